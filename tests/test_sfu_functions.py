"""The SFU's elementwise functions against ``jax.jit`` on the CPU, in ulps of the result's dtype
(docs/timing-and-numerics.md, "The SFU's functions"). The card's SFU has no published accuracy
(CARD.md): the model computes each function as XLA's float32 implementation and rounds it once
to the result's dtype, so these bounds are the model's, measured here, not the card's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import spyre_jax

#: name -> (function, input range, the most ulps allowed: float32, float16, bfloat16)
FUNCTIONS = {
    "atan": (jnp.arctan, (-20, 20), (0, 0, 0)),
    "sinh": (jnp.sinh, (-5, 5), (0, 0, 0)),
    "cosh": (jnp.cosh, (-5, 5), (0, 0, 0)),
    "tan": (jnp.tan, (-1.5, 1.5), (2, 0, 0)),
    "asin": (jnp.arcsin, (-1, 1), (0, 1, 1)),
    "acos": (jnp.arccos, (-1, 1), (0, 1, 1)),
    "asinh": (jnp.arcsinh, (-20, 20), (0, 1, 1)),
    "acosh": (jnp.arccosh, (1, 20), (0, 2, 2)),
    "atanh": (jnp.arctanh, (-0.99, 0.99), (0, 1, 1)),
    "cbrt": (jnp.cbrt, (-50, 50), (1, 0, 0)),
    "lgamma": (lax.lgamma, (0.1, 20), (0, 0, 0)),
    "digamma": (lax.digamma, (0.1, 20), (0, 0, 0)),
    "erf_inv": (lax.erf_inv, (-0.99, 0.99), (0, 0, 0)),
    "bessel_i0e": (lax.bessel_i0e, (-20, 20), (0, 0, 0)),
    "bessel_i1e": (lax.bessel_i1e, (-20, 20), (0, 0, 0)),
    "exp": (jnp.exp, (-10, 10), (0, 0, 0)),
    "log": (jnp.log, (0.01, 100), (0, 0, 0)),
    "tanh": (jnp.tanh, (-5, 5), (0, 0, 0)),
    "erf": (lax.erf, (-3, 3), (0, 0, 0)),
    "sin": (jnp.sin, (-6, 6), (0, 0, 0)),
    "rsqrt": (lax.rsqrt, (0.01, 100), (0, 0, 0)),
}
DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16)


def _ulps(got: np.ndarray, want: np.ndarray, dt: type) -> float:
    ok = np.isfinite(got) & np.isfinite(want)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    w = np.abs(want[ok])
    fin = np.finfo(dt)
    ulp = np.exp2(np.floor(np.log2(np.maximum(w, fin.tiny))) - fin.nmant)
    return float((np.abs(got[ok] - want[ok]) / ulp).max(initial=0.0))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_sfu_function_within_its_stated_ulps(name):
    f, (lo, hi), bounds = FUNCTIONS[name]
    rng = np.random.default_rng(0)
    for dt, bound in zip(DTYPES, bounds, strict=True):
        x = rng.uniform(lo, hi, 2048).astype(dt)
        want = np.asarray(jax.jit(f)(x)).astype(np.float64)
        got = np.asarray(spyre_jax.jit(f)(x)).astype(np.float64)
        assert _ulps(got, want, dt) <= bound, (name, np.dtype(dt).name)
