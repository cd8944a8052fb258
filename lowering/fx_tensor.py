"""torch FX rules: layout and movement, reductions, matmuls and gathers.

They register into :data:`lowering.fx_common.RULES` when ``lowering.from_fx`` imports this module.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import indexing, torch_import
from .builder import Builder, Lit
from .errors import LoweringError
from .fx_common import (
    bcast,
    card_dtype,
    convert,
    ew_raw,
    meta_val,
    norm_dim,
    norm_dims,
    operand,
    result,
    rule,
)
from .graph import Var
from .torch_import import torch

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# rules: layout and movement


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(b: Builder, node: torch.fx.Node, x: Var, size: Any) -> Var:
    shape, _ = result(node)
    return b.reshape(x, shape)


@rule(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(b: Builder, node: torch.fx.Node, x: Var, *a: Any) -> Var:
    shape, _ = result(node)
    return b.reshape(x, shape)


@rule(aten.permute.default)
def _permute(b: Builder, node: torch.fx.Node, x: Var, dims: Any) -> Var:
    return b.transpose(x, tuple(norm_dim(int(d), len(x.shape)) for d in dims))


@rule(aten.t.default)
def _t(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    return b.transpose(x, (1, 0)) if len(x.shape) == 2 else x


@rule(aten.transpose.int)
def _transpose(b: Builder, node: torch.fx.Node, x: Var, d0: int, d1: int) -> Var:
    r = len(x.shape)
    perm = list(range(r))
    d0, d1 = norm_dim(d0, r), norm_dim(d1, r)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return b.transpose(x, tuple(perm))


@rule(aten.expand.default)
def _expand(b: Builder, node: torch.fx.Node, x: Var, size: Any, **kw: Any) -> Var:
    shape, _ = result(node)
    return bcast(b, x, shape)


def _slice_dim(b: Builder, x: Var, dim: int, start: int, end: int, step: int = 1) -> Var:
    r = len(x.shape)
    n = x.shape[dim]
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(start, min(n, end + n if end < 0 else end))
    if start == 0 and end == n and step == 1:
        return x
    st = [0] * r
    li = list(x.shape)
    sd = [1] * r
    st[dim], li[dim], sd[dim] = start, end, step
    shape = list(x.shape)
    shape[dim] = max(0, -(-(end - start) // step))
    return b.emit(
        "slice", [x], tuple(shape), x.dtype, starts=tuple(st), limits=tuple(li), strides=tuple(sd)
    )


@rule(aten.slice.Tensor)
def _slice(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    dim: int = 0,
    start: Any = None,
    end: Any = None,
    step: int = 1,
) -> Var:
    d = norm_dim(dim, len(x.shape))
    n = x.shape[d]
    return _slice_dim(
        b,
        x,
        d,
        0 if start is None else int(start),
        n if end is None else min(int(end), n),
        int(step),
    )


@rule(aten.select.int)
def _select(b: Builder, node: torch.fx.Node, x: Var, dim: int, index: int) -> Var:
    d = norm_dim(dim, len(x.shape))
    i = index + x.shape[d] if index < 0 else index
    shape, _ = result(node)
    return b.reshape(_slice_dim(b, x, d, i, i + 1), shape)


@rule(aten.split_with_sizes.default, aten.split.Tensor)
def _split(b: Builder, node: torch.fx.Node, x: Var, sizes: Any, dim: int = 0) -> tuple:
    d = norm_dim(dim, len(x.shape))
    n = x.shape[d]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
    outs, start = [], 0
    for s in sizes:
        outs.append(_slice_dim(b, x, d, start, start + int(s)))
        start += int(s)
    return tuple(outs)


@rule(aten.cat.default)
def _cat(b: Builder, node: torch.fx.Node, xs: Any, dim: int = 0) -> Var:
    shape, dt = result(node)
    vs = [convert(b, x, dt) for x in xs if isinstance(x, Var) and math.prod(x.shape) > 0]
    if len(vs) == 1:
        return vs[0]
    d = norm_dim(dim, len(shape))
    return b.emit("concatenate", vs, shape, dt, axis=d)


@rule(aten.constant_pad_nd.default)
def _constant_pad(b: Builder, node: torch.fx.Node, x: Var, pad: Any, value: Any = 0) -> Var:
    """``F.pad(x, pad, value=...)``: ``pad`` pairs (low, high) from the last dim backwards;
    negative amounts slice elements off."""
    shape, dt = result(node)
    r = len(x.shape)
    config = [(0, 0, 0)] * r
    for i in range(len(pad) // 2):
        config[r - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]), 0)
    fill = Lit(bool(value) if dt == "bool" else value, dt)
    y = b.pad(x, fill, config)
    if y.shape != shape:  # pragma: no cover - Builder.pad follows ATen's arithmetic
        raise LoweringError(f"spyre: constant_pad_nd gave {y.shape}, expected {shape}")
    return y


# ---------------------------------------------------------------------------------------------
# rules: reductions


def _reduce(b: Builder, x: Var, kind: str, axes: tuple[int, ...], keep: bool, dt: str) -> Var:
    if not x.shape:  # a rank-0 tensor: ATen takes dim 0 / -1 on it and reduces nothing
        axes = ()
        if kind in ("argmax", "argmin"):
            return b.const(np.zeros((), np.int32), "int32")
    if not axes:
        return convert(b, x, dt)
    shape = tuple(s for i, s in enumerate(x.shape) if i not in axes)
    r = b.emit("reduce", [x], shape, dt, kind=kind, axes=axes)
    if keep:
        r = b.reshape(r, tuple(1 if i in axes else s for i, s in enumerate(x.shape)))
    return r


@rule(aten.sum.dim_IntList, aten.sum.default)
def _sum(
    b: Builder, node: torch.fx.Node, x: Var, dims: Any = None, keepdim: bool = False, **kw: Any
) -> Var:
    _, dt = result(node)
    return _reduce(b, convert(b, x, dt), "sum", norm_dims(dims, len(x.shape)), keepdim, dt)


@rule(aten.mean.dim, aten.mean.default)
def _mean(
    b: Builder, node: torch.fx.Node, x: Var, dims: Any = None, keepdim: bool = False, **kw: Any
) -> Var:
    shape, dt = result(node)
    axes = norm_dims(dims, len(x.shape))
    s = _reduce(b, convert(b, x, dt), "sum", axes, keepdim, dt)
    n = math.prod(x.shape[a] for a in axes)
    return b.elementwise("div", [s, Lit(float(n), dt)], s.shape, dt)


@rule(aten.amax.default, aten.amin.default)
def _amax(b: Builder, node: torch.fx.Node, x: Var, dims: Any = (), keepdim: bool = False) -> Var:
    _, dt = result(node)
    kind = "max" if node.target is aten.amax.default else "min"
    return _reduce(b, x, kind, norm_dims(dims or None, len(x.shape)), keepdim, dt)


@rule(aten.max.default, aten.min.default)
def _max_all(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    """``x.max()`` / ``x.min()`` with no dim: over every element, a rank-0 result."""
    kind = "max" if node.target is aten.max.default else "min"
    return _reduce(b, x, kind, tuple(range(len(x.shape))), False, x.dtype)


@rule(aten.max.dim, aten.min.dim)
def _max_dim(b: Builder, node: torch.fx.Node, x: Var, dim: int, keepdim: bool = False) -> tuple:
    d = norm_dim(dim, len(x.shape))
    big = node.target is aten.max.dim
    v = _reduce(b, x, "max" if big else "min", (d,), keepdim, x.dtype)
    i = _reduce(b, x, "argmax" if big else "argmin", (d,), keepdim, "int32")
    return (v, i)


@rule(aten.argmax.default, aten.argmin.default)
def _argmax(b: Builder, node: torch.fx.Node, x: Var, dim: Any = None, keepdim: bool = False) -> Var:
    kind = "argmax" if node.target is aten.argmax.default else "argmin"
    if dim is None:
        x = b.reshape(x, (math.prod(x.shape),))
        dim = 0
    return _reduce(b, x, kind, (norm_dim(dim, len(x.shape)),), keepdim, "int32")


@rule(aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim, aten.all.default)
def _any(b: Builder, node: torch.fx.Node, x: Var, dim: Any = None, keepdim: bool = False) -> Var:
    is_any = node.target in (aten.any.dim, aten.any.dims, aten.any.default)
    v = convert(b, convert(b, x, "bool"), "int32")
    r = _reduce(b, v, "max" if is_any else "min", norm_dims(dim, len(x.shape)), keepdim, "int32")
    # > 0, not != 0: over no elements max gives INT32_MIN (any of nothing is False)
    return b.elementwise("gt", [r, Lit(0, "int32")], r.shape, "bool")


@rule(aten.flip.default)
def _flip(b: Builder, node: torch.fx.Node, x: Var, dims: Any) -> Var:
    return indexing.reverse(b, x, tuple(norm_dim(d, len(x.shape)) for d in dims))


_CUMULATIVE = {
    aten.cumsum.default: "cumsum",
    aten.cumprod.default: "cumprod",
    aten.logcumsumexp.default: "cumlogsumexp",
    aten.cummax.default: "cummax",
    aten.cummin.default: "cummin",
}


@rule(*_CUMULATIVE)
def _cumulative(b: Builder, node: torch.fx.Node, x: Var, dim: int, **kw: Any) -> Any:
    shape, dt = result(node)
    kind = _CUMULATIVE[node.target]
    y = convert(b, x, dt)
    if x.shape:  # (the running result of one element is itself)
        y = b.emit("reduce", [y], shape, dt, kind=kind, axes=(norm_dim(dim, len(x.shape)),))
    if kind not in ("cummax", "cummin"):
        return y
    return (y, _cum_index(b, x, y, norm_dim(dim, len(x.shape)) if x.shape else 0))


def _cum_index(b: Builder, x: Var, y: Var, d: int) -> Var:
    """cummax/cummin's indices: at each position the last one so far that holds the running
    result (torch's choice on ties). Such a position holds its own running result too, so it
    is the running max of the positions where ``x`` equals its running result."""
    if not x.shape:
        return b.const(np.zeros((), np.int32), "int32")
    io = np.arange(x.shape[d], dtype=np.int32).reshape(
        [-1 if j == d else 1 for j in range(len(x.shape))]
    )
    pos = b.const(np.broadcast_to(io, x.shape).astype(np.int32), "int32")
    xv = convert(b, x, y.dtype)
    hit = b.elementwise("eq", [xv, y], x.shape, "bool")
    if y.dtype.startswith(("float", "bfloat")):  # a NaN is the running result from there on
        nan = b.elementwise("ne", [xv, xv], x.shape, "bool")
        hit = b.elementwise("or", [hit, nan], x.shape, "bool")
    at = b.elementwise("select_n", [hit, Lit(0, "int32"), pos], x.shape, "int32")
    return b.emit("reduce", [at], x.shape, "int32", kind="cummax", axes=(d,))


@rule(aten.var.correction, aten.var.dim)
def _var(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    dims: Any = None,
    *a: Any,
    correction: Any = None,
    keepdim: bool = False,
    unbiased: Any = None,
) -> Var:
    shape, dt = result(node)
    if a and isinstance(a[0], bool):  # var.dim(x, dims, unbiased, keepdim)
        unbiased = a[0]
        keepdim = a[1] if len(a) > 1 else keepdim
    corr = correction if correction is not None else (1 if unbiased in (None, True) else 0)
    axes = norm_dims(dims, len(x.shape))
    n = math.prod(x.shape[i] for i in axes)
    xv = convert(b, x, dt)
    m = _reduce(b, xv, "sum", axes, True, dt)
    m = b.elementwise("div", [m, Lit(float(n), dt)], m.shape, dt)
    dlt = ew_raw(b, "sub", [xv, bcast(b, m, xv.shape)], xv.shape, dt)
    sq = b.elementwise("mul", [dlt, dlt], xv.shape, dt)
    s = _reduce(b, sq, "sum", axes, keepdim, dt)
    return b.elementwise("div", [s, Lit(float(max(n - corr, 0)), dt)], s.shape, dt)


@rule(aten._softmax.default, aten._log_softmax.default)
def _softmax(b: Builder, node: torch.fx.Node, x: Var, dim: int, half_to_float: bool) -> Var:
    shape, dt = result(node)
    d = norm_dim(dim, len(x.shape))
    cdt = "float32" if x.dtype != "float32" else dt
    xv = convert(b, x, cdt)
    m = bcast(b, _reduce(b, xv, "max", (d,), True, cdt), shape)
    z = b.elementwise("sub", [xv, m], shape, cdt)
    e = b.elementwise("exp", [z], shape, cdt)
    s = bcast(b, _reduce(b, e, "sum", (d,), True, cdt), shape)
    if node.target is aten._log_softmax.default:
        r = b.elementwise("sub", [z, b.elementwise("log", [s], shape, cdt)], shape, cdt)
    else:
        r = b.elementwise("div", [e, s], shape, cdt)
    return convert(b, r, dt)


@rule(aten.native_layer_norm.default)
def _layer_norm(
    b: Builder, node: torch.fx.Node, x: Var, normalized_shape: Any, w: Any, bias: Any, eps: float
) -> tuple:
    shape, dt = result(node)
    k = len(normalized_shape)
    axes = tuple(range(len(shape) - k, len(shape)))
    n = math.prod(shape[a] for a in axes)
    cdt = "float32"
    xv = convert(b, x, cdt)
    mean = b.elementwise(
        "div",
        [_reduce(b, xv, "sum", axes, True, cdt), Lit(float(n), cdt)],
        None or tuple(1 if i in axes else s for i, s in enumerate(shape)),
        cdt,
    )
    d = b.elementwise("sub", [xv, bcast(b, mean, shape)], shape, cdt)
    var = b.elementwise(
        "div",
        [
            _reduce(b, b.elementwise("mul", [d, d], shape, cdt), "sum", axes, True, cdt),
            Lit(float(n), cdt),
        ],
        mean.shape,
        cdt,
    )
    rstd = b.elementwise(
        "rsqrt",
        [b.elementwise("add", [var, Lit(float(eps), cdt)], mean.shape, cdt)],
        mean.shape,
        cdt,
    )
    y = b.elementwise("mul", [d, bcast(b, rstd, shape)], shape, cdt)
    if isinstance(w, Var):
        y = b.elementwise("mul", [y, bcast(b, convert(b, w, cdt), shape)], shape, cdt)
    if isinstance(bias, Var):
        y = b.elementwise("add", [y, bcast(b, convert(b, bias, cdt), shape)], shape, cdt)
    stat_dt = card_dtype(meta_val(node)[1].dtype)
    return (convert(b, y, dt), convert(b, mean, stat_dt), convert(b, rstd, stat_dt))


# ---------------------------------------------------------------------------------------------
# rules: matmul and gathers


def _matmul3(b: Builder, a: Var, c: Var, dt: str) -> Var:
    bsz, m, k = a.shape
    n = c.shape[2]
    return b.emit("matmul", [a, c], (bsz, m, n), dt, dtype=dt)


@rule(aten.mm.default)
def _mm(b: Builder, node: torch.fx.Node, x: Var, y: Var) -> Var:
    shape, dt = result(node)
    r = _matmul3(b, b.reshape(x, (1, *x.shape)), b.reshape(y, (1, *y.shape)), dt)
    return b.reshape(r, shape)


@rule(aten.bmm.default)
def _bmm(b: Builder, node: torch.fx.Node, x: Var, y: Var) -> Var:
    _, dt = result(node)
    return _matmul3(b, x, y, dt)


@rule(aten.addmm.default)
def _addmm(
    b: Builder, node: torch.fx.Node, bias: Any, x: Var, y: Var, *, beta: Any = 1, alpha: Any = 1
) -> Var:
    shape, dt = result(node)
    r = b.reshape(_matmul3(b, b.reshape(x, (1, *x.shape)), b.reshape(y, (1, *y.shape)), dt), shape)
    if alpha != 1:
        r = b.elementwise("mul", [r, Lit(alpha, dt)], shape, dt)
    if beta == 0:
        return r
    bias_t = operand(b, bias, shape, dt)
    if beta != 1:
        bias_t = b.elementwise("mul", [bias_t, Lit(beta, dt)], shape, dt)
    return b.elementwise("add", [r, bias_t], shape, dt)


@rule(aten.embedding.default)
def _embedding(b: Builder, node: torch.fx.Node, w: Var, idx: Var, *a: Any, **kw: Any) -> Var:
    shape, dt = result(node)
    flat = b.reshape(convert(b, idx, "int32"), (math.prod(idx.shape),))
    width = math.prod(w.shape[1:])
    tab = b.reshape(w, (w.shape[0], width))
    g = b.emit("gather", [tab, flat], (flat.shape[0], width), dt, mode="clip")
    return b.reshape(g, shape)


@rule(aten.index_select.default)
def _index_select(b: Builder, node: torch.fx.Node, x: Var, dim: int, idx: Var) -> Var:
    shape, dt = result(node)
    if not x.shape:  # a 0-d tensor: its one element (the index can only be 0), as a [1]
        if math.prod(idx.shape) != 1:
            raise LoweringError(
                f"index_select(): Index to scalar can have only 1 value, got "
                f"{math.prod(idx.shape)} value(s)"
            )
        x = b.reshape(x, (1,))
        dim = 0
    d = norm_dim(dim, len(x.shape))
    perm = (d, *[i for i in range(len(x.shape)) if i != d])
    xt = b.transpose(x, perm)
    flat = b.reshape(convert(b, idx, "int32"), (math.prod(idx.shape),))
    width = math.prod(xt.shape[1:])
    g = b.emit(
        "gather",
        [b.reshape(xt, (xt.shape[0], width)), flat],
        (flat.shape[0], width),
        dt,
        mode="clip",
    )
    g = b.reshape(g, (flat.shape[0], *xt.shape[1:]))
    inv = tuple(int(i) for i in np.argsort(perm))
    out = b.transpose(g, inv)
    return out if out.shape == tuple(shape) else b.reshape(out, tuple(shape))


def _indexable(node: torch.fx.Node) -> bool:
    """``x[i0, i1, ...]`` with integer index tensors on adjacent dims (``None`` for whole dims
    before or after them): the form ``aten.index.Tensor`` has a rule for. Boolean masks (whose
    result size depends on the data) and index tensors on dims apart run on the CPU."""
    idx = node.args[1]
    pos = [i for i, t in enumerate(idx) if t is not None]
    if not pos or pos != list(range(pos[0], pos[0] + len(pos))):
        return False
    for i in pos:
        v = meta_val(idx[i]) if isinstance(idx[i], torch.fx.Node) else None
        if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype == torch.bool:
            return False
    return True


@rule(aten.index.Tensor, when=_indexable)
def _index(b: Builder, node: torch.fx.Node, x: Var, indices: list[Any]) -> Var:
    """Advanced indexing as one row gather: the indexed dims (moved first) flattened into the
    table's rows, the others into its row; each result element's row is the sum of its index
    tensors (broadcast together, negatives counted from the end) times the dims' strides. The
    broadcast dims land where the indexed dims were."""
    shape, dt = result(node)
    pos = [i for i, t in enumerate(indices) if t is not None]
    p, k, r = pos[0], len(pos), len(x.shape)
    perm = (*range(p, p + k), *range(p), *range(p + k, r))
    xt = b.transpose(x, perm) if perm != tuple(range(r)) else x
    lead, rest = x.shape[p : p + k], (*x.shape[:p], *x.shape[p + k :])
    bshape = shape[p : p + len(shape) - len(rest)]
    off: Var | None = None
    for j, i in enumerate(pos):
        t = operand(b, indices[i], bshape, "int32")
        n, stride = lead[j], math.prod(lead[j + 1 :])
        neg = b.elementwise("lt", [t, Lit(0, "int32")], bshape, "bool")
        wrapped = b.elementwise("add", [t, Lit(n, "int32")], bshape, "int32")
        t = b.elementwise("select_n", [neg, t, wrapped], bshape, "int32")
        term = ew_raw(b, "mul", [t, stride], bshape, "int32") if stride != 1 else t
        off = term if off is None else b.elementwise("add", [off, term], bshape, "int32")
    assert off is not None
    flat = b.reshape(off, (math.prod(bshape),))
    width = math.prod(rest)
    tab = b.reshape(xt, (math.prod(lead), width))
    g = b.emit("gather", [tab, flat], (flat.shape[0], width), dt, mode="clip")
    g = b.reshape(g, (*bshape, *rest))
    nb = len(bshape)
    back = (*range(nb, nb + p), *range(nb), *range(nb + p, nb + len(rest)))
    return b.transpose(g, back) if back != tuple(range(len(back))) else g


torch_import.finish(__name__)  # see lowering.torch_import
