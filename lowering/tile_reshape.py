"""Tiling of re-layouts (a reshape that is not a free view of its input's bytes): rows of the
input regrouped into rows of the output, in whole blocks first, then in ragged row blocks, rows
split into chunks (or groups of rows joined) when one does not fit."""

from __future__ import annotations

import math
from typing import NamedTuple

from device_model.kernel import Operand, Stage, TensorDecl
from device_model.layout import layout_for
from device_model.steps import ReshapeStep

from . import tiling
from .graph import Node

__all__ = ["plan_reshape"]


def plan_reshape(ctx: tiling.TilingContext, n: Node) -> list[Stage]:
    """A re-layout's stages, from the first tier that fits (:func:`_reshape_general` past
    whole blocks)."""
    what = f"reshape {n.inputs[0].shape} -> {n.out.shape}"
    return tiling.plan_node(ctx, n, what, _reshape_stage_whole, _reshape_general)


def _reshape_stage_whole(ctx: tiling.TilingContext, n: Node) -> Stage:
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
    cands = [d for d in tiling.divisors(r_out) if d % q == 0] or [r_out]

    def plan(bl: list[int], multi: bool) -> int:
        ro = bl[0]
        ri = ro * l_out // l_in
        return ctx.plan_bytes(
            [((ri, li.device_shape[1]), x.dtype), ((ro, lo.device_shape[1]), x.dtype)],
            2 if multi else 1,
        )

    (ro,) = tiling.choose_blocks([r_out], [cands], plan, ctx.cap, ctx.ncores, "reshape", n.source)
    ri = ro * l_out // l_in
    grid = (r_out // ro,)
    iop = Operand(vin, (ri, li.device_shape[1]), (0, -1), "in")
    out = Operand(vout, (ro, lo.device_shape[1]), (0, -1), "out")
    slots = 2 if grid[0] > ctx.ncores else 1
    body = ReshapeStep(l_in=l_in, l_out=l_out)
    name = f"s{len(ctx.stages)}"
    return tiling.one_input_stage(
        ctx, name, grid, (iop, out), (li, lo), (x.dtype, x.dtype), slots, body, n.source
    )


def _reshape_general(ctx: tiling.TilingContext, n: Node, tier: tiling.Tier) -> list[Stage]:
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
        rows = Rows(base_in, base_out, dt, l_in, l_out, r_in, r_out)
        if l_in % l_out == 0 or l_out % l_in == 0:
            return [_reshape_chunks(ctx, n, tier, rows)]
        return [_reshape_groups(ctx, n, tier, rows)]
    except tiling.NoFit as e:
        need = e.need
        ctx.rollback(mark)
    # through rows of a common divisor of both row lengths, the largest that fits: the gcd
    # first, then smaller ones (rows of 1 element at worst: each its own stick, a temp that
    # large only for rows longer than the scratchpad whose length has no other divisor)
    g = math.gcd(l_in, l_out)
    mids = [d for d in sorted(tiling.divisors(g), reverse=True) if d not in (l_in, l_out)]
    total = r_in * l_in
    for d in mids[:4] + ([1] if mids[4:] else []):
        mid = f"{base_out}_m{len(ctx.decls)}"
        ctx.decls[mid] = TensorDecl(mid, layout_for((total // d, d), dt, stick), "temp")
        try:
            s1 = _reshape_chunks(ctx, n, tier, Rows(base_in, mid, dt, l_in, d, r_in, total // d))
            second = Rows(mid, base_out, dt, d, l_out, total // d, r_out)
            s2 = _reshape_chunks(ctx, n, tier, second, 1)
            return [s1, s2]
        except tiling.NoFit as e:
            need = min(need, e.need)
            ctx.rollback(mark)
        ctx.decls.pop(mid, None)
    raise tiling.NoFit(need)


class Rows(NamedTuple):
    """A re-layout of rows: ``r_in`` rows of ``l_in`` elements of the tensor ``base_in`` into
    ``r_out`` rows of ``l_out`` of ``base_out``, in ``dt``."""

    base_in: str
    base_out: str
    dt: str
    l_in: int
    l_out: int
    r_in: int
    r_out: int


def _reshape_chunks(
    ctx: tiling.TilingContext, n: Node, tier: tiling.Tier, rows_of: Rows, offset: int = 0
) -> Stage:
    """A re-layout where one row length divides the other (see :func:`_reshape_general`); the
    stage is numbered ``offset`` past the ones already scheduled."""
    base_in, base_out, dt, l_in, l_out, r_in, r_out = rows_of
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
    cands = {
        0: tiling.ragged_blocks(rows, 1),
        1: tiling.ragged_blocks(R, eps // math.gcd(eps, unit)),
    }

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

    def choose(single: bool) -> dict[int, int | None]:
        def plan(bl: dict[int, int | None], multi: bool) -> int:
            ib, ob, _, _ = blocks(bl)
            return ctx.plan_bytes([(ib, dt), (ob, dt)], tiling.slots_for(single, multi))

        return tiling.choose_general_blocks(
            {0: rows, 1: R}, cands, [0, 1], [], plan, ctx.cap, ctx.ncores
        )

    bl, single = tiling.double_or_single(tier, choose)
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
    slots = tiling.slots_for(single, -(-g0 * g1 // ctx.ncores) > 1)
    name = f"s{len(ctx.stages) + offset}"
    body = ReshapeStep(l_in=le_in, l_out=le_out)
    return tiling.one_input_stage(
        ctx, name, grid, (iop, out), (li, lo), (dt, dt), slots, body, n.source
    )


def _reshape_groups(ctx: tiling.TilingContext, n: Node, tier: tiling.Tier, rows: Rows) -> Stage:
    """A re-layout in ragged blocks of row groups that end together on both sides."""
    base_in, base_out, dt, l_in, l_out, r_in, r_out = rows
    vin = ctx.view(base_in, (r_in, l_in), dt)
    vout = ctx.view(base_out, (r_out, l_out), dt)
    li, lo = ctx.decls[vin].layout, ctx.decls[vout].layout
    q = math.lcm(l_in, l_out) // l_out
    cands = {0: [c for c in tiling.ragged_blocks(r_out, q) if c % q == 0]}

    def choose(single: bool) -> dict[int, int | None]:
        def plan(bl: dict[int, int | None], multi: bool) -> int:
            ro = r_out if bl[0] is None else bl[0]
            ri = r_in if bl[0] is None else ro * l_out // l_in
            return ctx.plan_bytes(
                [((ri, li.device_shape[1]), dt), ((ro, lo.device_shape[1]), dt)],
                tiling.slots_for(single, multi),
            )

        return tiling.choose_general_blocks({0: r_out}, cands, [0], [], plan, ctx.cap, ctx.ncores)

    bl, single = tiling.double_or_single(tier, choose)
    ro = r_out if bl[0] is None else bl[0]
    ri = r_in if bl[0] is None else ro * l_out // l_in
    grid = (-(-r_out // ro),)
    d0 = 0 if bl[0] is not None else -1
    iop = Operand(vin, (ri, li.device_shape[1]), (d0, -1), "in")
    out = Operand(vout, (ro, lo.device_shape[1]), (d0, -1), "out")
    slots = tiling.slots_for(single, -(-grid[0] // ctx.ncores) > 1)
    body = ReshapeStep(l_in=l_in, l_out=l_out)
    name = f"s{len(ctx.stages)}"
    return tiling.one_input_stage(
        ctx, name, grid, (iop, out), (li, lo), (dt, dt), slots, body, n.source
    )
