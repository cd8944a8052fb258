"""Tiling of gather nodes (rows of a table by index): blocks of index rows (whole int32 sticks)
and whole-stick column blocks of the rows; the table stays in device memory whatever its size
(the load unit fetches each row by its index)."""

from __future__ import annotations

import math

from device_model.kernel import Operand, Stage
from device_model.layout import TensorLayout
from device_model.steps import GatherStep

from . import tiling
from .graph import Node

__all__ = ["plan_gather"]


def plan_gather(ctx: tiling.TilingContext, n: Node) -> list[Stage]:
    """A gather's stage, from the first tier that fits (:func:`~lowering.tiling.first_fit`)."""
    what = "gather (a stick of indices and their rows)"
    return tiling.plan_node(ctx, n, what, _gather_stage_whole, _gather_general)


def _gather_stage_whole(ctx: tiling.TilingContext, n: Node) -> Stage:
    table, idx = n.inputs
    li, lo = ctx.layout(idx), ctx.layout(n.out)
    (N,) = idx.shape
    Dp = lo.device_shape[1]
    tr_c = tiling.stick_blocks(N, li.elems_per_stick) if li.device_shape[0] == N else [N]
    td_c = tiling.stick_blocks(Dp, lo.elems_per_stick)

    def plan(bl: list[int], multi: bool) -> int:
        tr, td = bl
        trp = li.device_shape[0] if tr == N else tr
        return ctx.plan_bytes([((trp,), "int32"), ((tr, td), lo.dtype)], 2 if multi else 1)

    tr, td = tiling.choose_blocks(
        [N, Dp], [tr_c, td_c], plan, ctx.cap, ctx.ncores, "gather", n.source
    )
    trp = li.device_shape[0] if tr == N else tr
    grid = (N // tr, Dp // td)
    iop = Operand(ctx.name(idx), (trp,), (0 if tr != N else -1,), "idx")
    out = Operand(ctx.name(n.out), (tr, td), (0, 1), "rows")
    slots = 2 if math.prod(grid) > ctx.ncores else 1
    return _gather_stage(ctx, n, grid, (iop, out), (li, lo), slots)


def _gather_general(ctx: tiling.TilingContext, n: Node, tier: tiling.Tier) -> Stage:
    """A gather in ragged blocks of index rows (whole int32 sticks) and whole-stick column
    blocks dividing the row; the table stays in device memory whatever its size (rows are
    fetched by index)."""
    table, idx = n.inputs
    li, lo = ctx.layout(idx), ctx.layout(n.out)
    (N,) = idx.shape
    Dp = lo.device_shape[1]
    cands = {
        0: tiling.ragged_blocks(N, li.elems_per_stick),
        1: [d for d in sorted(tiling.stick_blocks(Dp, lo.elems_per_stick), reverse=True) if d < Dp],
    }

    def blocks(bl: dict[int, int | None]) -> tuple[int, int, int]:
        tr = N if bl[0] is None else bl[0]
        trp = li.device_shape[0] if bl[0] is None else bl[0]
        td = Dp if bl[1] is None else bl[1]
        return tr, trp, td

    def choose(single: bool) -> dict[int, int | None]:
        def plan(bl: dict[int, int | None], multi: bool) -> int:
            tr, trp, td = blocks(bl)
            slots = tiling.slots_for(single, multi)
            return ctx.plan_bytes([((trp,), "int32"), ((tr, td), lo.dtype)], slots)

        return tiling.choose_general_blocks(
            {0: N, 1: Dp}, cands, [0, 1], [], plan, ctx.cap, ctx.ncores
        )

    bl, single = tiling.double_or_single(tier, choose)
    tr, trp, td = blocks(bl)
    grid = (-(-N // tr), Dp // td)
    iop = Operand(ctx.name(idx), (trp,), (0 if bl[0] is not None else -1,), "idx")
    out = Operand(ctx.name(n.out), (tr, td), (0, 1), "rows")
    multi = -(-math.prod(grid) // ctx.ncores) > 1
    return _gather_stage(ctx, n, grid, (iop, out), (li, lo), tiling.slots_for(single, multi))


def _gather_step(ctx: tiling.TilingContext, n: Node) -> GatherStep:
    """The LSU's program for the gather ``n``: its table's rows by index."""
    table = n.inputs[0]
    return GatherStep(
        table=ctx.name(table),
        num_rows=table.shape[0],
        mode=n.params.mode,
        fill_value=n.params.fill_value,
    )


def _gather_stage(
    ctx: tiling.TilingContext,
    n: Node,
    grid: tuple[int, ...],
    operands: tuple[Operand, Operand],
    lays: tuple[TensorLayout, TensorLayout],
    slots: int,
) -> Stage:
    """The gather ``n`` over ``grid``: the LSU loads each core's block of indices (``operands``:
    the indices, the rows) and fetches the table's rows into the output's block."""
    dtypes = ("int32", lays[1].dtype)
    name = f"s{len(ctx.stages)}"
    step = _gather_step(ctx, n)
    return tiling.one_input_stage(ctx, name, grid, operands, lays, dtypes, slots, step, n.source)
