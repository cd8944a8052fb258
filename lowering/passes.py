"""Graph-to-graph passes, each a pure function: ``to_maps``, ``fuse_maps``, ``dce``.

* ``to_maps`` turns every SFU-side op (elementwise, convert, broadcast, transpose, slice,
  reductions, and reshapes that only add or drop size-1 dims) into a single-op ``map`` node
  whose inputs are read through views;
* ``fuse_maps`` merges a map into the map that consumes it (elementwise ops commute with views,
  so the producer's inputs are read through the composed view): one SFU chain, one stage, no
  round trip through device memory;
* ``dce`` drops nodes whose results nobody uses.
"""

from __future__ import annotations

from device_model.layout import layout_for
from device_model.ops import InputView, MapBody

from .graph import Graph, Node, Var, params

__all__ = ["to_maps", "fuse_maps", "dce", "is_free_reshape", "MAX_MAP_INPUTS"]

MAX_MAP_INPUTS = 8


def is_free_reshape(src: tuple[int, ...], dst: tuple[int, ...], dtype: str) -> bool:
    """A reshape the device does for free: the padded row-major buffers coincide."""
    a, b = layout_for(src, dtype), layout_for(dst, dtype)
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
    return Node("map", tuple(inputs), n.outputs, params(body=body), n.source)


def _single(n: Node) -> Node | None:
    op, out = n.op, n.out
    if op == "elementwise":
        nvar = len(n.inputs)
        scal = {pos: (v, dt) for pos, v, dt in n.p("scalars", ())}
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
        prog.append((n.p("fn"), tuple(regs), n.p("param"), out.dtype))
        views = [InputView.identity(len(v.shape)) for v in n.inputs]
        return _map(n, list(n.inputs), views, prog, out.shape)
    if op == "convert":
        (x,) = n.inputs
        prog = [("convert", (0,), out.dtype, out.dtype)]
        return _map(n, [x], [InputView.identity(len(x.shape))], prog, out.shape)
    copy = [("copy", (0,), None, out.dtype)]
    if op == "broadcast":
        (x,) = n.inputs
        shape, dims = n.p("shape"), n.p("dims")
        if not x.shape:
            view = InputView((), (), (), ())
        else:
            bc = tuple(x.shape[j] == 1 and shape[d] != 1 for j, d in enumerate(dims))
            view = InputView(tuple(dims), (0,) * len(dims), (1,) * len(dims), bc)
        return _map(n, [x], [view], copy, out.shape)
    if op == "transpose":
        (x,) = n.inputs
        perm = n.p("perm")
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
        view = InputView(tuple(range(r)), tuple(n.p("starts")), tuple(n.p("strides")), (False,) * r)
        return _map(n, [x], [view], copy, out.shape)
    if op == "reduce":
        (x,) = n.inputs
        # the values reduced keep the input's dtype: argmax/argmin produce int32 indices, and
        # carrying the values in the result dtype would truncate floats before the comparison
        prog = [("copy", (0,), None, x.dtype)]
        return _map(
            n, [x], [InputView.identity(len(x.shape))], prog, x.shape, n.p("kind"), n.p("axes")
        )
    if op == "reshape":
        (x,) = n.inputs
        if is_free_reshape(x.shape, out.shape, x.dtype):
            return None
        view = _unit_reshape_view(x.shape, out.shape)
        if view is None:
            return None
        return _map(n, [x], [view], copy, out.shape)
    return None


def to_maps(g: Graph) -> Graph:
    """Every SFU-side op becomes a single-op ``map`` node."""
    nodes = []
    for n in g.nodes:
        m = _single(n)
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


def _merge(p: Node, c: Node, slot: int) -> Node:
    """Fuse producer map ``p`` into consumer map ``c`` at input ``slot``."""
    pb: MapBody = p.p("body")
    cb: MapBody = c.p("body")
    vc = cb.views[slot]
    c_ins = [v for i, v in enumerate(c.inputs) if i != slot]
    c_views = [w for i, w in enumerate(cb.views) if i != slot]
    ins = c_ins + list(p.inputs)
    views = c_views + [_compose(vp, vc) for vp in pb.views]
    nin = len(ins)
    nc = len(c.inputs)
    p_res = nin + len(pb.program) - 1

    def p_reg(r: int) -> int:
        return (nc - 1) + r if r < len(p.inputs) else nin + (r - len(p.inputs))

    def c_reg(r: int) -> int:
        if r < nc:
            return p_res if r == slot else (r if r < slot else r - 1)
        return nin + len(pb.program) + (r - nc)

    prog = [(o, tuple(p_reg(a) for a in args), prm, dt) for o, args, prm, dt in pb.program]
    prog += [(o, tuple(c_reg(a) for a in args), prm, dt) for o, args, prm, dt in cb.program]
    body = MapBody(cb.space, tuple(views), tuple(prog), cb.reduce, cb.reduce_axes, cb.out_dtype)
    return _dedupe(Node("map", tuple(ins), c.outputs, params(body=body), c.source))


def _dedupe(n: Node) -> Node:
    """Merge inputs that are the same var read through the same view."""
    b: MapBody = n.p("body")
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
    return Node("map", tuple(n.inputs[i] for i in keep), n.outputs, params(body=body), n.source)


def _is_view_only(n: Node) -> bool:
    b: MapBody = n.p("body")
    return (
        len(b.program) == 1
        and b.program[0][0] == "copy"
        and not b.reduce
        and n.inputs[0].dtype == n.out.dtype
    )


def fuse_maps(g: Graph) -> Graph:
    """Merge producer maps into consumer maps until nothing more fuses."""
    nodes = list(g.nodes)
    outputs = {v.id for v in g.outputs}
    changed = True
    while changed:
        changed = False
        producer = {n.out.id: n for n in nodes if n.op == "map" and not n.p("body").reduce}
        uses: dict[int, list[Node]] = {}
        for n in nodes:
            for v in n.inputs:
                uses.setdefault(v.id, []).append(n)
        for ci, c in enumerate(nodes):
            if c.op != "map":
                continue
            for slot, v in enumerate(c.inputs):
                p = producer.get(v.id)
                if p is None:
                    continue
                users = uses[v.id]
                exclusive = v.id not in outputs and all(u is c for u in users)
                if not (exclusive or _is_view_only(p)):
                    continue
                if sum(1 for x in c.inputs if x.id == v.id) > 1 and not exclusive:
                    continue
                if len(c.inputs) - 1 + len(p.inputs) > MAX_MAP_INPUTS:
                    continue
                merged = _merge(p, c, slot)
                # all slots reading v the same way were deduped; re-fuse any left next round
                nodes[ci] = merged
                changed = True
                break
            if changed:
                break
        if changed:
            nodes = list(dce(Graph(g.name, g.inputs, tuple(nodes), g.outputs, g.consts)).nodes)
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
