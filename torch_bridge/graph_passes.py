"""Passes over the static FX graphs the dynamic paths trace again: constants folded, the user's
source lines given back; the core ATen decomposition table every trace of the bridge uses."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["fold_constants", "copy_sources", "core_decompositions", "FOLD_MAX_ELEMENTS"]

#: the table :func:`core_decompositions` made, and the number of CompositeImplicitAutograd
#: registrations it was made with
_CORE: list[Any] = [None, -1]


def core_decompositions() -> dict[Any, Any]:
    """``torch._decomp.core_aten_decompositions()`` as a plain dict, made once. PyTorch builds
    the table again on every call and fills it on first use with every CompositeImplicitAutograd
    op registered (about 70 ms: a tenth of a small graph's compile); the table here is made
    again only when that set of registrations grows (a library registered ops since). Shared:
    callers copy it before changing it."""
    n = len(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"))
    if _CORE[1] != n:
        from torch._decomp import core_aten_decompositions

        _CORE[:] = [dict(core_aten_decompositions()), n]
    return _CORE[0]


#: a computation on sizes alone folds to a constant when its result has at most this many elements
FOLD_MAX_ELEMENTS = 1 << 16


def _foldable(target: Any) -> bool:
    """Not a random op (each call draws anew) nor an uninitialized allocation."""
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags and target not in (
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
    )


def fold_constants(gm: torch.fx.GraphModule) -> None:
    """Evaluate what no input reaches (arithmetic on the sizes, now numbers: the ``** 0.5`` of
    a head width, ``arange`` of a length) into constants of the graph, so that the scalar
    computations Dynamo traced for symbolic sizes (often in float64) do not reach the card."""
    values: dict[torch.fx.Node, Any] = {}
    for n in list(gm.graph.nodes):
        if n.op == "get_attr":
            obj: Any = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            values[n] = obj
            continue
        if n.op != "call_function":
            continue
        deps = n.all_input_nodes
        if not all(d in values for d in deps) or not _foldable(n.target):
            continue
        args = torch.fx.node.map_arg(n.args, lambda d: values[d])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda d: values[d])
        try:
            v = n.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - not foldable here: the card computes it
            continue
        if not isinstance(v, torch.Tensor) or v.numel() > FOLD_MAX_ELEMENTS:
            continue
        values[n] = v
        name = f"_folded_{len(values)}"
        gm.register_buffer(name, v)
        with gm.graph.inserting_before(n):
            c = gm.graph.get_attr(name)
        c.meta["val"] = v
        n.replace_all_uses_with(c)
        gm.graph.erase_node(n)
        values[c] = v
    gm.graph.eliminate_dead_code()


def copy_sources(src: torch.fx.GraphModule, dst: torch.fx.GraphModule) -> None:
    """Give the retraced nodes the user's source lines back: each node of ``dst`` takes the
    stack trace of the first node of ``src`` with the same target, in order (errors then point
    at the user's line as they do for static graphs)."""
    traces: dict[Any, list[str]] = {}
    for n in src.graph.nodes:
        if n.op == "call_function" and n.meta.get("stack_trace"):
            traces.setdefault(n.target, []).append(n.meta["stack_trace"])
    for n in dst.graph.nodes:
        if n.op == "call_function" and traces.get(n.target):
            n.meta["stack_trace"] = traces[n.target].pop(0)
