"""Graphs with loops and branches -> host programs (:mod:`device_model.hostprog`).

The graph IR's ``scan``, ``while`` and ``cond`` nodes never enter a kernel. :func:`lower_program`
cuts a graph at them: each run of other nodes between two of them is a graph of its own,
compiled by the pipeline into one kernel (one launch); each control node becomes a loop or a
branch of the host program whose bodies are lowered the same way, once, whatever the trip
count. Values that cross from one piece to the next stay in device memory.

Before the cut, :func:`unroll_scans` inlines the scans that are better unrolled: those the user
asked to unroll whole (``unroll >= length``) and short ones whose body kernel is quicker than
the host's launch of it (``CardSpec.host_launch_s``: the looped form would wait for the host
every iteration), up to :data:`UNROLL_MAX_NODES` nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from device_model.card import CardSpec
from device_model.hostprog import Branch, Call, Program, ScanLoop, UpdateInPlace, WhileLoop
from device_model.kernel import Kernel
from device_model.layout import layout_for
from device_model.timing import kernel_cost

from .graph import Graph, Node, Var
from .op_params import Broadcast, Elementwise, Reshape, Slice
from .op_params import Concatenate as ConcatParams

__all__ = ["CONTROL_OPS", "has_control", "lower_program", "unroll_scans", "UNROLL_MAX_NODES"]

#: the graph IR's control-flow ops
CONTROL_OPS = frozenset({"scan", "while", "cond"})

#: a scan is unrolled by the compiler's choice only when its unrolled body has at most this many
#: nodes (the unrolled graph compiles as one kernel: its compile time grows with it)
UNROLL_MAX_NODES = 512


def has_control(g: Graph) -> bool:
    """Whether ``g`` has a loop or a branch."""
    return any(n.op in CONTROL_OPS for n in g.nodes)


Compile = Callable[[Graph, CardSpec], Kernel]


def lower_program(
    g: Graph,
    card: CardSpec,
    compile_graph: Compile,
    notes: list[dict] | None = None,
    owned: frozenset[int] = frozenset(),
) -> Program:
    """``g`` as a host program: its straight-line pieces compiled by ``compile_graph``, its
    loops and branches with their bodies lowered once (each body's scans unrolled first where
    better: :func:`unroll_scans`; the caller does so for ``g``). ``owned``: the inputs a loop
    owns (its carry, its stacked inputs' slices): an ``update_slice`` of one that nothing
    reads after becomes an :class:`~device_model.hostprog.UpdateInPlace` step."""
    layouts = {}
    for v in _all_vars(g):
        layouts[v.id] = layout_for(v.shape, v.dtype, card.stick_bytes)
    const_of = {v.id: (v, arr) for v, arr in g.consts}
    last_use = _last_uses(g)
    steps: list = []
    run: list[Node] = []
    prog_consts: dict[int, object] = {}

    def flush(end: int) -> None:
        if run:
            call = _segment(g, run, end, last_use, const_of, card, compile_graph, len(steps))
            if call is not None:
                steps.append(call)
            run.clear()

    owned = set(owned)
    outs = {v.id for v in g.outputs}
    for i, n in enumerate(g.nodes):
        if n.op == "update_slice" and _in_place(n, i, owned, last_use, outs, layouts, card, notes):
            flush(i)
            x, upd, *traced = n.inputs
            steps.append(
                UpdateInPlace(x.id, upd.id, n.params.starts, tuple(v.id for v in traced), n.out.id)
            )
            owned.add(n.out.id)
            continue
        if n.op not in CONTROL_OPS:
            run.append(n)
            continue
        flush(i)
        for v in n.inputs:
            if v.id in const_of:
                prog_consts[v.id] = const_of[v.id][1]
        step = _control(n, card, compile_graph, notes)
        if n.op in ("scan", "while"):  # the loop's own buffers an enclosing loop hands over
            first = _carry_start(n)
            donated = frozenset(
                k - first
                for k, v in enumerate(n.inputs)
                if k >= first and v.id in owned and last_use.get(v.id) == i and v.id not in outs
            )
            step = dataclasses.replace(step, donated=donated)
        steps.append(step)
        owned.update(v.id for v in n.outputs)
    flush(len(g.nodes))
    for v in g.outputs:
        if v.id in const_of:
            prog_consts[v.id] = const_of[v.id][1]
    return Program(
        g.name,
        tuple(v.id for v in g.inputs),
        tuple(prog_consts.items()),  # type: ignore[arg-type]
        tuple(steps),
        tuple(v.id for v in g.outputs),
        layouts,
    )


def _carry_start(n: Node) -> int:
    """Where a loop node's carry starts among its inputs (after its consts)."""
    p = n.params
    return p.num_consts if n.op == "scan" else p.cond_nconsts + p.body_nconsts


def _in_place(
    n: Node,
    i: int,
    owned: set[int],
    last_use: dict[int, int],
    outs: set[int],
    layouts: dict,
    card: CardSpec,
    notes: list[dict] | None,
) -> bool:
    """Whether update ``n`` (node ``i``) writes its operand in place: the loop owns it, this is
    its last reader, the graph does not return it, and the timing model says so: in place, the
    kernel is cut in two (one more launch, ``host_launch_s``); in the kernel, the operand is
    read and written whole (twice its bytes at the streaming rate)."""
    x = n.inputs[0]
    if not (x.id in owned and last_use.get(x.id) == i and x.id not in outs):
        return False
    copy_us = 2 * layouts[x.id].nbytes / card.memory_bw(0.5) * 1e6
    launch_us = card.host_launch_s * 1e6
    if notes is not None:
        where = "in place" if copy_us > launch_us else "in the kernel (copied whole)"
        notes.append(
            {"kind": "update", "source": n.source, "decision": where}
            | {"copy_us": copy_us, "launch_us": launch_us}
        )
    return copy_us > launch_us


def _all_vars(g: Graph) -> list[Var]:
    out = list(g.inputs) + [v for v, _ in g.consts]
    for n in g.nodes:
        out += list(n.outputs)
    return out


def _last_uses(g: Graph) -> dict[int, int]:
    """Each var's last reader: a node's index, or ``len(g.nodes)`` for a graph output."""
    last: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            last[v.id] = i
    for v in g.outputs:
        last[v.id] = len(g.nodes)
    return last


def _segment(
    g: Graph,
    nodes: list[Node],
    end: int,
    last_use: dict[int, int],
    const_of: dict[int, tuple[Var, object]],
    card: CardSpec,
    compile_graph: Compile,
    k: int,
) -> Call | None:
    """One straight-line piece (the nodes before index ``end``) as one launch."""
    defined = {v.id for n in nodes for v in n.outputs}
    inputs: dict[int, Var] = {}
    consts: dict[int, tuple[Var, object]] = {}
    for n in nodes:
        for v in n.inputs:
            if v.id in defined:
                continue
            if v.id in const_of:
                consts[v.id] = const_of[v.id]
            else:
                inputs.setdefault(v.id, v)
    outputs = [v for n in nodes for v in n.outputs if last_use.get(v.id, -1) >= end]
    if not outputs:
        return None
    seg = Graph(
        f"{g.name}_{k}",
        tuple(inputs.values()),
        tuple(nodes),
        tuple(outputs),
        tuple(consts.values()),  # type: ignore[arg-type]
    )
    kernel = compile_graph(seg, card)
    return Call(kernel, tuple(inputs), tuple(v.id for v in outputs))


def _lower_body(
    g: Graph,
    card: CardSpec,
    compile_graph: Compile,
    notes: list[dict] | None,
    first_owned: int = -1,
) -> Program:
    """A body's program; its inputs from ``first_owned`` on (when given) are the loop's own."""
    g = unroll_scans(g, card, compile_graph, notes)
    owned = frozenset(v.id for v in g.inputs[first_owned:]) if first_owned >= 0 else frozenset()
    return lower_program(g, card, compile_graph, notes, owned)


def _control(
    n: Node, card: CardSpec, compile_graph: Compile, notes: list[dict] | None
) -> ScanLoop | WhileLoop | Branch:
    p = n.params
    ins = tuple(v.id for v in n.inputs)
    outs = tuple(v.id for v in n.outputs)
    if n.op == "scan":
        nc, nk = p.num_consts, p.num_carry
        return ScanLoop(
            _lower_body(p.body, card, compile_graph, notes, nc),
            p.length,
            p.reverse,
            ins[:nc],
            ins[nc : nc + nk],
            ins[nc + nk :],
            outs,
            n.source,
        )
    if n.op == "while":
        cn, bn = p.cond_nconsts, p.body_nconsts
        return WhileLoop(
            _lower_body(p.cond, card, compile_graph, notes),
            _lower_body(p.body, card, compile_graph, notes, bn),
            ins[:cn],
            ins[cn : cn + bn],
            ins[cn + bn :],
            outs,
            n.source,
        )
    branches = tuple(_lower_body(b, card, compile_graph, notes) for b in p.branches)
    return Branch(ins[0], ins[1:], branches, outs, n.source)


# ---------------------------------------------------------------------------------------------
# unrolling


def unroll_scans(
    g: Graph, card: CardSpec, compile_graph: Compile, notes: list[dict] | None = None
) -> Graph:
    """``g`` with the scans better unrolled inlined, and the conds better computed both ways
    and selected (see the module's docstring). Each choice made is appended to ``notes`` (a
    row for ``cost_analysis()["inlined"]``)."""
    nodes: list[Node] = []
    consts = list(g.consts)
    changed = False
    for n in g.nodes:
        note = _inline_choice(n, card, compile_graph)
        if note is None:
            nodes.append(n)
            continue
        changed = True
        if notes is not None:
            notes.append(note)
        if n.op == "scan":
            nodes += inline_scan(n)
            consts += list(n.params.body.consts)
        else:
            nodes += select_cond(n)
            for br in n.params.branches:
                consts += list(br.consts)
    if not changed:
        return g
    return Graph(g.name, g.inputs, tuple(nodes), g.outputs, tuple(consts))


def _time_us(g: Graph, card: CardSpec, compile_graph: Compile) -> float:
    return float(kernel_cost(compile_graph(g, card), card)["sim_time_us"])


def _inline_choice(n: Node, card: CardSpec, compile_graph: Compile) -> dict | None:
    """Why ``n`` (a scan or a cond) is better inlined, as a row of notes; None to keep it."""
    p = n.params
    launch_us = card.host_launch_s * 1e6
    if n.op == "scan":
        row = {"kind": "scan", "source": n.source, "iterations": p.length}
        if p.length == 0 or p.unroll >= p.length:
            return row | {"decision": "unrolled (asked for)"}
        body = p.body
        if has_control(body) or p.length * max(len(body.nodes), 1) > UNROLL_MAX_NODES:
            return None
        t = _time_us(body, card, compile_graph)
        if t >= launch_us:
            return None
        return row | {"decision": "unrolled", "body_us": t, "host_launch_us": launch_us}
    if n.op == "cond":
        if any(has_control(b) for b in p.branches):
            return None
        if sum(len(b.nodes) for b in p.branches) > UNROLL_MAX_NODES:
            return None
        ts = [_time_us(b, card, compile_graph) if b.nodes else 0.0 for b in p.branches]
        rt_us = (card.host_round_trip_s + card.host_launch_s) * 1e6
        if sum(ts) >= max(ts) + rt_us:
            return None
        return {
            "kind": "cond",
            "source": n.source,
            "decision": "every branch computed, the result selected",
            "branches_us": ts,
            "round_trip_us": rt_us,
        }
    return None


def select_cond(n: Node) -> list[Node]:
    """A cond node as straight-line nodes: every branch computed, each output selected by the
    index (clamped into range first, as JAX does)."""
    idx, ops = n.inputs[0], list(n.inputs[1:])
    out: list[Node] = []
    k = len(n.params.branches)
    lo = Var((), "int32")
    out.append(
        Node(
            "elementwise",
            (idx,),
            (lo,),
            Elementwise("max", "int32", ((1, 0, "int32"),), ()),
            n.source,
        )
    )
    hi = Var((), "int32")
    out.append(
        Node(
            "elementwise",
            (lo,),
            (hi,),
            Elementwise("min", "int32", ((1, k - 1, "int32"),), ()),
            n.source,
        )
    )
    results = [_inline_graph(br, ops, out) for br in n.params.branches]
    for j, final in enumerate(n.outputs):
        cases = [r[j] for r in results]
        if k == 1:
            out.append(_copy(cases[0], final, n.source))
            continue
        pred: Var = hi
        if final.shape:
            pred = Var(final.shape, "int32")
            bc = Broadcast(final.shape, ())
            out.append(Node("broadcast", (hi,), (pred,), bc, n.source))
        ew = Elementwise("select_n", final.dtype, (), final.shape)
        out.append(Node("elementwise", (pred, *cases), (final,), ew, n.source))
    return out


def _inline_graph(g: Graph, args: list[Var], out: list[Node]) -> list[Var]:
    """``g``'s nodes appended to ``out`` over fresh vars, its inputs bound to ``args``; its
    outputs (the graph's constants are read as they are: the caller adds them)."""
    env: dict[int, Var] = {v.id: a for v, a in zip(g.inputs, args, strict=True)}
    for cv, _arr in g.consts:
        env[cv.id] = cv
    for bn in g.nodes:
        new_outs = tuple(Var(v.shape, v.dtype) for v in bn.outputs)
        out.append(Node(bn.op, tuple(env[v.id] for v in bn.inputs), new_outs, bn.params, bn.source))
        env.update((v.id, w) for v, w in zip(bn.outputs, new_outs, strict=True))
    return [env[v.id] for v in g.outputs]


def inline_scan(n: Node) -> list[Node]:
    """A scan node as straight-line nodes: its body once per iteration, each slice of a stacked
    input a ``slice`` and a ``reshape``, the stacked outputs ``concatenate`` s of the slices.
    The body's constants are read as they are (the caller adds them to the graph's)."""
    p = n.params
    nc, nk = p.num_consts, p.num_carry
    consts, carry = list(n.inputs[:nc]), list(n.inputs[nc : nc + nk])
    xs = list(n.inputs[nc + nk :])
    body = p.body
    out: list[Node] = []
    ys: list[list[Var]] = [[] for _ in body.outputs[nk:]]
    order = range(p.length - 1, -1, -1) if p.reverse else range(p.length)
    for i in order:
        sliced = [_take(x, i, out, n.source) for x in xs]
        res = _inline_graph(body, consts + carry + sliced, out)
        carry = res[:nk]
        for j, y in enumerate(res[nk:]):
            ys[j].append(_lift(y, out, n.source))
    stacked = []
    for j, parts in enumerate(ys):
        parts = parts[::-1] if p.reverse else parts
        final = n.outputs[nk + j]
        stacked.append((final, parts))
    # the final carry and stacked outputs keep the scan's own vars (later nodes read them)
    for final, v in zip(n.outputs[:nk], carry, strict=True):
        out.append(_copy(v, final, n.source))
    for final, parts in stacked:
        if not parts:
            out.append(_empty(final, n.source))
        elif len(parts) == 1:
            out.append(Node("reshape", (parts[0],), (final,), Reshape(final.shape), n.source))
        else:
            out.append(Node("concatenate", tuple(parts), (final,), ConcatParams(0), n.source))
    return out


def _take(x: Var, i: int, out: list[Node], source: str) -> Var:
    """Slice ``i`` of stacked ``x`` (its first axis dropped)."""
    r = len(x.shape)
    one = Var((1, *x.shape[1:]), x.dtype)
    st = (i,) + (0,) * (r - 1)
    li = (i + 1, *x.shape[1:])
    out.append(Node("slice", (x,), (one,), Slice(st, li, (1,) * r), source))
    v = Var(x.shape[1:], x.dtype)
    out.append(Node("reshape", (one,), (v,), Reshape(v.shape), source))
    return v


def _lift(y: Var, out: list[Node], source: str) -> Var:
    """``y`` with a leading axis of 1 (one slice of a stacked output)."""
    v = Var((1, *y.shape), y.dtype)
    out.append(Node("reshape", (y,), (v,), Reshape(v.shape), source))
    return v


def _copy(v: Var, final: Var, source: str) -> Node:
    return Node("elementwise", (v,), (final,), Elementwise("copy", v.dtype, (), v.shape), source)


def _empty(final: Var, source: str) -> Node:
    z = (0, 0, final.dtype)
    return Node(
        "elementwise", (), (final,), Elementwise("copy", final.dtype, (z,), final.shape), source
    )
