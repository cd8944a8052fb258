"""General tiling of the data-movement and PE nodes (matmul, gather, reshape, concatenate),
used when a node has no tiling in whole blocks (see :mod:`lowering.schedule`): ragged blocks
along every dim, a matmul's K split across steps with fp32 partial sums, re-layouts in chunks
of rows, concatenations tiled along their axis through windows of the inputs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from device_model.kernel import Operand, Stage, TensorDecl
from device_model.layout import TensorLayout, layout_for
from device_model.steps import ConcatStep, GatherStep, ReshapeStep

from .errors import TilingError
from .graph import Node
from .tiling import (
    _STEP_OVERHEAD_S,
    _align,
    _cands,
    _choose_general,
    _Ctx,
    _divisors,
    _NoFit,
    _ragged_cands,
    _tables,
    matmul_stage,
)


def lsu_stage(
    ctx: _Ctx,
    name: str,
    grid: tuple[int, ...],
    inputs: tuple[Operand, ...],
    out: Operand,
    lays: list[TensorLayout],
    scratch: Any,
    step: ReshapeStep | ConcatStep,
    source: str,
) -> Stage:
    """A data-movement stage (a reshape or concat ``step``: the LSU moves the inputs' blocks
    into ``out``'s) over ``grid``, with its scratchpad plan and step tables (``lays``: the
    inputs' layouts, then the output's)."""
    tabs = _tables(grid, [*inputs, out], lays, ctx.ncores)
    return Stage(
        name=name,
        grid=grid,
        inputs=inputs,
        output=out,
        scratch=scratch,
        step=step,
        **tabs,
        source=source,
    )


def reshape_stage(
    ctx: _Ctx,
    name: str,
    grid: tuple[int, ...],
    iop: Operand,
    out: Operand,
    lays: tuple[TensorLayout, TensorLayout],
    dtype: str,
    slots: int,
    body: ReshapeStep,
    source: str,
) -> Stage:
    """A reshape stage (the LSU re-lays ``iop``'s blocks as ``out``'s), ``slots`` per buffer."""
    scratch = ctx.sp_plan([("in", iop.block, dtype, slots), ("out", out.block, dtype, slots)])
    return lsu_stage(ctx, name, grid, (iop,), out, list(lays), scratch, body, source)


def gather_stage(
    ctx: _Ctx,
    n: Node,
    grid: tuple[int, ...],
    iop: Operand,
    out: Operand,
    lays: tuple[TensorLayout, TensorLayout],
    slots: int,
) -> Stage:
    """The gather ``n`` as a stage over ``grid``: the LSU loads each core's ``iop`` block of
    indices and fetches the table's rows into ``out``'s block (``lays``: the indices' and the
    output's layouts), ``slots`` per buffer."""
    table = n.inputs[0]
    scratch = ctx.sp_plan(
        [("idx", iop.block, "int32", slots), ("rows", out.block, lays[1].dtype, slots)]
    )
    step = GatherStep(
        table=ctx.name(table),
        num_rows=table.shape[0],
        mode=n.params.mode,
        fill_value=n.params.fill_value,
    )
    return Stage(
        name=f"s{len(ctx.stages)}",
        grid=grid,
        inputs=(iop,),
        output=out,
        scratch=scratch,
        step=step,
        **_tables(grid, [iop, out], list(lays), ctx.ncores),
        source=n.source,
    )


def _matmul_general(ctx: _Ctx, n: Node, first_err: TilingError) -> Stage:
    """A matmul in ragged blocks: M in rows, N in whole sticks, K split across steps in whole
    lhs sticks (fp32 partial sums carried in the accumulator; a last K block past K is
    masked). Single-buffered when nothing else fits."""
    a, b = n.inputs[:2]
    la, lb, lo = ctx.layout(a), ctx.layout(b), ctx.layout(n.out)
    B, M, K = a.shape
    N = n.out.shape[2]
    rhs_t = n.params.rhs_t
    Kp, No = la.device_shape[2], lo.device_shape[2]
    if rhs_t:
        # an NT rhs [B, N, Kr]: N blocks in rows (whole output sticks; the last one may reach
        # past N: its output columns are masked), K blocks in whole sticks of both operands
        Np, Kr = N, lb.device_shape[2]
        q, qk = lo.elems_per_stick, math.lcm(la.elems_per_stick, lb.elems_per_stick)
    else:
        Np, Kr = lb.device_shape[2], K
        q, qk = math.lcm(lb.elems_per_stick, lo.elems_per_stick), la.elems_per_stick
    card = ctx.card
    al = lambda x: -(-x // card.stick_bytes) * card.stick_bytes  # noqa: E731
    tm_c = np.asarray([M] + _ragged_cands(M, 1), np.int64)
    tn_c = np.asarray([0] + _ragged_cands(N, q), np.int64)  # 0: the whole N
    tk_c = np.asarray([0] + _ragged_cands(K, qk), np.int64)  # 0: the whole K
    TM, TN, TK = (x.reshape(-1) for x in np.meshgrid(tm_c, tn_c, tk_c, indexing="ij"))
    wn, wk = TN == 0, TK == 0
    gm = -(-M // TM)
    gn = np.where(wn, 1, -(-N // np.maximum(TN, 1)))
    gk = np.where(wk, 1, -(-K // np.maximum(TK, 1)))
    tn_r = np.where(wn, Np, TN)  # the rhs block's (and the accumulator's) N
    tn_o = np.where(wn, No, TN)
    tkp = np.where(wk, Kp, TK)  # the lhs block's K
    tkr = np.where(wk, Kr, TK)  # the rhs block's K
    ntiles = B * gm * gn
    steps = -(-ntiles // ctx.ncores) * gk
    alv = np.vectorize(al, otypes=[np.int64])
    best = None
    for single in (False, True):
        slots = np.where(single | (steps > 1), np.where(single, 1, 2), 1)
        plan = (
            alv(TM * tkp * la.itemsize) * slots
            + alv(tkr * tn_r * lb.itemsize) * slots
            + alv(TM * tn_o * lo.itemsize) * slots
            + alv(TM * tn_r * 4)
        )
        ok = plan <= ctx.cap
        if not ok.any():
            continue
        per = np.minimum(ntiles, ctx.ncores)
        uniq_a = np.minimum(per, np.maximum(1, -(-per // gn)))
        uniq_b = np.minimum(per, gn)
        load = (uniq_a * TM * tkp * la.itemsize + uniq_b * tkr * tn_r * lb.itemsize) / (
            card.memory_bw_one_way
        )
        comp = 2 * TM * tn_r * tkp / card.pe_flops_sustained_per_core
        over = 0.0 if not single else 1.0
        est = load + (steps - 1) * (np.maximum(load, comp) + over * np.minimum(load, comp))
        est = est + comp + steps * _STEP_OVERHEAD_S
        est = np.where(ok, est, np.inf)
        fastest = est.min()
        near = np.flatnonzero(est <= 1.1 * fastest)
        pick = near[np.lexsort((est[near], steps[near]))[0]]
        best = (int(TM[pick]), int(TN[pick]), int(TK[pick]), single)
        break
    if best is None:
        one = (
            al(la.elems_per_stick * la.itemsize) * 1
            + al(lb.elems_per_stick * q * lb.itemsize)
            + al(q * lo.itemsize)
            + al(q * 4)
        )
        raise TilingError(
            f"spyre: matmul {a.shape}x{b.shape} cannot be tiled into the usable scratchpad "
            f"({ctx.cap} B per core): even blocks of one stick need about {one} B"
            + (f"\n  at: {n.source}" if n.source else "")
        ) from first_err
    tm, tn, tk, single = best
    whole_n, whole_k = tn == 0, tk == 0
    gm = -(-M // tm)
    gn = 1 if whole_n else -(-N // tn)
    gk = 1 if whole_k else -(-K // tk)
    grid = (B, gm, gn, gk)
    tn_r, tn_o = (Np, No) if whole_n else (tn, tn)
    if whole_k:
        lhs = Operand(ctx.name(a), (1, tm, Kp), (0, 1, -1), "lhs")
        rblk, rdims = ((1, tn_r, Kr), (0, 2, -1)) if rhs_t else ((1, K, tn_r), (0, -1, 2))
    else:
        lhs = Operand(ctx.name(a), (1, tm, tk), (0, 1, 3), "lhs")
        rblk, rdims = ((1, tn_r, tk), (0, 2, 3)) if rhs_t else ((1, tk, tn_r), (0, 3, 2))
    rhs = Operand(ctx.name(b), rblk, rdims, "rhs")
    out = Operand(ctx.name(n.out), (1, tm, tn_o), (0, 1, 2), "out")
    steps = -(-(B * gm * gn) // ctx.ncores) * gk
    slots = 1 if single else (2 if steps > 1 else 1)
    return matmul_stage(ctx, n, grid, (lhs, rhs, out), (la, lb, lo), slots, (1, tm, tn_r))


def _gather_general(ctx: _Ctx, n: Node, first_err: TilingError) -> list[Stage]:
    """A gather in ragged blocks of index rows (whole int32 sticks) and whole-stick column
    blocks dividing the row; the table stays in device memory whatever its size (rows are
    fetched by index)."""
    table, idx = n.inputs
    li, lo = ctx.layout(idx), ctx.layout(n.out)
    (N,) = idx.shape
    Dp = lo.device_shape[1]
    cands = {
        0: _ragged_cands(N, li.elems_per_stick),
        1: [d for d in sorted(_cands(Dp, lo.elems_per_stick), reverse=True) if d < Dp],
    }

    def blocks(bl: dict[int, int | None]) -> tuple[int, int, int]:
        tr = N if bl[0] is None else bl[0]
        trp = li.device_shape[0] if bl[0] is None else bl[0]
        td = Dp if bl[1] is None else bl[1]
        return tr, trp, td

    need = 0
    for single in (False, True):

        def plan(bl: dict[int, int | None], multi: bool, single: bool = single) -> int:
            tr, trp, td = blocks(bl)
            slots = 1 if single else (2 if multi else 1)
            return ctx.plan_bytes([((trp,), "int32"), ((tr, td), lo.dtype)], slots)

        try:
            bl = _choose_general({0: N, 1: Dp}, cands, [0, 1], [], plan, ctx.cap, ctx.ncores)
            break
        except _NoFit as e:
            need = e.need
    else:
        raise TilingError(
            f"spyre: gather cannot be tiled into the usable scratchpad ({ctx.cap} B per core): "
            f"even the smallest tiling (a stick of indices and their rows) needs {need} B"
            + (f"\n  at: {n.source}" if n.source else "")
        ) from first_err
    tr, trp, td = blocks(bl)
    grid = (-(-N // tr), Dp // td)
    iop = Operand(ctx.name(idx), (trp,), (0 if bl[0] is not None else -1,), "idx")
    out = Operand(ctx.name(n.out), (tr, td), (0, 1), "rows")
    multi = -(-math.prod(grid) // ctx.ncores) > 1
    slots = 1 if single else (2 if multi else 1)
    return [gather_stage(ctx, n, grid, iop, out, (li, lo), slots)]


def _reshape_general(ctx: _Ctx, n: Node, first_err: TilingError) -> list[Stage]:
    """A re-layout in ragged row blocks, rows split into chunks when one does not fit.

    With ``l_in``/``l_out`` the logical row lengths before and after: when ``l_out`` divides
    ``l_in`` each input row becomes ``R = l_in / l_out`` output rows, read as a ``(rows, R,
    l_out)`` view of the output, and a block may hold ``m`` of them (its ``m * l_out`` input
    elements whole sticks; the last chunk of a row ragged); the other way round likewise.
    Otherwise blocks hold whole groups of rows that end together on both sides; when those do
    not fit either, the re-layout goes through rows of ``gcd(l_in, l_out)``.
    """
    (x,) = n.inputs
    src, dst = x.shape or (1,), n.out.shape or (1,)
    l_in, l_out = src[-1], dst[-1]
    r_in, r_out = math.prod(src[:-1]), math.prod(dst[:-1])
    base_in, base_out = ctx.name(x), ctx.name(n.out)
    dt = x.dtype
    stick = ctx.card.stick_bytes
    mark = ctx.mark()
    try:
        if l_in % l_out == 0 or l_out % l_in == 0:
            return [_reshape_chunks(ctx, n, base_in, base_out, dt, l_in, l_out, r_in, r_out)]
        return [_reshape_groups(ctx, n, base_in, base_out, dt, l_in, l_out, r_in, r_out)]
    except _NoFit as e:
        need = e.need
        ctx.rollback(mark)
    # through rows of a common divisor of both row lengths, the largest that fits: the gcd
    # first, then smaller ones (rows of 1 element at worst: each its own stick, a temp that
    # large only for rows longer than the scratchpad whose length has no other divisor)
    g = math.gcd(l_in, l_out)
    mids = [d for d in sorted(_divisors(g), reverse=True) if d not in (l_in, l_out)]
    total = r_in * l_in
    for d in mids[:4] + ([1] if mids[4:] else []):
        mid = f"{base_out}_m{len(ctx.decls)}"
        ctx.decls[mid] = TensorDecl(mid, layout_for((total // d, d), dt, stick), "temp")
        try:
            s1 = _reshape_chunks(ctx, n, base_in, mid, dt, l_in, d, r_in, total // d)
            s2 = _reshape_chunks(ctx, n, mid, base_out, dt, d, l_out, total // d, r_out, 1)
            return [s1, s2]
        except _NoFit as e:
            need = min(need, e.need)
            ctx.rollback(mark)
        del ctx.decls[mid]
    raise TilingError(
        f"spyre: reshape {x.shape} -> {n.out.shape} cannot be tiled into the usable scratchpad "
        f"({ctx.cap} B per core): the smallest tiling needs {need} B"
        + (f"\n  at: {n.source}" if n.source else "")
    ) from first_err


def _reshape_chunks(
    ctx: _Ctx,
    n: Node,
    base_in: str,
    base_out: str,
    dt: str,
    l_in: int,
    l_out: int,
    r_in: int,
    r_out: int,
    offset: int = 0,
) -> Stage:
    """A re-layout where one row length divides the other (see :func:`_reshape_general`); the
    stage is numbered ``offset`` past the ones already scheduled."""
    finer = l_in % l_out == 0  # each input row makes R output rows
    R = l_in // l_out if finer else l_out // l_in
    rows = r_in if finer else r_out
    if finer:
        vin = ctx.view(base_in, (rows, l_in), dt)
        vout = ctx.view(base_out, (rows, R, l_out), dt)
    else:
        vin = ctx.view(base_in, (rows, R, l_in), dt)
        vout = ctx.view(base_out, (rows, l_out), dt)
    li, lo = ctx.decls[vin].layout, ctx.decls[vout].layout
    eps = (li if finer else lo).elems_per_stick
    unit = l_out if finer else l_in
    # m rows per chunk: m * unit elements of the long rows, whole sticks (the last chunk ragged)
    cands = {0: _ragged_cands(rows, 1), 1: _ragged_cands(R, eps // math.gcd(eps, unit))}

    def blocks(bl: dict[int, int | None]) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
        rb = rows if bl[0] is None else bl[0]
        m = bl[1]
        if finer:
            ib = (rb, li.device_shape[1] if m is None else m * l_out)
            ob = (rb, R if m is None else m, lo.device_shape[2])
            return ib, ob, (l_in if m is None else m * l_out), l_out
        ib = (rb, R if m is None else m, li.device_shape[2])
        ob = (rb, lo.device_shape[1] if m is None else m * l_in)
        return ib, ob, l_in, (l_out if m is None else m * l_in)

    bl = None
    for single in (False, True):

        def plan(bl: dict[int, int | None], multi: bool, single: bool = single) -> int:
            ib, ob, _, _ = blocks(bl)
            slots = 1 if single else (2 if multi else 1)
            return ctx.plan_bytes([(ib, dt), (ob, dt)], slots)

        try:
            bl = _choose_general({0: rows, 1: R}, cands, [0, 1], [], plan, ctx.cap, ctx.ncores)
            break
        except _NoFit:
            if single:
                raise
    assert bl is not None
    ib, ob, le_in, le_out = blocks(bl)
    g0 = 1 if bl[0] is None else -(-rows // bl[0])
    g1 = 1 if bl[1] is None else -(-R // bl[1])
    grid = (g0, g1)
    d0 = 0 if bl[0] is not None else -1
    d1 = 1 if bl[1] is not None else -1
    if finer:
        iop = Operand(vin, ib, (d0, d1), "in")
        out = Operand(vout, ob, (d0, d1, -1), "out")
    else:
        iop = Operand(vin, ib, (d0, d1, -1), "in")
        out = Operand(vout, ob, (d0, d1), "out")
    multi = -(-g0 * g1 // ctx.ncores) > 1
    slots = 1 if single else (2 if multi else 1)
    name = f"s{len(ctx.stages) + offset}"
    body = ReshapeStep(l_in=le_in, l_out=le_out)
    return reshape_stage(ctx, name, grid, iop, out, (li, lo), dt, slots, body, n.source)


def _reshape_groups(
    ctx: _Ctx,
    n: Node,
    base_in: str,
    base_out: str,
    dt: str,
    l_in: int,
    l_out: int,
    r_in: int,
    r_out: int,
) -> Stage:
    """A re-layout in ragged blocks of row groups that end together on both sides."""
    vin = ctx.view(base_in, (r_in, l_in), dt)
    vout = ctx.view(base_out, (r_out, l_out), dt)
    li, lo = ctx.decls[vin].layout, ctx.decls[vout].layout
    q = math.lcm(l_in, l_out) // l_out
    cands = {0: [c for c in _ragged_cands(r_out, q) if c % q == 0]}
    for single in (False, True):

        def plan(bl: dict[int, int | None], multi: bool, single: bool = single) -> int:
            ro = r_out if bl[0] is None else bl[0]
            ri = r_in if bl[0] is None else ro * l_out // l_in
            slots = 1 if single else (2 if multi else 1)
            return ctx.plan_bytes(
                [((ri, li.device_shape[1]), dt), ((ro, lo.device_shape[1]), dt)], slots
            )

        try:
            bl = _choose_general({0: r_out}, cands, [0], [], plan, ctx.cap, ctx.ncores)
            break
        except _NoFit:
            if single:
                raise
    ro = r_out if bl[0] is None else bl[0]
    ri = r_in if bl[0] is None else ro * l_out // l_in
    grid = (-(-r_out // ro),)
    d0 = 0 if bl[0] is not None else -1
    iop = Operand(vin, (ri, li.device_shape[1]), (d0, -1), "in")
    out = Operand(vout, (ro, lo.device_shape[1]), (d0, -1), "out")
    slots = 1 if single else (2 if -(-grid[0] // ctx.ncores) > 1 else 1)
    body = ReshapeStep(l_in=l_in, l_out=l_out)
    name = f"s{len(ctx.stages)}"
    return reshape_stage(ctx, name, grid, iop, out, (li, lo), dt, slots, body, n.source)


def _concat_general(ctx: _Ctx, n: Node, first_err: TilingError) -> Stage:
    """A concatenation tiled along every dim, the axis included: output block ``k`` along the
    axis reads from each input the window of its positions (a window starts a whole stick
    before when the input's offset is not stick-aligned) and takes each position from the
    input whose range holds it."""
    ax = n.params.axis
    lays = [ctx.layout(v) for v in n.inputs]
    lo = ctx.layout(n.out)
    S = n.out.shape
    r = len(S)
    sizes = tuple(v.shape[ax] for v in n.inputs)
    offsets = tuple(int(x) for x in np.cumsum((0, *sizes[:-1])))
    quant = [lo.elems_per_stick if d == r - 1 else 1 for d in range(r)]
    cands = {d: _ragged_cands(S[d], quant[d]) for d in range(r)}
    par = [d for d in range(r) if cands[d]]

    def layout_of(bl: dict[int, int | None]) -> tuple:
        ob = tuple(lo.device_shape[d] if bl.get(d) is None else bl[d] for d in range(r))
        ins = []
        for lay, off in zip(lays, offsets, strict=True):
            blk, org, stp = [], [], []
            loc = 0
            for d in range(r):
                if d == ax and bl.get(d) is not None:
                    q, b = quant[d], bl[d]
                    o = ((-off) // q) * q
                    loc = -off - o
                    blk.append(_align(loc + b, q))
                    org.append(o)
                    stp.append(b)
                else:
                    bb = lay.device_shape[d] if bl.get(d) is None else bl[d]
                    blk.append(bb)
                    org.append(0)
                    stp.append(bb)
            ins.append((tuple(blk), tuple(org), tuple(stp), loc))
        return ob, ins

    for single in (False, True):

        def plan(bl: dict[int, int | None], multi: bool, single: bool = single) -> int:
            ob, ins = layout_of(bl)
            slots = 1 if single else (2 if multi else 1)
            items = [(w[0], lay.dtype) for w, lay in zip(ins, lays, strict=True)]
            return ctx.plan_bytes(items + [(ob, lo.dtype)], slots)

        try:
            bl = _choose_general(dict(enumerate(S)), cands, par, [], plan, ctx.cap, ctx.ncores)
            break
        except _NoFit as e:
            need = e.need
    else:
        raise TilingError(
            f"spyre: concatenate cannot be tiled into the usable scratchpad ({ctx.cap} B per "
            f"core): even the smallest tiling needs {need} B"
            + (f"\n  at: {n.source}" if n.source else "")
        ) from first_err
    ob, ins = layout_of(bl)
    grid = tuple(1 if bl.get(d) is None else -(-S[d] // bl[d]) for d in range(r))
    gd = tuple(-1 if bl.get(d) is None else d for d in range(r))
    inputs = []
    for i, (v, (blk, org, stp, _)) in enumerate(zip(n.inputs, ins, strict=True)):
        windowed = any(org) or stp != blk
        inputs.append(
            Operand(
                ctx.name(v), blk, gd, f"in{i}", org if windowed else (), stp if windowed else ()
            )
        )
    out = Operand(ctx.name(n.out), ob, gd, "out")
    multi = -(-math.prod(grid) // ctx.ncores) > 1
    slots = 1 if single else (2 if multi else 1)
    scratch = ctx.sp_plan(
        [
            (f"in{i}", op.block, lay.dtype, slots)
            for i, (op, lay) in enumerate(zip(inputs, lays, strict=True))
        ]
        + [("out", ob, lo.dtype, slots)]
    )
    if bl.get(ax) is None:
        body = ConcatStep(axis=ax, sizes=sizes)
    else:
        body = ConcatStep(
            axis=ax,
            sizes=sizes,
            tile=bl[ax],
            offsets=offsets,
            local=tuple(w[3] for w in ins),
            out_grid=grid,
        )
    name = f"s{len(ctx.stages)}"
    ops = tuple(inputs)
    return lsu_stage(ctx, name, grid, ops, out, [*lays, lo], scratch, body, n.source)
