"""torch FX rules found missing by ``spyre-jax coverage torch``: ops that stay in the graphs
``torch.compile`` hands the backend (core ATen keeps them) and that the eager device reached
only through decompositions.

Elementwise: ``log1p``, ``expm1``, ``exp2``, ``reciprocal``, ``isnan``, ``isinf``, ``fmod``,
``hardtanh``, ``elu``, ``round(decimals=)``. Layout: ``repeat`` (a
broadcast and a reshape), ``diagonal`` (a gather along the flattened pair of dims). Reductions:
``linalg_vector_norm`` (any ``ord``: 0, inf, -inf, 1, 2, p). They register into
:data:`lowering.fx_common.RULES` when ``lowering.from_fx`` imports this module.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import sort_ops, torch_import
from .builder import Builder, Lit
from .fx_common import convert, ew, ew_raw, norm_dim, norm_dims, result, rule
from .graph import Var
from .torch_import import torch

aten = torch.ops.aten

_FLOATS = ("float16", "bfloat16", "float32")


def _float(dt: str) -> str:
    return dt if dt in _FLOATS else "float32"


for _op, _fn in {
    aten.log1p.default: "log1p",
    aten.expm1.default: "expm1",
    aten.exp2.default: "exp2",
}.items():

    def _unary(b: Builder, node: torch.fx.Node, x: Var, _fn: str = _fn) -> Var:
        shape, dt = result(node)
        return ew(b, node, _fn, convert(b, x, _float(dt)), compute=_float(dt))

    rule(_op)(_unary)


@rule(aten.reciprocal.default)
def _reciprocal(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    shape, dt = result(node)
    return convert(b, ew_raw(b, "div", [1.0, convert(b, x, dt)], shape, dt), dt)


@rule(aten.isnan.default)
def _isnan(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    if x.dtype not in _FLOATS:
        return b.full(x.shape, False, "bool")
    return b.elementwise("ne", [x, x], x.shape, "bool")


@rule(aten.isinf.default)
def _isinf(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    if x.dtype not in _FLOATS:
        return b.full(x.shape, False, "bool")
    a = b.elementwise("abs", [x], x.shape, x.dtype)
    return b.elementwise("eq", [a, Lit(math.inf, x.dtype)], x.shape, "bool")


@rule(aten.fmod.Tensor, aten.fmod.Scalar)
def _fmod(b: Builder, node: torch.fx.Node, x: Any, y: Any) -> Var:
    """C's ``fmod``: the remainder with the dividend's sign (the card's ``rem``)."""
    return ew(b, node, "rem", x, y)


@rule(aten.hardtanh.default)
def _hardtanh(b: Builder, node: torch.fx.Node, x: Var, lo: float = -1.0, hi: float = 1.0) -> Var:
    shape, dt = result(node)
    return ew_raw(b, "min", [ew_raw(b, "max", [x, lo], shape, dt), hi], shape, dt)


@rule(aten.elu.default)
def _elu(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    alpha: float = 1.0,
    scale: float = 1.0,
    input_scale: float = 1.0,
) -> Var:
    """``scale * x`` where ``x > 0``, else ``scale * alpha * (exp(input_scale * x) - 1)``."""
    shape, dt = result(node)
    neg = ew_raw(b, "expm1", [ew_raw(b, "mul", [x, input_scale], shape, dt)], shape, dt)
    neg = ew_raw(b, "mul", [neg, float(scale) * float(alpha)], shape, dt)
    pos = ew_raw(b, "mul", [x, float(scale)], shape, dt)
    gt = b.elementwise("gt", [x, Lit(0.0, x.dtype)], shape, "bool")
    return b.elementwise("select_n", [gt, neg, pos], shape, dt)


@rule(aten.round.decimals)
def _round_decimals(b: Builder, node: torch.fx.Node, x: Var, *, decimals: int = 0) -> Var:
    """torch's ``round(x, decimals=d)``: ``round(x * 10^d) / 10^d`` (half to even), as the CPU."""
    shape, dt = result(node)
    k = 10.0 ** int(decimals)
    y = (
        ew_raw(b, "mul", [x, k], shape, dt)
        if decimals >= 0
        else ew_raw(b, "div", [x, 1 / k], shape, dt)
    )
    r = b.elementwise("round", [y], shape, dt, param=1)
    return (
        ew_raw(b, "div", [r, k], shape, dt)
        if decimals >= 0
        else ew_raw(b, "mul", [r, 1 / k], shape, dt)
    )


# ---------------------------------------------------------------------------------------------
# layout


@rule(aten.repeat.default)
def _repeat(b: Builder, node: torch.fx.Node, x: Var, repeats: Any) -> Var:
    """``x.repeat(*repeats)``: ``x`` (leading 1s added to its rank) broadcast to
    ``[r0, s0, r1, s1, ...]`` and merged pairwise: copy ``r`` of dim ``k`` at ``r * s_k + j``."""
    shape, dt = result(node)
    reps = [int(r) for r in repeats]
    src = (1,) * (len(reps) - len(x.shape)) + tuple(x.shape)
    if math.prod(shape) == 0:
        return b.full(shape, 0, dt)
    v = b.reshape(x, tuple(d for s in src for d in (1, s)))
    wide = tuple(d for r, s in zip(reps, src, strict=True) for d in (r, s))
    v = b.emit("broadcast", [v], wide, v.dtype, shape=wide, dims=tuple(range(len(wide))))
    return b.reshape(v, shape)


@rule(aten.diagonal.default)
def _diagonal(
    b: Builder, node: torch.fx.Node, x: Var, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> Var:
    """``torch.diagonal``: the two dims moved last and flattened, the diagonal gathered from them
    (``[..., L]``, ``L`` its length)."""
    shape, dt = result(node)
    r = len(x.shape)
    d1, d2 = norm_dim(dim1, r), norm_dim(dim2, r)
    rest = [d for d in range(r) if d not in (d1, d2)]
    n, m = x.shape[d1], x.shape[d2]
    L = shape[-1]
    lead = tuple(x.shape[d] for d in rest)
    if L == 0 or math.prod(lead) == 0:
        return b.full(shape, 0, dt)
    t = b.transpose(x, (*rest, d1, d2)) if (*rest, d1, d2) != tuple(range(r)) else x
    flat = b.reshape(t, (*lead, n * m))
    i = np.arange(L)
    pos = (i + max(-offset, 0)) * m + i + max(offset, 0)
    idx = b.const(np.broadcast_to(pos.astype(np.int32), (*lead, L)).copy(), "int32")
    return sort_ops.take_along(b, flat, idx, len(lead))


# ---------------------------------------------------------------------------------------------
# reductions


@rule(aten.linalg_vector_norm.default)
def _vector_norm(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    ord: float = 2,
    dim: Any = None,
    keepdim: bool = False,
    *,
    dtype: Any = None,
) -> Var:
    """``torch.linalg.vector_norm``: ``ord`` inf / -inf the largest / smallest magnitude, 0 the
    count of non-zeros, 1 the sum of magnitudes, 2 the root of the sum of squares, any other
    ``p`` ``sum(|x|^p)^(1/p)``; in fp32, rounded once to the result's dtype."""
    shape, dt = result(node)
    axes = norm_dims(dim, len(x.shape))
    f = "float32"
    a = b.elementwise("abs", [convert(b, x, f)], x.shape, f)
    p = float(ord)

    def red(v: Var, kind: str) -> Var:
        if not x.shape or not axes:
            return v
        out = tuple(s for i, s in enumerate(x.shape) if i not in axes)
        r_ = b.emit("reduce", [v], out, f, kind=kind, axes=axes)
        if keepdim:
            r_ = b.reshape(r_, tuple(1 if i in axes else s for i, s in enumerate(x.shape)))
        return r_

    if math.isinf(p):
        res = red(a, "max" if p > 0 else "min")
    elif p == 0:
        nz = convert(b, b.elementwise("ne", [a, Lit(0.0, f)], x.shape, "bool"), f)
        res = red(nz, "sum")
    elif p == 1:
        res = red(a, "sum")
    elif p == 2:
        sq = b.elementwise("mul", [a, a], x.shape, f)
        s = red(sq, "sum")
        res = b.elementwise("sqrt", [s], s.shape, f)
    else:
        pw = b.elementwise("pow", [a, Lit(p, f)], x.shape, f)
        s = red(pw, "sum")
        res = b.elementwise("pow", [s, Lit(1.0 / p, f)], s.shape, f)
    if tuple(res.shape) != tuple(shape):
        res = b.reshape(res, tuple(shape))
    return convert(b, res, dt)


torch_import.finish(__name__)  # see lowering.torch_import
