"""The JAX op table of ``spyre-jax coverage jax``, as data: :data:`JAX_OPS`, one :class:`JaxOp`
record per entry.

An entry names a ``jax.numpy`` / ``jax.lax`` / ``jax.nn`` / ``jax.scipy`` function (or a small
composite such as layernorm or attention), the dtypes it runs in, and its samples: each
:class:`Sample` is a function (the op, or a lambda fixing its static arguments) and the
:class:`Arg` specs of its inputs (shape, value range, kind, dtype). :func:`make_samples` draws
the inputs from a random generator for one dtype. The shapes are odd on purpose (``SHAPES``: 65
and 63 columns, a rank-3 100) so that padding to the card's sticks is exercised.

The order of :data:`JAX_OPS` is part of the data: the coverage run seeds each entry's generator
with its index.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
from jax import lax

__all__ = ["Arg", "Sample", "JaxOp", "JAX_OPS", "SHAPES", "make_samples"]

#: the three shapes of unary ops and most other entries
SHAPES = ((5, 65), (3, 63), (2, 3, 100))

#: operand shapes of binary ops: equal, a broadcast row, a broadcast column
BINARY_SHAPES = (((5, 65), (5, 65)), ((3, 63), (63,)), ((2, 3, 100), (3, 1)))

F32_F16 = ("float32", "float16")
F32 = ("float32",)
INT32 = ("int32",)
BOOL = ("bool",)


@dataclass(frozen=True)
class Arg:
    """One input of a sample, drawn from the run's generator.

    ``kind``: ``"uniform"`` (values in ``[lo, hi)``; integers in ``[lo, hi)``; bools half true),
    ``"nonzero"`` (magnitudes in [0.5, 2] with random signs: safe divisors), ``"sorted"`` (uniform,
    then sorted), ``"spd"`` (a symmetric positive definite matrix, ``a @ a.T + n * I``), ``"key"``
    (a ``jax.random.key`` of a drawn seed; its raw uint32 data with ``dtype="uint32"``) or
    ``"const"`` (the scalar ``value``; nothing is drawn). ``dtype``: a fixed dtype (``"int32"`` for
    indices), or None for the dtype the entry runs in.
    """

    shape: tuple[int, ...]
    lo: float = -2.0
    hi: float = 2.0
    kind: str = "uniform"
    dtype: str | None = None
    value: float = 0


@dataclass(frozen=True)
class Sample:
    """One call: ``fn(*inputs)``. ``draw_order``: the order the inputs are drawn in (default:
    as listed). ``pass_dtype``: ``fn`` also takes the run's dtype as ``dtype=``."""

    fn: Callable[..., Any]
    args: tuple[Arg, ...]
    draw_order: tuple[int, ...] | None = None
    pass_dtype: bool = False


@dataclass(frozen=True)
class JaxOp:
    """One entry of the table: its name, samples, the dtypes it runs in, and a note."""

    name: str
    samples: tuple[Sample, ...]
    dtypes: tuple[str, ...] = F32_F16
    note: str = ""


# ---------------------------------------------------------------------------------------------
# drawing the inputs


def _arr(
    rng: np.random.Generator, shape: tuple[int, ...], dt: Any, lo: float = -2.0, hi: float = 2.0
) -> np.ndarray:
    dt = np.dtype(dt)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        return rng.integers(int(lo), int(hi), shape).astype(dt)
    return rng.uniform(lo, hi, shape).astype(dt)


def _draw(arg: Arg, rng: np.random.Generator, dtype: np.dtype) -> Any:
    if arg.kind == "key":  # a threefry key (raw uint32 data with dtype="uint32")
        seed = int(rng.integers(0, 2**31))
        return jax.random.PRNGKey(seed) if arg.dtype == "uint32" else jax.random.key(seed)
    dt = np.dtype(arg.dtype or dtype)
    if arg.kind == "uniform":
        return _arr(rng, arg.shape, dt, arg.lo, arg.hi)
    if arg.kind == "nonzero":
        mag = rng.uniform(0.5, 2.0, arg.shape)
        return (mag * np.where(rng.random(arg.shape) < 0.5, -1.0, 1.0)).astype(dt)
    if arg.kind == "sorted":
        return np.sort(_arr(rng, arg.shape, dt, arg.lo, arg.hi))
    if arg.kind == "spd":
        a = _arr(rng, arg.shape, dt, arg.lo, arg.hi)
        return (a @ a.T + arg.shape[0] * np.eye(arg.shape[0])).astype(dt)
    if arg.kind == "const":
        return dt.type(arg.value)
    raise ValueError(f"Arg: unknown kind {arg.kind!r}")


def make_samples(op: JaxOp, rng: np.random.Generator, dtype: Any) -> list[tuple[Callable, tuple]]:
    """``op``'s samples for ``dtype``: ``(fn, inputs)`` pairs, inputs drawn from ``rng``."""
    dt = np.dtype(dtype)
    out = []
    for s in op.samples:
        vals: list[Any] = [None] * len(s.args)
        for i in s.draw_order or range(len(s.args)):
            vals[i] = _draw(s.args[i], rng, dt)
        fn = functools.partial(s.fn, dtype=dt) if s.pass_dtype else s.fn
        out.append((fn, tuple(vals)))
    return out


# ---------------------------------------------------------------------------------------------
# record constructors for the families of the table


def A(shape: tuple[int, ...], lo: float = -2.0, hi: float = 2.0) -> Arg:
    """An input in the entry's dtype, uniform in ``[lo, hi)``."""
    return Arg(shape, lo, hi)


def Idx(shape: tuple[int, ...], hi: int) -> Arg:
    """int32 indices in ``[0, hi)``."""
    return Arg(shape, 0, hi, dtype="int32")


def S(fn: Callable, *args: Arg) -> Sample:
    return Sample(fn, args)


def op(name: str, *samples: Sample, **kw: Any) -> JaxOp:
    return JaxOp(name, samples, **kw)


def unary(name: str, f: Callable, lo: float = -2.0, hi: float = 2.0, **kw: Any) -> JaxOp:
    """``f`` on each of :data:`SHAPES`, values in ``[lo, hi)``."""
    return JaxOp(name, tuple(S(f, A(s, lo, hi)) for s in SHAPES), **kw)


def unary_nonzero(name: str, f: Callable, **kw: Any) -> JaxOp:
    return JaxOp(name, tuple(S(f, Arg(s, kind="nonzero")) for s in SHAPES), **kw)


def binary(
    name: str,
    f: Callable,
    lo: float = -2.0,
    hi: float = 2.0,
    lo2: float | None = None,
    hi2: float | None = None,
    divisor: bool = False,
    same_shape: bool = False,
    **kw: Any,
) -> JaxOp:
    """Same shapes, a broadcast row vector, and a broadcast column (``same_shape``: equal shapes
    only); the second operand in ``[lo2, hi2)`` or, as a ``divisor``, away from zero. The second
    operand is drawn first."""
    pairs = tuple((s, s) for s in SHAPES) if same_shape else BINARY_SHAPES
    lo2 = lo if lo2 is None else lo2
    hi2 = hi if hi2 is None else hi2
    samples = tuple(
        Sample(
            f,
            (A(a, lo, hi), Arg(b, kind="nonzero") if divisor else A(b, lo2, hi2)),
            draw_order=(1, 0),
        )
        for a, b in pairs
    )
    return JaxOp(name, samples, **kw)


def reduction(name: str, f: Callable, lo: float = -2.0, hi: float = 2.0, **kw: Any) -> JaxOp:
    """Over the last axis, over axis 0 with keepdims, over axes (1, 2)."""
    return op(
        name,
        S(lambda x: f(x, axis=-1), A((5, 65), lo, hi)),
        S(lambda x: f(x, axis=0, keepdims=True), A((3, 63), lo, hi)),
        S(lambda x: f(x, axis=(1, 2)), A((2, 3, 100), lo, hi)),
        **kw,
    )


def reduction1(name: str, f: Callable, lo: float = -2.0, hi: float = 2.0, **kw: Any) -> JaxOp:
    """Reductions over a single axis (argmax...): last axis, axis 0 with keepdims, axis 1."""
    return op(
        name,
        S(lambda x: f(x, axis=-1), A((5, 65), lo, hi)),
        S(lambda x: f(x, axis=0, keepdims=True), A((3, 63), lo, hi)),
        S(lambda x: f(x, axis=1), A((2, 3, 100), lo, hi)),
        **kw,
    )


def along(name: str, f: Callable, lo: float = -2.0, hi: float = 2.0, **kw: Any) -> JaxOp:
    """``f(x, axis)`` along the last axis, axis 0 and axis 1 (cumulative ops, softmax...)."""
    return op(
        name,
        S(lambda x: f(x, -1), A((5, 65), lo, hi)),
        S(lambda x: f(x, 0), A((3, 63), lo, hi)),
        S(lambda x: f(x, 1), A((2, 3, 100), lo, hi)),
        **kw,
    )


def per_shape(name: str, *fs: Callable, **kw: Any) -> JaxOp:
    """One sample per function: ``fs[i]`` on ``SHAPES[i]``."""
    return JaxOp(name, tuple(S(f, A(s)) for f, s in zip(fs, SHAPES, strict=False)), **kw)


def pairs(
    name: str, f: Callable, shapes: Sequence[tuple[tuple[int, ...], ...]], **kw: Any
) -> JaxOp:
    """``f(a, b)`` for each pair of operand shapes."""
    return JaxOp(name, tuple(S(f, A(a), A(b)) for a, b in shapes), **kw)


def _layernorm(x: Any, w: Any, b: Any) -> Any:
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * lax.rsqrt(v + 1e-5) * w + b


_LAX_SAME_RANK = "lax's binary ops take operands of one rank (no NumPy broadcasting)"
_SPECIAL_DOMAIN = {"logit": (0.05, 0.95), "erfinv": (-0.9, 0.9), "gammaln": (0.5, 4.0)}
_SPECIAL_DOMAIN["digamma"] = (0.5, 4.0)
_MM_SHAPES = (((5, 65), (65, 33)), ((3, 63), (63, 100)), ((2, 3, 100), (2, 100, 17)))


# ---------------------------------------------------------------------------------------------
# the table

JAX_OPS: list[JaxOp] = [
    # -- unary math
    *(
        unary(f"jnp.{n}", getattr(jnp, n))
        for n in ("abs", "negative", "positive", "exp", "exp2", "expm1", "sin", "cos", "tanh")
    ),
    *(
        unary(f"jnp.{n}", getattr(jnp, n))
        for n in ("arctan", "sinh", "cosh", "arcsinh", "sign", "floor", "ceil", "round", "trunc")
    ),
    *(
        unary(f"jnp.{n}", getattr(jnp, n))
        for n in ("square", "fabs", "deg2rad", "rad2deg", "cbrt", "signbit", "isnan", "isfinite")
    ),
    *(
        unary(f"jnp.{n}", getattr(jnp, n), 0.1, 3.0)
        for n in ("log", "log1p", "log2", "log10", "sqrt")
    ),
    unary("jnp.tan", jnp.tan, -1.2, 1.2),
    unary("jnp.arcsin", jnp.arcsin, -0.95, 0.95),
    unary("jnp.arccos", jnp.arccos, -0.95, 0.95),
    unary("jnp.arctanh", jnp.arctanh, -0.9, 0.9),
    unary("jnp.arccosh", jnp.arccosh, 1.1, 3.0),
    unary_nonzero("jnp.reciprocal", jnp.reciprocal),
    unary("jnp.isinf", lambda x: jnp.isinf(x / (x - x.mean() + 0.5))),
    unary("jnp.nan_to_num", lambda x: jnp.nan_to_num(jnp.log(x)), -1.0, 2.0),
    unary("jnp.sinc", jnp.sinc),
    *(
        unary(f"jax.scipy.special.{n}", getattr(jss, n), *_SPECIAL_DOMAIN.get(n, (-2.0, 2.0)))
        for n in ("erf", "erfc", "expit", "logit", "gammaln", "digamma", "erfinv", "i0e")
    ),
    unary("jax.scipy.special.ndtr", jss.ndtr, dtypes=F32, note="no float16 on the CPU"),
    # -- jax.lax elementwise
    *(
        unary(f"lax.{n}", getattr(lax, n))
        for n in ("exp", "tanh", "logistic", "neg", "abs", "sin", "cos", "erf", "square", "sign")
    ),
    unary("lax.rsqrt", lax.rsqrt, 0.1, 3.0),
    unary("lax.sqrt", lax.sqrt, 0.1, 3.0),
    unary("lax.log", lax.log, 0.1, 3.0),
    unary("lax.exp2", lax.exp2),
    unary("lax.integer_pow.2", lambda x: lax.integer_pow(x, 2)),
    unary("lax.integer_pow.3", lambda x: lax.integer_pow(x, 3)),
    unary_nonzero("lax.integer_pow.-1", lambda x: lax.integer_pow(x, -1)),
    unary("lax.convert_element_type", lambda x: lax.convert_element_type(x, jnp.float32)),
    unary("lax.clamp", lambda x: lax.clamp(jnp.array(-0.5, x.dtype), x, jnp.array(0.75, x.dtype))),
    unary("lax.reduce_precision", lambda x: lax.reduce_precision(x, 5, 10)),
    # -- binary arithmetic and comparisons
    *(
        binary(f"jnp.{n}", getattr(jnp, n))
        for n in ("add", "subtract", "multiply", "maximum", "minimum", "fmax", "fmin")
    ),
    *(
        binary(f"jnp.{n}", getattr(jnp, n))
        for n in ("arctan2", "hypot", "copysign", "logaddexp", "logaddexp2", "heaviside")
    ),
    *(
        binary(f"jnp.{n}", getattr(jnp, n), divisor=True)
        for n in ("divide", "true_divide", "floor_divide", "remainder", "fmod")
    ),
    binary("jnp.power", jnp.power, 0.5, 2.0, -2.0, 2.0),
    binary("jnp.float_power", jnp.float_power, 0.5, 2.0, -2.0, 2.0, dtypes=F32),
    *(
        binary(f"jnp.{n}", getattr(jnp, n), -2.0, 2.0)
        for n in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")
    ),
    binary("jnp.isclose", lambda a, b: jnp.isclose(a, jnp.round(b * 2) / 2 + a * 0)),
    binary("lax.max", lax.max, same_shape=True, note=_LAX_SAME_RANK),
    binary("lax.pow", lax.pow, 0.5, 2.0, -2.0, 2.0, same_shape=True, note=_LAX_SAME_RANK),
    binary("lax.rem", lax.rem, divisor=True, same_shape=True, note=_LAX_SAME_RANK),
    binary("lax.nextafter", lax.nextafter, dtypes=F32, same_shape=True, note=_LAX_SAME_RANK),
    binary("jnp.where(a>b)", lambda a, b: jnp.where(a > b, a, b * 2)),
    *(
        binary(f"jnp.{n}[int32]", getattr(jnp, n), -50, 50, 1, 9, dtypes=INT32)
        for n in ("add", "subtract", "multiply", "maximum", "floor_divide", "remainder")
    ),
    *(
        binary(f"jnp.{n}", getattr(jnp, n), -1000, 1000, 0, 8, dtypes=INT32)
        for n in ("bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift")
    ),
    unary("jnp.invert[int32]", jnp.invert, -100, 100, dtypes=INT32),
    *(
        binary(f"jnp.{n}", getattr(jnp, n), dtypes=BOOL)
        for n in ("logical_and", "logical_or", "logical_xor")
    ),
    unary("jnp.logical_not", jnp.logical_not, dtypes=BOOL),
    # -- reductions
    *(
        reduction(f"jnp.{n}", getattr(jnp, n))
        for n in ("sum", "mean", "max", "min", "var", "std", "ptp", "nansum", "nanmax", "amax")
    ),
    reduction("jnp.prod", jnp.prod, 0.9, 1.1),
    reduction("jnp.all", lambda x, **k: jnp.all(x > -1.8, **k)),
    reduction("jnp.any", lambda x, **k: jnp.any(x > 1.9, **k)),
    reduction("jnp.count_nonzero", lambda x, **k: jnp.count_nonzero(x > 0, **k)),
    reduction("jnp.linalg.norm", jnp.linalg.norm),
    reduction("jax.nn.logsumexp", jax.nn.logsumexp),
    reduction1("jnp.argmax", jnp.argmax),
    reduction1("jnp.argmin", jnp.argmin),
    reduction1("jnp.median", jnp.median, dtypes=F32),
    per_shape("jnp.sum(all)", jnp.sum, jnp.sum, jnp.sum),
    op(
        "jnp.average(weights)",
        S(lambda x, w: jnp.average(x, axis=-1, weights=w), A((5, 65)), A((65,), 0.1, 1.0)),
    ),
    per_shape(
        "lax.reduce_max",
        lambda x: lax.reduce_max(x, (1,)),
        lambda x: lax.reduce_max(x, (0,)),
        lambda x: lax.reduce_max(x, (0, 2)),
    ),
    per_shape(
        "lax.reduce_sum",
        lambda x: lax.reduce_sum(x, (1,)),
        lambda x: lax.reduce_sum(x, (0, 1)),
        lambda x: lax.reduce_sum(x, (2,)),
    ),
    per_shape(
        "lax.argmax",
        lambda x: lax.argmax(x, 1, jnp.int32),
        lambda x: lax.argmax(x, 0, jnp.int32),
    ),
    # -- cumulative
    along("jnp.cumsum", lambda x, a: jnp.cumsum(x, axis=a)),
    along("jnp.cumprod", lambda x, a: jnp.cumprod(x, axis=a), 0.95, 1.05),
    along("jnp.diff", lambda x, a: jnp.diff(x, axis=a)),
    along("lax.cumsum", lambda x, a: lax.cumsum(x, axis=a % x.ndim)),
    along("lax.cummax", lambda x, a: lax.cummax(x, axis=a % x.ndim)),
    along("lax.cummin", lambda x, a: lax.cummin(x, axis=a % x.ndim)),
    along("lax.cumlogsumexp", lambda x, a: lax.cumlogsumexp(x, axis=a % x.ndim)),
    along("jnp.cumsum(reverse)", lambda x, a: jnp.flip(jnp.cumsum(jnp.flip(x, a), axis=a), a)),
    # -- shape and data movement
    per_shape(
        "jnp.reshape",
        lambda x: x.reshape(13, 25),
        lambda x: x.reshape(-1),
        lambda x: x.reshape(6, 100),
    ),
    per_shape("jnp.ravel", jnp.ravel, jnp.ravel, jnp.ravel),
    per_shape("jnp.transpose", jnp.transpose, jnp.transpose, lambda x: jnp.transpose(x, (2, 0, 1))),
    per_shape(
        "jnp.swapaxes",
        lambda x: jnp.swapaxes(x, 0, 1),
        lambda x: jnp.swapaxes(x, 1, 0),
        lambda x: jnp.swapaxes(x, 1, 2),
    ),
    per_shape(
        "jnp.moveaxis",
        lambda x: jnp.moveaxis(x, 0, -1),
        lambda x: jnp.moveaxis(x, 1, 0),
        lambda x: jnp.moveaxis(x, -1, 0),
    ),
    per_shape(
        "jnp.expand_dims",
        lambda x: jnp.expand_dims(x, 0),
        lambda x: jnp.expand_dims(x, 1),
        lambda x: jnp.expand_dims(x, -1),
    ),
    per_shape(
        "jnp.squeeze",
        lambda x: jnp.squeeze(x[:1]),
        lambda x: jnp.squeeze(x[:, None], 1),
        lambda x: jnp.squeeze(x[:, :1], 1),
    ),
    per_shape(
        "jnp.broadcast_to",
        lambda x: jnp.broadcast_to(x[:1], (4, 65)),
        lambda x: jnp.broadcast_to(x, (2, 3, 63)),
        lambda x: jnp.broadcast_to(x[:, :1], (2, 5, 100)),
    ),
    op(
        "jnp.concatenate",
        S(lambda a, b: jnp.concatenate([a, b], axis=0), A((5, 65)), A((3, 65))),
        S(lambda a, b: jnp.concatenate([a, b], axis=1), A((3, 63)), A((3, 37))),
        S(lambda a, b: jnp.concatenate([a, b], axis=-1), A((2, 3, 100)), A((2, 3, 28))),
    ),
    pairs(
        "jnp.stack",
        lambda a, b: jnp.stack([a, b], axis=1),
        (((5, 65), (5, 65)), ((2, 3, 100), (2, 3, 100))),
    ),
    pairs("jnp.hstack", lambda a, b: jnp.hstack([a, b]), (((5, 65), (5, 7)),)),
    pairs("jnp.vstack", lambda a, b: jnp.vstack([a, b]), (((5, 65), (3, 65)),)),
    per_shape(
        "jnp.split",
        lambda x: jnp.split(x, [2, 4], axis=0),
        lambda x: jnp.split(x, 3, axis=1),
        lambda x: jnp.split(x, [30], axis=-1),
    ),
    per_shape(
        "jnp.tile",
        lambda x: jnp.tile(x, (2, 1)),
        lambda x: jnp.tile(x, (1, 3)),
        lambda x: jnp.tile(x, (1, 2, 1)),
    ),
    per_shape(
        "jnp.repeat",
        lambda x: jnp.repeat(x, 2, axis=0),
        lambda x: jnp.repeat(x, 3, axis=1),
        lambda x: jnp.repeat(x, 2, axis=-1),
    ),
    per_shape("jnp.flip", lambda x: jnp.flip(x, 0), lambda x: jnp.flip(x, 1), jnp.flip),
    per_shape(
        "jnp.roll",
        lambda x: jnp.roll(x, 2, axis=0),
        lambda x: jnp.roll(x, -5, axis=1),
        lambda x: jnp.roll(x, 7, axis=-1),
    ),
    per_shape(
        "jnp.pad",
        lambda x: jnp.pad(x, ((1, 2), (3, 0))),
        lambda x: jnp.pad(x, 1, constant_values=0.5),
        lambda x: jnp.pad(x, ((0, 0), (1, 1), (0, 28))),
    ),
    per_shape("jnp.pad(edge)", lambda x: jnp.pad(x, 2, mode="edge")),
    per_shape("jnp.pad(reflect)", lambda x: jnp.pad(x, 2, mode="reflect")),
    per_shape(
        "jnp.where",
        lambda x: jnp.where(x > 0, x, 0.0),
        lambda x: jnp.where(x < 0.5, x * 2, -x),
        lambda x: jnp.where(x > 0, 1.0, x),
    ),
    per_shape(
        "jnp.clip",
        lambda x: jnp.clip(x, -1, 1),
        lambda x: jnp.clip(x, 0.0),
        lambda x: jnp.clip(x, max=0.3),
    ),
    per_shape("jnp.triu", jnp.triu, lambda x: jnp.triu(x, 1)),
    per_shape("jnp.tril", jnp.tril, lambda x: jnp.tril(x, -1)),
    per_shape(
        "jnp.zeros_like+ones_like",
        lambda x: jnp.zeros_like(x) + x,
        lambda x: jnp.ones_like(x) * x,
        lambda x: jnp.full_like(x, 3.0) - x,
    ),
    per_shape(
        "astype",
        lambda x: x.astype(jnp.float32) * 2,
        lambda x: x.astype(jnp.float16),
        lambda x: (x * 10).astype(jnp.int32),
    ),
    per_shape("astype(bool)", lambda x: x.astype(bool), lambda x: (x > 0) * x),
    op(
        "jnp.take",
        S(lambda x, i: jnp.take(x, i, axis=0), A((5, 65)), Idx((7,), 5)),
        S(lambda x, i: jnp.take(x, i, axis=1), A((3, 63)), Idx((9,), 63)),
        S(lambda x, i: x[i], A((2, 3, 100)), Idx((4,), 2)),
    ),
    op(
        "jnp.take_along_axis",
        S(lambda x, i: jnp.take_along_axis(x, i, axis=-1), A((5, 65)), Idx((5, 3), 65)),
        S(lambda x, i: jnp.take_along_axis(x, i, axis=0), A((3, 63)), Idx((2, 63), 3)),
    ),
    op(
        "embedding (table[idx])",
        S(lambda t, i: t[i], A((50, 65)), Idx((3, 7), 50)),
        S(lambda t, i: t[i], A((100, 63)), Idx((9,), 100)),
    ),
    per_shape(
        "basic indexing",
        lambda x: x[1:4, ::2],
        lambda x: x[::-1, 3],
        lambda x: x[..., None, 5:50],
    ),
    op(
        "x.at[].set",
        S(lambda x, v: x.at[1:3].set(v), A((5, 65)), A((2, 65))),
        S(lambda x, i: x.at[i].add(1.0), A((3, 63)), Idx((4,), 3)),
        # traced scatters: a duplicate index, one out of range (dropped), clip mode
        S(lambda x, i, v: x.at[i].set(v), A((5, 65)), Idx((4,), 7), A((4, 65))),
        S(lambda x, i, v: x.at[i].max(v), A((5, 65)), Idx((4,), 5), A((4, 65))),
        S(lambda x, i, v: x.at[:, i].add(v, mode="clip"), A((3, 63)), Idx((2,), 70), A((3, 2))),
    ),
    along("jnp.sort", lambda x, a: jnp.sort(x, axis=a)),
    along("jnp.argsort", lambda x, a: jnp.argsort(x, axis=a)),
    per_shape("lax.top_k", lambda x: lax.top_k(x, 3), lambda x: lax.top_k(x, 5)),
    op(
        "jnp.searchsorted",
        S(lambda s, v: jnp.searchsorted(s, v), Arg((65,), kind="sorted"), A((5, 7))),
    ),
    # -- linear algebra
    pairs("jnp.matmul", jnp.matmul, _MM_SHAPES),
    pairs("@ (broadcast)", jnp.matmul, (((2, 3, 100), (100, 17)), ((5, 65), (2, 65, 9)))),
    pairs("jnp.dot", jnp.dot, (((5, 65), (65, 33)), ((63,), (63,)), ((3, 63), (63,)))),
    pairs("jnp.einsum(ij,jk)", lambda a, b: jnp.einsum("ij,jk->ik", a, b), (((5, 65), (65, 33)),)),
    pairs(
        "jnp.einsum(bij,bkj)",
        lambda a, b: jnp.einsum("bij,bkj->bik", a, b),
        (((2, 3, 100), (2, 17, 100)),),
    ),
    pairs(
        "jnp.einsum(bhqd,bhkd)",
        lambda a, b: jnp.einsum("bhqd,bhkd->bhqk", a, b),
        (((2, 3, 5, 65), (2, 3, 7, 65)),),
    ),
    per_shape("jnp.einsum(ij->j)", lambda x: jnp.einsum("ij->j", x)),
    pairs(
        "jnp.tensordot",
        lambda a, b: jnp.tensordot(a, b, axes=1),
        (((5, 65), (65, 33)), ((2, 3, 100), (100, 7))),
    ),
    pairs(
        "jnp.tensordot(2)",
        lambda a, b: jnp.tensordot(a, b, axes=2),
        (((2, 3, 100), (3, 100, 7)),),
    ),
    pairs("jnp.outer", jnp.outer, (((65,), (33,)), ((5,), (100,)))),
    pairs("jnp.inner", jnp.inner, (((5, 65), (7, 65)),)),
    pairs("jnp.vdot", jnp.vdot, (((65,), (65,)),)),
    pairs("jnp.kron", jnp.kron, (((3, 5), (4, 7)),)),
    pairs(
        "lax.dot_general",
        lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))),
        (((2, 3, 100), (2, 100, 17)),),
    ),
    pairs("lax.batch_matmul", lax.batch_matmul, (((2, 3, 100), (2, 100, 17)),)),
    per_shape("jnp.trace", jnp.trace, jnp.trace),
    per_shape("jnp.diagonal", jnp.diagonal, jnp.diagonal),
    op(
        "jnp.linalg (cholesky/inv/solve)",
        S(jnp.linalg.cholesky, Arg((7, 7), kind="spd")),
        S(jnp.linalg.inv, Arg((7, 7), kind="spd")),
        S(lambda m, b: jnp.linalg.solve(m, b), Arg((7, 7), kind="spd"), A((7, 3))),
        dtypes=F32,
    ),
    per_shape("jnp.fft.rfft", lambda x: jnp.abs(jnp.fft.rfft(x)), dtypes=F32),
    # -- nn
    *(
        unary(f"jax.nn.{n}", getattr(jax.nn, n))
        for n in ("relu", "relu6", "silu", "sigmoid", "softplus", "soft_sign", "elu", "celu")
    ),
    unary("jax.nn.selu", jax.nn.selu),
    *(
        unary(f"jax.nn.{n}", getattr(jax.nn, n))
        for n in ("hard_tanh", "hard_sigmoid", "hard_swish", "log_sigmoid", "mish", "sparse_plus")
    ),
    unary("jax.nn.gelu(tanh)", lambda x: jax.nn.gelu(x, approximate=True)),
    unary("jax.nn.gelu(erf)", lambda x: jax.nn.gelu(x, approximate=False)),
    unary("jax.nn.leaky_relu", lambda x: jax.nn.leaky_relu(x, 0.1)),
    per_shape("jax.nn.glu", lambda x: jax.nn.glu(x[:, :64]), lambda x: jax.nn.glu(x[:2], axis=0)),
    along("jax.nn.softmax", lambda x, a: jax.nn.softmax(x, axis=a)),
    along("jax.nn.log_softmax", lambda x, a: jax.nn.log_softmax(x, axis=a)),
    along("jax.nn.standardize", lambda x, a: jax.nn.standardize(x, axis=a)),
    op(
        "jax.nn.one_hot",
        Sample(lambda i, dtype: jax.nn.one_hot(i, 10, dtype=dtype), (Idx((5, 7), 10),), None, True),
        Sample(lambda i, dtype: jax.nn.one_hot(i, 65, dtype=dtype), (Idx((9,), 65),), None, True),
    ),
    op(
        "layernorm",
        S(_layernorm, A((5, 65)), A((65,)), A((65,))),
        S(_layernorm, A((2, 3, 100)), A((100,)), A((100,))),
    ),
    op(
        "attention",
        S(
            lambda q, k, v: jax.nn.softmax(q @ k.swapaxes(-1, -2) / 8.0, axis=-1) @ v,
            A((2, 5, 65)),
            A((2, 7, 65)),
            A((2, 7, 33)),
        ),
    ),
    op(
        "jax.nn.dot_product_attention",
        S(jax.nn.dot_product_attention, A((2, 5, 3, 16)), A((2, 7, 3, 16)), A((2, 7, 3, 16))),
        dtypes=F32,
        note="XLA:CPU has no float16 dot_product_attention",
    ),
    # -- lax structural ops
    per_shape(
        "lax.select",
        lambda x: lax.select(x > 0, x, -x),
        lambda x: lax.select(x < 0.3, x * 3, x),
    ),
    op(
        "lax.dynamic_slice",
        S(
            lambda x, i: lax.dynamic_slice(x, (i, 0), (2, 17)),
            A((5, 65)),
            Arg((), kind="const", dtype="int32", value=2),
        ),
        S(
            lambda x, i: lax.dynamic_slice(x, (0, i), (3, 10)),
            A((3, 63)),
            Arg((), kind="const", dtype="int32", value=40),
        ),
        S(  # a start out of range: clamped, as JAX does
            lambda x, i: lax.dynamic_slice(x, (i, 5), (2, 17)),
            A((5, 65)),
            Arg((), kind="const", dtype="int32", value=9),
        ),
    ),
    op(
        "lax.dynamic_update_slice",
        S(
            lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)),
            A((5, 65)),
            A((2, 65)),
            Arg((), kind="const", dtype="int32", value=1),
        ),
        S(
            lambda x, u, i: lax.dynamic_update_slice(x, u, (1, i)),
            A((3, 63)),
            A((2, 10)),
            Arg((), kind="const", dtype="int32", value=-4),
        ),
    ),
    per_shape(
        "lax.slice",
        lambda x: lax.slice(x, (1, 3), (4, 60)),
        lambda x: lax.slice(x, (0, 0), (3, 63), (2, 3)),
    ),
    per_shape(
        "lax.pad(interior)",
        lambda x: lax.pad(x, jnp.array(0, x.dtype), ((1, 1, 1), (0, 2, 0))),
    ),
    per_shape("lax.rev", lambda x: lax.rev(x, (0,)), lambda x: lax.rev(x, (1,))),
    per_shape(
        "lax.broadcast_in_dim",
        lambda x: lax.broadcast_in_dim(x, (4, 5, 65), (1, 2)),
        lambda x: lax.broadcast_in_dim(x[:, :1], (3, 63), (0, 1)),
    ),
    per_shape("lax.reshape", lambda x: lax.reshape(x, (65, 5))),
    per_shape("lax.expand_dims", lambda x: lax.expand_dims(x, (0, 2))),
    pairs("lax.concatenate", lambda a, b: lax.concatenate([a, b], 1), (((5, 65), (5, 31)),)),
    per_shape(
        "lax.reduce_window(max)",
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3), (1, 2), "VALID"),
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3, 3), (1, 1), "SAME"),
    ),
    per_shape(
        "lax.reduce_window(sum)",
        lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 4), (1, 4), "VALID"),
    ),
    op(
        "lax.conv_general_dilated",
        S(
            lambda x, w: lax.conv_general_dilated(x, w, (1,), "VALID"),
            A((2, 3, 100)),
            A((4, 3, 5)),
        ),
    ),
    per_shape("lax.sort", lambda x: lax.sort(x, dimension=1)),
    per_shape(
        "jnp.iota+arange",
        lambda x: x + jnp.arange(x.shape[-1], dtype=x.dtype),
        lambda x: x * lax.broadcasted_iota(x.dtype, x.shape, 0),
    ),
    # -- control flow
    per_shape(
        "lax.cond",
        lambda x: lax.cond(x.sum() > 0, lambda v: v * 2, lambda v: -v, x),
        lambda x: lax.cond(x[0].sum() < 0, lambda v: (v[0], v[1] + 1), lambda v: v, (x, x * 2)),
    ),
    op(
        "lax.switch",
        *(
            S(
                lambda x, i: lax.switch(i, [lambda v: v, lambda v: jnp.sin(v), lambda v: v * 3], x),
                A((5, 65)),
                Arg((), kind="const", dtype="int32", value=k),
            )
            for k in (-2, 1, 7)  # out of range on both sides: clamped, as JAX does
        ),
    ),
    per_shape(
        "lax.fori_loop",
        lambda x: lax.fori_loop(0, 3, lambda i, v: v * 0.5 + 1, x),
        lambda x: lax.fori_loop(0, 4, lambda i, c: (c[0] + x[0] * i, c[1] * 0.9), (x[0], x))[0],
    ),
    op(
        "lax.fori_loop(traced bounds)",
        S(
            lambda x, n: lax.fori_loop(0, n, lambda i, v: v * 0.5 + 1, x),
            A((5, 65)),
            Arg((), kind="const", dtype="int32", value=3),
        ),
    ),
    per_shape(
        "lax.scan",
        lambda x: lax.scan(lambda c, r: (c + r, c * 2), jnp.zeros_like(x[0]), x),
        lambda x: lax.scan(lambda c, r: (c * 0.5 + r, c.sum()), x[-1], x, reverse=True),
        lambda x: lax.scan(lambda c, _: ((c[0] * 0.9, c[1] + 1), c[0]), (x, 0), None, length=3),
    ),
    per_shape(
        "lax.while_loop",
        lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5), (0, x))[1],
        lambda x: lax.while_loop(lambda v: jnp.max(jnp.abs(v)) > 0.1, lambda v: v * 0.5, x),
    ),
    per_shape("lax.map", lambda x: lax.map(lambda r: jnp.tanh(r) * 2, x)),
    per_shape("lax.associative_scan", lambda x: lax.associative_scan(jnp.add, x, axis=0)),
    pairs("jax.vmap", jax.vmap(lambda a, b: a @ b), (((4, 5, 65), (4, 65, 7)),)),
    per_shape("jax.checkpoint", jax.checkpoint(lambda x: jnp.sin(x) * x)),
    per_shape("jax.grad", jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2))),
]
