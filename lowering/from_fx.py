"""Import a torch FX graph of core ATen ops into the graph IR: one registry from ATen op to rule.

The graph comes from AOTAutograd with the core ATen decompositions (``torch_bridge`` does that),
so every ``call_function`` node targets an ``OpOverload`` such as ``aten.addmm.default`` and
carries its output's fake tensor in ``node.meta["val"]``. Rules are registered with
``@rule(aten.add.Tensor, ...)`` next to their bodies; a rule gets the builder, the node and its
arguments (``Var`` for tensors, Python values otherwise) and returns a ``Var`` (or a tuple of
them for multi-output ops). An op with no rule raises :class:`UnsupportedPrimitiveError` naming
it, with the node and the user's source line (from ``node.meta["stack_trace"]``).

Dtypes follow the card: float16, bfloat16, float32, int32 (int64 indices are narrowed) and bool.
Tensor-tensor ops compute in the dtype torch would promote to (the output's, from the fake
tensor; for comparisons, the promoted input dtype).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.fx

from device_model.layout import SUPPORTED_DTYPES

from .builder import Builder, Lit
from .errors import LoweringError, UnsupportedPrimitiveError
from .graph import Graph, Var

__all__ = ["from_fx", "RULES", "rule", "supported", "card_dtype", "node_source"]

aten = torch.ops.aten

_TORCH_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.int32: "int32",
    torch.int64: "int32",  # indices: narrowed, as the JAX frontend does
    torch.bool: "bool",
}


def card_dtype(dt: torch.dtype, what: str = "a tensor") -> str:
    """The card's dtype for a torch dtype; TypeError naming it and the supported ones."""
    name = _TORCH_DTYPES.get(dt)
    if name is None:
        raise TypeError(
            f"spyre: {what} has dtype {dt}, which the card does not support; supported dtypes: "
            f"{', '.join(SUPPORTED_DTYPES)} (int64 is narrowed to int32)"
        )
    return name


Rule = Callable[..., Any]
RULES: dict[Any, Rule] = {}

#: TEST-ONLY switch: the name of a unary elementwise fn (e.g. "tanh") whose rule then computes
#: ``1.01 * fn(x)`` -- a planted lowering bug, to show that the differential tests catch one
_PLANTED_BUG: str | None = None


def rule(*ops: Any) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return deco


def supported(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a call this importer has a rule for, on dtypes the card has."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return True
    if node.target not in RULES:
        return False
    vals = node.meta.get("val")
    for v in vals if isinstance(vals, list | tuple) else [vals]:
        if isinstance(v, torch.Tensor) and v.dtype not in _TORCH_DTYPES:
            return False
    return True


def node_source(node: torch.fx.Node) -> str:
    """The user's line of a node: the last frame of its recorded stack trace outside torch."""
    st = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip().startswith("File ")]
    for ln in reversed(lines):
        if "/torch/" not in ln and "/transformers/" not in ln:
            return ln
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------------------------
# the importer loop


def from_fx(gm: torch.fx.GraphModule, name: str = "fx") -> Graph:
    """Import an FX graph of core ATen ops (placeholders in order become the graph's inputs;
    ``get_attr`` tensors become constants) into a :class:`Graph`."""
    b = Builder()
    env: dict[torch.fx.Node, Any] = {}
    inputs: list[Var] = []
    outputs: list[Var] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = _meta_val(node)
            if not isinstance(v, torch.Tensor):
                raise LoweringError(f"spyre: graph input {node.name} is not a tensor ({v!r})")
            var = Var(tuple(int(d) for d in v.shape), card_dtype(v.dtype, f"input {node.name}"))
            env[node] = var
            inputs.append(var)
        elif node.op == "get_attr":
            t = _fetch_attr(gm, node.target)
            env[node] = _const_of(b, t)
        elif node.op == "call_function":
            env[node] = _call(b, gm, node, env)
        elif node.op == "output":
            outs = node.args[0]
            for o in outs if isinstance(outs, list | tuple) else [outs]:
                val = env[o] if isinstance(o, torch.fx.Node) else o
                if isinstance(val, Lit) or not isinstance(val, Var):
                    val = b.const(np.asarray(getattr(val, "value", val)))
                outputs.append(val)
        else:
            raise LoweringError(
                f"spyre: FX node kind {node.op} is not supported ({node.format_node()})"
            )
    return Graph(name, tuple(inputs), tuple(b.nodes), tuple(outputs), tuple(b.consts))


def _fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _const_of(b: Builder, t: torch.Tensor) -> Var:
    dt = card_dtype(t.dtype, "a constant")
    arr = t.detach().cpu()
    if arr.dtype == torch.bfloat16:
        import ml_dtypes

        host = arr.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        host = arr.numpy()
    if dt == "int32":
        host = host.astype(np.int32)
    return b.const(host, dt)


def _meta_val(node: torch.fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


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
    except (LoweringError, TypeError) as e:
        if "spyre" in str(e) and "at:" in str(e):
            raise
        raise type(e)(f"{e}\n  node: {node.format_node()}\n  at: {where}") from e
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
# helpers


def _out(node: torch.fx.Node) -> tuple[tuple[int, ...], str]:
    v = _meta_val(node)
    if isinstance(v, list | tuple):
        v = v[0]
    return tuple(int(d) for d in v.shape), card_dtype(v.dtype, f"the result of {node.target}")


def _dt(x: Any) -> str | None:
    return x.dtype if isinstance(x, Var) else None


def _promote(*xs: Any) -> str:
    """torch's promotion of tensor operands (Python scalars do not promote float tensors)."""
    ts = [x for x in xs if isinstance(x, Var)]
    if not ts:
        return "float32"
    order = {"bool": 0, "int32": 1, "float16": 2, "bfloat16": 2, "float32": 3}
    dts = {t.dtype for t in ts}
    if dts == {"float16", "bfloat16"}:
        return "float32"
    best = max(dts, key=lambda d: order[d])
    if order[best] <= 1 and any(isinstance(x, float) for x in xs):
        return "float32"
    return best


def _convert(b: Builder, x: Var, dt: str) -> Var:
    if x.dtype == dt:
        return x
    return b.emit("convert", [x], x.shape, dt, dtype=dt)


def _bcast(b: Builder, x: Var, shape: tuple[int, ...]) -> Var:
    """NumPy/torch broadcasting of ``x`` to ``shape`` (trailing dims aligned)."""
    shape = tuple(shape)
    if x.shape == shape:
        return x
    r, R = len(x.shape), len(shape)
    if r > R:
        raise LoweringError(f"spyre: cannot broadcast {x.shape} to {shape}")
    dims = tuple(range(R - r, R))
    for d, s in zip(dims, x.shape, strict=True):
        if s not in (1, shape[d]):
            raise LoweringError(f"spyre: cannot broadcast {x.shape} to {shape}")
    return b.emit("broadcast", [x], shape, x.dtype, shape=shape, dims=dims)


def _operand(b: Builder, x: Any, shape: tuple[int, ...], dt: str) -> Var | Lit:
    if isinstance(x, Var):
        return _bcast(b, _convert(b, x, dt), shape)
    if isinstance(x, bool | int | float):
        return Lit(x, dt)
    raise LoweringError(f"spyre: unsupported operand {x!r}")


def _ew(
    b: Builder,
    node: torch.fx.Node,
    fn: str,
    *xs: Any,
    compute: str | None = None,
    param: Any = None,
) -> Var:
    """An elementwise op in torch's semantics: broadcast, promote, compute, cast to the result."""
    shape, out_dt = _out(node)
    cdt = compute or _promote(*xs)
    ops = [_operand(b, x, shape, cdt) for x in xs]
    if all(isinstance(o, Lit) for o in ops):
        v = b.elementwise(fn, ops, shape, cdt, param=param)
    else:
        v = b.elementwise(fn, ops, shape, cdt if fn not in _CMP else "bool", param=param)
    return _convert(b, v, out_dt)


_CMP = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _dims(ds: Any, rank: int) -> tuple[int, ...]:
    """Reduction dims; None or an empty list means all of them, as in ATen."""
    if ds is None or (isinstance(ds, list | tuple) and len(ds) == 0):
        return tuple(range(rank))
    if isinstance(ds, int):
        ds = [ds]
    return tuple(sorted({_dim(int(d), rank) for d in ds}))


# ---------------------------------------------------------------------------------------------
# rules: elementwise

_UNARY = {
    aten.neg.default: "neg",
    aten.abs.default: "abs",
    aten.sign.default: "sign",
    aten.floor.default: "floor",
    aten.ceil.default: "ceil",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.tanh.default: "tanh",
    aten.sigmoid.default: "logistic",
    aten.erf.default: "erf",
    aten.sin.default: "sin",
    aten.cos.default: "cos",
    aten.logical_not.default: "not",
    aten.bitwise_not.default: "not",
}
for _op, _fn in _UNARY.items():

    def _u(b: Builder, node: torch.fx.Node, x: Var, _fn: str = _fn) -> Var:
        if _fn == "not":
            if _out(node)[1] == "int32":  # bitwise not on integers
                return _ew(b, node, "not", x, compute="int32")
            return _ew(b, node, "not", _convert(b, x, "bool"), compute="bool")
        shape, out_dt = _out(node)
        cdt = out_dt if out_dt != "bool" else "float32"
        r = _ew(b, node, _fn, _convert(b, x, cdt), compute=cdt)
        if _PLANTED_BUG == _fn:
            r = b.elementwise("mul", [r, Lit(1.01, r.dtype)], r.shape, r.dtype)
        return r

    RULES[_op] = _u

_BINARY = {
    aten.add.Tensor: "add",
    aten.add.Scalar: "add",
    aten.sub.Tensor: "sub",
    aten.sub.Scalar: "sub",
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
    aten.maximum.default: "max",
    aten.minimum.default: "min",
    aten.pow.Tensor_Tensor: "pow",
    aten.logical_and.default: "and",
    aten.logical_or.default: "or",
    aten.logical_xor.default: "xor",
    aten.bitwise_and.Tensor: "and",
    aten.bitwise_or.Tensor: "or",
    aten.bitwise_and.Scalar: "and",
    aten.bitwise_or.Scalar: "or",
    aten.bitwise_xor.Tensor: "xor",
    aten.bitwise_xor.Scalar: "xor",
    aten.eq.Tensor: "eq",
    aten.eq.Scalar: "eq",
    aten.ne.Tensor: "ne",
    aten.ne.Scalar: "ne",
    aten.lt.Tensor: "lt",
    aten.lt.Scalar: "lt",
    aten.le.Tensor: "le",
    aten.le.Scalar: "le",
    aten.gt.Tensor: "gt",
    aten.gt.Scalar: "gt",
    aten.ge.Tensor: "ge",
    aten.ge.Scalar: "ge",
}
for _op, _fn in _BINARY.items():

    def _bin(
        b: Builder,
        node: torch.fx.Node,
        x: Any,
        y: Any,
        *,
        alpha: Any = None,
        rounding_mode: Any = None,
        _fn: str = _fn,
    ) -> Var:
        if rounding_mode is not None:
            raise LoweringError(f"spyre: div with rounding_mode={rounding_mode!r}")
        if _fn in ("and", "or", "xor"):
            shape, out_dt = _out(node)
            if out_dt == "int32":  # bitwise on integers
                return _ew(b, node, _fn, x, y, compute="int32")
            return _ew(b, node, _fn, *(_to_bool(b, v) for v in (x, y)), compute="bool")
        if alpha is not None and alpha != 1:
            shape, _ = _out(node)
            y = _ew_raw(b, "mul", [y, alpha], shape, _promote(x, y))
        if _fn == "div":  # true division: integer operands divide as floats
            shape, out_dt = _out(node)
            return _ew(b, node, "div", x, y, compute=out_dt)
        return _ew(b, node, _fn, x, y)

    RULES[_op] = _bin


def _to_bool(b: Builder, v: Any) -> Any:
    return _convert(b, v, "bool") if isinstance(v, Var) else bool(v)


def _ew_raw(b: Builder, fn: str, xs: list[Any], shape: tuple[int, ...], dt: str) -> Var:
    ops = [_operand(b, x, shape, dt) for x in xs]
    return b.elementwise(fn, ops, shape, dt)


@rule(aten.remainder.Tensor, aten.remainder.Scalar)
def _remainder(b: Builder, node: torch.fx.Node, x: Any, y: Any) -> Var:
    """torch's remainder takes the divisor's sign (Python ``%``), not the dividend's (fmod)."""
    shape, dt = _out(node)
    cdt = _promote(x, y)
    r = _ew_raw(b, "rem", [x, y], shape, cdt)
    yv = _operand(b, y, shape, cdt)
    zero = Lit(0, cdt)
    rneg = b.elementwise("lt", [r, zero], shape, "bool")
    yneg = b.elementwise("lt", [yv, zero], shape, "bool") if isinstance(yv, Var) else None
    nz = b.elementwise("ne", [r, zero], shape, "bool")
    if yneg is None:  # a scalar divisor: its sign is known now
        fix = rneg if float(y) > 0 else b.elementwise("not", [rneg], shape, "bool")
    else:
        fix = b.elementwise("xor", [rneg, yneg], shape, "bool")
    fix = b.elementwise("and", [fix, nz], shape, "bool")
    shifted = b.elementwise("add", [r, yv], shape, cdt)
    return _convert(b, b.elementwise("select_n", [fix, r, shifted], shape, cdt), dt)


@rule(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(b: Builder, node: torch.fx.Node, x: Any, y: Any, alpha: Any = 1) -> Var:
    shape, _ = _out(node)
    if alpha != 1:
        x = _ew_raw(b, "mul", [x, alpha], shape, _promote(x, y))
    return _ew(b, node, "sub", y, x)


@rule(aten.round.default)
def _round(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    shape, dt = _out(node)
    return b.elementwise("round", [x], shape, dt, param=1)  # half to even, as torch rounds


@rule(aten.tril.default, aten.triu.default)
def _tril(b: Builder, node: torch.fx.Node, x: Var, diagonal: int = 0) -> Var:
    """Keep ``col - row <= diagonal`` (tril) or ``>= diagonal`` (triu) of the last two dims."""
    shape, dt = _out(node)
    r, c = shape[-2], shape[-1]
    d = np.arange(c)[None, :] - np.arange(r)[:, None]
    keep = d <= diagonal if node.target is aten.tril.default else d >= diagonal
    mask = _bcast(b, b.const(keep, "bool"), shape)
    zero = Lit(False if dt == "bool" else 0, dt)
    return b.elementwise("select_n", [mask, zero, x], shape, dt)


@rule(aten.pow.Tensor_Scalar)
def _pow(b: Builder, node: torch.fx.Node, x: Var, e: Any) -> Var:
    shape, out_dt = _out(node)
    if float(e) == int(e) and abs(int(e)) <= 16:
        return _ew(b, node, "integer_pow", _convert(b, x, out_dt), compute=out_dt, param=int(e))
    return _ew(b, node, "pow", _convert(b, x, out_dt), float(e), compute=out_dt)


@rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(b: Builder, node: torch.fx.Node, c: Any, x: Any, y: Any) -> Var:
    shape, out_dt = _out(node)
    pred = _bcast(b, _convert(b, c, "bool"), shape)
    xs = [_operand(b, v, shape, out_dt) for v in (y, x)]  # select_n: case 0 if false
    return b.elementwise("select_n", [pred, *xs], shape, out_dt)


@rule(aten.clamp.default)
def _clamp(b: Builder, node: torch.fx.Node, x: Var, lo: Any = None, hi: Any = None) -> Var:
    shape, out_dt = _out(node)
    v = _convert(b, x, out_dt)
    if lo is not None:
        v = _ew_raw(b, "max", [v, lo], shape, out_dt)
    if hi is not None:
        v = _ew_raw(b, "min", [v, hi], shape, out_dt)
    return v


@rule(aten.gelu.default)
def _gelu(b: Builder, node: torch.fx.Node, x: Var, approximate: str = "none") -> Var:
    shape, dt = _out(node)
    if approximate == "tanh":
        x3 = b.elementwise("integer_pow", [x], shape, dt, param=3)
        inner = _ew_raw(b, "add", [x, _ew_raw(b, "mul", [x3, 0.044715], shape, dt)], shape, dt)
        t = b.elementwise(
            "tanh", [_ew_raw(b, "mul", [inner, math.sqrt(2 / math.pi)], shape, dt)], shape, dt
        )
        return _ew_raw(
            b,
            "mul",
            [_ew_raw(b, "mul", [x, 0.5], shape, dt), _ew_raw(b, "add", [t, 1.0], shape, dt)],
            shape,
            dt,
        )
    e = b.elementwise("erf", [_ew_raw(b, "mul", [x, 1 / math.sqrt(2)], shape, dt)], shape, dt)
    return _ew_raw(
        b,
        "mul",
        [_ew_raw(b, "mul", [x, 0.5], shape, dt), _ew_raw(b, "add", [e, 1.0], shape, dt)],
        shape,
        dt,
    )


@rule(aten.relu.default)
def _relu(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    shape, dt = _out(node)
    return b.elementwise("max", [x, Lit(0, dt)], shape, dt)


@rule(aten.leaky_relu.default)
def _leaky_relu(b: Builder, node: torch.fx.Node, x: Var, slope: float = 0.01) -> Var:
    shape, dt = _out(node)
    neg = b.elementwise("lt", [x, Lit(0, dt)], shape, "bool")
    return b.elementwise("select_n", [neg, x, _ew_raw(b, "mul", [x, slope], shape, dt)], shape, dt)


@rule(aten.silu.default)
def _silu(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    shape, dt = _out(node)
    return _ew_raw(b, "mul", [x, b.elementwise("logistic", [x], shape, dt)], shape, dt)


@rule(
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.lift_fresh_copy.default,
    aten.detach.default,
    aten.contiguous.default,
)
def _copy(b: Builder, node: torch.fx.Node, x: Any, **kw: Any) -> Var:
    shape, dt = _out(node)
    if not isinstance(x, Var):
        return b.const(np.asarray(x), dt)
    return _convert(b, x, dt)


# ---------------------------------------------------------------------------------------------
# rules: creation


@rule(aten.full.default)
def _full(b: Builder, node: torch.fx.Node, size: Any, value: Any, **kw: Any) -> Var:
    shape, dt = _out(node)
    return b.const(np.full(shape, value), dt)


@rule(aten.full_like.default)
def _full_like(b: Builder, node: torch.fx.Node, x: Any, value: Any, **kw: Any) -> Var:
    shape, dt = _out(node)
    return b.const(np.full(shape, value), dt)


@rule(aten.zeros_like.default, aten.ones_like.default)
def _zeros_like(b: Builder, node: torch.fx.Node, x: Any, **kw: Any) -> Var:
    shape, dt = _out(node)
    return b.const(np.full(shape, 1 if node.target is aten.ones_like.default else 0), dt)


@rule(aten.scalar_tensor.default)
def _scalar_tensor(b: Builder, node: torch.fx.Node, value: Any, **kw: Any) -> Var:
    shape, dt = _out(node)
    return b.const(np.asarray(value), dt)


@rule(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(b: Builder, node: torch.fx.Node, *a: Any, **kw: Any) -> Var:
    shape, dt = _out(node)
    nums = [x for x in a if isinstance(x, int | float)]
    if len(nums) == 1:
        start, step = 0, 1
    else:
        start = nums[0]
        step = nums[2] if len(nums) > 2 else 1
    return b.const(start + step * np.arange(shape[0]), dt)


# ---------------------------------------------------------------------------------------------
# rules: layout and movement


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(b: Builder, node: torch.fx.Node, x: Var, size: Any) -> Var:
    shape, _ = _out(node)
    return b.reshape(x, shape)


@rule(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(b: Builder, node: torch.fx.Node, x: Var, *a: Any) -> Var:
    shape, _ = _out(node)
    return b.reshape(x, shape)


@rule(aten.permute.default)
def _permute(b: Builder, node: torch.fx.Node, x: Var, dims: Any) -> Var:
    return b.transpose(x, tuple(_dim(int(d), len(x.shape)) for d in dims))


@rule(aten.t.default)
def _t(b: Builder, node: torch.fx.Node, x: Var) -> Var:
    return b.transpose(x, (1, 0)) if len(x.shape) == 2 else x


@rule(aten.transpose.int)
def _transpose(b: Builder, node: torch.fx.Node, x: Var, d0: int, d1: int) -> Var:
    r = len(x.shape)
    perm = list(range(r))
    d0, d1 = _dim(d0, r), _dim(d1, r)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return b.transpose(x, tuple(perm))


@rule(aten.expand.default)
def _expand(b: Builder, node: torch.fx.Node, x: Var, size: Any, **kw: Any) -> Var:
    shape, _ = _out(node)
    return _bcast(b, x, shape)


def _slice_dim(b: Builder, x: Var, dim: int, start: int, end: int, step: int = 1) -> Var:
    r = len(x.shape)
    n = x.shape[dim]
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(start, min(n, end + n if end < 0 else end))
    if start == 0 and end == n and step == 1:
        return x
    st = [0] * r
    li = list(x.shape)
    sd = [1] * r
    st[dim], li[dim], sd[dim] = start, end, step
    shape = list(x.shape)
    shape[dim] = max(0, -(-(end - start) // step))
    return b.emit(
        "slice", [x], tuple(shape), x.dtype, starts=tuple(st), limits=tuple(li), strides=tuple(sd)
    )


@rule(aten.slice.Tensor)
def _slice(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    dim: int = 0,
    start: Any = None,
    end: Any = None,
    step: int = 1,
) -> Var:
    d = _dim(dim, len(x.shape))
    n = x.shape[d]
    return _slice_dim(
        b,
        x,
        d,
        0 if start is None else int(start),
        n if end is None else min(int(end), n),
        int(step),
    )


@rule(aten.select.int)
def _select(b: Builder, node: torch.fx.Node, x: Var, dim: int, index: int) -> Var:
    d = _dim(dim, len(x.shape))
    i = index + x.shape[d] if index < 0 else index
    shape, _ = _out(node)
    return b.reshape(_slice_dim(b, x, d, i, i + 1), shape)


@rule(aten.split_with_sizes.default, aten.split.Tensor)
def _split(b: Builder, node: torch.fx.Node, x: Var, sizes: Any, dim: int = 0) -> tuple:
    d = _dim(dim, len(x.shape))
    n = x.shape[d]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
    outs, start = [], 0
    for s in sizes:
        outs.append(_slice_dim(b, x, d, start, start + int(s)))
        start += int(s)
    return tuple(outs)


@rule(aten.cat.default)
def _cat(b: Builder, node: torch.fx.Node, xs: Any, dim: int = 0) -> Var:
    shape, dt = _out(node)
    vs = [_convert(b, x, dt) for x in xs if isinstance(x, Var) and math.prod(x.shape) > 0]
    if len(vs) == 1:
        return vs[0]
    d = _dim(dim, len(shape))
    return b.emit("concatenate", vs, shape, dt, axis=d)


# ---------------------------------------------------------------------------------------------
# rules: reductions


def _reduce(b: Builder, x: Var, kind: str, axes: tuple[int, ...], keep: bool, dt: str) -> Var:
    if not axes:
        return _convert(b, x, dt)
    shape = tuple(s for i, s in enumerate(x.shape) if i not in axes)
    r = b.emit("reduce", [x], shape, dt, kind=kind, axes=axes)
    if keep:
        r = b.reshape(r, tuple(1 if i in axes else s for i, s in enumerate(x.shape)))
    return r


@rule(aten.sum.dim_IntList, aten.sum.default)
def _sum(
    b: Builder, node: torch.fx.Node, x: Var, dims: Any = None, keepdim: bool = False, **kw: Any
) -> Var:
    _, dt = _out(node)
    return _reduce(b, _convert(b, x, dt), "sum", _dims(dims, len(x.shape)), keepdim, dt)


@rule(aten.mean.dim, aten.mean.default)
def _mean(
    b: Builder, node: torch.fx.Node, x: Var, dims: Any = None, keepdim: bool = False, **kw: Any
) -> Var:
    shape, dt = _out(node)
    axes = _dims(dims, len(x.shape))
    s = _reduce(b, _convert(b, x, dt), "sum", axes, keepdim, dt)
    n = math.prod(x.shape[a] for a in axes)
    return b.elementwise("div", [s, Lit(float(n), dt)], s.shape, dt)


@rule(aten.amax.default, aten.amin.default)
def _amax(b: Builder, node: torch.fx.Node, x: Var, dims: Any = (), keepdim: bool = False) -> Var:
    _, dt = _out(node)
    kind = "max" if node.target is aten.amax.default else "min"
    return _reduce(b, x, kind, _dims(dims or None, len(x.shape)), keepdim, dt)


@rule(aten.max.dim, aten.min.dim)
def _max_dim(b: Builder, node: torch.fx.Node, x: Var, dim: int, keepdim: bool = False) -> tuple:
    d = _dim(dim, len(x.shape))
    big = node.target is aten.max.dim
    v = _reduce(b, x, "max" if big else "min", (d,), keepdim, x.dtype)
    i = _reduce(b, x, "argmax" if big else "argmin", (d,), keepdim, "int32")
    return (v, i)


@rule(aten.argmax.default, aten.argmin.default)
def _argmax(b: Builder, node: torch.fx.Node, x: Var, dim: Any = None, keepdim: bool = False) -> Var:
    kind = "argmax" if node.target is aten.argmax.default else "argmin"
    if dim is None:
        x = b.reshape(x, (math.prod(x.shape),))
        dim = 0
    return _reduce(b, x, kind, (_dim(dim, len(x.shape)),), keepdim, "int32")


@rule(aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim, aten.all.default)
def _any(b: Builder, node: torch.fx.Node, x: Var, dim: Any = None, keepdim: bool = False) -> Var:
    is_any = node.target in (aten.any.dim, aten.any.dims, aten.any.default)
    v = _convert(b, _convert(b, x, "bool"), "int32")
    r = _reduce(b, v, "max" if is_any else "min", _dims(dim, len(x.shape)), keepdim, "int32")
    return _convert(b, r, "bool")


@rule(aten.cumsum.default)
def _cumsum(b: Builder, node: torch.fx.Node, x: Var, dim: int, **kw: Any) -> Var:
    shape, dt = _out(node)
    return b.emit(
        "reduce", [_convert(b, x, dt)], shape, dt, kind="cumsum", axes=(_dim(dim, len(x.shape)),)
    )


@rule(aten.var.correction, aten.var.dim)
def _var(
    b: Builder,
    node: torch.fx.Node,
    x: Var,
    dims: Any = None,
    *a: Any,
    correction: Any = None,
    keepdim: bool = False,
    unbiased: Any = None,
) -> Var:
    shape, dt = _out(node)
    if a and isinstance(a[0], bool):  # var.dim(x, dims, unbiased, keepdim)
        unbiased = a[0]
        keepdim = a[1] if len(a) > 1 else keepdim
    corr = correction if correction is not None else (1 if unbiased in (None, True) else 0)
    axes = _dims(dims, len(x.shape))
    n = math.prod(x.shape[i] for i in axes)
    xv = _convert(b, x, dt)
    m = _reduce(b, xv, "sum", axes, True, dt)
    m = b.elementwise("div", [m, Lit(float(n), dt)], m.shape, dt)
    dlt = _ew_raw(b, "sub", [xv, _bcast(b, m, xv.shape)], xv.shape, dt)
    sq = b.elementwise("mul", [dlt, dlt], xv.shape, dt)
    s = _reduce(b, sq, "sum", axes, keepdim, dt)
    return b.elementwise("div", [s, Lit(float(max(n - corr, 0)), dt)], s.shape, dt)


@rule(aten._softmax.default, aten._log_softmax.default)
def _softmax(b: Builder, node: torch.fx.Node, x: Var, dim: int, half_to_float: bool) -> Var:
    shape, dt = _out(node)
    d = _dim(dim, len(x.shape))
    cdt = "float32" if x.dtype != "float32" else dt
    xv = _convert(b, x, cdt)
    m = _bcast(b, _reduce(b, xv, "max", (d,), True, cdt), shape)
    z = b.elementwise("sub", [xv, m], shape, cdt)
    e = b.elementwise("exp", [z], shape, cdt)
    s = _bcast(b, _reduce(b, e, "sum", (d,), True, cdt), shape)
    if node.target is aten._log_softmax.default:
        r = b.elementwise("sub", [z, b.elementwise("log", [s], shape, cdt)], shape, cdt)
    else:
        r = b.elementwise("div", [e, s], shape, cdt)
    return _convert(b, r, dt)


@rule(aten.native_layer_norm.default)
def _layer_norm(
    b: Builder, node: torch.fx.Node, x: Var, normalized_shape: Any, w: Any, bias: Any, eps: float
) -> tuple:
    shape, dt = _out(node)
    k = len(normalized_shape)
    axes = tuple(range(len(shape) - k, len(shape)))
    n = math.prod(shape[a] for a in axes)
    cdt = "float32"
    xv = _convert(b, x, cdt)
    mean = b.elementwise(
        "div",
        [_reduce(b, xv, "sum", axes, True, cdt), Lit(float(n), cdt)],
        None or tuple(1 if i in axes else s for i, s in enumerate(shape)),
        cdt,
    )
    d = b.elementwise("sub", [xv, _bcast(b, mean, shape)], shape, cdt)
    var = b.elementwise(
        "div",
        [
            _reduce(b, b.elementwise("mul", [d, d], shape, cdt), "sum", axes, True, cdt),
            Lit(float(n), cdt),
        ],
        mean.shape,
        cdt,
    )
    rstd = b.elementwise(
        "rsqrt",
        [b.elementwise("add", [var, Lit(float(eps), cdt)], mean.shape, cdt)],
        mean.shape,
        cdt,
    )
    y = b.elementwise("mul", [d, _bcast(b, rstd, shape)], shape, cdt)
    if isinstance(w, Var):
        y = b.elementwise("mul", [y, _bcast(b, _convert(b, w, cdt), shape)], shape, cdt)
    if isinstance(bias, Var):
        y = b.elementwise("add", [y, _bcast(b, _convert(b, bias, cdt), shape)], shape, cdt)
    stat_dt = card_dtype(_meta_val(node)[1].dtype)
    return (_convert(b, y, dt), _convert(b, mean, stat_dt), _convert(b, rstd, stat_dt))


# ---------------------------------------------------------------------------------------------
# rules: matmul and gathers


def _matmul3(b: Builder, a: Var, c: Var, dt: str) -> Var:
    bsz, m, k = a.shape
    n = c.shape[2]
    return b.emit("matmul", [a, c], (bsz, m, n), dt, dtype=dt)


@rule(aten.mm.default)
def _mm(b: Builder, node: torch.fx.Node, x: Var, y: Var) -> Var:
    shape, dt = _out(node)
    r = _matmul3(b, b.reshape(x, (1, *x.shape)), b.reshape(y, (1, *y.shape)), dt)
    return b.reshape(r, shape)


@rule(aten.bmm.default)
def _bmm(b: Builder, node: torch.fx.Node, x: Var, y: Var) -> Var:
    _, dt = _out(node)
    return _matmul3(b, x, y, dt)


@rule(aten.addmm.default)
def _addmm(
    b: Builder, node: torch.fx.Node, bias: Any, x: Var, y: Var, *, beta: Any = 1, alpha: Any = 1
) -> Var:
    shape, dt = _out(node)
    r = b.reshape(_matmul3(b, b.reshape(x, (1, *x.shape)), b.reshape(y, (1, *y.shape)), dt), shape)
    if alpha != 1:
        r = b.elementwise("mul", [r, Lit(alpha, dt)], shape, dt)
    if beta == 0:
        return r
    bias_t = _operand(b, bias, shape, dt)
    if beta != 1:
        bias_t = b.elementwise("mul", [bias_t, Lit(beta, dt)], shape, dt)
    return b.elementwise("add", [r, bias_t], shape, dt)


@rule(aten.embedding.default)
def _embedding(b: Builder, node: torch.fx.Node, w: Var, idx: Var, *a: Any, **kw: Any) -> Var:
    shape, dt = _out(node)
    flat = b.reshape(_convert(b, idx, "int32"), (math.prod(idx.shape),))
    width = math.prod(w.shape[1:])
    tab = b.reshape(w, (w.shape[0], width))
    g = b.emit("gather", [tab, flat], (flat.shape[0], width), dt, mode="clip")
    return b.reshape(g, shape)


@rule(aten.index_select.default)
def _index_select(b: Builder, node: torch.fx.Node, x: Var, dim: int, idx: Var) -> Var:
    shape, dt = _out(node)
    d = _dim(dim, len(x.shape))
    perm = (d, *[i for i in range(len(x.shape)) if i != d])
    xt = b.transpose(x, perm)
    flat = b.reshape(_convert(b, idx, "int32"), (math.prod(idx.shape),))
    width = math.prod(xt.shape[1:])
    g = b.emit(
        "gather",
        [b.reshape(xt, (xt.shape[0], width)), flat],
        (flat.shape[0], width),
        dt,
        mode="clip",
    )
    g = b.reshape(g, (flat.shape[0], *xt.shape[1:]))
    inv = tuple(int(i) for i in np.argsort(perm))
    return b.transpose(g, inv)


@rule(aten.gather.default)
def _gather(b: Builder, node: torch.fx.Node, x: Var, dim: int, idx: Var, **kw: Any) -> Var:
    """``out[i] = x[i with coordinate dim replaced by idx[i]]``: a row gather on x flattened to
    one element per row, at offsets computed elementwise from idx and iotas."""
    shape, dt = _out(node)
    r = len(x.shape)
    d = _dim(dim, r)
    strides = [math.prod(x.shape[k + 1 :]) for k in range(r)]
    off = _ew_raw(b, "mul", [_convert(b, idx, "int32"), strides[d]], shape, "int32")
    for k in range(r):
        if k == d:
            continue
        io = np.arange(shape[k]).reshape([-1 if j == k else 1 for j in range(r)])
        iota = b.const(np.broadcast_to(io * strides[k], shape).astype(np.int32), "int32")
        off = b.elementwise("add", [off, iota], shape, "int32")
    flat = b.reshape(off, (math.prod(shape),))
    tab = b.reshape(x, (math.prod(x.shape), 1))
    g = b.emit("gather", [tab, flat], (flat.shape[0], 1), dt, mode="clip")
    return b.reshape(g, shape)
