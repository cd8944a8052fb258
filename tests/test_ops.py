"""Per-op tables (JAX lax-test style): ops x shapes x dtypes, each ``spyre_jax.jit(f)(*xs)``
against ``jax.jit(f)(*xs)`` on CPU, plus the IR checkers, tiling under a small scratchpad and
one hypothesis property."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import rng as _rng
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import spyre_jax
from device_model.kernel import check_kernel
from lowering.from_jaxpr import from_jaxpr
from lowering.graph import check_graph
from lowering.pipeline import compile_graph
from spyre_jax import CardSpec
from spyre_jax.tools.testing import assert_tree_close

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
FLOATS = [F16, BF16, F32]
FLOAT_IDS = ["f16", "bf16", "f32"]


def _arr(shape, dtype, kind: str = "normal", seed: int = 0) -> np.ndarray:
    r = _rng(seed)
    shape = tuple(shape)
    if kind == "normal":
        x = r.standard_normal(shape)
    elif kind == "pos":  # strictly positive, away from 0 (log, rsqrt, pow base)
        x = r.uniform(0.25, 4.0, shape)
    elif kind == "nonzero":  # |x| in [0.5, 2] (denominators)
        x = r.uniform(0.5, 2.0, shape) * r.choice([-1.0, 1.0], shape)
    elif kind == "unit":  # inside (-1, 1): arcsin, arctanh; tan away from its poles
        x = r.uniform(-0.95, 0.95, shape)
    elif kind == "ge1":  # arccosh's domain
        x = r.uniform(1.0, 4.0, shape)
    elif kind == "small":  # exponents of pow
        x = r.uniform(-2.0, 2.0, shape)
    elif kind == "int":
        x = r.integers(-50, 50, shape)
    elif kind == "coarse":  # few distinct values, so == comparisons hit both ways
        x = r.integers(-3, 4, shape) * 0.5
    else:  # pragma: no cover
        raise ValueError(kind)
    return np.asarray(x).astype(dtype)


def _check(f, *xs, rtol=None, atol=None, k: int = 1, chain: int = 1):
    """Run ``f`` on the simulated card and with jax.jit on CPU and compare (the oracle of
    ``spyre_jax.tools.testing``: ``k`` = reduction length, ``chain`` = rounded ops in a row on
    the CPU side that the card computes in fp32 with a single rounding: gelu, softmax...)."""
    got = spyre_jax.jit(f)(*xs)
    want = jax.jit(f)(*xs)
    assert_tree_close(got, want, k=k, chain=chain, rtol=rtol, atol=atol)
    return got


def _xfail(reason: str):
    return pytest.mark.xfail(reason=reason, strict=True)


# ---------------------------------------------------------------------------------------------
# unary

UNARY = {
    "neg": (lambda x: -x, "normal", 1),
    "abs": (jnp.abs, "normal", 1),
    "exp": (jnp.exp, "normal", 1),
    "log": (jnp.log, "pos", 1),
    "tanh": (jnp.tanh, "normal", 1),
    "logistic": (jax.nn.sigmoid, "normal", 1),
    "erf_scipy": (jax.scipy.special.erf, "normal", 1),
    "erf_lax": (lax.erf, "normal", 1),
    "erfc_lax": (lax.erfc, "normal", 1),
    "rsqrt": (lax.rsqrt, "pos", 1),
    "sqrt": (jnp.sqrt, "pos", 1),
    "square": (jnp.square, "normal", 1),
    "integer_pow3": (lambda x: x**3, "normal", 1),
    "gelu_tanh": (lambda x: jax.nn.gelu(x, approximate=True), "normal", 3),
    "gelu_exact": (lambda x: jax.nn.gelu(x, approximate=False), "normal", 3),
    "silu": (jax.nn.silu, "normal", 2),
    "relu": (jax.nn.relu, "normal", 1),
    "sin": (jnp.sin, "normal", 1),
    "cos": (jnp.cos, "normal", 1),
    "floor": (jnp.floor, "normal", 1),
    "tan": (jnp.tan, "unit", 1),
    "arcsin": (jnp.arcsin, "unit", 1),
    "arccos": (jnp.arccos, "unit", 1),
    "arctan": (jnp.arctan, "normal", 1),
    "sinh": (jnp.sinh, "normal", 1),
    "cosh": (jnp.cosh, "normal", 1),
    "arcsinh": (jnp.arcsinh, "normal", 1),
    "arccosh": (jnp.arccosh, "ge1", 1),
    "arctanh": (jnp.arctanh, "unit", 1),
    "cbrt": (jnp.cbrt, "normal", 1),
    "lgamma": (lax.lgamma, "pos", 1),
    "digamma": (lax.digamma, "pos", 1),
    "erf_inv": (lax.erf_inv, "unit", 1),
    "bessel_i0e": (lax.bessel_i0e, "normal", 1),
    "bessel_i1e": (jax.scipy.special.i1e, "normal", 1),
    "nextafter": (lambda x: lax.nextafter(x, x + 1), "normal", 1),
}

_UNARY_XFAIL: dict[str, str] = {}
_UNARY_BF16 = {"exp", "log", "tanh", "logistic", "rsqrt", "gelu_tanh", "gelu_exact"}


def _unary_params():
    out = []
    for name in UNARY:
        for dt, did in zip(FLOATS, FLOAT_IDS, strict=True):
            if dt == BF16 and name not in _UNARY_BF16 | set(_UNARY_XFAIL):
                continue
            marks = [_xfail(_UNARY_XFAIL[name])] if name in _UNARY_XFAIL else []
            out.append(pytest.param(name, dt, id=f"{name}-{did}", marks=marks))
    return out


@pytest.mark.parametrize("name,dtype", _unary_params())
@pytest.mark.slow
def test_unary(name, dtype):
    f, kind, chain = UNARY[name]
    _check(f, _arr((65, 100), dtype, kind, seed=1), chain=chain)


SHAPES = [(), (1,), (63,), (65,), (64, 128), (100, 150), (2, 63, 65), (1, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", ["tanh"])
def test_unary_shapes(name, shape):
    f, kind, chain = UNARY[name]
    _check(f, _arr(shape, F16, kind, seed=2), chain=chain)


# ---------------------------------------------------------------------------------------------
# binary

BINARY = {
    "add": (lambda x, y: x + y, "normal", "normal"),
    "sub": (lambda x, y: x - y, "normal", "normal"),
    "mul": (lambda x, y: x * y, "normal", "normal"),
    "div": (lambda x, y: x / y, "normal", "nonzero"),
    "max": (jnp.maximum, "normal", "normal"),
    "min": (jnp.minimum, "normal", "normal"),
    "pow": (lambda x, y: x**y, "pos", "small"),
    "eq": (lambda x, y: x == y, "coarse", "coarse"),
    "lt": (lambda x, y: x < y, "coarse", "coarse"),
    "ge": (lambda x, y: x >= y, "coarse", "coarse"),
    "where": (lambda x, y: jnp.where(x > y, x, y), "normal", "normal"),
    "select": (lambda x, y: lax.select(x < y, x * 2, y), "normal", "normal"),
}


_BINARY_BF16 = {"sub", "div", "pow", "lt"}


@pytest.mark.parametrize(
    "name,dtype",
    [
        pytest.param(n, dt, id=f"{n}-{i}")
        for n in BINARY
        for dt, i in zip(FLOATS, FLOAT_IDS, strict=True)
        if dt != BF16 or n in _BINARY_BF16
    ],
)
@pytest.mark.slow
def test_binary(name, dtype):
    f, k1, k2 = BINARY[name]
    x = _arr((63, 130), dtype, k1, seed=3)
    y = _arr((63, 130), dtype, k2, seed=4)
    _check(f, x, y)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_binary_shapes(shape):
    f, k1, k2 = BINARY["mul"]
    _check(f, _arr(shape, F32, k1, seed=5), _arr(shape, F32, k2, seed=6))


def test_binary_int32():
    x = _arr((10, 70), np.int32, "int", seed=7)
    y = _arr((10, 70), np.int32, "int", seed=8)
    _check(lambda a, b: (a + b, a * b, a - b, jnp.maximum(a, b), a < b), x, y)


# ---------------------------------------------------------------------------------------------
# broadcasting and scalar literals

BROADCAST = {
    "plus_row": (lambda x, r: x + r, (100, 150), (150,)),
    "times_col": (lambda x, c: x * c, (100, 150), (100, 1)),
    "col_plus_row": (lambda c, r: c + r, (63, 1), (1, 65)),
    "3d_plus_row": (lambda x, r: x - r, (2, 63, 65), (65,)),
    "3d_times_mid": (lambda x, m: x * m, (2, 63, 65), (63, 1)),
    "scalar_arg": (lambda x, s: x * s + 1.0, (63, 100), ()),
}


@pytest.mark.parametrize("name", list(BROADCAST))
def test_broadcast(name):
    dtype = [F16, F32][list(BROADCAST).index(name) % 2]
    f, s1, s2 = BROADCAST[name]
    _check(f, _arr(s1, dtype, seed=9), _arr(s2, dtype, seed=10))


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_scalar_literals(dtype):
    x = _arr((65, 100), dtype, seed=11)
    _check(lambda a: 2.0 * a - 0.5 + a / 3.0, x, chain=2)
    _check(lambda a: jnp.maximum(a, 0.25) * 1.5, x)


def test_broadcast_in_dim_explicit():
    x = _arr((63,), F16, seed=12)
    _check(lambda a: jnp.broadcast_to(a[:, None], (63, 100)) + 1, x)
    _check(lambda a: jnp.broadcast_to(a, (3, 5, 63)), x)


# ---------------------------------------------------------------------------------------------
# convert_element_type

CONV_DTYPES = {
    "f16": F16,
    "bf16": BF16,
    "f32": F32,
    "i32": np.dtype(np.int32),
    "bool": np.dtype(np.bool_),
}


def _conv_input(src: np.dtype, seed: int) -> np.ndarray:
    r = _rng(seed)
    if src == np.bool_:
        return r.random((63, 100)) < 0.5
    if src == np.int32:
        return r.integers(-300, 300, (63, 100)).astype(np.int32)
    x = r.standard_normal((63, 100)) * 20
    x[::7] = 0.0  # zeros, for -> bool
    return x.astype(src)


@pytest.mark.parametrize(
    "src,dst",
    [pytest.param(a, b, id=f"{a}->{b}") for a in CONV_DTYPES for b in CONV_DTYPES if a != b],
)
@pytest.mark.slow
def test_convert(src, dst):
    s, d = CONV_DTYPES[src], CONV_DTYPES[dst]
    _check(lambda a: lax.convert_element_type(a, d), _conv_input(s, 13))


# ---------------------------------------------------------------------------------------------
# reductions

RED = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}


@pytest.mark.parametrize("axis", [0, 1, None], ids=["ax0", "ax1", "all"])
@pytest.mark.parametrize(
    "name,dtype",
    [("sum", F16), ("sum", BF16), ("sum", F32), ("max", F16), ("min", F32)],
    ids=["sum-f16", "sum-bf16", "sum-f32", "max-f16", "min-f32"],
)
@pytest.mark.slow
def test_reduce_2d(name, dtype, axis):
    x = _arr((100, 150), dtype, seed=14)
    k = x.size if axis is None else x.shape[axis]
    _check(lambda a: RED[name](a, axis=axis), x, k=k if name == "sum" else 1)


@pytest.mark.parametrize(
    "name,axis",
    [("sum", a) for a in [0, 2, (0, 2), (1, 2), None]] + [("max", 1), ("min", (0, 2))],
    ids=str,
)
def test_reduce_3d(name, axis):
    x = _arr((2, 63, 65), F32, seed=15)
    k = x.size if axis is None else int(np.prod([x.shape[a] for a in np.atleast_1d(axis)]))
    _check(lambda a: RED[name](a, axis=axis), x, k=k if name == "sum" else 1)


@pytest.mark.parametrize("shape", [(1,), (63,), (65,), (1, 1)], ids=str)
def test_reduce_small(shape):
    x = _arr(shape, F16, seed=16)
    _check(lambda a: (jnp.sum(a), jnp.max(a, axis=-1)), x, k=x.size)


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_arg_reduce(name, dtype):
    # distinct values per row so that the answer is unique in every dtype
    r = _rng(17)
    x = np.stack([r.permutation(150) for _ in range(63)]).astype(np.float32) / 4
    x = x.astype(dtype)
    fn = jnp.argmax if name == "argmax" else jnp.argmin
    _check(lambda a: fn(a, axis=-1), x)


@pytest.mark.parametrize("shape", [(63, 150), (2, 65, 100)], ids=str)
def test_arg_reduce_shapes(shape):
    x = _arr(shape, F32, seed=18)
    fn = jnp.argmax
    _check(lambda a: fn(a, axis=-1), x)


@pytest.mark.parametrize("dtype", [F16, F32], ids=["f16", "f32"])
def test_arg_reduce_fused_producer_axis0(dtype):
    # values in (-1, 1) all truncate to 0 as int32: the reduced values must keep their dtype
    # through the producer fused into the reduction, along a non-minor axis too
    r = _rng(19)
    x = (np.stack([r.permutation(63) for _ in range(150)], axis=1) / 64).astype(dtype)
    _check(lambda a: (jnp.argmax(a * 0.5 - 0.25, axis=0), jnp.argmin(-a, axis=0)), x)


@pytest.mark.parametrize(
    "dtype,axis,reverse",
    [
        (F16, 0, False),
        (F16, 0, True),
        (F16, 1, False),
        (F16, 1, True),
        (F32, 1, True),
        (BF16, 0, False),
    ],
    ids=["f16-ax0", "f16-ax0-rev", "f16-ax1", "f16-ax1-rev", "f32-ax1-rev", "bf16-ax0"],
)
def test_cumsum(dtype, axis, reverse):
    x = _arr((63, 100), dtype, seed=19)
    k = x.shape[axis]
    _check(lambda a: lax.cumsum(a, axis=axis, reverse=reverse), x, k=k)


_RUNNING = {
    "cumprod": lax.cumprod,
    "cummax": lax.cummax,
    "cummin": lax.cummin,
    "cumlogsumexp": lax.cumlogsumexp,
}


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("name", list(_RUNNING))
@pytest.mark.parametrize("dtype", [F16, F32], ids=["f16", "f32"])
def test_running_reductions(name, dtype, reverse):
    # cumprod of values near 1 stays in range over 100 steps; the others take any value
    x = _arr((63, 100), dtype, "normal", seed=21)
    if name == "cumprod":
        x = (1 + x.astype(np.float32) / 20).astype(dtype)
    f = _RUNNING[name]
    for ax in (0, 1):
        _check(lambda a, ax=ax: f(a, axis=ax, reverse=reverse), x, k=x.shape[ax])


@pytest.mark.parametrize("name", list(_RUNNING))
def test_running_reductions_split_across_steps(small_card, name):
    # a scratchpad of 16 KiB per core splits the 3000-long axis into blocks: the carry from
    # block to block combines by the kind's own rule (a product, a max...), both directions
    small_card(scratchpad_bytes=16 * 1024, num_cores=4)
    x = _arr((2, 3000), F32, "normal", seed=22)
    if name == "cumprod":
        x = (1 + x / 200).astype(F32)
    for reverse in (False, True):
        _check(lambda a, r=reverse: _RUNNING[name](a, axis=1, reverse=r), x, k=3000)


def test_shifts_of_int32_bits_as_xla_defines_them():
    # counts outside [0, 32) give 0 (left, logical right) or the sign (arithmetic right)
    a = np.array([1, -5, 7, 2**30, -(2**31), 123456, -1, 99], np.int32)
    b = np.array([0, 1, 31, 2, 33, -1, 32, 5], np.int32)
    for f in (lax.shift_left, lax.shift_right_arithmetic, lax.shift_right_logical):
        np.testing.assert_array_equal(np.asarray(spyre_jax.jit(f)(a, b)), jax.jit(f)(a, b))


def test_bitcasts_stack_and_checkpoint():
    x = np.array([[1.5, -2.0, 0.0, -0.0, np.inf, 3e-39, np.nan]], np.float32).repeat(3, 0)
    for f in (
        jnp.signbit,
        lambda v: jnp.copysign(v, -1.0),
        lambda v: lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.int32) + 1, jnp.float32),
        lambda v: jnp.stack([v, v * 2, -v], axis=1),
        jax.checkpoint(lambda v: jnp.sin(v) * v),
    ):
        got, want = np.asarray(spyre_jax.jit(f)(x)), np.asarray(jax.jit(f)(x))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


_POOLS = {
    "max_3x3_s2_same": lambda x: lax.reduce_window(
        x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "SAME"
    ),
    "max_2x2_s2_valid": lambda x: lax.reduce_window(
        x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID"
    ),
    "avg_3x3_same": lambda x: (
        lax.reduce_window(x, 0.0, lax.add, (1, 1, 3, 3), (1, 1, 1, 1), "SAME") / 9
    ),
    "min_dilated_padded": lambda x: lax.reduce_window(
        x,
        jnp.inf,
        lax.min,
        (1, 1, 3, 2),
        (1, 1, 1, 2),
        ((0, 0), (0, 0), (1, 1), (0, 1)),
        window_dilation=(1, 1, 2, 1),
    ),
}


@pytest.mark.parametrize("name", list(_POOLS))
def test_pooling_as_windowed_reductions(name):
    x = _arr((2, 3, 11, 13), F32, seed=23)
    _check(_POOLS[name], x, k=9)


def test_cumsum_jnp_3d():
    x = _arr((2, 63, 65), F32, seed=20)
    for ax in range(3):
        _check(lambda a, ax=ax: jnp.cumsum(a, axis=ax), x, k=x.shape[ax])


def _layernorm(x, eps=1e-5):
    m = jnp.mean(x, axis=-1, keepdims=True)
    v = jnp.var(x, axis=-1, keepdims=True)
    return (x - m) * lax.rsqrt(v + eps)


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_mean_var(dtype):
    x = _arr((63, 150), dtype, seed=21) + 1.0
    _check(lambda a: (jnp.mean(a, axis=-1), jnp.var(a, axis=-1)), x, k=150)
    _check(lambda a: jnp.mean(a, axis=0), x, k=63)


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_layernorm(dtype):
    x = _arr((65, 256), dtype, seed=22)
    _check(_layernorm, x, k=256, chain=2)


@pytest.mark.parametrize(
    "dtype,shape",
    [(F16, (63, 100)), (BF16, (63, 100)), (F32, (63, 100)), (F16, (4, 65, 128))],
    ids=["f16", "bf16", "f32", "f16-3d"],
)
def test_softmax(dtype, shape):
    x = _arr(shape, dtype, seed=23) * 3
    _check(lambda a: jax.nn.softmax(a, axis=-1), x, chain=3)


def test_softmax_axis0():
    x = _arr((100, 65), F32, seed=24)
    _check(lambda a: jax.nn.softmax(a, axis=0), x, chain=3)


# ---------------------------------------------------------------------------------------------
# layout and movement

TRANSPOSE = [
    ((100, 150), (1, 0)),
    ((63, 65), (1, 0)),
    ((1, 64), (1, 0)),
    ((2, 63, 65), (0, 2, 1)),
    ((2, 63, 65), (2, 1, 0)),
    ((2, 63, 65), (1, 0, 2)),
    ((2, 63, 65), (1, 2, 0)),
    ((2, 63, 65), (2, 0, 1)),
    ((2, 2, 65, 64), (0, 2, 1, 3)),
    ((2, 2, 65, 64), (0, 1, 3, 2)),
    ((2, 2, 65, 64), (3, 2, 1, 0)),
]


_ALT = [F16, F32, BF16]  # dtypes cycled over the movement cases (data movement is dtype-blind
# apart from the stick width: 64 fp16/bf16 or 32 fp32 elements)


@pytest.mark.parametrize(
    "shape,perm,dtype",
    [(s, p, _ALT[i % 3]) for i, (s, p) in enumerate(TRANSPOSE)]
    + [(s, p, np.dtype(np.int32)) for s, p in TRANSPOSE[-2:-1]],
    ids=lambda v: str(v) if not isinstance(v, np.dtype) else v.name,
)
@pytest.mark.slow
def test_transpose(shape, perm, dtype):
    _check(lambda a: jnp.transpose(a, perm), _arr(shape, dtype, seed=25))


RESHAPE = [
    ((6, 100), (600,)),
    ((600,), (20, 30)),
    ((6, 100), (20, 30)),
    ((64, 128), (128, 64)),
    ((64, 128), (8, 8, 128)),
    ((2, 63, 65), (126, 65)),
    ((2, 63, 65), (2, 4095)),
    ((100, 150), (150, 100)),
    ((4, 64), (256,)),
    ((2, 2, 65, 64), (4, 65, 64)),
    ((2, 2, 65, 64), (2, 2, 4160)),
]


@pytest.mark.parametrize("shape,new", RESHAPE, ids=[f"{s}->{n}" for s, n in RESHAPE])
def test_reshape(shape, new):
    _check(lambda a: jnp.reshape(a, new) * 2, _arr(shape, F16, seed=26))


def test_reshape_chain():
    # (6,100) -> (600,) -> (20,30) in one program, each step a different layout
    _check(lambda a: jnp.reshape(jnp.reshape(a, (600,)) + 1, (20, 30)), _arr((6, 100), F16))


def test_reshape_then_transpose_2_2_65_64():
    # attention-style head split: [B, S, H*D] -> [B, H, S, D]; a known failure class on the card
    x = _arr((2, 65, 128), F16, seed=27)
    _check(lambda a: jnp.transpose(a.reshape(2, 65, 2, 64), (0, 2, 1, 3)), x)
    y = _arr((2, 2, 65, 64), F16, seed=28)
    _check(lambda a: jnp.transpose(a, (0, 2, 1, 3)).reshape(2, 65, 128), y)


@pytest.mark.parametrize(
    "f,shape",
    [
        (lambda a: jnp.squeeze(a, 1), (63, 1, 100)),
        (lambda a: jnp.squeeze(a), (1, 65, 1)),
        (lambda a: jnp.expand_dims(a, 0), (63, 100)),
        (lambda a: jnp.expand_dims(a, -1) + 1, (63, 100)),
        (lambda a: a[None, :, None], (65,)),
    ],
    ids=["squeeze1", "squeeze_all", "expand0", "expand_last", "newaxis"],
)
def test_squeeze_expand(f, shape):
    _check(f, _arr(shape, F16, seed=29))


SLICES = {
    "rows": ((100, 150), lambda a: a[3:70]),
    "cols_unaligned": ((100, 150), lambda a: a[:, 5:140]),
    "cols_aligned": ((100, 150), lambda a: a[:, 64:128]),
    "both": ((100, 150), lambda a: a[10:20, 63:65]),
    "strided_rows": ((100, 150), lambda a: a[1::3]),
    "strided_cols": ((100, 150), lambda a: a[:, 1:149:2]),
    "strided_both": ((63, 65), lambda a: a[::2, ::5]),
    "3d": ((2, 63, 65), lambda a: a[1:, 2:50, 7:]),
    "1d": ((150,), lambda a: a[70:135]),
    "last_elem": ((63, 65), lambda a: a[:, -1]),
}


@pytest.mark.parametrize("name", list(SLICES))
def test_slice(name):
    dtype = _ALT[list(SLICES).index(name) % 3]
    shape, f = SLICES[name]
    _check(f, _arr(shape, dtype, seed=30))


CONCAT = {
    "ax0": ([(63, 100), (65, 100)], 0),
    "ax1_odd": ([(10, 63), (10, 65)], 1),
    "ax1_three": ([(10, 1), (10, 64), (10, 100)], 1),
    "1d": ([(63,), (65,)], 0),
    "3d_ax0": ([(1, 63, 65), (2, 63, 65)], 0),
    "3d_ax1": ([(2, 1, 65), (2, 63, 65)], 1),
    "3d_ax2": ([(2, 5, 63), (2, 5, 65)], 2),
}


@pytest.mark.parametrize("name", list(CONCAT))
def test_concatenate(name):
    dtype = _ALT[list(CONCAT).index(name) % 3]
    shapes, axis = CONCAT[name]
    xs = [_arr(s, dtype, seed=31 + i) for i, s in enumerate(shapes)]
    _check(lambda *a: jnp.concatenate(a, axis=axis), *xs)


@pytest.mark.parametrize("dtype", [F16, F32], ids=["f16", "f32"])
def test_iota(dtype):
    x = _arr((63, 100), dtype, seed=32)
    _check(lambda a: a + jnp.arange(100, dtype=a.dtype), x)
    _check(lambda a: a * lax.broadcasted_iota(a.dtype, a.shape, 0), x, k=63)
    _check(lambda a: jnp.arange(65, dtype=jnp.int32) + a, np.int32(3))


def _table(n=50, d=100, dtype=F16):
    return _arr((n, d), dtype, seed=33)


def test_take_in_range():
    t = _table()
    idx = _rng(34).integers(0, 50, (37,)).astype(np.int32)
    _check(lambda a, i: jnp.take(a, i, axis=0), t, idx)


def test_getitem_gather_2d_indices():
    t = _table(d=64)
    idx = _rng(35).integers(0, 50, (3, 7)).astype(np.int32)
    _check(lambda a, i: a[i], t, idx)


def test_getitem_negative_indices():
    t = _table(dtype=F32)
    idx = np.array([0, -1, 5, -50, 49], np.int32)
    _check(lambda a, i: a[i], t, idx)


def test_take_fill_out_of_range():
    # jnp.take defaults to mode="fill": out-of-range rows come back as NaN
    t = _table(dtype=F32)
    idx = np.array([0, 3, 50, 1000, 49, -51], np.int32)
    got = _check(lambda a, i: jnp.take(a, i, axis=0), t, idx)
    assert np.isnan(np.asarray(got)[[2, 3, 5]]).all()
    _check(lambda a, i: jnp.take(a, i, axis=0, mode="fill"), t, idx)


@pytest.mark.parametrize("fill", [0.0, -7.5], ids=str)
def test_take_fill_value(fill):
    # regression: gather used NaN whatever fill_value said
    t = _table(dtype=F32)
    idx = np.array([0, 3, 50, 1000, 49], np.int32)
    got = _check(lambda a, i: jnp.take(a, i, axis=0, mode="fill", fill_value=fill), t, idx)
    assert (np.asarray(got)[[2, 3]] == fill).all()


def test_take_fill_int_table_defaults_like_jax():
    t = np.arange(50 * 3, dtype=np.int32).reshape(50, 3)
    idx = np.array([0, 3, 50, -60, 49], np.int32)
    _check(lambda a, i: jnp.take(a, i, axis=0, mode="fill"), t, idx)


def test_take_clip_out_of_range():
    t = _table(dtype=F32)
    idx = np.array([0, 3, 50, 1000, 49, -1000], np.int32)
    _check(lambda a, i: jnp.take(a, i, axis=0, mode="clip"), t, idx)


def test_embedding_lookup_3d_table():
    t = _arr((20, 4, 65), F16, seed=36)
    idx = np.array([[1, 2], [19, 0]], np.int32)
    _check(lambda a, i: jnp.take(a, i, axis=0) * 2, t, idx)


# ---------------------------------------------------------------------------------------------
# matmul

MATMUL = [
    (1, 1, 1),
    (1, 64, 64),
    (63, 65, 100),
    (65, 63, 1),
    (100, 150, 63),
    (150, 100, 150),
    (64, 128, 64),
    (128, 1024, 64),
    (1, 1024, 1024),
]


@pytest.mark.parametrize(
    "mkn,dtype",
    [(s, F16) for s in MATMUL]
    + [(MATMUL[2], BF16), (MATMUL[4], BF16), (MATMUL[2], F32), (MATMUL[-1], F32)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v.name,
)
@pytest.mark.slow
def test_matmul(mkn, dtype):
    m, k, n = mkn
    x = _arr((m, k), dtype, seed=37)
    w = _arr((k, n), dtype, seed=38)
    _check(lambda a, b: a @ b, x, w, k=k)


def test_matmul_512():
    x = _arr((512, 512), F16, seed=39)
    w = _arr((512, 512), F16, seed=40)
    _check(lambda a, b: a @ b, x, w, k=512)


@pytest.mark.parametrize(
    "bmkn,dtype",
    [
        ((2, 63, 65, 100), F16),
        ((4, 1, 64, 150), F32),
        ((3, 65, 1, 63), BF16),
        ((2, 63, 65, 100), F32),
    ],
    ids=str,
)
def test_batched_matmul(bmkn, dtype):
    b, m, k, n = bmkn
    x = _arr((b, m, k), dtype, seed=41)
    y = _arr((b, k, n), dtype, seed=42)
    _check(lambda p, q: jnp.einsum("bij,bjk->bik", p, q), x, y, k=k)


@pytest.mark.parametrize(
    "kmn,dtype", [((100, 63, 65), F16), ((64, 128, 1), F32), ((1, 150, 100), F16)], ids=str
)
def test_matmul_transposed_lhs(kmn, dtype):
    k, m, n = kmn
    x = _arr((k, m), dtype, seed=43)
    y = _arr((k, n), dtype, seed=44)
    _check(lambda p, q: p.T @ q, x, y, k=k)
    _check(lambda p, q: lax.dot_general(p, q, (((0,), (0,)), ((), ()))), x, y, k=k)


@pytest.mark.parametrize("kn,dtype", [((63, 65), F16), ((150, 100), F32), ((64, 1), F16)], ids=str)
def test_vector_matrix(kn, dtype):
    k, n = kn
    v = _arr((k,), dtype, seed=45)
    w = _arr((k, n), dtype, seed=46)
    _check(lambda p, q: p @ q, v, w, k=k)
    u = _arr((n,), dtype, seed=47)
    _check(lambda q, p: q @ p, w, u, k=n)  # matrix @ vector
    _check(lambda p, q: jnp.dot(p, q), v, v, k=k)  # vector . vector


@pytest.mark.parametrize("n", [128, 150, 4])
def test_matmul_preferred_f32(n):
    # fp16 operands, fp32 result: the PE array accumulates in fp32 anyway
    x = _arr((65, 100), F16, seed=55)
    w = _arr((100, n), F16, seed=56)
    _check(
        lambda p, q: jnp.matmul(p, q, preferred_element_type=jnp.float32),
        x,
        w,
        k=100,
    )


def test_matmul_rhs_transposed_and_bias_gelu():
    x = _arr((65, 100), F16, seed=48)
    w = _arr((63, 100), F16, seed=49)
    b = _arr((63,), F16, seed=50)
    _check(lambda p, q, r: jax.nn.gelu(p @ q.T + r), x, w, b, k=100, chain=3)


# ---------------------------------------------------------------------------------------------
# the graph and schedule checkers

CHECKED = {
    "mlp": (
        lambda x, w, b: jax.nn.gelu(x @ w + b),
        [((65, 100), F16), ((100, 150), F16), ((150,), F16)],
    ),
    "layernorm": (_layernorm, [((63, 150), F32)]),
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), [((100, 65), BF16)]),
    "movement": (
        lambda x: jnp.concatenate([x[:, 1:64].T, x[::2, :63].T], axis=1).reshape(-1),
        [((100, 150), F16)],
    ),
    "heads": (
        lambda x: jnp.transpose(x.reshape(2, 65, 2, 64), (0, 2, 1, 3)),
        [((2, 65, 128), F16)],
    ),
    "embed": (
        lambda t, i: jnp.cumsum(jnp.take(t, i, axis=0), axis=0),
        [((50, 100), F32), ((9,), np.int32)],
    ),
}


@pytest.mark.parametrize("name", list(CHECKED))
def test_checkers_pass(name):
    f, specs = CHECKED[name]
    xs = [
        _arr(s, d, seed=51) if d != np.int32 else np.arange(9, dtype=np.int32) * 5 for s, d in specs
    ]
    g = from_jaxpr(jax.make_jaxpr(f)(*xs))
    check_graph(g)
    k = compile_graph(g, CardSpec(), check=True)
    check_kernel(k)


# ---------------------------------------------------------------------------------------------
# tiling under a small scratchpad


@pytest.mark.slow
def test_small_scratchpad_matmul_512(small_card):
    card = small_card(scratchpad_bytes=64 * 1024)
    x = _arr((512, 512), F16, seed=52)
    w = _arr((512, 512), F16, seed=53)
    f = lambda a, b: a @ b
    _check(f, x, w, k=512)
    cost = spyre_jax.jit(f).lower(x, w).compile().cost_analysis()
    assert cost["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes


@pytest.mark.slow
def test_small_scratchpad_softmax_256x1000(small_card):
    card = small_card(scratchpad_bytes=64 * 1024)
    x = _arr((256, 1000), F16, seed=54) * 3
    f = lambda a: jax.nn.softmax(a, axis=-1)
    _check(f, x, chain=3)
    cost = spyre_jax.jit(f).lower(x).compile().cost_analysis()
    assert cost["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes


@pytest.mark.slow
def test_tiny_scratchpad_long_row_tiles(small_card):
    """A reduction over rows far longer than the scratchpad is split across steps (a carried
    fp32 accumulator); only a card that cannot hold one stick per buffer raises."""
    card = small_card(scratchpad_bytes=4096)
    x = _arr((4, 100000), np.float16, seed=55)
    f = lambda a: jnp.sum(a, axis=-1)
    _check(f, x, k=100000)
    cost = spyre_jax.jit(f).lower(x).compile().cost_analysis()
    assert cost["scratchpad_peak_bytes"] <= card.scratchpad_usable_bytes
    card = small_card(scratchpad_bytes=256)  # one 128-byte stick usable
    with pytest.raises(spyre_jax.TilingError, match="scratchpad") as ei:
        spyre_jax.jit(f)(x)
    assert str(card.scratchpad_usable_bytes) in str(ei.value)


# ---------------------------------------------------------------------------------------------
# property: random shapes, an elementwise chain and a reduction


@st.composite
def _shapes_and_axis(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 130)) for _ in range(rank))
    axis = draw(st.integers(-1, rank - 1))  # -1 doubles as "last"
    dtype = draw(st.sampled_from(["float16", "float32"]))
    return shape, axis, dtype


@settings(max_examples=25, deadline=None)
@given(_shapes_and_axis(), st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_property_elementwise_reduce(sa, seed):
    shape, axis, dtype = sa
    x = _arr(shape, np.dtype(dtype), seed=seed)
    y = _arr(shape, np.dtype(dtype), seed=seed + 1)

    def f(a, b):
        t = jnp.tanh(a) * b + 0.5
        return jnp.sum(t, axis=axis), jnp.max(t * t, axis=axis)

    _check(f, x, y, k=shape[axis], chain=2)
