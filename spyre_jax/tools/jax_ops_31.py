"""The rows issue 31 adds to the JAX op table, counted apart from the table it started from
(:data:`ISSUE31_OPS`; ``spyre-jax coverage jax`` reports both groups): ``jax.random`` on typed
and raw keys, uint32 arithmetic and bit ops, sorting forms the old table lacked (descending,
multi-key, ``lax.sort_key_val``, ``lax.top_k`` with ties and signed zeros).

Random rows compare bit for bit like every row (threefry is exact); their samples' keys are
drawn from the run's generator (``Arg(kind="key")``)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax import random as jr

from .jax_ops import F32, F32_F16, A, Arg, JaxOp, S, op

__all__ = ["ISSUE31_OPS"]

KEY = Arg((), kind="key")
RAW_KEY = Arg((2,), kind="key", dtype="uint32")
U32 = ("uint32",)


def _key_op(name: str, f, **kw) -> JaxOp:  # type: ignore[no-untyped-def]
    """``f(key)`` on a typed key and on a raw uint32 key."""
    return op(name, S(f, KEY), S(f, RAW_KEY), dtypes=F32, **kw)


def _u32(name: str, f) -> JaxOp:  # type: ignore[no-untyped-def]
    big = 2.0**32
    return op(
        name,
        S(f, Arg((5, 65), 0, big), Arg((5, 65), 0, big)),
        S(f, Arg((2, 3, 100), 0, big), Arg((3, 100), 0, 40)),
        dtypes=U32,
    )


ISSUE31_OPS: list[JaxOp] = [
    _key_op("jax.random.split", lambda k: jr.key_data(jr.split(k, 4))),
    _key_op("jax.random.fold_in", lambda k: jr.key_data(jr.fold_in(k, 11))),
    _key_op("jax.random.bits", lambda k: jr.bits(k, (5, 65))),
    _key_op("jax.random.uniform", lambda k: jr.uniform(k, (5, 65), minval=-1.0, maxval=2.0)),
    _key_op("jax.random.normal", lambda k: jr.normal(k, (3, 63))),
    _key_op("jax.random.truncated_normal", lambda k: jr.truncated_normal(k, -1.0, 2.0, (3, 63))),
    op(
        "jax.random.categorical",
        S(lambda k, x: jr.categorical(k, x), KEY, A((5, 65))),
        S(lambda k, x: jr.categorical(k, x, axis=0, shape=(4, 63)), RAW_KEY, A((3, 63))),
        dtypes=F32,
    ),
    _key_op("jax.random.bernoulli", lambda k: jr.bernoulli(k, 0.3, (5, 65))),
    _key_op("jax.random.gumbel", lambda k: jr.gumbel(k, (5, 65))),
    _key_op("jax.random.randint", lambda k: jr.randint(k, (5, 65), -7, 300)),
    _key_op("jax.random.choice", lambda k: jr.choice(k, 65, (9,), replace=False)),
    _key_op("jax.random.permutation", lambda k: jr.permutation(k, 63)),
    _key_op(
        "jax.random in a fori_loop",
        lambda k: lax.fori_loop(
            0,
            3,
            lambda i, c: (jr.fold_in(c[0], i), c[1] + jr.normal(c[0], (65,))),
            (k, jnp.zeros(65)),
        )[1],
    ),
    _u32("uint32 arithmetic", lambda a, b: (a + b, a * b, a - b, a // (b + 1), a % (b + 1))),
    _u32("uint32 bit ops", lambda a, b: (a ^ b, a | b, a & ~b, (a << 7) | (a >> 25))),
    _u32(
        "uint32 shifts",
        lambda a, b: (a << (b % 32), lax.shift_right_logical(a, jnp.broadcast_to(b % 40, a.shape))),
    ),
    _u32("uint32 compare/max", lambda a, b: (a < b, jnp.maximum(a, b), jnp.where(a > b, a, b))),
    _u32(
        "uint32 convert/bitcast",
        lambda a, b: (
            a.astype(jnp.float32),
            lax.bitcast_convert_type(a, jnp.float32),
            lax.bitcast_convert_type((a >> 9) | jnp.uint32(0x3F800000), jnp.float32),
        ),
    ),
    _u32("uint32 reductions", lambda a, b: (jnp.sum(a, -1), jnp.max(a, 0), jnp.sort(a, -1))),
    op(
        "jnp.sort/argsort(descending)",
        S(lambda x: (jnp.sort(x, descending=True), jnp.argsort(x, descending=True)), A((5, 65))),
        S(lambda x: jnp.argsort(x, axis=0, descending=True, stable=True), A((3, 63))),
        dtypes=F32_F16,
    ),
    op(
        "lax.sort(multi-key)/sort_key_val",
        S(lambda a, b: lax.sort((jnp.round(a), b), num_keys=2), A((5, 65)), A((5, 65))),
        S(lambda a, b: lax.sort_key_val(a, b, dimension=0), A((3, 63)), A((3, 63))),
        dtypes=F32_F16,
    ),
    op(
        "lax.top_k(ties, -0.0)",
        S(lambda x: lax.top_k(jnp.round(x) * 0.0 + jnp.round(x), 7), A((5, 65))),
        S(lambda x: lax.top_k(jnp.where(x > 0, x, -0.0), 9), A((2, 3, 100))),
        dtypes=F32_F16,
    ),
]
