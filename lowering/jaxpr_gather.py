"""A gather whose indexed dims keep a window (``slice_sizes[d] > 1``: the derivative of
``x.at[1:3].set(v)`` with respect to ``v`` reads ``dynamic_slice``-like windows of the
cotangent with a gather) as one of single elements, which :func:`lowering.indexing.gather`
computes: each window position becomes an index of its own, at the start plus its offset.
:func:`lowering.from_jaxpr`'s gather rule calls :func:`expand_windows`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .builder import Builder, Lit
from .graph import Var

__all__ = ["Windows", "expand_windows"]

_I32 = "int32"


@dataclass(frozen=True)
class Windows:
    """The single-element gather :func:`expand_windows` made: its index, collapsed dims and
    slice sizes, the output it gives (``out_shape`` with its ``offset_dims``: the index's batch
    dims, then the window dims, then the other kept dims) and ``perm``, the transpose from that
    output to the original gather's."""

    index: Var
    collapsed: tuple[int, ...]
    slice_sizes: tuple[int, ...]
    offset_dims: tuple[int, ...]
    out_shape: tuple[int, ...]
    perm: tuple[int, ...]


def expand_windows(
    b: Builder,
    table_shape: tuple[int, ...],
    index: Var,
    start_index_map: tuple[int, ...],
    collapsed: tuple[int, ...],
    slice_sizes: tuple[int, ...],
    offset_dims: tuple[int, ...],
    operand_batching: tuple[int, ...],
    clip: bool,
) -> Windows | None:
    """The single-element form of a gather whose indexed, uncollapsed dims take windows of more
    than one element and less than the whole dim; None when it has none. As XLA does, a window
    start is clamped so that the window fits (``clip``), or moved out of range when it does not
    (every element of the window then reads the fill value)."""
    wins = [
        c
        for c, d in enumerate(start_index_map)
        if d not in collapsed and 1 < slice_sizes[d] < table_shape[d]
    ]
    if not wins or index.shape[-1] != len(start_index_map):
        return None
    if index.dtype != _I32:
        index = b.emit("convert", [index], index.shape, _I32, dtype=_I32)
    batch, k = index.shape[:-1], index.shape[-1]
    last = len(index.shape) - 1
    cols = [b.slice_dim(index, last, c, c + 1) for c in range(k)]
    for c in wins:
        d = start_index_map[c]
        hi = table_shape[d] - slice_sizes[d]
        s = cols[c]
        if clip:
            s = b.elementwise("max", [s, Lit(0, _I32)], s.shape, _I32)
            cols[c] = b.elementwise("min", [s, Lit(hi, _I32)], s.shape, _I32)
        else:
            ok = b.elementwise(
                "and",
                [
                    b.elementwise("ge", [s, Lit(0, _I32)], s.shape, "bool"),
                    b.elementwise("le", [s, Lit(hi, _I32)], s.shape, "bool"),
                ],
                s.shape,
                "bool",
            )
            away = b.full(s.shape, -(slice_sizes[d] + table_shape[d]), _I32)
            cols[c] = b.elementwise("select_n", [ok, away, s], s.shape, _I32)
    index = b.concat(cols, last) if k > 1 else cols[0]
    for c in wins:  # one more batch dim per window: [*batch, w1, ..., k]
        w = slice_sizes[start_index_map[c]]
        nb = len(index.shape) - 1
        shape = (*index.shape[:-1], w, k)
        off = np.zeros((w, k), np.int32)
        off[:, c] = np.arange(w)
        wide = b.emit(
            "broadcast",
            [b.reshape(index, (*index.shape[:-1], 1, k))],
            shape,
            _I32,
            shape=shape,
            dims=tuple(range(len(shape))),
        )
        offs = b.emit(
            "broadcast", [b.const(off, _I32)], shape, _I32, shape=shape, dims=(nb, nb + 1)
        )
        index = b.elementwise("add", [wide, offs], shape, _I32)
    win_dims = [start_index_map[c] for c in wins]
    coll = (*collapsed, *win_dims)
    sizes = tuple(1 if d in win_dims else n for d, n in enumerate(slice_sizes))
    r = len(table_shape)
    kept = [d for d in range(r) if d not in collapsed and d not in operand_batching]
    kept2 = [d for d in kept if d not in win_dims]
    nb2 = len(index.shape) - 1
    out2 = (*index.shape[:-1], *(sizes[d] for d in kept2))
    offs2 = tuple(range(nb2, nb2 + len(kept2)))
    # the original output: the batch dims at the positions no offset dim takes, in order; the
    # kept dims at ``offset_dims``; a window dim's values are its batch dim of the new gather
    n_out = len(batch) + len(kept)
    perm, nxt = [], 0
    for p in range(n_out):
        if p in offset_dims:
            e = kept[list(offset_dims).index(p)]
            src = len(batch) + win_dims.index(e) if e in win_dims else nb2 + kept2.index(e)
        else:
            src, nxt = nxt, nxt + 1
        perm.append(src)
    return Windows(index, coll, sizes, offs2, out2, tuple(perm))
