"""The tiler never gives up on a legal shape: a sweep over every op kind of the graph IR.

Each op runs on a small card (16 KiB scratchpad, 4 cores: about 12.75 KiB usable per core) on
arrays whose rows (the long dim: a row, a reduced axis, a matmul's K, a concatenation, a
transposed dim) are 1x, 4x, 16x and 64x the usable scratchpad, so that no block holds a whole
row. Every case must schedule (no ``TilingError``), keep each stage's
scratchpad plan within the usable scratchpad and match NumPy; at 1x the vectorized card is also
checked against the NumPy reference interpreter of the schedule (``device_model.reference``),
which runs the same stages step by step. The counts of cases run and of cases that raised are
printed at the end (``pytest -s`` shows them). A shape that cannot hold one stick per buffer
still raises, with the usable scratchpad in the message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_reference import _assert_same, _device_args

import spyre_jax
from device_model.reference import run_kernel_reference
from spyre_jax import TilingError
from spyre_jax.tools.testing import assert_tree_close, tolerance

#: the sweep's card: small, so the arrays stay small and the test fast
CARD = dict(scratchpad_bytes=16 * 1024, num_cores=4)
SCALES = (1, 4, 16, 64)
#: cases run, cases that raised (TilingError or anything else), over the module
COUNTS = {"run": 0, "raised": 0}

F16, F32, I32 = np.float16, np.float32, np.int32


def _rand(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# name -> maker(row_bytes) -> (jax fn, inputs, numpy fn, rtol). ``row_bytes``: the bytes of one
# row, the scale times the usable scratchpad; the row lengths are odd on purpose (ragged last
# blocks, stick padding).
Case = tuple[Callable[..., Any], tuple[np.ndarray, ...], Callable[..., Any], float]
# the oracle's one-op tolerances (spyre_jax.tools.testing): against a float64 / fp32 NumPy
# reference the card's fp32 sums (k = 1: both accumulate at fp32 or better) and its one rounding
# to fp16 differ by less
F16_TOL, F32_TOL = tolerance(F16)[0], tolerance(F32)[0]


def _elementwise(nb: int) -> Case:
    n = nb // 2 + 5
    a, b = _rand((2, n), F16, 1), _rand((2, n), F16, 2)
    return (
        lambda x, y: jnp.tanh(x) * y + 1,
        (a, b),
        lambda x, y: np.tanh(x.astype(F32)) * y.astype(F32) + 1,
        tolerance(F16, chain=2)[0],
    )


def _convert(nb: int) -> Case:
    # one rounding of exact values: half an fp16 ulp (2^-11), tighter than the oracle's table
    return (lambda x: x.astype(jnp.float16), (_rand((2, nb // 4 + 7), F32, 3),), lambda x: x, 1e-3)


def _broadcast(nb: int) -> Case:
    a, b = _rand((3, 1), F32, 4), _rand((1, nb // 4 + 3), F32, 5)
    # the same two fp32 ops as NumPy's: a few fp32 ulps, tighter than the oracle's table
    return (lambda x, y: x * y - y, (a, b), lambda x, y: x * y - y, 1e-6)


def _transpose(nb: int) -> Case:
    x = _rand((9, nb // 4 + 5), F32, 6)  # rows of x become the columns of the result
    return (lambda v: v.T, (x,), lambda v: v.T, 0.0)


def _slice(nb: int) -> Case:
    x = _rand((3, nb // 4 + 41), F32, 7)
    return (
        lambda v: (v[1:, 37:-3], v[:, 5::3], v[2]),
        (x,),
        lambda v: (v[1:, 37:-3], v[:, 5::3], v[2]),
        0.0,
    )


def _reshape(nb: int) -> Case:
    k = max(1, nb // 2 // 100)
    x = _rand((2, 100 * k), F16, 8)  # (2, 100k) -> (2k, 100): a re-layout, not a free view
    return (lambda v: v.reshape(2 * k, 100) * 2, (x,), lambda v: v.reshape(2 * k, 100) * 2, 0.0)


def _concatenate(nb: int) -> Case:
    a, b = _rand((2, nb // 4 + 3), F16, 9), _rand((2, nb // 4 + 5), F16, 10)
    return (
        lambda x, y: jnp.concatenate([x, y], axis=-1),
        (a, b),
        lambda x, y: np.concatenate([x, y], axis=-1),
        0.0,
    )


def _sum_last(nb: int) -> Case:
    x = _rand((3, nb // 4 + 7), F32, 11)
    return (
        lambda v: jnp.sum(v, axis=-1),
        (x,),
        lambda v: v.sum(axis=-1, dtype=np.float64),
        F32_TOL,
    )


def _sum_first(nb: int) -> Case:
    x = _rand((nb // 4 // 40 + 7, 40), F32, 12)  # each column holds the scale's bytes
    return (lambda v: jnp.sum(v, axis=0), (x,), lambda v: v.sum(axis=0, dtype=np.float64), F32_TOL)


def _max(nb: int) -> Case:
    x = _rand((3, nb // 2 + 7), F16, 13)
    return (lambda v: jnp.max(v, axis=-1), (x,), lambda v: v.max(axis=-1), 0.0)


def _argmax(nb: int) -> Case:
    x = _rand((3, nb // 4 + 7), F32, 14)
    return (lambda v: jnp.argmax(v, axis=-1), (x,), lambda v: v.argmax(axis=-1), 0.0)


def _cumsum(nb: int) -> Case:
    x = _rand((2, nb // 4 + 7), F32, 15)
    return (
        lambda v: jnp.cumsum(v, axis=-1),
        (x,),
        lambda v: np.cumsum(v.astype(np.float64), axis=-1),
        F32_TOL,
    )


def _matmul(nb: int) -> Case:
    k = nb // 2 + 3  # K: one row of the lhs holds the scale's bytes
    a, b = _rand((4, k), F16, 17), _rand((k, 40), F16, 18)
    return (
        lambda x, y: x @ y,
        (a, b),
        lambda x, y: x.astype(F32) @ y.astype(F32),
        F16_TOL,
    )


def _gather(nb: int) -> Case:
    t = _rand((64, nb // 4 + 5), F32, 19)  # table rows of the scale's bytes
    idx = np.random.default_rng(20).integers(0, 64, (9,)).astype(I32)
    return (lambda tab, i: tab[i], (t, idx), lambda tab, i: tab[i], 0.0)


KINDS: dict[str, Callable[[int], Case]] = {
    "elementwise": _elementwise,
    "convert": _convert,
    "broadcast": _broadcast,
    "transpose": _transpose,
    "slice": _slice,
    "reshape": _reshape,
    "concatenate": _concatenate,
    "reduce_sum_last": _sum_last,
    "reduce_sum_first": _sum_first,
    "reduce_max": _max,
    "reduce_argmax": _argmax,
    "cumsum": _cumsum,
    "matmul": _matmul,
    "gather": _gather,
}


def _compare(got: Any, want: Any, rtol: float) -> None:
    """The card's result against the NumPy reference (float32/float64: the dtypes may differ),
    with the oracle of ``spyre_jax.tools.testing`` at the case's ``rtol`` (= atol relative to the
    output's magnitude); exact for integers, and for floats at ``rtol=0``."""
    assert_tree_close(got, want, rtol=rtol, atol=rtol, check_dtype=False)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.slow
def test_sweep(small_card, kind, scale):
    card = small_card(**CARD)
    f, xs, ref, rtol = KINDS[kind](scale * card.scratchpad_usable_bytes)
    COUNTS["run"] += 1
    jf = spyre_jax.jit(f)
    try:
        low = jf.lower(*xs)
        compiled = low.compile()
        got = jf(*xs)
    except Exception:
        COUNTS["raised"] += 1
        raise
    assert compiled.cost_analysis()["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes
    _compare(got, ref(*xs), rtol)
    if scale == 1:  # the NumPy reference interpreter runs the same schedule
        k = low.kernel
        args = _device_args(low, xs)
        # the card program the call above ran (already compiled)
        vec = [np.asarray(o) for o in compiled.executable.runner()(*args)]
        for name, v, r in zip(k.outputs, vec, run_kernel_reference(k, args), strict=True):
            _assert_same(v, r, f"{kind}: output {name}")


def test_general_schedules_match_the_reference(small_card):
    """The general schedules' special paths in one kernel, on the vectorized card and the NumPy
    reference interpreter, against NumPy: concatenation windows at offsets that are not
    stick-aligned, a strided slice from an unaligned start, a reversed cumsum and an argmax
    (with a NaN and ties) split across steps, a sum over two long axes (one axis at a time), a
    matmul whose K the blocks do not divide, a re-layout splitting its rows, reductions over an
    empty axis and a concatenation with an empty input."""
    card = small_card(**CARD)
    n = card.scratchpad_usable_bytes  # elements: 2-4x the usable bytes per row
    a, b = _rand((2, 37), F16, 30), _rand((2, n + 1), F16, 31)
    c = _rand((3, 2 * n + 9), F16, 32)
    d = _rand((2, n // 2 + 3), F32, 33)
    e = _rand((2, n // 2 + 3), F32, 34)
    e[1, 100], e[1, n // 2] = np.nan, np.nan
    e[0, 5] = e[0, n // 3] = 50.0  # a tie: the first index wins
    g = _rand((n // 64 + 5, 3, 67), F32, 35)
    h, k = _rand((5, n // 4 + 11), F32, 36), _rand((n // 4 + 11, 7), F32, 37)
    m = _rand((2, 100 * (n // 100)), F16, 38)
    z, y = np.zeros((0, 6), F32), _rand((3, 6), F32, 39)

    def f(a, b, c, d, e, g, h, k, m, z, y):
        return (
            jnp.concatenate([a, b, a], axis=-1),
            c[1:, 7::3],
            lax_cumsum_rev(d),
            jnp.argmax(e, axis=-1),
            jnp.sum(g, axis=(0, 2)),
            h @ k,
            m.reshape(2, -1, 100) * 2,
            jnp.sum(z, axis=0),
            jnp.max(z, axis=0, initial=-jnp.inf),
            jnp.concatenate([z, y], axis=0),
        )

    def ref(a, b, c, d, e, g, h, k, m, z, y):
        return (
            np.concatenate([a, b, a], axis=-1),
            c[1:, 7::3],
            np.flip(np.cumsum(np.flip(d.astype(np.float64), -1), -1), -1),
            np.argmax(e, axis=-1),
            g.sum(axis=(0, 2), dtype=np.float64),
            h.astype(np.float64) @ k,
            m.reshape(2, -1, 100) * 2,
            np.zeros(6, F32),
            np.full(6, -np.inf, F32),
            np.concatenate([z, y], axis=0),
        )

    xs = (a, b, c, d, e, g, h, k, m, z, y)
    jf = spyre_jax.jit(f)
    low = jf.lower(*xs)
    compiled = low.compile()
    assert compiled.cost_analysis()["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes
    kern = low.kernel
    assert any(op.windowed for st in kern.stages for op in st.inputs)  # windows
    assert any(st.kind == "map" and st.reduce_axis >= 0 for st in kern.stages)  # split
    assert any(st.kind == "matmul" and st.grid[3] > 1 for st in kern.stages)  # split K
    _compare(jf(*xs), ref(*xs), F32_TOL)
    args = _device_args(low, xs)
    vec = [np.asarray(o) for o in compiled.executable.runner()(*args)]
    for name, v, r in zip(kern.outputs, vec, run_kernel_reference(kern, args), strict=True):
        _assert_same(v, r, f"output {name}")


def lax_cumsum_rev(x: Any) -> Any:
    return jax.lax.cumsum(x, axis=x.ndim - 1, reverse=True)


@pytest.mark.parametrize(
    "f,x",
    [
        (lambda v: jnp.sum(v, axis=-1), np.ones((4, 100000), F16)),
        (lambda v: v.T * 2, np.ones((300, 70), F32)),
    ],
    ids=["sum", "transpose"],
)
@pytest.mark.slow
def test_not_even_one_stick_per_buffer_raises(small_card, f, x):
    """A card whose usable scratchpad is one stick cannot hold a block of an input and one of
    the output: TilingError naming the usable scratchpad and what the smallest tiling needs."""
    card = small_card(scratchpad_bytes=256)
    assert card.scratchpad_usable_bytes == card.stick_bytes
    with pytest.raises(TilingError, match="scratchpad") as ei:
        spyre_jax.jit(f)(x)
    msg = str(ei.value)
    assert f"{card.scratchpad_usable_bytes} B per core" in msg and "needs" in msg


def test_sweep_counts():
    """The sweep's counts (run after it; ``pytest -s`` shows the line)."""
    print(
        f"\ntiling sweep: {COUNTS['run']} cases run, {COUNTS['raised']} raised "
        f"({len(KINDS)} op kinds x scales {SCALES} of the usable scratchpad, "
        f"card {CARD})"
    )
    assert COUNTS["raised"] == 0
