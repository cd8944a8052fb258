"""From a fused graph to the schedule IR: layouts, tiling over the cores and into scratchpad.

For each node the tiler picks block sizes (whole sticks along every stick dimension, exact
divisors elsewhere), so that the tiles spread over the cores and the stage's scratchpad plan fits
the usable scratchpad; the plan is double-buffered when the stage has more than one step. Then the
work is divided (tile p runs on core p % n at step p // n, n the card's ``num_cores``) and the
load, ring and store tables are built: a block several cores need in one step is loaded by the
first of them and forwarded over the ring to the rest. A plan that does not fit is never
emitted: the tiler splits further (a reduction whose output rows cannot be tiled finely enough
writes one element per stick to a temp, then packs it), and raises :class:`TilingError` only
when no split fits. Every figure of the card (cores, stick size, usable scratchpad, bandwidths)
comes from the :class:`~device_model.card.CardSpec` passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import product

import numpy as np

from device_model.card import CardSpec
from device_model.kernel import Kernel, Operand, SpBuf, Stage, TensorDecl, blocks_of
from device_model.layout import DTYPES, TensorLayout, layout_for
from device_model.ops import (
    ROW_REDUCTIONS,
    TRANSCENDENTAL,
    ConcatBody,
    GatherBody,
    InputView,
    MapBody,
    MatmulBody,
    ReshapeBody,
)

from .errors import TilingError
from .graph import Graph, Node, Var
from .passes import is_free_reshape

__all__ = ["schedule", "map_fits"]


def _align(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a`` (the card's stick size)."""
    return -(-n // a) * a


def _divisors(n: int) -> list[int]:
    out = set()
    for i in range(1, int(math.isqrt(n)) + 1):
        if n % i == 0:
            out.add(i)
            out.add(n // i)
    return sorted(out)


def _cands(extent: int, quantum: int) -> list[int]:
    """Block sizes for a dim: divisors of ``extent`` that are multiples of ``quantum``."""
    return [d for d in _divisors(extent) if d % quantum == 0] or [extent]


class _Ctx:
    def __init__(self, card: CardSpec):
        self.card = card
        self.cap = card.scratchpad_usable_bytes
        self.ncores = card.num_cores
        self.decls: dict[str, TensorDecl] = {}
        self.aliases: list[tuple[str, str]] = []
        self.stages: list[Stage] = []
        self.names: dict[int, str] = {}
        self.counter = 0

    def name(self, v: Var) -> str:
        return self.names[v.id]

    def plan_bytes(self, blocks: list[tuple[tuple[int, ...], str]], slots: int) -> int:
        return _plan_bytes(blocks, slots, self.card.stick_bytes)

    def sp_plan(self, bufs: list[tuple[str, tuple[int, ...], str, int]]) -> tuple[SpBuf, ...]:
        return _sp_plan(bufs, self.card.stick_bytes)

    def layout(self, v: Var) -> TensorLayout:
        return self.decls[self.name(v)].layout

    def declare(self, v: Var, role: str, name: str | None = None) -> str:
        if v.id in self.names:
            return self.names[v.id]
        nm = name or f"t{len(self.names)}"
        self.names[v.id] = nm
        self.decls[nm] = TensorDecl(nm, layout_for(v.shape, v.dtype, self.card.stick_bytes), role)
        return nm

    def view(self, base: str, shape: tuple[int, ...], dtype: str) -> str:
        nm = f"{base}_v{len(self.aliases)}"
        self.decls[nm] = TensorDecl(nm, layout_for(shape, dtype, self.card.stick_bytes), "view")
        self.aliases.append((nm, base))
        return nm


# ---------------------------------------------------------------------------------------------
# block choice


def _choose(
    extents: list[int],
    cands: list[list[int]],
    plan_bytes: Callable[[list[int], bool], int],
    cap: int,
    ncores: int,
    what: str,
    source: str,
) -> list[int]:
    """Blocks per dim: enough tiles for the cores, the largest that fit (outer dims first)."""
    blocks = [max(c) for c in cands]

    def tiles(bl: list[int]) -> int:
        return math.prod(e // b for e, b in zip(extents, bl, strict=True))

    for d in range(len(extents)):
        if tiles(blocks) >= ncores:
            break
        need = -(-ncores // tiles(blocks))
        # largest block along d that still gives `need` more tiles (else the smallest block)
        ok = [b for b in cands[d] if extents[d] // b >= need]
        blocks[d] = max(ok) if ok else min(cands[d])
    while plan_bytes(blocks, tiles(blocks) > ncores) > cap:
        for d in range(len(extents)):
            smaller = [b for b in cands[d] if b < blocks[d]]
            if smaller:
                blocks[d] = max(smaller)
                break
        else:
            need = plan_bytes(blocks, tiles(blocks) > ncores)
            raise TilingError(
                f"spyre: {what} cannot be tiled into the usable scratchpad ({cap} B per core): "
                f"the smallest tiling needs {need} B" + (f"\n  at: {source}" if source else "")
            )
    return blocks


# ---------------------------------------------------------------------------------------------
# work division tables


def _tables(
    grid: tuple[int, ...],
    operands: list[Operand],
    layouts: list[TensorLayout],
    ncores: int,
    reduce_axis: int = -1,
) -> tuple:
    """Build loads/ring/stores/first/last for ``operands`` (the last is the output)."""
    par_axes = [a for a in range(len(grid)) if a != reduce_axis]
    par_grid = [grid[a] for a in par_axes]
    ntiles = math.prod(par_grid)
    nk = grid[reduce_axis] if reduce_axis >= 0 else 1
    psteps = -(-ntiles // ncores)
    coords_par = (
        np.array(np.unravel_index(np.arange(ntiles), par_grid)).T
        if par_grid
        else np.zeros((ntiles, 0), np.int64)
    )

    def block_index(op: Operand, lay: TensorLayout, coord: dict[int, int]) -> int:
        nb = blocks_of(lay.device_shape, op.block)
        idx = [coord.get(g, 0) if g >= 0 else 0 for g in op.grid_dims]
        return int(np.ravel_multi_index(idx, nb)) if nb else 0

    loads, ring, stores, first, last = [], [], [], [], []
    for s in range(psteps):
        for k in range(nk):
            lrow = [[-1] * ncores for _ in operands[:-1]]
            rrow = [[-1] * ncores for _ in operands[:-1]]
            srow = [-1] * ncores
            for c in range(ncores):
                p = s * ncores + c
                if p >= ntiles:
                    continue
                coord = {a: int(coords_par[p][i]) for i, a in enumerate(par_axes)}
                if reduce_axis >= 0:
                    coord[reduce_axis] = k
                for i, (op, lay) in enumerate(zip(operands[:-1], layouts[:-1], strict=True)):
                    b = block_index(op, lay, coord)
                    owner = next((o for o in range(c) if lrow[i][o] == b), -1)
                    if owner >= 0:
                        rrow[i][c] = owner
                    else:
                        lrow[i][c] = b
                if k == nk - 1:
                    srow[c] = block_index(operands[-1], layouts[-1], coord)
            loads.append(tuple(tuple(r) for r in lrow))
            ring.append(tuple(tuple(r) for r in rrow))
            stores.append(tuple(srow))
            first.append(k == 0)
            last.append(k == nk - 1)
    return tuple(loads), tuple(ring), tuple(stores), tuple(first), tuple(last)


def _sp_plan(bufs: list[tuple[str, tuple[int, ...], str, int]], stick: int) -> tuple[SpBuf, ...]:
    """Lay the buffers out one after another, each slot a whole number of sticks."""
    out, off = [], 0
    for name, block, dtype, slots in bufs:
        sb = _align(math.prod(block) * DTYPES[dtype], stick)
        out.append(SpBuf(name, off, sb, slots, tuple(block), dtype))
        off += sb * slots
    return tuple(out)


def _plan_bytes(blocks: list[tuple[tuple[int, ...], str]], slots: int, stick: int) -> int:
    """Scratchpad bytes of buffers for ``blocks``, ``slots`` each, each slot whole sticks."""
    return sum(_align(math.prod(b) * DTYPES[d], stick) * slots for b, d in blocks)


# ---------------------------------------------------------------------------------------------
# per-kind stage builders


_REDUCTIONS = frozenset({"sum", "max", "min", "prod", "argmax", "argmin"})


def map_fits(n: Node, card: CardSpec) -> bool:
    """Whether :func:`schedule` can tile the map node ``n`` on ``card`` (a dry run of its
    tiling choice: no tables are built). The fusion pass asks this of every map it merges."""
    ctx = _Ctx(card)
    for v in (*n.inputs, *n.outputs):
        ctx.declare(v, "temp")
    try:
        _map_stage(ctx, n, dry=True)
    except TilingError:
        return False
    return True


def _map_stage(ctx: _Ctx, n: Node, dry: bool = False) -> list[Stage]:
    """A map node's stage; a reduction that does not fit goes through a one-per-stick temp.

    The output's last dim is its stick dim, so tiles of the output's rows come in whole output
    sticks (64 fp16), and a reduction over long rows then needs that many full input rows in
    the scratchpad at once. When that does not fit, the reduction writes a temp with a trailing
    size-1 dim instead (one element per stick, as the card's own stick-dim reductions do): its
    rows are no longer the stick dim and tile one by one. A second, copy stage packs the temp
    into the output's layout. With ``dry`` only the tiling is chosen (TilingError when none fits)
    and no stage is returned.
    """
    body: MapBody = n.p("body")
    in_names = [ctx.name(v) for v in n.inputs]
    in_lays = [ctx.layout(v) for v in n.inputs]
    out_name, out_lay = ctx.name(n.out), ctx.layout(n.out)
    name = f"s{len(ctx.stages)}"
    try:
        st = _map_plan(ctx, body, in_names, in_lays, out_name, out_lay, name, n.source, dry)
        return [st] if st is not None else []
    except TilingError as err:
        if body.reduce not in _REDUCTIONS or not out_lay.shape:
            raise
        first_err = err
    shape, dt = out_lay.shape, out_lay.dtype
    tmp = f"{out_name}_s"
    tmp_lay = layout_for((*shape, 1), dt, ctx.card.stick_bytes)
    sparse = MapBody((*body.space, 1), body.views, body.program, body.reduce, body.reduce_axes, dt)
    r = len(shape)
    pack = MapBody(
        shape,
        (InputView((*range(r), -1), (0,) * (r + 1), (1,) * (r + 1), (False,) * (r + 1)),),
        (("copy", (0,), None, dt),),
        "",
        (),
        dt,
    )
    try:
        s1 = _map_plan(ctx, sparse, in_names, in_lays, tmp, tmp_lay, name, n.source, dry)
        s2 = _map_plan(
            ctx,
            pack,
            [tmp],
            [tmp_lay],
            out_name,
            out_lay,
            f"s{len(ctx.stages) + 1}",
            n.source,
            dry,
        )
    except TilingError:
        raise first_err from None
    if s1 is None or s2 is None:
        return []
    ctx.decls[tmp] = TensorDecl(tmp, tmp_lay, "temp")
    return [s1, s2]


def _map_plan(
    ctx: _Ctx,
    body: MapBody,
    in_names: list[str],
    in_lays: list[TensorLayout],
    out_name: str,
    out_lay: TensorLayout,
    name: str,
    source: str,
    dry: bool = False,
) -> Stage | None:
    """Tile one map body over the cores; raises :class:`TilingError` when no tiling fits.

    Reduced axes (the final reduction's and the in-program ones) stay whole in every block.
    With ``dry``, returns None once a tiling is chosen.
    """
    space = body.space
    r = len(space)
    out_dims = body.out_space_dims()
    reduced = (
        set(range(r)) - set(out_dims)
        if body.reduce not in ("cumsum", "cumsum_rev")
        else set(body.reduce_axes)
    ) | body.program_reduce_axes()
    # which tensors map onto each space dim, and with what device extent
    ext: dict[int, set[int]] = {g: set() for g in range(r)}
    quant: dict[int, int] = dict.fromkeys(range(r), 1)
    tileable = {g: g not in reduced for g in range(r)}
    for lay, view in zip(in_lays, body.views, strict=True):
        for j, g in enumerate(view.dims):
            if g < 0 or view.bcast[j]:
                continue
            if not view.is_plain(j) or lay.shape[j] != space[g]:
                tileable[g] = False
                continue
            ext[g].add(lay.device_shape[j])
            if j == len(lay.shape) - 1:
                quant[g] = math.lcm(quant[g], lay.elems_per_stick)
    for i, g in enumerate(out_dims):
        ext[g].add(out_lay.device_shape[i] if out_lay.shape else out_lay.device_shape[0])
        if i == len(out_dims) - 1:
            quant[g] = math.lcm(quant[g], out_lay.elems_per_stick)
    extents, cands = [], []
    for g in range(r):
        if tileable[g] and len(ext[g]) == 1:
            e = next(iter(ext[g]))
            extents.append(e)
            cands.append(_cands(e, quant[g]) + ([e] if e not in _cands(e, quant[g]) else []))
        else:
            tileable[g] = False
            extents.append(1)
            cands.append([1])

    def blocks_for(bl: list[int]) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
        in_blocks = []
        for lay, view in zip(in_lays, body.views, strict=True):
            blk = []
            for j, g in enumerate(view.dims):
                tiled = g >= 0 and tileable[g] and view.is_plain(j)
                blk.append(bl[g] if tiled else lay.device_shape[j])
            in_blocks.append(tuple(blk) if lay.shape else lay.device_shape)
        ob = tuple(
            bl[g] if tileable[g] else out_lay.device_shape[i] for i, g in enumerate(out_dims)
        )
        return in_blocks, (ob if out_lay.shape else out_lay.device_shape)

    def plan(bl: list[int], multi: bool) -> int:
        ib, ob = blocks_for(bl)
        items = [(b, lay.dtype) for b, lay in zip(ib, in_lays, strict=True)]
        return ctx.plan_bytes(items + [(ob, out_lay.dtype)], 2 if multi else 1)

    bl = _choose(extents, cands, plan, ctx.cap, ctx.ncores, f"map ({_describe(body)})", source)
    if dry:
        return None
    grid = tuple(extents[g] // bl[g] if tileable[g] else 1 for g in range(r))
    ib, ob = blocks_for(bl)
    # a block past the logical extent (the stick padding) computes only the logical part
    space_block = tuple(min(bl[g], space[g]) if tileable[g] else space[g] for g in range(r))
    inputs = []
    for i, (nm, lay, view, blk) in enumerate(zip(in_names, in_lays, body.views, ib, strict=True)):
        gd = (
            tuple(
                g if g >= 0 and tileable[g] and view.is_plain(j) else -1
                for j, g in enumerate(view.dims)
            )
            if lay.shape
            else (-1,)
        )
        inputs.append(Operand(nm, blk, gd, f"in{i}"))
    ogd = tuple(g if tileable[g] else -1 for g in out_dims) if out_lay.shape else (-1,)
    output = Operand(out_name, ob, ogd, "out")
    ntiles = math.prod(grid)
    slots = 2 if ntiles > ctx.ncores else 1
    scratch = ctx.sp_plan(
        [
            (f"in{i}", op.block, lay.dtype, slots)
            for i, (op, lay) in enumerate(zip(inputs, in_lays, strict=True))
        ]
        + [("out", ob, out_lay.dtype, slots)]
    )
    tabs = _tables(grid, [*inputs, output], [*in_lays, out_lay], ctx.ncores)
    sfu, flops = _map_work(body, ctx.card)
    return Stage(
        name,
        "map",
        grid,
        -1,
        tuple(inputs),
        output,
        scratch,
        (("SFU", "map", (body, space_block)),),
        *tabs,
        flops=flops,
        sfu_elem_ops=sfu,
        source=source,
    )


#: map-program ops that move or retype data and do no arithmetic (no flops)
_MOVES = frozenset({"const", "copy", "convert", "select_n"})


def _op_extents(body: MapBody) -> list[int]:
    """Per program op, the elements it computes: the product of the space dims its result varies
    along (an op on a row's reduced value, or on a broadcast input, runs once per row)."""
    dims: list[frozenset[int]] = [
        frozenset(g for j, g in enumerate(v.dims) if g >= 0 and not v.bcast[j]) for v in body.views
    ]
    out = []
    for op, args, param, _ in body.program:
        d = frozenset().union(*(dims[a] for a in args)) if args else frozenset()
        if op in ROW_REDUCTIONS:
            d = d - set(param)
        dims.append(d)
        out.append(math.prod(body.space[g] for g in d))
    return out


def _map_work(body: MapBody, card: CardSpec) -> tuple[int, int]:
    """(SFU element-ops, flops) of a map body over its whole space.

    SFU: one pass per element of each op (``sfu_ops_per_elem_transcendental`` for
    transcendental ones; an in-program reduction reads every element of its input once) and one
    per element for the final reduction. Flops as XLA's cost analysis counts them: one per
    element per arithmetic op (moves, converts and selects count none); an in-program reduction
    counts one per element reduced.
    """
    sfu = flops = 0
    full = math.prod(body.space)
    for (op, _args, param, _), n in zip(body.program, _op_extents(body), strict=True):
        if op == "const":
            continue
        if op in ROW_REDUCTIONS:
            n *= math.prod(body.space[a] for a in param)
        sfu += n * (card.sfu_ops_per_elem_transcendental if op in TRANSCENDENTAL else 1)
        if op not in _MOVES:
            flops += n
    if body.reduce:
        sfu += full
        flops += full
    return sfu, flops


def _describe(body: MapBody) -> str:
    ops = [p[0] for p in body.program if p[0] != "const"]
    return ",".join(ops[:6]) + (f" then {body.reduce}" if body.reduce else "")


#: the tiler's guess at a step's fixed cost when it ranks matmul tilings (a tie-breaker that
#: favours fewer steps; a heuristic of the tiler, not a figure of the card or the timing model)
_STEP_OVERHEAD_S = 1e-7


def _matmul_stage(ctx: _Ctx, n: Node) -> Stage:
    a, b = n.inputs
    la, lb, lo = ctx.layout(a), ctx.layout(b), ctx.layout(n.out)
    B, M, K = a.shape
    N = b.shape[2]
    Kp, Np, No = la.device_shape[2], lb.device_shape[2], lo.device_shape[2]
    # N tiles: whole sticks of both the rhs and the output. When their dtypes pad N to different
    # extents (fp16 rhs, fp32 output: 150 -> 192 vs 160) no such tile divides both, and N is one
    # tile: the rhs block and the accumulator span the rhs's padded N, the output block its own
    # (the PE result is cropped, or zero-padded, to it).
    q = math.lcm(lb.elems_per_stick, lo.elems_per_stick)
    tn_c = [(t, t) for t in _divisors(math.gcd(Np, No)) if t % q == 0]
    if (Np, No) not in tn_c:
        tn_c.append((Np, No))
    tk_c = _cands(K, la.elems_per_stick) if Kp == K else [K]
    tm_c = _divisors(M)
    card = ctx.card
    best = None
    cands_all: list[tuple[float, int, int, tuple[int, int], int]] = []
    for tm, (tn, tno), tk in product(tm_c, tn_c, tk_c):
        gm, gn, gk = M // tm, Np // tn, K // tk
        ntiles = B * gm * gn
        steps = -(-ntiles // ctx.ncores) * gk
        slots = 2 if steps > 1 else 1
        tkp = Kp if tk == K else tk
        plan = (
            ctx.plan_bytes([((1, tm, tkp), la.dtype), ((1, tk, tn), lb.dtype)], slots)
            + ctx.plan_bytes([((1, tm, tno), lo.dtype)], slots)
            + ctx.plan_bytes([((1, tm, tn), "float32")], 1)
        )
        if plan > ctx.cap:
            continue
        per_step_tiles = min(ntiles, ctx.ncores)
        uniq_a = min(per_step_tiles, max(1, -(-per_step_tiles // gn)))
        uniq_b = min(per_step_tiles, gn)
        load = (
            uniq_a * tm * tkp * la.itemsize + uniq_b * tk * tn * lb.itemsize
        ) / card.device_memory_bw
        comp = 2 * tm * tn * tkp / card.pe_flops_per_cycle_per_core / card.clock_hz
        est = load + (steps - 1) * max(load, comp) + comp + steps * _STEP_OVERHEAD_S
        cands_all.append((est, steps, tm, (tn, tno), tk))
    if cands_all:
        # among tilings within 10% of the fastest, the one with the fewest steps
        fastest = min(c[0] for c in cands_all)
        near = [c for c in cands_all if c[0] <= 1.1 * fastest]
        est, _, tm, tn, tk = min(near, key=lambda c: (c[1], c[0]))
        best = ((est,), tm, tn, tk)
    if best is None:
        raise TilingError(
            f"spyre: matmul {a.shape}x{b.shape} cannot be tiled into the usable scratchpad "
            f"({ctx.cap} B per core)" + (f"\n  at: {n.source}" if n.source else "")
        )
    _, tm, (tn, tno), tk = best
    gm, gn, gk = M // tm, Np // tn, K // tk
    grid = (B, gm, gn, gk)
    tkp = Kp if tk == K else tk
    if gk > 1:
        lhs = Operand(ctx.name(a), (1, tm, tk), (0, 1, 3), "lhs")
        rhs = Operand(ctx.name(b), (1, tk, tn), (0, 3, 2), "rhs")
    else:
        lhs = Operand(ctx.name(a), (1, tm, Kp), (0, 1, -1), "lhs")
        rhs = Operand(ctx.name(b), (1, K, tn), (0, -1, 2), "rhs")
    out = Operand(ctx.name(n.out), (1, tm, tno), (0, 1, 2), "out")
    steps = -(-(B * gm * gn) // ctx.ncores) * gk
    slots = 2 if steps > 1 else 1
    scratch = ctx.sp_plan(
        [
            ("lhs", lhs.block, la.dtype, slots),
            ("rhs", rhs.block, lb.dtype, slots),
            ("acc", (1, tm, tn), "float32", 1),
            ("out", out.block, lo.dtype, slots),
        ]
    )
    tabs = _tables(grid, [lhs, rhs, out], [la, lb, lo], ctx.ncores, reduce_axis=3)
    return Stage(
        f"s{len(ctx.stages)}",
        "matmul",
        grid,
        3,
        (lhs, rhs),
        out,
        scratch,
        (("PE", "matmul", MatmulBody(K, lo.dtype)),),
        *tabs,
        flops=2 * B * M * N * K,
        source=n.source,
    )


def _gather_stage(ctx: _Ctx, n: Node) -> Stage:
    table, idx = n.inputs
    li, lo = ctx.layout(idx), ctx.layout(n.out)
    (N,) = idx.shape
    Dp = lo.device_shape[1]
    tr_c = _cands(N, li.elems_per_stick) if li.device_shape[0] == N else [N]
    td_c = _cands(Dp, lo.elems_per_stick)

    def plan(bl: list[int], multi: bool) -> int:
        tr, td = bl
        trp = li.device_shape[0] if tr == N else tr
        return ctx.plan_bytes([((trp,), "int32"), ((tr, td), lo.dtype)], 2 if multi else 1)

    tr, td = _choose([N, Dp], [tr_c, td_c], plan, ctx.cap, ctx.ncores, "gather", n.source)
    trp = li.device_shape[0] if tr == N else tr
    grid = (N // tr, Dp // td)
    iop = Operand(ctx.name(idx), (trp,), (0 if tr != N else -1,), "idx")
    out = Operand(ctx.name(n.out), (tr, td), (0, 1), "rows")
    slots = 2 if math.prod(grid) > ctx.ncores else 1
    scratch = ctx.sp_plan(
        [("idx", iop.block, "int32", slots), ("rows", out.block, lo.dtype, slots)]
    )
    tabs = _tables(grid, [iop, out], [li, lo], ctx.ncores)
    body = GatherBody(ctx.name(table), table.shape[0], n.p("mode"), n.p("fill_value"))
    return Stage(
        f"s{len(ctx.stages)}",
        "gather",
        grid,
        -1,
        (iop,),
        out,
        scratch,
        (("LSU", "gather", body),),
        *tabs,
        source=n.source,
    )


def _reshape_stage(ctx: _Ctx, n: Node) -> Stage:
    (x,) = n.inputs
    src, dst = x.shape or (1,), n.out.shape or (1,)
    l_in, l_out = src[-1], dst[-1]
    r_in, r_out = math.prod(src[:-1]), math.prod(dst[:-1])
    base_in, base_out = ctx.name(x), ctx.name(n.out)
    vin = ctx.view(base_in, (r_in, l_in), x.dtype)
    # the output is written through a 2-d view of itself
    vout = ctx.view(base_out, (r_out, l_out), x.dtype)
    li, lo = ctx.decls[vin].layout, ctx.decls[vout].layout
    q = math.lcm(l_in, l_out) // l_out
    cands = [d for d in _divisors(r_out) if d % q == 0] or [r_out]

    def plan(bl: list[int], multi: bool) -> int:
        ro = bl[0]
        ri = ro * l_out // l_in
        return ctx.plan_bytes(
            [((ri, li.device_shape[1]), x.dtype), ((ro, lo.device_shape[1]), x.dtype)],
            2 if multi else 1,
        )

    (ro,) = _choose([r_out], [cands], plan, ctx.cap, ctx.ncores, "reshape", n.source)
    ri = ro * l_out // l_in
    grid = (r_out // ro,)
    iop = Operand(vin, (ri, li.device_shape[1]), (0, -1), "in")
    out = Operand(vout, (ro, lo.device_shape[1]), (0, -1), "out")
    slots = 2 if grid[0] > ctx.ncores else 1
    scratch = ctx.sp_plan([("in", iop.block, x.dtype, slots), ("out", out.block, x.dtype, slots)])
    tabs = _tables(grid, [iop, out], [li, lo], ctx.ncores)
    return Stage(
        f"s{len(ctx.stages)}",
        "reshape",
        grid,
        -1,
        (iop,),
        out,
        scratch,
        (("LSU", "reshape", ReshapeBody(l_in, l_out)),),
        *tabs,
        source=n.source,
    )


def _concat_stage(ctx: _Ctx, n: Node) -> Stage:
    ax = n.p("axis")
    lays = [ctx.layout(v) for v in n.inputs]
    lo = ctx.layout(n.out)
    r = len(n.out.shape)
    # tile the leading dim when it is not the axis (and not the stick dim)
    tile0 = ax != 0 and r >= 2
    e0 = n.out.shape[0] if tile0 else 1
    cands = _divisors(e0) if tile0 else [1]

    def blocks(b0: int) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
        ib = [
            tuple(b0 if (d == 0 and tile0) else lay.device_shape[d] for d in range(r))
            for lay in lays
        ]
        ob = tuple(b0 if (d == 0 and tile0) else lo.device_shape[d] for d in range(r))
        return ib, ob

    def plan(bl: list[int], multi: bool) -> int:
        ib, ob = blocks(bl[0])
        items = [(b, lay.dtype) for b, lay in zip(ib, lays, strict=True)] + [(ob, lo.dtype)]
        return ctx.plan_bytes(items, 2 if multi else 1)

    (b0,) = _choose([e0], [cands], plan, ctx.cap, ctx.ncores, "concatenate", n.source)
    ib, ob = blocks(b0)
    grid = (e0 // b0,)
    gd = tuple(0 if (d == 0 and tile0) else -1 for d in range(r))
    inputs = [
        Operand(ctx.name(v), b, gd, f"in{i}")
        for i, (v, b) in enumerate(zip(n.inputs, ib, strict=True))
    ]
    out = Operand(ctx.name(n.out), ob, gd, "out")
    slots = 2 if grid[0] > ctx.ncores else 1
    scratch = ctx.sp_plan(
        [
            (f"in{i}", op.block, lay.dtype, slots)
            for i, (op, lay) in enumerate(zip(inputs, lays, strict=True))
        ]
        + [("out", ob, lo.dtype, slots)]
    )
    tabs = _tables(grid, [*inputs, out], [*lays, lo], ctx.ncores)
    body = ConcatBody(ax, tuple(v.shape[ax] for v in n.inputs))
    return Stage(
        f"s{len(ctx.stages)}",
        "concat",
        grid,
        -1,
        tuple(inputs),
        out,
        scratch,
        (("LSU", "concat", body),),
        *tabs,
        source=n.source,
    )


_BUILDERS = {
    "map": _map_stage,
    "matmul": _matmul_stage,
    "gather": _gather_stage,
    "concatenate": _concat_stage,
}


def schedule(g: Graph, card: CardSpec) -> Kernel:
    """Lower a fused graph (after ``to_maps``/``fuse_maps``) to a :class:`Kernel`."""
    ctx = _Ctx(card)
    for i, v in enumerate(g.inputs):
        ctx.declare(v, "input", f"arg{i}")
    for i, (v, _) in enumerate(g.consts):
        ctx.declare(v, "const", f"const{i}")
    for n in g.nodes:
        for o in n.outputs:
            ctx.declare(o, "temp")
        if n.op == "reshape":
            (x,) = n.inputs
            if is_free_reshape(x.shape, n.out.shape, x.dtype, card.stick_bytes):
                # the output is a view of the input's buffer: no stage, no traffic
                nm = ctx.name(n.out)
                ctx.decls[nm] = TensorDecl(nm, ctx.decls[nm].layout, "view")
                ctx.aliases.append((nm, ctx.name(x)))
                continue
            ctx.stages.append(_reshape_stage(ctx, n))
            continue
        builder = _BUILDERS.get(n.op)
        if builder is None:
            raise TilingError(f"spyre: no schedule for op {n.op!r}")  # pragma: no cover
        built = builder(ctx, n)
        ctx.stages.extend(built if isinstance(built, list) else [built])
    outs = []
    for v in g.outputs:
        nm = ctx.name(v)
        outs.append(nm)
        if ctx.decls[nm].role == "temp":
            ctx.decls[nm] = TensorDecl(nm, ctx.decls[nm].layout, "output")
    inputs = tuple(ctx.name(v) for v in g.inputs) + tuple(ctx.name(v) for v, _ in g.consts)
    consts = tuple((ctx.name(v), a) for v, a in g.consts)
    return Kernel(
        g.name,
        tuple(ctx.decls.values()),
        tuple(ctx.stages),
        inputs,
        tuple(outs),
        tuple(ctx.aliases),
        num_cores=card.num_cores,
        sp_capacity=ctx.cap,
        stick_bytes=card.stick_bytes,
        dl16=card.dl16_rounding,
        consts=consts,
    )
