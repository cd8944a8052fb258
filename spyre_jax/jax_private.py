"""The one use of JAX's private modules (``jax._src``): reverse-mode rules of ``spyre_call``,
and ``spyre_jax.Array`` as a value JAX functions take.

JAX differentiates in reverse by *linearizing* each primitive (``jax_use_direct_linearize``,
on by default since JAX 0.7): a rule splits the primitive's computation into a primal part,
run now, which also returns residuals, and a linear tangent part over those residuals, which
JAX transposes for ``grad``. A primitive without such a rule is linearized through its jvp rule
and a partial evaluation that cannot split a call primitive (all its outputs would be unknown,
and JAX refuses). JAX's own ``jit`` primitive splits its jaxpr with
``jax._src.interpreters.ad.linearize_jaxpr``; ``spyre_call`` does the same, and binds itself on
both parts, so the forward of a gradient and its backward are both compiled for the card.

A profile (``spyre_jax.profile``) counts the JAX primitives evaluated eagerly on the CPU while it
records (what JAX computes between card programs, e.g. the glue of a gradient):
:func:`add_cpu_listener` wraps the method every eager primitive goes through,
``jax._src.core.EvalTrace.process_primitive``.

JAX functions (``jnp.sin(a)``, ``jax.jit(f)(a)``) take a value of a type JAX knows; since JAX
0.7 an object's ``__jax_array__`` is no longer consulted where JAX finds a value's type and
canonicalizes it. :func:`register_array_type` registers both for ``spyre_jax.Array`` (its type
from its shape and dtype; its value a host copy of its elements): such a call then runs on the
CPU, as any JAX function outside ``spyre_jax.jit``.

Tested against the pinned JAX range (``pyproject.toml``) in ``tests/test_transforms.py``.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src.interpreters import ad as _ad

__all__ = ["register_linearize", "register_array_type", "add_cpu_listener", "remove_cpu_listener"]

#: primitives not counted: moving a value (a constant staged onto the device), and the card's
TRANSFERS = frozenset({"stage", "device_put", "spyre_call"})
_listeners: list[Counter] = []
_lock = threading.Lock()
_original_apply: list[Any] = []


#: set while the card model hands results to JAX (:func:`as_transfer`)
_state = threading.local()


def as_transfer(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its primitives not counted by the CPU listeners: a transfer of results
    into JAX arrays, not the user's program's work."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        return fn(*args)
    finally:
        _state.depth -= 1


def _counting_process(self: Any, prim: Any, *args: Any, **params: Any) -> Any:
    if (
        _listeners
        and prim.name not in TRANSFERS
        and not getattr(_state, "depth", 0)
        and not _in_card_model()
    ):
        for c in list(_listeners):
            c[prim.name] += 1
    return _original_apply[0](self, prim, *args, **params)


def _in_card_model(depth: int = 16) -> bool:
    """Whether the card model's own code (``device_model``: running a kernel's program stage
    by stage) bound the primitive: the simulation's work, not the user's program's."""
    f = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            return False
        if _CARD_MODEL in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


_CARD_MODEL = os.sep + "device_model" + os.sep


def add_cpu_listener(counter: Counter) -> None:
    """Count in ``counter`` each JAX primitive evaluated eagerly on the CPU from now on (by
    name; transfers excluded) until :func:`remove_cpu_listener`."""
    with _lock:
        if not _original_apply:
            _original_apply.append(_core.EvalTrace.process_primitive)
            _core.EvalTrace.process_primitive = _counting_process
        _listeners.append(counter)


def remove_cpu_listener(counter: Counter) -> None:
    with _lock:
        _listeners[:] = [c for c in _listeners if c is not counter]


def register_array_type(cls: type) -> None:
    """Let JAX take instances of ``cls`` (with ``shape``, ``dtype`` and ``__array__``) as
    arrays: their abstract value from shape and dtype, their value a host copy."""
    _core.pytype_aval_mappings[cls] = lambda x: _core.ShapedArray(x.shape, x.dtype)
    _dtypes.register_canonicalize_value_handler(cls, lambda x: np.asarray(x))


def key_impl(dtype: Any) -> Any:
    """The PRNG implementation of a typed-key dtype (``jax.random.key_impl`` wants an array;
    a callback's result is made from a dtype alone)."""
    return dtype._impl


def register_linearize(
    prim: Any,
    bind: Callable[..., list[Any]],
    memo: Any,
    saved: Callable[[int], None] = lambda n: None,
) -> None:
    """Give ``prim`` (whose params are ``jaxpr`` and ``name``) a linearization rule.
    ``bind(closed, args, name)`` binds it; ``memo.get(jaxprs, extra, make)`` memoizes the split
    per jaxpr, so a second gradient binds the same jaxprs (and compiles nothing); ``saved(n)``
    is told the bytes of the residuals each linearization's primal part computes (the
    activations a backward keeps: fewer under ``jax.checkpoint``)."""

    def rule(is_vjp: bool, nzs: Sequence[bool], *primals: Any, jaxpr: Any, name: str) -> Any:
        nzs = tuple(bool(z) for z in nzs)
        split = memo.get(
            (jaxpr,),
            ("linearize", nzs, bool(is_vjp)),
            lambda: _ad.linearize_jaxpr(jaxpr, nzs, is_vjp=is_vjp),
        )
        primal_jaxpr, num_res, nzs_out, in_fwd_res, tangent_jaxpr = split
        res_avals = primal_jaxpr.out_avals[len(primal_jaxpr.out_avals) - num_res :]
        saved(sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in res_avals))
        ans = bind(primal_jaxpr, list(primals), name)
        nout = len(ans) - num_res
        primal_ans, res = ans[:nout], iter(ans[nout:])
        src = [*jaxpr.consts, *primals]
        residuals = [src[f] if f is not None else next(res) for f in in_fwd_res]
        tangent_avals = [a.to_tangent_aval() for a in jaxpr.out_avals]

        def tangent_fun(residuals: Sequence[Any], *tangents: Any) -> list[Any]:
            nz_t = [t for t, nz in zip(tangents, nzs, strict=True) if nz]
            outs = iter(bind(tangent_jaxpr, [*residuals, *nz_t], f"{name}_lin"))
            return [
                next(outs) if nz else _ad.Zero(a)
                for a, nz in zip(tangent_avals, nzs_out, strict=True)
            ]

        return primal_ans, list(nzs_out), residuals, tangent_fun

    _ad.primitive_linearizations[prim] = rule
