"""The frontend-neutral graph IR: a small op set both importers target.

A :class:`Graph` is a list of :class:`Node` s in topological order over :class:`Var` s. Ops:

* ``elementwise`` (param ``fn``: a name from ``device_model.ops.ELEMENTWISE``; scalar operands
  are immediates in ``scalars``), ``convert`` (``dtype``),
* ``broadcast`` (``shape``, ``dims``: jax's broadcast_in_dim), ``transpose`` (``perm``),
  ``slice`` (``starts``, ``limits``, ``strides``), ``reshape`` (``shape``), ``concatenate``
  (``axis``) — the layout and movement ops,
* ``reduce`` (``kind``: a ``device_model.ops.Reduce``; ``axes``),
* ``matmul``: ``[B, M, K] x [B, K, N] -> [B, M, N]``, fp32 accumulation, out ``dtype``; with
  ``rhs_t=True`` the rhs is given transposed, ``[B, N, K]`` (an NT GEMM: a torch Linear weight);
  after fusion, ``epilogue`` (a ``Fused``: a MapBody over ``[B, M, N]``, elementwise) applied
  to the product on its way out, the product its input ``slot`` (printed ``acc_slot``) and the
  node's inputs past the rhs the rest, and ``prologue`` (a ``Fused`` over ``[B, M, K]``) applied
  to the lhs on its way in, the lhs its input ``slot`` (printed ``lhs_slot``) and the node's
  last inputs the rest (after the epilogue's),
* ``gather``: rows of a table by int32 indices (``mode``: clip or fill),
* ``conv``: a 2-D convolution, channels-last ``[N, H, W, C]`` by ``[KH * KW, C, O]`` ->
  ``[N, OH * OW, O]`` (an implicit GEMM: :mod:`lowering.tile_conv`),
* ``sort``: the first ``k`` indices of a stable sort of each row of its keys ``[R, n]``
  (``descending``, ``order``), ``take_along``: each row's elements at int32 indices,
* ``map``: a fused SFU chain (made by the fusion pass; param ``body``: a MapBody),
* ``scan``, ``while``, ``cond``: control flow, each holding its body graphs (``lax.scan``,
  ``lax.while_loop``, ``lax.cond``/``lax.switch``); never inside a kernel, they are the
  host program's loops and branches (:mod:`lowering.control`).

Each op's parameters are a frozen, hashable dataclass (:mod:`lowering.op_params`; ``PARAMS``
maps an op to its class, :func:`register_op` adds one), which :func:`check_graph` validates
field by field, recursing into the graphs an op holds (``Params.subgraphs``). Every node keeps
the user's source line. Graphs are frozen and hashable-by-identity; the printer and
:func:`check_graph` are the two other consumers of the same structure.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from device_model.layout import check_dtype
from device_model.ops import ELEMENTWISE, REDUCTIONS, InputView, MapBody

from .op_params import PARAMS, GraphError, Map, Params

__all__ = [
    "Var",
    "Node",
    "Graph",
    "GraphError",
    "check_graph",
    "format_graph",
    "infer",
    "register_op",
    "unregister_op",
]

_ids = itertools.count()


@dataclass(frozen=True, slots=True, eq=False)
class Var:
    """A value: identity-hashed, with a shape and dtype."""

    shape: tuple[int, ...]
    dtype: str
    id: int = field(default_factory=lambda: next(_ids))

    def __repr__(self) -> str:
        return f"%{self.id}:{_ty(self)}"


def _ty(v: Var) -> str:
    short = {
        "float16": "f16",
        "bfloat16": "bf16",
        "float32": "f32",
        "int32": "i32",
        "uint32": "u32",
        "bool": "bool",
    }
    return f"{short.get(v.dtype, v.dtype)}[{','.join(map(str, v.shape))}]"


@dataclass(frozen=True, slots=True, eq=False)
class Node:
    """One op. ``params`` is an instance of the op's params class (:data:`PARAMS`)."""

    op: str
    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]
    params: Params
    source: str = ""

    @property
    def out(self) -> Var:
        return self.outputs[0]


@dataclass(frozen=True, slots=True, eq=False)
class Graph:
    name: str
    inputs: tuple[Var, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[Var, ...]
    consts: tuple[tuple[Var, np.ndarray], ...] = ()

    def __str__(self) -> str:
        return format_graph(self)


# ---------------------------------------------------------------------------------------------
# shape rules: op -> fn(node) -> list of (shape, dtype) for the outputs


def infer(node: Node) -> list[tuple[tuple[int, ...], str]]:
    """The output types an op gives for its inputs and params (raises GraphError if invalid)."""
    rule = _RULES.get(node.op)
    if rule is None:
        raise GraphError(f"unknown op {node.op!r}")
    return rule(node)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise GraphError(msg)


def _check_params(n: Node) -> None:
    cls = PARAMS.get(n.op)
    _need(cls is not None and n.op in _RULES, f"unknown op {n.op!r}")
    got = type(n.params).__name__
    _need(isinstance(n.params, cls), f"{n.op}: params are a {got}, not a {cls.__name__}")
    n.params.check(n.op)


def _r_elementwise(n: Node) -> list:
    fn = n.params.fn
    _need(fn in ELEMENTWISE, f"unknown elementwise fn {fn!r}")
    shapes = {v.shape for v in n.inputs}
    _need(len(shapes) <= 1, f"elementwise inputs differ in shape: {sorted(shapes)}")
    arity = ELEMENTWISE[fn][1]
    nargs = len(n.inputs) + len(n.params.scalars)
    _need(arity < 0 or nargs == arity, f"{fn} takes {arity} operands, got {nargs}")
    shape = n.params.shape
    if shape is None:
        shape = n.inputs[0].shape if n.inputs else ()
    _need(not n.inputs or n.inputs[0].shape == shape, "elementwise shape differs from inputs")
    return [(shape, n.params.dtype)]


def _r_convert(n: Node) -> list:
    return [(n.inputs[0].shape, n.params.dtype)]


def _r_broadcast(n: Node) -> list:
    (x,) = n.inputs
    shape, dims = n.params.shape, n.params.dims
    _need(len(dims) == len(x.shape), "broadcast dims do not match operand rank")
    for d, s in zip(dims, x.shape, strict=True):
        _need(s in (1, shape[d]), f"broadcast of dim size {s} to {shape[d]}")
    return [(tuple(shape), x.dtype)]


def _r_transpose(n: Node) -> list:
    (x,) = n.inputs
    perm = n.params.perm
    _need(sorted(perm) == list(range(len(x.shape))), f"bad permutation {perm}")
    return [(tuple(x.shape[p] for p in perm), x.dtype)]


def _r_slice(n: Node) -> list:
    (x,) = n.inputs
    st, li, sd = n.params.starts, n.params.limits, n.params.strides
    _need(len(st) == len(li) == len(sd) == len(x.shape), "slice params do not match rank")
    out = []
    for s, lim, d, size in zip(st, li, sd, x.shape, strict=True):
        _need(0 <= s <= lim <= size and d >= 1, f"slice {s}:{lim}:{d} out of range {size}")
        out.append(max(0, -(-(lim - s) // d)))
    return [(tuple(out), x.dtype)]


def _r_reshape(n: Node) -> list:
    (x,) = n.inputs
    shape = n.params.shape
    _need(math.prod(shape) == math.prod(x.shape), f"reshape {x.shape} -> {shape}")
    return [(shape, x.dtype)]


def _r_concat(n: Node) -> list:
    ax = n.params.axis
    first = n.inputs[0]
    total = 0
    for v in n.inputs:
        _need(len(v.shape) == len(first.shape), "concatenate of different ranks")
        _need(v.dtype == first.dtype, "concatenate of different dtypes")
        for d in range(len(v.shape)):
            _need(d == ax or v.shape[d] == first.shape[d], "concatenate shapes differ")
        total += v.shape[ax]
    shape = list(first.shape)
    shape[ax] = total
    return [(tuple(shape), first.dtype)]


def _r_reduce(n: Node) -> list:
    (x,) = n.inputs
    kind, axes = n.params.kind, n.params.axes
    _need(kind in REDUCTIONS, f"unknown reduction kind {kind!r}")
    red = REDUCTIONS[kind]
    _need(all(0 <= a < len(x.shape) for a in axes), f"reduce axes {axes} out of range")
    _need(not red.one_axis or len(axes) == 1, f"{kind} over one axis")
    if red.scan:
        return [(x.shape, x.dtype)]
    shape = tuple(s for i, s in enumerate(x.shape) if i not in axes)
    return [(shape, red.out_dtype(x.dtype))]


def matmul_inputs(n: Node) -> tuple[Var, Var, tuple[Var, ...], tuple[Var, ...]]:
    """A matmul node's inputs as (lhs, rhs, the epilogue's, the prologue's): the node's inputs
    are ``(lhs, rhs, *epilogue inputs, *prologue inputs)``, as many of the prologue's as its
    views less the lhs."""
    pro = n.params.prologue
    cut = len(n.inputs) - (len(pro.body.views) - 1 if pro is not None else 0)
    return n.inputs[0], n.inputs[1], tuple(n.inputs[2:cut]), tuple(n.inputs[cut:])


def _r_matmul(n: Node) -> list:
    _need(len(n.inputs) >= 2, "matmul takes lhs and rhs")
    a, b = n.inputs[:2]
    rhs_t = n.params.rhs_t
    form = "[B,M,K] x [B,N,K]" if rhs_t else "[B,M,K] x [B,K,N]"
    _need(len(a.shape) == 3 and len(b.shape) == 3, f"matmul takes {form}")
    kb, nb = (2, 1) if rhs_t else (1, 2)
    _need(
        a.shape[0] == b.shape[0] and a.shape[2] == b.shape[kb],
        f"matmul shapes {a.shape} x {b.shape} ({form})",
    )
    shape = (a.shape[0], a.shape[1], b.shape[nb])
    npro = 0
    if n.params.prologue is not None:
        # the prologue: an elementwise map over the lhs's shape; its input lhs_slot is the lhs
        # (read one-to-one), the others are the node's last inputs
        pro, lslot = n.params.prologue.body, n.params.prologue.slot
        npro = len(pro.views) - 1
        _need(len(n.inputs) - 2 >= npro, "matmul: fewer inputs than the prologue reads")
        _need(0 <= lslot <= npro, f"matmul: prologue lhs_slot {lslot} out of range")
        _need(pro.space == a.shape, f"matmul: prologue space {pro.space} is not the lhs's")
        _need(not pro.reduce and not pro.program_reduce_axes(), "matmul: the prologue reduces")
        _need(pro.views[lslot] == InputView.identity(3), "matmul: the prologue reads the lhs 1:1")
        ins = list(matmul_inputs(n)[3])
        ins.insert(lslot, a)
        lhs = Var(a.shape, pro.out_dtype, -1)  # what the PE multiplies (no id drawn)
        _r_map(Node("map", tuple(ins), (lhs,), Map(pro), n.source))
    return _with_epilogue(n, shape, npro)


def _with_epilogue(n: Node, shape: tuple[int, ...], npro: int = 0) -> list:
    """A matmul's or a convolution's output type: its product's ``shape`` in its dtype, or
    what its epilogue makes of it (an elementwise map over the product's shape; its input
    acc_slot is the product, read one-to-one, the others are the node's inputs past the rhs
    and before a prologue's)."""
    op = n.op
    if n.params.epilogue is None:
        _need(len(n.inputs) == 2 + npro, f"{op}: inputs past lhs and rhs need an epilogue")
        return [(shape, n.params.dtype)]
    ep, slot = n.params.epilogue.body, n.params.epilogue.slot
    _need(len(ep.views) == len(n.inputs) - 1 - npro, f"{op}: one epilogue view per input past rhs")
    _need(0 <= slot < len(ep.views), f"{op}: epilogue acc_slot {slot} out of range")
    _need(ep.space == shape, f"{op}: epilogue space {ep.space} is not the product's {shape}")
    _need(not ep.reduce and not ep.program_reduce_axes(), f"{op}: the epilogue reduces")
    _need(ep.views[slot] == InputView.identity(3), f"{op}: the epilogue reads the product 1:1")
    extras = list(matmul_inputs(n)[2])
    extras.insert(slot, Var(shape, n.params.dtype, -1))  # the product (no id drawn)
    _r_map(Node("map", tuple(extras), n.outputs, Map(ep), n.source))
    return [(shape, ep.out_dtype)]


def _r_gather(n: Node) -> list:
    table, idx = n.inputs
    _need(idx.dtype == "int32", "gather indices must be int32")
    _need(len(table.shape) == 2, "gather table must be 2-d")
    return [((*idx.shape, table.shape[1]), table.dtype)]


def _r_sort(n: Node) -> list:
    _need(len(n.inputs) >= 1, "sort: at least one key")
    shape = n.inputs[0].shape
    _need(len(shape) == 2, f"sort: keys must be 2-d [rows, n], not {list(shape)}")
    _need(all(v.shape == shape for v in n.inputs), "sort: keys differ in shape")
    _need(n.params.k <= shape[1], f"sort: k={n.params.k} exceeds the row length {shape[1]}")
    return [((shape[0], n.params.k), "int32")]


def _r_conv(n: Node) -> list:
    _need(len(n.inputs) >= 2, "conv: an input and a kernel")
    x, w = n.inputs[:2]
    p = n.params
    _need(len(x.shape) == 4, f"conv: the input must be [N, H, W, C], not {list(x.shape)}")
    taps = p.kernel[0] * p.kernel[1]
    _need(
        len(w.shape) == 3 and w.shape[:2] == (taps, x.shape[3]),
        f"conv: the kernel must be [{taps}, {x.shape[3]}, O], not {list(w.shape)}",
    )
    _need(x.dtype == w.dtype, f"conv: input {x.dtype} and kernel {w.dtype} differ")
    oh, ow = p.out_hw(*x.shape[1:3])
    _need(oh > 0 and ow > 0, f"conv: the kernel is larger than the padded input {x.shape}")
    return _with_epilogue(n, (x.shape[0], oh * ow, w.shape[2]))


def _r_take_along(n: Node) -> list:
    _need(len(n.inputs) == 2, "take_along: a tensor and its indices")
    x, idx = n.inputs
    _need(idx.dtype == "int32", "take_along: indices must be int32")
    _need(len(x.shape) == 2 and len(idx.shape) == 2, "take_along: 2-d [rows, n] operands")
    _need(x.shape[0] == idx.shape[0], "take_along: the operands differ in rows")
    _need(x.shape[1] > 0, "take_along: rows of 0 elements")
    return [(idx.shape, x.dtype)]


def _r_map(n: Node) -> list:
    body: MapBody = n.params.body
    _need(len(body.views) == len(n.inputs), "map: one view per input")
    for v, view in zip(n.inputs, body.views, strict=True):
        _need(len(view.dims) == len(v.shape), "map: view rank differs from input rank")
        for j, g in enumerate(view.dims):
            if g < 0 or view.bcast[j]:
                _need(0 <= view.starts[j] < max(v.shape[j], 1), "map: view index out of range")
                continue
            last = view.starts[j] + (body.space[g] - 1) * view.strides[j]
            _need(
                body.space[g] == 0 or last < v.shape[j],
                f"map: view of dim {j} reads past {v.shape[j]}",
            )
    shape = tuple(body.space[d] for d in body.out_space_dims())
    return [(shape, body.out_dtype)]


def _types(vs: tuple[Var, ...] | list[Var]) -> list[tuple[tuple[int, ...], str]]:
    return [(v.shape, v.dtype) for v in vs]


def _signature(what: str, got: list, want: list) -> None:
    _need(got == want, f"{what}: {_show(got)}, expected {_show(want)}")


def _show(ts: list) -> str:
    return "(" + ", ".join(f"{dt}{list(sh)}" for sh, dt in ts) + ")"


def _r_scan(n: Node) -> list:
    p = n.params
    nc, nk = p.num_consts, p.num_carry
    _need(len(n.inputs) >= nc + nk, "scan: fewer inputs than its consts and carry")
    consts, carry, xs = n.inputs[:nc], n.inputs[nc : nc + nk], n.inputs[nc + nk :]
    for x in xs:
        _need(x.shape[:1] == (p.length,), f"scan: stacked input {x!r} is not of length {p.length}")
    body = p.body
    want_in = _types(consts) + _types(carry) + [(x.shape[1:], x.dtype) for x in xs]
    _signature("scan: the body takes", _types(body.inputs), want_in)
    _need(len(body.outputs) >= nk, "scan: the body returns fewer values than the carry")
    _signature("scan: the body returns the carry as", _types(body.outputs[:nk]), _types(carry))
    ys = [((p.length, *v.shape), v.dtype) for v in body.outputs[nk:]]
    return _types(carry) + ys


def _r_while(n: Node) -> list:
    p = n.params
    cn, bn = p.cond_nconsts, p.body_nconsts
    _need(len(n.inputs) >= cn + bn, "while: fewer inputs than its consts")
    cconsts, bconsts, carry = n.inputs[:cn], n.inputs[cn : cn + bn], n.inputs[cn + bn :]
    _signature("while: the cond takes", _types(p.cond.inputs), _types(cconsts) + _types(carry))
    _signature("while: the cond returns", _types(p.cond.outputs), [((), "bool")])
    _signature("while: the body takes", _types(p.body.inputs), _types(bconsts) + _types(carry))
    _signature("while: the body returns", _types(p.body.outputs), _types(carry))
    return _types(carry)


def _r_cond(n: Node) -> list:
    _need(len(n.inputs) >= 1, "cond: no index")
    idx, ops = n.inputs[0], n.inputs[1:]
    _need(idx.shape == () and idx.dtype == "int32", f"cond: index {idx!r} is not an int32 scalar")
    first = n.params.branches[0]
    for i, g in enumerate(n.params.branches):
        _signature(f"cond: branch {i} takes", _types(g.inputs), _types(ops))
        _signature(f"cond: branch {i} returns", _types(g.outputs), _types(first.outputs))
    return _types(first.outputs)


def _r_update_slice(n: Node) -> list:
    x, upd, *starts = n.inputs
    st = n.params.starts
    _need(len(st) == len(x.shape), "update_slice: one start per dim")
    _need(len(starts) == sum(s is None for s in st), "update_slice: one input per traced start")
    _need(all(s.shape == () and s.dtype == "int32" for s in starts), "update_slice: int32 starts")
    _need(
        upd.dtype == x.dtype and len(upd.shape) == len(x.shape), "update_slice: the update's type"
    )
    _need(all(u <= d for u, d in zip(upd.shape, x.shape, strict=True)), "update_slice: too big")
    return [(x.shape, x.dtype)]


_RULES: dict[str, Callable[[Node], list]] = {
    "elementwise": _r_elementwise,
    "convert": _r_convert,
    "broadcast": _r_broadcast,
    "transpose": _r_transpose,
    "slice": _r_slice,
    "reshape": _r_reshape,
    "concatenate": _r_concat,
    "reduce": _r_reduce,
    "matmul": _r_matmul,
    "gather": _r_gather,
    "map": _r_map,
    "scan": _r_scan,
    "while": _r_while,
    "cond": _r_cond,
    "update_slice": _r_update_slice,
    "sort": _r_sort,
    "take_along": _r_take_along,
    "conv": _r_conv,
}


def register_op(op: str, params_cls: type[Params], rule: Callable[[Node], list]) -> None:
    """Add an op: its params class and its shape rule (``rule(node)``: the outputs' ``(shape,
    dtype)`` list, raising GraphError if invalid)."""
    _need(op not in PARAMS and op not in _RULES, f"op {op!r} is already registered")
    PARAMS[op] = params_cls
    _RULES[op] = rule


def unregister_op(op: str) -> None:
    PARAMS.pop(op, None)
    _RULES.pop(op, None)


def check_graph(g: Graph) -> None:
    """Every var defined once before use; every node's params are its op's class, well-formed;
    every node's output types follow from its inputs; every graph a node holds checks too."""
    defined: set[int] = set()
    for v in g.inputs:
        check_dtype(v.dtype, f"graph input {v!r}")
        defined.add(v.id)
    for v, arr in g.consts:
        _need(tuple(arr.shape) == v.shape, f"constant {v!r} has data of shape {arr.shape}")
        defined.add(v.id)
    for i, n in enumerate(g.nodes):
        try:
            for v in n.inputs:
                _need(v.id in defined, f"input {v!r} used before it is defined")
            _check_params(n)
            for k, sub in enumerate(n.params.subgraphs()):
                _need(isinstance(sub, Graph), f"{n.op}: subgraph {k} is not a Graph")
                try:
                    check_graph(sub)
                except GraphError as e:
                    raise GraphError(f"in subgraph {k} ({sub.name}): {e}") from None
            got = infer(n)
            _need(len(got) == len(n.outputs), "wrong number of outputs")
            for v, (shape, dt) in zip(n.outputs, got, strict=True):
                _need(
                    v.shape == tuple(shape) and v.dtype == dt,
                    f"output {v!r} but the op gives {dt}{list(shape)}",
                )
                check_dtype(v.dtype, f"output {v!r}")
                _need(v.id not in defined, f"{v!r} defined twice")
                defined.add(v.id)
        except (GraphError, TypeError) as e:
            raise GraphError(f"{e}\n  at node {i}:\n{_context(g, i)}") from None
    for v in g.outputs:
        _need(v.id in defined, f"graph output {v!r} is never defined")


def _context(g: Graph, i: int, radius: int = 2) -> str:
    lines = []
    for j in range(max(0, i - radius), min(len(g.nodes), i + radius + 1)):
        mark = ">>" if j == i else "  "
        lines.append(f"  {mark} {format_node(g.nodes[j])}")
    return "\n".join(lines)


def format_node(n: Node) -> str:
    outs = ", ".join(repr(v) for v in n.outputs)
    ins = ", ".join(f"%{v.id}" for v in n.inputs)
    ps = [f"{k}={v}" for k, v in n.params.items()]
    src = f"   # {n.source}" if n.source else ""
    return f"{outs} = {n.op}[{', '.join(ps)}]({ins}){src}"


def format_graph(g: Graph, indent: str = "") -> str:
    """``g``, readable; the graphs a node holds (a loop's body) printed below it, indented."""
    lines = [f"{indent}graph {g.name}(" + ", ".join(repr(v) for v in g.inputs) + ") {"]
    for v, _arr in g.consts:
        lines.append(f"{indent}  {v!r} = constant")
    for n in g.nodes:
        lines.append(f"{indent}  " + format_node(n))
        for sub in n.params.subgraphs():
            lines.append(format_graph(sub, indent + "    "))
    lines.append(f"{indent}  return " + ", ".join(f"%{v.id}" for v in g.outputs))
    lines.append(f"{indent}}}")
    return "\n".join(lines)
