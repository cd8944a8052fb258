"""The JAX importer's rules for loops, branches and traced indexing: ``scan``, ``while`` and
``cond`` (each body imported as a graph of its own: the host program's loops and branches,
:mod:`lowering.control`), ``dynamic_slice``, ``dynamic_update_slice``, scatter, ``rev``,
``stack``, ``bitcast_convert_type`` and the windowed reductions (pooling). They register
into :data:`lowering.from_jaxpr.RULES` when ``lowering.from_jaxpr`` imports this module;
bodies are imported with :data:`lowering.jaxpr_common.import_body`."""

from __future__ import annotations

from typing import Any

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
    return b.emit_many(
        "while",
        _vars(b, args, eqn.invars),
        _outs(eqn),
        cond=_sub(b, p["cond_jaxpr"], "while_cond"),
        body=_sub(b, p["body_jaxpr"], "while_body"),
        cond_nconsts=int(p["cond_nconsts"]),
        body_nconsts=int(p["body_nconsts"]),
    )


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
    rest = [d for d in range(len(x.shape)) if d not in sd]
    mode = str(eqn.params.get("mode", ""))
    ok = not tuple(getattr(dn, "operand_batching_dims", ())) and set(ins) <= set(sd)
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


@rule("stack")
def _stack(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    shape, dt = _aval(eqn.outvars[0])
    ax = int(eqn.params["axis"])
    parts = []
    for a, v in zip(args, eqn.invars, strict=True):
        x = b.as_var(a, _aval(v)[0])
        parts.append(b.reshape(x, (*x.shape[:ax], 1, *x.shape[ax:])))
    return [b.concat(parts, ax)]


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
