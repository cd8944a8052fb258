"""The unfuse pass: a matmul whose fused epilogue or prologue leaves it no tiling in whole
blocks (its operands' blocks beside the matmul's own need more scratchpad than the card has),
or that multiplies over an empty K, goes back to the map and the matmul it was fused from.
Before fusion, :func:`explicit_convs` makes a ``conv`` node no window of whose input fits the
scratchpad (:func:`lowering.tile_conv.conv_fits`) an explicit im2col
(:func:`lowering.conv_ops.explicit`).

It asks the tiler (:func:`lowering.tile_matmul.fits_whole`) and takes the prologue out first,
then the epilogue, until the matmul fits or has no fused part left; the tiler itself never
changes the graph. The unfused matmul may then take the general tiling (K split across steps,
ragged blocks); the results are the same bits (the fused stage computes what the two unfused
ones do).
"""

from __future__ import annotations

from device_model.card import CardSpec

from .conv_ops import explicit
from .graph import Graph, Node
from .matmul_passes import unfuse_epilogue
from .prologue import unfuse_prologue
from .tile_conv import conv_fits
from .tile_matmul import fits_whole

__all__ = ["unfuse", "explicit_convs"]


def _must_unfuse(n: Node, card: CardSpec) -> bool:
    if n.op == "conv":
        return n.params.epilogue is not None and not conv_fits(n, card)
    if n.op != "matmul" or (n.params.prologue is None and n.params.epilogue is None):
        return False
    return n.inputs[0].shape[2] == 0 or not fits_whole(n, card)


def unfuse(g: Graph, card: CardSpec) -> Graph:
    """``g`` with every fused matmul that does not fit ``card`` split (prologue first)."""
    out: list[Node] = []
    changed = False
    for n in g.nodes:
        todo = [n]
        while todo:
            m = todo.pop(0)
            if not _must_unfuse(m, card):
                out.append(m)
                continue
            changed = True
            parts = unfuse_prologue(m) if m.params.prologue is not None else unfuse_epilogue(m)
            todo[:0] = parts
    if not changed:
        return g
    return Graph(g.name, g.inputs, tuple(out), g.outputs, g.consts)


def explicit_convs(g: Graph, card: CardSpec) -> Graph:
    """``g`` with every ``conv`` node that has no tiling on ``card`` lowered as an explicit
    im2col (run before fusion: the pad, slices and concatenation fuse as any others)."""
    out: list[Node] = []
    consts = list(g.consts)
    for n in g.nodes:
        if n.op == "conv" and not conv_fits(n, card):
            nodes, made = explicit(n)
            out.extend(nodes)
            consts.extend(made)
        else:
            out.append(n)
    if len(out) == len(g.nodes):
        return g
    return Graph(g.name, g.inputs, tuple(out), g.outputs, tuple(consts))
