"""torch FX rules: sorting, selection and gathers along a dim (``sort``, ``argsort``, ``topk``,
``kthvalue``, ``msort``, ``gather``), through :mod:`lowering.sort_ops`.

torch orders NaN above every number (whatever its sign) and ``-0.0`` equal to ``0.0``; the card's
sorts are stable, so of equal values the first comes first (descending too), which is what
``stable=True`` asks and what the CPU gives for the unstable forms on the sizes tested. They
register into :data:`lowering.fx_common.RULES` when ``lowering.from_fx`` imports this module.
"""

from __future__ import annotations

from typing import Any

from . import sort_ops, torch_import
from .builder import Builder, Lit
from .fx_common import bcast, convert, ew_raw, norm_dim, result, rule
from .graph import Var
from .torch_import import torch

aten = torch.ops.aten


def _sorted(b: Builder, x: Var, dim: int, descending: bool, k: int | None = None) -> tuple:
    if not x.shape:
        return x, b.full((), 0, "int32")
    d = norm_dim(dim, len(x.shape))
    idx = sort_ops.argsort(b, [x], d, k=k, descending=descending)
    return sort_ops.take_along(b, x, idx, d), idx


@rule(aten.sort.default)
def _sort(
    b: Builder, node: torch.fx.Node, x: Var, dim: int = -1, descending: bool = False
) -> tuple:
    return _sorted(b, x, dim, descending)


@rule(aten.sort.stable)
def _sort_stable(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    *,
    stable: bool | None = None,
    dim: int = -1,
    descending: bool = False,
) -> tuple:
    return _sorted(b, x, dim, descending)


@rule(aten.argsort.default)
def _argsort(
    b: Builder, node: torch.fx.Node, x: Var, dim: int = -1, descending: bool = False
) -> Var:
    return _sorted(b, x, dim, descending)[1]


@rule(aten.argsort.stable)
def _argsort_stable(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    *,
    stable: bool = False,
    dim: int = -1,
    descending: bool = False,
) -> Var:
    return _sorted(b, x, dim, descending)[1]


@rule(aten.msort.default)
def _msort(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    return _sorted(b, x, 0, False)[0]


@rule(aten.topk.default)
def _topk(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    k: int,
    dim: int = -1,
    largest: bool = True,
    sorted: bool = True,  # noqa: A002  (ATen's name)
) -> tuple:
    """The ``k`` largest (smallest) in order, of equal values the first; NaN the largest."""
    return _sorted(b, x, dim, largest, k=int(k))


@rule(aten.kthvalue.default)
def _kthvalue(
    b: Builder, node: torch.fx.Node, x: Var, k: int, dim: int = -1, keepdim: bool = False
) -> tuple:
    return sort_ops.kth(b, x, int(k), norm_dim(dim, max(len(x.shape), 1)), keepdim)


def _slice_scatter_ok(node: torch.fx.Node) -> bool:
    """A step of 1, or a dim short enough to interleave position by position (else the CPU)."""
    step = node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return step == 1 or (x is not None and int(x.shape[dim]) <= 256)


@rule(aten.slice_scatter.default, when=_slice_scatter_ok)
def _slice_scatter(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    src: Var,
    dim: int = 0,
    start: int | None = None,
    end: int | None = None,
    step: int = 1,
) -> Var:
    """``x`` with ``src`` written over ``x[start:end:step]`` along ``dim`` (what an in-place
    slice assignment becomes once functionalized): a step of 1 is the pieces of ``x`` around
    ``src`` joined; a larger step interleaves ``src`` with ``x``'s other positions."""
    shape, dt = result(node)
    d = norm_dim(dim, len(x.shape))
    n = x.shape[d]
    lo, hi, _ = slice(start, end, step).indices(n)
    src = convert(b, src, dt)
    x = convert(b, x, dt)
    if step == 1:
        return b.concat([b.slice_dim(x, d, 0, lo), src, b.slice_dim(x, d, hi, n)], d)
    idx = list(range(n))  # each position: from x, or the j-th element of src
    picks = [
        (1, (i - lo) // step) if lo <= i < hi and (i - lo) % step == 0 else (0, i) for i in idx
    ]
    pieces = [b.slice_dim(src if w else x, d, j, j + 1) for w, j in picks]
    return b.concat(pieces, d)


@rule(aten.copy.default)
def _copy(b: Builder, node: torch.fx.Node, x: Var, src: Any, non_blocking: bool = False) -> Var:
    """``x.copy_(src)`` functionalized: ``src`` broadcast and converted to ``x``'s type."""
    shape, dt = result(node)
    if not isinstance(src, Var):
        return b.full(shape, src, dt)
    return bcast(b, convert(b, src, dt), shape)


@rule(aten.gather.default)
def _gather(b: Builder, node: torch.fx.Node, x: Var, dim: int, idx: Var, **kw: Any) -> Var:
    """``out[i] = x[i with coordinate dim replaced by idx[i]]`` (the index may be smaller than
    ``x`` along the other dims: ``x`` is sliced to it), negative indices wrapped; each row's
    elements read at the indices in scratchpad (a ``take_along``)."""
    shape, dt = result(node)
    if not x.shape:
        return x
    d = norm_dim(dim, len(x.shape))
    for j, s in enumerate(idx.shape):
        if j != d and s != x.shape[j]:
            x = b.slice_dim(x, j, 0, s)
    i = convert(b, idx, "int32")
    neg = b.elementwise("lt", [i, Lit(0, "int32")], i.shape, "bool")
    wrapped = ew_raw(b, "add", [i, x.shape[d]], i.shape, "int32")
    i = b.elementwise("select_n", [neg, i, wrapped], i.shape, "int32")
    return convert(b, sort_ops.take_along(b, x, i, d), dt)


torch_import.finish(__name__)  # see lowering.torch_import
