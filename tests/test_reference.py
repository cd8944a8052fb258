"""The vectorized card model against the per-core NumPy reference interpreter of the schedule IR.

Each case lowers a small function with ``spyre_jax.jit(f).lower(*xs)``, builds the kernel's input
device buffers the way ``Compiled._run`` does (host arrays padded into the stick layout, constants
appended), and runs the kernel twice: on the vectorized JAX executor
(``device_model.program.build_runner``) and on ``device_model.reference``. The two must agree on
the whole device buffers (stick padding included): bitwise for integer and bool tensors; for float
tensors to within the differences that two fp32 summation orders leave after rounding to the
output dtype (about one ulp of the dtype). The logical result is also checked against
``jax.jit(f)`` on the host CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import spyre_jax
from device_model.kernel import Kernel, Stage
from device_model.program import build_runner
from device_model.reference import (
    Scratchpad,
    block_slices,
    reference_runner,
    run_kernel_reference,
)
from device_model.runtime import to_device_layout
from spyre_jax.tools.testing import assert_close, tolerance

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)


def _arr(shape: tuple[int, ...], dtype: Any, seed: int = 0, kind: str = "normal") -> np.ndarray:
    r = np.random.default_rng(seed)
    if kind == "int":
        return r.integers(-50, 50, shape).astype(dtype)
    if kind == "pos":
        return r.uniform(0.25, 4.0, shape).astype(dtype)
    return r.standard_normal(shape).astype(dtype)


def _device_args(low: spyre_jax.Lowered, xs: tuple[Any, ...]) -> list[np.ndarray]:
    """The kernel's input device buffers, as ``Compiled._run`` builds them."""
    k = low.kernel
    decls = {t.name: t for t in k.tensors}
    # the traced leaves of the arguments, flattened as ``Jitted._split`` does
    leaves = [
        x
        for x in jax.tree_util.tree_leaves((xs, {}))
        if isinstance(x, np.ndarray | np.generic | jax.Array)
    ]
    assert len(leaves) == len(low.graph.inputs)
    hosts = [np.asarray(x) for x in leaves] + [arr for _, arr in low.kernel.consts]
    assert len(hosts) == len(k.inputs)
    return [
        np.asarray(to_device_layout(h, decls[n].layout))
        for n, h in zip(k.inputs, hosts, strict=True)
    ]


def _logical(buf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Device buffer -> logical values (as ``Array.__array__``)."""
    return buf[..., : shape[-1]] if shape else buf[0]


def _assert_same(vec: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Vectorized vs reference: bitwise for integers and bool; for floats the oracle's one-op
    tolerance (both compute in fp32 and round once to the output dtype; only the order of fp32
    sums differs, which moves a result by about one ulp where the fp32 values straddle a rounding
    boundary), with atol a tenth of it: where a sum cancelled, its rounding error is an ulp of
    the terms, not of the result, so a tenth of the tolerance at the output's scale."""
    rtol, _ = tolerance(vec.dtype)
    assert_close(vec, ref, atol=0.1 * rtol, err_msg=what)


def _check(
    f: Any, *xs: Any, k: int = 1, chain: int = 1, min_ring: int = 0, host: bool = True
) -> tuple[Kernel, list[np.ndarray]]:
    """Lower ``f``, run vectorized and reference, compare both with each other and (``host``)
    with jax on the CPU."""
    low = spyre_jax.jit(f).lower(*xs)
    kern = low.kernel
    args = _device_args(low, xs)
    vec = [np.asarray(o) for o in build_runner(kern)(*args)]
    ref = run_kernel_reference(kern, args)
    decls = {t.name: t for t in kern.tensors}
    assert len(vec) == len(ref) == len(kern.outputs)
    for name, v, r in zip(kern.outputs, vec, ref, strict=True):
        assert v.shape == decls[name].layout.device_shape
        _assert_same(v, r, f"kernel {kern.name} output {name}")
    assert _ring_transfers(kern) >= min_ring
    if not host:
        return kern, ref
    want = jax.tree_util.tree_leaves(eqx.filter_jit(f)(*xs))
    assert len(want) == len(ref)
    for name, r, w in zip(kern.outputs, ref, want, strict=True):
        got = _logical(r, decls[name].layout.shape)
        assert_close(got, w, k=k, chain=chain, err_msg=f"output {name} against the host")
    return kern, ref


def _ring_transfers(k: Kernel) -> int:
    return sum(int((np.asarray(s.ring) >= 0).sum()) for s in k.stages)


def _ring_varies(s: Stage) -> bool:
    r = np.asarray(s.ring)
    return bool(len(r) > 1 and (r != r[:1]).any())


# ---------------------------------------------------------------------------------------------
# the reference's own machinery


def test_scratchpad_uninitialized_reads():
    k = spyre_jax.jit(lambda a: a * 2).lower(np.ones((4, 64), np.float16)).kernel
    sp = Scratchpad(k.stages[0])
    assert np.isnan(sp.read("in0", 0).astype(np.float32)).all()
    assert sp.mem.size == k.stages[0].sp_peak_bytes
    with pytest.raises(IndexError):
        sp.read("in0", 5)


def test_block_slices_out_of_range_raises():
    assert block_slices((4, 128), (2, 64), 3) == (slice(2, 4), slice(64, 128))
    with pytest.raises(IndexError):
        block_slices((4, 128), (2, 64), 4)


def test_unloaded_input_reads_nan_in_both():
    """A schedule that forgets a load computes on uninitialized scratchpad: NaN in both."""
    x = _arr((4, 64), F16, seed=1)
    low = spyre_jax.jit(lambda a: a + 1).lower(x)
    k = low.kernel
    (st0,) = k.stages
    loads = tuple(tuple(tuple(-1 for _ in row) for row in step) for step in st0.loads)
    broken = dataclasses.replace(k, stages=(dataclasses.replace(st0, loads=loads),))
    args = _device_args(low, (x,))
    vec = np.asarray(build_runner(broken)(*args)[0]).astype(np.float32)
    ref = reference_runner(broken)(*args)[0].astype(np.float32)
    assert np.isnan(ref[:, :64]).all() and np.isnan(vec[:, :64]).all()


# ---------------------------------------------------------------------------------------------
# elementwise, broadcasting, reductions


@pytest.mark.parametrize("n", [1, 63, 65, 100, 150])
def test_elementwise_odd_shapes(n):
    dtype = [F16, BF16, F32][n % 3]
    x, y = _arr((n, n), dtype, seed=n), _arr((n, n), dtype, seed=n + 1)
    _check(lambda a, b: jnp.tanh(a) * b + jnp.exp(-a * a), x, y, chain=3)


def test_special_functions():
    # the reference computes them with SciPy, the card program with XLA's approximations
    x = np.abs(_arr((63, 100), F32, seed=5)) + 0.25
    _check(lambda a: (lax.lgamma(a), lax.digamma(a), lax.bessel_i0e(a)), x)
    _check(lambda a: lax.erf_inv(jnp.tanh(a) * 0.9) + lax.nextafter(a, a + 1), x)


def test_elementwise_int_and_bool():
    x, y = _arr((63, 100), np.int32, 2, "int"), _arr((63, 100), np.int32, 3, "int")
    _check(lambda a, b: (a * 3 - b // 7, a > b, jnp.where(a > b, a, b % 5)), x, y)
    m = _arr((63, 100), F16, seed=4) > 0
    _check(lambda p, a, b: (jnp.where(p, a, b), ~p | (a < 0)), m, x, y)


@pytest.mark.parametrize(
    "shapes",
    [((63, 1), (1, 150)), ((150,), (65, 150)), ((2, 1, 100), (1, 63, 1))],
    ids=["col_row", "row_mat", "3d"],
)
def test_broadcasting(shapes):
    xs = [_arr(s, F16, seed=10 + i) for i, s in enumerate(shapes)]
    _check(lambda a, b: a * b - a, *xs, chain=2)


@pytest.mark.parametrize("red", ["sum", "max"])
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("shape", [(63, 100), (65, 150)])
def test_reductions(red, axis, shape):
    x = _arr(shape, F16 if shape[0] == 63 else F32, seed=20)
    fn = jnp.sum if red == "sum" else jnp.max
    _check(lambda a: fn(a, axis=axis), x, k=shape[axis])


def test_scalar_and_cumsum():
    x = _arr((63, 100), F32, seed=23)
    _check(lambda a, s: jnp.cumsum(a * s, axis=-1), x, np.float32(1.5), k=100)
    _check(lambda a: jnp.cumsum(a, axis=0) + jnp.arange(100, dtype=a.dtype), x, k=63)


def test_argmax_bitwise():
    x = _arr((65, 100), F32, seed=21)
    _check(lambda a: (jnp.argmax(a, axis=-1), jnp.argmin(a, axis=0)), x)


def test_softmax():
    x = _arr((63, 150), F16, seed=22) * 3
    _check(lambda a: jax.nn.softmax(a, axis=-1), x, chain=3)


def _row_reduction_ops(k: Kernel) -> list[str]:
    from device_model.ops import ROW_REDUCTIONS

    return [
        op[0]
        for st in k.stages
        if st.kind == "map"
        for op in st.step.body.program
        if op[0] in ROW_REDUCTIONS
    ]


def _ln(a: Any) -> Any:
    m = jnp.mean(a, axis=-1, keepdims=True)
    return (a - m) * jax.lax.rsqrt(jnp.var(a, axis=-1, keepdims=True) + 1e-5)


def _rms(a: Any) -> Any:
    return a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize(
    "case",
    ["softmax_3d", "log_softmax_axis0", "layernorm", "rmsnorm", "center_two_axes"],
)
def test_fused_row_programs(case):
    """Softmax, layernorm and RMSNorm fused into one map with in-program reductions."""
    if case == "softmax_3d":
        f, x, k, chain = (lambda a: jax.nn.softmax(a, axis=-1)), _arr((2, 3, 65), F16, 80), 1, 3
    elif case == "log_softmax_axis0":
        f, x, k, chain = (lambda a: jax.nn.log_softmax(a, axis=0)), _arr((100, 65), F32, 81), 1, 3
    elif case == "layernorm":
        f, x, k, chain = _ln, _arr((65, 150), BF16, 82), 150, 2
    elif case == "rmsnorm":
        f, x, k, chain = _rms, _arr((63, 100), F32, 83), 100, 2
    else:
        f, x, k, chain = (
            (lambda a: a - jnp.mean(a, axis=(0, 2), keepdims=True)),
            _arr((3, 5, 65), F16, 84),
            195,
            2,
        )
    kern, _ = _check(f, x * 3, k=k, chain=chain)
    assert len(kern.stages) == 1 and _row_reduction_ops(kern)


@pytest.mark.slow
def test_fused_softmax_multistep_and_fallback(small_card):
    """A fused softmax over several double-buffered steps; rows too long for the scratchpad go
    through the unfused stages."""
    small_card(scratchpad_bytes=32 * 1024)
    x = _arr((256, 1000), F16, seed=85) * 3
    kern, _ = _check(lambda a: jax.nn.softmax(a, axis=-1), x, chain=3)
    (st0,) = kern.stages
    assert st0.steps > 1 and _row_reduction_ops(kern)
    y = _arr((64, 4096), F16, seed=86) * 3
    kern, _ = _check(lambda a: jax.nn.softmax(a, axis=-1), y, chain=3)
    assert len(kern.stages) > 1 and not _row_reduction_ops(kern)


# ---------------------------------------------------------------------------------------------
# matmul


@pytest.mark.parametrize(
    "mkn",
    [(256, 512, 384), (64, 2048, 64), (40 * 32, 64, 64)],
    ids=["256x512x384", "64x2048x64", "1280x64x64"],
)
def test_matmul_ring(mkn):
    m, kk, n = mkn
    a, b = _arr((m, kk), F16, seed=30), _arr((kk, n), F16, seed=31)
    k, _ = _check(lambda x, y: x @ y, a, b, k=kk)
    (st0,) = k.stages
    assert st0.kind == "matmul"


def test_matmul_batched():
    a, b = _arr((4, 64, 128), F32, seed=32), _arr((4, 128, 96), F32, seed=33)
    _check(lambda x, y: x @ y, a, b, k=128)


def test_matmul_mixed_padding():
    """fp16 operands, fp32 result: N pads to 192 in the rhs but 160 in the output."""
    a, b = _arr((63, 100), F16, seed=38), _arr((100, 150), F16, seed=39)
    _check(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32), a, b, k=100)


def test_matmul_bf16_with_epilogue():
    a, b = _arr((65, 128), BF16, seed=40), _arr((128, 64), BF16, seed=41)
    _check(lambda x, y: jax.nn.gelu(x @ y), a, b, k=128, chain=3)


@pytest.mark.parametrize(
    "shapes,varies",
    [
        (((128, 256), (256, 128)), False),  # K split over 4 unrolled steps, double-buffered
        (((80, 128), (128, 320)), True),  # the ring table changes from step to step
        (((5, 64, 128), (5, 128, 192)), True),  # ... and more steps than are unrolled (a scan)
    ],
    ids=["128x256x128", "80x128x320", "5x64x128x192"],
)
@pytest.mark.slow
def test_matmul_tiny_scratchpad(small_card, shapes, varies):
    small_card(scratchpad_bytes=32 * 1024)
    a, b = _arr(shapes[0], F16, seed=34), _arr(shapes[1], F16, seed=35)
    k, _ = _check(lambda x, y: x @ y, a, b, k=shapes[0][-1], min_ring=1)
    (st0,) = k.stages
    assert st0.grid[3] > 1 and st0.steps > 1
    assert _ring_varies(st0) == varies


@pytest.mark.slow
def test_tiny_scratchpad_maps(small_card):
    small_card(scratchpad_bytes=16 * 1024)
    x = _arr((256, 1000), F16, seed=36)
    k, _ = _check(lambda a: jnp.tanh(a) * 2, x, chain=2)
    assert k.stages[0].steps > 4  # a lax.scan in the vectorized executor
    # a long-row reduction through a one-per-stick temp, then a packing stage
    k, _ = _check(lambda a: jnp.sum(a, axis=-1), x, k=1000)
    assert len(k.stages) > 1 and k.stages[0].steps > 1
    y = _arr((8, 4000), F16, seed=37) * 3
    _check(lambda a: jax.nn.softmax(a, axis=-1), y, chain=3)


@pytest.mark.slow
def test_dl16_rounding(small_card):
    """``CardSpec(dl16_rounding=True)``: fp16/bf16 stores of map and matmul results round
    through DL16 (9 fraction bits; overflow to inf above ~8.6e9) in both executors."""
    x, w = _arr((63, 128), F16, seed=70), _arr((128, 100), F16, seed=71)
    f = lambda a, b: (jnp.tanh(a) * 3 + 1, a @ b)
    _, plain = _check(f, x, w, k=128)
    small_card(dl16_rounding=True)
    k, dl16 = _check(f, x, w, k=128, chain=2)
    assert k.dl16
    for p, d in zip(plain, dl16, strict=True):
        assert not np.array_equal(p, d)  # the switch changes the stored bits
    big = _arr((65, 100), BF16, seed=72) * 1e5
    _, (sq,) = _check(lambda a: a * a * a, big, host=False)
    assert np.isinf(sq.astype(np.float32)).any()  # beyond DL16's range


# ---------------------------------------------------------------------------------------------
# data movement


@pytest.mark.parametrize(
    "shape,perm", [((63, 100), (1, 0)), ((2, 65, 63), (2, 0, 1)), ((3, 5, 64), (0, 2, 1))]
)
def test_transpose(shape, perm):
    _check(lambda a: jnp.transpose(a, perm), _arr(shape, F16, seed=40))


def test_concatenate():
    xs = [_arr((10, 63), F16, seed=41), _arr((10, 65), F16, seed=42)]
    _check(lambda a, b: jnp.concatenate([a, b], axis=1), *xs)
    ys = [_arr((63, 100), F32, seed=43), _arr((2, 100), F32, seed=44)]
    _check(lambda a, b: jnp.concatenate([a, b], axis=0), *ys)


def test_slicing():
    x = _arr((65, 150), F16, seed=45)
    _check(lambda a: (a[3:40, 7:100], a[::2, 1::3], a[-1]), x)


def test_reshape():
    x = _arr((6, 100), F16, seed=46)
    _check(lambda a: a.reshape(20, 30) * 2, x)


def test_embedding_lookup():
    t = _arr((50, 100), F16, seed=47)
    idx = np.random.default_rng(48).integers(0, 50, (37,)).astype(np.int32)
    _check(lambda a, i: jnp.take(a, i, axis=0), t, idx)


def test_embedding_lookup_fill_out_of_range():
    t = _arr((50, 100), F32, seed=49)
    idx = np.array([0, 3, 50, 1000, 49, -51], np.int32)
    _, (ref,) = _check(lambda a, i: jnp.take(a, i, axis=0), t, idx)
    assert np.isnan(ref[[2, 3, 5], :100]).all()


# ---------------------------------------------------------------------------------------------
# the work division is data: moving tiles to other cores must not change the result


def _permute_cores(s: Stage, rng: np.random.Generator) -> Stage:
    """The same stage with its tiles dealt to other cores: a fresh permutation for every group of
    steps that accumulates one output block (so each accumulator stays on one core). Ring
    tables then change from step to step and tiles land on the high cores."""
    ncores = len(s.stores[0])
    perm = rng.permutation(ncores)
    loads, ring, stores = [], [], []
    for t in range(s.steps):
        if s.first[t]:
            perm = rng.permutation(ncores)
        lrows, rrows = [], []
        for i in range(len(s.inputs)):
            lrow, rrow = [-1] * ncores, [-1] * ncores
            for c in range(ncores):
                lrow[perm[c]] = s.loads[t][i][c]
                src = s.ring[t][i][c]
                rrow[perm[c]] = int(perm[src]) if src >= 0 else -1
            lrows.append(tuple(lrow))
            rrows.append(tuple(rrow))
        srow = [-1] * ncores
        for c in range(ncores):
            srow[perm[c]] = s.stores[t][c]
        loads.append(tuple(lrows))
        ring.append(tuple(rrows))
        stores.append(tuple(srow))
    return dataclasses.replace(s, loads=tuple(loads), ring=tuple(ring), stores=tuple(stores))


@pytest.mark.parametrize(
    "case",
    ["broadcast", "matmul_ksplit", "gather"],
)
@pytest.mark.slow
def test_cores_permuted(small_card, case):
    small_card(scratchpad_bytes=32 * 1024)
    if case == "broadcast":
        f, xs = (lambda a, b: a * b - a), (_arr((63, 1), F16, 60), _arr((1, 150), F16, 61))
    elif case == "matmul_ksplit":
        f, xs = (lambda a, b: a @ b), (_arr((5, 64, 128), F16, 62), _arr((5, 128, 192), F16, 63))
    else:
        idx = np.random.default_rng(64).integers(0, 50, (37,)).astype(np.int32)
        f, xs = (lambda a, i: jnp.take(a, i, axis=0)), (_arr((50, 100), F16, 65), idx)
    low = spyre_jax.jit(f).lower(*xs)
    args = _device_args(low, xs)
    base = run_kernel_reference(low.kernel, args)
    for seed in range(2):
        rng = np.random.default_rng(seed)
        k = low.kernel
        moved = dataclasses.replace(k, stages=tuple(_permute_cores(s, rng) for s in k.stages))
        vec = [np.asarray(o) for o in build_runner(moved)(*args)]
        ref = run_kernel_reference(moved, args)
        for v, r, b in zip(vec, ref, base, strict=True):
            # each core computes alone in the reference: the same bytes, wherever it runs
            np.testing.assert_array_equal(r.view(np.uint8), b.view(np.uint8))
            _assert_same(v, r, f"{case}, cores permuted (seed {seed})")


# ---------------------------------------------------------------------------------------------
# a model


def test_equinox_mlp():
    mlp = eqx.nn.MLP(64, 32, 96, 2, activation=jax.nn.relu, key=jax.random.PRNGKey(0))
    x = _arr((8, 64), F32, seed=50)
    _check(lambda m, a: jax.vmap(m)(a), mlp, x, k=96, chain=3)


# ---------------------------------------------------------------------------------------------
# property


@st.composite
def _shapes_and_axis(draw: Any) -> tuple[tuple[int, ...], int, Any]:
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 70)) for _ in range(rank))
    axis = draw(st.integers(-1, rank - 1))
    dtype = draw(st.sampled_from([F16, F32]))
    return shape, axis, dtype


@settings(max_examples=6, deadline=None)
@given(_shapes_and_axis(), st.integers(0, 2**31 - 1))
def test_property_elementwise_reduce(sa, seed):
    shape, axis, dtype = sa
    x, y = _arr(shape, dtype, seed=seed), _arr(shape, dtype, seed=seed + 1)

    def f(a, b):
        t = jnp.tanh(a) * b + 0.5
        return jnp.sum(t, axis=axis), jnp.max(t * t, axis=axis)

    _check(f, x, y, k=shape[axis], chain=2)
