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

from device_model.kernel import Operand, Stage, TensorDecl
from device_model.layout import TensorLayout, layout_for
from device_model.ops import (
    InputView,
    MapBody,
    compute_dtype,
)
from device_model.steps import MapStep, SplitReduce

from .errors import TilingError
from .tiling import (
    _choose_general,
    _Ctx,
    _describe,
    _map_work,
    _NoFit,
    _ragged_cands,
    _tables,
    _window,
)


def _map_general(
    ctx: _Ctx,
    body: MapBody,
    in_names: list[str],
    in_lays: list[TensorLayout],
    out_name: str,
    out_lay: TensorLayout,
    source: str,
    first_err: TilingError,
    offset: int = 0,
) -> list[Stage]:
    """The stages of a map with no tiling in whole blocks, in order of preference:

    1. ragged blocks and windows, reduced axes whole in a block;
    2. the same through a one-element-per-stick temp, then a pack (:func:`_map_via_temp`);
    3. and 4. the same two with the reduction split across steps along one reduced axis (the
       longest first; a carried accumulator; not an axis an in-program reduction reduces);
    5. a reduction over several axes as one reduction per axis, through compute-type temps;
    and all of it again single-buffered (one slot per buffer, no overlap) for maps without
    in-program reductions. TilingError only when none fits. The stages are numbered from
    ``offset`` past the ones already scheduled.
    """
    needs: list[int] = []
    prog = body.program_reduce_axes()
    red = body.reduction
    cum = red is not None and red.scan
    reducing = red is not None and not red.scan
    splits: list[int | None] = [None]
    if reducing or cum:
        axes = [a for a in body.reduce_axes if a not in prog and body.space[a] > 1]
        splits += sorted(axes, key=lambda a: -body.space[a])
    for single in (False, True):
        if single and prog:
            break
        for split in splits:
            try:
                st = _map_plan_general(
                    ctx,
                    body,
                    in_names,
                    in_lays,
                    out_name,
                    out_lay,
                    len(ctx.stages) + offset,
                    source,
                    split,
                    single,
                )
                return [st]
            except _NoFit as e:
                needs.append(e.need)
            if not out_lay.shape:
                continue
            try:
                return _map_via_temp(
                    ctx, body, in_names, in_lays, out_name, out_lay, source, split, single, offset
                )
            except _NoFit as e:
                needs.append(e.need)
    if reducing and not red.one_axis and len(body.reduce_axes) > 1:
        if not prog:
            return _map_decompose(ctx, body, in_names, in_lays, out_name, out_lay, source, offset)
    raise TilingError(
        f"spyre: map ({_describe(body)}) cannot be tiled into the usable scratchpad "
        f"({ctx.cap} B per core): even the smallest tiling needs {min(needs, default=0)} B"
        + (f"\n  at: {source}" if source else "")
    ) from first_err


def _map_via_temp(
    ctx: _Ctx,
    body: MapBody,
    in_names: list[str],
    in_lays: list[TensorLayout],
    out_name: str,
    out_lay: TensorLayout,
    source: str,
    split: int | None,
    single: bool,
    offset: int = 0,
) -> list[Stage]:
    """The map written one element per stick (a trailing size-1 dim), then packed: the rows
    of a reduction then tile one by one, and a transpose needs blocks of one layout's stick
    dim only in each stage (a stick of both layouts at once can need more than fits)."""
    shape, dt = out_lay.shape, out_lay.dtype
    tmp = f"{out_name}_g{len(ctx.decls)}"
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
    i0 = len(ctx.stages) + offset
    s1 = _map_plan_general(ctx, sparse, in_names, in_lays, tmp, tmp_lay, i0, source, split, single)
    s2 = _map_plan_general(
        ctx, pack, [tmp], [tmp_lay], out_name, out_lay, i0 + 1, source, None, single
    )
    ctx.decls[tmp] = TensorDecl(tmp, tmp_lay, "temp")
    return [s1, s2]


def _map_decompose(
    ctx: _Ctx,
    body: MapBody,
    in_names: list[str],
    in_lays: list[TensorLayout],
    out_name: str,
    out_lay: TensorLayout,
    source: str,
    offset: int = 0,
) -> list[Stage]:
    """A reduction over several axes as a reduction over its last axis into a temp of the
    compute type (fp32 for floats), then the rest over the temp."""
    last = max(body.reduce_axes)
    acc_dt = compute_dtype(body.program[-1][3])
    tshape = tuple(e for g, e in enumerate(body.space) if g != last)
    tmp = f"{out_name}_r{len(ctx.decls)}"
    tmp_lay = layout_for(tshape, acc_dt, ctx.card.stick_bytes)
    ctx.decls[tmp] = TensorDecl(tmp, tmp_lay, "temp")
    first = MapBody(body.space, body.views, body.program, body.reduce, (last,), acc_dt)
    err = TilingError(f"spyre: map ({_describe(body)}) does not fit in whole blocks")
    stages = _map_general(ctx, first, in_names, in_lays, tmp, tmp_lay, source, err, offset)
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
    more = _map_general(
        ctx, second, [tmp], [tmp_lay], out_name, out_lay, source, err, offset + len(stages)
    )
    return stages + more


def _map_plan_general(
    ctx: _Ctx,
    body: MapBody,
    in_names: list[str],
    in_lays: list[TensorLayout],
    out_name: str,
    out_lay: TensorLayout,
    index: int,
    source: str,
    split: int | None,
    single: bool,
) -> Stage:
    """One map stage in ragged blocks and windows (see the section comment); ``split``: the
    reduced space axis cut across steps (None: reduced axes whole); ``single``: one slot per
    buffer. Raises :class:`_NoFit` when no block sizes fit."""
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
        raise _NoFit(1 << 62)
    cands = {g: _ragged_cands(space[g], quant[g]) if tileable[g] else [] for g in range(r)}
    if split is not None and not cands[split]:
        raise _NoFit(1 << 62)
    par = [g for g in range(r) if tileable[g] and g != split and cands[g]]
    seq = [split] if split is not None else []
    acc_dt = compute_dtype(body.program[-1][3]) if body.program else out_lay.dtype

    def layout_of(bl: dict[int, int | None]) -> tuple:
        sb = tuple(space[g] if bl.get(g) is None else bl[g] for g in range(r))
        ins = [_window(lay, view, space, bl) for lay, view in zip(in_lays, body.views, strict=True)]
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

    bl = _choose_general(dict(enumerate(space)), cands, par, seq, plan, ctx.cap, ctx.ncores)
    sb, ins, ob, ogd, accs = layout_of(bl)
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
    tabs = _tables(
        grid,
        [*inputs, output],
        [*in_lays, out_lay],
        ctx.ncores,
        reduce_axis=split if split is not None else -1,
        store_every=cum,
        reverse=red is not None and red.reverse,
    )
    sfu, flops = _map_work(body, ctx.card)
    return Stage(
        name=f"s{index}",
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
