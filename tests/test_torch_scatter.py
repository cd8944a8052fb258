"""Scatters and indexed updates on the torch side (``scatter``, ``scatter_add``,
``scatter_reduce``, ``index_put``, ``index_add``, ``index_copy``; ``lowering.fx_scatter``), through
``torch.compile(backend="spyre")`` and on the eager ``spyre`` device, against torch eager on the
CPU, with no CPU fallback.

Tolerances are the oracle's (``spyre_jax.tools.testing.assert_close``) at ``k`` = the most terms
merged into one element (its own value and every duplicate update landing on it) and
``chain=2``: the card sums a row's updates in float32, rounds once to the dtype and rounds again
when it merges them into the row, where the CPU rounds after every term (``k`` roundings). A set
(plain scatter, index_copy, ``index_put`` without accumulate), max and min round nothing: those
use unique indices (torch leaves duplicates undefined) and compare within the same tolerance,
exactly in practice; integers compare exactly."""

from __future__ import annotations

import warnings

import pytest
import torch

from spyre_jax.tools.testing import assert_close
from torch_bridge import backend as tb
from torch_bridge import device as dev
from torch_bridge.errors import SpyreFallbackWarning

aten = torch.ops.aten
F32, F16, BF16, I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32


def _x(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == I32:
        return torch.randint(-6, 7, shape, generator=g, dtype=I32)
    return torch.randn(shape, generator=g).to(dtype)


def _dups(n: int, shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    """Indices in ``[0, n)`` with repeats (int64, as torch makes them)."""
    return torch.randint(0, n, shape, generator=torch.Generator().manual_seed(seed))


def _unique(shape: tuple[int, ...], dim: int, m: int, seed: int = 2) -> torch.Tensor:
    """An index of ``shape`` narrowed to ``m`` along ``dim``, unique along ``dim`` (a scatter
    without duplicates: each line's positions a permutation's first ``m``)."""
    r = torch.rand(shape, generator=torch.Generator().manual_seed(seed))
    return r.argsort(dim=dim).narrow(dim, 0, m)


def _near_one(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Factors for products: near 1 (no overflow), or small integers."""
    if dtype == I32:
        return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed), dtype=I32)
    return (1 + 0.25 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


# ---------------------------------------------------------------------------------------------
# the cases: name -> (fn, inputs for a dtype, k: the most terms merged into one element)

_IU = _unique((6, 9), 0, 4)  # unique along dim 0
_I3 = _unique((3, 4, 10), 2, 6, seed=3)  # unique along the last dim
_D2 = _dups(3, (5, 9))  # rows 0..2 of dim 0, many duplicates
_D3 = _dups(4, (3, 4, 7), seed=4)  # columns 0..3 of the last dim
_ROWS = torch.tensor([0, 2, 2, -1, 5, 2])  # index_put/index_add: duplicates and a negative
_COLS = torch.tensor([3, 0, 3, 1])  # index_add along dim 1 / -1: duplicates


def _iadd_rows(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[i] += v  # index, add, index_put (no accumulate): unique indices
    return y


def _set_apart(x: torch.Tensor, i: torch.Tensor, j: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[i, :, j] = v  # index tensors on dims apart: the broadcast dims come first
    return y


def _mask_set(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[x > 0] = 2  # a boolean mask set to one value: a select
    return y


CASES = {
    "scatter_src_dim0": (
        lambda x, i, s: torch.scatter(x, 0, i, s),
        lambda dt: (_x(dt, (6, 9)), _IU, _x(dt, (5, 10), 1)),
        1,
    ),
    "scatter_value_dim-1_3d": (
        lambda x, i: torch.scatter(x, -1, i, 3),
        lambda dt: (_x(dt, (3, 4, 10)), _I3),
        1,
    ),
    "scatter_inplace_dim1": (
        lambda x, i, s: x.clone().scatter_(1, i, s),
        lambda dt: (_x(dt, (4, 9)), _unique((4, 9), 1, 5), _x(dt, (4, 5), 1)),
        1,
    ),
    "scatter_add_dim0": (
        lambda x, i, s: torch.scatter_add(x, 0, i, s),
        lambda dt: (_x(dt, (6, 9)), _D2, _x(dt, (5, 9), 1)),
        6,
    ),
    "scatter_add_dim-1_3d": (
        lambda x, i, s: torch.scatter_add(x, -1, i, s),
        lambda dt: (_x(dt, (3, 4, 8)), _D3, _x(dt, (3, 4, 7), 1)),
        8,
    ),
    "scatter_reduce_arg_add": (
        lambda x, i, s: torch.scatter(x, 0, i, s, reduce="add"),
        lambda dt: (_x(dt, (6, 9)), _D2, _x(dt, (5, 9), 1)),
        6,
    ),
    "scatter_reduce_arg_multiply": (
        lambda x, i, s: torch.scatter(x, 0, i, s, reduce="multiply"),
        lambda dt: (_near_one(dt, (6, 9), 0), _D2, _near_one(dt, (5, 9), 1)),
        6,
    ),
    "scatter_value_reduce_add": (
        lambda x, i: torch.scatter(x, -1, i, 2, reduce="add"),
        lambda dt: (_x(dt, (3, 4, 8)), _D3),
        8,
    ),
    "index_put_accumulate": (
        lambda x, i, v: x.index_put((i,), v, accumulate=True),
        lambda dt: (_x(dt, (7, 9)), _ROWS, _x(dt, (6, 9), 1)),
        4,
    ),
    "index_put_inplace_accumulate": (
        lambda x, i, v: x.clone().index_put_((i,), v, accumulate=True),
        lambda dt: (_x(dt, (7, 9)), _ROWS, _x(dt, (1, 9), 1)),  # values broadcast
        4,
    ),
    "index_put_broadcast_indices": (  # [2, 1] and [3] broadcast to [2, 3], dims 1 and 2
        lambda x, i, j, v: aten.index_put(x, [None, i, j], v, True),
        lambda dt: (
            _x(dt, (3, 4, 5, 6)),
            torch.tensor([[1], [3]]),
            torch.tensor([0, 4, 0]),
            _x(dt, (3, 2, 3, 6), 1),
        ),
        3,
    ),
    "index_put_apart": (
        _set_apart,
        lambda dt: (
            _x(dt, (4, 5, 6)),
            torch.tensor([0, 3, -1]),
            torch.tensor([5, 1, 2]),
            _x(dt, (3, 5), 1),
        ),
        1,
    ),
    "index_put_apart_accumulate": (
        lambda x, i, j, v: aten.index_put(x, [i, None, j], v, True),
        lambda dt: (
            _x(dt, (4, 5, 6)),
            torch.tensor([0, 0, 3, 0]),
            torch.tensor([1, 1, 2, 1]),
            _x(dt, (4, 5), 1),
        ),
        4,
    ),
    "setitem_add": (
        _iadd_rows,
        lambda dt: (_x(dt, (7, 9)), torch.tensor([4, 0, -2]), _x(dt, (3, 9), 1)),
        2,
    ),
    "index_put_mask": (_mask_set, lambda dt: (_x(dt, (5, 9)),), 1),
    "index_add_dim0_alpha": (
        lambda x, i, v: x.index_add(0, i, v, alpha=2),
        lambda dt: (_x(dt, (7, 9)), _ROWS.abs(), _x(dt, (6, 9), 1)),
        4,
    ),
    "index_add_dim1_3d": (
        lambda x, i, v: x.index_add(1, i, v),
        lambda dt: (_x(dt, (2, 5, 6)), _COLS, _x(dt, (2, 4, 6), 1)),
        3,
    ),
    "index_add_dim-1": (
        lambda x, i, v: x.index_add(-1, i, v, alpha=-1),
        lambda dt: (_x(dt, (5, 4)), _COLS, _x(dt, (5, 4), 1)),
        3,
    ),
    "index_copy_dim0": (
        lambda x, i, v: x.index_copy(0, i, v),
        lambda dt: (_x(dt, (6, 9)), torch.tensor([5, 0, 3]), _x(dt, (3, 9), 1)),
        1,
    ),
    "index_copy_dim-1_3d": (
        lambda x, i, v: x.index_copy(-1, i, v),
        lambda dt: (_x(dt, (2, 3, 7)), torch.tensor([6, 2, 0, 4]), _x(dt, (2, 3, 4), 1)),
        1,
    ),
}

_REDUCES = ["sum", "prod", "mean", "amax", "amin"]
for _red in _REDUCES:
    for _self in (True, False):
        CASES[f"scatter_reduce_{_red}_{'self' if _self else 'noself'}"] = (
            lambda x, i, s, _r=_red, _s=_self: x.scatter_reduce(1, i, s, _r, include_self=_s),
            lambda dt, _r=_red: (
                (_near_one if _r == "prod" else _x)(dt, (3, 6, 4), 0),
                _dups(6, (3, 5, 4), seed=5),
                (_near_one if _r == "prod" else _x)(dt, (3, 5, 4), 1),
            ),
            6,
        )

#: the cases run in every dtype (the others in float32)
_EVERY_DTYPE = [
    "scatter_src_dim0",
    "scatter_add_dim-1_3d",
    "scatter_reduce_mean_noself",
    "scatter_reduce_amax_self",
    "scatter_reduce_prod_noself",
    "index_put_accumulate",
    "index_add_dim1_3d",
    "index_copy_dim-1_3d",
]


def _run_compiled(fn, *xs):
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # scatter(reduce=...) is deprecated
        got = torch.compile(fn, backend="spyre")(*xs)
    assert tb.fallback_stats() == {}, tb.fallback_stats()
    return got


def _run_eager(fn, *xs):
    dev.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("error", SpyreFallbackWarning)  # a CPU fallback warns
        got = fn(*(x.to("spyre") for x in xs))
    assert dev.eager_stats()["cpu_fallbacks"] == 0, dev.fallback_stats()
    assert got.device.type == "spyre"
    return got.cpu()


def _want(fn, *xs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn(*xs)


_PARAMS = [(n, F32) for n in sorted(CASES)] + [
    (n, dt) for n in _EVERY_DTYPE for dt in (F16, BF16, I32)
]


@pytest.mark.parametrize(("name", "dtype"), _PARAMS, ids=[f"{n}-{d}" for n, d in _PARAMS])
def test_compiled_against_cpu(name, dtype):
    fn, inputs, k = CASES[name]
    xs = inputs(dtype)
    assert_close(_run_compiled(fn, *xs), _want(fn, *xs), k=k, chain=2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_device_against_cpu(name):
    fn, inputs, k = CASES[name]
    xs = inputs(F32)
    assert_close(_run_eager(fn, *xs), _want(fn, *xs), k=k, chain=2)


@pytest.mark.parametrize("dtype", [F16, BF16, I32])
def test_eager_device_other_dtypes(dtype):
    for name in ("scatter_add_dim0", "scatter_reduce_mean_self", "index_put_accumulate"):
        fn, inputs, k = CASES[name]
        xs = inputs(dtype)
        assert_close(_run_eager(fn, *xs), _want(fn, *xs), k=k, chain=2, err_msg=name)


def test_integer_mean_rounds_down():
    # torch divides an integer mean rounding toward -inf: (-5 + -2) / 2 -> -4, (5 + 2) / 2 -> 3
    x = torch.tensor([-5, 5, 1, -7], dtype=I32)
    i = torch.tensor([0, 1, 3, 3, 3])
    s = torch.tensor([-2, 2, 1, 1, 1], dtype=I32)
    for inc in (True, False):
        fn = lambda a, j, u, inc=inc: a.scatter_reduce(0, j, u, "mean", include_self=inc)  # noqa: E731
        want = fn(x, i, s)
        assert torch.equal(_run_compiled(fn, x, i, s), want)
        assert torch.equal(_run_eager(fn, x, i, s), want)


def test_duplicates_sum_every_update():
    # 40 updates onto one element: each counts (the card sums them all, not the last one)
    x = torch.zeros(3, 5)
    i = torch.zeros(40, 5, dtype=torch.long)
    s = torch.ones(40, 5)
    got = _run_compiled(lambda a, j, u: torch.scatter_add(a, 0, j, u), x, i, s)
    assert torch.equal(got[0], torch.full((5,), 40.0)) and torch.equal(got[1:], x[1:])
    got = _run_eager(lambda a, j, u: a.index_add(0, j[:, 0], u), x, i, s)
    assert torch.equal(got[0], torch.full((5,), 40.0))


@pytest.mark.parametrize(
    ("dtype", "pos"), [(F32, [4, 5, 6]), (F16, [0, 15, -2]), (BF16, [9]), (F16, [3, 4])]
)
def test_kv_cache_update_unchanged(dtype, pos):
    # the form the one-dim index_put rule (formerly in lowering.fx_tensor) was written for: a
    # static KV cache's update at cache_position; moved, not computed: bit for bit
    cache = _x(dtype, (1, 2, 16, 64))
    v = _x(dtype, (1, 2, len(pos), 64), 1)
    idx = torch.tensor(pos)

    def put(c, i, x):
        return aten.index_put.default(c, [None, None, i], x) * 1

    want = put(cache, idx, v)
    assert torch.equal(_run_compiled(put, cache, idx, v), want)
    if min(pos) >= 0:

        def copy(c, i, x):
            c = c.clone()
            c.index_copy_(2, i, x)
            return c

        assert torch.equal(_run_compiled(copy, cache, idx, v), want)
        assert torch.equal(_run_eager(copy, cache, idx, v), want)


def test_index_put_rule_is_this_modules():
    # one rule per op (the narrower index_put rule fx_tensor had is gone)
    from lowering.from_fx import RULES

    for op in (aten.index_put.default, aten._index_put_impl.default, aten.scatter_reduce.two):
        assert RULES[op].__module__ == "lowering.fx_scatter"


def _fallback_ok(fn, *xs):
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", SpyreFallbackWarning)
        got = torch.compile(fn, backend="spyre")(*xs)
    assert_close(got, fn(*xs))
    return tb.fallback_stats()


def test_mask_with_a_value_per_element_runs_on_the_card():
    # x[mask] = v with one value per masked element: the j-th true position takes v[j] (its
    # running count of the mask, gathered on the card)
    x = _x(F32, (4, 6))
    n = int((x > 0).sum())
    v = torch.arange(float(n))
    fn = lambda a, u: aten.index_put(a, [a > 0], u)  # noqa: E731
    assert_close(_run_compiled(fn, x, v), fn(x, v))
    assert_close(_run_eager(fn, x, v), fn(x, v))


def test_a_match_past_the_bound_runs_on_the_cpu():
    # 64 x 256 elements each matched against 64 x 256 updates (2**28): past the card's bound
    x, s = _x(F32, (64, 256)), _x(F32, (64, 256), 1)
    i = _dups(256, (64, 256))
    fb = _fallback_ok(lambda a, j, u: torch.scatter_add(a, 1, j, u), x, i, s)
    assert fb == {"aten.scatter_add.default": 1}


@pytest.mark.parametrize(
    ("shape", "dim", "index"),
    [
        ((1, 500), 1, "perm"),  # top-p sampling's scatter of a sorted vocabulary
        ((3, 300), 1, "perm"),
        ((300, 3), 0, "perm"),
        ((2, 400), 1, "dups"),  # duplicates: the last in index order, as torch's CPU
        ((2, 3, 200), 2, "dups"),
        ((4, 130), 1, "short"),  # fewer updates than positions: the rest keep their own
    ],
)
@pytest.mark.parametrize("dtype", [F32, F16, torch.bool])
def test_the_sorted_path_of_a_large_set_scatter(shape, dim, index, dtype):
    """A set scatter past _SORTED_FROM takes two sorts per row instead of the match (O(n log n),
    not O(n^2)): against torch on both paths."""
    n = shape[dim]
    if index == "perm":
        i = _unique(shape, dim, n)
    elif index == "dups":
        i = _dups(n, shape)
    else:
        i = _unique(shape, dim, n // 2)
    x, s = _x(F32, shape) > 0, _x(F32, tuple(i.shape), 1) > 0
    if dtype != torch.bool:
        x, s = _x(dtype, shape), _x(dtype, tuple(i.shape), 1)

    def fn(a, j, u):  # noqa: ANN001, ANN202
        return a.scatter(dim, j, u)

    want = fn(x, i, s)
    assert torch.equal(_run_compiled(fn, x, i, s), want)
    assert torch.equal(_run_eager(fn, x, i, s), want)


def test_a_vocabulary_sized_set_scatter_runs_on_the_card():
    # [1, 50257]: 2.5e9 elements to match; sorted, it is two sorts of 100514
    x = _x(F32, (1, 50257))
    i = _unique((1, 50257), 1, 50257)
    s = _x(F32, (1, 50257), 1) > 0
    fn = lambda a, j, u: a.masked_fill(torch.zeros_like(u).scatter(1, j, u), 0.0)  # noqa: E731
    assert torch.equal(_run_compiled(fn, x, i, s), fn(x, i, s))
