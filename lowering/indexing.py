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

from device_model.layout import np_dtype
from device_model.ops import REDUCTIONS

from .builder import Builder, Lit
from .graph import Graph, Node, Var

__all__ = [
    "dynamic_slice",
    "dynamic_update_slice",
    "expand_updates",
    "gather",
    "reverse",
    "scatter",
    "scatter_windows",
    "SCATTER_KINDS",
]

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


# ---------------------------------------------------------------------------------------------
# scatter

#: a scatter's kind -> (how it merges the updates landing on one row, the merge's identity)
SCATTER_KINDS = {"set": "", "add": "sum", "mul": "prod", "max": "max", "min": "min"}


def scatter(
    b: Builder,
    x: Var,
    index: Var,
    upd: Var,
    scatter_dims: tuple[int, ...],
    window_dims: tuple[int, ...],
    kind: str,
    clip: bool,
) -> Var:
    """XLA's scatter where each index addresses whole rows: ``index`` ``[*batch, k]`` names
    operand dims ``scatter_dims`` (each inserted: a window of one, dropped from the update), the
    update ``[*batch and window dims]`` has ``window_dims`` covering the other operand dims
    whole. ``kind``: set (where several updates land on one element, the last one), add, mul,
    max, min. ``clip``: out-of-range indices clamped; otherwise their updates are dropped.

    Every row of the result compares its own index with each update's (a ``[rows, updates]``
    match); add, mul, max and min reduce the matching updates (their identity where none
    matches) and merge the result into the row; set takes the last matching update, or keeps
    the row."""
    r = len(x.shape)
    rest = [d for d in range(r) if d not in scatter_dims]
    xt = b.transpose(x, (*scatter_dims, *rest))
    lead = tuple(x.shape[d] for d in scatter_dims)
    tail = tuple(x.shape[d] for d in rest)
    R, D = math.prod(lead), math.prod(tail)
    k = len(scatter_dims)
    batch = index.shape[:-1]
    M = math.prod(batch)
    if R == 0 or D == 0 or M == 0:
        return x
    ub = [d for d in range(len(upd.shape)) if d not in window_dims]
    u = b.reshape(b.transpose(upd, (*ub, *window_dims)), (M, D))
    idx = b.reshape(index, (M, k))
    rows = _flat_rows(b, idx, lead, clip)  # [M]: each update's row, -1 when dropped
    io = b.const(np.arange(R, dtype=np.int32).reshape(R, 1), _I32)
    io = b.emit("broadcast", [io], (R, M), _I32, shape=(R, M), dims=(0, 1))
    rm = b.emit("broadcast", [b.reshape(rows, (1, M))], (R, M), _I32, shape=(R, M), dims=(0, 1))
    match = b.elementwise("eq", [io, rm], (R, M), "bool")  # [R, M]
    xr = b.reshape(xt, (R, D))
    if kind == "set":
        out = _scatter_set(b, xr, u, match, R, M, D)
    else:
        red = SCATTER_KINDS[kind]
        m3 = b.emit("broadcast", [match], (R, M, D), "bool", shape=(R, M, D), dims=(0, 1))
        u3 = b.emit(
            "broadcast",
            [b.reshape(u, (1, M, D))],
            (R, M, D),
            u.dtype,
            shape=(R, M, D),
            dims=(0, 1, 2),
        )
        ident = _identity(red, u.dtype)
        masked = b.elementwise(
            "select_n", [m3, b.full((R, M, D), ident, u.dtype), u3], (R, M, D), u.dtype
        )
        part = b.emit("reduce", [masked], (R, D), u.dtype, kind=red, axes=(1,))
        fn = {"sum": "add", "prod": "mul", "max": "max", "min": "min"}[red]
        out = b.elementwise(fn, [xr, part], (R, D), x.dtype)
    back = [0] * r
    for pos, d in enumerate((*scatter_dims, *rest)):
        back[d] = pos
    return b.transpose(b.reshape(out, (*lead, *tail)), tuple(back))


def _identity(red: str, dtype: str) -> object:
    return REDUCTIONS[red].identity_value(np_dtype(dtype)).item()


def _flat_rows(b: Builder, idx: Var, lead: tuple[int, ...], clip: bool) -> Var:
    """Each update's row of the operand's leading dims ``lead`` from its index ``[M, k]``:
    clamped (``clip``), or -1 where a coordinate is out of range."""
    M, k = idx.shape
    return _rows_of(
        b, [b.reshape(b.slice_dim(idx, 1, j, j + 1), (M,)) for j in range(k)], lead, clip
    )


def _rows_of(b: Builder, coords: list[Var], lead: tuple[int, ...], clip: bool) -> Var:
    """The row of a table whose rows are ``lead``'s positions (row-major) at coordinates
    ``coords`` (one ``[M]`` int32 vector per dim of ``lead``): each coordinate clamped into
    range (``clip``), or the row -1 where one is out of range."""
    (M,) = coords[0].shape
    terms: list[tuple[Var | Lit, int]] = []
    ok: Var | None = None
    for j, c in enumerate(coords):
        if clip:
            c = b.elementwise("max", [c, Lit(0, _I32)], (M,), _I32)
            c = b.elementwise("min", [c, Lit(lead[j] - 1, _I32)], (M,), _I32)
        else:
            inside = b.elementwise(
                "and",
                [
                    b.elementwise("ge", [c, Lit(0, _I32)], (M,), "bool"),
                    b.elementwise("lt", [c, Lit(lead[j], _I32)], (M,), "bool"),
                ],
                (M,),
                "bool",
            )
            ok = inside if ok is None else b.elementwise("and", [ok, inside], (M,), "bool")
        terms.append((c, math.prod(lead[j + 1 :])))
    rows = _scaled_sum(b, terms, (M,))
    if ok is None:
        return rows
    return b.elementwise("select_n", [ok, b.full((M,), -1, _I32), rows], (M,), _I32)


def _scatter_set(b: Builder, xr: Var, u: Var, match: Var, R: int, M: int, D: int) -> Var:
    """Each row takes the last update that lands on it, or keeps its own."""
    pos = b.const(np.arange(1, M + 1, dtype=np.int32).reshape(1, M), _I32)
    pos = b.emit("broadcast", [pos], (R, M), _I32, shape=(R, M), dims=(0, 1))
    score = b.elementwise("select_n", [match, b.full((R, M), 0, _I32), pos], (R, M), _I32)
    last = b.emit("reduce", [score], (R,), _I32, kind="max", axes=(1,))  # 0: no update lands
    hit = b.elementwise("gt", [last, Lit(0, _I32)], (R,), "bool")
    src = b.elementwise(
        "max", [b.elementwise("sub", [last, Lit(1, _I32)], (R,), _I32), Lit(0, _I32)], (R,), _I32
    )
    got = b.emit("gather", [u, src], (R, D), u.dtype, mode="clip")
    h2 = b.emit("broadcast", [b.reshape(hit, (R, 1))], (R, D), "bool", shape=(R, D), dims=(0, 1))
    return b.elementwise("select_n", [h2, xr, got], (R, D), xr.dtype)


def scatter_windows(
    b: Builder,
    x: Var,
    index: Var,
    upd: Var,
    scatter_dims: tuple[int, ...],
    inserted: tuple[int, ...],
    window_dims: tuple[int, ...],
    clip: bool,
) -> tuple[Var, Var, tuple[int, ...]]:
    """A scatter whose scattered dims keep a window (``x.at[1:3].set(v)``: dim 0 scattered with
    a window of 2) as one where each is inserted: each window position becomes an update of its
    own, at the index plus its offset. As XLA does, a window start is clamped so that the
    window fits (``clip``), or the whole window is dropped when it does not. Returns
    ``(index, update, window_dims)``."""
    inserted = tuple(inserted)
    for d in scatter_dims:
        if d in inserted:
            continue
        nonins = [e for e in range(len(x.shape)) if e not in inserted]
        a = window_dims[nonins.index(d)]
        w = upd.shape[a]
        ub = [e for e in range(len(upd.shape)) if e not in window_dims]
        others = [e for e in window_dims if e != a]
        upd = b.transpose(upd, (*ub, a, *others))  # [*batch, w, *other windows]
        nb = len(ub) + 1
        window_dims = tuple(range(nb, nb + len(others)))
        batch, k = index.shape[:-1], index.shape[-1]
        col = scatter_dims.index(d)
        index = _window_starts(b, index, col, x.shape[d] - w, w + x.shape[d], clip)
        off = np.zeros((w, k), np.int32)
        off[:, col] = np.arange(w)
        shape = (*batch, w, k)
        wide = b.emit(
            "broadcast",
            [b.reshape(index, (*batch, 1, k))],
            shape,
            _I32,
            shape=shape,
            dims=tuple(range(len(shape))),
        )
        offs = b.emit(
            "broadcast",
            [b.const(off, _I32)],
            shape,
            _I32,
            shape=shape,
            dims=(len(batch), len(batch) + 1),
        )
        index = b.elementwise("add", [wide, offs], shape, _I32)
        inserted = (*inserted, d)
    return index, upd, window_dims


def _window_starts(b: Builder, index: Var, col: int, hi: int, away: int, clip: bool) -> Var:
    """``index`` with column ``col`` (window starts) clamped to ``[0, hi]`` (``clip``), or moved
    ``away`` below zero where out of that range (every row of the window then drops)."""
    k = index.shape[-1]
    c = b.slice_dim(index, len(index.shape) - 1, col, col + 1)
    if clip:
        c = b.elementwise("max", [c, Lit(0, _I32)], c.shape, _I32)
        new = b.elementwise("min", [c, Lit(hi, _I32)], c.shape, _I32)
    else:
        ok = b.elementwise(
            "and",
            [
                b.elementwise("ge", [c, Lit(0, _I32)], c.shape, "bool"),
                b.elementwise("le", [c, Lit(hi, _I32)], c.shape, "bool"),
            ],
            c.shape,
            "bool",
        )
        new = b.elementwise("select_n", [ok, b.full(c.shape, -away, _I32), c], c.shape, _I32)
    parts = [b.slice_dim(index, len(index.shape) - 1, j, j + 1) for j in range(k)]
    parts[col] = new
    return b.concat(parts, len(index.shape) - 1)


# ---------------------------------------------------------------------------------------------
# gather


def gather(
    b: Builder,
    x: Var,
    index: Var,
    *,
    start_index_map: tuple[int, ...],
    collapsed: tuple[int, ...],
    offset_dims: tuple[int, ...],
    slice_sizes: tuple[int, ...],
    operand_batching: tuple[int, ...],
    index_batching: tuple[int, ...],
    out_shape: tuple[int, ...],
    clip: bool,
    fill: float | int | None,
) -> Var:
    """XLA's gather where each index names single elements of its dims (slice size 1, the dim
    collapsed), batching dims pair the operand's with the index's, and every other operand dim
    is taken whole (``table[idx]``, ``jnp.take(x, i, axis=k)``, ``take_along_axis``,
    ``x[i, j]``). The operand is a table of rows (its batching dims, then its indexed dims; the
    rest flattened into a row), each output row one ``gather`` by an index computed on the card:
    clamped (``clip``), or -1 where a coordinate is out of range (the row is ``fill``)."""
    if index.dtype == "uint32":  # (saturated below 2**31: still out of range where it was)
        index = b.elementwise("min", [index, Lit(0x7FFFFFFF, "uint32")], index.shape, "uint32")
    if index.dtype != _I32:
        index = b.emit("convert", [index], index.shape, _I32, dtype=_I32)
    r = len(x.shape)
    lead_dims = (*operand_batching, *start_index_map)
    rest = [d for d in range(r) if d not in lead_dims]
    lead = tuple(x.shape[d] for d in lead_dims)
    R, D = math.prod(lead), math.prod(x.shape[d] for d in rest)
    table = b.reshape(b.transpose(x, (*lead_dims, *rest)), (R, D))
    bshape = index.shape[:-1]
    M = math.prod(bshape)
    coords: list[Var] = []
    for j in index_batching:  # a batching dim's coordinate is the index array's own position
        coords.append(b.const(_iota(bshape, j) if bshape else np.zeros(1, np.int32), _I32))
    if index.shape[-1] == 1:  # one coordinate: the index array itself, flattened
        coords += [b.reshape(index, (M,))] if start_index_map else []
    else:
        idx2 = b.reshape(index, (M, index.shape[-1]))
        for c in range(len(start_index_map)):
            coords.append(b.reshape(b.slice_dim(idx2, 1, c, c + 1), (M,)))
    if len(coords) == 1:  # the rows themselves: the gather clamps them, or fills
        rows = coords[0]
    else:
        rows = _rows_of(b, coords, lead, clip) if coords else b.full((M,), 0, _I32)
    got = b.emit(
        "gather", [table, rows], (M, D), x.dtype, mode="clip" if clip else "fill", fill_value=fill
    )
    # the output: the index's batch dims where no offset dim is, at ``offset_dims`` the dims
    # not collapsed (those taken whole, and indexed ones kept with size 1)
    kept = [d for d in range(r) if d not in collapsed and d not in operand_batching]
    got = b.reshape(got, (*bshape, *(slice_sizes[d] for d in kept)))
    nb = len(bshape)
    order = [0] * len(out_shape)
    batch_pos = [p for p in range(len(out_shape)) if p not in offset_dims]
    for k, p in enumerate(batch_pos):
        order[p] = k
    for k, p in enumerate(offset_dims):
        order[p] = nb + k
    return b.reshape(b.transpose(got, tuple(order)), out_shape)


def expand_updates(g: Graph) -> Graph:
    """``g`` with each ``update_slice`` node as the gather and select of
    :func:`dynamic_update_slice` (what a kernel computes); the graph's other nodes as they are."""
    if not any(n.op == "update_slice" for n in g.nodes):
        return g
    b = Builder()
    rename: dict[int, Var] = {}
    consts = list(g.consts)
    for n in g.nodes:
        ins = [rename.get(v.id, v) for v in n.inputs]
        if n.op != "update_slice":
            b.nodes.append(Node(n.op, tuple(ins), n.outputs, n.params, n.source))
            continue
        b.source = n.source
        x, upd, *traced = ins
        it = iter(traced)
        starts = [Lit(s, _I32) if s is not None else next(it) for s in n.params.starts]
        rename[n.out.id] = dynamic_update_slice(b, x, upd, starts)
    consts += b.consts
    outs = tuple(rename.get(v.id, v) for v in g.outputs)
    return Graph(g.name, g.inputs, tuple(b.nodes), outs, tuple(consts))
