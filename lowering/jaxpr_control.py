"""The JAX importer's rules for loops, branches and traced indexing: ``scan``, ``while`` and
``cond`` (each body imported as a graph of its own: the host program's loops and branches,
:mod:`lowering.control`), ``dynamic_slice``, ``dynamic_update_slice``, scatter, ``rev``,
``stack``, ``unstack``, ``bitcast_convert_type``, the windowed reductions (pooling) and the
derivative of max/min pooling (``select_and_scatter_add``). They register into
:data:`lowering.from_jaxpr.RULES` when ``lowering.from_jaxpr`` imports this module; bodies are
imported with :data:`lowering.jaxpr_common.import_body`."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from device_model.layout import np_dtype
from device_model.reductions import identity_value

from . import conv_ops, indexing, jaxpr_common
from .builder import Builder, Lit
from .errors import LoweringError
from .graph import Graph, Var
from .jaxpr_common import aval as _aval
from .jaxpr_common import rule

__all__: list[str] = []


# ---------------------------------------------------------------------------------------------
# rules: control flow (each body a graph of its own: the host program's loops and branches)


def _sub(b: Builder, closed: Any, name: str) -> Graph:
    """A loop's or a branch's closed jaxpr as a graph (its constants its own)."""
    return jaxpr_common.import_body(closed, name=name, source=b.source)


def _vars(b: Builder, args: list[Any], invars: list[Any]) -> list[Var]:
    return [
        b.as_var(a, _aval(v)[0]) if isinstance(a, Lit) else a
        for a, v in zip(args, invars, strict=True)
    ]


def _outs(eqn: Any) -> list[tuple[tuple[int, ...], str]]:
    return [_aval(v) for v in eqn.outvars]


@rule("scan")
def _scan(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    p = eqn.params
    length = int(p["length"])
    unroll = p.get("unroll", 1)
    unroll = length if unroll is True else max(1, int(unroll or 1))
    return b.emit_many(
        "scan",
        _vars(b, args, eqn.invars),
        _outs(eqn),
        body=_sub(b, p["jaxpr"], "scan_body"),
        length=length,
        num_consts=int(p["num_consts"]),
        num_carry=int(p["num_carry"]),
        reverse=bool(p["reverse"]),
        unroll=min(unroll, max(length, 1)),
    )


@rule("while")
def _while(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    nc, nb = int(p["cond_nconsts"]), int(p["body_nconsts"])
    ins = _vars(b, args, eqn.invars)
    if cond.out_avals[0].shape != ():  # a batched predicate (vmap): see _batched_predicate
        cond, body = _batched_predicate(cond, body, nc, nb)
        ins = [*ins[:nc], *ins[: nc + nb], *ins[nc + nb :]]
        nb += nc
    return b.emit_many(
        "while",
        ins,
        _outs(eqn),
        cond=_sub(b, cond, "while_cond"),
        body=_sub(b, body, "while_body"),
        cond_nconsts=nc,
        body_nconsts=nb,
    )


def _batched_predicate(cond: Any, body: Any, nc: int, nb: int) -> tuple[Any, Any]:
    """A ``while`` whose predicate is an array (``jax.vmap`` of a loop whose condition depends
    on the mapped inputs: every carry then has the batch dims leading) as XLA runs it: the loop
    goes on while any element's predicate holds, and an iteration updates only the elements
    whose predicate holds (the others keep their carry). Returns the scalar-predicate cond
    (``cond consts, carry``) and the body (``cond consts, body consts, carry``)."""
    cf, bf = jcore.jaxpr_as_fun(cond), jcore.jaxpr_as_fun(body)

    def any_cond(*xs: Any) -> list[Any]:
        return [jnp.any(cf(*xs)[0])]

    def masked_body(*xs: Any) -> list[Any]:
        cc, bc, carry = xs[:nc], xs[nc : nc + nb], xs[nc + nb :]
        (pred,) = cf(*cc, *carry)
        new = bf(*bc, *carry)
        dims = tuple(range(pred.ndim))
        return [
            lax.select(lax.broadcast_in_dim(pred, n.shape, dims), n, o)
            for n, o in zip(new, carry, strict=True)
        ]

    def spec(a: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(a.shape, a.dtype)

    cond_specs = [spec(a) for a in cond.in_avals]
    body_specs = [*cond_specs[:nc], *(spec(a) for a in body.in_avals)]
    return jax.make_jaxpr(any_cond)(*cond_specs), jax.make_jaxpr(masked_body)(*body_specs)


@rule("cond")
def _cond(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    ins = _vars(b, args, eqn.invars)
    if ins[0].dtype != "int32":  # (a bool predicate: JAX converts it first; to be sure)
        ins[0] = b.emit("convert", [ins[0]], (), "int32", dtype="int32")
    branches = tuple(_sub(b, br, f"branch{i}") for i, br in enumerate(eqn.params["branches"]))
    return b.emit_many("cond", ins, _outs(eqn), branches=branches)


# ---------------------------------------------------------------------------------------------
# rules: traced indexing (lowering.indexing)


@rule("dynamic_slice")
def _dynamic_slice(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    sizes = tuple(int(s) for s in eqn.params["slice_sizes"])
    return [indexing.dynamic_slice(b, b.as_var(args[0]), list(args[1:]), sizes)]


@rule("dynamic_update_slice")
def _dynamic_update_slice(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    x, upd = b.as_var(args[0]), args[1]
    upd = b.as_var(upd, _aval(eqn.invars[1])[0]) if isinstance(upd, Lit) else upd
    starts = tuple(int(a.value) if isinstance(a, Lit) else None for a in args[2:])
    traced = [
        a if a.dtype == "int32" else b.emit("convert", [a], (), "int32", dtype="int32")
        for a in args[2:]
        if not isinstance(a, Lit)
    ]
    return [b.emit("update_slice", [x, upd, *traced], x.shape, x.dtype, starts=starts)]


@rule("rev")
def _rev(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    return [indexing.reverse(b, b.as_var(args[0]), tuple(eqn.params["dimensions"]))]


_SCATTERS = {"scatter": "set", "scatter-add": "add", "scatter_add": "add", "scatter-mul": "mul"}
_SCATTERS |= {"scatter_mul": "mul", "scatter-max": "max", "scatter_max": "max"}
_SCATTERS |= {"scatter-min": "min", "scatter_min": "min"}


@rule(*_SCATTERS)
def _scatter(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    x, idx, upd = (b.as_var(a, _aval(v)[0]) for a, v in zip(args, eqn.invars, strict=True))
    dn = eqn.params["dimension_numbers"]
    sd, ins = tuple(dn.scatter_dims_to_operand_dims), tuple(dn.inserted_window_dims)
    wd = tuple(dn.update_window_dims)
    ob = tuple(int(d) for d in getattr(dn, "operand_batching_dims", ()))
    ib = tuple(int(d) for d in getattr(dn, "scatter_indices_batching_dims", ()))
    if ob and len(idx.shape) >= 1 and len(ob) == len(ib):
        idx, sd, ins = _unbatched_scatter(b, idx, sd, ins, ob, ib)
        ob = ()
    rest = [d for d in range(len(x.shape)) if d not in sd]
    mode = str(eqn.params.get("mode", ""))
    ok = not ob and set(ins) <= set(sd)
    if ok and len(idx.shape) >= 1 and idx.shape[-1] == len(sd):
        idx, upd, wd = indexing.scatter_windows(b, x, idx, upd, sd, ins, wd, "CLIP" in mode)
    ok = (
        ok
        and len(idx.shape) >= 1
        and idx.shape[-1] == len(sd)
        and len(wd) == len(rest)
        and all(upd.shape[w] == x.shape[d] for w, d in zip(wd, rest, strict=True))
    )
    if not ok:
        raise LoweringError(
            "scatter is supported where each index names rows of the scattered dims (windows "
            f"covering the other dims whole); got {dn}"
        )
    kind = _SCATTERS[eqn.primitive.name]
    return [indexing.scatter(b, x, idx, upd, sd, wd, kind, clip="CLIP" in mode)]


def _unbatched_scatter(
    b: Builder,
    idx: Var,
    sd: tuple[int, ...],
    ins: tuple[int, ...],
    ob: tuple[int, ...],
    ib: tuple[int, ...],
) -> tuple[Var, tuple[int, ...], tuple[int, ...]]:
    """A scatter with batching dims (``vmap`` of a scatter, the derivative of a batched gather:
    ``take_along_axis``, ``median``) as a plain one: each operand batching dim becomes one more
    scattered (inserted) dim whose index is its paired index dim's own position (an iota of the
    index array's batch shape, appended to the index vectors). Returns ``(index, scattered
    dims, inserted dims)``."""
    batch, last = idx.shape[:-1], len(idx.shape) - 1
    cols = [idx]
    for d in ib:
        shape = [n if j == d else 1 for j, n in enumerate(batch)]
        io = np.arange(batch[d], dtype=np_dtype(idx.dtype)).reshape(shape)
        cols.append(b.const(np.broadcast_to(io, batch).reshape(*batch, 1).copy(), idx.dtype))
    return b.concat(cols, last), (*sd, *ob), (*ins, *ob)


@rule("stack")
def _stack(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    ax = int(eqn.params["axis"])
    parts = []
    for a, v in zip(args, eqn.invars, strict=True):
        x = b.as_var(a, _aval(v)[0])
        parts.append(b.reshape(x, (*x.shape[:ax], 1, *x.shape[ax:])))
    return [b.concat(parts, ax)]


@rule("unstack")
def _unstack(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """``stack``'s transpose: one slice per position along ``axis``, the axis dropped."""
    x = b.as_var(args[0], _aval(eqn.invars[0])[0])
    ax = int(eqn.params["axis"])
    outs = []
    for i, v in enumerate(eqn.outvars):
        shape, _ = _aval(v)
        outs.append(b.reshape(b.slice_dim(x, ax, i, i + 1), shape))
    return outs


@rule("bitcast_convert_type")
def _bitcast_convert(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    x = b.as_var(args[0], shape)
    bits = ("float32", "int32", "uint32")
    if x.dtype not in bits or dt not in bits:
        raise LoweringError(
            "bitcast_convert_type is supported between the 32-bit types float32, int32 and "
            f"uint32; got {x.dtype} -> {dt}"
        )
    if x.dtype == dt:
        return [x]
    return [b.elementwise("bitcast", [x], shape, dt, param=dt)]


# ---------------------------------------------------------------------------------------------
# rules: windowed reductions (pooling), as strided slices of the padded input merged elementwise


_WINDOWED = {"reduce_window_max": ("max", "lowest"), "reduce_window_min": ("min", "highest")}
_WINDOWED |= {"reduce_window_sum": ("add", "zero")}


@rule(*_WINDOWED)
def _reduce_window(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    p = eqn.params
    shape, dt = _aval(eqn.outvars[0])
    x = b.as_var(args[0], _aval(eqn.invars[0])[0])
    if any(int(d) != 1 for d in p["base_dilation"]):
        raise LoweringError("reduce_window with base_dilation is not supported")
    fn, identity = _WINDOWED[eqn.primitive.name]
    fill = identity_value(identity, np_dtype(dt)).item()
    cfg = [(int(lo), int(hi), 0) for lo, hi in p["padding"]]
    out = conv_ops.window_reduce(
        b,
        x,
        fn,
        fill,
        window=[int(w) for w in p["window_dimensions"]],
        strides=[int(s) for s in p["window_strides"]],
        dilation=[int(d) for d in p["window_dilation"]],
        padding=cfg,
        out_shape=shape,
    )
    return [out]


@rule("select_and_scatter_add")
def _select_and_scatter_add(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """The derivative of ``reduce_window`` max (``select_prim`` ``ge``) or min (``le``): each
    window's selected element (the first maximum, or minimum, in the window's row-major order,
    as XLA selects: a later element replaces the selected one where ``select(selected, later)``
    fails) receives the window's source value; what several windows select adds up.

    From strided slices of the padded operand, one per window offset: a running selection
    over the offsets gives each window the offset it selects; then, per offset, the source where
    it was selected goes back to the operand's positions by a pad (low: the offset; interior:
    the stride less one), the pads add up, and the operand's padding is cropped."""
    p = eqn.params
    shape, dt = _aval(eqn.outvars[0])
    src = b.as_var(args[0], _aval(eqn.invars[0])[0])
    x = b.as_var(args[1], shape)
    sel = getattr(p["select_prim"], "name", str(p["select_prim"]))
    pads = [(int(lo), int(hi)) for lo, hi in p["padding"]]
    if sel not in ("ge", "le") or any(lo < 0 or hi < 0 for lo, hi in pads):
        raise LoweringError(
            f"select_and_scatter_add is supported with select_prim ge or le and no negative "
            f"padding; got {sel}, {pads}"
        )
    win = [int(w) for w in p["window_dimensions"]]
    strides = tuple(int(s) for s in p["window_strides"])
    fill = identity_value("lowest" if sel == "ge" else "highest", np_dtype(x.dtype)).item()
    xp = b.pad(x, Lit(fill, x.dtype), [(lo, hi, 0) for lo, hi in pads])
    out = src.shape
    if 0 in out:
        return [b.full(shape, 0, dt)]
    offsets = list(itertools.product(*(range(w) for w in win)))

    def view(o: tuple[int, ...]) -> Var:
        limits = tuple(od + s * (n - 1) + 1 for od, s, n in zip(o, strides, out, strict=True))
        return b.emit("slice", [xp], out, x.dtype, starts=o, limits=limits, strides=strides)

    best, chosen = view(offsets[0]), b.full(out, 0, "int32")
    for k, o in enumerate(offsets[1:], start=1):
        v = view(o)
        keep = b.elementwise(sel, [best, v], out, "bool")
        best = b.elementwise("select_n", [keep, v, best], out, x.dtype)
        chosen = b.elementwise("select_n", [keep, Lit(k, "int32"), chosen], out, "int32")
    total: Var | None = None
    for k, o in enumerate(offsets):
        hit = b.elementwise("eq", [chosen, Lit(k, "int32")], out, "bool")
        part = b.elementwise("select_n", [hit, Lit(0, dt), src], out, dt)
        cfg = [
            (od, xn - (od + s * (n - 1) + 1), s - 1)
            for od, s, n, xn in zip(o, strides, out, xp.shape, strict=True)
        ]
        placed = b.pad(part, Lit(0, dt), cfg)
        total = placed if total is None else b.elementwise("add", [total, placed], xp.shape, dt)
    assert total is not None
    starts = tuple(lo for lo, _ in pads)
    limits = tuple(lo + n for (lo, _), n in zip(pads, shape, strict=True))
    ones = (1,) * len(shape)
    return [b.emit("slice", [total], shape, dt, starts=starts, limits=limits, strides=ones)]
