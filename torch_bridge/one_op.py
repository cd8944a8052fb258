"""One ATen call as an FX graph of one node (the eager device's unit of compilation), and the
pieces of it the eager path shares: which operands a matmul reads transposed in place, and
the decompositions tried when the op itself has no lowering rule (``torch_bridge.eager``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._decomp import decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .graph_passes import core_decompositions

__all__ = ["NT_OPS", "DECOMPOSITIONS", "is_nt", "one_op_graph", "decomposed", "same_results"]

aten = torch.ops.aten


#: ops that read an operand given transposed (``x @ w.t()``, a Linear's weight) in place: the
#: kernel takes the operand's own bytes and a transpose the lowering folds into the matmul
#: (``lowering.matmul_passes.nt_matmul``), instead of a gather of it on every call; the timing
#: model charges the card's restickify of that product's cheaper form (``MatmulStep.nt_form``)
NT_OPS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default})


def is_nt(x: torch.Tensor) -> bool:
    """``x`` is the transpose of its last two dims of a contiguous tensor (not itself one)."""
    return x.dim() >= 2 and not x.is_contiguous() and x.transpose(-1, -2).is_contiguous()


def one_op_graph(
    op: Any,
    spec: Any,
    leaves: list,
    ph: list,
    out: Any,
    outs: list,
    nts: tuple[int, ...] = (),
    mode: Any = None,
) -> torch.fx.GraphModule:
    """The op as an FX graph of one node over placeholders; an input in ``nts`` is given as
    its transpose (contiguous) and transposed back in the graph."""
    g = torch.fx.Graph()
    env: list[Any] = []
    for i, (x, p) in enumerate(zip(leaves, ph, strict=True)):
        if p is None:
            env.append(x)
            continue
        n = g.placeholder(f"x{i}")
        n.meta["val"] = p
        if i in nts:
            with mode:
                n.meta["val"] = torch.empty_like(
                    p.transpose(-1, -2), memory_format=torch.contiguous_format
                )
                val = n.meta["val"].transpose(-1, -2)
            n = g.call_function(aten.transpose.int, (n, -1, -2))
            n.meta["val"] = val
        env.append(n)
    a, k = tree_unflatten(env, spec)
    node = g.call_function(op, tuple(a), dict(k))
    node.meta["val"] = out
    if isinstance(out, tuple | list):
        items = []
        for j, o in enumerate(outs):
            gi = g.call_function(operator.getitem, (node, j))
            gi.meta["val"] = o
            items.append(gi)
        g.output(tuple(items))
    else:
        g.output(node)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def same_results(gm: torch.fx.GraphModule, out: Any) -> bool:
    """Whether a decomposition's results have the op's shapes and dtypes. Not all of torch's
    do: ``_scaled_dot_product_flash_attention_for_cpu``'s second result is the attention
    weights, not the log-sum-exp the op returns."""
    want = list(out) if isinstance(out, tuple | list) else [out]
    got = tree_flatten(next(n for n in gm.graph.nodes if n.op == "output").args)[0]
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else n for n in got]
    return len(vals) == len(want) and all(
        isinstance(v, torch.Tensor) and v.shape == w.shape and v.dtype == w.dtype
        for v, w in zip(vals, want, strict=True)
    )


#: decompositions beside core ATen's (:func:`decomposed`): our own ops' (set by their owners)
#: and the interpolations core ATen keeps whole (compiled graphs meet their ``.vec`` forms)
DECOMPOSITIONS: dict[Any, Any] = {
    op: decomposition_table[op]
    for op in (
        aten.upsample_bilinear2d.default,
        aten.upsample_bicubic2d.default,
        aten.upsample_trilinear3d.default,
    )
}


def decomposed(op: Any, spec: Any, orig: list, inputs: list) -> torch.fx.GraphModule:
    idx = [i for i, *_ in inputs]

    def f(*ts: torch.Tensor) -> Any:
        vals = list(orig)
        for i, t in zip(idx, ts, strict=True):
            vals[i] = t
        a, k = tree_unflatten(vals, spec)
        return op(*a, **k)

    table = {**core_decompositions(), **DECOMPOSITIONS}
    return make_fx(f, decomposition_table=table, tracing_mode="real")(*[orig[i] for i in idx])
