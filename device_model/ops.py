"""What the compute units do: the semantics of stage bodies, written once for NumPy and JAX.

Every function here takes ``xp`` (``numpy`` or ``jax.numpy``) and works on tiles with a leading
core axis ``[cores, *block]``. The vectorized card model calls them with ``jax.numpy`` on all the
card's cores at once; the reference evaluator calls them with ``numpy`` one core at a time. One
definition, two executions: that is what keeps the two in agreement.

Precision model (see also ``device_model.numerics``): tiles are widened on the way out of the
scratchpad to the compute type (fp32 for floating types, int32 for integers, bool); PE products
accumulate in fp32; an SFU chain (a fused map body) keeps its intermediates in fp32 and rounds only
where the program says ``convert`` to a narrower float, and when the result is written back to the
scratchpad in the output's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .layout import FLOAT_DTYPES, np_dtype
from .reductions import REDUCTIONS, Reduce, Reduction, identity_value

if TYPE_CHECKING:
    from .steps import ConcatStep, SplitReduce

__all__ = [
    "InputView",
    "MapBody",
    "ELEMENTWISE",
    "ROW_REDUCTIONS",
    "Reduce",
    "Reduction",
    "REDUCTIONS",
    "TRANSCENDENTAL",
    "compute_dtype",
    "widen",
    "narrow",
    "run_map",
    "combine_partial",
    "finish_partial",
    "scan_carry",
    "reduce_identity",
    "identity_value",
    "run_concat",
    "fit",
]


# ---------------------------------------------------------------------------------------------
# body records (frozen, hashable: they are part of the schedule IR)


@dataclass(frozen=True, slots=True)
class InputView:
    """How a map reads one input: per input dim, the space dim it feeds and how.

    ``dims[j]``: space dim fed by input dim j, or -1 when the dim is dropped (it must then be read
    at the single index ``starts[j]``). ``bcast[j]``: the input contributes only index
    ``starts[j]`` along j, broadcast over the space dim. Otherwise element i of the space dim
    reads index ``starts[j] + i * strides[j]`` of the input dim.
    """

    dims: tuple[int, ...]
    starts: tuple[int, ...]
    strides: tuple[int, ...]
    bcast: tuple[bool, ...]

    @staticmethod
    def identity(rank: int) -> InputView:
        return InputView(tuple(range(rank)), (0,) * rank, (1,) * rank, (False,) * rank)

    def is_plain(self, j: int) -> bool:
        """Input dim j is read one-to-one (a candidate for tiling)."""
        return (
            self.dims[j] >= 0 and not self.bcast[j] and self.starts[j] == 0 and self.strides[j] == 1
        )


@dataclass(frozen=True, slots=True)
class MapBody:
    """A fused SFU chain over an iteration space, with an optional reduction at the end.

    ``program`` is a tuple of ``(op, args, param, dtype)``; registers 0..n_inputs-1 are the
    inputs (after their views), each op appends one register, the last is the result. ``dtype``
    is the op's logical result dtype. An op is ``const`` (param: the value), a name from
    :data:`ELEMENTWISE`, or an in-program reduction from :data:`ROW_REDUCTIONS` (param: the
    space axes reduced, kept with size 1 so that later ops broadcast the result along them; it
    accumulates in the compute type, as the final reduction does). ``reduce`` is "", or a
    :class:`Reduce` kind over ``reduce_axes`` (:data:`REDUCTIONS` says which take one axis and
    which keep the shape).
    """

    space: tuple[int, ...]
    views: tuple[InputView, ...]
    program: tuple[tuple[str, tuple[int, ...], Any, str], ...]
    reduce: str
    reduce_axes: tuple[int, ...]
    out_dtype: str

    @property
    def reduction(self) -> Reduction | None:
        """The final reduction's entry in :data:`REDUCTIONS` (None: the map reduces nothing)."""
        return REDUCTIONS[self.reduce] if self.reduce else None

    def program_reduce_axes(self) -> frozenset[int]:
        """The space axes some in-program reduction reduces (they stay whole in a block)."""
        return frozenset(a for op, _, p, _ in self.program if op in ROW_REDUCTIONS for a in p)

    def out_space_dims(self) -> tuple[int, ...]:
        """The space dims the output keeps, in order."""
        if not self.reduce or self.reduction.scan:
            return tuple(range(len(self.space)))
        return tuple(d for d in range(len(self.space)) if d not in self.reduce_axes)

    def __str__(self) -> str:
        n = len(self.views)
        regs = [f"in{i}" for i in range(n)]
        parts = []
        for k, (op, args, param, dt) in enumerate(self.program):
            a = ",".join(regs[i] for i in args)
            ptxt = f"[{param}]" if param is not None and param != () else ""
            parts.append(f"r{k}={op}{ptxt}({a}):{dt}")
            regs.append(f"r{k}")
        red = f" then {self.reduce}{list(self.reduce_axes)}" if self.reduce else ""
        return f"space={list(self.space)} " + "; ".join(parts) + red + f" -> {self.out_dtype}"


# ---------------------------------------------------------------------------------------------
# dtypes


def compute_dtype(dtype: str) -> str:
    """The type a unit computes in for a tensor dtype."""
    if dtype in FLOAT_DTYPES:
        return "float32"
    return dtype


def widen(xp: Any, x: Any, dtype: str) -> Any:
    """Scratchpad tile -> compute type."""
    return x.astype(np_dtype(compute_dtype(dtype)))


def narrow(xp: Any, x: Any, dtype: str, dl16: bool = False) -> Any:
    """Compute type -> the dtype stored (round to nearest even for floats, as a cast does).

    With ``dl16`` a float result stored as fp16/bf16 is first rounded to DL16
    (:mod:`device_model.numerics`), as the card's 16-bit units hold it.
    """
    if dtype == "bool":
        return x != 0 if x.dtype != np.bool_ else x
    if dtype in ("int32", "uint32") and x.dtype.kind == "f":
        return _float_to_int(xp, x, dtype)
    if dl16 and dtype in ("float16", "bfloat16") and x.dtype.kind == "f":
        from . import numerics

        if xp is np:
            x = numerics.round_to_dl16_np(x.astype(np.float32))
        else:
            x = numerics.round_to_dl16(x.astype(np.float32))
    return x.astype(np_dtype(dtype))


# ---------------------------------------------------------------------------------------------
# elementwise ops: name -> fn(xp, *args, param)


def _erf(xp: Any, x: Any) -> Any:
    if xp is np:
        return np.vectorize(math.erf, otypes=[np.float32])(x).astype(np.float32)
    import jax.scipy.special as jss

    return jss.erf(x)


def _erfc(xp: Any, x: Any) -> Any:
    """``1 - erf(x)`` computed directly, so it keeps its relative precision for large ``x``."""
    if xp is np:
        return np.vectorize(math.erfc, otypes=[np.float32])(x).astype(np.float32)
    import jax.scipy.special as jss

    return jss.erfc(x)


def _round_half_even(xp: Any, x: Any) -> Any:
    return xp.round(x)


def _round_away(xp: Any, x: Any) -> Any:
    return xp.sign(x) * xp.floor(xp.abs(x) + 0.5)


def _float_to_int(xp: Any, x: Any, to: str) -> Any:
    """A float to int32 or uint32 as XLA converts: toward zero, saturating at the type's range,
    NaN to 0."""
    info = np.iinfo(np_dtype(to))
    t = xp.trunc(x.astype(np.float32))
    t = xp.where(xp.isnan(t), 0, t)
    # fp32 cannot hold the int32 maximum: clamp below it, then put the saturated ends back
    lo, hi = float(info.min), float(info.max)
    r = xp.clip(t, lo, min(hi, 2.0**31 - 128 if to == "int32" else 2.0**32 - 256))
    r = r.astype(np_dtype(to))
    r = xp.where(t >= hi, np_dtype(to).type(info.max), r)
    return r


def _convert(xp: Any, x: Any, to: str) -> Any:
    src_kind = x.dtype.kind
    if to == "bool":
        return x != 0
    if to in ("int32", "uint32"):
        if src_kind == "f":
            return _float_to_int(xp, x, to)
        return x.astype(np_dtype(to))
    # to a float type: round to that type's precision, then compute in fp32 again
    y = x.astype(np.float32)
    if to != "float32":
        y = y.astype(np_dtype(to)).astype(np.float32)
    return y


def _int_pow(xp: Any, x: Any, y: int) -> Any:
    if y == 0:
        return xp.ones_like(x)
    neg = y < 0
    y = abs(y)
    acc = None
    base = x
    while y:
        if y & 1:
            acc = base if acc is None else acc * base
        y >>= 1
        if y:
            base = base * base
    return (1 / acc) if neg else acc


def _bitcast(xp: Any, a: Any, to: str) -> Any:
    """The 32 bits of ``a`` (float32, int32 or uint32) read as ``to``."""
    dt = np_dtype(to)
    if xp is np:
        return np.ascontiguousarray(a).view(dt)
    from jax import lax

    return lax.bitcast_convert_type(a, dt)


def _shift(xp: Any, a: Any, b: Any, kind: str) -> Any:
    """XLA's shifts of int32 bits: a shift by a count outside ``[0, 32)`` gives 0 (left,
    logical right) or the sign (arithmetic right); the logical right shift sees ``a`` as
    uint32."""
    big = (b < 0) | (b >= 32)
    n = xp.where(big, 0, b).astype(a.dtype)
    if kind == "left":
        return xp.where(big, 0, a << n).astype(a.dtype)
    if kind == "arith":
        return xp.where(big, a >> 31, a >> n).astype(a.dtype)
    u = a.astype(np.uint32)
    return xp.where(big, 0, (u >> n.astype(np.uint32)).astype(a.dtype)).astype(a.dtype)


#: special functions: (``jax.lax``'s, ``scipy.special``'s) name; computed in fp32 by the
#: library of each executor (the JAX one: XLA's approximations, the NumPy reference: SciPy's)
_SPECIAL = {
    "lgamma": ("lgamma", "gammaln"),
    "digamma": ("digamma", "digamma"),
    "erf_inv": ("erf_inv", "erfinv"),
    "bessel_i0e": ("bessel_i0e", "i0e"),
    "bessel_i1e": ("bessel_i1e", "i1e"),
}


def _special(xp: Any, a: Any, name: str) -> Any:
    lax_name, scipy_name = _SPECIAL[name]
    if xp is np:
        import scipy.special  # (a dependency of JAX's; imported only when the reference runs)

        return getattr(scipy.special, scipy_name)(a).astype(a.dtype)
    from jax import lax

    return getattr(lax, lax_name)(a)


def _div(xp: Any, a: Any, b: Any) -> Any:
    if a.dtype.kind in "iu" and a.dtype.itemsize < 4:  # int8/uint8: in int32 (abs(-128) fits)
        return _div(xp, a.astype(np.int32), b.astype(np.int32)).astype(a.dtype)
    if a.dtype.kind in "iu":
        # C-style integer division (truncation toward zero), as lax.div
        q = xp.abs(a) // xp.where(b == 0, 1, xp.abs(b))
        return xp.where((a < 0) ^ (b < 0), -q, q).astype(a.dtype)
    return a / b


def _rem(xp: Any, a: Any, b: Any) -> Any:
    if a.dtype.kind in "iu" and a.dtype.itemsize < 4:
        return _rem(xp, a.astype(np.int32), b.astype(np.int32)).astype(a.dtype)
    if a.dtype.kind in "iu":
        r = xp.abs(a) % xp.where(b == 0, 1, xp.abs(b))
        return xp.where(a < 0, -r, r).astype(a.dtype)
    return xp.fmod(a, b)


def _max(xp: Any, a: Any, b: Any) -> Any:
    # lax.max propagates NaN
    return xp.maximum(a, b)


def _min(xp: Any, a: Any, b: Any) -> Any:
    return xp.minimum(a, b)


def _select(xp: Any, pred: Any, *cases: Any) -> Any:
    if len(cases) == 2:
        return xp.where(
            pred.astype(bool) if pred.dtype == np.bool_ else pred != 0, cases[1], cases[0]
        )
    out = cases[0]
    for i, c in enumerate(cases[1:], start=1):
        out = xp.where(pred == i, c, out)
    return out


def _const(xp: Any, value: Any, dtype: str) -> Any:
    cd = np_dtype(compute_dtype(dtype))
    v = np.asarray(value).astype(np_dtype(dtype)).astype(cd) if dtype in FLOAT_DTYPES else value
    return xp.asarray(v, dtype=cd)


#: name -> (fn(xp, *args, param), arity). Arity -1: variadic (select_n).
ELEMENTWISE: dict[str, tuple[Any, int]] = {
    "neg": (lambda xp, a, p: -a, 1),
    "abs": (lambda xp, a, p: xp.abs(a), 1),
    "sign": (lambda xp, a, p: xp.sign(a), 1),
    "floor": (lambda xp, a, p: xp.floor(a), 1),
    "ceil": (lambda xp, a, p: xp.ceil(a), 1),
    "round": (lambda xp, a, p: _round_half_even(xp, a) if p == 1 else _round_away(xp, a), 1),
    "exp": (lambda xp, a, p: xp.exp(a), 1),
    "exp2": (lambda xp, a, p: xp.exp2(a), 1),
    "log": (lambda xp, a, p: xp.log(a), 1),
    "log1p": (lambda xp, a, p: xp.log1p(a), 1),
    "expm1": (lambda xp, a, p: xp.expm1(a), 1),
    "sqrt": (lambda xp, a, p: xp.sqrt(a), 1),
    "rsqrt": (lambda xp, a, p: 1 / xp.sqrt(a), 1),
    "tanh": (lambda xp, a, p: xp.tanh(a), 1),
    "logistic": (lambda xp, a, p: 1 / (1 + xp.exp(-a)), 1),
    "erf": (lambda xp, a, p: _erf(xp, a), 1),
    "erfc": (lambda xp, a, p: _erfc(xp, a), 1),
    "sin": (lambda xp, a, p: xp.sin(a), 1),
    "cos": (lambda xp, a, p: xp.cos(a), 1),
    # trigonometric and hyperbolic functions and their inverses, the cube root: by NumPy's name
    **{
        op: (lambda xp, a, p, f=f: getattr(xp, f)(a), 1)
        for op, f in (
            ("tan", "tan"),
            ("asin", "arcsin"),
            ("acos", "arccos"),
            ("atan", "arctan"),
            ("sinh", "sinh"),
            ("cosh", "cosh"),
            ("asinh", "arcsinh"),
            ("acosh", "arccosh"),
            ("atanh", "arctanh"),
            ("cbrt", "cbrt"),
        )
    },
    "square": (lambda xp, a, p: a * a, 1),
    "integer_pow": (lambda xp, a, p: _int_pow(xp, a, p), 1),
    "not": (lambda xp, a, p: ~a if a.dtype == np.bool_ else ~a, 1),
    "is_finite": (lambda xp, a, p: xp.isfinite(a), 1),
    "convert": (lambda xp, a, p: _convert(xp, a, p), 1),
    "copy": (lambda xp, a, p: a, 1),
    "bitcast": (lambda xp, a, p: _bitcast(xp, a, p), 1),
    "add": (lambda xp, a, b, p: a + b, 2),
    "sub": (lambda xp, a, b, p: a - b, 2),
    "mul": (lambda xp, a, b, p: a * b, 2),
    "div": (lambda xp, a, b, p: _div(xp, a, b), 2),
    "rem": (lambda xp, a, b, p: _rem(xp, a, b), 2),
    "pow": (lambda xp, a, b, p: xp.power(a, b), 2),
    "max": (lambda xp, a, b, p: _max(xp, a, b), 2),
    "min": (lambda xp, a, b, p: _min(xp, a, b), 2),
    "atan2": (lambda xp, a, b, p: xp.arctan2(a, b), 2),
    **{op: (lambda xp, a, p, op=op: _special(xp, a, op), 1) for op in _SPECIAL},
    "nextafter": (lambda xp, a, b, p: xp.nextafter(a, b), 2),
    "shl": (lambda xp, a, b, p: _shift(xp, a, b, "left"), 2),
    "shr": (lambda xp, a, b, p: _shift(xp, a, b, "arith"), 2),
    "shr_logical": (lambda xp, a, b, p: _shift(xp, a, b, "logical"), 2),
    "and": (lambda xp, a, b, p: a & b, 2),
    "or": (lambda xp, a, b, p: a | b, 2),
    "xor": (lambda xp, a, b, p: a ^ b, 2),
    "eq": (lambda xp, a, b, p: a == b, 2),
    "ne": (lambda xp, a, b, p: a != b, 2),
    "lt": (lambda xp, a, b, p: a < b, 2),
    "le": (lambda xp, a, b, p: a <= b, 2),
    "gt": (lambda xp, a, b, p: a > b, 2),
    "ge": (lambda xp, a, b, p: a >= b, 2),
    "select_n": (lambda xp, *a: _select(xp, *a[:-1]), -1),
}

#: in-program reductions over space axes (param: the axes; the result keeps them with size 1)
#: -> the kind of :func:`_reduce` they compute
ROW_REDUCTIONS: dict[str, str] = {"rsum": "sum", "rmax": "max", "rmin": "min", "rprod": "prod"}

#: ops the SFU evaluates with several passes (for the timing model)
TRANSCENDENTAL = frozenset(
    {
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "sqrt",
        "rsqrt",
        "tanh",
        "logistic",
        "erf",
        "erfc",
        "sin",
        "cos",
        "lgamma",
        "digamma",
        "erf_inv",
        "bessel_i0e",
        "bessel_i1e",
        "tan",
        "asin",
        "acos",
        "atan",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
        "cbrt",
        "pow",
        "atan2",
        "div",
    }
)


# ---------------------------------------------------------------------------------------------
# tile helpers


def fit(xp: Any, x: Any, shape: tuple[int, ...], lead: int = 1) -> Any:
    """Slice or zero-pad ``x`` (with ``lead`` leading axes untouched) to ``shape``."""
    cur = x.shape[lead:]
    if tuple(cur) == tuple(shape):
        return x
    idx = (slice(None),) * lead + tuple(
        slice(0, min(c, s)) for c, s in zip(cur, shape, strict=True)
    )
    x = x[idx]
    pads = [(0, 0)] * lead + [(0, max(0, s - c)) for c, s in zip(cur, shape, strict=True)]
    if any(p[1] for p in pads):
        x = xp.pad(x, pads)
    return x


def view_tile(xp: Any, x: Any, view: InputView, space_block: tuple[int, ...]) -> Any:
    """An input tile ``[C, *in_block]`` seen in the space block's dims ``[C, *space_block]``.

    Dims read one-to-one are fit to the space block (which slices stick padding off); broadcast
    dims become size 1 and array broadcasting does the rest.
    """
    idx: list[Any] = [slice(None)]
    kept: list[tuple[int, bool]] = []  # (space dim, broadcast?) per kept input dim
    for j in range(len(view.dims)):
        g = view.dims[j]
        if g < 0:
            idx.append(view.starts[j])
        elif view.bcast[j]:
            idx.append(slice(view.starts[j], view.starts[j] + 1))
            kept.append((g, True))
        elif view.starts[j] != 0 or view.strides[j] != 1:
            n = space_block[g]
            stop = view.starts[j] + (n - 1) * view.strides[j] + 1
            idx.append(slice(view.starts[j], stop, view.strides[j]))
            kept.append((g, False))
        else:
            idx.append(slice(None))
            kept.append((g, False))
    x = x[tuple(idx)]
    order = sorted(range(len(kept)), key=lambda i: kept[i][0])
    if order != list(range(len(kept))):
        x = xp.transpose(x, (0, *[1 + i for i in order]))
    by_space = {kept[i][0]: (pos, kept[i][1]) for pos, i in enumerate(order)}
    shape = [x.shape[0]]
    target = []
    for g in range(len(space_block)):
        if g in by_space:
            pos, bc = by_space[g]
            shape.append(x.shape[1 + pos])
            target.append(1 if bc else space_block[g])
        else:
            shape.append(1)
            target.append(1)
    x = x.reshape(shape)
    return fit(xp, x, tuple(target))


def _row_reduce(
    xp: Any, x: Any, kind: str, axes: tuple[int, ...], space_block: tuple[int, ...]
) -> Any:
    """An in-program reduction of a register ``[C or 1, *space]`` over space ``axes``, kept.

    A register may be broadcast (size 1, or rank 0 for a constant) along the axes: it is
    widened to the block first, so a sum counts every element of the row.
    """
    if x.ndim == 0:
        x = x.reshape((1,) * (1 + len(space_block)))
    shape = tuple(
        space_block[g - 1] if g >= 1 and g - 1 in axes else n for g, n in enumerate(x.shape)
    )
    if shape != x.shape:
        x = xp.broadcast_to(x, shape)
    r = _reduce(xp, x, kind, axes)
    return xp.expand_dims(r, tuple(1 + a for a in sorted(axes)))


def run_program(
    xp: Any, body: MapBody, inputs: list[Any], space_block: tuple[int, ...] | None = None
) -> Any:
    """Evaluate a map body's program on input tiles already seen in space dims.

    ``space_block``: the logical extent of the block (needed by in-program reductions; defaults
    to the whole space).
    """
    block = tuple(body.space) if space_block is None else tuple(space_block)
    regs = list(inputs)
    for op, args, param, dtype in body.program:
        if op == "const":
            regs.append(_const(xp, param, dtype))
            continue
        a = [regs[i] for i in args]
        if op in ROW_REDUCTIONS:
            regs.append(_row_reduce(xp, a[0], ROW_REDUCTIONS[op], tuple(param), block))
        else:
            fn, arity = ELEMENTWISE[op]
            regs.append(fn(xp, *a, param))
        r = regs[-1]
        want = np_dtype(compute_dtype(dtype))
        if hasattr(r, "dtype") and r.dtype != want:
            regs[-1] = r.astype(want)
    return regs[-1]


def _reduce(xp: Any, x: Any, kind: str, axes: tuple[int, ...]) -> Any:
    return REDUCTIONS[kind].whole(xp, x, axes)


def run_map(
    xp: Any,
    body: MapBody,
    tiles: list[Any],
    in_dtypes: list[str],
    space_block: tuple[int, ...],
    ncores: int,
    *,
    final: bool = True,
    split: SplitReduce | None = None,
    coord: Any = None,
) -> Any:
    """A map stage's compute on one step: input tiles -> output tile ``[C, *space_block]`` in
    the compute type (space dims), through the final reduction unless ``final`` is False. With
    ``split``, one step of a reduction split across steps (block ``coord`` of the split axis;
    see :func:`_partial`)."""
    seen = []
    for t, dt, v in zip(tiles, in_dtypes, body.views, strict=True):
        if not v.dims:  # a rank-0 tensor: element 0 of its one stick
            t = t[:, 0]
        seen.append(view_tile(xp, widen(xp, t, dt), v, space_block))
    r = run_program(xp, body, seen, space_block)
    c = ncores
    if not hasattr(r, "shape") or r.shape != (c, *space_block):
        r = xp.broadcast_to(r, (c, *space_block))
    if split is not None:
        return _partial(xp, body, r, split, coord, space_block)
    if final and body.reduce:
        r = _reduce(xp, r, body.reduce, body.reduce_axes)
    return r


def reduce_identity(kind: str, dtype: Any) -> Any:
    """The value a reduction of ``kind`` gives over no elements, in ``dtype`` (a NumPy dtype):
    :meth:`Reduction.identity_value` (argmax/argmin: their values' identity, so a masked
    element never wins a tie; the first index does)."""
    return REDUCTIONS[kind].identity_value(dtype)


def _split_mask(xp: Any, split: SplitReduce, n: int, ndim: int, coord: Any) -> Any:
    """Which of a block's ``n`` elements along the split axis lie inside the extent, shaped to
    broadcast against a ``[C, *space_block]`` register of ``ndim`` dims."""
    pos = coord * split.block + xp.arange(n)
    valid = pos < split.extent
    shape = [1] * ndim
    shape[1 + split.axis] = n
    return valid.reshape(shape)


def _partial(
    xp: Any, body: MapBody, r: Any, split: SplitReduce, coord: Any, space_block: tuple[int, ...]
) -> Any:
    """One step of a split reduction (:class:`SplitReduce`): the reduction of this block of the
    split axis (block ``coord``; elements past the extent masked to the identity). sum, prod,
    max, min: ``[C, *kept]``; argmax/argmin: ``(values, indices)``, the indices counted from
    the start of the axis; a scan (cumsum...): the block's own running results
    ``[C, *space_block]``."""
    kind = body.reduce
    valid = _split_mask(xp, split, space_block[split.axis], r.ndim, coord)
    fill = reduce_identity(kind, r.dtype)
    r = xp.where(valid, r, xp.asarray(fill, dtype=r.dtype))
    red = REDUCTIONS[kind]
    if red.index_of:
        vals = _reduce(xp, r, red.index_of, body.reduce_axes)
        idx = red.whole(xp, r, body.reduce_axes) + (coord * split.block)
        return vals, idx.astype(np.int32)
    return red.whole(xp, r, body.reduce_axes)


def combine_partial(xp: Any, kind: str, acc: Any, part: Any, first: Any) -> Any:
    """The accumulator after one more block: ``part`` alone on the ``first`` block (a Python
    bool or a traced one), else ``acc`` combined with it (argmax/argmin: pairs of values and
    indices; a later block wins only when strictly better, or NaN against a number)."""
    if first is True:
        return part
    red = REDUCTIONS[kind]
    if red.index_of:
        (av, ai), (pv, pi) = acc, part
        better = pv > av if red.index_of == "max" else pv < av
        if np.dtype(pv.dtype).kind == "f":
            better = better | (xp.isnan(pv) & ~xp.isnan(av))
        new = (xp.where(better, pv, av), xp.where(better, pi, ai))
        if first is False:
            return new
        return (xp.where(first, pv, new[0]), xp.where(first, pi, new[1]))
    if red.combine is None:
        raise ValueError(f"a {kind} keeps no accumulator to combine")
    new = red.combine(xp, acc, part)
    if first is False:
        return new
    return xp.where(first, part, new)


def finish_partial(kind: str, acc: Any) -> Any:
    """The reduction's result from its accumulator (the index, for argmax/argmin)."""
    return acc[1] if REDUCTIONS[kind].index_of else acc


def scan_carry(xp: Any, kind: str, local: Any, carry: Any, first: Any, split: SplitReduce) -> Any:
    """One block of a split running reduction (cumsum, cummax...): ``(output block, new
    carry)``. The output is the block's own running results combined with the carry (the
    result of the blocks before it in the scan's direction; none on the ``first`` block); the
    new carry is the output at the block's far edge (kept with size 1 along the axis)."""
    a = 1 + split.axis
    combine = REDUCTIONS[kind].combine
    if first is True:
        out = local
    elif first is False:
        out = combine(xp, carry, local)
    else:
        out = xp.where(first, local, combine(xp, carry, local))
    n = out.shape[a]
    edge = 0 if split.reverse else n - 1
    idx = [slice(None)] * out.ndim
    idx[a] = slice(edge, edge + 1)
    return out, out[tuple(idx)]


def run_concat(xp: Any, body: ConcatStep, tiles: list[Any], kcoord: Any) -> Any:
    """A concatenation's output tile. Untiled (``body.tile`` 0): each input tile's own
    ``sizes[i]`` positions along the axis, one after another. Tiled: from each input's window
    tile ``[C, *block_i]`` the positions of output block ``kcoord`` (``[C]``, each core's
    coordinate along the axis) that fall in that input's range; 0 where none does."""
    a, b = 1 + body.axis, body.tile
    if not b:
        parts = []
        for x, n in zip(tiles, body.sizes, strict=True):
            sl = [slice(None)] * x.ndim
            sl[a] = slice(0, n)
            parts.append(x[tuple(sl)])
        return xp.concatenate(parts, axis=a)
    pos = kcoord.reshape(-1, 1) * b + xp.arange(b).reshape(1, -1)  # [C, b]
    out = None
    for x, off, n, lo in zip(tiles, body.offsets, body.sizes, body.local, strict=True):
        idx = [slice(None)] * x.ndim
        idx[a] = slice(lo, lo + b)
        x = x[tuple(idx)]
        m = (pos >= off) & (pos < off + n)
        shape = [1] * x.ndim
        shape[0], shape[a] = m.shape[0], b
        m = m.reshape(shape)
        out = xp.where(m, x, xp.zeros((), x.dtype) if out is None else out)
    return out


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES
