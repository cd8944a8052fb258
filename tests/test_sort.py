"""Sorting and selection on the card (issue 31): sort, argsort, top-k, k-th value, gathers along a
dim, on both frontends, against ``jax.jit`` on the CPU and torch eager; the card program against
the NumPy reference; the timing model's charge for the compare-exchange passes; bad input.

Sorting rounds nothing, so every comparison is exact (values and indices)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import spyre_jax
from device_model import sorting
from device_model.program import build_runner
from device_model.reference import run_kernel_reference
from device_model.runtime import to_device_layout
from device_model.sorting import compare_exchanges, order_keys
from lowering.errors import TilingError

F16, BF16, F32 = np.float16, jnp.bfloat16, np.float32


def _arr(shape, dtype=F32, seed=0, nans=0, ties=False):
    r = np.random.default_rng(seed)
    x = r.standard_normal(shape).astype(np.float32)
    if ties:
        x = np.round(x * 2) / 2  # few distinct values: many ties
    flat = x.reshape(-1)
    if nans:
        at = r.choice(flat.size, nans, replace=False)
        flat[at[::2]] = np.nan
        flat[at[1::2]] = -np.nan
    return x.astype(dtype)


def _same(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        if g.dtype.kind == "f" or g.dtype == BF16:
            g, w = g.astype(np.float32), w.astype(np.float32)
            # the same bits, NaNs aside (a sort moves them, whatever their payload)
            assert np.array_equal(g, w, equal_nan=True)
            assert np.array_equal(np.signbit(g[~np.isnan(g)]), np.signbit(w[~np.isnan(w)]))
        else:
            np.testing.assert_array_equal(g, w)


def _jax_same(f, *xs):
    _same(spyre_jax.jit(f)(*xs), jax.jit(f)(*xs))


# ---------------------------------------------------------------------------------------------
# JAX


@pytest.mark.parametrize("dtype", [F16, BF16, F32, np.int32])
def test_jax_sort_and_argsort_every_dtype(dtype):
    x = _arr((6, 45), dtype, seed=1, nans=6 if dtype != np.int32 else 0, ties=True)
    if dtype == np.int32:
        x = (np.random.default_rng(2).integers(-9, 9, (6, 45))).astype(np.int32)
    _jax_same(lambda a: (jnp.sort(a), jnp.argsort(a)), x)
    _jax_same(lambda a: (jnp.sort(a, descending=True), jnp.argsort(a, descending=True)), x)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_jax_sort_along_any_axis(axis):
    x = _arr((5, 7, 19), seed=axis + 3, nans=4, ties=True)
    _jax_same(lambda a: (jnp.sort(a, axis=axis), jnp.argsort(a, axis=axis, stable=True)), x)


def test_jax_sort_orders_nan_last_and_zeros_equal():
    x = np.array([[1.0, np.nan, -0.0, 0.0, 3.0, -np.nan, 1.0, -np.inf, np.inf, 0.0, -0.0]], F32)
    _jax_same(lambda a: (jnp.sort(a), jnp.argsort(a), jnp.argsort(a, descending=True)), x)


def test_jax_top_k_total_order_and_ties():
    x = np.array([[1.0, np.nan, -0.0, 0.0, 3.0, -np.nan, 1.0, -np.inf, np.inf, 3.0]], F32)
    _jax_same(lambda a: lax.top_k(a, 10), x)
    y = _arr((3, 8, 300), F16, seed=4, nans=10, ties=True)
    _jax_same(lambda a: lax.top_k(a, 7), y)
    _jax_same(lambda a: lax.top_k(a, 1), y)


def test_jax_multi_operand_and_multi_key_sort():
    k1 = np.random.default_rng(5).integers(0, 3, (4, 33)).astype(np.int32)
    k2 = _arr((4, 33), F32, seed=6, ties=True)
    v = _arr((4, 33), F16, seed=7)
    _jax_same(lambda a, b, c: lax.sort((a, b, c), num_keys=2), k1, k2, v)
    _jax_same(lambda a, b: lax.sort((a, b), num_keys=1, dimension=0), k2, v)
    _jax_same(lambda a, b: lax.sort_key_val(a, b), k2, k1)


def test_jax_sort_of_bool_scalar_and_one_element():
    m = np.random.default_rng(8).random((3, 20)) > 0.5
    _jax_same(lambda a: (jnp.sort(a), jnp.argsort(a)), m)
    _jax_same(lambda a: jnp.sort(a, axis=None), np.float32(3.0))
    _jax_same(lambda a: (jnp.sort(a), jnp.argsort(a), lax.top_k(a, 1)), np.ones((4, 1), F32))


def test_jax_take_along_axis_and_sampling_pieces():
    x = _arr((4, 50), F32, seed=9)
    i = np.random.default_rng(10).integers(0, 50, (4, 12)).astype(np.int32)
    _jax_same(lambda a, j: jnp.take_along_axis(a, j, axis=1), x, i)

    def top_p(logits):  # the nucleus filter of a sampling loop
        srt = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
        cut = jnp.take_along_axis(srt, jnp.argmax(cum > 0.9, axis=-1)[:, None], axis=-1)
        return jnp.where(logits < cut, -jnp.inf, logits)

    got, want = spyre_jax.jit(top_p)(x), jax.jit(top_p)(x)
    np.testing.assert_array_equal(np.isinf(np.asarray(got)), np.isinf(np.asarray(want)))


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 40),
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "int32"]),
)
def test_jax_sort_property(rows, n, k, seed, dtype):
    k = min(k, n)
    r = np.random.default_rng(seed)
    if dtype == "int32":
        x = r.integers(-5, 5, (rows, n)).astype(np.int32)
    else:
        x = _arr((rows, n), jnp.dtype(dtype), seed=seed, nans=min(3, rows * n), ties=True)
    _jax_same(lambda a: (jnp.sort(a), jnp.argsort(a), lax.top_k(a, k)), x)


# ---------------------------------------------------------------------------------------------
# the card program against the NumPy reference; the timing model


def _run_both(f, *xs):
    low = spyre_jax.jit(f).lower(*xs)
    k = low.kernel
    decls = {t.name: t for t in k.tensors}
    hosts = [np.asarray(x) for x in xs] + [a for _, a in k.consts]
    pairs = zip(k.inputs, hosts, strict=True)
    args = [np.asarray(to_device_layout(h, decls[n].layout)) for n, h in pairs]
    vec = [np.asarray(o) for o in build_runner(k)(*args)]
    ref = run_kernel_reference(k, args)
    return k, vec, ref


def test_reference_agrees_with_the_card_program():
    x = _arr((70, 130), F16, seed=11, nans=8, ties=True)
    k, vec, ref = _run_both(lambda a: (jnp.sort(a), lax.top_k(a, 9)), x)
    assert {s.kind for s in k.stages} >= {"sort", "take"}
    for v, r in zip(vec, ref, strict=True):
        np.testing.assert_array_equal(v.view(np.uint8), r.view(np.uint8))


def test_sort_is_costed_as_compare_exchange_passes():
    def stage_us(n, f):
        x = _arr((64, n), F32, seed=12)
        cost = spyre_jax.jit(f).lower(x).compile().cost_analysis()
        st_ = [s for s in cost["stages"] if s["kind"] == "sort"]
        assert len(st_) == 1 and st_[0]["unit"] == "SFU" and st_[0]["compute_s"] > 0
        return st_[0]["compute_s"]

    # a full sort: n/2 log n (log n + 1)/2 compare-exchanges per row
    t1, t2 = stage_us(1024, jnp.argsort), stage_us(4096, jnp.argsort)
    assert t2 / t1 == pytest.approx(compare_exchanges(4096, 4096) / compare_exchanges(1024, 1024))
    # a top-k of few is cheaper than the full sort (bitonic top-k)
    tk = stage_us(4096, lambda a: lax.top_k(a, 8)[1])
    assert tk < t2 / 3
    assert compare_exchanges(4096, 4096) == 2048 * 12 * 13 // 2


def test_order_keys_reverse_ints_exactly():
    x = np.array([np.iinfo(np.int32).min, -1, 0, 1, np.iinfo(np.int32).max], np.int32)
    (d,) = order_keys(np, x, "nan_last", True)
    assert list(np.argsort(d, kind="stable")) == [4, 3, 2, 1, 0]


@pytest.mark.parametrize("n", [7, 500, sorting.NATIVE_SORT_MAX_ROW + 3])
@pytest.mark.parametrize("order", sorting.ORDERS)
@pytest.mark.parametrize("descending", [False, True])
def test_simulator_sorts_agree_with_lexsort(n, order, descending):
    """The simulated program sorts a short row with XLA's stable sort and a long one with
    NumPy's lexsort called back: both give NumPy's stable order (ties, NaNs of either sign,
    -0.0 == 0.0), on one key and on two."""
    x = _arr((3, n), seed=n, nans=4, ties=True)
    x.reshape(-1)[:3] = [-0.0, 0.0, -0.0]
    y = np.random.default_rng(1).integers(-3, 3, (3, n)).astype(np.int32)
    for keys in ([x], [y, x]):
        want = sorting.argsort_rows(np, keys, order, descending, n - 2)
        got = jax.jit(lambda *ks: sorting.argsort_rows(jnp, list(ks), order, descending, n - 2))(
            *keys
        )
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_row_longer_than_the_scratchpad_is_a_tiling_error():
    x = jax.ShapeDtypeStruct((2, 1 << 19), np.float32)
    with pytest.raises(TilingError, match=r"sort .*rows of 524288.*scratchpad") as e:
        spyre_jax.jit(lambda a: jnp.sort(a)).lower(x)
    assert "test_sort.py" in str(e.value)


# ---------------------------------------------------------------------------------------------
# torch: both paths


def _torch_cases():
    idx = torch.randint(0, 37, (4, 10), generator=torch.Generator().manual_seed(0))
    idx[0, 0] = -3  # torch.gather's negative index counts from the end
    return {
        "sort": lambda x: torch.sort(x, stable=True),
        "sort_desc_dim0": lambda x: torch.sort(x, dim=0, descending=True, stable=True),
        "sort_default": lambda x: torch.sort(x)[0],
        "argsort": lambda x: torch.argsort(x, dim=-1, stable=True),
        "argsort_desc": lambda x: torch.argsort(x, descending=True, stable=True),
        "topk": lambda x: torch.topk(x, 5),
        "topk_smallest_dim0": lambda x: torch.topk(x, 3, dim=0, largest=False),
        "kthvalue": lambda x: torch.kthvalue(x, 4, dim=1),
        "kthvalue_keepdim": lambda x: torch.kthvalue(x, 2, dim=0, keepdim=True),
        "msort": lambda x: torch.msort(x),
        "gather": lambda x: torch.gather(x, 1, idx.abs().to(x.device)),
        "gather_small": lambda x: torch.gather(x[:, :20], 0, idx[:3, :5].abs().to(x.device) % 4),
        "take_along_dim": lambda x: torch.take_along_dim(x, idx.abs().to(x.device), dim=1),
    }


def _tensor(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 37, generator=g)
    x = torch.round(x * 2) / 2  # ties
    x[0, 3], x[2, 7] = float("nan"), -float("nan")
    return x.to(dtype)


#: ops whose CPU kernel orders ties as its quickselect leaves them (unspecified): the card gives
#: the first of equal values; checked by the values, and the indices pointing at them
_TIES_UNSPECIFIED = {"topk", "topk_smallest_dim0", "kthvalue", "kthvalue_keepdim"}


def _torch_same(got, want, x=None, dim=-1):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    if x is not None:  # (values, indices): the values exactly, each index at its value
        (gv, gi), (wv, _) = got, want
        gv, gi = gv.cpu(), gi.cpu()
        _torch_same(gv, wv)
        if gi.dim() < x.dim():  # keepdim=False
            gi, gv = gi.unsqueeze(dim), gv.unsqueeze(dim)
        at = torch.gather(x, dim, gi)
        assert torch.equal(at.isnan(), gv.isnan())
        assert torch.equal(torch.nan_to_num(at), torch.nan_to_num(gv))
        return
    for g, w in zip(got, want, strict=True):
        g = g.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(
            torch.nan_to_num(g), torch.nan_to_num(w)
        ), (g, w)


@pytest.mark.parametrize("name", sorted(_torch_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_compile_sorts(name, dtype):
    f = _torch_cases()[name]
    x = _tensor(dtype)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(f, backend="spyre")(x)
    _check_torch(name, got, f(x), x)


def _check_torch(name, got, want, x):
    if name in _TIES_UNSPECIFIED:
        _torch_same(got, want, x, dim=0 if "dim0" in name or "keepdim" in name else 1)
    else:
        _torch_same(got, want)


@pytest.mark.parametrize("name", sorted(_torch_cases()))
def test_torch_device_sorts_without_fallback(name):
    from torch_bridge import device as dev

    f = _torch_cases()[name]
    x = _tensor(torch.float32)
    dev.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU fallback warns
        got = f(x.to("spyre"))
    _check_torch(name, got, f(x), x)
    assert dev.eager_stats()["cpu_fallbacks"] == 0


def test_torch_int_sort_and_topk():
    x = torch.randint(-20, 20, (3, 50), generator=torch.Generator().manual_seed(3))
    for name, f in (
        ("sort", lambda a: torch.sort(a, stable=True)),
        ("topk", lambda a: torch.topk(a, 6)),
    ):
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(f, backend="spyre")(x)
        _check_torch(name, got, f(x), x)
