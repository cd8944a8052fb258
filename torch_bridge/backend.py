"""``torch.compile(model, backend="spyre")``: Dynamo's FX graph, through AOTAutograd with the
core ATen decompositions, into ``lowering.from_fx`` and the shared graph IR, passes, kernel and
card (``torch_bridge.kernels``: ``lowering.pipeline`` and ``device_model.runtime``).

A graph that needs gradients (grad mode on and an input that requires grad) is compiled for
training: AOTAutograd's forward and backward graphs both run on the card through the same
lowering (``torch_bridge.training``). Under ``torch.no_grad()`` a graph is one forward graph,
as it always was. An ATen op with no lowering rule falls back to the CPU by default:
the graph is split by ``torch.fx``'s capability-based partitioner into card subgraphs and the
unsupported nodes, which run eagerly on the CPU, with a warning that names the op and a counter
(:func:`fallback_stats`). ``options={"strict": True}`` raises instead, naming the op and the
node's source line.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from device_model.runtime import runtime
from lowering.errors import UnsupportedPrimitiveError
from lowering.from_fx import RULES, card_dtype, from_fx, node_source, supported
from lowering.fx_common import is_card_dtype
from lowering.hoist import split_weight_layouts

from . import rng, training
from .dynamic import DynamicGraph, is_dynamic
from .errors import InferenceOnlyError, SpyreFallbackWarning
from .graph_passes import core_decompositions
from .kernels import WeightLayouts, load, run_graph
from .storage import from_host, to_host

__all__ = [
    "spyre_backend",
    "fallback_stats",
    "reset_fallback_stats",
    "compile_stats",
    "compiled_kernels",
    "SpyreFallbackWarning",
    "InferenceOnlyError",
    "to_host",
    "from_host",
]


_lock = threading.Lock()
_fallbacks: collections.Counter[str] = collections.Counter()
_stats = {"graphs": 0, "kernels": 0, "compile_s": 0.0}
# every card kernel (a _CardGraph) since the last reset, while something (Dynamo's cache, the
# caller) still holds it: a weak reference, so that recompiling does not keep every old kernel
# and its compiled card program alive
_kernels: list[weakref.ref] = []
# every graph of symbolic sizes (a DynamicGraph: a kernel per size), weakly, as _kernels
_dynamic: list[weakref.ref] = []


def fallback_stats() -> dict[str, int]:
    """ATen op -> how many graph nodes of it were compiled to run on the CPU (all graphs so far)."""
    with _lock:
        return dict(_fallbacks)


def reset_fallback_stats() -> None:
    with _lock:
        _fallbacks.clear()
        _stats.update(graphs=0, kernels=0, compile_s=0.0)
        _kernels.clear()
        _dynamic.clear()


def compiled_kernels() -> list[Any]:
    """The card kernels the backend made since the last reset and that are still in use (held
    by Dynamo's cache or by the caller; the list does not keep them alive): each has ``graph``
    (the graph IR), ``kernel`` (the schedule), ``executable`` and ``cost_analysis()`` (simulated
    time, scratchpad peak, traffic, ...)."""
    with _lock:
        live = [k for r in _kernels if (k := r()) is not None]
        _kernels[:] = [weakref.ref(k) for k in live]
        return live


def compile_stats() -> dict[str, float]:
    """Graphs compiled by the backend (a graph of symbolic sizes counts once per size it was
    specialized to), card kernels they became, the seconds spent, and how many of the graphs
    were graphs of symbolic sizes (``dynamic_graphs``) still in use."""
    with _lock:
        live = [g for r in _dynamic if (g := r()) is not None]
        return {**_stats, "dynamic_graphs": len(live)}


_OPTIONS = frozenset({"strict"})


def spyre_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None
) -> Callable:
    """The Dynamo backend registered as ``"spyre"`` (entry point ``torch_dynamo_backends``)."""
    opts = dict(options or {})
    unknown = set(opts) - _OPTIONS
    if unknown:
        raise ValueError(
            f"spyre backend: unknown options {sorted(unknown)}; known: {sorted(_OPTIONS)}"
        )
    strict = bool(opts.get("strict", False))
    if training.needs_autograd(example_inputs):  # forward and backward graphs, both on the card
        return training.compile_training(
            gm,
            example_inputs,
            forward=functools.partial(_compile_forward, strict=strict),
            backward=functools.partial(_compile_backward, strict=strict),
        )
    return aot_module_simplified(
        gm,
        list(example_inputs),
        fw_compiler=functools.partial(_compile_forward, strict=strict),
        # never called under no_grad; there for a graph AOTAutograd finds needs gradients anyway
        bw_compiler=training.SplitOutputs.compiler(
            functools.partial(_compile_backward, strict=strict)
        ),
        decompositions=core_decompositions(),
    )


# ---------------------------------------------------------------------------------------------
# forward graphs


def _compile_forward(gm: torch.fx.GraphModule, example_inputs: Any, *, strict: bool) -> Callable:
    # AOTAutograd calls us under its fake mode; constants must be read as real tensors
    with unset_fake_temporarily():
        return _compile_forward_real(gm, strict=strict, weights=_weight_inputs())


def _compile_backward(gm: torch.fx.GraphModule, example_inputs: Any, *, strict: bool) -> Callable:
    """AOTAutograd's backward graph, compiled as a forward graph is. Its inputs are saved
    activations and incoming gradients, not the model's weights (AOTAutograd's static input
    indices are the forward's): no weight layouts are cut out of it."""
    with unset_fake_temporarily():
        return _compile_forward_real(gm, strict=strict, weights=())


def _weight_inputs() -> tuple[int, ...]:
    """The indices of the forward graph's inputs that are the model's parameters and buffers
    (AOTAutograd's static inputs), or none outside a Dynamo compile."""
    tc = TracingContext.try_get()
    meta = getattr(tc, "fw_metadata", None) if tc is not None else None
    return tuple(getattr(meta, "static_input_indices", None) or ())


def _compile_forward_real(
    gm: torch.fx.GraphModule, *, strict: bool, weights: Sequence[int] = ()
) -> Callable:
    states = rng.rewrite_random(gm)  # random ops draw from the card's generator, per call
    if is_dynamic(gm):  # symbolic sizes: a static kernel per concrete size, at call time
        run = DynamicGraph(gm, functools.partial(_compile_static, strict=strict), weights)
        with _lock:
            _dynamic.append(weakref.ref(run))
    else:
        run = _compile_static(gm, strict=strict, weights=weights)

    def forward(*args: Any) -> Any:
        if states:
            args = (*args, *rng.draw_states(states))
        return run(*args)

    return make_boxed_func(forward)


def _compile_static(
    gm: torch.fx.GraphModule, *, strict: bool, weights: Sequence[int] = ()
) -> Callable:
    """A graph of static sizes as one card kernel, or card kernels and CPU fallbacks.
    ``weights``: the indices of the inputs that are the model's weights (their re-layouts are
    made once, :class:`~torch_bridge.kernels.WeightLayouts`)."""
    t0 = time.perf_counter()
    bad = [n for n in gm.graph.nodes if not supported(n)]
    if bad and strict:
        n = bad[0]
        for v in _tensor_vals(n):  # a rule that exists, on a dtype the card does not have
            if n.target in RULES and not is_card_dtype(v.dtype):
                card_dtype(v.dtype, f"the result of {n.target} (at {node_source(n) or n.name})")
        raise UnsupportedPrimitiveError(
            "ATen", str(n.target), n.format_node(), node_source(n), _context(gm, n)
        )
    if not bad:
        run = _CardGraph(gm, weights)
        nk = 1
    else:
        for n in bad:
            warnings.warn(
                f"spyre: ATen op {n.target} has no lowering rule; it runs on the CPU "
                f"(at {node_source(n) or n.format_node()})",
                SpyreFallbackWarning,
                stacklevel=2,
            )
        run, nk = _partitioned(gm)
    with _lock:
        for n in bad:
            _fallbacks[str(n.target)] += 1
        _stats["graphs"] += 1
        _stats["kernels"] += nk
        _stats["compile_s"] += time.perf_counter() - t0
    return run


def _tensor_vals(n: torch.fx.Node) -> list[torch.Tensor]:
    vals = n.meta.get("val")
    return [
        v
        for v in (vals if isinstance(vals, list | tuple) else [vals])
        if isinstance(v, torch.Tensor)
    ]


def _context(gm: torch.fx.GraphModule, node: torch.fx.Node, radius: int = 2) -> str:
    nodes = list(gm.graph.nodes)
    i = nodes.index(node)
    return "\n".join(
        f"    {'>>' if k == i else '  '} {nodes[k].format_node()[:160]}"
        for k in range(max(0, i - radius), min(len(nodes), i + radius + 1))
    )


class _CardGraph:
    """A whole FX graph compiled to one card kernel; called with torch tensors.

    ``graph`` (the graph IR), ``kernel`` (the schedule), ``executable`` (loaded on the card),
    :meth:`cost_analysis` and :meth:`as_text`: what :func:`compiled_kernels` lists.

    With ``weights`` (the indices of the inputs that are the model's weights), the re-layouts
    that read only weights (a convolution's kernel) are cut out into ``weight_layouts`` (a
    :class:`~torch_bridge.kernels.WeightLayouts`: run once, while the weights stay the same),
    and ``graph`` is the rest, run on every call."""

    def __init__(self, gm: torch.fx.GraphModule, weights: Sequence[int] = ()):
        graph = from_fx(gm, name="torch_graph")
        split = split_weight_layouts(graph, weights) if weights else None
        self.weight_layouts: WeightLayouts | None = None
        self.main_args: tuple[int, ...] = ()
        if split is not None:
            self.weight_layouts = WeightLayouts(split.prelude, split.prelude_args)
            self.main_args, graph = split.main_args, split.main
        self.graph = graph
        self.executable = load(self.graph)
        self.kernel = self.executable.kernel
        self.recipe = self.executable.recipe
        with _lock:
            _kernels.append(weakref.ref(self))
        outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        outs = outs if isinstance(outs, list | tuple) else [outs]
        self.out_meta = [_val(o) for o in outs]

    def cost_analysis(self) -> dict[str, Any]:
        """The kernel's figures (``device_model.runtime.Executable.cost_analysis``): one call's.
        Where weights are laid out once, ``weight_layouts_us`` is that kernel's simulated time
        (paid when the weights come to the card, not per call)."""
        res = self.executable.cost_analysis()
        if self.weight_layouts is not None:
            pre = self.weight_layouts.executable.cost_analysis()
            res = {**res, "weight_layouts_us": pre["sim_time_us"]}
        return res

    def as_text(self) -> str:
        text = self.executable.as_text()
        if self.weight_layouts is not None:
            text = f"{self.weight_layouts.executable.as_text()}\n{text}"
        return text

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        shapes_only = _shapes_only(args)
        if shapes_only is not None:
            # a model on the meta device or under FakeTensorMode: timing only. The kernel is
            # compiled (its cost_analysis() holds the simulated time); nothing runs, and the
            # results are tensors of the right shapes on the arguments' meta or fake device
            mode, device = shapes_only
            with mode:
                return tuple(
                    torch.empty(tuple(m.shape), dtype=m.dtype, device=device) for m in self.out_meta
                )
        # spyre tensors go in as the card buffers they are (no host round trip) and results on
        # spyre come back as spyre tensors; CPU tensors are copied in and out
        if self.executable.rt is not runtime():  # set_card since: load it on the new card
            self.executable = load(self.graph)
            self.kernel, self.recipe = self.executable.kernel, self.executable.recipe
        if self.weight_layouts is not None:
            laid = self.weight_layouts.buffers(args)
            args = (*(args[i] for i in self.main_args), *laid)
        return run_graph(self.executable, args, self.out_meta)


def _shapes_only(args: Sequence[Any]) -> tuple[Any, Any] | None:
    """(a context to create results in, their device) when an argument has no data (a meta
    tensor, or a FakeTensor); None when every tensor argument is real."""
    for a in args:
        if isinstance(a, FakeTensor):
            return a.fake_mode, a.device
        if isinstance(a, torch.Tensor) and a.is_meta:
            return contextlib.nullcontext(), torch.device("meta")
    return None


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else n


def _partitioned(gm: torch.fx.GraphModule) -> tuple[Callable, int]:
    """Card subgraphs for the supported nodes; the rest stays in ``gm`` and runs on the CPU."""

    class Support(OperatorSupportBase):
        def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
            return node.op == "call_function" and supported(node)

    part = CapabilityBasedPartitioner(gm, Support(), allows_single_node_partition=True)
    fused = part.fuse_partitions(part.propose_partitions())
    count = 0
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and node.target.startswith("fused_"):
            sub = getattr(fused, node.target)
            _copy_placeholder_meta(sub, node)
            setattr(fused, node.target, _CardModule(sub))
            count += 1
    fused.recompile()
    return fused, count


def _copy_placeholder_meta(sub: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for ph, arg in zip(phs, call.args, strict=True):
        if "val" not in ph.meta and isinstance(arg, torch.fx.Node):
            ph.meta["val"] = arg.meta.get("val")


class _CardModule(torch.nn.Module):
    """A fused partition compiled to one card kernel, inside a CPU-run FX graph."""

    def __init__(self, sub: torch.fx.GraphModule):
        super().__init__()
        self.card = _CardGraph(sub)
        self.single = not isinstance(
            [n for n in sub.graph.nodes if n.op == "output"][0].args[0], list | tuple
        )

    def forward(self, *args: Any) -> Any:
        outs = self.card(*args)
        return outs[0] if self.single else outs
