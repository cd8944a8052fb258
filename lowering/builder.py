"""The graph builder both importers use: emit nodes, collect constants, keep the source line.

``from_jaxpr`` and ``from_fx`` each have their own registry of rules; a rule gets a
:class:`Builder` and emits graph-IR nodes through it. :class:`Lit` is a scalar immediate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from device_model.layout import check_dtype

from .graph import Node, Var
from .op_params import make_params

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
        """A node of ``op`` (its params class made from the keywords: GraphError naming the op
        for one it does not take); its one output."""
        ps = make_params(op, **kw)
        out = Var(tuple(int(d) for d in out_shape), out_dtype)
        self.nodes.append(Node(op, tuple(inputs), (out,), ps, self.source))
        return out

    def emit_many(
        self, op: str, inputs: list[Var], out_types: list[tuple[tuple[int, ...], str]], **kw: Any
    ) -> list[Var]:
        """A node of ``op`` with several outputs, one per ``(shape, dtype)``."""
        ps = make_params(op, **kw)
        outs = [Var(tuple(int(d) for d in sh), dt) for sh, dt in out_types]
        self.nodes.append(Node(op, tuple(inputs), tuple(outs), ps, self.source))
        return outs

    def const(self, value: Any, dtype: str | None = None) -> Var:
        arr = np.asarray(value)
        dt = dtype or dtype_name(arr.dtype)
        v = Var(tuple(arr.shape), dt)
        self.consts.append((v, arr))
        return v

    def full(self, shape: tuple[int, ...], value: Any, dtype: str) -> Var:
        """``shape`` filled with ``value``: one scalar constant, broadcast (fused into its
        readers; never a tensor of copies in device memory)."""
        v = self.const(np.asarray(value), dtype)
        if not shape:
            return v
        return self.emit("broadcast", [v], tuple(shape), dtype, shape=tuple(shape), dims=())

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

    def slice_dim(self, x: Var, axis: int, start: int, stop: int) -> Var:
        """``x[..., start:stop, ...]`` along ``axis`` (``0 <= start <= stop <= size``)."""
        if (start, stop) == (0, x.shape[axis]):
            return x
        st, li = [0] * len(x.shape), list(x.shape)
        st[axis], li[axis] = start, stop
        sh = list(x.shape)
        sh[axis] = stop - start
        ones = (1,) * len(sh)
        return self.emit(
            "slice", [x], tuple(sh), x.dtype, starts=tuple(st), limits=tuple(li), strides=ones
        )

    def concat(self, pieces: list[Var], axis: int) -> Var:
        """The pieces joined along ``axis``; empty pieces are left out (one piece is itself)."""
        pieces = [v for v in pieces if v.shape[axis] > 0] or pieces[:1]
        if len(pieces) == 1:
            return pieces[0]
        sh = list(pieces[0].shape)
        sh[axis] = sum(v.shape[axis] for v in pieces)
        return self.emit("concatenate", pieces, tuple(sh), pieces[0].dtype, axis=axis)

    def pad(self, x: Var, value: Var | Lit, config: list[tuple[int, int, int]]) -> Var:
        """``lax.pad(x, value, config)`` (``(low, high, interior)`` per dim, XLA's semantics) from
        slices and concatenations; torch's ``constant_pad_nd`` is the case without interior.

        Per dim: interior padding first (each element followed by ``interior`` pad values as a
        new axis, flattened, the trailing ones sliced off), then low and high: element ``j`` goes
        to position ``low + j`` of ``low + n + high``; what falls outside is sliced off (negative
        padding), what is left around it is filled. The fill blocks are ``value`` broadcast (a
        filled constant for a literal)."""

        def fill(sh: list[int]) -> Var:
            return self.as_var(value, tuple(sh))

        for d, (lo, hi, interior) in enumerate(config):
            n = x.shape[d]
            if interior > 0 and n > 1:
                sh = list(x.shape)
                col = self.reshape(x, (*sh[: d + 1], 1, *sh[d + 1 :]))
                gap = fill([*sh[: d + 1], interior, *sh[d + 1 :]])
                wide = self.concat([col, gap], d + 1)
                flat = self.reshape(wide, (*sh[:d], n * (1 + interior), *sh[d + 1 :]))
                x = self.slice_dim(flat, d, 0, n + (n - 1) * interior)
                n = x.shape[d]
            total = lo + n + hi
            start, stop = max(0, -lo), min(n, total - lo)
            kept = max(0, stop - start)
            lead = min(max(lo, 0), total)
            trail = total - lead - kept
            sh = list(x.shape)
            pieces = []
            if lead:
                pieces.append(fill([*sh[:d], lead, *sh[d + 1 :]]))
            if kept or not total:
                pieces.append(
                    self.slice_dim(x, d, start, stop) if kept else self.slice_dim(x, d, 0, 0)
                )
            if trail:
                pieces.append(fill([*sh[:d], trail, *sh[d + 1 :]]))
            x = self.concat(pieces, d)
        return x
