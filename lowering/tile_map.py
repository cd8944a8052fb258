"""General tiling of map nodes (elementwise chains, views, reductions), used when a map has no
tiling in whole blocks (:mod:`lowering.schedule`'s first choice: divisor blocks, whole reduced
rows).

Every dim may be cut in blocks of whole sticks (or single elements off the stick dim) that need
not divide it: the last block is ragged (the part past the tensor loads as uninitialized
scratchpad and is never stored). An input read through a slice is loaded in
windows of it (Operand.origin/step); a reduction too long for the scratchpad is split across
steps with a carried accumulator (in the compute type: fp32 for floats); a map that needs a
stick of two layouts at once (a transpose) goes through a one-element-per-stick temp; a
reduction over several axes that still does not fit runs one axis at a time. TilingError only
when even the smallest blocks do not fit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from device_model.card import CardSpec
from device_model.kernel import Operand, Stage, TensorDecl
from device_model.layout import TensorLayout, layout_for
from device_model.ops import (
    InputView,
    MapBody,
    compute_dtype,
)
from device_model.steps import MapStep, SplitReduce

from . import tiling
from .errors import TilingError
from .graph import Node

__all__ = ["plan_map", "plan_body", "map_fits"]


class MapIO(NamedTuple):
    """What a map body reads and writes: its inputs' names and layouts, its output's, and the
    user's line (for errors)."""

    in_names: list[str]
    in_lays: list[TensorLayout]
    out_name: str
    out_lay: TensorLayout
    source: str


def _io_of(ctx: tiling.TilingContext, n: Node) -> MapIO:
    ins = [ctx.name(v) for v in n.inputs], [ctx.layout(v) for v in n.inputs]
    return MapIO(*ins, ctx.name(n.out), ctx.layout(n.out), n.source)


def map_fits(n: Node, card: CardSpec) -> bool:
    """Whether the map node ``n`` has a tiling in whole blocks on ``card`` (a dry run of its
    choice of blocks: no tables are built). The fusion pass asks this of every map it merges: a
    fusion is made only where the fused map fits with whole rows."""
    return tiling.fits(card, n, lambda ctx, n: _map_stage_whole(ctx, n, dry=True))


def plan_map(ctx: tiling.TilingContext, n: Node) -> list[Stage]:
    """A map node's stages, from the first tier that fits: whole blocks
    (:func:`_map_stage_whole`), then the general tiling (:func:`_map_general`: ragged edge
    blocks, windows of slices, a reduction split across steps)."""
    return _plan(ctx, n.params.body, _io_of(ctx, n), n)


def plan_body(
    ctx: tiling.TilingContext,
    body: MapBody,
    in_names: list[str],
    in_lays: list[TensorLayout],
    out_name: str,
    out_lay: TensorLayout,
    source: str,
) -> list[Stage]:
    """The stages of one map body over tensors already declared, from the first tier that
    fits."""
    return _plan(ctx, body, MapIO(in_names, in_lays, out_name, out_lay, source), None)


def _plan(
    ctx: tiling.TilingContext,
    body: MapBody,
    io: MapIO,
    node: Node | None,
) -> list[Stage]:
    source = io.source

    def whole() -> list[Stage]:
        if node is not None:
            return _map_stage_whole(ctx, node)
        name = f"s{len(ctx.stages)}"
        return [_map_plan(ctx, body, io, name)]

    return tiling.first_fit(
        ctx,
        f"map ({tiling.describe(body)})",
        source,
        whole,
        lambda tier: _map_general(ctx, body, io, tier),
    )


def _map_stage_whole(ctx: tiling.TilingContext, n: Node, dry: bool = False) -> list[Stage]:
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
    io = _io_of(ctx, n)
    out_name, out_lay = io.out_name, io.out_lay
    name = f"s{len(ctx.stages)}"
    try:
        st = _map_plan(ctx, body, io, name, dry)
        return [st] if st is not None else []
    except TilingError as err:
        if not body.reduction or body.reduction.scan or not out_lay.shape:
            raise
        first_err = err
    tmp = f"{out_name}_s"
    tmp_lay, sparse, pack = _one_per_stick(ctx, body, out_lay)
    try:
        s1 = _map_plan(ctx, sparse, io._replace(out_name=tmp, out_lay=tmp_lay), name, dry)
        pack_io = MapIO([tmp], [tmp_lay], out_name, out_lay, n.source)
        s2 = _map_plan(ctx, pack, pack_io, f"s{len(ctx.stages) + 1}", dry)
    except TilingError:
        raise first_err from None
    if s1 is None or s2 is None:
        return []
    ctx.decls[tmp] = TensorDecl(tmp, tmp_lay, "temp")
    return [s1, s2]


def _one_per_stick(
    ctx: tiling.TilingContext, body: MapBody, out_lay: TensorLayout
) -> tuple[TensorLayout, MapBody, MapBody]:
    """``body`` written one element per stick instead: the temp's layout (the output's shape
    with a trailing size-1 dim), the map that writes it and the copy that packs it into the
    output's layout."""
    shape, dt = out_lay.shape, out_lay.dtype
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
    return tmp_lay, sparse, pack


def _map_plan(
    ctx: tiling.TilingContext,
    body: MapBody,
    io: MapIO,
    name: str,
    dry: bool = False,
) -> Stage | None:
    """Tile one map body over the cores; raises :class:`TilingError` when no tiling fits.

    Reduced axes (the final reduction's and the in-program ones) stay whole in every block.
    With ``dry``, returns None once a tiling is chosen.
    """
    in_names, in_lays, out_name, out_lay, source = io
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
            cands.append(
                tiling.stick_blocks(e, quant[g])
                + ([e] if e not in tiling.stick_blocks(e, quant[g]) else [])
            )
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

    bl = tiling.choose_blocks(
        extents, cands, plan, ctx.cap, ctx.ncores, f"map ({tiling.describe(body)})", source
    )
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
    tabs = tiling.step_tables(grid, [*inputs, output], [*in_lays, out_lay], ctx.ncores)
    sfu, flops = tiling.map_work(body, ctx.card)
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


def _map_general(
    ctx: tiling.TilingContext,
    body: MapBody,
    io: MapIO,
    tier: tiling.Tier,
    offset: int = 0,
) -> list[Stage]:
    """The stages of a map with no tiling in whole blocks, in order of preference:

    1. ragged blocks and windows, reduced axes whole in a block;
    2. the same through a one-element-per-stick temp, then a pack (:func:`_map_via_temp`);
    3. and 4. the same two with the reduction split across steps along one reduced axis (the
       longest first; a carried accumulator; not an axis an in-program reduction reduces);
    in the ``tier``'s buffering: double in :attr:`Tier.RAGGED`, single in :attr:`Tier.SINGLE`
    (not for maps with in-program reductions), where, last, 5. a reduction over several axes
    runs as one reduction per axis, through compute-type temps. NoFit when none fits. The
    stages are numbered from ``offset`` past the ones already scheduled.
    """
    out_lay = io.out_lay
    needs: list[int] = []
    prog = body.program_reduce_axes()
    red = body.reduction
    cum = red is not None and red.scan
    reducing = red is not None and not red.scan
    splits: list[int | None] = [None]
    if reducing or cum:
        axes = [a for a in body.reduce_axes if a not in prog and body.space[a] > 1]
        splits += sorted(axes, key=lambda a: -body.space[a])
    single = tier is tiling.Tier.SINGLE
    if single and prog:
        raise TilingError("a map with an in-program reduction is not single-buffered")
    for split in splits:
        try:
            st = _map_plan_general(ctx, body, io, len(ctx.stages) + offset, split, single)
            return [st]
        except tiling.NoFit as e:
            needs.append(e.need)
        if not out_lay.shape:
            continue
        try:
            return _map_via_temp(ctx, body, io, split, single, offset)
        except tiling.NoFit as e:
            needs.append(e.need)
    if single and reducing and not red.one_axis and len(body.reduce_axes) > 1:
        return _map_decompose(ctx, body, io, offset)
    raise tiling.NoFit(min(needs, default=1 << 62))


def _map_via_temp(
    ctx: tiling.TilingContext,
    body: MapBody,
    io: MapIO,
    split: int | None,
    single: bool,
    offset: int = 0,
) -> list[Stage]:
    """The map written one element per stick (a trailing size-1 dim), then packed: the rows
    of a reduction then tile one by one, and a transpose needs blocks of one layout's stick
    dim only in each stage (a stick of both layouts at once can need more than fits)."""
    out_name, out_lay, source = io.out_name, io.out_lay, io.source
    tmp = f"{out_name}_g{len(ctx.decls)}"
    tmp_lay, sparse, pack = _one_per_stick(ctx, body, out_lay)
    i0 = len(ctx.stages) + offset
    s1 = _map_plan_general(
        ctx, sparse, io._replace(out_name=tmp, out_lay=tmp_lay), i0, split, single
    )
    pack_io = MapIO([tmp], [tmp_lay], out_name, out_lay, source)
    s2 = _map_plan_general(ctx, pack, pack_io, i0 + 1, None, single)
    ctx.decls[tmp] = TensorDecl(tmp, tmp_lay, "temp")
    return [s1, s2]


def _map_decompose(
    ctx: tiling.TilingContext,
    body: MapBody,
    io: MapIO,
    offset: int = 0,
) -> list[Stage]:
    """A reduction over several axes as a reduction over its last axis into a temp of the
    compute type (fp32 for floats), then the rest over the temp."""
    out_name, out_lay, source = io.out_name, io.out_lay, io.source
    last = max(body.reduce_axes)
    acc_dt = compute_dtype(body.program[-1][3])
    tshape = tuple(e for g, e in enumerate(body.space) if g != last)
    tmp = f"{out_name}_r{len(ctx.decls)}"
    tmp_lay = layout_for(tshape, acc_dt, ctx.card.stick_bytes)
    ctx.decls[tmp] = TensorDecl(tmp, tmp_lay, "temp")
    first = MapBody(body.space, body.views, body.program, body.reduce, (last,), acc_dt)
    stages = _general_tiers(ctx, first, io._replace(out_name=tmp, out_lay=tmp_lay), offset)
    rest = tuple(a if a < last else a - 1 for a in body.reduce_axes if a != last)
    r = len(tshape)
    second = MapBody(
        tshape,
        (InputView.identity(r),),
        (("copy", (0,), None, acc_dt),),
        body.reduce,
        rest,
        body.out_dtype,
    )
    second_io = MapIO([tmp], [tmp_lay], out_name, out_lay, source)
    more = _general_tiers(ctx, second, second_io, offset + len(stages))
    return stages + more


def _general_tiers(
    ctx: tiling.TilingContext,
    body: MapBody,
    io: MapIO,
    offset: int,
) -> list[Stage]:
    """:func:`_map_general` double-buffered, else single-buffered (the part of a decomposed
    reduction). NoFit when neither fits."""
    try:
        return _map_general(ctx, body, io, tiling.Tier.RAGGED, offset)
    except tiling.NoFit:
        return _map_general(ctx, body, io, tiling.Tier.SINGLE, offset)


def _map_plan_general(
    ctx: tiling.TilingContext,
    body: MapBody,
    io: MapIO,
    index: int,
    split: int | None,
    single: bool,
) -> Stage:
    """One map stage in ragged blocks and windows (see the section comment); ``split``: the
    reduced space axis cut across steps (None: reduced axes whole); ``single``: one slot per
    buffer. Raises :class:`NoFit` when no block sizes fit."""
    in_lays, out_lay = io.in_lays, io.out_lay
    space = body.space
    r = len(space)
    out_dims = body.out_space_dims()
    red = body.reduction
    cum = red is not None and red.scan
    reduced = set(body.reduce_axes) if body.reduce else set()
    prog = body.program_reduce_axes()
    tileable = {
        g: space[g] > 1 and g not in prog and (g not in reduced or g == split) for g in range(r)
    }
    quant = dict.fromkeys(range(r), 1)
    for lay, view in zip(in_lays, body.views, strict=True):
        seen: set[int] = set()
        for j, g in enumerate(view.dims):
            if g < 0 or view.bcast[j]:
                continue
            if g in seen:
                tileable[g] = False  # two dims of one input read along one space dim
            seen.add(g)
            if j == len(lay.shape) - 1:
                q = lay.elems_per_stick
                quant[g] = math.lcm(quant[g], q // math.gcd(q, view.strides[j]))
    if out_lay.shape and out_dims:
        quant[out_dims[-1]] = math.lcm(quant[out_dims[-1]], out_lay.elems_per_stick)
    if split is not None and not tileable[split]:
        raise tiling.NoFit(1 << 62)
    cands = {g: tiling.ragged_blocks(space[g], quant[g]) if tileable[g] else [] for g in range(r)}
    if split is not None and not cands[split]:
        raise tiling.NoFit(1 << 62)
    par = [g for g in range(r) if tileable[g] and g != split and cands[g]]
    seq = [split] if split is not None else []
    acc_dt = compute_dtype(body.program[-1][3]) if body.program else out_lay.dtype

    def layout_of(bl: dict[int, int | None]) -> tuple:
        sb = tuple(space[g] if bl.get(g) is None else bl[g] for g in range(r))
        ins = [
            tiling.window(lay, view, space, bl)
            for lay, view in zip(in_lays, body.views, strict=True)
        ]
        if out_lay.shape:
            ob = tuple(
                out_lay.device_shape[i] if bl.get(g) is None else bl[g]
                for i, g in enumerate(out_dims)
            )
            ogd = tuple(-1 if bl.get(g) is None else g for g in out_dims)
        else:
            ob, ogd = out_lay.device_shape, (-1,)
        accs: list[tuple[str, tuple[int, ...], str]] = []
        if split is not None:
            if cum:
                ab = tuple(1 if g == split else sb[g] for g in range(r))
                accs.append(("acc", ab, acc_dt))
            else:
                ab = tuple(sb[g] for g in out_dims)
                accs.append(("acc", ab, acc_dt))
                if red is not None and red.index_of:
                    accs.append(("acci", ab, "int32"))
        return sb, ins, ob, ogd, accs

    def plan(bl: dict[int, int | None], multi: bool) -> int:
        _, ins, ob, _, accs = layout_of(bl)
        slots = 1 if single else (2 if multi else 1)
        items = [(w[0], lay.dtype) for w, lay in zip(ins, in_lays, strict=True)]
        return ctx.plan_bytes(items + [(ob, out_lay.dtype)], slots) + ctx.plan_bytes(
            [(b, d) for _, b, d in accs], 1
        )

    bl = tiling.choose_general_blocks(
        dict(enumerate(space)), cands, par, seq, plan, ctx.cap, ctx.ncores
    )
    return _general_stage(ctx, body, io, f"s{index}", split, single, bl, layout_of(bl))


def _general_stage(
    ctx: tiling.TilingContext,
    body: MapBody,
    io: MapIO,
    name: str,
    split: int | None,
    single: bool,
    bl: dict[int, int | None],
    parts: tuple,
) -> Stage:
    """The stage of :func:`_map_plan_general`'s blocks ``bl`` (``parts``: the space block, the
    inputs' windows, the output block and grid dims, the accumulators)."""
    in_names, in_lays, out_name, out_lay, source = io
    space, r, red = body.space, len(body.space), body.reduction
    cum = red is not None and red.scan
    sb, ins, ob, ogd, accs = parts
    grid = tuple(1 if bl.get(g) is None else -(-space[g] // bl[g]) for g in range(r))
    par_tiles = math.prod(grid[g] for g in range(r) if g != split)
    steps = -(-par_tiles // ctx.ncores) * (grid[split] if split is not None else 1)
    slots = 1 if single else (2 if steps > 1 else 1)
    inputs = []
    views = []
    for i, (nm, (blk, gd, org, stp, local)) in enumerate(zip(in_names, ins, strict=True)):
        windowed = any(org) or tuple(stp) != tuple(blk)
        inputs.append(
            Operand(
                nm,
                tuple(blk),
                tuple(gd),
                f"in{i}",
                org if windowed else (),
                stp if windowed else (),
            )
        )
        views.append(local)
    output = Operand(out_name, tuple(ob), tuple(ogd), "out")
    scratch = ctx.sp_plan(
        [
            (f"in{i}", op.block, lay.dtype, slots)
            for i, (op, lay) in enumerate(zip(inputs, in_lays, strict=True))
        ]
        + [("out", output.block, out_lay.dtype, slots)]
        + [(nm, b, d, 1) for nm, b, d in accs]
    )
    local_body = MapBody(
        space, tuple(views), body.program, body.reduce, body.reduce_axes, body.out_dtype
    )
    sp = None
    if split is not None:
        rev = red is not None and red.reverse
        sp = SplitReduce(
            axis=split, block=bl[split], extent=space[split], nk=grid[split], reverse=rev
        )
    tabs = tiling.step_tables(
        grid,
        [*inputs, output],
        [*in_lays, out_lay],
        ctx.ncores,
        reduce_axis=split if split is not None else -1,
        store_every=cum,
        reverse=red is not None and red.reverse,
    )
    sfu, flops = tiling.map_work(body, ctx.card)
    return Stage(
        name=name,
        grid=grid,
        reduce_axis=split if split is not None else -1,
        inputs=tuple(inputs),
        output=output,
        scratch=scratch,
        step=MapStep(body=local_body, space_block=tuple(sb), split=sp),
        **tabs,
        flops=flops,
        sfu_elem_ops=sfu,
        source=source,
    )
