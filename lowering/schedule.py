"""From a fused graph to the schedule IR: layouts, tiling over the cores and into scratchpad.

For each node the tiler picks block sizes (whole sticks along every stick dimension, exact
divisors elsewhere), so that the tiles spread over the cores and the stage's scratchpad plan fits
the usable scratchpad; the plan is double-buffered when the stage has more than one step. Then the
work is divided (tile p runs on core p % n at step p // n, n the card's ``num_cores``) and the
load, ring and store tables are built: a block several cores need in one step is loaded by the
first of them and forwarded over the ring to the rest. A plan that does not fit is never
emitted: the tiler splits further (a reduction whose output rows cannot be tiled finely enough
writes one element per stick to a temp, then packs it).

When no tiling in whole blocks fits, the general tiling takes over (:mod:`lowering.tile_map`,
:mod:`lowering.tile_moves`; shared helpers in :mod:`lowering.tiling`): every dim of every op may
be cut, the stick dim and the reduced axis included, in blocks that need not divide it (the last
block is ragged); a slice, a strided slice or a shifted input of a concatenation is read in
windows of the input; a reduction too long for the scratchpad (sum/max/min/prod/argmax/argmin/
cumsum along any axis) is split across steps with a carried accumulator in the compute type
(fp32 for floats); a matmul's K is split with fp32 partial sums whatever its length; a
transpose whose blocks would need a stick of both layouts goes through a one-element-per-stick
temp; re-layouts split their rows; gathers tile the index rows (the table stays in device
memory, whatever its size); and as a last resort the buffers are single-buffered.
:class:`TilingError` is left only for what cannot fit even the smallest such blocks: one stick
per buffer, or, for a re-layout between layouts whose sticks cross (a transpose, a matmul's K,
packing one element per stick), one stick's worth of sticks (64 fp16 sticks, 8 KiB). Tensors
without elements need no stage; a reduction over an empty axis is a fill with the reduction's
identity (argmax/argmin over an empty axis raise).

Every figure of the card (cores, stick size, usable scratchpad, bandwidths) comes from the
:class:`~device_model.card.CardSpec` passed in.
"""

from __future__ import annotations

import logging
import math
from itertools import product
from typing import Any

from device_model.card import CardSpec
from device_model.kernel import Kernel, Operand, Stage, TensorDecl
from device_model.layout import TensorLayout, layout_for, np_dtype
from device_model.ops import (
    REDUCTIONS,
    InputView,
    MapBody,
    compute_dtype,
)
from device_model.progress import Progress
from device_model.steps import ConcatStep, MapStep, ReshapeStep
from device_model.timing import stage_cost

from .errors import TilingError
from .graph import Graph, Node, Var
from .matmul_passes import unfuse_epilogue
from .op_params import Map
from .passes import is_free_reshape
from .prologue import unfuse_prologue
from .tile_map import _map_general
from .tile_moves import (
    _concat_general,
    _gather_general,
    _matmul_general,
    _reshape_general,
    gather_stage,
    lsu_stage,
    reshape_stage,
)
from .tiling import (
    _STEP_OVERHEAD_S,
    _cands,
    _choose,
    _Ctx,
    _describe,
    _divisors,
    _map_work,
    _tables,
    epilogue_blocks,
    matmul_stage,
    prologue_blocks,
)

log = logging.getLogger("lowering")

__all__ = ["schedule", "map_fits"]


# ---------------------------------------------------------------------------------------------
# per-kind stage builders


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
    """A map node's stages: whole blocks first (:func:`_map_stage_whole`); when no such
    tiling fits, the general tiling (:func:`_map_general`: ragged edge blocks, windows of
    slices, a reduction split across steps). ``dry`` (the fusion pass's question) tries the
    first only: a fusion is made only where the fused map fits with whole rows."""
    try:
        return _map_stage_whole(ctx, n, dry)
    except TilingError as err:
        if dry:
            raise
        first_err = err
    body: MapBody = n.params.body
    return _map_general(
        ctx,
        body,
        [ctx.name(v) for v in n.inputs],
        [ctx.layout(v) for v in n.inputs],
        ctx.name(n.out),
        ctx.layout(n.out),
        n.source,
        first_err,
    )


def _map_stage_whole(ctx: _Ctx, n: Node, dry: bool = False) -> list[Stage]:
    """A map node's stage; a reduction that does not fit goes through a one-per-stick temp.

    The output's last dim is its stick dim, so tiles of the output's rows come in whole output
    sticks (64 fp16), and a reduction over long rows then needs that many full input rows in
    the scratchpad at once. When that does not fit, the reduction writes a temp with a trailing
    size-1 dim instead (one element per stick, as the card's own stick-dim reductions do): its
    rows are not the stick dim and tile one by one. A second, copy stage packs the temp
    into the output's layout. With ``dry`` only the tiling is chosen (TilingError when none fits)
    and no stage is returned.
    """
    body: MapBody = n.params.body
    in_names = [ctx.name(v) for v in n.inputs]
    in_lays = [ctx.layout(v) for v in n.inputs]
    out_name, out_lay = ctx.name(n.out), ctx.layout(n.out)
    name = f"s{len(ctx.stages)}"
    try:
        st = _map_plan(ctx, body, in_names, in_lays, out_name, out_lay, name, n.source, dry)
        return [st] if st is not None else []
    except TilingError as err:
        if not body.reduction or body.reduction.scan or not out_lay.shape:
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
        if not (body.reduction and body.reduction.scan)
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
        name=name,
        grid=grid,
        inputs=tuple(inputs),
        output=output,
        scratch=scratch,
        step=MapStep(body=body, space_block=tuple(space_block)),
        **tabs,
        flops=flops,
        sfu_elem_ops=sfu,
        source=source,
    )


#: how many of the estimator's best matmul tilings the timing model ranks (see _pick_matmul)
MATMUL_RANKED = 6

#: simulated times this close (relative) count as a tie, won by the tiling of fewer steps
MATMUL_TIE = 0.01

#: ... or this close in absolute terms (s): for a tiny matmul, a step less matters more to the
#: simulation's speed than a fraction of a microsecond on the card
MATMUL_TIE_S = 0.2e-6


def _pick_matmul(
    ctx: _Ctx,
    cands: list[tuple[float, int, int, tuple[int, int], int, bool]],
    build: Any,
) -> tuple[Stage, tuple[int, int, int, int, bool]]:
    """The matmul tiling to use. The estimator's best few (``MATMUL_RANKED``), and the two of
    fewest steps among those it puts near the best, are built and timed by the timing model
    itself, which sees what the estimate does not (blocks shared by the cores of a step and
    multicast over the ring, stores draining behind later steps, the read/write mix). The
    fastest wins; near ties (``MATMUL_TIE``, ``MATMUL_TIE_S``) go to the fewer steps.

    ``cands``: ``(estimate s, steps, tm, (tn, output tn), tk, m_inner)`` per tiling that fits;
    ``build(tm, tn, tno, tk, m_inner)`` makes its stage. Returns the stage and its tiling."""
    ranked = sorted(cands, key=lambda c: (c[0], c[1]))
    # the estimator's best, and the fewest-step tilings it puts near them
    near = [c for c in ranked if c[0] <= ranked[0][0] * (1 + 3 * MATMUL_TIE) + 3 * MATMUL_TIE_S]
    shortlist = list(dict.fromkeys(ranked[:MATMUL_RANKED] + sorted(near, key=lambda c: c[1])[:2]))
    dtypes = ctx.dtypes()
    timed = []
    for _, steps, tm, (tn, tno), tk, m_inner in shortlist:
        st = build(tm, tn, tno, tk, m_inner)
        tiling = (tm, tn, tno, tk, m_inner)
        timed.append((stage_cost(st, dtypes, ctx.card)["time_s"], steps, st, tiling))
    fastest = min(c[0] for c in timed)
    # within a tie of the fastest, the fewest steps (a shorter simulation, about the same time)
    tie = max(fastest * MATMUL_TIE, MATMUL_TIE_S)
    best = min((c for c in timed if c[0] <= fastest + tie), key=lambda c: c[1])
    return best[2], best[3]


#: the tiling picked for a matmul signature (its layouts, parameters, epilogue operands' layouts
#: and the card): the identical layers of a model are searched once. At most this many, then
#: the cache starts over
MATMUL_CHOICES = 4096
_matmul_choices: dict[Any, tuple[int, int, int, int, bool]] = {}


def _matmul_key(ctx: _Ctx, n: Node) -> Any:
    """What a matmul's tiling depends on, hashable; None when a parameter is not."""
    key = (
        tuple(ctx.layout(v) for v in n.inputs),
        ctx.layout(n.out),
        n.params,
        ctx.card,
        ctx.cap,
        ctx.ncores,
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _matmul_stage_whole(ctx: _Ctx, n: Node) -> Stage:
    key = _matmul_key(ctx, n)
    known = _matmul_choices.get(key) if key is not None else None
    a, b = n.inputs[:2]
    la, lb, lo = ctx.layout(a), ctx.layout(b), ctx.layout(n.out)
    B, M, K = a.shape
    rhs_t = n.params.rhs_t
    Kp, No = la.device_shape[2], lo.device_shape[2]
    Kr = lb.device_shape[2] if rhs_t else K  # the rhs block's K when it is the whole K
    if rhs_t:
        # an NT rhs [B, N, Kr]: N in rows dividing N, whole output sticks (or the whole N: the
        # accumulator spans N, the output block its padded N); K split in whole sticks of both
        Np = N = n.out.shape[2]
        tn_c = [(t, t) for t in _divisors(N) if t % lo.elems_per_stick == 0 and t < N]
        tn_c.append((N, No))
        qk = math.lcm(la.elems_per_stick, lb.elems_per_stick)
        tk_c = _cands(K, qk) if Kp == K == Kr else [K]
    else:
        # N tiles: whole sticks of both the rhs and the output. When their dtypes pad N to
        # different extents (fp16 rhs, fp32 output: 150 -> 192 vs 160) no such tile divides
        # both, and N is one tile: the rhs block and the accumulator span the rhs's padded N,
        # the output block its own (the PE result is cropped, or zero-padded, to it).
        Np = lb.device_shape[2]
        q = math.lcm(lb.elems_per_stick, lo.elems_per_stick)
        tn_c = [(t, t) for t in _divisors(math.gcd(Np, No)) if t % q == 0]
        if (Np, No) not in tn_c:
            tn_c.append((Np, No))
        tk_c = _cands(K, la.elems_per_stick) if Kp == K else [K]
    tm_c = _divisors(M)
    card = ctx.card
    if known is not None:  # an identical matmul was tiled before: build its tiling
        tm_c, tn_c, tk_c = [known[0]], [(known[1], known[2])], [known[3]]
    cands_all: list[tuple[float, int, int, tuple[int, int], int, bool]] = []
    ep_items: dict[tuple[int, int], list[tuple[tuple[int, ...], str]]] = {}
    pro_items_of: dict[tuple[int, int], list[tuple[tuple[int, ...], str]]] = {}
    pro_body = n.params.prologue.body if n.params.prologue is not None else None
    # a prologue's SFU time per lhs element (its tiles pass the SFUs before the PE)
    pro_s = 0.0
    if pro_body is not None:
        sfu_rate = card.sfu_elems_per_cycle * card.corelets_per_core * card.clock_hz
        pro_s = _map_work(pro_body, card)[0] / max(1, math.prod(pro_body.space)) / sfu_rate
    for tm, (tn, tno), tk in product(tm_c, tn_c, tk_c):
        gm, gn, gk = M // tm, Np // tn, K // tk
        ntiles = B * gm * gn
        steps = -(-ntiles // ctx.ncores) * gk
        slots = 2 if steps > 1 else 1
        tkp, tkr = (Kp, Kr) if tk == K else (tk, tk)
        rblk = (1, tn, tkr) if rhs_t else (1, tk, tn)
        if (tm, tno) not in ep_items:  # an epilogue's operands, in blocks of the output's
            ep_items[tm, tno] = epilogue_blocks(ctx, n, tm, tno).plan_items()
        if (tm, tk) not in pro_items_of:  # a prologue's operands, in blocks of the lhs's
            pro_items_of[tm, tk] = prologue_blocks(ctx, n, tm, None if tk == K else tk).plan_items()
        pro_items = pro_items_of[tm, tk]
        pro_bytes = sum(math.prod(b) * np_dtype(dt).itemsize for b, dt in pro_items)
        plan = (
            ctx.plan_bytes([((1, tm, tkp), la.dtype), (rblk, lb.dtype)] + pro_items, slots)
            + ctx.plan_bytes([((1, tm, tno), lo.dtype)] + ep_items[tm, tno], slots)
            + ctx.plan_bytes([((1, tm, tn), "float32")], 1)
        )
        if plan > ctx.cap:
            continue
        per_step_tiles = min(ntiles, ctx.ncores)
        comp = 2 * tm * tn * tkp / card.pe_flops_sustained_per_core + tm * tkp * pro_s
        # the tiles of a step: N fastest (one lhs block shared, multicast) or, when M splits,
        # M fastest (one rhs block shared: the rhs is read once, the lhs once per round)
        for m_inner in (False, True) if gm > 1 else (False,):
            ga = gm if m_inner else gn
            shared = min(per_step_tiles, ga)  # blocks of the operand that varies fastest
            other = min(per_step_tiles, max(1, -(-per_step_tiles // ga)))
            uniq_a, uniq_b = (shared, other) if m_inner else (other, shared)
            bw = card.memory_bw_one_way
            load = (
                uniq_a * (tm * tkp * la.itemsize + pro_bytes) + uniq_b * tkr * tn * lb.itemsize
            ) / bw
            # a round's stores drain over the next round's K steps; the last round's at the end
            store = per_step_tiles * tm * tno * lo.itemsize / bw
            rounds = steps // gk
            est = (
                load
                + gk * max(load, comp)
                + (rounds - 1) * gk * max(load + store / gk, comp)
                + store
                + steps * _STEP_OVERHEAD_S
            )
            cands_all.append((est, steps, tm, (tn, tno), tk, m_inner))
    if not cands_all:
        raise TilingError(
            f"spyre: matmul {a.shape}x{b.shape} cannot be tiled into the usable scratchpad "
            f"({ctx.cap} B per core)" + (f"\n  at: {n.source}" if n.source else "")
        )

    def build(tm: int, tn: int, tno: int, tk: int, m_inner: bool) -> Stage:
        gm, gn, gk = M // tm, Np // tn, K // tk
        grid = (B, gm, gn, gk)
        if gk > 1:
            lhs = Operand(ctx.name(a), (1, tm, tk), (0, 1, 3), "lhs")
            if rhs_t:
                rhs = Operand(ctx.name(b), (1, tn, tk), (0, 2, 3), "rhs")
            else:
                rhs = Operand(ctx.name(b), (1, tk, tn), (0, 3, 2), "rhs")
        else:
            lhs = Operand(ctx.name(a), (1, tm, Kp), (0, 1, -1), "lhs")
            if rhs_t:
                rhs = Operand(ctx.name(b), (1, tn, Kr), (0, 2, -1), "rhs")
            else:
                rhs = Operand(ctx.name(b), (1, K, tn), (0, -1, 2), "rhs")
        out = Operand(ctx.name(n.out), (1, tm, tno), (0, 1, 2), "out")
        steps = -(-(B * gm * gn) // ctx.ncores) * gk
        slots = 2 if steps > 1 else 1
        order = (0, 2, 1) if m_inner else None
        return matmul_stage(
            ctx, n, grid, (lhs, rhs, out), (la, lb, lo), slots, (1, tm, tn), tile_order=order
        )

    if known is not None:
        return build(*known)
    stage, tiling = _pick_matmul(ctx, cands_all, build)
    if key is not None:
        if len(_matmul_choices) >= MATMUL_CHOICES:
            _matmul_choices.clear()
        _matmul_choices[key] = tiling
    return stage


def _gather_stage_whole(ctx: _Ctx, n: Node) -> Stage:
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
    return gather_stage(ctx, n, grid, iop, out, (li, lo), slots)


def _reshape_stage_whole(ctx: _Ctx, n: Node) -> Stage:
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
    body = ReshapeStep(l_in=l_in, l_out=l_out)
    name = f"s{len(ctx.stages)}"
    return reshape_stage(ctx, name, grid, iop, out, (li, lo), x.dtype, slots, body, n.source)


def _concat_stage_whole(ctx: _Ctx, n: Node) -> Stage:
    ax = n.params.axis
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
    body = ConcatStep(axis=ax, sizes=tuple(v.shape[ax] for v in n.inputs))
    name, ops = f"s{len(ctx.stages)}", tuple(inputs)
    return lsu_stage(ctx, name, grid, ops, out, [*lays, lo], scratch, body, n.source)


# ---------------------------------------------------------------------------------------------
# tensors without elements


def _is_empty(v: Var) -> bool:
    return bool(v.shape) and math.prod(v.shape) == 0


def _fill_stages(ctx: _Ctx, v: Var, value: Any, source: str) -> list[Stage]:
    """A stage that writes ``value`` into every element of ``v`` (no inputs)."""
    body = MapBody(v.shape, (), (("const", (), value, v.dtype),), "", (), v.dtype)
    lay = ctx.layout(v)
    try:
        st = _map_plan(ctx, body, [], [], ctx.name(v), lay, f"s{len(ctx.stages)}", source)
        assert st is not None
        return [st]
    except TilingError as err:
        return _map_general(ctx, body, [], [], ctx.name(v), lay, source, err)


def _empty_input_stages(ctx: _Ctx, n: Node) -> list[Stage] | None:
    """The stages of a node with a non-empty output that reads no elements (an input or the
    map's space has a 0), or None when the node is scheduled as usual."""
    if n.op == "map":
        body: MapBody = n.params.body
        if 0 not in body.space:
            return None
        kind = body.reduce
        if kind and REDUCTIONS[kind].index_of:
            raise TilingError(
                f"spyre: {kind} over an empty axis has no result"
                + (f"\n  at: {n.source}" if n.source else "")
            )
        if not kind or REDUCTIONS[kind].scan:  # pragma: no cover - the output is empty
            raise TilingError(f"spyre: a map over an empty space with a non-empty result: {body}")
        value = REDUCTIONS[kind].identity_value(np_dtype(compute_dtype(n.out.dtype)))
        return _fill_stages(ctx, n.out, value.item(), n.source)
    if n.op == "matmul" and n.inputs[0].shape[2] == 0:
        if n.params.prologue is not None:  # an empty lhs: nothing for the prologue to do
            for m in unfuse_prologue(n):
                _schedule_node(ctx, m, ctx.card)
            return []
        if n.params.epilogue is not None:  # a product of zeros, then the epilogue's map
            for m in unfuse_epilogue(n):
                _schedule_node(ctx, m, ctx.card)
            return []
        return _fill_stages(ctx, n.out, 0, n.source)
    if n.op == "gather" and n.inputs[0].shape[0] == 0:
        fill = n.params.fill_value
        if fill is None:
            fill = float("nan") if n.out.dtype in ("float16", "bfloat16", "float32") else 0
        return _fill_stages(ctx, n.out, fill, n.source)
    if n.op == "concatenate" and any(_is_empty(v) for v in n.inputs):
        keep = tuple(v for v in n.inputs if not _is_empty(v))
        if len(keep) == 1:
            (x,) = keep
            r = len(x.shape)
            body = MapBody(
                x.shape, (InputView.identity(r),), (("copy", (0,), None, x.dtype),), "", (), x.dtype
            )
            m = Node("map", keep, n.outputs, Map(body), n.source)
            return _map_stage(ctx, m)
        return _concat_stage(ctx, Node(n.op, keep, n.outputs, n.params, n.source))
    return None


def _matmul_stage(ctx: _Ctx, n: Node) -> list[Stage]:
    try:
        return [_matmul_stage_whole(ctx, n)]
    except TilingError as err:
        if n.params.prologue is not None:
            # the fused stage does not fit: the prologue's map makes the lhs, then the matmul
            for m in unfuse_prologue(n):
                _schedule_node(ctx, m, ctx.card)
            return []
        if n.params.epilogue is not None:
            # the fused stage does not fit: the matmul and its epilogue's map, one by one
            for m in unfuse_epilogue(n):
                _schedule_node(ctx, m, ctx.card)
            return []
        return [_matmul_general(ctx, n, err)]


def _gather_stage(ctx: _Ctx, n: Node) -> list[Stage]:
    try:
        return [_gather_stage_whole(ctx, n)]
    except TilingError as err:
        return _gather_general(ctx, n, err)


def _reshape_stage(ctx: _Ctx, n: Node) -> list[Stage]:
    mark = ctx.mark()
    try:
        return [_reshape_stage_whole(ctx, n)]
    except TilingError as err:
        ctx.rollback(mark)
        return _reshape_general(ctx, n, err)


def _concat_stage(ctx: _Ctx, n: Node) -> Stage:
    try:
        return _concat_stage_whole(ctx, n)
    except TilingError as err:
        return _concat_general(ctx, n, err)


_BUILDERS = {
    "map": _map_stage,
    "matmul": _matmul_stage,
    "gather": _gather_stage,
    "concatenate": _concat_stage,
}


def _schedule_node(ctx: _Ctx, n: Node, card: CardSpec) -> None:
    """Declare ``n``'s outputs and append its stages (none for a free reshape or an empty op)."""
    for o in n.outputs:
        ctx.declare(o, "temp")
    if any(_is_empty(o) for o in n.outputs):
        return  # nothing to compute or store
    empty = _empty_input_stages(ctx, n)
    if empty is not None:
        ctx.stages.extend(empty)
        return
    if n.op == "reshape":
        (x,) = n.inputs
        if is_free_reshape(x.shape, n.out.shape, x.dtype, card.stick_bytes):
            # the output is a view of the input's buffer: no stage, no traffic
            nm = ctx.name(n.out)
            ctx.decls[nm] = TensorDecl(nm, ctx.decls[nm].layout, "view")
            ctx.aliases.append((nm, ctx.name(x)))
            return
        ctx.stages.extend(_reshape_stage(ctx, n))
        return
    builder = _BUILDERS.get(n.op)
    if builder is None:
        raise TilingError(f"spyre: no schedule for op {n.op!r}")  # pragma: no cover
    built = builder(ctx, n)
    ctx.stages.extend(built if isinstance(built, list) else [built])


def schedule(g: Graph, card: CardSpec) -> Kernel:
    """Lower a fused graph (after ``to_maps``/``fuse_maps``) to a :class:`Kernel`."""
    ctx = _Ctx(card)
    for i, v in enumerate(g.inputs):
        ctx.declare(v, "input", f"arg{i}")
    for i, (v, _) in enumerate(g.consts):
        ctx.declare(v, "const", f"const{i}")
    with Progress(f"{g.name}: ops scheduled", len(g.nodes), log) as bar:
        for n in g.nodes:
            bar.update()
            _schedule_node(ctx, n, card)
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
