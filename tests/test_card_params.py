"""Every ``CardSpec`` figure the compiler uses comes from the card it compiles for.

At the lowering level (no ``spyre_jax`` runtime): graphs from ``lowering.from_jaxpr`` are
compiled with ``lowering.pipeline.compile_graph(graph, card)`` for cards with other stick sizes,
scratchpads and core counts; each kernel passes ``check_kernel``, records the card's figures,
lays every tensor out in the card's sticks, and computes what NumPy computes on both the
vectorized card (``device_model.program.build_runner``) and the reference interpreter
(``device_model.reference``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from device_model.card import DEFAULT_CARD, CardSpec
from device_model.kernel import Kernel, ScheduleError, check_kernel
from device_model.layout import DTYPES, TensorLayout, layout_for, np_dtype
from device_model.program import build_runner
from device_model.reference import run_kernel_reference
from device_model.timing import kernel_cost
from device_model.trace import chrome_trace
from lowering.from_jaxpr import from_jaxpr
from lowering.passes import is_free_reshape
from lowering.pipeline import compile_graph
from spyre_jax.tools.testing import assert_close

F16, BF16, F32, I32 = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32),
                       np.dtype(np.int32))  # fmt: skip

CARDS = {
    "stick64": CardSpec(stick_bytes=64),
    "stick256": CardSpec(stick_bytes=256),
    "sp256k": CardSpec(scratchpad_bytes=256 * 1024),
    "cores8": CardSpec(num_cores=8),
    "stick32_cores3": CardSpec(stick_bytes=32, num_cores=3, scratchpad_bytes=128 * 1024),
}


def _softmax_np(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _layernorm_np(x: np.ndarray) -> np.ndarray:
    m = x.mean(axis=-1, keepdims=True)
    v = ((x - m) ** 2).mean(axis=-1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-5)


def _layernorm(x: jax.Array) -> jax.Array:
    m = jnp.mean(x, axis=-1, keepdims=True)
    v = jnp.mean((x - m) ** 2, axis=-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5)


#: name -> (jax function, NumPy function, input (shape, dtype)s, tolerance; 0: exact)
#: name -> (jax fn, numpy reference (float64), input specs, (k, chain) of the oracle's tolerance
#: for the output's dtype (spyre_jax.tools.testing), or None: exact)
CASES: dict[
    str,
    tuple[Callable, Callable, list[tuple[tuple[int, ...], np.dtype]], tuple[int, int] | None],
] = {
    "elementwise": (
        lambda x, y: jnp.tanh(x) * y + 1.0,
        lambda x, y: np.tanh(x) * y + 1.0,
        [((37, 150), F32), ((37, 150), F32)],
        (1, 1),
    ),
    "elementwise_f16_bcast": (
        lambda x, b: jnp.maximum(x * 2.0 + b, 0.0),
        lambda x, b: np.maximum(x * 2.0 + b, 0.0),
        [((3, 33, 70), F16), ((70,), F16)],
        (1, 2),
    ),
    "matmul": (
        lambda a, b: a @ b,
        lambda a, b: a @ b,
        [((65, 100), F32), ((100, 72), F32)],
        (100, 1),
    ),
    "matmul_f16_batched": (
        lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b),
        lambda a, b: np.einsum("bmk,bkn->bmn", a, b),
        [((3, 40, 96), F16), ((3, 96, 50), F16)],
        (96, 1),
    ),
    "softmax": (
        lambda x: jax.nn.softmax(x, axis=-1),
        _softmax_np,
        [((48, 300), F32)],
        (1, 1),
    ),
    "layernorm_bf16": (_layernorm, _layernorm_np, [((20, 130), BF16)], (1, 3)),
    "column_sum": (
        lambda x: jnp.sum(x, axis=0),
        lambda x: x.sum(axis=0),
        [((90, 77), F32)],
        (90, 1),
    ),
    "transpose": (lambda x: x.T, lambda x: x.T, [((70, 130), F32)], None),
    "transpose3d": (
        lambda x: jnp.transpose(x, (1, 0, 2)) * 3.0,
        lambda x: np.transpose(x, (1, 0, 2)) * 3.0,
        [((5, 66, 40), F16)],
        None,
    ),
    "concatenate": (
        lambda x, y: jnp.concatenate([x, y], axis=1),
        lambda x, y: np.concatenate([x, y], axis=1),
        [((24, 50), F32), ((24, 77), F32)],
        None,
    ),
    "concatenate_rows": (
        lambda x, y: jnp.concatenate([x, y], axis=0),
        lambda x, y: np.concatenate([x, y], axis=0),
        [((10, 70), F16), ((13, 70), F16)],
        None,
    ),
    "reshape": (
        lambda x: x.reshape(60, 50) + 1.0,
        lambda x: x.reshape(60, 50) + 1.0,
        [((30, 100), F32)],
        None,
    ),
    "embedding": (
        lambda t, i: jnp.take(t, i, axis=0),
        lambda t, i: t[i],
        [((50, 100), F32), ((9,), I32)],
        None,
    ),
}


def _inputs(specs: list[tuple[tuple[int, ...], np.dtype]], seed: int) -> list[np.ndarray]:
    r = np.random.default_rng(seed)
    out = []
    for shape, dt in specs:
        if dt == I32:
            out.append(r.integers(0, 50, shape).astype(np.int32))
        else:
            out.append(r.standard_normal(shape).astype(dt))
    return out


def _to_device(host: np.ndarray, lay: TensorLayout) -> np.ndarray:
    """Host values -> the padded device array of ``lay`` (padding zero-filled)."""
    a = np.asarray(host).astype(np_dtype(lay.dtype))
    if not lay.shape:
        a = a.reshape(1)
    pad = lay.device_shape[-1] - a.shape[-1]
    return np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) if pad else a


def _logical(buf: np.ndarray, lay: TensorLayout) -> np.ndarray:
    return np.asarray(buf)[..., : lay.shape[-1]] if lay.shape else np.asarray(buf)[0]


def _compile(name: str, card: CardSpec) -> tuple[Kernel, list[np.ndarray], Callable]:
    f, ref, specs, _ = CASES[name]
    xs = _inputs(specs, seed=sum(map(ord, name)))
    g = from_jaxpr(jax.make_jaxpr(f)(*xs), name=name)
    return compile_graph(g, card, check=True), xs, ref


def _assert_kernel_is_for(k: Kernel, card: CardSpec) -> None:
    check_kernel(k)
    assert (k.num_cores, k.stick_bytes, k.sp_capacity, k.dl16) == (
        card.num_cores,
        card.stick_bytes,
        card.scratchpad_usable_bytes,
        card.dl16_rounding,
    )
    for t in k.tensors:
        lay = t.layout
        assert lay.stick_bytes == card.stick_bytes, t
        eps = card.stick_bytes // DTYPES[lay.dtype]
        assert lay.elems_per_stick == eps and lay.device_shape[-1] % eps == 0, t
        assert lay.nbytes % card.stick_bytes == 0, t
    for s in k.stages:
        assert s.sp_peak_bytes <= card.scratchpad_usable_bytes, s.name
        for b in s.scratch:
            assert b.offset % card.stick_bytes == 0 and b.slot_bytes % card.stick_bytes == 0
        for t in range(s.steps):
            assert len(s.stores[t]) == card.num_cores
            assert all(len(row) == card.num_cores for row in s.loads[t])
    cost = kernel_cost(k, card)
    assert 1 <= cost["cores_used"] <= card.num_cores
    assert cost["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes


def _run_and_compare(
    k: Kernel, xs: list[np.ndarray], ref: Callable, tol: tuple[int, int] | None
) -> None:
    decls = {t.name: t.layout for t in k.tensors}
    hosts = [*xs, *(arr for _, arr in k.consts)]
    args = [_to_device(h, decls[n]) for n, h in zip(k.inputs, hosts, strict=True)]
    want = ref(*(x.astype(np.float64) if x.dtype.kind == "f" else x for x in xs))
    (vec,) = build_runner(k)(*args)
    (rfr,) = run_kernel_reference(k, args)
    lay = decls[k.outputs[0]]
    for what, buf in (("vectorized", vec), ("reference", rfr)):
        assert np.asarray(buf).shape == lay.device_shape, what
        got = _logical(buf, lay)
        assert got.shape == want.shape, (what, got.shape, want.shape)
        if tol is None:
            np.testing.assert_array_equal(
                got.astype(np.float64), np.asarray(want, np_dtype(lay.dtype)).astype(np.float64)
            )
        else:
            # the reference is float64: the tolerance is the output dtype's
            assert_close(
                got,
                want,
                k=tol[0],
                chain=tol[1],
                dtype=lay.dtype,
                check_dtype=False,
                err_msg=f"{k.name}: {what}",
            )


@pytest.mark.parametrize("card_name", list(CARDS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_kernel_follows_the_card(case, card_name):
    card = CARDS[card_name]
    k, xs, ref = _compile(case, card)
    _assert_kernel_is_for(k, card)
    _run_and_compare(k, xs, ref, CASES[case][3])


def test_stick_size_changes_the_layouts():
    """The same graph on two stick sizes: padding to 64- vs 256-byte sticks."""
    k64, _, _ = _compile("elementwise", CARDS["stick64"])
    k256, _, _ = _compile("elementwise", CARDS["stick256"])
    out64 = k64.tensor(k64.outputs[0]).layout
    out256 = k256.tensor(k256.outputs[0]).layout
    assert out64.device_shape == (37, 160) and out256.device_shape == (37, 192)  # 150 fp32


def test_free_reshape_depends_on_the_stick():
    # (4, 16) -> (64,) fp32: free with 64-byte sticks (16 elements fill a stick exactly), not
    # with 128-byte ones (each row of 16 pads to 32)
    assert is_free_reshape((4, 16), (64,), "float32", 64)
    assert not is_free_reshape((4, 16), (64,), "float32", 128)


def test_core_count_changes_the_tables():
    k8, _, _ = _compile("matmul", CARDS["cores8"])
    k32, _, _ = _compile("matmul", DEFAULT_CARD)
    assert {len(row) for s in k8.stages for row in s.stores} == {8}
    assert {len(row) for s in k32.stages for row in s.stores} == {32}


def test_checker_rejects_a_kernel_for_another_card():
    k, _, _ = _compile("elementwise", CARDS["stick64"])
    with pytest.raises(ScheduleError, match="sticks"):
        check_kernel(dataclasses.replace(k, stick_bytes=128))
    with pytest.raises(ScheduleError, match="one entry per core"):
        check_kernel(dataclasses.replace(k, num_cores=16))
    small = CARDS["stick64"].replace(scratchpad_bytes=1024)
    big = max(s.sp_peak_bytes for s in k.stages)
    assert big > small.scratchpad_usable_bytes
    with pytest.raises(ScheduleError, match="exceeds usable"):
        check_kernel(dataclasses.replace(k, sp_capacity=small.scratchpad_usable_bytes))
    with pytest.raises(ValueError, match="scheduled for"):
        kernel_cost(k, DEFAULT_CARD)


def test_no_silent_default_card():
    with pytest.raises(TypeError):
        layout_for((4, 4), "float32")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Kernel("k", (), (), (), ())  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="whole number"):
        layout_for((4, 4), "float32", 6)
    assert chrome_trace([])["otherData"]["num_cores"] == DEFAULT_CARD.num_cores


def test_dl16_rounding_is_recorded():
    card = DEFAULT_CARD.replace(dl16_rounding=True)
    k, _, _ = _compile("elementwise_f16_bcast", card)
    assert k.dl16 and math.prod(k.tensor(k.outputs[0]).layout.shape) > 0
