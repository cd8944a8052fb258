"""Traced indexing from the graph IR's ops, for both importers: ``dynamic_slice`` and
``dynamic_update_slice`` with start indices computed on the card.

Both clamp each start into range, as JAX does (``0 <= start <= size - window``). The dims up to
the last one whose start is traced are addressed by row: the tensor is a table of rows (the
dims after them flattened), and a ``gather`` fetches the rows the window covers, at indices
computed on the card from the starts; the dims after are sliced statically. An update is the
same gather run the other way round: every row of the result takes the update's row that lands
on it, or keeps its own, by a ``select`` (so the result is written whole: the update is not in
place).
"""

from __future__ import annotations

import math

import numpy as np

from .builder import Builder, Lit
from .graph import Var

__all__ = ["dynamic_slice", "dynamic_update_slice"]

_I32 = "int32"


def _clamped(b: Builder, start: Var | Lit, hi: int) -> Var | Lit:
    """``start`` clamped to ``[0, hi]`` (a literal stays one)."""
    if isinstance(start, Lit):
        return Lit(min(max(int(start.value), 0), hi), _I32)
    s = start if start.dtype == _I32 else b.emit("convert", [start], (), _I32, dtype=_I32)
    s = b.elementwise("max", [s, Lit(0, _I32)], (), _I32)
    return b.elementwise("min", [s, Lit(hi, _I32)], (), _I32)


def _row_dims(starts: list[Var | Lit]) -> int:
    """How many leading dims are addressed by row: up to the last traced start."""
    k = 0
    for j, s in enumerate(starts):
        if not isinstance(s, Lit):
            k = j + 1
    return k


def _iota(shape: tuple[int, ...], j: int) -> np.ndarray:
    io = np.arange(shape[j], dtype=np.int32).reshape(
        [-1 if i == j else 1 for i in range(len(shape))]
    )
    return np.broadcast_to(io, shape).reshape(-1).astype(np.int32)


def _scaled_sum(b: Builder, terms: list[tuple[Var | Lit, int]], shape: tuple[int, ...]) -> Var:
    """``sum(v * k)`` over ``terms`` as an int32 tensor of ``shape`` (scalars broadcast)."""
    static = sum(int(v.value) * k for v, k in terms if isinstance(v, Lit))
    acc: Var | None = None
    for v, k in terms:
        if isinstance(v, Lit) or k == 0:
            continue
        t = b.elementwise("mul", [v, Lit(k, _I32)], v.shape, _I32) if k != 1 else v
        acc = t if acc is None else b.elementwise("add", [acc, t], acc.shape, _I32)
    if acc is None:
        return b.full(shape, static, _I32)
    if static:
        acc = b.elementwise("add", [acc, Lit(static, _I32)], acc.shape, _I32)
    return b.as_var(acc, shape)


def dynamic_slice(b: Builder, x: Var, starts: list[Var | Lit], sizes: tuple[int, ...]) -> Var:
    """``lax.dynamic_slice(x, starts, sizes)``: each start clamped into range first."""
    cs = [_clamped(b, s, n - w) for s, n, w in zip(starts, x.shape, sizes, strict=True)]
    k = _row_dims(cs)
    if k == 0:  # every start static: a plain slice
        return _static_slice(b, x, [int(c.value) for c in cs], sizes)
    lead, tail = x.shape[:k], x.shape[k:]
    R, D = math.prod(lead), math.prod(tail)
    win = tuple(sizes[:k])
    M = math.prod(win)
    if M == 0 or D == 0:  # an empty window
        return b.full(tuple(sizes), 0, x.dtype)
    strides = [math.prod(lead[j + 1 :]) for j in range(k)]
    base = _scaled_sum(b, [(cs[j], strides[j]) for j in range(k)], ())
    offs = sum(_iota(win, j) * strides[j] for j in range(k)).astype(np.int32)
    idx = b.elementwise("add", [b.as_var(base, (M,)), b.const(offs, _I32)], (M,), _I32)
    rows = b.emit("gather", [b.reshape(x, (R, D)), idx], (M, D), x.dtype, mode="clip")
    got = b.reshape(rows, (*win, *tail))
    rest = [0] * k + [int(c.value) for c in cs[k:]]  # the dims after: static starts
    return _static_slice(b, got, rest, sizes)


def _static_slice(b: Builder, x: Var, starts: list[int], sizes: tuple[int, ...]) -> Var:
    if list(starts) == [0] * len(starts) and tuple(sizes) == x.shape:
        return x
    li = tuple(s + w for s, w in zip(starts, sizes, strict=True))
    return b.emit(
        "slice",
        [x],
        tuple(sizes),
        x.dtype,
        starts=tuple(starts),
        limits=li,
        strides=(1,) * len(sizes),
    )


def dynamic_update_slice(b: Builder, x: Var, upd: Var, starts: list[Var | Lit]) -> Var:
    """``lax.dynamic_update_slice(x, upd, starts)``: ``upd`` written over ``x`` at the starts
    (each clamped so the update fits)."""
    cs = [_clamped(b, s, n - w) for s, n, w in zip(starts, x.shape, upd.shape, strict=True)]
    if math.prod(upd.shape) == 0:
        return x
    k = _row_dims(cs)
    tail = x.shape[k:]
    # the dims after the row dims: the update placed at its static starts, the rest masked out
    t_starts = [int(c.value) for c in cs[k:]]
    placed = upd
    tmask = np.zeros(tail, bool)
    tmask[tuple(slice(s, s + w) for s, w in zip(t_starts, upd.shape[k:], strict=True))] = True
    if not tmask.all():
        cfg = [(0, 0, 0)] * k + [
            (s, n - s - w, 0) for s, n, w in zip(t_starts, tail, upd.shape[k:], strict=True)
        ]
        placed = b.pad(upd, Lit(0, upd.dtype), cfg)
    if k == 0:
        m = b.const(np.broadcast_to(tmask, x.shape).copy(), "bool")
        return b.elementwise("select_n", [m, x, placed], x.shape, x.dtype)
    lead, ulead = x.shape[:k], upd.shape[:k]
    R, D, Ru = math.prod(lead), math.prod(tail), math.prod(ulead)
    ustrides = [math.prod(ulead[j + 1 :]) for j in range(k)]
    inside: Var | None = None
    terms: list[tuple[Var | Lit, int]] = []
    for j in range(k):
        i_j = b.const(_iota(lead, j), _I32)  # each row's coordinate along dim j
        rel = b.elementwise("sub", [i_j, b.as_var(_scalar(b, cs[j]), (R,))], (R,), _I32)
        ok = b.elementwise("ge", [rel, Lit(0, _I32)], (R,), "bool")
        ok = b.elementwise(
            "and", [ok, b.elementwise("lt", [rel, Lit(ulead[j], _I32)], (R,), "bool")], (R,), "bool"
        )
        inside = ok if inside is None else b.elementwise("and", [inside, ok], (R,), "bool")
        rel = b.elementwise("max", [rel, Lit(0, _I32)], (R,), _I32)
        terms.append(
            (b.elementwise("min", [rel, Lit(ulead[j] - 1, _I32)], (R,), _I32), ustrides[j])
        )
    uidx = _scaled_sum(b, terms, (R,))
    rows = b.emit("gather", [b.reshape(placed, (Ru, D)), uidx], (R, D), x.dtype, mode="clip")
    assert inside is not None
    mask = b.emit("broadcast", [inside], (R, D), "bool", shape=(R, D), dims=(0,))
    if not tmask.all():
        tm = b.const(tmask.reshape(1, D), "bool")
        tm = b.emit("broadcast", [tm], (R, D), "bool", shape=(R, D), dims=(0, 1))
        mask = b.elementwise("and", [mask, tm], (R, D), "bool")
    out = b.elementwise("select_n", [mask, b.reshape(x, (R, D)), rows], (R, D), x.dtype)
    return b.reshape(out, x.shape)


def _scalar(b: Builder, v: Var | Lit) -> Var:
    return v if isinstance(v, Var) else b.const(np.asarray(v.value, np.int32), _I32)


def reverse(b: Builder, x: Var, dims: tuple[int, ...]) -> Var:
    """``lax.rev(x, dims)``: ``x`` reversed along ``dims``. The dims before the last one form
    the rows a ``gather`` takes in reversed order (constant indices); the last dim, when
    reversed, is moved to the front for the gather and back after."""
    dims = tuple(sorted({d % len(x.shape) for d in dims})) if x.shape else ()
    if not dims or math.prod(x.shape) == 0:
        return x
    r = len(x.shape)
    if r > 1 and r - 1 in dims:  # the stick dim: the row dim of the transposed tensor
        t = reverse(b, b.transpose(x, (r - 1, *range(r - 1))), (0,))
        x = b.transpose(t, (*range(1, r), 0))
        dims = dims[:-1]
        if not dims:
            return x
    k = dims[-1] + 1
    lead = x.shape[:k]
    R, D = math.prod(lead), math.prod(x.shape[k:])
    coords = np.indices(lead).reshape(k, -1)
    for d in dims:
        coords[d] = lead[d] - 1 - coords[d]
    idx = np.ravel_multi_index(tuple(coords), lead).astype(np.int32)
    rows = b.emit(
        "gather", [b.reshape(x, (R, D)), b.const(idx, _I32)], (R, D), x.dtype, mode="clip"
    )
    return b.reshape(rows, x.shape)
