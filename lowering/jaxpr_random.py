"""The JAX importer's rules for random numbers: threefry keys and the bits drawn from them.

A threefry key array of shape ``S`` is its key data on the card, uint32 ``[*S, 2]``
(:func:`lowering.jaxpr_common.aval`). ``random_seed``, ``random_split``, ``random_fold_in`` and
``random_bits`` are imported as the jaxprs of JAX's own threefry functions
(``jax.extend.random.threefry_prng_impl``: traced at import time, so the flag
``jax_threefry_partitionable`` chooses between its two ways of counting, as on the CPU), vmapped
over the key array's dims; their ``threefry2x32`` is the Threefry-2x32 block cipher (20 rounds)
written here in uint32 adds, rotations and xors, which the fusion pass merges into SFU maps; the
counters (``iota_2x32_shape``) are the 64-bit linear index of each position, split into two words.
The results are bit-equal to ``jax.jit`` on the CPU. Other PRNG implementations are refused
(:class:`~lowering.errors.PRNGKeyError`).

Structural ops on key arrays (slice, squeeze, reshape, broadcast, concatenate, transpose, select,
dynamic slices) act on the key data: :func:`key_rule` gives each the key's trailing dim in its
parameters and runs the ordinary rule.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.random as jax_random
import numpy as np

from . import jaxpr_common
from .builder import Builder, Lit
from .errors import LoweringError
from .graph import Var
from .jaxpr_common import INLINED, RULES, key_impl, rule
from .jaxpr_common import aval as _aval
from .rng_ops import threefry2x32

__all__ = ["key_rule"]

_U32 = "uint32"


# ---------------------------------------------------------------------------------------------
# the cipher and its counters


@rule("threefry2x32")
def _threefry(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    return list(threefry2x32(b, *args))


@rule("iota_2x32_shape")
def _iota_2x32(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """The 64-bit row-major linear index of every position of ``shape``, as (high, low) words."""
    shape = tuple(int(d) for d in eqn.params["shape"])
    n = np.arange(math.prod(shape), dtype=np.uint64).reshape(shape)
    hi = (n >> np.uint64(32)).astype(np.uint32)
    lo = (n & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return [b.const(hi, _U32), b.const(lo, _U32)]


# ---------------------------------------------------------------------------------------------
# the key operations: JAX's threefry functions, traced and inlined


def _traced(b: Builder, fn: Callable[..., Any], batch: int, args: list[Any], avals: list) -> list:
    """``fn``'s jaxpr (vmapped over ``batch`` leading dims of every operand) inlined on
    ``args``."""
    for _ in range(batch):
        fn = jax.vmap(fn)
    closed = jax.make_jaxpr(fn)(*avals)
    return jaxpr_common.inline(b, closed, args)


def _struct(v: Any) -> jax.ShapeDtypeStruct:
    shape, dt = _aval(v)
    return jax.ShapeDtypeStruct(shape, np.dtype(dt))


def _impl_of(eqn: Any) -> Any:
    for v in (*eqn.invars, *eqn.outvars):
        impl = key_impl(v.aval.dtype)
        if impl is not None:
            return impl
    return jax_random.threefry_prng_impl


def _vars(b: Builder, eqn: Any, args: list[Any]) -> list[Any]:
    return [
        b.as_var(a, _aval(v)[0]) if isinstance(a, Lit) else a
        for a, v in zip(args, eqn.invars, strict=True)
    ]


@rule("random_seed")
def _random_seed(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    impl = _impl_of(eqn)
    (seed,) = _vars(b, eqn, args)
    return _traced(b, impl.seed, len(seed.shape), [seed], [_struct(eqn.invars[0])])


@rule("random_bits")
def _random_bits(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    impl = _impl_of(eqn)
    width, shape = int(eqn.params["bit_width"]), tuple(eqn.params["shape"])
    if width != 32:
        raise TypeError(
            f"spyre: random bits of width {width} (uint{width}) are not supported on the card: "
            "it draws 32-bit words (uint32); draw float32 values and convert them"
        )
    (key,) = _vars(b, eqn, args)
    batch = len(key.shape) - 1

    def bits(k: Any) -> Any:
        return impl.random_bits(k, width, shape)

    return _traced(b, bits, batch, [key], [_struct(eqn.invars[0])])


@rule("random_split")
def _random_split(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    impl = _impl_of(eqn)
    shape = tuple(eqn.params["shape"])
    (key,) = _vars(b, eqn, args)

    def split(k: Any) -> Any:
        return impl.split(k, shape)

    return _traced(b, split, len(key.shape) - 1, [key], [_struct(eqn.invars[0])])


@rule("random_fold_in")
def _random_fold_in(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    impl = _impl_of(eqn)
    key, msg = _vars(b, eqn, args)
    batch = len(key.shape) - 1
    if msg.shape != key.shape[:-1]:
        msg = b.emit(
            "broadcast",
            [msg],
            key.shape[:-1],
            msg.dtype,
            shape=key.shape[:-1],
            dims=tuple(range(batch - len(msg.shape), batch)),
        )
    avals = [_struct(eqn.invars[0]), jax.ShapeDtypeStruct(msg.shape, np.dtype(msg.dtype))]
    return _traced(b, impl.fold_in, batch, [key, msg], avals)


@rule("random_wrap", "random_unwrap", "random_clone")
def _random_data(b: Builder, eqn: Any, args: list[Any]) -> list[Var]:
    """A key array and its data are the same uint32 tensor on the card."""
    return _vars(b, eqn, args)


# ---------------------------------------------------------------------------------------------
# structural ops on key arrays: the key's trailing dims added to their parameters


def _with_key_dims(name: str, p: dict[str, Any], eqn: Any) -> dict[str, Any]:
    """``p`` for the key data: the key's trailing dim(s) appended where the op names dims."""
    kd = tuple(_impl_of(eqn).key_shape)
    n = len(kd)
    q = dict(p)
    if name == "slice":
        r = len(p["start_indices"])
        q["start_indices"] = (*p["start_indices"], *([0] * n))
        q["limit_indices"] = (*p["limit_indices"], *kd)
        if p.get("strides") is not None:
            q["strides"] = (*p["strides"], *([1] * n))
        del r
    elif name == "broadcast_in_dim":
        r = len(p["shape"])
        q["shape"] = (*p["shape"], *kd)
        q["broadcast_dimensions"] = (*p["broadcast_dimensions"], *range(r, r + n))
    elif name == "reshape":
        q["new_sizes"] = (*p["new_sizes"], *kd)
        q["dimensions"] = None
    elif name == "transpose":
        r = len(p["permutation"])
        q["permutation"] = (*p["permutation"], *range(r, r + n))
    elif name == "dynamic_slice":
        q["slice_sizes"] = (*p["slice_sizes"], *kd)
    return q


#: structural ops whose rule runs on the key data once the key's dims are in their parameters
_ON_KEY_DATA = frozenset(
    {
        "slice",
        "squeeze",
        "broadcast_in_dim",
        "reshape",
        "concatenate",
        "transpose",
        "dynamic_slice",
        "dynamic_update_slice",
        "select_n",
        "rev",
    }
)
#: ops that carry keys without looking at them (their rules or bodies see the key data)
_CARRY_KEYS = INLINED | {
    "scan",
    "while",
    "cond",
    "copy",
    "copy_p",
    "optimization_barrier",
    "stop_gradient",
    "random_seed",
    "random_bits",
    "random_split",
    "random_fold_in",
    "random_wrap",
    "random_unwrap",
    "random_clone",
}


def key_rule(eqn: Any) -> Callable[[Builder, Any, list[Any]], list[Any]] | None:
    """The rule of an equation on PRNG key arrays when it needs one of its own (None: the
    ordinary rule): a structural op, given the key's trailing dims; any other op on keys is a
    LoweringError naming it."""
    name = eqn.primitive.name
    if name in _CARRY_KEYS:
        return None
    if not any(key_impl(v.aval.dtype) is not None for v in (*eqn.invars, *eqn.outvars)):
        return None
    if name not in _ON_KEY_DATA:

        def refuse(b: Builder, e: Any, args: list[Any]) -> list[Any]:
            raise LoweringError(
                f"spyre: '{name}' on PRNG keys is not supported on the card (keys may be split, "
                "folded, sliced, reshaped, broadcast, concatenated, selected and carried "
                "through loops)"
            )

        return refuse
    inner = RULES[name]

    def on_data(b: Builder, e: Any, args: list[Any]) -> list[Any]:
        params = _with_key_dims(name, dict(e.params), e)
        shim = types.SimpleNamespace(
            primitive=e.primitive,
            params=params,
            invars=e.invars,
            outvars=e.outvars,
            source_info=e.source_info,
        )
        if name == "select_n":  # the predicate (not a key) broadcast over the key's dims
            shape = _aval(e.outvars[0])[0]
            pred = (
                b.as_var(args[0], shape[: len(shape) - 1]) if isinstance(args[0], Lit) else args[0]
            )
            if pred.shape != shape:
                pred = b.emit(
                    "broadcast",
                    [pred],
                    shape,
                    pred.dtype,
                    shape=shape,
                    dims=tuple(range(len(pred.shape))),
                )
            args = [pred, *args[1:]]
        elif name in ("dynamic_slice", "dynamic_update_slice"):
            args = [*args, Lit(0, "int32")]
        return inner(b, shim, args)

    return on_data
