"""``spyre_call``: a :func:`spyre_jax.jit` function as a JAX primitive, so that JAX's
transformations compose with it and the transformed programs run on the card.

Modelled on JAX's own ``jit`` primitive: called with JAX tracers among its arguments (under
``jax.grad``, ``jax.vmap``, ``jax.jvp``, ``jax.jit``, ``jax.make_jaxpr`` ...), a jitted function
binds ``spyre_call_p`` with its traced function's closed jaxpr instead of running. The
primitive's rules transform that jaxpr and bind the primitive again on the result, so a
derivative or a batched program is itself compiled for the card and launched there:

* impl: compile the jaxpr for the card (once per jaxpr: :func:`_compiled`) and launch it;
  results come back as ``jax.Array`` s, which JAX's machinery computes with;
* abstract eval: the jaxpr's output types;
* jvp: ``jax.jvp`` of the jaxpr, traced to a jaxpr (primals and nonzero tangents in, primal and
  tangent outputs out);
* linearize (reverse mode): JAX's own split of the jaxpr into a primal part, which runs now and
  also returns the residuals, and a linear tangent part, in :mod:`spyre_jax.jax_private`;
* transpose: ``jax.linear_transpose`` of the jaxpr in its undefined (linear) inputs, the
  others held fixed;
* batching: ``jax.vmap`` of the jaxpr, batched outputs along axis 0;
* lowering inside ``jax.jit``: a host callback into the card (the card part runs on the card,
  the rest of the outer program on the CPU); inside another ``spyre_jax.jit``: inlined.

Every derived jaxpr is memoized by the jaxpr it came from (and the transformation's
parameters), and the spyre function keeps its traced jaxpr per signature, so the second
``jax.grad(spyre_f)(x)`` binds the very same jaxprs and compiles nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from device_model.runtime import runtime

from . import jax_private

__all__ = ["spyre_call_p", "spyre_call", "set_jit", "stats", "reset_stats"]

spyre_call_p = jcore.Primitive("spyre_call")
spyre_call_p.multiple_results = True

_lock = threading.RLock()
#: how many of each event (card compiles of a jaxpr, impl launches, derived jaxprs traced)
_counts = {"compiles": 0, "launches": 0, "derived": 0, "host_callbacks": 0, "residual_bytes": 0}


def stats() -> dict[str, int]:
    """compiles (jaxprs compiled for the card by the primitive), launches (impl runs on the
    card), derived (jaxprs made by a transformation rule), host_callbacks (card runs from
    inside an outer ``jax.jit``), residual_bytes (what the forward parts of reverse-mode
    derivatives saved for their backward parts: the activations; ``jax.checkpoint`` lowers it)."""
    with _lock:
        return dict(_counts)


def reset_stats() -> None:
    with _lock:
        for k in _counts:
            _counts[k] = 0


def _count(name: str) -> None:
    with _lock:
        _counts[name] += 1


class _Memo:
    """A bounded cache keyed by jaxprs (by identity: the entry holds them alive) and plain
    data."""

    def __init__(self, size: int = 512):
        self.size = size
        self._d: OrderedDict[Any, tuple[Any, Any]] = OrderedDict()

    def get(self, jaxprs: tuple, extra: Any, make: Callable[[], Any]) -> Any:
        key = (tuple(id(j) for j in jaxprs), extra)
        with _lock:
            hit = self._d.get(key)
            if hit is not None and all(a is b for a, b in zip(hit[0], jaxprs, strict=True)):
                self._d.move_to_end(key)
                return hit[1]
        value = make()
        with _lock:
            self._d[key] = (jaxprs, value)
            while len(self._d) > self.size:
                self._d.popitem(last=False)
        return value


_DERIVED = _Memo()
_COMPILED = _Memo(256)


def spyre_call(closed: Any, args: Sequence[Any], name: str) -> list[Any]:
    """Bind the primitive: ``closed`` (a ClosedJaxpr) applied to ``args`` on the card."""
    return spyre_call_p.bind(*args, jaxpr=closed, name=name)


# ---------------------------------------------------------------------------------------------
# impl and abstract eval


#: makes a jitted function of a Python function (``spyre_jax.api`` sets it: this module sits
#: below the API and imports none of it)
_JIT: list[Callable[[Callable], Any]] = []


def set_jit(make: Callable[[Callable], Any]) -> None:
    """Set how a jaxpr's function is jitted for the card (``spyre_jax.jit``'s ``Jitted``)."""
    _JIT[:] = [make]


def _compiled(closed: Any, name: str) -> Any:
    """A :class:`spyre_jax.api.Jitted` of ``closed`` (compiled on its first call)."""

    def make() -> Any:
        _count("compiles")
        fun = jcore.jaxpr_as_fun(closed)

        def call(*xs: Any) -> Any:
            return fun(*xs)

        call.__name__ = name if name.isidentifier() else "fn"
        return _JIT[0](call)

    return _COMPILED.get((closed,), runtime(), make)


def _run_on_card(closed: Any, name: str, args: Sequence[Any]) -> list[Any]:
    """Launch ``closed`` on the card with host (or ``spyre_jax.Array``) arguments; the results
    as :class:`spyre_jax.Array` s."""
    _count("launches")
    jitted = _compiled(closed, name)
    if len(jitted._cache) == 1:  # compiled: launch it without keying the call again
        (c,) = jitted._cache.values()
        call_flat = getattr(c, "call_flat", None)  # (one card's Compiled; not a multi-card one)
        if call_flat is not None:
            return call_flat(list(args))
    return list(jitted(*args))


def _impl(*args: Any, jaxpr: Any, name: str) -> list[Any]:
    outs = _run_on_card(jaxpr, name, [_to_card(a) if _is_jax(a) else a for a in args])
    hosts = [o if is_key_array(o) else np.asarray(o) for o in outs]
    res = list(jax_private.as_transfer(_as_jax, *hosts))
    for j, o in zip(res, outs, strict=True):
        if not is_key_array(o):
            _mirror(j, o)
    return res


#: id(JAX array) -> (a weak reference to it, the device array it was copied from): a result
#: handed to JAX keeps its card copy while it lives, so a later card program that takes it
#: (a gradient's residuals, the next step's input) reads it in place instead of copying it in
_MIRRORS: dict[int, tuple[Any, Any]] = {}


def _mirror(j: Any, dev: Any) -> None:
    key = id(j)
    try:
        ref = weakref.ref(j, lambda _r, k=key: _MIRRORS.pop(k, None))
    except TypeError:  # (not weakly referenceable: no mirror)
        return
    _MIRRORS[key] = (ref, dev)


def _to_card(x: Any) -> Any:
    """A JAX array as a card program's argument: its device copy where it has one (it is
    immutable, so the copy holds its values), else its host values."""
    hit = _MIRRORS.get(id(x))
    if hit is not None and hit[0]() is x:
        dev = hit[1]
        if not dev.is_deleted() and dev.buffer.rt is runtime():  # (this card's, still there)
            return dev
    return _to_host(x)


#: host values -> JAX arrays, through jax.jit's C++ fast path (one call for all of them, a
#: quarter of ``jax.device_put`` 's host time for a list of four small arrays)
_as_jax = jax.jit(lambda *xs: xs)


def _is_jax(x: Any) -> bool:
    return isinstance(x, jax.Array)


def is_key_array(x: Any) -> bool:
    """Whether ``x`` (an array or aval) holds typed PRNG keys (``jax.random.key``): they have
    no NumPy value; the card's jit takes and returns them as they are (their key data are
    uint32 words on the card)."""
    dt = getattr(x, "dtype", None)
    return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)


def _to_host(x: Any) -> Any:
    return x if is_key_array(x) else np.asarray(x)


def _abstract_eval(*avals: Any, jaxpr: Any, name: str) -> list[Any]:
    return list(jaxpr.out_avals)


spyre_call_p.def_impl(_impl)
spyre_call_p.def_abstract_eval(_abstract_eval)


# ---------------------------------------------------------------------------------------------
# derived jaxprs (public JAX API only)


def _spec(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _differentiable(aval: Any) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, np.inexact)


def _trace(fun: Callable, specs: Sequence[Any]) -> Any:
    _count("derived")
    return jax.make_jaxpr(fun)(*specs)


def jvp_jaxpr(closed: Any, nonzeros: tuple[bool, ...]) -> tuple[Any, tuple[bool, ...]]:
    """``(primals, nonzero tangents) -> (primal outputs, nonzero tangent outputs)`` of
    ``closed``, and which output tangents it returns (the differentiable outputs)."""
    out_nz = tuple(_differentiable(a) for a in closed.out_avals)

    def make() -> Any:
        fun = jcore.jaxpr_as_fun(closed)
        n = len(closed.in_avals)

        def jvp(*xs: Any) -> list[Any]:
            primals, nz_t = list(xs[:n]), iter(xs[n:])
            tangents = [
                next(nz_t) if nz else _zero_tangent(a)
                for a, nz in zip(closed.in_avals, nonzeros, strict=True)
            ]
            outs, touts = jax.jvp(lambda *p: list(fun(*p)), primals, tangents)
            return [*outs, *(t for t, nz in zip(touts, out_nz, strict=True) if nz)]

        specs = [_spec(a) for a in closed.in_avals]
        specs += [_spec(a) for a, nz in zip(closed.in_avals, nonzeros, strict=True) if nz]
        return _trace(jvp, specs)

    return _DERIVED.get((closed,), ("jvp", nonzeros), make), out_nz


def _zero_tangent(aval: Any) -> Any:
    dt = jcore.primal_dtype_to_tangent_dtype(aval.dtype)
    return np.zeros(aval.shape, dt)


def transpose_jaxpr(closed: Any, undefined: tuple[bool, ...], ct_nonzero: tuple[bool, ...]) -> Any:
    """``(defined inputs, nonzero output cotangents) -> cotangents of the undefined inputs`` of
    ``closed``, linear in its undefined inputs."""

    def make() -> Any:
        fun = jcore.jaxpr_as_fun(closed)
        ins, outs = closed.in_avals, closed.out_avals
        ndef = undefined.count(False)

        def transposed(*xs: Any) -> list[Any]:
            defined, nz_cts = iter(xs[:ndef]), iter(xs[ndef:])
            fixed = [None if u else next(defined) for u in undefined]

            def linear(*lin: Any) -> list[Any]:
                it = iter(lin)
                full = [next(it) if u else f for u, f in zip(undefined, fixed, strict=True)]
                return list(fun(*full))

            cts = [
                next(nz_cts) if nz else np.zeros(a.shape, a.dtype)
                for a, nz in zip(outs, ct_nonzero, strict=True)
            ]
            lin_specs = [_spec(a) for a, u in zip(ins, undefined, strict=True) if u]
            return list(jax.linear_transpose(linear, *lin_specs)(cts))

        specs = [_spec(a) for a, u in zip(ins, undefined, strict=True) if not u]
        specs += [_spec(a) for a, nz in zip(outs, ct_nonzero, strict=True) if nz]
        return _trace(transposed, specs)

    return _DERIVED.get((closed,), ("transpose", undefined, ct_nonzero), make)


def batched_outputs(closed: Any, batched: Sequence[bool]) -> tuple[bool, ...]:
    """Which outputs of ``closed`` depend on its ``batched`` inputs (an equation's outputs all
    do when any of its inputs does): those ``vmap`` batches; the others stay unbatched, as
    ``jax.vmap`` leaves an output that does not depend on the mapped inputs (``jax.jacfwd``
    asks for its primal output unbatched)."""
    jaxpr = closed.jaxpr
    dep = {v for v, b in zip(jaxpr.invars, batched, strict=True) if b}
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jcore.Literal) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    return tuple(not isinstance(v, jcore.Literal) and v in dep for v in jaxpr.outvars)


def batch_jaxpr(closed: Any, dims: tuple[int | None, ...], size: int) -> tuple[Any, tuple]:
    """``closed`` vmapped over ``dims`` (None: unbatched) of size ``size``, and each output's
    batch axis: 0 where it depends on a batched input, else None."""
    out_axes = tuple(
        0 if b else None for b in batched_outputs(closed, [d is not None for d in dims])
    )

    def make() -> Any:
        fun = jcore.jaxpr_as_fun(closed)
        specs = []
        for a, d in zip(closed.in_avals, dims, strict=True):
            shape = list(a.shape)
            if d is not None:
                shape.insert(d, size)
            specs.append(jax.ShapeDtypeStruct(tuple(shape), a.dtype))
        batched = jax.vmap(
            lambda *xs: list(fun(*xs)), in_axes=list(dims), out_axes=list(out_axes), axis_size=size
        )
        return _trace(batched, specs)

    return _DERIVED.get((closed,), ("vmap", dims, size), make), out_axes


# ---------------------------------------------------------------------------------------------
# rules


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, jaxpr: Any, name: str) -> Any:
    nonzeros = tuple(
        type(t) is not ad.Zero and _differentiable(a)
        for t, a in zip(tangents, jaxpr.in_avals, strict=True)
    )
    jj, out_nz = jvp_jaxpr(jaxpr, nonzeros)
    nz_t = [t for t, nz in zip(tangents, nonzeros, strict=True) if nz]
    outs = spyre_call(jj, [*primals, *nz_t], f"{name}_jvp")
    n = len(jaxpr.out_avals)
    touts = iter(outs[n:])
    tangents_out = [
        next(touts) if nz else ad.Zero(a.to_tangent_aval())
        for a, nz in zip(jaxpr.out_avals, out_nz, strict=True)
    ]
    return outs[:n], tangents_out


def _transpose(cts: Sequence[Any], *args: Any, jaxpr: Any, name: str) -> list[Any]:
    undefined = tuple(ad.is_undefined_primal(a) for a in args)
    ct_nonzero = tuple(type(c) is not ad.Zero for c in cts)
    if not any(ct_nonzero):
        return [None] * len(args)
    tj = transpose_jaxpr(jaxpr, undefined, ct_nonzero)
    defined = [a for a, u in zip(args, undefined, strict=True) if not u]
    nz_cts = [c for c in cts if type(c) is not ad.Zero]
    outs = iter(spyre_call(tj, [*defined, *nz_cts], f"{name}_transpose"))
    return [next(outs) if u else None for u in undefined]


def _batch(args: Sequence[Any], dims: Sequence[Any], *, jaxpr: Any, name: str) -> Any:
    ds = tuple(None if d is None else int(d) for d in dims)
    size = next(a.shape[d] for a, d in zip(args, ds, strict=True) if d is not None)
    bj, out_axes = batch_jaxpr(jaxpr, ds, size)
    outs = spyre_call(bj, list(args), f"{name}_vmap")
    return outs, list(out_axes)  # None: not mapped


ad.primitive_jvps[spyre_call_p] = _jvp
ad.primitive_transposes[spyre_call_p] = _transpose
batching.primitive_batchers[spyre_call_p] = _batch


def _saved(nbytes: int) -> None:
    with _lock:
        _counts["residual_bytes"] += nbytes


jax_private.register_linearize(spyre_call_p, spyre_call, _DERIVED, _saved)


# ---------------------------------------------------------------------------------------------
# inside an outer jax.jit: a host callback into the card


def _host_call(*args: Any, jaxpr: Any, name: str) -> list[Any]:
    # typed keys cross the callback as their key data (a callback takes and gives NumPy values)
    impls = [jax.random.key_impl(a) if is_key_array(a) else None for a in args]
    datas = [jax.random.key_data(a) if i else a for a, i in zip(args, impls, strict=True)]
    outs_key = [is_key_array(a) for a in jaxpr.out_avals]
    specs = [_spec(a) for a in jaxpr.out_avals]
    specs = [
        jax.eval_shape(jax.random.key_data, s) if k else s
        for s, k in zip(specs, outs_key, strict=True)
    ]

    def on_card(*xs: Any) -> list[np.ndarray]:
        _count("host_callbacks")
        keyed = [
            jax.random.wrap_key_data(x, impl=i) if i else x for x, i in zip(xs, impls, strict=True)
        ]
        outs = _run_on_card(jaxpr, name, keyed)
        return [
            np.asarray(jax.random.key_data(o) if k else o)
            for o, k in zip(outs, outs_key, strict=True)
        ]

    outs = jax.pure_callback(on_card, specs, *datas, vmap_method="sequential")
    return [
        jax.random.wrap_key_data(o, impl=jax_private.key_impl(a.dtype)) if k else o
        for o, a, k in zip(outs, jaxpr.out_avals, outs_key, strict=True)
    ]


mlir.register_lowering(spyre_call_p, mlir.lower_fun(_host_call, multiple_results=True))
