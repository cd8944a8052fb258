"""Tiling of concatenations: whole blocks that hold the whole axis of every input first; then
the output tiled along the axis too, each input read through windows that place it at its
offset."""

from __future__ import annotations

import math

import numpy as np

from device_model.kernel import Operand, Stage
from device_model.steps import ConcatStep

from . import tiling
from .graph import Node

__all__ = ["plan_concat"]


def plan_concat(ctx: tiling.TilingContext, n: Node) -> list[Stage]:
    """A concatenation's stage, from the first tier that fits (whole blocks holding the whole
    axis of every input, else tiled along the axis too: :func:`_concat_general`)."""
    return tiling.plan_node(ctx, n, "concatenate", _concat_stage_whole, _concat_general)


def _concat_stage_whole(ctx: tiling.TilingContext, n: Node) -> Stage:
    ax = n.params.axis
    lays = [ctx.layout(v) for v in n.inputs]
    lo = ctx.layout(n.out)
    r = len(n.out.shape)
    # tile the leading dim when it is not the axis (and not the stick dim)
    tile0 = ax != 0 and r >= 2
    e0 = n.out.shape[0] if tile0 else 1
    cands = tiling.divisors(e0) if tile0 else [1]

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

    (b0,) = tiling.choose_blocks([e0], [cands], plan, ctx.cap, ctx.ncores, "concatenate", n.source)
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
    return tiling.lsu_stage(ctx, name, grid, ops, out, [*lays, lo], scratch, body, n.source)


def _concat_general(ctx: tiling.TilingContext, n: Node, tier: tiling.Tier) -> Stage:
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
    cands = {d: tiling.ragged_blocks(S[d], quant[d]) for d in range(r)}
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
                    blk.append(tiling.align(loc + b, q))
                    org.append(o)
                    stp.append(b)
                else:
                    bb = lay.device_shape[d] if bl.get(d) is None else bl[d]
                    blk.append(bb)
                    org.append(0)
                    stp.append(bb)
            ins.append((tuple(blk), tuple(org), tuple(stp), loc))
        return ob, ins

    def choose(single: bool) -> dict[int, int | None]:
        def plan(bl: dict[int, int | None], multi: bool) -> int:
            ob, ins = layout_of(bl)
            items = [(w[0], lay.dtype) for w, lay in zip(ins, lays, strict=True)]
            return ctx.plan_bytes(items + [(ob, lo.dtype)], tiling.slots_for(single, multi))

        return tiling.choose_general_blocks(
            dict(enumerate(S)), cands, par, [], plan, ctx.cap, ctx.ncores
        )

    bl, single = tiling.double_or_single(tier, choose)
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
    slots = tiling.slots_for(single, -(-math.prod(grid) // ctx.ncores) > 1)
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
    return tiling.lsu_stage(ctx, name, grid, ops, out, [*lays, lo], scratch, body, n.source)
