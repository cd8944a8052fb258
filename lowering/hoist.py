"""Weight layouts hoisted out of a graph: the re-layouts that depend only on a model's weights
run once, when the weights come to the card, not on every call.

A convolution's kernel comes as PyTorch stores it, ``[O, I, KH, KW]``, and the card's matmul
wants it as ``[KH * KW * I, O]`` (:mod:`lowering.conv_ops`). In device memory the first has
``KW`` on its sticks (3 elements of a 64-element fp16 stick), so re-laying it out on every call
reads about 20 times its bytes. A compiler for the card lays such weights out once, when they
are loaded (as PyTorch's own compilers fold constant work on frozen parameters).
:func:`split_weight_layouts` does that for a graph whose weight inputs the caller names: the
data movement that reads only weights and moves their stick dimension (a transpose that changes
the last axis, with the reshapes, slices and converts around it) becomes a separate graph, the
*prelude*, whose results the main graph takes as extra inputs. A ``Linear``'s ``W.T`` is one
too: the card's PE takes a matmul's second operand sticked on the output columns, so the
weight, sticked on K as stored, is restickified once here rather than on every call
(``MatmulStep.nt_form``). Pure: a new pair of graphs, or None when nothing is worth hoisting.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from device_model.layout import np_dtype

from .graph import Graph, Node, Var
from .passes import dce

__all__ = ["Split", "split_weight_layouts", "HOISTABLE", "host_computable", "run_on_host"]

#: ops that move or convert data and may run in the prelude (no broadcast: it would store more)
HOISTABLE = frozenset({"transpose", "reshape", "convert", "slice", "concatenate"})


@dataclass(frozen=True)
class Split:
    """A graph cut in two: ``prelude`` reads the weights (``prelude_args``: indices of the
    original graph's inputs, in its input order) and gives the laid-out weights; ``main`` takes
    the original inputs it still reads (``main_args``: their indices) followed by the prelude's
    outputs, and gives the original outputs."""

    prelude: Graph
    prelude_args: tuple[int, ...]
    main: Graph
    main_args: tuple[int, ...]


def _moves_sticks(n: Node) -> bool:
    if n.op != "transpose":
        return False
    perm = n.params.perm
    return len(perm) > 0 and perm[-1] != len(perm) - 1


def split_weight_layouts(g: Graph, weights: Collection[int]) -> Split | None:
    """``g`` with the re-layouts of the inputs at indices ``weights`` moved to a prelude graph
    (see the module's doc), or None when there are none."""
    static: set[int] = {g.inputs[i].id for i in weights}
    if not static:
        return None
    producer: dict[int, Node] = {}
    static_nodes: list[Node] = []
    for n in g.nodes:
        if n.op in HOISTABLE and n.inputs and all(v.id in static for v in n.inputs):
            static_nodes.append(n)
            for o in n.outputs:
                static.add(o.id)
                producer[o.id] = n
    if not static_nodes:
        return None
    hoisted_ids = {id(n) for n in static_nodes}
    used_outside: set[int] = {v.id for v in g.outputs}
    for n in g.nodes:
        if id(n) not in hoisted_ids:
            used_outside.update(v.id for v in n.inputs)
    frontier = [
        o for n in static_nodes for o in n.outputs if o.id in used_outside and o.id in producer
    ]

    def cone(v: Var) -> list[Node]:
        seen: dict[int, Node] = {}
        stack = [v]
        while stack:
            x = stack.pop()
            n = producer.get(x.id)
            if n is not None and id(n) not in seen:
                seen[id(n)] = n
                stack.extend(n.inputs)
        return list(seen.values())

    chosen = [v for v in frontier if any(_moves_sticks(n) for n in cone(v))]
    if not chosen:
        return None
    pre_ids = {id(n) for v in chosen for n in cone(v)}
    pre_nodes = tuple(n for n in g.nodes if id(n) in pre_ids)
    read = {v.id for n in pre_nodes for v in n.inputs}
    prelude_args = tuple(i for i, v in enumerate(g.inputs) if v.id in read)
    prelude = Graph(
        f"{g.name}_weight_layouts",
        tuple(g.inputs[i] for i in prelude_args),
        pre_nodes,
        tuple(chosen),
    )
    chosen_ids = {v.id for v in chosen}
    rest = tuple(n for n in g.nodes if not (id(n) in pre_ids and n.out.id in chosen_ids))
    main = dce(Graph(g.name, g.inputs, rest, g.outputs, g.consts))
    live = {v.id for n in main.nodes for v in n.inputs} | {v.id for v in main.outputs}
    main_args = tuple(i for i, v in enumerate(g.inputs) if v.id in live)
    main = Graph(
        main.name,
        (*(g.inputs[i] for i in main_args), *chosen),
        main.nodes,
        main.outputs,
        main.consts,
    )
    return Split(prelude, prelude_args, main, main_args)


_FLOATS = frozenset({"float16", "bfloat16", "float32"})


def host_computable(g: Graph) -> bool:
    """Whether :func:`run_on_host` gives ``g``'s results exactly as the card does: data
    movement only, and converts between float dtypes (rounded to nearest even either way)."""
    return all(
        n.op in HOISTABLE
        and (n.op != "convert" or (n.inputs[0].dtype in _FLOATS and n.out.dtype in _FLOATS))
        for n in g.nodes
    )


def run_on_host(g: Graph, args: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``g`` (a prelude: :func:`host_computable`) evaluated with NumPy on the host: what a
    compiler does to constant weights as it copies them to the card (no card time, and no
    padded copy of the weights in device memory while they are re-laid out)."""
    env: dict[int, np.ndarray] = {
        v.id: np.asarray(a).reshape(v.shape) for v, a in zip(g.inputs, args, strict=True)
    }
    for n in g.nodes:
        x = [env[v.id] for v in n.inputs]
        p = n.params
        if n.op == "transpose":
            y = np.transpose(x[0], p.perm)
        elif n.op == "reshape":
            y = x[0].reshape(n.out.shape)
        elif n.op == "convert":
            y = x[0].astype(np_dtype(n.out.dtype))
        elif n.op == "slice":
            y = x[0][
                tuple(slice(a, b, c) for a, b, c in zip(p.starts, p.limits, p.strides, strict=True))
            ]
        elif n.op == "concatenate":
            y = np.concatenate(x, axis=p.axis)
        else:  # pragma: no cover - host_computable says which ops come here
            raise ValueError(f"run_on_host: op {n.op!r} is not data movement")
        env[n.out.id] = np.ascontiguousarray(y, dtype=np_dtype(n.out.dtype))
    return [env[v.id] for v in g.outputs]
