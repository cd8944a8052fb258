"""Sorting, selection and indexing along an axis from the graph IR's ``sort`` and
``take_along`` nodes, for both importers.

Both nodes work on rows: the axis is moved last and the dims before it flattened (a transpose
where the axis is not last already, a reshape), and the result is put back. A sort gives the
permutation (int32 indices, stable, :mod:`device_model.sorting`'s orders); every sorted tensor
is then a ``take_along`` of it by that permutation, so a multi-operand ``lax.sort`` sorts once.
"""

from __future__ import annotations

import math

from .builder import Builder
from .graph import Var

__all__ = ["argsort", "take_along", "sort", "kth"]


def _perm_last(rank: int, axis: int) -> tuple[int, ...]:
    return tuple(d for d in range(rank) if d != axis) + (axis,)


def _rows(b: Builder, x: Var, axis: int) -> Var:
    """``x`` with ``axis`` moved last and the other dims flattened: ``[R, n]``."""
    t = b.transpose(x, _perm_last(len(x.shape), axis))
    return b.reshape(t, (math.prod(t.shape[:-1]), t.shape[-1]))


def _unrows(b: Builder, y: Var, shape: tuple[int, ...], axis: int) -> Var:
    """Rows ``[R, m]`` back to ``shape`` (whose ``axis`` has ``m`` elements)."""
    r = len(shape)
    perm = _perm_last(r, axis)
    moved = b.reshape(y, tuple(shape[p] for p in perm))
    inv = tuple(perm.index(d) for d in range(r))
    return b.transpose(moved, inv)


def _axis(axis: int, rank: int) -> int:
    return axis + max(rank, 1) if axis < 0 else axis


def argsort(
    b: Builder,
    keys: list[Var],
    axis: int,
    *,
    k: int | None = None,
    descending: bool = False,
    order: str = "nan_last",
) -> Var:
    """The first ``k`` (all when None) indices (int32) of a stable sort along ``axis`` of
    ``keys`` (the same shape; the first the most significant)."""
    shape = keys[0].shape
    if not shape:  # a scalar is its own order
        return b.full((), 0, "int32")
    axis = _axis(axis, len(shape))
    k = shape[axis] if k is None else k
    out_shape = tuple(k if d == axis else s for d, s in enumerate(shape))
    if k == 0 or math.prod(shape) == 0:
        return b.full(out_shape, 0, "int32")
    rows = [_rows(b, v, axis) for v in keys]
    R = rows[0].shape[0]
    perm = b.emit("sort", rows, (R, k), "int32", k=k, descending=descending, order=order)
    return _unrows(b, perm, out_shape, axis)


def take_along(
    b: Builder, x: Var, idx: Var, axis: int, *, mode: str = "clip", fill: float | None = None
) -> Var:
    """``x``'s elements along ``axis`` at ``idx`` (int32, ``x``'s shape but along ``axis``):
    ``np.take_along_axis``. ``mode`` clip clamps the indices into range; fill gives ``fill``
    (None: NaN for floats, 0 for integers) for an index out of range. Negative indices are the
    caller's to wrap."""
    if not x.shape:
        return x
    axis = _axis(axis, len(x.shape))
    if math.prod(idx.shape) == 0:
        return b.full(idx.shape, 0, x.dtype)
    if x.shape[axis] == 0:
        return b.full(idx.shape, 0 if fill is None else fill, x.dtype)
    if idx.dtype != "int32":
        idx = b.emit("convert", [idx], idx.shape, "int32", dtype="int32")
    xr, ir = _rows(b, x, axis), _rows(b, idx, axis)
    got = b.emit("take_along", [xr, ir], ir.shape, x.dtype, mode=mode, fill_value=fill)
    return _unrows(b, got, idx.shape, axis)


def sort(
    b: Builder,
    operands: list[Var],
    axis: int,
    num_keys: int = 1,
    *,
    descending: bool = False,
    order: str = "nan_last",
    k: int | None = None,
) -> list[Var]:
    """``lax.sort``: every operand reordered by the stable sort of the first ``num_keys``
    (their first ``k`` along ``axis``). One sort; each operand a ``take_along`` of its order."""
    perm = argsort(b, operands[:num_keys], axis, k=k, descending=descending, order=order)
    return [take_along(b, v, perm, axis) for v in operands]


def kth(b: Builder, x: Var, k: int, axis: int, keepdim: bool) -> tuple[Var, Var]:
    """``torch.kthvalue``: the ``k``-th smallest (1-based) along ``axis`` and its index (the
    stable sort's: of equal values, the first)."""
    if not x.shape:
        return x, b.full((), 0, "int32")
    axis = _axis(axis, len(x.shape))
    perm = argsort(b, [x], axis, k=k)
    last = b.slice_dim(perm, axis, k - 1, k)
    val = take_along(b, x, last, axis)
    if not keepdim:
        shape = tuple(s for d, s in enumerate(last.shape) if d != axis)
        return b.reshape(val, shape), b.reshape(last, shape)
    return val, last
