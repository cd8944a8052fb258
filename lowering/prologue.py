"""Norm + matmul fusion: the per-element part of a norm rides the loads of the matmul after it.

A norm (RMSNorm, layernorm) is a map that reduces each row in its program (``rsum`` over the
last axis) and then scales every element by functions of those sums. The matmul after it reads
the norm's rows as its lhs, in blocks of K: its K loop cuts the rows the norm needs whole.
:func:`fuse_prologue` splits the norm at its row statistics:

* a **stats** map per statistic computes it (the norm's program up to it, on whole rows) and
  stores one fp32 value per row, ``[B, M]``, instead of the normalized ``[B, M, K]`` tensor
  (RMSNorm has one, ``rsqrt(mean(x²) + eps)``; layernorm two, the mean and the scale);
* every matmul that reads the norm takes the rest as its ``prologue``: on each K step the SFUs
  run it on the lhs tile (the norm's input) with the row statistics and the other inputs'
  blocks (the norm's weight), round it to the norm's dtype as the unfused map's store rounds
  it, and the PE multiplies that. The results are the unfused ones, bit for bit: a statistic
  is stored in fp32 (the precision it is computed in) and the rest runs as it did.

The normalized tensor never goes to device memory and back: its store and every matmul's load
of it become loads of the norm's input (one per stats map, and the matmuls load it instead)
and a store and loads of one value per row and statistic. Whether that saves time depends on
the shapes (each stats map loads the rows; the prologue runs once per N block), so the pass
asks the scheduler and the timing model and fuses only where it does. A norm read by anything
but matmuls' lhs (or through the free reshapes of a torch ``Linear``), or with more than
:data:`MAX_STATISTICS` statistics, stays as it was. When a fused matmul does not fit the
scratchpad, the scheduler runs the prologue as a map and the matmul after it
(:func:`unfuse_prologue`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from device_model.card import CardSpec
from device_model.ops import ROW_REDUCTIONS, InputView, MapBody

from .errors import TilingError
from .graph import Graph, Node, Var, matmul_inputs
from .op_params import Fused, Map, Reshape
from .passes import dce, is_free_reshape, splice

__all__ = ["fuse_prologue", "unfuse_prologue", "split_norm"]

_Program = tuple[tuple[str, tuple[int, ...], Any, str], ...]


def _invariant(body: MapBody) -> tuple[list[bool], list[bool]] | None:
    """Per register of ``body``: whether it is constant along the last space axis (an input
    that broadcasts along it, a constant, a row reduction over it, an op of such), and whether
    it depends on a row reduction. None when a row reduction reduces another axis."""
    last = len(body.space) - 1
    inv = [all(g != last or bc for g, bc in zip(v.dims, v.bcast, strict=True)) for v in body.views]
    red = [False] * len(body.views)
    for op, args, param, _ in body.program:
        if op == "const":
            inv.append(True)
            red.append(False)
        elif op in ROW_REDUCTIONS:
            if tuple(param) != (last,):
                return None
            inv.append(True)
            red.append(True)
        else:
            inv.append(all(inv[a] for a in args))
            red.append(any(red[a] for a in args))
    return inv, red


def _closure(
    program: _Program, n_in: int, root: int, stop: frozenset[int] = frozenset()
) -> set[int]:
    """The registers ``root`` is computed from (itself included), not looking past those in
    ``stop``."""
    need: set[int] = set()
    todo = [root]
    while todo:
        r = todo.pop()
        if r in need:
            continue
        need.add(r)
        if r >= n_in and r not in stop:
            todo.extend(program[r - n_in][1])
    return need


def _subprogram(
    body: MapBody, need: set[int], inputs: list[int], extra: tuple[int, ...] = ()
) -> tuple[tuple[InputView, ...], _Program]:
    """The views and program of ``body`` restricted to the registers in ``need``: its inputs
    ``inputs`` (register numbers, in order), then the registers ``extra`` read as more inputs,
    then the ops in ``need`` in their order."""
    n_in = len(body.views)
    where = {r: i for i, r in enumerate((*inputs, *extra))}
    views = tuple(body.views[r] for r in inputs)
    prog = []
    for k, (op, args, param, dt) in enumerate(body.program):
        r = n_in + k
        if r in need and r not in where:
            prog.append((op, tuple(where[a] for a in args), param, dt))
            where[r] = len(where)
    return views, tuple(prog)


#: the most row statistics a norm may have to be split (each is a stats map loading the rows)
MAX_STATISTICS = 2

#: a fusion that saves less simulated time than this fraction of the unfused time ...
FUSE_GAIN = 0.01
#: ... or than this many microseconds saves none: the unfused stages are a shorter simulation
#: (a prologue reruns per N block in the simulation too), as the tiler breaks its ties
FUSE_GAIN_US = 0.2


def split_norm(
    body: MapBody,
) -> tuple[list[tuple[MapBody, list[int]]], MapBody, list[int], int] | None:
    """A norm's map body split at its row statistics, or None when it is not one.

    Returns (per statistic, in register order, its stats body: the program up to it on whole
    rows, then ``max`` over the last axis: one fp32 value per row, with its inputs, register
    numbers of ``body``; the prologue body: the rest over the same space, reading the
    statistics as its last inputs, broadcast along the last axis; its inputs before those; the
    prologue's input that is the norm's row input, read one-to-one: the lhs tile of a matmul).
    RMSNorm has one statistic (``rsqrt(mean(x²) + eps)``), layernorm two (the mean and the
    scale); more than :data:`MAX_STATISTICS` are not split."""
    last = len(body.space) - 1
    if body.reduce or last < 0 or body.program_reduce_axes() != frozenset((last,)):
        return None
    found = _invariant(body)
    if found is None:
        return None
    inv, red = found
    n_in = len(body.views)
    final = n_in + len(body.program) - 1
    if inv[final]:
        return None
    # the statistics: the registers after a row reduction that per-element ops read
    boundary = sorted(
        {
            a
            for k, (_, args, _, _) in enumerate(body.program)
            if not inv[n_in + k]
            for a in args
            if inv[a] and red[a]
        }
    )
    if not 1 <= len(boundary) <= MAX_STATISTICS:
        return None
    stats = []
    for stat in boundary:
        need_s = _closure(body.program, n_in, stat)
        ins_s = sorted(r for r in need_s if r < n_in)
        views, prog = _subprogram(body, need_s, ins_s)
        stats.append((MapBody(body.space, views, prog, "max", (last,), "float32"), ins_s))
    need_p = _closure(body.program, n_in, final, stop=frozenset(boundary))
    ins_p = sorted(r for r in need_p if r < n_in)
    views, prog = _subprogram(body, need_p, ins_p, extra=tuple(boundary))
    rank = len(body.space)
    sv = InputView(
        tuple(range(rank - 1)), (0,) * (rank - 1), (1,) * (rank - 1), (False,) * (rank - 1)
    )
    pro = MapBody(body.space, (*views, *[sv] * len(boundary)), prog, "", (), body.out_dtype)
    ident = InputView.identity(rank)
    rows = [i for i, r in enumerate(ins_p) if body.views[r] == ident and not inv[r]]
    if not rows:
        return None
    return stats, pro, ins_p, rows[0]


def _over(
    n: Node, lhs: tuple[int, ...], stick: int
) -> tuple[MapBody, list[Var], list[tuple[Var, Var]]] | None:
    """Map ``n`` re-expressed over the matmul's lhs shape ``lhs`` (``[B, M, K]``, the same K):
    its body, its inputs (the full-size ones reshaped), and the (input, reshaped) pairs to
    make. None unless every input is read whole (reshaped for free) or only along K."""
    body: MapBody = n.params.body
    space = body.space
    if space == lhs:
        return body, list(n.inputs), []
    if not space or space[-1] != lhs[-1]:
        return None
    last, ident = len(space) - 1, InputView.identity(len(space))
    views: list[InputView] = []
    ins: list[Var] = []
    pairs: list[tuple[Var, Var]] = []
    for v, view in zip(n.inputs, body.views, strict=True):
        if view == ident and v.shape == space:
            if not is_free_reshape(space, lhs, v.dtype, stick):
                return None
            done = [u for w, u in pairs if w is v]
            u = done[0] if done else Var(lhs, v.dtype)
            if not done:
                pairs.append((v, u))
            ins.append(u)
            views.append(InputView.identity(3))
            continue
        dims = []
        for g, bc in zip(view.dims, view.bcast, strict=True):
            if g == last and not bc:
                dims.append(2)
            elif g < 0 or bc:
                dims.append(-1)  # one index of it, whichever dim it broadcasts over
            else:
                return None  # read along a dim the reshape regroups
        ins.append(v)
        views.append(InputView(tuple(dims), view.starts, view.strides, view.bcast))
    prog = []
    for op, args, param, dt in body.program:  # the row reductions: over the new last axis
        if op in ROW_REDUCTIONS:
            if tuple(param) != (last,):
                return None
            param = (2,)
        prog.append((op, args, param, dt))
    return MapBody(lhs, tuple(views), tuple(prog), "", (), body.out_dtype), ins, pairs


def _matmul_readers(
    v: Var, readers: dict[int, list[Node]], outputs: set[int], stick: int
) -> tuple[list[Node], list[Node], tuple[int, ...]] | None:
    """The matmuls reading ``v`` as their lhs, directly or through chains of free reshapes
    that keep its last dim (a torch ``Linear``'s ``[B, S, K] -> [B*S, K] -> [1, B*S, K]``),
    the reshapes, and the lhs shape; None when anything else reads ``v`` or a value between."""
    mms: dict[int, Node] = {}
    shapes: set[tuple[int, ...]] = set()
    reshapes: list[Node] = []

    def walk(u: Var) -> bool:
        if u.id in outputs or 0 in u.shape:
            return False
        for r in readers.get(u.id, []):
            if r.op == "reshape":
                w = r.out
                if w.shape[-1:] != v.shape[-1:] or not is_free_reshape(
                    v.shape, w.shape, v.dtype, stick
                ):
                    return False
                reshapes.append(r)
                if not walk(w):
                    return False
            elif r.op == "matmul" and len(u.shape) == 3:
                if r.inputs[0] is not u or any(x is u for x in r.inputs[1:]):
                    return False
                if r.params.prologue is not None or 0 in r.out.shape:
                    return False
                mms[id(r)] = r
                shapes.add(u.shape)
            else:
                return False
        return True

    if not walk(v) or not mms or len(shapes) != 1:
        return None
    return list(mms.values()), reshapes, shapes.pop()


def _subgraph(nodes: list[Node]) -> Graph:
    """``nodes`` as a graph of their own: what they read from outside are its inputs, the
    matmuls' results its outputs."""
    made = {o.id for n in nodes for o in n.outputs}
    ins: dict[int, Var] = {}
    for n in nodes:
        for v in n.inputs:
            if v.id not in made:
                ins.setdefault(v.id, v)
    outs = tuple(o for n in nodes if n.op == "matmul" for o in n.outputs)
    return Graph("norm_matmul", tuple(ins.values()), tuple(nodes), outs)


def fuse_prologue(
    g: Graph, card: CardSpec, time_of: Callable[[Graph], float] | None = None
) -> Graph:
    """Every norm whose only readers are matmuls' lhs (directly or through the free reshape of
    a torch ``Linear``) becomes a stats map and a prologue of each of those matmuls (see the
    module docstring). ``time_of`` (the simulated time of a graph, in us, as the scheduler
    tiles it): a norm is fused only where the norm and its matmuls take less time fused than
    not, by :data:`FUSE_GAIN` of it and :data:`FUSE_GAIN_US` at least (a small norm can take
    longer as a stats map: one fp32 value per row, the rows in blocks of whole sticks of them,
    keeps fewer cores busy)."""
    readers: dict[int, list[Node]] = {}
    for n in g.nodes:
        for v in set(n.inputs):
            readers.setdefault(v.id, []).append(n)
    outputs = {v.id for v in g.outputs}
    stick = card.stick_bytes
    drop: set[int] = set()
    replace: dict[int, list[Node]] = {}
    taken: set[int] = set()  # matmuls already given a prologue in this pass
    for n in g.nodes:
        if n.op != "map" or split_norm(n.params.body) is None:
            continue
        found = _matmul_readers(n.out, readers, outputs, stick)
        if found is None:
            continue
        mms, reshapes, lhs_shape = found
        if any(id(m) in taken for m in mms):
            continue
        over = _over(n, lhs_shape, stick)
        if over is None:
            continue
        body, ins, pairs = over
        parts = split_norm(body)
        if parts is None:
            continue
        stats, pro_body, ins_p, row = parts
        if ins[ins_p[row]].shape != lhs_shape:  # an identity view of a longer input: a slice
            continue
        made = [Node("reshape", (w,), (u,), Reshape(lhs_shape), n.source) for w, u in pairs]
        stat_vars = []
        for stats_body, ins_s in stats:
            stat = Var(lhs_shape[:-1], "float32")
            ps = Map(stats_body)
            made.append(Node("map", tuple(ins[r] for r in ins_s), (stat,), ps, n.source))
            stat_vars.append(stat)
        pro_ins = [ins[r] for r in ins_p] + stat_vars
        lhs = pro_ins.pop(row)
        fused = {
            id(m): Node(
                "matmul",
                (lhs, *m.inputs[1:], *pro_ins),
                m.outputs,
                dataclasses.replace(m.params, prologue=Fused(pro_body, row)),
                m.source,
            )
            for m in mms
        }
        if time_of is not None:
            try:
                before = time_of(_subgraph([n, *reshapes, *mms]))
                after = time_of(_subgraph([*made, *fused.values()]))
            except TilingError:  # the scheduler will say so for the whole graph
                continue
            if after > before - max(before * FUSE_GAIN, FUSE_GAIN_US):
                continue
        for m in mms:
            replace[id(m)] = [fused[id(m)]]
            taken.add(id(m))
        replace[id(n)] = made
        drop.update(id(r) for r in reshapes)
    if not replace:
        return g
    return dce(splice(g, drop, replace))


def unfuse_prologue(n: Node) -> list[Node]:
    """A matmul with a prologue as the prologue's map, which makes the lhs, and the matmul
    (the unfuse pass's split when the fused stage does not fit)."""
    pro: MapBody = n.params.prologue.body
    a, b, ep_ins, pro_ins = matmul_inputs(n)
    ins = list(pro_ins)
    ins.insert(n.params.prologue.slot, a)
    lhs = Var(a.shape, pro.out_dtype)
    ps = dataclasses.replace(n.params, prologue=None)
    return [
        Node("map", tuple(ins), (lhs,), Map(pro), n.source),
        Node("matmul", (lhs, b, *ep_ins), n.outputs, ps, n.source),
    ]
