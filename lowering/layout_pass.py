"""The ``sink_transposes`` pass: transposes moved down through the elementwise ops after them,
so that a transpose and its inverse meet and cancel.

A CNN written channels-first (PyTorch's NCHW) runs each convolution channels-last on the card
(:mod:`lowering.conv_ops`: the channels on the sticks), so every convolution is wrapped in two
re-layouts, NCHW -> NHWC before it and back after it; the batch norm, ReLU, residual add and
pooling between two convolutions run on NCHW tensors. Each re-layout moves the stick dim: a
whole pass over the activation at the re-layout rate. A JAX model written NHWC gets an adjacent
inverse pair around each convolution.

The pass keeps, for each value that is a transpose, its source and permutation instead of the
transpose itself, and rewrites the ops after it on the source's layout:

* a transpose of a transpose composes the two (the identity: nothing left);
* an elementwise op or a convert whose operands are such transposes (all of one permutation),
  or values cheap to make in any layout (a ``broadcast``: a per-channel scale, a fill), runs on
  the sources, the cheap operands made in the source's layout (a broadcast with its dims
  permuted); its result is again a transpose of a value;
* a slice, a concatenation (cheap operands as above) and a reduction likewise, their axes and
  bounds permuted.

Everything else (a convolution, a matmul, a reshape, a graph output) takes the transpose made
where it is first needed, once. A convolution's input transpose then meets the one the previous
convolution's output was given and both vanish. Pure: a new graph; the original when the
transposes that would be made weigh more than those there were (bytes), so it never adds
re-layout traffic.
"""

from __future__ import annotations

import dataclasses
import math

from device_model.layout import np_dtype
from device_model.ops import REDUCTIONS

from .graph import Graph, Node, Var, infer
from .op_params import Transpose

__all__ = ["sink_transposes"]

_ELEMENTWISE = frozenset({"elementwise", "convert"})


def _compose(q: tuple[int, ...], p: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation of ``transpose(transpose(x, q), p)``."""
    return tuple(q[i] for i in p)


def _inverse(p: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(p)
    for i, d in enumerate(p):
        inv[d] = i
    return tuple(inv)


def _identity(p: tuple[int, ...]) -> bool:
    return p == tuple(range(len(p)))


def _nbytes(v: Var) -> int:
    return math.prod(v.shape) * np_dtype(v.dtype).itemsize


class _Sinker:
    """One pass over a graph's nodes, emitting the rewritten ones (see the module docstring)."""

    def __init__(self, g: Graph):
        self.g = g
        self.out: list[Node] = []
        #: value id -> (source, perm): the value is transpose(source, perm), not made yet
        self.lazy: dict[int, tuple[Var, tuple[int, ...]]] = {}
        self.made: set[int] = set()  # lazy values given their transpose node already
        self.maker = {n.out.id: n for n in g.nodes if len(n.outputs) == 1}
        # values cheap to make in any layout: broadcasts, fills, and elementwise ops of them
        # (a batch norm's per-channel scale): made again where a layout needs them
        self.cheap: set[int] = set()
        for n in g.nodes:
            if (
                n.op == "broadcast"
                or (n.op == "elementwise" and not n.inputs)
                or (n.op in _ELEMENTWISE and n.inputs and all(v.id in self.cheap for v in n.inputs))
            ):
                self.cheap.add(n.out.id)
        self.rebuilt: dict[tuple[int, tuple[int, ...]], Var] = {}

    def need(self, v: Var) -> Var:
        """``v`` itself, its transpose made here (once) if it was kept lazy."""
        lz = self.lazy.get(v.id)
        if lz is None or v.id in self.made:
            return v
        src, p = lz
        if _identity(p):
            return src
        self.out.append(Node("transpose", (src,), (v,), Transpose(p)))
        self.made.add(v.id)
        return v

    def keep(self, n: Node) -> None:
        """``n`` as it is, its lazy inputs made."""
        ins = tuple(self.need(v) for v in n.inputs)
        self.out.append(n if ins == n.inputs else dataclasses.replace(n, inputs=ins))

    def in_layout(self, v: Var, p: tuple[int, ...], source: str) -> Var | None:
        """``v`` (layout O = transpose(B, p)) in the layout B: a lazy value's source, a cheap
        value rebuilt; None for anything else."""
        lz = self.lazy.get(v.id)
        if lz is not None:
            return lz[0] if lz[1] == p else None
        if v.id not in self.cheap:
            return None
        key = (v.id, p)
        if key in self.rebuilt:
            return self.rebuilt[key]
        n = self.maker[v.id]
        inv = _inverse(p)
        shape = tuple(v.shape[inv[j]] for j in range(len(p)))
        w = Var(shape, v.dtype)
        ins = n.inputs
        if n.op == "broadcast":
            dims = tuple(p[d] for d in n.params.dims)
            ps = dataclasses.replace(n.params, shape=shape, dims=dims)
        else:  # an elementwise op of cheap values (or a fill): its operands rebuilt first
            ins = tuple(self.in_layout(u, p, source) for u in n.inputs)
            ps = n.params
            if n.op == "elementwise" and ps.shape is not None:
                ps = dataclasses.replace(ps, shape=shape)
        self.out.append(Node(n.op, ins, (w,), ps, n.source))
        self.rebuilt[key] = w
        return w

    def common_perm(self, n: Node) -> tuple[int, ...] | None:
        perms = {self.lazy[v.id][1] for v in n.inputs if v.id in self.lazy}
        if len(perms) != 1:
            return None
        (p,) = perms
        return None if _identity(p) else p

    def sink(self, n: Node, p: tuple[int, ...]) -> bool:
        """``n`` rewritten on the sources' layout (its result lazy), or False."""
        srcs = []
        for v in n.inputs:
            if v.id not in self.lazy and v.id not in self.cheap:
                return False
        for v in n.inputs:
            w = self.in_layout(v, p, n.source)
            if w is None:
                return False
            srcs.append(w)
        inv = _inverse(p)
        x = n.out
        params = n.params
        if n.op in _ELEMENTWISE:
            if n.op == "elementwise" and params.shape is not None:
                params = dataclasses.replace(params, shape=srcs[0].shape)
            q = p
        elif n.op == "slice":
            st, li, sd = (
                tuple(getattr(params, f)[inv[j]] for j in range(len(p)))
                for f in ("starts", "limits", "strides")
            )
            params = dataclasses.replace(params, starts=st, limits=li, strides=sd)
            q = p
        elif n.op == "concatenate":
            params = dataclasses.replace(params, axis=p[params.axis])
            q = p
        else:  # reduce
            axes = tuple(sorted(p[a] for a in params.axes))
            params = dataclasses.replace(params, axes=axes)
            kept = [p[i] for i in range(len(p)) if i not in n.params.axes]
            order = sorted(kept)
            q = tuple(order.index(d) for d in kept)
        probe = Node(n.op, tuple(srcs), (x,), params, n.source)
        y = Var(infer(probe)[0][0], x.dtype)
        self.out.append(Node(n.op, tuple(srcs), (y,), params, n.source))
        self.lazy[x.id] = (y, q)
        return True

    def run(self) -> list[Node]:
        for n in self.g.nodes:
            if n.op == "transpose":
                (v,) = n.inputs
                src, q = self.lazy.get(v.id, (v, tuple(range(len(v.shape)))))
                if v.id in self.made:
                    src, q = v, tuple(range(len(v.shape)))
                self.lazy[n.out.id] = (src, _compose(q, n.params.perm))
                continue
            sinkable = (
                n.op in _ELEMENTWISE
                or n.op in ("slice", "concatenate")
                or (n.op == "reduce" and not REDUCTIONS[n.params.kind].scan)
            )
            if sinkable and len(n.outputs) == 1 and n.inputs:
                p = self.common_perm(n)
                if p is not None and self.sink(n, p):
                    continue
            self.keep(n)
        return self.out


def sink_transposes(g: Graph) -> Graph:
    """``g`` with its transposes sunk through elementwise ops, slices, concatenations and
    reductions, pairs that meet cancelled (see the module docstring); ``g`` itself when that
    would not make fewer transpose bytes."""
    if not any(n.op == "transpose" for n in g.nodes):
        return g
    s = _Sinker(g)
    nodes = s.run()
    outs = tuple(s.need(v) for v in g.outputs)
    cheap = s.cheap

    def moved(ns: list[Node] | tuple[Node, ...]) -> int:
        return sum(
            _nbytes(n.out) for n in ns if n.op == "transpose" and n.inputs[0].id not in cheap
        )

    if moved(nodes) >= moved(g.nodes):
        return g
    return Graph(g.name, g.inputs, tuple(nodes), outs, g.consts)
