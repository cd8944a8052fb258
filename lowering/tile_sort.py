"""Tiling of ``sort`` and ``take_along`` nodes: blocks of whole rows, each row held whole in one
core's scratchpad (a bitonic network needs all of it), the rows dealt to the cores.

A sort's scratchpad holds, beside its keys' input buffers and the int32 output, the network's
working set: the index of every element, and a 32-bit copy of each key narrower than that (a
32-bit key is sorted in its input buffer; the network treats the positions past the row's end
as the largest keys without storing them). A row too long for the usable scratchpad is a
TilingError naming the op and the user's line."""

from __future__ import annotations

from device_model.kernel import Operand, Stage
from device_model.layout import DTYPES
from device_model.sorting import sort_sfu_ops
from device_model.steps import SortStep, TakeStep

from . import tiling
from .graph import Node

__all__ = ["plan_sort", "plan_take_along"]

_ROW_TIERS = (tiling.Tier.RAGGED, tiling.Tier.SINGLE)


def _rows_stage(
    ctx: tiling.TilingContext,
    n: Node,
    tier: tiling.Tier,
    step: SortStep | TakeStep,
    work: list[tuple[tuple[int, ...], str]],
    sfu_ops: int,
) -> Stage:
    """A stage over blocks of ``tr`` whole rows of ``n``'s inputs and output (every operand
    ``[R, *]``), with the scratch ``work`` (per row: (shape of a row's buffer, dtype))."""
    R = n.out.shape[0]
    lays = [ctx.layout(v) for v in (*n.inputs, n.out)]
    cols = [lay.device_shape[1] for lay in lays]

    def bufs(tr: int) -> list[tuple[tuple[int, ...], str]]:
        return [((tr, c), lay.dtype) for c, lay in zip(cols, lays, strict=True)]

    def choose(single: bool) -> dict[int, int | None]:
        def plan(bl: dict[int, int | None], multi: bool) -> int:
            tr = R if bl[0] is None else bl[0]
            slots = tiling.slots_for(single, multi)
            wk = [((tr, *shape), dt) for shape, dt in work]
            return ctx.plan_bytes(bufs(tr), slots) + ctx.plan_bytes(wk, 1)

        cands = {0: tiling.ragged_blocks(R, 1)}
        return tiling.choose_general_blocks({0: R}, cands, [0], [], plan, ctx.cap, ctx.ncores)

    bl, single = tiling.double_or_single(tier, choose)
    tr = R if bl[0] is None else bl[0]
    grid = (-(-R // tr),)
    multi = -(-grid[0] // ctx.ncores) > 1
    slots = tiling.slots_for(single, multi)
    names = [f"in{i}" for i in range(len(n.inputs))] + ["out"]
    operands = [
        Operand(ctx.name(v), (tr, c), (0 if bl[0] is not None else -1, -1), nm)
        for v, c, nm in zip((*n.inputs, n.out), cols, names, strict=True)
    ]
    plan = [(nm, (tr, c), lay.dtype, slots) for nm, c, lay in zip(names, cols, lays, strict=True)]
    plan += [(f"work{i}", (tr, *shape), dt, 1) for i, (shape, dt) in enumerate(work)]
    tabs = tiling.step_tables(grid, operands, lays, ctx.ncores)
    return Stage(
        name=f"s{len(ctx.stages)}",
        grid=grid,
        inputs=tuple(operands[:-1]),
        output=operands[-1],
        scratch=ctx.sp_plan(plan),
        step=step,
        **tabs,
        sfu_elem_ops=sfu_ops,
        source=n.source,
    )


def plan_sort(ctx: tiling.TilingContext, n: Node) -> list[Stage]:
    """A sort's stage: blocks of whole rows of its keys, sorted in scratchpad."""
    R, N = n.inputs[0].shape
    p = n.params
    narrow = sum(DTYPES[v.dtype] < 4 for v in n.inputs)  # keys widened into a 32-bit copy
    step = SortStep(n=N, k=p.k, descending=p.descending, order=p.order)
    ops_ = sort_sfu_ops(R, N, p.k, len(n.inputs))

    def general(c: tiling.TilingContext, node: Node, tier: tiling.Tier) -> Stage:
        return _rows_stage(c, node, tier, step, [((N,), "int32")] * (1 + narrow), ops_)

    what = f"sort (rows of {N} held whole in a core's scratchpad)"
    return tiling.plan_node(ctx, n, what, _no_whole, general, _ROW_TIERS)


def plan_take_along(ctx: tiling.TilingContext, n: Node) -> list[Stage]:
    """A take_along's stage: blocks of whole rows of the tensor and of its indices."""
    x, idx = n.inputs
    step = TakeStep(n=x.shape[1], mode=n.params.mode, fill_value=n.params.fill_value)
    ops_ = idx.shape[0] * idx.shape[1]

    def general(c: tiling.TilingContext, node: Node, tier: tiling.Tier) -> Stage:
        return _rows_stage(c, node, tier, step, [], ops_)

    what = f"take_along (rows of {x.shape[1]} held whole in a core's scratchpad)"
    return tiling.plan_node(ctx, n, what, _no_whole, general, _ROW_TIERS)


def _no_whole(ctx: tiling.TilingContext, n: Node) -> Stage:  # pragma: no cover - not a tier here
    raise tiling.NoFit(0)
