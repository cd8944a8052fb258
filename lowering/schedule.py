"""From a fused graph to the schedule IR: layouts, tiling over the cores and into scratchpad.

For each node the tiler picks block sizes (whole sticks along every stick dimension, exact
divisors elsewhere), so that the tiles spread over the cores and the stage's scratchpad plan fits
the usable scratchpad; the plan is double-buffered when the stage has more than one step. Then the
work is divided (tile p runs on core p % n at step p // n, n the card's ``num_cores``) and the
load, ring and store tables are built: a block several cores need in one step is loaded by the
first of them and forwarded over the ring to the rest. A plan that does not fit is never
emitted: the tiler splits further (a reduction whose output rows cannot be tiled finely enough
writes one element per stick to a temp, then packs it).

Each op kind has its tiler (:mod:`lowering.tile_map`, ``tile_matmul``, ``tile_gather``,
``tile_reshape``, ``tile_concat``, ``tile_sort``, entered in :data:`PLANNERS`; their shared
interface is :mod:`lowering.tiling`), and each tries the same tiers in order: whole blocks, then the
general tiling (ragged blocks), then single buffering. In the general tiling every dim of every op
may be cut, the stick dim and the reduced axis included, in blocks that need not divide it (the last
block is ragged); a slice, a strided slice or a shifted input of a concatenation is read in windows
of the input; a reduction too long for the scratchpad (sum/max/min/prod/argmax/argmin/ cumsum along
any axis) is split across steps with a carried accumulator in the compute type (fp32 for floats); a
matmul's K is split with fp32 partial sums whatever its length; a transpose whose blocks would need
a stick of both layouts goes through a one-element-per-stick temp; re-layouts split their rows;
gathers tile the index rows (the table stays in device memory, whatever its size); and as a last
resort the buffers are single-buffered. :class:`TilingError` is left only for what cannot fit even
the smallest such blocks: one stick per buffer, or, for a re-layout between layouts whose sticks
cross (a transpose, a matmul's K, packing one element per stick), one stick's worth of sticks (64
fp16 sticks, 8 KiB). Tensors without elements need no stage; a reduction over an empty axis is a
fill with the reduction's identity (argmax/argmin over an empty axis raise).

Every figure of the card (cores, stick size, usable scratchpad, bandwidths) comes from the
:class:`~device_model.card.CardSpec` passed in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from device_model.card import CardSpec
from device_model.kernel import Kernel, Stage, TensorDecl
from device_model.layout import np_dtype
from device_model.ops import (
    REDUCTIONS,
    InputView,
    MapBody,
    compute_dtype,
)
from device_model.progress import Progress

from .errors import TilingError
from .graph import Graph, Node, Var
from .op_params import Map
from .passes import is_free_reshape
from .tile_concat import plan_concat
from .tile_conv import plan_conv
from .tile_gather import plan_gather
from .tile_map import map_fits, plan_body, plan_map
from .tile_matmul import plan_matmul
from .tile_reshape import plan_reshape
from .tile_sort import plan_sort, plan_take_along
from .tiling import TilingContext

__all__ = ["schedule", "map_fits", "PLANNERS"]


log = logging.getLogger("lowering")


def _is_empty(v: Var) -> bool:
    return bool(v.shape) and math.prod(v.shape) == 0


def _fill_stages(ctx: TilingContext, v: Var, value: Any, source: str) -> list[Stage]:
    """A stage that writes ``value`` into every element of ``v`` (no inputs)."""
    body = MapBody(v.shape, (), (("const", (), value, v.dtype),), "", (), v.dtype)
    return plan_body(ctx, body, [], [], ctx.name(v), ctx.layout(v), source)


def _empty_input_stages(ctx: TilingContext, n: Node) -> list[Stage] | None:
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
        # a product of zeros (the unfuse pass took a fused prologue or epilogue out of it)
        if n.params.prologue is not None or n.params.epilogue is not None:
            raise TilingError(f"spyre: a fused matmul over an empty K (run the unfuse pass): {n}")
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
            return plan_map(ctx, m)
        return plan_concat(ctx, Node(n.op, keep, n.outputs, n.params, n.source))
    return None


#: each op kind's tiler: the node's stages (its output declared), in order
PLANNERS: dict[str, Callable[[TilingContext, Node], list[Stage]]] = {
    "map": plan_map,
    "matmul": plan_matmul,
    "gather": plan_gather,
    "reshape": plan_reshape,
    "concatenate": plan_concat,
    "sort": plan_sort,
    "take_along": plan_take_along,
    "conv": plan_conv,
}


def _schedule_node(ctx: TilingContext, n: Node, card: CardSpec) -> None:
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
    planner = PLANNERS.get(n.op)
    if planner is None:
        raise TilingError(f"spyre: no schedule for op {n.op!r}")  # pragma: no cover
    ctx.stages.extend(planner(ctx, n))


def schedule(g: Graph, card: CardSpec) -> Kernel:
    """Lower a fused graph (after ``to_maps``/``fuse_maps``) to a :class:`Kernel`."""
    ctx = TilingContext(card)
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
