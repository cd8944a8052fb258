"""The graph builder both importers use: emit nodes, collect constants, keep the source line.

``from_jaxpr`` and ``from_fx`` each have their own registry of rules; a rule gets a
:class:`Builder` and emits graph-IR nodes through it. :class:`Lit` is a scalar immediate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from device_model.layout import check_dtype

from .graph import Node, Var, params

__all__ = ["Builder", "Lit", "dtype_name"]


def dtype_name(dt: Any) -> str:
    """The card dtype name of a NumPy/JAX dtype; TypeError for unsupported ones."""
    name = np.dtype(dt).name
    return check_dtype(name, "a value in the traced program")


@dataclass(frozen=True, slots=True)
class Lit:
    """A scalar literal operand (folded into the consuming op as an immediate)."""

    value: Any
    dtype: str


class Builder:
    """Collects nodes and constants while a jaxpr is imported."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.consts: list[tuple[Var, np.ndarray]] = []
        self.source = ""

    def emit(
        self, op: str, inputs: list[Var], out_shape: tuple[int, ...], out_dtype: str, **kw: Any
    ) -> Var:
        out = Var(tuple(int(d) for d in out_shape), out_dtype)
        self.nodes.append(Node(op, tuple(inputs), (out,), params(**kw), self.source))
        return out

    def const(self, value: Any, dtype: str | None = None) -> Var:
        arr = np.asarray(value)
        dt = dtype or dtype_name(arr.dtype)
        v = Var(tuple(arr.shape), dt)
        self.consts.append((v, arr))
        return v

    def as_var(self, x: Var | Lit, shape: tuple[int, ...] = ()) -> Var:
        """A Var for an operand: literals become broadcast constants of ``shape``."""
        if isinstance(x, Var):
            if x.shape != tuple(shape) and x.shape == ():
                return self.emit("broadcast", [x], shape, x.dtype, shape=tuple(shape), dims=())
            return x
        return self.elementwise("copy", [x], tuple(shape), x.dtype)

    def elementwise(
        self, fn: str, args: list[Var | Lit], shape: tuple[int, ...], dtype: str, param: Any = None
    ) -> Var:
        vars_: list[Var] = []
        scalars = []
        for pos, a in enumerate(args):
            if isinstance(a, Lit):
                scalars.append((pos, a.value, a.dtype))
            elif a.shape != tuple(shape):
                # scalar operands and size-1 dims broadcast implicitly
                dims = () if a.shape == () else tuple(range(len(shape)))
                vars_.append(
                    self.emit("broadcast", [a], shape, a.dtype, shape=tuple(shape), dims=dims)
                )
            else:
                vars_.append(a)
        return self.emit(
            "elementwise",
            vars_,
            shape,
            dtype,
            fn=fn,
            scalars=tuple(scalars),
            dtype=dtype,
            shape=tuple(shape),
            param=param,
        )

    def reshape(self, x: Var, shape: tuple[int, ...]) -> Var:
        shape = tuple(int(d) for d in shape)
        if x.shape == shape:
            return x
        return self.emit("reshape", [x], shape, x.dtype, shape=shape)

    def transpose(self, x: Var, perm: tuple[int, ...]) -> Var:
        perm = tuple(int(p) for p in perm)
        if perm == tuple(range(len(perm))):
            return x
        return self.emit("transpose", [x], tuple(x.shape[p] for p in perm), x.dtype, perm=perm)
