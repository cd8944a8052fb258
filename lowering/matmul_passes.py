"""Graph passes around matmuls: operands read in place (``nt_matmul``, ``swap_matmul``), the
fp32 product stored narrow (``narrow_matmul``), and elementwise maps fused into a matmul's
store (``fuse_epilogue``, with ``sink_reshapes`` moving the reshapes between them out of the
way). Pure functions from graph to graph, like :mod:`lowering.passes`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from device_model.card import CardSpec
from device_model.ops import InputView, MapBody

from .graph import Graph, Node, Var, matmul_inputs
from .op_params import Fused, Map, Reshape
from .passes import dce, fuse_maps, is_free_reshape, splice, use_counts

__all__ = [
    "nt_matmul",
    "swap_matmul",
    "narrow_matmul",
    "sink_reshapes",
    "sink_and_fuse",
    "fuse_epilogue",
    "unfuse_epilogue",
    "EPILOGUE_INPUTS",
    "EPILOGUE_VECTORS",
]


def _swaps_last_two(n: Node) -> bool:
    perm = n.params.perm
    r = len(perm)
    return r >= 2 and perm == (*range(r - 2), r - 1, r - 2)


def nt_matmul(g: Graph) -> Graph:
    """A matmul whose rhs is a transpose of the last two dims (through a reshape that only
    merges or adds leading dims, ``[..., K, N] -> [B, K, N]``) reads the transpose's input in
    place: ``matmul(a, reshape?(W), rhs_t=True)`` with ``W`` seen as ``[B, N, K]``. The
    transpose stays if anything else reads it (:func:`dce` drops it otherwise)."""
    made = {n.out.id: n for n in g.nodes if len(n.outputs) == 1}
    nodes: list[Node] = []
    changed = False
    for n in g.nodes:
        if n.op == "matmul" and not n.params.rhs_t:
            rhs = n.inputs[1]
            src = made.get(rhs.id)
            if src is not None and src.op == "reshape":
                t = made.get(src.inputs[0].id)
                if src.inputs[0].shape[-2:] != rhs.shape[-2:]:
                    t = None
            else:
                t = src
            if t is not None and t.op == "transpose" and _swaps_last_two(t):
                (w,) = t.inputs
                B, K, N = rhs.shape
                if w.shape != (B, N, K):
                    w2 = Var((B, N, K), w.dtype)
                    nodes.append(Node("reshape", (w,), (w2,), Reshape((B, N, K)), t.source))
                    w = w2
                ps = dataclasses.replace(n.params, rhs_t=True)
                nodes.append(Node("matmul", (n.inputs[0], w), n.outputs, ps, n.source))
                changed = True
                continue
        nodes.append(n)
    if not changed:
        return g
    return dce(Graph(g.name, g.inputs, tuple(nodes), g.outputs, g.consts))


def swap_matmul(g: Graph) -> Graph:
    """The transpose of an NT matmul's product is the NT matmul with its operands swapped:
    ``transpose(a @ b^T) = b @ a^T`` (``[B, P, K] x [B, Q, K]`` both read K-last either way).
    A vmapped ``W @ x`` (equinox's ``Linear``) is traced as the weight times the activations
    transposed, then transposed back; swapped, the product comes out in the layout its readers
    want and the transpose stage is gone (and a map reading the product can become its
    epilogue). Through the reshape that drops a leading batch of 1, when each value between is
    read only there."""
    uses = use_counts(g)
    made = {n.out.id: n for n in g.nodes if len(n.outputs) == 1}
    drop: set[int] = set()
    replace: dict[int, list[Node]] = {}
    for t in g.nodes:
        if t.op != "transpose" or not _swaps_last_two(t) or uses.get(t.inputs[0].id) != 1:
            continue
        v = t.inputs[0]
        src, mid = made.get(v.id), None
        if src is not None and src.op == "reshape" and len(v.shape) == 2:
            x = src.inputs[0]
            if x.shape == (1, *v.shape) and uses.get(x.id) == 1:
                mid, src = src, made.get(x.id)
        if src is None or src.op != "matmul" or not src.params.rhs_t:
            continue
        if src.params.epilogue is not None or (mid is None and len(v.shape) != 3):
            continue
        a, b = src.inputs
        swapped = Var((a.shape[0], b.shape[1], a.shape[1]), src.out.dtype)
        if mid is None:
            nodes = [Node("matmul", (b, a), t.outputs, src.params, src.source)]
        else:
            nodes = [
                Node("matmul", (b, a), (swapped,), src.params, src.source),
                Node("reshape", (swapped,), t.outputs, Reshape(t.out.shape), t.source),
            ]
            drop.add(id(mid))
        drop.add(id(src))
        replace[id(t)] = nodes
    return splice(g, drop, replace)


_NARROW = ("float16", "bfloat16")


def narrow_matmul(g: Graph) -> Graph:
    """A matmul (or a convolution) that accumulates in fp32 only to be converted to fp16 or
    bf16 (JAX's ``preferred_element_type=jnp.float32`` then ``.astype``, possibly through a
    reshape) stores the narrow dtype itself: ``matmul[dtype=float16]``. Its accumulator stays
    fp32 and is rounded once on the way out, as the convert rounds it, so the results are the
    same. The fp32 tensor never reaches device memory (half the output traffic, and no separate
    convert stage)."""
    uses = use_counts(g)
    made = {n.out.id: n for n in g.nodes if len(n.outputs) == 1}
    replace: dict[int, list[Node]] = {}  # convert node id -> its replacement nodes
    drop: set[int] = set()
    for c in g.nodes:
        if c.op != "convert" or c.params.dtype not in _NARROW:
            continue
        (x,) = c.inputs
        src = made.get(x.id)
        mid = None
        if src is not None and src.op == "reshape" and uses.get(x.id) == 1:
            mid, src = src, made.get(src.inputs[0].id)
        if (
            src is None
            or src.op not in ("matmul", "conv")
            or src.out.dtype != "float32"
            or uses.get(src.out.id) != 1
        ):
            continue
        dt = c.params.dtype
        ps = dataclasses.replace(src.params, dtype=dt)
        if mid is None:
            nodes = [Node(src.op, src.inputs, c.outputs, ps, src.source)]
        else:
            m = Var(src.out.shape, dt)
            nodes = [
                Node(src.op, src.inputs, (m,), ps, src.source),
                Node("reshape", (m,), c.outputs, mid.params, mid.source),
            ]
            drop.add(id(mid))
        drop.add(id(src))
        replace[id(c)] = nodes
    return splice(g, drop, replace)


def _reshape_root(v: Var, made: dict[int, Node], stick: int) -> Var:
    """The value ``v`` is a chain of free reshapes of (``v`` itself when it is none)."""
    while (r := made.get(v.id)) is not None and r.op == "reshape":
        u = r.inputs[0]
        if not u.shape or 0 in u.shape or not is_free_reshape(u.shape, v.shape, u.dtype, stick):
            break
        v = u
    return v


def _sink_one(c: Node, made: dict[int, Node], stick: int) -> list[Node] | None:
    """:func:`sink_reshapes` for one map: its replacement nodes, or None."""
    body: MapBody = c.params.body
    for s, v in enumerate(c.inputs):
        if v.shape != body.space or body.views[s] != InputView.identity(len(v.shape)):
            continue  # (an identity view of a longer input is a slice of it)
        if not v.shape or 0 in v.shape:
            continue
        u = _reshape_root(v, made, stick)
        if u is v or u.shape == v.shape:
            continue
        if not is_free_reshape(u.shape, v.shape, c.out.dtype, stick):
            continue
        rv, ru = len(v.shape), len(u.shape)
        t = 0  # the trailing dims the reshape keeps
        while t < min(rv, ru) and u.shape[-1 - t] == v.shape[-1 - t]:
            t += 1
        ins: list[Var] = []
        views: list[InputView] = []
        for j, (w, view) in enumerate(zip(c.inputs, body.views, strict=True)):
            w0 = u if j == s else _reshape_root(w, made, stick)
            if w.shape == v.shape and w0.shape == u.shape and view == InputView.identity(rv):
                ins.append(w0)  # the same reshape of a value of the new shape (a residual)
                views.append(InputView.identity(ru))
                continue
            dims = []
            for jj, g in enumerate(view.dims):
                if g >= rv - t:
                    dims.append(g + ru - rv)  # a kept dim: the same extent
                elif g < 0 or view.bcast[jj]:
                    dims.append(-1)  # one index of it, whichever dim it broadcasts over
                else:
                    break  # it varies along a dim the reshape regroups
            else:
                ins.append(w)
                views.append(InputView(tuple(dims), view.starts, view.strides, view.bcast))
                continue
            break
        else:
            y = Var(u.shape, c.out.dtype)
            nb = MapBody(u.shape, tuple(views), body.program, "", (), body.out_dtype)
            return [
                Node("map", tuple(ins), (y,), Map(nb), c.source),
                Node("reshape", (y,), c.outputs, Reshape(c.out.shape), c.source),
            ]
    return None


def sink_reshapes(g: Graph, card: CardSpec) -> Graph:
    """An elementwise map that reads a chain of free reshapes of a value (as torch's ``Linear``
    wraps its matmul: ``[B, S, H] -> [B*S, H] -> [1, B*S, H]`` and back) runs on the value's
    own shape instead, and one reshape after it gives its old result (free as well, on
    ``card``'s sticks). Its other inputs must broadcast along the dims the reshape regroups (a
    bias, a scalar) or be free reshapes of values of the new shape (a residual). Maps then meet
    without a reshape between them (:func:`fuse_maps` chains them) and a map meets the matmul
    whose product it reads (:func:`fuse_epilogue`). Every rewrite moves a reshape from a map's
    inputs to its output, so repeating it until nothing changes ends (and a cap guards it)."""
    for _ in range(4 * len(g.nodes) + 1):
        made = {o.id: n for n in g.nodes for o in n.outputs}
        replace: dict[int, list[Node]] = {}
        for c in g.nodes:
            if c.op != "map" or c.params.body.reduce or c.params.body.program_reduce_axes():
                continue
            new = _sink_one(c, made, card.stick_bytes)
            if new is not None:
                replace[id(c)] = new
        if not replace:
            break
        g = dce(splice(g, set(), replace))
    return g


def sink_and_fuse(g: Graph, card: CardSpec, fits: Callable[[Node], bool] | None = None) -> Graph:
    """:func:`sink_reshapes`, then :func:`fuse_maps` again where it changed anything."""
    sunk = sink_reshapes(g, card)
    return g if sunk is g else fuse_maps(sunk, card, fits)


#: the most tensors besides the product an epilogue may read (each takes scratchpad the
#: matmul's tiles would otherwise have)
EPILOGUE_INPUTS = 3


#: an epilogue may read this many per-channel vectors (of at most the output's last dim: a
#: block of them is one output block's columns) beyond EPILOGUE_INPUTS: a convolution's bias
#: and a batch norm's mean, variance, scale and shift
EPILOGUE_VECTORS = 6


def _epilogue_inputs_fit(src: Node, extras: tuple[Var, ...]) -> bool:
    """Whether a map's other inputs may ride ``src``'s store: at most :data:`EPILOGUE_INPUTS`
    tensors, and :data:`EPILOGUE_VECTORS` per-channel vectors besides."""
    width = src.out.shape[-1]
    vectors = sum(1 for u in extras if math.prod(u.shape) <= width)
    if len(extras) <= EPILOGUE_INPUTS:
        return True
    return len(extras) - vectors <= EPILOGUE_INPUTS and vectors <= EPILOGUE_VECTORS


def _lift(body: MapBody, slot: int) -> MapBody:
    """A map body over ``space`` as one over ``(1, *space)`` (the product's leading batch of 1),
    its input ``slot`` (the product) read one-to-one with that batch dim."""
    views = [
        InputView(tuple(g + 1 if g >= 0 else g for g in v.dims), v.starts, v.strides, v.bcast)
        for v in body.views
    ]
    views[slot] = InputView.identity(len(body.space) + 1)
    return MapBody((1, *body.space), tuple(views), body.program, "", (), body.out_dtype)


def fuse_epilogue(g: Graph) -> Graph:
    """An elementwise map that reads a matmul's product (directly, or through the free reshape
    that drops its leading batch of 1) as its only use becomes the matmul's ``epilogue``: the
    SFUs apply it to each output block on its way from the accumulator to the store (a bias,
    an activation, a residual add, a convert: the bias-GELU of an MLP, a SwiGLU's gate product).
    The product never goes to device memory and back, and the map's stage is gone. The map's
    other inputs (at most :data:`EPILOGUE_INPUTS`) become the matmul's inputs past the rhs. The
    results are the unfused ones: the product is rounded to the matmul's dtype first, as it was
    stored. The scheduler falls back to the two stages when the fused one does not fit. A
    convolution takes an epilogue the same way (a batch norm, a ReLU, a residual add); per-channel
    vectors are counted apart (:data:`EPILOGUE_VECTORS`)."""
    uses = use_counts(g)
    made = {o.id: n for n in g.nodes for o in n.outputs}
    drop: set[int] = set()
    replace: dict[int, list[Node]] = {}
    for c in g.nodes:
        if c.op != "map" or len(c.inputs) - 1 > EPILOGUE_INPUTS + EPILOGUE_VECTORS:
            continue
        body: MapBody = c.params.body
        if body.reduce or body.program_reduce_axes():
            continue
        for slot, v in enumerate(c.inputs):
            if uses.get(v.id) != 1 or body.views[slot] != InputView.identity(len(v.shape)):
                continue
            src, mid = made.get(v.id), None
            if src is not None and src.op == "reshape" and id(src) not in drop:
                x = src.inputs[0]
                if uses.get(x.id) == 1 and x.shape[:1] == (1,) and x.shape[1:] == v.shape:
                    mid, src = src, made.get(x.id)
            if (
                src is None
                or id(src) in drop
                or src.op not in ("matmul", "conv")
                or src.params.epilogue is not None
                or 0 in src.out.shape
                or 0 in src.inputs[0].shape
                or body.space != v.shape
            ):
                continue
            extras = tuple(u for i, u in enumerate(c.inputs) if i != slot)
            if not _epilogue_inputs_fit(src, extras):
                continue
            ep = _lift(body, slot) if mid is not None else body
            ps = dataclasses.replace(src.params, epilogue=Fused(ep, slot))
            if mid is None:
                nodes = [Node(src.op, src.inputs + extras, c.outputs, ps, src.source)]
            else:
                y = Var(src.out.shape, body.out_dtype)
                nodes = [
                    Node(src.op, src.inputs + extras, (y,), ps, src.source),
                    Node("reshape", (y,), c.outputs, Reshape(c.out.shape), mid.source),
                ]
                drop.add(id(mid))
            drop.add(id(src))
            replace[id(c)] = nodes
            break
    return splice(g, drop, replace)


def unfuse_epilogue(n: Node) -> list[Node]:
    """A matmul with an epilogue as the matmul and the map it came from (the unfuse pass's
    split when the fused stage does not fit)."""
    ep, slot = n.params.epilogue.body, n.params.epilogue.slot
    ps = dataclasses.replace(n.params, epilogue=None)
    a, b, ep_ins, pro_ins = matmul_inputs(n)  # a prologue's inputs stay with the matmul
    prod = Var(n.out.shape, n.params.dtype)
    extras = list(ep_ins)
    extras.insert(slot, prod)
    return [
        Node(n.op, (a, b, *pro_ins), (prod,), ps, n.source),
        Node("map", tuple(extras), n.outputs, Map(ep), n.source),
    ]
