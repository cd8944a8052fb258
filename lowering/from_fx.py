"""Import a torch FX graph of core ATen ops into the graph IR: one registry from ATen op to rule.

The graph comes from AOTAutograd with the core ATen decompositions (``torch_bridge`` does that),
so every ``call_function`` node targets an ``OpOverload`` such as ``aten.addmm.default`` and
carries its output's fake tensor in ``node.meta["val"]``. The rules live in
``lowering.fx_elementwise``, ``lowering.fx_tensor``, ``lowering.fx_select``,
``lowering.fx_scatter``, ``lowering.fx_conv`` and ``lowering.fx_pool``, registered with
``@rule(aten.add.Tensor, ...)`` into :data:`RULES` (``lowering.fx_common``, re-exported here:
tests plant a bug by patching it). An op with no rule raises :class:`UnsupportedPrimitiveError`
naming it, with the node and the user's source line (from ``node.meta["stack_trace"]``); an
exception a rule raises is wrapped once in a :class:`~lowering.errors.LoweringRuleError`
carrying the same (as ``lowering.from_jaxpr`` does).
"""

from __future__ import annotations

import operator
import re
from typing import Any

import ml_dtypes
import numpy as np

from . import (
    fx_conv,
    fx_elementwise,
    fx_misc,
    fx_pool,
    fx_random,
    fx_scatter,
    fx_select,
    fx_tensor,
    torch_import,
)
from .builder import Builder, Lit
from .errors import PASS_THROUGH, LoweringError, UnsupportedPrimitiveError, rule_error
from .fx_common import RULES, WHEN, card_dtype, is_card_dtype, meta_val, rule
from .graph import Graph, Var
from .source import user_line
from .torch_import import torch

__all__ = ["from_fx", "RULES", "rule", "supported", "card_dtype", "node_source"]

#: the rule modules, imported for the rules they register into :data:`RULES`
RULE_MODULES = (
    fx_elementwise,
    fx_tensor,
    fx_select,
    fx_scatter,
    fx_conv,
    fx_pool,
    fx_random,
    fx_misc,
)


def supported(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a call this importer has a rule for, on dtypes the card has (an
    ``invoke_subgraph`` region: when every node of its subgraph is)."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return True
    if node.target is _INVOKE_SUBGRAPH:
        sub = _region(node)
        return sub is not None and all(supported(n) for n in sub.graph.nodes)
    if node.target in _CONTROL:
        return all(supported(n) for g in _control_graphs(node) for n in g.graph.nodes)
    if node.target not in RULES:
        return False
    when = WHEN.get(node.target)
    if when is not None and not when(node):
        return False
    vals = node.meta.get("val")
    for v in vals if isinstance(vals, list | tuple) else [vals]:
        if isinstance(v, torch.Tensor) and not is_card_dtype(v.dtype):
            return False
    return True


_FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+), in (?P<fn>.+)$')


def node_source(node: torch.fx.Node) -> str:
    """The user's line of a node, ``file.py:12 (fn)`` as the JAX importer writes it: the
    innermost frame of its recorded stack trace outside torch, the libraries and this project
    (else the innermost frame; ``""`` without a stack trace)."""
    st = node.meta.get("stack_trace") or ""
    frames = []
    for ln in st.strip().splitlines():
        m = _FRAME.search(ln.strip())
        if m:
            frames.append((m["file"], int(m["line"]), m["fn"].strip()))
    return user_line(reversed(frames))


# ---------------------------------------------------------------------------------------------
# the importer loop


def from_fx(gm: torch.fx.GraphModule, name: str = "fx") -> Graph:
    """Import an FX graph of core ATen ops (placeholders in order become the graph's inputs;
    ``get_attr`` tensors become constants) into a :class:`Graph`. A region compiled once and
    called many times (``torch.compiler.nested_compile_region``: an ``invoke_subgraph`` node)
    is imported at each call, its subgraph's placeholders bound to the call's operands."""
    b = Builder()
    inputs: list[Var] = []
    outputs = _import(b, gm, None, inputs)
    return Graph(name, tuple(inputs), tuple(b.nodes), tuple(outputs), tuple(b.consts))


#: the higher-order op of a region traced once and called at every use
_INVOKE_SUBGRAPH = getattr(torch.ops.higher_order, "invoke_subgraph", None)


def _region(node: torch.fx.Node) -> torch.fx.GraphModule | None:
    """The subgraph an ``invoke_subgraph`` node calls."""
    sub = node.args[0]
    if not isinstance(sub, torch.fx.Node) or sub.op != "get_attr":
        return None
    gm = _fetch_attr(sub.graph.owning_module, sub.target)
    return gm if isinstance(gm, torch.fx.GraphModule) else None


def _import(
    b: Builder, gm: torch.fx.GraphModule, operands: list[Any] | None, inputs: list[Var]
) -> list[Any]:
    """``gm``'s nodes into ``b``; its outputs. Placeholders become new graph inputs (appended
    to ``inputs``) or, for a region (``operands`` given), the call's operands."""
    env: dict[torch.fx.Node, Any] = {}
    outputs: list[Any] = []
    k = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if operands is not None:
                env[node] = operands[k]
                k += 1
                continue
            v = meta_val(node)
            if not isinstance(v, torch.Tensor):
                raise LoweringError(f"spyre: graph input {node.name} is not a tensor ({v!r})")
            var = Var(tuple(int(d) for d in v.shape), card_dtype(v.dtype, f"input {node.name}"))
            env[node] = var
            inputs.append(var)
        elif node.op == "get_attr":
            t = _fetch_attr(gm, node.target)
            env[node] = t if isinstance(t, torch.fx.GraphModule) else _const_of(b, t)
        elif node.op == "call_function" and node.target is _INVOKE_SUBGRAPH:
            sub = _region(node)
            if sub is None:
                raise LoweringError(f"spyre: a region without its subgraph ({node.format_node()})")
            ops = [env[a] if isinstance(a, torch.fx.Node) else a for a in node.args[2:]]
            env[node] = tuple(_import(b, sub, ops, inputs))
        elif node.op == "call_function":
            env[node] = _call(b, gm, node, env)
        elif node.op == "output":
            outs = node.args[0]
            for o in outs if isinstance(outs, list | tuple) else [outs]:
                val = env[o] if isinstance(o, torch.fx.Node) else o
                if operands is None and (isinstance(val, Lit) or not isinstance(val, Var)):
                    val = b.const(np.asarray(getattr(val, "value", val)))
                outputs.append(val)
        else:
            raise LoweringError(
                f"spyre: FX node kind {node.op} is not supported ({node.format_node()})"
            )
    return outputs


def _fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _const_of(b: Builder, t: torch.Tensor) -> Var:
    dt = card_dtype(t.dtype, "a constant")
    arr = t.detach().cpu()
    if arr.dtype == torch.bfloat16:
        host = arr.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        host = arr.numpy()
    if dt == "int32":
        host = host.astype(np.int32)
    return b.const(host, dt)


def _call(b: Builder, gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict) -> Any:
    if node.target is operator.getitem:
        seq, i = node.args
        return env[seq][i]
    fn = RULES.get(node.target)
    where = node_source(node)
    if fn is None:
        raise UnsupportedPrimitiveError(
            "ATen", str(node.target), node.format_node(), where, _context(gm, node)
        )
    args = torch.fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
    saved = b.source
    b.source = where
    try:
        return fn(b, node, *args, **kwargs)
    except PASS_THROUGH:
        raise
    except Exception as e:
        raise rule_error(
            "ATen", str(node.target), node.format_node(), where, e, _context(gm, node)
        ) from e
    finally:
        b.source = saved


def _context(gm: torch.fx.GraphModule, node: torch.fx.Node, radius: int = 2) -> str:
    nodes = list(gm.graph.nodes)
    i = nodes.index(node)
    out = []
    for k in range(max(0, i - radius), min(len(nodes), i + radius + 1)):
        mark = ">>" if k == i else "  "
        out.append(f"    {mark} {nodes[k].format_node()[:160]}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# control flow: torch.cond, while_loop and scan (higher-order ops) -> the graph IR's cond,
# while and scan, each subgraph imported as a graph of its own

_HOP = torch.ops.higher_order
_CONTROL = {getattr(_HOP, n) for n in ("cond", "while_loop", "scan") if hasattr(_HOP, n)}


def _control_graphs(node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    gms = []
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            g = _fetch_attr(a.graph.owning_module, a.target)
            if isinstance(g, torch.fx.GraphModule):
                gms.append(g)
    return gms


def _out_types(node: torch.fx.Node) -> list[tuple[tuple[int, ...], str]]:
    vals = meta_val(node)
    return [
        (tuple(int(d) for d in v.shape), card_dtype(v.dtype, f"a result of {node.target}"))
        for v in (vals if isinstance(vals, list | tuple) else [vals])
    ]


def _moved(g: Graph, n_first: int) -> Graph:
    """``g`` with its last inputs (from ``n_first`` on) moved to the front."""
    ins = g.inputs[n_first:] + g.inputs[:n_first]
    return Graph(g.name, ins, g.nodes, g.outputs, g.consts)


def _vars_of(b: Builder, xs: Any) -> list[Var]:
    return [x if isinstance(x, Var) else b.as_var(x) for x in xs]


def _cond_hop(b: Builder, node: torch.fx.Node, pred: Any, t: Any, f: Any, ops: Any) -> tuple:
    idx = b.emit("convert", [b.as_var(pred)], (), "int32", dtype="int32")
    branches = (from_fx(f, "branch0"), from_fx(t, "branch1"))  # index 0: false (as JAX's)
    return tuple(b.emit_many("cond", [idx, *_vars_of(b, ops)], _out_types(node), branches=branches))


def _while_hop(
    b: Builder, node: torch.fx.Node, cg: Any, bg: Any, carried: Any, extra: Any = ()
) -> tuple:
    n, extra = len(carried), _vars_of(b, extra)
    return tuple(
        b.emit_many(
            "while",
            [*extra, *extra, *_vars_of(b, carried)],
            _out_types(node),
            cond=_moved(from_fx(cg, "while_cond"), n),
            body=_moved(from_fx(bg, "while_body"), n),
            cond_nconsts=len(extra),
            body_nconsts=len(extra),
        )
    )


def _scan_hop(
    b: Builder, node: torch.fx.Node, fg: Any, init: Any, xs: Any, extra: Any = ()
) -> tuple:
    init, xs, extra = _vars_of(b, init), _vars_of(b, xs), _vars_of(b, extra)
    if not xs:
        raise LoweringError("spyre: a torch scan without inputs to scan over")
    body = _moved(from_fx(fg, "scan_body"), len(init) + len(xs))
    return tuple(
        b.emit_many(
            "scan",
            [*extra, *init, *xs],
            _out_types(node),
            body=body,
            length=xs[0].shape[0],
            num_consts=len(extra),
            num_carry=len(init),
        )
    )


for _name, _fn in (("cond", _cond_hop), ("while_loop", _while_hop), ("scan", _scan_hop)):
    if hasattr(_HOP, _name):
        RULES[getattr(_HOP, _name)] = _fn


torch_import.finish(__name__)  # see lowering.torch_import
