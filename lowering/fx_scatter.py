"""torch FX rules: scatters and indexed updates (``scatter``, ``scatter_add``,
``scatter_reduce``, ``index_put``, ``index_add``, ``index_copy``).

Every one of them is :func:`lowering.indexing.scatter` (the JAX importer's scatter: each result
row matched against every update's row, the matching updates merged into it) with the index
written as full coordinates:

* ``scatter``-family ops address single elements: update ``p`` of ``index`` goes to ``p`` with
  coordinate ``dim`` replaced by ``index[p]``; the coordinates of every dim are the scattered
  dims and a row is one element (a ``[numel(self), numel(index)]`` match).
* ``index_put`` addresses the indexed dims (rows of them, the other dims a row's elements);
  ``index_add`` and ``index_copy`` are ``index_put`` on one dim.

Negative indices count from the end, as ATen's ``index_put`` does (``index_add`` and
``index_copy`` reach a compiled graph as ``index_put``; on the CPU their own kernels and the
scatters raise for them). Other out-of-range indices are dropped. Of duplicate indices the
accumulating forms merge all of them; a plain scatter or ``index_put`` takes the last (torch
leaves it undefined). A boolean mask is taken by ``index_put`` when its value is one element
(``x[mask] = v``: a select); with a value per masked element the result's layout depends on the
data, and it runs on the CPU. So does a scatter whose match is past :data:`_MAX_MATCH`.

They register into :data:`lowering.fx_common.RULES` when ``lowering.from_fx`` imports this module.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from device_model.layout import np_dtype
from device_model.ops import REDUCTIONS

from . import indexing, sort_ops, torch_import
from .builder import Builder, Lit
from .fx_common import bcast, convert, ew_raw, meta_val, norm_dim, result, rule, take
from .graph import Var
from .torch_import import torch

aten = torch.ops.aten

_I32 = "int32"

#: torch's reduce names -> the kinds of :data:`lowering.indexing.SCATTER_KINDS`
_REDUCE_KINDS = {
    "sum": "add",
    "add": "add",
    "prod": "mul",
    "multiply": "mul",
    "amax": "max",
    "amin": "min",
}


# ---------------------------------------------------------------------------------------------
# shared pieces

#: the most elements of a scatter's match (rows x updates, times a row's width where a reduction
#: merges the updates: the ``[rows, updates, width]`` select it reduces) taken to the card; past
#: it the op runs on the CPU. 2**26 runs in about a second (a ``[32, 256]`` scatter_add along
#: either dim; 256 rows of 256 added into 1024); at 2**28 the simulator's host memory for the
#: match runs out (tens of GB).
_MAX_MATCH = 1 << 26


def _fits(rows: int, updates: int, width: int, merges: bool) -> bool:
    """Whether a scatter of ``updates`` into ``rows`` rows of ``width`` stays in
    :data:`_MAX_MATCH`."""
    return rows * updates * (width if merges else 1) <= _MAX_MATCH


def _fake(a: Any) -> Any:
    """The fake tensor of a node argument (None for anything else)."""
    v = meta_val(a) if isinstance(a, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _wrap(b: Builder, i: Var, n: int) -> Var:
    """Index ``i`` as int32 with negative entries counted from the end of a dim of ``n``."""
    i = convert(b, i, _I32)
    neg = b.elementwise("lt", [i, Lit(0, _I32)], i.shape, "bool")
    return b.elementwise(
        "select_n", [neg, i, ew_raw(b, "add", [i, n], i.shape, _I32)], i.shape, _I32
    )


def _stacked(b: Builder, coords: list[Var]) -> Var:
    """The coordinates (each ``[*batch]`` int32) as one index ``[*batch, k]``."""
    shape = coords[0].shape
    cols = [b.reshape(c, (*shape, 1)) for c in coords]
    return b.concat(cols, len(shape)) if len(cols) > 1 else cols[0]


def _identity(kind: str, dt: str) -> Any:
    """The identity of a scatter kind's merge in ``dt``, as a Python number."""
    return REDUCTIONS[indexing.SCATTER_KINDS[kind]].identity_value(np_dtype(dt)).item()


def _values(b: Builder, v: Any, shape: tuple[int, ...], dt: str) -> Var:
    """An update operand (tensor or number) in ``dt``, broadcast to ``shape`` (leading size-1
    dims beyond it dropped, as torch accepts them)."""
    if not isinstance(v, Var):
        return b.full(shape, v.value if isinstance(v, Lit) else v, dt)
    v = convert(b, v, dt)
    extra = len(v.shape) - len(shape)
    if extra > 0 and all(s == 1 for s in v.shape[:extra]):
        v = b.reshape(v, v.shape[extra:])
    return bcast(b, v, shape)


# ---------------------------------------------------------------------------------------------
# scatter, scatter_add, scatter_reduce: one element per update


def _elementwise_scatter(
    b: Builder,
    dt: str,
    x: Var,
    dim: int,
    index: Var,
    src: Any,
    kind: str,
    include_self: bool = True,
) -> Var:
    """``out[p with coordinate dim = index[p]] (merged with) src[p]`` for each position ``p``
    of ``index`` (``src`` sliced to it, or a number): every element of ``index`` is an update
    at its full coordinates (the other dims' coordinates are its own position), each element
    of ``x`` a row. ``include_self`` False: the elements some update lands on first take the
    merge's identity (a set scatter of it), then merge the updates. The result in ``dt``."""
    shape = x.shape
    if not shape:  # a rank-0 tensor: as one of one element
        flat = [b.reshape(v, (1,)) if isinstance(v, Var) else v for v in (x, index, src)]
        one = _elementwise_scatter(b, dt, flat[0], 0, flat[1], flat[2], kind, include_self)
        return b.reshape(one, ())
    xs = convert(b, x, dt)
    r, ishape = len(shape), index.shape
    d = norm_dim(dim, r)
    if math.prod(ishape) == 0:
        return xs
    if isinstance(src, Var):
        for j, s in enumerate(ishape):
            src = b.slice_dim(src, j, 0, s)
    upd = _values(b, src, ishape, dt)
    coords = [
        _wrap(b, index, shape[j])
        if j == d
        else b.const(np.broadcast_to(_iota(ishape, j), ishape).copy(), _I32)
        for j in range(r)
    ]
    if kind == "set" and _sorted_ok(x, index, d):
        return _sorted_scatter_set(b, xs, d, coords[d], upd)
    index, dims = _stacked(b, coords), tuple(range(r))
    if not include_self and kind != "set":
        ident = b.full(ishape, _identity(kind, dt), dt)
        xs = indexing.scatter(b, xs, index, ident, dims, (), "set", clip=False)
    return indexing.scatter(b, xs, index, upd, dims, (), kind, clip=False)


#: a set scatter whose match (elements of ``self`` times elements of ``index``) is past this
#: many takes the sorted path (:func:`_sorted_scatter_set`) where it can
_SORTED_FROM = 1 << 14


def _sorted_ok(x: Any, index: Any, d: int) -> bool:
    """Whether a set scatter along ``d`` can take the sorted path: the index covers ``x`` in
    every other dim, and the match is large."""
    xs, ishape = tuple(x.shape), tuple(index.shape)
    return (
        len(xs) == len(ishape)
        and all(ishape[j] == xs[j] for j in range(len(xs)) if j != d)
        and math.prod(xs) * math.prod(ishape) > _SORTED_FROM
    )


def _sorted_scatter_set(b: Builder, xs: Var, d: int, idx: Var, upd: Var) -> Var:
    """``torch.scatter`` (set) along ``d`` by two stable sorts per row instead of a match of
    every element with every update: ``O((n + L) log(n + L))`` per row of ``L`` elements and
    ``n`` updates, where the match is ``O(rows^2 n L)`` (top-p sampling scatters a whole
    vocabulary: 50257^2 would not fit). Per row, the updates (key ``2 index``) and the row's
    positions (key ``2 t + 1``) are sorted together: each position comes right after the
    updates aimed at it, so the last update before it (a running max of update positions) is
    its value when its key is ``2 t``. A second sort (of the permutation: its inverse) finds
    each position's place in the sorted order. Out-of-range indices match no position
    (dropped); of duplicates the last in index order wins, as on the other path."""
    r = len(xs.shape)
    perm_t = (*[j for j in range(r) if j != d], d)
    inv_t = tuple(int(i) for i in np.argsort(perm_t))
    xt, it, ut = (b.transpose(v, perm_t) if d != r - 1 else v for v in (xs, idx, upd))
    rest = xt.shape[:-1]
    R, L, n = math.prod(rest), xt.shape[-1], it.shape[-1]
    xr, ir, ur = b.reshape(xt, (R, L)), b.reshape(it, (R, n)), b.reshape(ut, (R, n))
    two = b.elementwise("mul", [ir, Lit(2, _I32)], (R, n), _I32)
    tkeys = b.const(np.broadcast_to(np.arange(L, dtype=np.int32) * 2 + 1, (R, L)).copy(), _I32)
    keys = b.concat([two, tkeys], 1)  # [R, n + L]
    N = n + L
    perm = sort_ops.argsort(b, [keys], 1)
    ks = sort_ops.take_along(b, keys, perm, 1)
    pos = b.const(np.broadcast_to(np.arange(N, dtype=np.int32), (R, N)).copy(), _I32)
    is_upd = b.elementwise("lt", [perm, Lit(n, _I32)], (R, N), "bool")
    marks = b.elementwise("select_n", [is_upd, Lit(-1, _I32), pos], (R, N), _I32)
    last = b.emit("reduce", [marks], (R, N), _I32, kind="cummax", axes=(1,))
    place = b.slice_dim(sort_ops.argsort(b, [perm], 1), 1, n, N)  # [R, L]: each t's place
    u = sort_ops.take_along(b, last, place, 1)
    u0 = b.elementwise("max", [u, Lit(0, _I32)], (R, L), _I32)
    ku = sort_ops.take_along(b, ks, u0, 1)
    want = b.const(np.broadcast_to(np.arange(L, dtype=np.int32) * 2, (R, L)).copy(), _I32)
    hit = b.elementwise("eq", [ku, want], (R, L), "bool")
    hit = b.elementwise(
        "and", [hit, b.elementwise("ge", [u, Lit(0, _I32)], (R, L), "bool")], (R, L), "bool"
    )
    j = sort_ops.take_along(b, perm, u0, 1)
    val = sort_ops.take_along(b, ur, j, 1)  # (clipped where no update hits)
    out = b.elementwise("select_n", [hit, xr, val], (R, L), xr.dtype)
    out = b.reshape(out, xt.shape)
    return b.transpose(out, inv_t) if d != r - 1 else out


def _iota(shape: tuple[int, ...], j: int) -> np.ndarray:
    return np.arange(shape[j], dtype=np.int32).reshape(
        [-1 if i == j else 1 for i in range(len(shape))]
    )


def _scatter_ok(node: torch.fx.Node) -> bool:
    """A reduction torch names that the card merges with, no accumulating merge of bools, and
    a match (every element of ``self`` against every one of ``index``) that fits."""
    kw = dict(node.kwargs)
    red = kw.get("reduce", node.args[4] if len(node.args) > 4 else None)
    if red is not None and red not in _REDUCE_KINDS and red != "mean":
        return False
    v, idx = meta_val(node), _fake(node.args[2])
    if not isinstance(v, torch.Tensor) or idx is None:
        return False
    accumulates = red is not None or node.target is aten.scatter_add.default
    if not accumulates and v.dim() and _sorted_ok(v, idx, norm_dim(node.args[1], v.dim())):
        return True  # the sorted path: no match
    return not (accumulates and v.dtype == torch.bool) and _fits(v.numel(), idx.numel(), 1, False)


@rule(aten.scatter.src, aten.scatter.value, when=_scatter_ok)
def _scatter_set(b: Builder, node: torch.fx.Node, x: Var, dim: int, index: Var, src: Any) -> Var:
    """``torch.scatter(x, dim, index, src)`` (``src`` a tensor or a number): of updates landing
    on one element the last one."""
    return _elementwise_scatter(b, result(node)[1], x, dim, index, src, "set")


@rule(aten.scatter.reduce, aten.scatter.value_reduce, when=_scatter_ok)
def _scatter_reduce_arg(
    b: Builder, node: torch.fx.Node, x: Var, dim: int, index: Var, src: Any, *, reduce: str
) -> Var:
    """``torch.scatter(..., reduce="add" | "multiply")``: the updates merged into ``x``."""
    return _elementwise_scatter(b, result(node)[1], x, dim, index, src, _REDUCE_KINDS[reduce])


@rule(aten.scatter_add.default, when=_scatter_ok)
def _scatter_add(b: Builder, node: torch.fx.Node, x: Var, dim: int, index: Var, src: Var) -> Var:
    """``torch.scatter_add``: every update added (duplicates summed)."""
    return _elementwise_scatter(b, result(node)[1], x, dim, index, src, "add")


@rule(aten.scatter_reduce.two, when=_scatter_ok)
def _scatter_reduce(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    dim: int,
    index: Var,
    src: Var,
    reduce: str,
    *,
    include_self: bool = True,
) -> Var:
    """``Tensor.scatter_reduce`` (sum, prod, amax, amin, mean; with or without ``x``'s own
    values). mean: the sum over the count of what was summed (``x``'s value counting when
    included), elements no update lands on kept; integers divide rounding down, as torch."""
    shape, dt = result(node)
    if reduce != "mean":
        kind = _REDUCE_KINDS[reduce]
        return _elementwise_scatter(b, dt, x, dim, index, src, kind, include_self)
    total = _elementwise_scatter(b, dt, x, dim, index, src, "add", include_self)
    base = b.full(shape, 1 if include_self else 0, _I32)
    cnt = _elementwise_scatter(b, _I32, base, dim, index, 1, "add")
    cnt = b.elementwise("max", [cnt, Lit(1, _I32)], shape, _I32)
    if dt != _I32:
        q = ew_raw(b, "div", [convert(b, total, "float32"), cnt], shape, "float32")
        return convert(b, q, dt)
    q = b.elementwise("div", [total, cnt], shape, _I32)  # toward zero; the count is positive
    rem = b.elementwise("rem", [total, cnt], shape, _I32)
    down = b.elementwise("lt", [rem, Lit(0, _I32)], shape, "bool")
    return b.elementwise("select_n", [down, q, ew_raw(b, "sub", [q, 1], shape, _I32)], shape, _I32)


# ---------------------------------------------------------------------------------------------
# index_put, index_add, index_copy: rows of the indexed dims


def _index_tensors(node: torch.fx.Node) -> list[tuple[int, Any]] | None:
    """(position, fake tensor) of each index tensor of an ``index_put``; None if one is not a
    tensor."""
    out = []
    for i, t in enumerate(node.args[1]):
        if t is None:
            continue
        v = _fake(t)
        if v is None:
            return None
        out.append((i, v))
    return out


def _index_put_ok(node: torch.fx.Node) -> bool:
    """Integer index tensors (any number, any dims, broadcast together), or one boolean mask
    set to (or added) a one-element value; no accumulating into bools."""
    ts = _index_tensors(node)
    acc = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    v = meta_val(node)
    if not ts or not isinstance(v, torch.Tensor) or (acc and v.dtype == torch.bool):
        return False
    if any(t.dtype in (torch.bool, torch.uint8) for _, t in ts):
        (p, m), *more = ts
        return (
            not more
            and m.dtype == torch.bool
            and m.dim() >= 1
            and tuple(m.shape) == tuple(v.shape[p : p + m.dim()])
            and _mask_values_ok(_fake(node.args[2]), v.shape, p, m.dim())
        )
    if any(t.dtype.is_floating_point or t.dtype.is_complex for _, t in ts):
        return False
    rows = math.prod(v.shape[i] for i, _ in ts)
    updates = math.prod(torch.broadcast_shapes(*(t.shape for _, t in ts)))
    return _fits(rows, updates, v.numel() // max(rows, 1), bool(acc))


def _mask_values_ok(vals: Any, shape: Any, p: int, md: int) -> bool:
    """Whether ``vals`` broadcasts to ``x[..., mask, ...]`` (``[*shape[:p], K, *rest]``, the
    mask on ``md`` dims from ``p``, ``K`` its count, any size here: checked by torch)."""
    if not isinstance(vals, torch.Tensor):
        return False
    tgt = (*shape[:p], None, *shape[p + md :])
    vs = tuple(vals.shape)
    if len(vs) > len(tgt):
        if any(d != 1 for d in vs[: len(vs) - len(tgt)]):
            return False
        vs = vs[len(vs) - len(tgt) :]
    return all(
        d == 1 or t is None or d == t for d, t in zip(reversed(vs), reversed(tgt), strict=False)
    )


def _put_along_ok(node: torch.fx.Node) -> bool:
    """``index_add`` / ``index_copy`` whose match fits."""
    v, idx = meta_val(node), _fake(node.args[2])
    if not isinstance(v, torch.Tensor) or idx is None:
        return False
    rows = v.shape[norm_dim(int(node.args[1]), v.dim())] if v.dim() else 1
    merges = node.target is aten.index_add.default
    return _fits(rows, idx.numel(), v.numel() // max(rows, 1), merges)


@rule(aten.index_put.default, aten._index_put_impl.default, when=_index_put_ok)
def _index_put(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    indices: Any,
    values: Any,
    accumulate: bool = False,
    unsafe: bool = False,
) -> Var:
    """``x[indices] = values`` (``+=`` each of them, duplicates summed, with ``accumulate``);
    ``_index_put_impl`` is the functional form of what ``index_put_`` and ``x[i] = v`` call on
    the eager device (``unsafe``: whether to check the indices; nothing to check here).

    The index tensors broadcast together to ``bshape``; the indexed dims (their coordinates,
    negatives wrapped) are the scattered dims, the others whole windows of each update. The
    values broadcast to ``x[indices]``'s shape: ``bshape`` where the indexed dims were when
    they are adjacent, else first (torch's advanced indexing)."""
    shape, dt = result(node)
    xs = convert(b, x, dt)
    pos = [i for i, t in enumerate(indices) if t is not None]
    if indices[pos[0]].dtype == "bool":
        return _masked_put(b, xs, pos[0], indices[pos[0]], values, accumulate)
    bshape = tuple(torch.broadcast_shapes(*(indices[i].shape for i in pos)))
    coords = [_wrap(b, bcast(b, indices[i], bshape), shape[i]) for i in pos]
    r, k, nb = len(shape), len(pos), len(bshape)
    rest = [d for d in range(r) if d not in pos]
    if pos == list(range(pos[0], pos[0] + k)):  # adjacent: the batch dims in their place
        p = pos[0]
        ishape = (*shape[:p], *bshape, *shape[p + k :])
        wd = (*range(p), *range(p + nb, nb + len(rest)))
    else:
        ishape = (*bshape, *(shape[d] for d in rest))
        wd = tuple(range(nb, nb + len(rest)))
    upd = _values(b, values, ishape, dt)
    if math.prod(ishape) == 0:
        return xs
    kind = "add" if accumulate else "set"
    return indexing.scatter(b, xs, _stacked(b, coords), upd, tuple(pos), wd, kind, clip=False)


def _masked_put(b: Builder, x: Var, p: int, mask: Var, values: Any, accumulate: bool) -> Var:
    """``x[..., mask] = v`` (``+= v``): a select where the mask (on the dims from ``p``) holds.
    A ``v`` with one entry per masked position (``[..., K, ...]``, ``K`` the mask's count) is
    first gathered to the mask's positions: the ``j``-th true position (in row-major order,
    its running count minus one) takes entry ``j``."""
    shape, dt = x.shape, x.dtype
    md = len(mask.shape)
    m = b.emit("broadcast", [mask], shape, "bool", shape=shape, dims=tuple(range(p, p + md)))
    if not isinstance(values, Var):
        new = _values(b, values, shape, dt)
    else:
        lead, rest = shape[:p], shape[p + md :]
        v = convert(b, values, dt)
        rank = p + 1 + len(rest)
        if len(v.shape) > rank:
            v = b.reshape(v, v.shape[len(v.shape) - rank :])
        vs = (1,) * (rank - len(v.shape)) + tuple(v.shape)
        k = vs[p]
        if k == 1:
            new = bcast(b, b.reshape(v, (*vs[:p], *(1,) * md, *vs[p + 1 :])), shape)
        else:
            v = bcast(b, b.reshape(v, vs), (*lead, k, *rest))
            M = math.prod(mask.shape)
            flat = convert(b, b.reshape(mask, (M,)), _I32)
            run = b.emit("reduce", [flat], (M,), _I32, kind="cumsum", axes=(0,))
            at = ew_raw(b, "max", [ew_raw(b, "sub", [run, 1], (M,), _I32), 0], (M,), _I32)
            new = b.reshape(take(b, v, p, at), shape)
    if accumulate:
        new = b.elementwise("add", [x, new], shape, dt)
    return b.elementwise("select_n", [m, x, new], shape, dt)


def _put_along(
    b: Builder,
    out: tuple[tuple[int, ...], str],
    x: Var,
    dim: int,
    index: Var,
    src: Var,
    kind: str,
) -> Var:
    """``x`` (of the result's ``out``: shape, dtype) with the slices ``index`` names along
    ``dim`` set to (added) ``src``'s: an ``index_put`` on that one dim."""
    shape, dt = out
    if not shape:  # a rank-0 tensor: as one of one element
        one = _put_along(
            b,
            ((1,), dt),
            b.reshape(x, (1,)),
            0,
            b.reshape(index, (1,)),
            b.reshape(src, (1,)),
            kind,
        )
        return b.reshape(one, ())
    d = norm_dim(dim, len(shape))
    q = math.prod(index.shape)
    xs = convert(b, x, dt)
    if q == 0:
        return xs
    idx = _wrap(b, b.reshape(index, (q,)), shape[d])
    ushape = tuple(q if j == d else s for j, s in enumerate(shape))
    upd = _values(
        b, b.reshape(src, ushape) if math.prod(src.shape) == math.prod(ushape) else src, ushape, dt
    )
    wd = tuple(j for j in range(len(shape)) if j != d)
    return indexing.scatter(b, xs, _stacked(b, [idx]), upd, (d,), wd, kind, clip=False)


@rule(aten.index_add.default, when=_put_along_ok)
def _index_add(
    b: Builder, node: torch.fx.Node, x: Var, dim: int, index: Var, source: Var, *, alpha: Any = 1
) -> Var:
    """``x.index_add(dim, index, source, alpha=...)``: ``alpha * source`` (in ``x``'s dtype)
    added at the slices ``index`` names, duplicates summed."""
    _, dt = result(node)
    src = convert(b, source, dt)
    if alpha != 1:
        src = ew_raw(b, "mul", [src, alpha], src.shape, dt)
    return _put_along(b, result(node), x, dim, index, src, "add")


@rule(aten.index_copy.default, when=_put_along_ok)
def _index_copy(b: Builder, node: torch.fx.Node, x: Var, dim: int, index: Var, source: Var) -> Var:
    """``x.index_copy(dim, index, source)``: the slices ``index`` names replaced by
    ``source``'s (of duplicates the last)."""
    return _put_along(b, result(node), x, dim, index, source, "set")


torch_import.finish(__name__)  # see lowering.torch_import
