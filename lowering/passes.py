"""Graph-to-graph passes, each a pure function: ``fold_empty``, ``to_maps``, ``fuse_maps``,
``dce`` (the passes around matmuls are :mod:`lowering.matmul_passes`).

* ``fold_empty`` (the first thing ``to_maps`` does) removes the work on values with no elements:
  a node whose results have a zero in their shape becomes an empty constant, a reduction over
  an empty axis (and a matmul with ``K = 0``) becomes the identity of the reduction broadcast to
  its result, and a concatenation drops its empty pieces; the tiler never sees a zero extent;
* ``to_maps`` turns every SFU-side op (elementwise, convert, broadcast, transpose, slice,
  reductions, and reshapes that only add or drop size-1 dims) into a single-op ``map`` node
  whose inputs are read through views;
* ``fuse_maps`` merges a map into the map that consumes it (elementwise ops commute with views,
  so the producer's inputs are read through the composed view): one SFU chain, one stage, no
  round trip through device memory. A producer with several consumers is recomputed in each,
  and a reduction in a consumer that reads it broadcast over the reduced axes, as an
  in-program reduction on the consumer's resident rows: softmax and layernorm become one map
  that loads its input once and stores its output once;
* ``dce`` drops nodes whose results nobody uses.

The passes that look at device layouts (which reshapes are free, what a fusion saves in traffic)
take the card: :func:`lowering.pipeline.graph_passes` binds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from device_model.card import CardSpec
from device_model.layout import layout_for, np_dtype
from device_model.ops import REDUCTIONS, ROW_REDUCTIONS, InputView, MapBody

from .graph import Graph, Node, Var
from .op_params import Broadcast, Elementwise, Map

__all__ = [
    "fold_empty",
    "to_maps",
    "fuse_maps",
    "dce",
    "is_free_reshape",
    "MAX_MAP_INPUTS",
]

MAX_MAP_INPUTS = 8


def is_free_reshape(
    src: tuple[int, ...], dst: tuple[int, ...], dtype: str, stick_bytes: int
) -> bool:
    """A reshape the device does for free: the padded row-major buffers (sticks of
    ``stick_bytes``) coincide."""
    a, b = layout_for(src, dtype, stick_bytes), layout_for(dst, dtype, stick_bytes)
    if a.nbytes != b.nbytes:
        return False
    if src and dst and src[-1] == dst[-1]:
        return True
    return a.device_shape == a.shape and b.device_shape == b.shape and bool(src) and bool(dst)


def _unit_reshape_view(src: tuple[int, ...], dst: tuple[int, ...]) -> InputView | None:
    """The view for a reshape that only inserts or removes size-1 dims, else None."""
    s = [(i, d) for i, d in enumerate(src) if d != 1]
    t = [(i, d) for i, d in enumerate(dst) if d != 1]
    if [d for _, d in s] != [d for _, d in t]:
        return None
    dims = [-1] * len(src)
    for (i, _), (j, _) in zip(s, t, strict=True):
        dims[i] = j
    # size-1 source dims map onto size-1 destination dims in order where possible
    ones_src = [i for i, d in enumerate(src) if d == 1]
    ones_dst = [j for j, d in enumerate(dst) if d == 1]
    for i, j in zip(ones_src, ones_dst, strict=False):
        dims[i] = j
    r = len(src)
    return InputView(tuple(dims), (0,) * r, (1,) * r, (False,) * r)


def _map(
    n: Node,
    inputs: list[Var],
    views: list[InputView],
    program: list,
    space: tuple,
    reduce: str = "",
    axes: tuple[int, ...] = (),
) -> Node:
    body = MapBody(tuple(space), tuple(views), tuple(program), reduce, tuple(axes), n.out.dtype)
    return Node("map", tuple(inputs), n.outputs, Map(body), n.source)


def _single(n: Node, card: CardSpec) -> Node | None:
    op, out = n.op, n.out
    if op == "elementwise":
        nvar = len(n.inputs)
        scal = {pos: (v, dt) for pos, v, dt in n.params.scalars}
        prog: list = []
        regs: list[int] = []
        vi = 0
        for pos in range(nvar + len(scal)):
            if pos in scal:
                v, dt = scal[pos]
                prog.append(("const", (), v, dt))
                regs.append(nvar + len(prog) - 1)
            else:
                regs.append(vi)
                vi += 1
        prog.append((n.params.fn, tuple(regs), n.params.param, out.dtype))
        views = [InputView.identity(len(v.shape)) for v in n.inputs]
        return _map(n, list(n.inputs), views, prog, out.shape)
    if op == "convert":
        (x,) = n.inputs
        prog = [("convert", (0,), out.dtype, out.dtype)]
        return _map(n, [x], [InputView.identity(len(x.shape))], prog, out.shape)
    copy = [("copy", (0,), None, out.dtype)]
    if op == "broadcast":
        (x,) = n.inputs
        shape, dims = n.params.shape, n.params.dims
        if not x.shape:
            view = InputView((), (), (), ())
        else:
            bc = tuple(x.shape[j] == 1 and shape[d] != 1 for j, d in enumerate(dims))
            view = InputView(tuple(dims), (0,) * len(dims), (1,) * len(dims), bc)
        return _map(n, [x], [view], copy, out.shape)
    if op == "transpose":
        (x,) = n.inputs
        perm = n.params.perm
        dims = [0] * len(perm)
        for i, p in enumerate(perm):
            dims[p] = i
        r = len(perm)
        return _map(
            n, [x], [InputView(tuple(dims), (0,) * r, (1,) * r, (False,) * r)], copy, out.shape
        )
    if op == "slice":
        (x,) = n.inputs
        r = len(x.shape)
        view = InputView(tuple(range(r)), n.params.starts, n.params.strides, (False,) * r)
        return _map(n, [x], [view], copy, out.shape)
    if op == "reduce":
        (x,) = n.inputs
        # the values reduced keep the input's dtype: argmax/argmin produce int32 indices, and
        # carrying the values in the result dtype would truncate floats before the comparison
        prog = [("copy", (0,), None, x.dtype)]
        return _map(
            n, [x], [InputView.identity(len(x.shape))], prog, x.shape, n.params.kind, n.params.axes
        )
    if op == "reshape":
        (x,) = n.inputs
        if is_free_reshape(x.shape, out.shape, x.dtype, card.stick_bytes):
            return None
        view = _unit_reshape_view(x.shape, out.shape)
        if view is None:
            return None
        return _map(n, [x], [view], copy, out.shape)
    return None


def _identity(kind: str, dtype: str) -> np.ndarray | None:
    """The value a reduction of ``kind`` gives over no elements (as ``lax.reduce_*`` does), or
    None when it has none (argmax of nothing)."""
    red = REDUCTIONS[kind]
    return None if red.index_of else np.asarray(red.identity_value(np_dtype(dtype)))


def fold_empty(g: Graph) -> Graph:
    """Values with no elements need no computation.

    A node whose results all have a zero in their shape becomes an empty constant (its result
    var is the constant's, so consumers are unchanged); a reduction whose input is empty but
    whose result is not, and a matmul with ``K = 0``, become the identity of the reduction (0
    for sums and matmuls, 1 for products, -inf/+inf for max/min) as a scalar constant broadcast
    to the result; a concatenation drops its empty pieces (a copy when one is left). The graph is
    returned unchanged when nothing has a zero extent.
    """

    def empty(v: Var) -> bool:
        return 0 in v.shape

    if not any(empty(v) for n in g.nodes for v in (*n.inputs, *n.outputs)):
        return g
    nodes: list[Node] = []
    consts = list(g.consts)
    for n in g.nodes:
        if all(empty(o) for o in n.outputs):
            consts.extend((o, np.zeros(o.shape, np_dtype(o.dtype))) for o in n.outputs)
            continue
        out = n.out
        fill = None
        if n.op == "reduce" and empty(n.inputs[0]):
            fill = _identity(n.params.kind, out.dtype)
        elif n.op == "matmul" and n.inputs[0].shape[2] == 0:
            fill = np.zeros((), np_dtype(out.dtype))
        if fill is not None:
            c = Var((), out.dtype)
            consts.append((c, fill))
            ps = Broadcast(out.shape, ())
            nodes.append(Node("broadcast", (c,), n.outputs, ps, n.source))
            continue
        if n.op == "concatenate" and any(empty(v) for v in n.inputs):
            ins = tuple(v for v in n.inputs if not empty(v))
            if len(ins) == 1:
                ps = Elementwise("copy", out.dtype, (), out.shape)
                nodes.append(Node("elementwise", ins, n.outputs, ps, n.source))
            else:
                nodes.append(Node(n.op, ins, n.outputs, n.params, n.source))
            continue
        nodes.append(n)
    return Graph(g.name, g.inputs, tuple(nodes), g.outputs, tuple(consts))


def use_counts(g: Graph) -> dict[int, int]:
    """How many times each value is read (by a node, or as a graph output)."""
    uses: dict[int, int] = {}
    for n in g.nodes:
        for v in n.inputs:
            uses[v.id] = uses.get(v.id, 0) + 1
    for v in g.outputs:
        uses[v.id] = uses.get(v.id, 0) + 1
    return uses


def splice(g: Graph, drop: set[int], replace: dict[int, list[Node]]) -> Graph:
    """``g`` without the nodes in ``drop`` (by identity) and with each node in ``replace`` (by
    identity) replaced by its list, in place; ``g`` itself when nothing changes."""
    if not replace:
        return g
    out: list[Node] = []
    for n in g.nodes:
        if id(n) in drop:
            continue
        out.extend(replace.get(id(n), [n]))
    return Graph(g.name, g.inputs, tuple(out), g.outputs, g.consts)


def to_maps(g: Graph, card: CardSpec) -> Graph:
    """Every SFU-side op becomes a single-op ``map`` node (a reshape that is free on ``card``'s
    layouts stays a reshape). Values with no elements are folded first (:func:`fold_empty`)."""
    g = fold_empty(g)
    nodes = []
    for n in g.nodes:
        m = _single(n, card)
        nodes.append(m if m is not None else n)
    return Graph(g.name, g.inputs, tuple(nodes), g.outputs, g.consts)


def _compose(vp: InputView, vc: InputView) -> InputView:
    """View of a producer's input as seen by the consumer: ``vc`` after ``vp``."""
    dims, starts, strides, bcast = [], [], [], []
    for j in range(len(vp.dims)):
        g = vp.dims[j]
        if g < 0:
            dims.append(-1), starts.append(vp.starts[j]), strides.append(1), bcast.append(False)
            continue
        h, sc, tc, bc = vc.dims[g], vc.starts[g], vc.strides[g], vc.bcast[g]
        base = vp.starts[j] if vp.bcast[j] else vp.starts[j] + sc * vp.strides[j]
        if h < 0:
            dims.append(-1), starts.append(base), strides.append(1), bcast.append(False)
        elif bc or vp.bcast[j]:
            dims.append(h), starts.append(base), strides.append(1), bcast.append(True)
        else:
            dims.append(h), starts.append(base), strides.append(tc * vp.strides[j])
            bcast.append(False)
    return InputView(tuple(dims), tuple(starts), tuple(strides), tuple(bcast))


#: final reductions a producer map may end with and still be recomputed inside its consumer
_FUSIBLE_REDUCE = {"": "", "sum": "rsum", "max": "rmax", "min": "rmin", "prod": "rprod"}


def _space_view(p: Node, c: Node, slot: int) -> InputView | None:
    """How the consumer ``c`` sees the producer map ``p``'s *space* when it reads ``p`` at
    ``slot``; None when ``p``'s program cannot be recomputed inside ``c``.

    For a producer without a final reduction the space is its output: the consumer's view. A
    producer ending in a reduction is recomputed on the consumer's tile, so the consumer must
    read the result broadcast along exactly the reduced axes and have the producer's
    pre-reduction space (the reduced axes land on the consumer dims it broadcasts along, with the
    same extents; its other dims are read one-to-one; spare consumer dims have size 1), and not
    a reduction to a single element (nothing would be left to spread over the cores). Every
    axis reduced inside the producer (its final reduction and its in-program ones) must then be
    a whole consumer dim read one-to-one, so the recomputed reduction covers the same elements.
    """
    pb: MapBody = p.params.body
    cb: MapBody = c.params.body
    if pb.reduce not in _FUSIBLE_REDUCE:
        return None
    vc = cb.views[slot]
    sp, sc = pb.space, cb.space
    if not pb.reduce:
        ext = vc
    elif math.prod(p.out.shape) <= 1:
        return None  # a full reduction: recomputing it would put all the consumer on one core
    else:
        kept = pb.out_space_dims()
        cover = [vc.dims[j] for j in range(len(kept)) if vc.dims[j] >= 0]
        for j, d in enumerate(kept):
            if sp[d] != 1 and not (vc.is_plain(j) and sc[vc.dims[j]] == sp[d]):
                return None
        free = [g for g in range(len(sc)) if g not in cover]
        where: dict[int, int] = {}
        for a in sorted(pb.reduce_axes):
            g = next((g for g in free if sc[g] == sp[a] and g not in where.values()), None)
            if g is None:
                return None
            where[a] = g
        if any(sc[g] != 1 for g in free if g not in where.values()):
            return None
        dims, starts, strides, bcast = [], [], [], []
        for d in range(len(sp)):
            if d in where:
                dims.append(where[d]), starts.append(0), strides.append(1), bcast.append(False)
            else:
                j = kept.index(d)
                dims.append(vc.dims[j]), starts.append(vc.starts[j])
                strides.append(vc.strides[j]), bcast.append(vc.bcast[j])
        ext = InputView(tuple(dims), tuple(starts), tuple(strides), tuple(bcast))
    axes = set(pb.program_reduce_axes())
    if pb.reduce:
        axes.update(pb.reduce_axes)
    for a in axes:
        g = ext.dims[a]
        if not ext.is_plain(a) or sc[g] != sp[a]:
            return None
        if any(ext.dims[d] == g for d in range(len(sp)) if d != a):
            return None
    return ext


def _merge(p: Node, c: Node, slot: int, ext: InputView) -> Node:
    """Fuse producer map ``p`` into consumer map ``c`` at input ``slot``.

    ``ext`` (from :func:`_space_view`) maps ``p``'s space into ``c``'s: ``p``'s inputs are read
    through the composed views, its in-program reductions reduce the consumer dims their axes
    land on, and a final reduction of ``p`` becomes an in-program one whose result ``c`` reads
    broadcast.
    """
    pb: MapBody = p.params.body
    cb: MapBody = c.params.body
    c_ins = [v for i, v in enumerate(c.inputs) if i != slot]
    c_views = [w for i, w in enumerate(cb.views) if i != slot]
    ins = c_ins + list(p.inputs)
    views = c_views + [_compose(vp, ext) for vp in pb.views]
    nin = len(ins)
    nc = len(c.inputs)

    def axes(a: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(ext.dims[x] for x in a))

    def p_reg(r: int) -> int:
        return (nc - 1) + r if r < len(p.inputs) else nin + (r - len(p.inputs))

    prog = [
        (o, tuple(p_reg(a) for a in args), axes(prm) if o in ROW_REDUCTIONS else prm, dt)
        for o, args, prm, dt in pb.program
    ]
    if pb.reduce:
        prog.append(
            (_FUSIBLE_REDUCE[pb.reduce], (nin + len(prog) - 1,), axes(pb.reduce_axes), pb.out_dtype)
        )
    p_res = nin + len(prog) - 1
    n_p = len(prog)

    def c_reg(r: int) -> int:
        if r < nc:
            return p_res if r == slot else (r if r < slot else r - 1)
        return nin + n_p + (r - nc)

    prog += [(o, tuple(c_reg(a) for a in args), prm, dt) for o, args, prm, dt in cb.program]
    body = MapBody(cb.space, tuple(views), tuple(prog), cb.reduce, cb.reduce_axes, cb.out_dtype)
    return _cse(_dedupe(Node("map", tuple(ins), c.outputs, Map(body), c.source)))


def _dedupe(n: Node) -> Node:
    """Merge inputs that are the same var read through the same view."""
    b: MapBody = n.params.body
    seen: dict[tuple[int, InputView], int] = {}
    keep: list[int] = []
    remap: dict[int, int] = {}
    for i, (v, w) in enumerate(zip(n.inputs, b.views, strict=True)):
        key = (v.id, w)
        if key in seen:
            remap[i] = seen[key]
        else:
            seen[key] = len(keep)
            remap[i] = len(keep)
            keep.append(i)
    if len(keep) == len(n.inputs):
        return n
    nin_old, nin = len(n.inputs), len(keep)

    def reg(r: int) -> int:
        return remap[r] if r < nin_old else r - nin_old + nin

    prog = tuple((o, tuple(reg(a) for a in args), p, dt) for o, args, p, dt in b.program)
    body = MapBody(
        b.space, tuple(b.views[i] for i in keep), prog, b.reduce, b.reduce_axes, b.out_dtype
    )
    return Node("map", tuple(n.inputs[i] for i in keep), n.outputs, Map(body), n.source)


def _cse(n: Node) -> Node:
    """Drop program ops that repeat an earlier op on the same registers (a producer recomputed
    twice in one consumer, once per path, is computed once). The last op, the result, stays."""
    b: MapBody = n.params.body
    nin = len(n.inputs)
    first: dict[tuple, int] = {}
    remap: dict[int, int] = {}
    prog: list = []
    last = len(b.program) - 1
    for k, (o, args, prm, dt) in enumerate(b.program):
        args = tuple(remap.get(a, a) for a in args)
        key = (o, args, type(prm).__name__, repr(prm), dt)
        if key in first and k != last:
            remap[nin + k] = first[key]
            continue
        remap[nin + k] = nin + len(prog)
        first.setdefault(key, nin + len(prog))
        prog.append((o, args, prm, dt))
    if len(prog) == len(b.program):
        return n
    body = MapBody(b.space, b.views, tuple(prog), b.reduce, b.reduce_axes, b.out_dtype)
    return Node("map", n.inputs, n.outputs, Map(body), n.source)


def _is_view_only(n: Node) -> bool:
    b: MapBody = n.params.body
    return (
        len(b.program) == 1
        and b.program[0][0] == "copy"
        and not b.reduce
        and n.inputs[0].dtype == n.out.dtype
    )


def _merge_slot(p: Node, c: Node, slot: int) -> Node | None:
    """``p`` merged into ``c`` at ``slot``, or None when ``c`` cannot take it there."""
    if len(c.inputs) - 1 + len(p.inputs) > MAX_MAP_INPUTS:
        return None
    ext = _space_view(p, c, slot)
    return None if ext is None else _merge(p, c, slot, ext)


def _absorb(p: Node, c: Node) -> Node | None:
    """``c`` with the producer ``p`` merged into every input slot that reads it, or None when
    a slot cannot take it."""
    while (slot := next((i for i, v in enumerate(c.inputs) if v.id == p.out.id), None)) is not None:
        merged = _merge_slot(p, c, slot)
        if merged is None:
            return None
        c = merged
    return c


def _worth(p: Node, consumers: list[Node], stick_bytes: int) -> bool:
    """Recomputing ``p`` in each consumer moves no more device-memory bytes than storing its
    result once and loading it in each: each consumer loads ``p``'s inputs it did not read."""

    def _nbytes(v: Var) -> int:
        return layout_for(v.shape, v.dtype, stick_bytes).nbytes

    ins = {v.id: v for v in p.inputs}
    before = sum(map(_nbytes, ins.values())) + _nbytes(p.out) * (1 + len(consumers))
    after = sum(
        _nbytes(v) for c in consumers for i, v in ins.items() if i not in {u.id for u in c.inputs}
    )
    return after <= before


class _Fuser:
    """One :func:`fuse_maps` run: the graph's outputs, the ``fits`` check, the card's stick size
    and a memo of the merges tried (nodes are immutable, so a merge tried once need not be tried
    again)."""

    def __init__(self, outputs: set[int], fits: Callable[[Node], bool] | None, stick_bytes: int):
        self.outputs, self.fits, self.stick_bytes = outputs, fits, stick_bytes
        # keyed by the nodes' identities (hashing a node hashes its whole body); the entry
        # keeps the nodes alive so that an id is never reused for another node
        self.memo: dict[tuple, tuple[tuple, Node | None]] = {}

    def _checked(self, key: tuple, make: Callable[[], Node | None]) -> Node | None:
        ikey = tuple(id(k) if isinstance(k, Node) else k for k in key)
        if ikey not in self.memo:
            m = make()
            ok = m is not None and (self.fits is None or self.fits(m))
            self.memo[ikey] = (key, m if ok else None)
        return self.memo[ikey][1]

    def chain(self, nodes: list[Node]) -> bool:
        """The chain fusions, in place, in one forward pass: each consumer in order takes its
        producers (a map without a final reduction that only it reads, or a view it reads), one
        slot at a time, until none is left. True when anything merged.

        One pass is enough: a merge changes only its consumer (the producer, when only that
        consumer read it, is left dead for :func:`dce`), so the consumers before it see the
        same producers and uses as before.
        """
        producer = {n.out.id: n for n in nodes if n.op == "map"}
        uses: dict[int, list[int]] = {}
        for i, n in enumerate(nodes):
            for v in n.inputs:
                uses.setdefault(v.id, []).append(i)
        changed = False
        for ci in range(len(nodes)):
            while nodes[ci].op == "map" and (m := self._chain_one(nodes[ci], ci, producer, uses)):
                c = nodes[ci]
                for v in c.inputs:
                    uses[v.id].remove(ci)
                for v in m.inputs:
                    uses.setdefault(v.id, []).append(ci)
                nodes[ci] = m
                producer[m.out.id] = m
                changed = True
        return changed

    def _chain_one(
        self, c: Node, ci: int, producer: dict[int, Node], uses: dict[int, list[int]]
    ) -> Node | None:
        for slot, v in enumerate(c.inputs):
            p = producer.get(v.id)
            if p is None or p is c or p.params.body.reduce:
                continue
            exclusive = v.id not in self.outputs and all(u == ci for u in uses[v.id])
            if not (exclusive or _is_view_only(p)):
                continue
            if sum(1 for x in c.inputs if x.id == v.id) > 1 and not exclusive:
                continue
            m = self._checked((p, c, slot), lambda p=p, c=c, slot=slot: _merge_slot(p, c, slot))
            if m is not None:
                return m
        return None

    def absorb(self, nodes: list[Node]) -> list[Node] | None:
        """The recomputations of one round: each producer (one ending in a reduction too) that
        merges into all its consumers at once and is worth it, in order, skipping one that
        touches a node an earlier one of the round changed (it is tried again next round); None
        when there is none. Every node it leaves behind is either one the chain fusions made or
        a merge that ``fits``, so it never makes a graph the tiler cannot schedule."""
        uses: dict[int, list[int]] = {}
        for i, n in enumerate(nodes):
            for v in n.inputs:
                uses.setdefault(v.id, []).append(i)
        out = list(nodes)
        touched: set[int] = set()
        for pi, p in enumerate(nodes):
            if p.op != "map" or p.out.id in self.outputs or p.out.id not in uses:
                continue
            users = list(dict.fromkeys(uses[p.out.id]))
            if pi in touched or touched.intersection(users):
                continue
            if any(nodes[i].op != "map" for i in users):
                continue
            merged = {}
            for i in users:
                c = nodes[i]
                m = self._checked((p, c), lambda p=p, c=c: _absorb(p, c))
                if m is None:
                    break
                merged[i] = m
            else:
                if _worth(p, [nodes[i] for i in users], self.stick_bytes):
                    for i, m in merged.items():
                        out[i] = m
                    touched.update(users)
                    touched.add(pi)
        return out if touched else None


def fuse_maps(g: Graph, card: CardSpec, fits: Callable[[Node], bool] | None = None) -> Graph:
    """Merge producer maps into consumer maps until nothing more fuses.

    A map merges into its only consumer (a view into any consumer); then a producer, also one
    ending in a reduction, is recomputed in all its consumers at once when each can take it
    (:func:`_space_view`: a reduction only into a consumer that reads it broadcast over the
    reduced axes and has its pre-reduction space) and recomputing moves no more bytes
    (:func:`_worth`, counted in ``card``'s stick layouts). With ``fits``, each merged map must
    still be schedulable (``fits(node)``; the pipeline passes the tiler's check for the card): a
    fusion that would need whole rows the scratchpad cannot hold is not made, and the unfused
    stages are scheduled instead.
    """
    fuser = _Fuser({v.id for v in g.outputs}, fits, card.stick_bytes)

    def pruned(nodes: list[Node]) -> list[Node]:
        return list(dce(Graph(g.name, g.inputs, tuple(nodes), g.outputs, g.consts)).nodes)

    nodes = list(g.nodes)
    while True:
        if fuser.chain(nodes):
            nodes = pruned(nodes)
        fused = fuser.absorb(nodes)
        if fused is None:
            break
        nodes = pruned(fused)
    return Graph(g.name, g.inputs, tuple(nodes), g.outputs, g.consts)


def dce(g: Graph) -> Graph:
    """Drop nodes whose outputs are not used (and constants nobody reads)."""
    live = {v.id for v in g.outputs}
    keep = []
    for n in reversed(g.nodes):
        if any(o.id in live for o in n.outputs):
            keep.append(n)
            live.update(v.id for v in n.inputs)
    consts = tuple((v, a) for v, a in g.consts if v.id in live)
    return Graph(g.name, g.inputs, tuple(reversed(keep)), g.outputs, consts)
