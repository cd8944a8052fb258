"""Training graphs through ``torch.compile(backend="spyre")``: AOTAutograd's forward and
backward graphs, both compiled for the card through the forward's lowering.

When Dynamo hands the backend a graph while grad mode is on and an input requires grad,
:func:`compile_training` gives it to AOTAutograd with a forward and a backward compiler
(:func:`torch._functorch.aot_autograd.aot_module_simplified`). AOTAutograd traces the joint
forward and backward graph once, with the core ATen decompositions (so ``threshold_backward``,
``gelu_backward``, ``native_layer_norm_backward``, ``_softmax_backward_data``,
``embedding_dense_backward``, ... arrive as the core ATen ops ``lowering.from_fx`` has rules for),
cuts it in two and hands each half to the backend's compiler: the forward's (with the model's
weights, random ops drawing on the card's generator, per-op CPU fallback) and the same for the
backward (no weights: its inputs are saved activations and incoming gradients).

What this module adds around the backend's compiler:

* **Outputs the card does not compute.** A backward graph returns ``None`` for an input that
  needs no gradient, and a forward graph returns some of its own inputs (a parameter or an
  input saved for the backward). Those outputs are taken out of the graph before it is
  compiled and put back at call time (:class:`SplitOutputs`): a ``None`` stays ``None`` and an
  input is returned as itself, with no round trip through the card.
* **Attention.** ``F.scaled_dot_product_attention`` on CPU tensors picks the CPU's fused
  kernel (``_scaled_dot_product_flash_attention_for_cpu``), whose backward has no decomposition,
  and whose core ATen decomposition (right for inference) returns the attention weights where
  the backward expects a logsumexp. The joint graph is therefore traced with PyTorch's math
  attention (``sdpa_kernel(SDPBackend.MATH)``: matmuls and a softmax, differentiated as such),
  and the fused kernel's decomposition is left out of the training table, so that a fused call
  that still reaches the graph runs, forward and backward, on the CPU (correct, counted as a
  fallback) rather than wrong.
* **Recomputation.** The graph is cut by AOTAutograd's min-cut partitioner (Inductor's): it
  saves fewer activations and recomputes cheap ops in the backward, and it honours the
  recomputation that ``torch.utils.checkpoint`` asks for. Random ops are never recomputed:
  their values (dropout's mask) are saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch._decomp import get_decompositions
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import conv_grad
from .graph_passes import core_decompositions

__all__ = [
    "needs_autograd",
    "compile_training",
    "training_decompositions",
    "math_attention",
    "SplitOutputs",
]

aten = torch.ops.aten

#: a compiler of one AOTAutograd graph: (graph, example inputs) -> a boxed callable
GraphCompiler = Callable[[torch.fx.GraphModule, Any], Callable]

#: fused attention kernels whose core ATen decomposition is for inference only (their second
#: result is not what their backward reads)
_INFERENCE_ONLY_DECOMPOSITIONS = (aten._scaled_dot_product_flash_attention_for_cpu.default,)


def needs_autograd(example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo's graph needs gradients: grad mode is on and an input requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )


#: backward ops outside the core ATen decompositions whose decomposition (from PyTorch's full
#: table) is made of ops the card has rules for
_BACKWARD_DECOMPOSITIONS = (aten.max_pool2d_with_indices_backward.default,)


def training_decompositions() -> dict[Any, Callable]:
    """The core ATen decompositions and those of :data:`_BACKWARD_DECOMPOSITIONS`, less those
    that are right for inference only."""
    table = dict(core_decompositions())
    table.update(get_decompositions(list(_BACKWARD_DECOMPOSITIONS)))
    table.update(conv_grad.DECOMPOSITIONS)
    for op in _INFERENCE_ONLY_DECOMPOSITIONS:
        table.pop(op, None)
    return table


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` as PyTorch's math attention (matmuls and a softmax,
    which have rules and differentiate into ops that have rules) while a graph is traced."""
    with sdpa_kernel([SDPBackend.MATH]):
        yield


def compile_training(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    forward: GraphCompiler,
    backward: GraphCompiler,
) -> Callable:
    """Dynamo's graph ``gm`` as AOTAutograd's forward and backward graphs, compiled by
    ``forward`` and ``backward`` (the backend's compilers, each returning a boxed callable);
    outputs that are ``None`` or one of the graph's inputs are kept off the card."""
    with math_attention():
        return aot_module_simplified(
            gm,
            list(example_inputs),
            fw_compiler=SplitOutputs.compiler(forward),
            bw_compiler=SplitOutputs.compiler(backward),
            partition_fn=_partition,
            decompositions=training_decompositions(),
        )


def _partition(
    joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """AOTAutograd's min-cut partitioner; ``compiler="inductor"`` only says which ops it may
    recompute (pointwise ops, views, ...), which holds for the card's fused kernels too."""
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


class SplitOutputs:
    """The outputs of an AOTAutograd graph that the card does not compute, taken out of the
    graph: each output is ``("none", value)`` (``None`` or another non-node constant),
    ``("input", i)`` (the graph's ``i``-th placeholder, returned as it is) or ``("card", k)``
    (the compiled graph's ``k``-th result). An output node listed twice is computed once."""

    def __init__(self, gm: torch.fx.GraphModule):
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        outs = out.args[0]
        self.single = not isinstance(outs, list | tuple)
        outs = [outs] if self.single else list(outs)
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        placeholders = {n: i for i, n in enumerate(inputs)}
        card: dict[torch.fx.Node, int] = {}
        self.plan: list[tuple[str, Any]] = []
        for o in outs:
            if not isinstance(o, torch.fx.Node):
                self.plan.append(("none", o))
            elif o in placeholders:
                self.plan.append(("input", placeholders[o]))
            else:
                self.plan.append(("card", card.setdefault(o, len(card))))
        self.card_outputs = tuple(card)
        self.changed = len(card) != len(outs)
        if self.changed:
            out.args = (self.card_outputs,)
            gm.graph.lint()
            gm.recompile()

    @classmethod
    def compiler(cls, compile_graph: GraphCompiler) -> GraphCompiler:
        """``compile_graph`` for graphs whose outputs may be ``None`` or inputs."""

        def compile_split(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
            split = cls(gm)
            if not split.changed:
                return compile_graph(gm, example_inputs)
            run = compile_graph(gm, example_inputs) if split.card_outputs else None
            return split.boxed(run)

        return compile_split

    def boxed(self, run: Callable | None) -> Callable:
        """A boxed callable (AOTAutograd's convention: one list of arguments) that calls the
        compiled graph ``run`` (boxed too; None when the card computes no output) and puts the
        other outputs back in their places."""
        plan = self.plan
        inputs = [i for kind, i in plan if kind == "input"]

        def call(*args: Any) -> Any:
            kept = {i: args[i] for i in inputs}  # before ``run``, which may free its arguments
            res = run(list(args)) if run is not None else ()
            outs = [
                v if kind == "none" else kept[v] if kind == "input" else res[v] for kind, v in plan
            ]
            return outs[0] if self.single else outs

        return make_boxed_func(call)
