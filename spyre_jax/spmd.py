"""``spyre_jax.jit(f, in_shardings=..., out_shardings=...)``: a function of global arrays,
partitioned over a mesh of simulated cards.

JAX's ``jit`` hands a function and its arguments' shardings to XLA's SPMD partitioner, which
propagates the shardings through the program and inserts the collectives the cards need. This
module does the same on the traced jaxpr, for the card model: it interprets the jaxpr inside a
``jax.shard_map`` over the mesh, each value carried as its local shard with its *spec* (per
dimension, the mesh axis it is split over, or None), and writes the per-card program:

- elementwise primitives keep their operands' common spec (an operand replicated where another
  is split is sliced locally: no transfer);
- ``dot_general`` contracts locally and, where the contracted dimension is split, sums the
  partial products across the cards (``psum``: Megatron's row-parallel layer); split batch
  and free dimensions stay split (column-parallel);
- reductions over a split dimension reduce locally, then across the cards (``psum``/``pmax``/
  ``pmin``); ``transpose``, ``broadcast_in_dim`` and ``reshape`` carry their operand's spec
  to the dimensions it maps to (a reshape keeps a split dimension when it is the major one of
  the dimensions it merges or splits into);
- nested ``jit``, ``custom_jvp``/``custom_vjp`` and ``checkpoint`` calls are inlined;
- every other primitive (loops, branches, gathers, sorts, ...) runs replicated on its gathered
  operands (``all_gather``): always correct, and what a partitioner without a rule for it does.

The outputs are resharded to ``out_shardings`` where given, else left as propagated. The result
is a ``shard_map`` program, which :mod:`spyre_jax.multicard` compiles (one schedule per card,
collectives on the card-to-card link) and runs. Shardings are ``NamedSharding`` s over a mesh of
:func:`spyre_jax.devices`, one mesh axis per array dimension at most.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["check_shardings", "leaf_shardings", "partition", "specs_of"]

#: per array dimension: the mesh axis it is split over, or None (replicated)
Spec = tuple[str | None, ...]

#: primitives applied element by element to operands of one shape (scalar operands replicated)
ELEMENTWISE = frozenset(
    """add sub mul div rem pow max min neg sign floor ceil round is_finite exp exp2 log log1p
    expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt
    cbrt square integer_pow abs erf erfc erf_inv lgamma digamma convert_element_type
    reduce_precision select_n clamp eq ne lt le gt ge and or not xor shift_left
    shift_right_logical shift_right_arithmetic nextafter copy copy_p real imag conj
    population_count stop_gradient""".split()
)
#: reductions: the collective that finishes one over a split dimension
_REDUCE = {"reduce_sum": lax.psum, "reduce_max": lax.pmax, "reduce_min": lax.pmin}
#: call-like primitives inlined: the param that holds their jaxpr
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
}


# ---------------------------------------------------------------------------------------------
# the user's shardings


def _spec_of(sharding: Any, ndim: int, where: str) -> tuple[Spec, Any]:
    """``(spec, mesh)`` of one argument's or result's sharding (None: replicated, no mesh)."""
    if sharding is None:
        return (None,) * ndim, None
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"spyre_jax.jit: {where}: a sharding is a jax.sharding.NamedSharding over a mesh of "
            f"spyre_jax.devices() (or None), not {type(sharding).__name__}"
        )
    entries = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    if len(entries) > ndim:
        raise ValueError(
            f"spyre_jax.jit: {where}: {sharding.spec} has more entries than the array's "
            f"{ndim} dimensions"
        )
    spec: list[str | None] = []
    for e in entries:
        if isinstance(e, tuple | list):
            if len(e) > 1:
                raise NotImplementedError(
                    f"spyre_jax.jit: {where}: {sharding.spec} splits one dimension over several "
                    "mesh axes; one axis per dimension is supported"
                )
            e = e[0] if e else None
        if e is not None and e in spec:
            raise ValueError(
                f"spyre_jax.jit: {where}: mesh axis {e!r} used twice in {sharding.spec}"
            )
        spec.append(e)
    return tuple(spec), sharding.mesh


def _is_sharding(x: Any) -> bool:
    return x is None or isinstance(x, jax.sharding.Sharding)


def check_shardings(shardings: Any, what: str) -> None:
    """Refuse (TypeError) a leaf of ``shardings`` that is neither a sharding nor None."""
    for leaf in jax.tree_util.tree_leaves(shardings, is_leaf=_is_sharding):
        if not _is_sharding(leaf):
            raise TypeError(
                f"spyre_jax.jit: {what} takes jax.sharding.NamedSharding s (or None), not "
                f"{type(leaf).__name__}"
            )


def leaf_shardings(prefix: Any, tree: Any, what: str) -> list[Any]:
    """Per leaf of ``tree`` (in flattening order), its sharding: ``prefix`` is a pytree prefix
    of ``tree`` whose leaves are shardings or None (a single one applies to every leaf)."""
    try:
        per = jax.tree_util.tree_map(
            lambda s, sub: [s] * len(jax.tree_util.tree_leaves(sub)),
            prefix,
            tree,
            is_leaf=_is_sharding,
        )
    except ValueError as e:
        raise ValueError(f"spyre_jax.jit: {what} is not a prefix of the values: {e}") from None
    return [
        s
        for lst in jax.tree_util.tree_leaves(per, is_leaf=lambda x: isinstance(x, list))
        for s in lst
    ]


def specs_of(shardings: Sequence[Any], ndims: Sequence[int], what: str) -> tuple[list[Spec], Any]:
    """The specs of arrays of ranks ``ndims`` with these shardings, and the one mesh they name
    (None when every one is None)."""
    specs, meshes = [], {}
    for i, (sh, nd) in enumerate(zip(shardings, ndims, strict=True)):
        spec, mesh = _spec_of(sh, nd, f"{what}, leaf {i}")
        specs.append(spec)
        if mesh is not None:
            meshes[id(mesh)] = mesh
    if len(meshes) > 1:
        raise ValueError(f"spyre_jax.jit: {what} name {len(meshes)} different meshes; use one")
    return specs, next(iter(meshes.values()), None)


# ---------------------------------------------------------------------------------------------
# resharding inside the shard_map body


class _Ctx:
    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes

    def gather(self, x: Any, spec: Spec, dims: Sequence[int]) -> tuple[Any, Spec]:
        s = list(spec)
        for d in dims:
            if s[d] is not None:
                x = lax.all_gather(x, s[d], axis=d, tiled=True)
                s[d] = None
        return x, tuple(s)

    def replicate(self, x: Any, spec: Spec) -> Any:
        return self.gather(x, spec, range(len(spec)))[0]

    def reshard(self, x: Any, spec: Spec, want: Spec) -> Any:
        x, spec = self.gather(
            x, spec, [d for d, (a, b) in enumerate(zip(spec, want, strict=True)) if a != b]
        )
        for d, (a, b) in enumerate(zip(spec, want, strict=True)):
            if b is not None and a is None:  # replicated -> split: this card's block
                n = x.shape[d] // self.sizes[b]
                x = lax.dynamic_slice_in_dim(x, lax.axis_index(b) * n, n, d)
        return x

    def local(self, shape: Sequence[int], spec: Spec) -> tuple[int, ...]:
        return tuple(n // self.sizes[a] if a else n for n, a in zip(shape, spec, strict=True))

    def splittable(self, n: int, axis: str | None) -> bool:
        return axis is None or n % self.sizes[axis] == 0


def _aval(v: Any) -> Any:
    return v.aval


def _merge(specs: Sequence[Spec], shapes: Sequence[tuple[int, ...]], ctx: _Ctx) -> Spec:
    """One spec for operands of one shape: per dimension the first split found, each mesh axis
    used once."""
    nd = len(shapes[0])
    out: list[str | None] = [None] * nd
    for spec in specs:
        for d, a in enumerate(spec):
            if a is not None and out[d] is None and a not in out:
                if ctx.splittable(shapes[0][d], a):
                    out[d] = a
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# the interpreter


Rule = Callable[[Any, list[Any], list[Spec], _Ctx], tuple[list[Any], list[Spec]]]


def _bind(eqn: Any, vals: Sequence[Any], **params: Any) -> list[Any]:
    p = {**eqn.params, **params}
    bind_params = eqn.primitive.get_bind_params(p)
    subfuns: Sequence[Any] = ()
    if isinstance(bind_params, tuple):  # (JAX before 0.7: the sub-functions, the params)
        subfuns, bind_params = bind_params
    out = eqn.primitive.bind(*subfuns, *vals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _replicated(eqn: Any, vals: list[Any], specs: list[Spec], ctx: _Ctx):
    vals = [ctx.replicate(v, s) for v, s in zip(vals, specs, strict=True)]
    outs = _bind(eqn, vals)
    return outs, [(None,) * len(_aval(o).shape) for o in eqn.outvars]


def _fits(s: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """An operand's shape ``s`` against the result's: equal, of its rank with size-1
    dimensions (JAX broadcasts those), or a scalar (replicated)."""
    if s == ():
        return True
    return len(s) == len(shape) and all(a in (b, 1) for a, b in zip(s, shape, strict=True))


def _elementwise(eqn: Any, vals: list[Any], specs: list[Spec], ctx: _Ctx):
    shape = tuple(_aval(eqn.outvars[0]).shape)
    shapes = [tuple(_aval(v).shape) for v in eqn.invars]
    if not all(_fits(s, shape) for s in shapes):
        return _replicated(eqn, vals, specs, ctx)

    def own(spec: Spec, s: tuple[int, ...]) -> Spec:  # a size-1 dimension is never split
        return tuple(a if n == m else None for a, n, m in zip(spec, s, shape, strict=True))

    ranked = [own(sp, s) for sp, s in zip(specs, shapes, strict=True) if s != ()]
    spec = _merge(ranked or [(None,) * len(shape)], [shape], ctx)
    vals = [
        ctx.reshard(v, sp, own(spec, s)) if s != () else v
        for v, sp, s in zip(vals, specs, shapes, strict=True)
    ]
    return _bind(eqn, vals), [spec] * len(eqn.outvars)


def _transpose(eqn: Any, vals: list[Any], specs: list[Spec], ctx: _Ctx):
    perm = eqn.params["permutation"]
    return _bind(eqn, vals), [tuple(specs[0][p] for p in perm)]


def _broadcast(eqn: Any, vals: list[Any], specs: list[Spec], ctx: _Ctx):
    shape, bdims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    if len(vals) != 1:  # dynamic shapes: not on the card
        return _replicated(eqn, vals, specs, ctx)
    in_shape = _aval(eqn.invars[0]).shape
    spec: list[str | None] = [None] * len(shape)
    keep = list(specs[0])
    for i, d in enumerate(bdims):
        if keep[i] is not None and in_shape[i] == shape[d]:
            spec[d] = keep[i]
        else:
            keep[i] = None
    x = ctx.reshard(vals[0], specs[0], tuple(keep))
    out = _bind(eqn, [x], shape=ctx.local(shape, tuple(spec)))
    return out, [tuple(spec)]


def _reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """The dimensions of shapes ``a`` and ``b`` in runs of equal products (None if none)."""
    groups, i, j = [], 0, 0
    try:
        while i < len(a) and j < len(b):
            gi, gj, pa, pb = [i], [j], a[i], b[j]
            i, j = i + 1, j + 1
            while pa != pb:
                if pa < pb:
                    pa, i = pa * a[i], i + 1
                    gi.append(i - 1)
                else:
                    pb, j = pb * b[j], j + 1
                    gj.append(j - 1)
            groups.append((gi, gj))
    except IndexError:
        return None
    if any(n != 1 for n in (*a[i:], *b[j:])):
        return None
    return groups


def _reshape(eqn: Any, vals: list[Any], specs: list[Spec], ctx: _Ctx):
    if eqn.params.get("dimensions") is not None or len(vals) != 1:
        return _replicated(eqn, vals, specs, ctx)
    a = tuple(_aval(eqn.invars[0]).shape)
    b = tuple(eqn.params["new_sizes"])
    groups = _reshape_groups(a, b)
    spec = specs[0]
    if groups is None:
        return _replicated(eqn, vals, specs, ctx)
    keep = [None] * len(a)
    out: list[str | None] = [None] * len(b)
    for gi, gj in groups:
        ax = spec[gi[0]] if gi else None
        if ax is not None and gj and b[gj[0]] % ctx.sizes[ax] == 0:
            keep[gi[0]] = ax
            out[gj[0]] = ax
    x = ctx.reshard(vals[0], spec, tuple(keep))
    return _bind(eqn, [x], new_sizes=ctx.local(b, tuple(out))), [tuple(out)]


def _reduce(eqn: Any, vals: list[Any], specs: list[Spec], ctx: _Ctx):
    axes = tuple(eqn.params["axes"])
    spec = specs[0]
    outs = _bind(eqn, vals)
    split = tuple(spec[d] for d in axes if spec[d] is not None)
    if split:
        outs = [_REDUCE[eqn.primitive.name](o, split) for o in outs]
    return outs, [tuple(a for d, a in enumerate(spec) if d not in axes)]


def _dot(eqn: Any, vals: list[Any], specs: list[Spec], ctx: _Ctx):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = list(specs[0]), list(specs[1])
    lshape = _aval(eqn.invars[0]).shape
    used: set[str] = set()
    lw: list[str | None] = [None] * len(ls)
    rw: list[str | None] = [None] * len(rs)
    summed: list[str] = []
    for pairs, contract in (((lb, rb), False), ((lc, rc), True)):
        for i, j in zip(*pairs, strict=True):
            ax = ls[i] or rs[j]
            if ax is not None and ax not in used and ctx.splittable(lshape[i], ax):
                lw[i] = rw[j] = ax
                used.add(ax)
                if contract:
                    summed.append(ax)
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
    for side, free, want in ((ls, lfree, lw), (rs, rfree, rw)):
        for d in free:
            if side[d] is not None and side[d] not in used:
                want[d] = side[d]
                used.add(side[d])
    x = ctx.reshard(vals[0], specs[0], tuple(lw))
    y = ctx.reshard(vals[1], specs[1], tuple(rw))
    (out,) = _bind(eqn, [x, y])
    if summed:
        out = lax.psum(out, tuple(summed))
    spec = tuple([lw[i] for i in lb] + [lw[d] for d in lfree] + [rw[d] for d in rfree])
    return [out], [spec]


def _constraint(eqn: Any, vals: list[Any], specs: list[Spec], ctx: _Ctx):
    """``jax.lax.with_sharding_constraint``: the value resharded as asked (a sharding this
    module does not take, or a split that is not even, leaves it as it is)."""
    sh = eqn.params.get("sharding")
    shape = tuple(_aval(eqn.invars[0]).shape)
    try:
        want, _ = _spec_of(sh, len(shape), "with_sharding_constraint")
    except (TypeError, ValueError, NotImplementedError):
        return vals, specs
    want = tuple(
        a if a in ctx.sizes and ctx.splittable(n, a) else None
        for n, a in zip(shape, want, strict=True)
    )
    return [ctx.reshard(vals[0], specs[0], want)], [want]


def _nested_shard_map(eqn: Any, vals: list[Any], specs: list[Spec], ctx: _Ctx):
    raise NotImplementedError(
        "spyre_jax.jit: a jax.shard_map inside a function given in_shardings/out_shardings; "
        "write the whole function as one shard_map (without shardings) or drop the shard_map"
    )


_RULES: dict[str, Rule] = {
    "sharding_constraint": _constraint,
    "shard_map": _nested_shard_map,
    "transpose": _transpose,
    "broadcast_in_dim": _broadcast,
    "reshape": _reshape,
    "dot_general": _dot,
    **dict.fromkeys(_REDUCE, _reduce),
}


def _interpret(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[tuple[Any, Spec]], ctx: _Ctx
) -> list[tuple[Any, Spec]]:
    env: dict[Any, tuple[Any, Spec]] = {}

    def read(v: Any) -> tuple[Any, Spec]:
        if isinstance(v, jcore.Literal):
            return v.val, (None,) * len(getattr(v.aval, "shape", ()))
        return env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = (c, (None,) * len(_aval(v).shape))
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        vals, specs = [i[0] for i in ins], [i[1] for i in ins]
        name = eqn.primitive.name
        if name in _CALLS and _CALLS[name] in eqn.params:
            inner = eqn.params[_CALLS[name]]
            closed = inner if hasattr(inner, "jaxpr") else jcore.ClosedJaxpr(inner, ())
            res = _interpret(closed.jaxpr, closed.consts, ins, ctx)
            outs, ospecs = [r[0] for r in res], [r[1] for r in res]
        elif name in _RULES:
            outs, ospecs = _RULES[name](eqn, vals, specs, ctx)
        elif name in ELEMENTWISE:
            outs, ospecs = _elementwise(eqn, vals, specs, ctx)
        else:
            outs, ospecs = _replicated(eqn, vals, specs, ctx)
        for v, o, s in zip(eqn.outvars, outs, ospecs, strict=True):
            env[v] = (o, s)
    return [read(v) for v in jaxpr.outvars]


def partition(
    closed: Any, in_specs: Sequence[Spec], out_specs: Sequence[Spec | None], mesh: Any
) -> Any:
    """The closed jaxpr of one ``shard_map`` over ``mesh`` that computes ``closed`` on global
    arrays split by ``in_specs``; its results split by ``out_specs`` (None: as propagated)."""
    sizes = dict(mesh.shape)
    ctx = _Ctx(sizes)
    given = [(s, a) for s, a in zip(out_specs, closed.out_avals, strict=True) if s is not None]
    for spec, aval in [*zip(in_specs, closed.in_avals, strict=True), *given]:
        for n, a in zip(aval.shape, spec, strict=True):
            if a is not None and a not in sizes:
                raise ValueError(f"spyre_jax.jit: mesh axis {a!r} is not one of {tuple(sizes)}")
            if not ctx.splittable(n, a):
                raise ValueError(
                    f"spyre_jax.jit: a dimension of {n} does not split evenly over mesh axis "
                    f"{a!r} of {sizes[a]} cards"
                )
    chosen: list[Spec] = []

    def body(*xs: Any) -> list[Any]:
        res = _interpret(closed.jaxpr, closed.consts, list(zip(xs, in_specs, strict=True)), ctx)
        outs = []
        chosen.clear()
        for (v, s), want in zip(res, out_specs, strict=True):
            target = s if want is None else want
            outs.append(ctx.reshard(v, s, target))
            chosen.append(target)
        return outs

    pspecs = [PartitionSpec(*s) for s in in_specs]
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    n_out = len(closed.out_avals)

    def traced(outs: Sequence[PartitionSpec]) -> Any:
        sm = jax.shard_map(
            body, mesh=mesh, in_specs=tuple(pspecs), out_specs=list(outs), check_vma=False
        )
        return jax.make_jaxpr(lambda *a: list(sm(*a)))(*shapes)

    traced([PartitionSpec()] * n_out)  # finds the propagated output specs
    return traced([PartitionSpec(*s) for s in chosen])
