"""What the torch FX rule modules share: the one registry of rules and the helpers they use.

:data:`RULES` maps an ATen ``OpOverload`` to its rule; ``@rule(aten.add.Tensor, ...)`` registers
one. ``lowering.from_fx`` imports the rule modules (``fx_elementwise``, ``fx_tensor``), which
register into it, and re-exports it: ``lowering.from_fx.RULES`` is this dict. A rule gets the
builder, the node and its arguments (``Var`` for tensors, Python values otherwise) and returns a
``Var`` (or a tuple of them for multi-output ops).

Dtypes follow the card: float16, bfloat16, float32, int32 (int64 indices are narrowed) and bool.
Tensor-tensor ops compute in the dtype torch would promote to (the output's, from the fake
tensor; for comparisons, the promoted input dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from device_model.layout import SUPPORTED_DTYPES

from . import torch_import
from .builder import Builder, Lit
from .errors import LoweringError
from .graph import Var
from .torch_import import torch

__all__ = [
    "RULES",
    "Rule",
    "rule",
    "card_dtype",
    "is_card_dtype",
    "meta_val",
    "result",
    "promote",
    "convert",
    "bcast",
    "operand",
    "ew",
    "ew_raw",
    "to_bool",
    "norm_dim",
    "norm_dims",
]

_TORCH_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.int32: "int32",
    torch.int64: "int32",  # indices: narrowed, as the JAX frontend does
    torch.int8: "int8",
    torch.uint8: "uint8",
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


def is_card_dtype(dt: torch.dtype) -> bool:
    """Whether the card has ``dt`` (int64 counts: it is narrowed)."""
    return dt in _TORCH_DTYPES


Rule = Callable[..., Any]
#: the one registry: ATen OpOverload -> rule
RULES: dict[Any, Rule] = {}


#: op -> predicate on the node: a rule that covers only some uses of its op (the others run on
#: the CPU as an op with no rule does)
WHEN: dict[Any, Callable[[Any], bool]] = {}


def rule(*ops: Any, when: Callable[[Any], bool] | None = None) -> Callable[[Rule], Rule]:
    """Register the decorated function as the rule of each of ``ops`` (of the nodes ``when``
    accepts, if given)."""

    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
            if when is not None:
                WHEN[op] = when
        return fn

    return deco


def meta_val(node: torch.fx.Node) -> Any:
    """The fake tensor (or tuple of them) a node's result has."""
    return node.meta.get("val", node.meta.get("example_value"))


def result(node: torch.fx.Node) -> tuple[tuple[int, ...], str]:
    """(shape, card dtype) of a node's (first) result."""
    v = meta_val(node)
    if isinstance(v, list | tuple):
        v = v[0]
    return tuple(int(d) for d in v.shape), card_dtype(v.dtype, f"the result of {node.target}")


def promote(*xs: Any) -> str:
    """torch's promotion of tensor operands (Python scalars do not promote float tensors)."""
    ts = [x for x in xs if isinstance(x, Var)]
    if not ts:
        return "float32"
    order = {"bool": 0, "int8": 1, "uint8": 1, "int32": 2, "float16": 3, "bfloat16": 3}
    order["float32"] = 4
    dts = {t.dtype for t in ts}
    if dts == {"float16", "bfloat16"}:
        return "float32"
    if dts >= {"int8", "uint8"} and not dts & {"int32", "float16", "bfloat16", "float32"}:
        return "int32"  # (torch: int16, which the card does not have; int32 holds every result)
    best = max(dts, key=lambda d: order.get(d, 2))
    if order.get(best, 2) <= 2 and any(isinstance(x, float) for x in xs):
        return "float32"
    return best


def convert(b: Builder, x: Var, dt: str) -> Var:
    """``x`` in dtype ``dt`` (itself when it has it)."""
    if x.dtype == dt:
        return x
    return b.emit("convert", [x], x.shape, dt, dtype=dt)


def bcast(b: Builder, x: Var, shape: tuple[int, ...]) -> Var:
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


def take(b: Builder, x: Var, axis: int, rows: Var) -> Var:
    """``x``'s entries ``rows`` (int32 ``[M]``, clamped into range) along ``axis``: one row
    gather of ``x`` with ``axis`` moved first, the result ``x``'s shape with ``M`` at ``axis``."""
    n, M = x.shape[axis], rows.shape[0]
    perm = (axis, *(d for d in range(len(x.shape)) if d != axis))
    moved = b.transpose(x, perm) if axis else x
    rest = moved.shape[1:]
    D = math.prod(rest)
    got = b.emit(
        "gather",
        [b.reshape(moved, (n, D)), rows],
        (M, D),
        x.dtype,
        mode="clip",
        fill_value=None,
    )
    got = b.reshape(got, (M, *rest))
    if not axis:
        return got
    back = tuple(perm.index(d) for d in range(len(x.shape)))
    return b.transpose(got, back)


def operand(b: Builder, x: Any, shape: tuple[int, ...], dt: str) -> Var | Lit:
    """A tensor converted and broadcast to ``dt`` and ``shape``, or a Python number as a Lit."""
    if isinstance(x, Var):
        return bcast(b, convert(b, x, dt), shape)
    if isinstance(x, bool | int | float):
        return Lit(x, dt)
    raise LoweringError(f"spyre: unsupported operand {x!r}")


#: comparisons: their result is bool, whatever dtype they compare in
CMP = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})


def ew(
    b: Builder,
    node: torch.fx.Node,
    fn: str,
    *xs: Any,
    compute: str | None = None,
    param: Any = None,
) -> Var:
    """An elementwise op in torch's semantics: broadcast, promote, compute, cast to the result."""
    shape, out_dt = result(node)
    cdt = compute or promote(*xs)
    ops = [operand(b, x, shape, cdt) for x in xs]
    if all(isinstance(o, Lit) for o in ops):
        v = b.elementwise(fn, ops, shape, cdt, param=param)
    else:
        v = b.elementwise(fn, ops, shape, cdt if fn not in CMP else "bool", param=param)
    return convert(b, v, out_dt)


def norm_dim(d: int, rank: int) -> int:
    """A dim index with negative ones counted from the end."""
    return d + rank if d < 0 else d


def norm_dims(ds: Any, rank: int) -> tuple[int, ...]:
    """Reduction dims; None or an empty list means all of them, as in ATen. A rank-0 tensor has
    none: ATen accepts dim 0 or -1 on it and reduces nothing."""
    if rank == 0:
        return ()
    if ds is None or (isinstance(ds, list | tuple) and len(ds) == 0):
        return tuple(range(rank))
    if isinstance(ds, int):
        ds = [ds]
    return tuple(sorted({norm_dim(int(d), rank) for d in ds}))


def to_bool(b: Builder, v: Any) -> Any:
    """A tensor converted to bool, or a Python value as a bool."""
    return convert(b, v, "bool") if isinstance(v, Var) else bool(v)


def ew_raw(b: Builder, fn: str, xs: list[Any], shape: tuple[int, ...], dt: str) -> Var:
    """An elementwise op computed and returned in ``dt`` (operands converted and broadcast)."""
    ops = [operand(b, x, shape, dt) for x in xs]
    return b.elementwise(fn, ops, shape, dt)


torch_import.finish(__name__)  # see lowering.torch_import
