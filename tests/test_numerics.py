"""Tests for device_model.numerics: DL16 rounding (jax and numpy) and the store rounding model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from device_model.numerics import (
    STORE_DTYPES,
    dl16_eps,
    dl16_max,
    dl16_min_normal,
    round_to_dl16,
    round_to_dl16_np,
    store_round,
)

_round_jit = jax.jit(round_to_dl16)

# Any float32 at all: subnormals, huge, +-inf, NaN (with payloads), signed zeros.
_any_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
_f32_arrays = hnp.arrays(np.float32, 48, elements=_any_f32)
# Raw bit patterns cover every NaN payload and every exponent evenly.
_bit_arrays = hnp.arrays(np.uint32, 48).map(lambda a: a.view(np.float32))
_normal_dl16_range = st.floats(
    min_value=dl16_min_normal, max_value=dl16_max, width=32, allow_subnormal=False
)


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def _dl16_ref_scalar(v: float) -> float:
    """Independent (float64, non-bit-twiddling) model of DL16 rounding of one finite value."""
    if v == 0.0:
        return v
    a = abs(v)
    e = int(np.floor(np.log2(a)))
    if 2.0**e > a:  # guard log2 rounding
        e -= 1
    if 2.0 ** (e + 1) <= a:
        e += 1
    q = a / 2.0 ** (e - 9)  # in [512, 1024)
    r = np.floor(q + 0.5) * 2.0 ** (e - 9)  # ties away from zero on the magnitude
    if r > dl16_max:
        r = np.inf
    elif r < dl16_min_normal:
        r = 0.0
    return float(np.copysign(r, v))


# --- jax vs numpy, bit for bit ----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(_f32_arrays)
def test_jax_matches_numpy_bitwise(x):
    np.testing.assert_array_equal(_bits(round_to_dl16(x)), _bits(round_to_dl16_np(x)))


@settings(max_examples=40, deadline=None)
@given(_bit_arrays)
def test_jit_matches_numpy_bitwise_all_patterns(x):
    np.testing.assert_array_equal(_bits(_round_jit(x)), _bits(round_to_dl16_np(x)))


def test_exhaustive_grid_jit_vs_numpy():
    # Every 2^14-th fp32 bit pattern plus its neighbours (tie and tie +- 1) in both signs.
    base = np.arange(0, 1 << 18, dtype=np.uint32) << np.uint32(14)
    pats = np.concatenate([base, base + 0x1FFF, base + 0x2000, base + 0x2001])
    x = pats.view(np.float32)
    np.testing.assert_array_equal(_bits(_round_jit(x)), _bits(round_to_dl16_np(x)))


# --- properties -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(_bit_arrays)
def test_idempotent_and_representable(x):
    y = round_to_dl16_np(x)
    np.testing.assert_array_equal(_bits(round_to_dl16_np(y)), _bits(y))
    fin = np.isfinite(y) & (y != 0)
    yb = _bits(y[fin])
    assert np.all(yb & np.uint32(0x3FFF) == 0)  # only 9 fraction bits
    mag = np.abs(y[fin])
    assert np.all(mag >= dl16_min_normal) and np.all(mag <= dl16_max)
    # NaN stays NaN (same bits); non-NaN never becomes NaN.
    np.testing.assert_array_equal(np.isnan(y), np.isnan(x))
    np.testing.assert_array_equal(_bits(y[np.isnan(x)]), _bits(x[np.isnan(x)]))
    # Sign is preserved everywhere.
    np.testing.assert_array_equal(np.signbit(y), np.signbit(x))


@settings(max_examples=200, deadline=None)
@given(_normal_dl16_range, st.booleans())
def test_relative_error_bound_and_independent_model(v, neg):
    v = -v if neg else v
    y = float(round_to_dl16_np(np.float32(v)))
    expect = _dl16_ref_scalar(float(np.float32(v)))
    assert y == expect or (np.isinf(y) and np.isinf(expect))
    if np.isfinite(y) and abs(v) <= dl16_max:
        assert abs(y - v) <= 2.0**-10 * abs(v)


# --- known values -----------------------------------------------------------------------------


def test_constants():
    assert dl16_max == 2.0**32 * (1 + 510 / 512) == 8573157376.0
    assert dl16_min_normal == 2.0**-31 * (1 + 2.0**-9)
    assert dl16_eps == 2.0**-9


@pytest.mark.parametrize(
    "x, expect",
    [
        (1.0, 1.0),
        (1.0 + 2.0**-9, 1.0 + 2.0**-9),  # exactly representable
        (1.0 + 2.0**-11, 1.0),  # below half an ulp: rounds down
        (1.0 + 2.0**-10, 1.0 + 2.0**-9),  # exact tie: away from zero
        (-(1.0 + 2.0**-10), -(1.0 + 2.0**-9)),
        (1.0 + 3 * 2.0**-10, 1.0 + 2 * 2.0**-9),  # tie at odd fraction: still away (not even)
        (2.0 - 2.0**-11, 2.0),  # carry into the exponent
        (3.0, 3.0),
        (0.1, 0.0999755859375),
        (dl16_max, dl16_max),
        (-dl16_max, -dl16_max),
        (dl16_min_normal, dl16_min_normal),
        (-dl16_min_normal, -dl16_min_normal),
        (2.0**32, 2.0**32),
        (2.0**-30, 2.0**-30),
        (0.0, 0.0),
    ],
)
def test_known_values(x, expect):
    got_np = round_to_dl16_np(np.float32(x))
    got_jx = round_to_dl16(np.float32(x))
    assert float(got_np) == expect
    assert _bits(got_jx) == _bits(got_np)


def test_overflow_to_signed_inf():
    ulp_top = 2.0**32 * 2.0**-9
    x = np.array(
        [
            dl16_max + 0.49 * ulp_top,  # still rounds to max
            dl16_max + 0.5 * ulp_top,  # tie onto the NaN/inf pattern: overflow
            2.0**33,
            3.0e38,
            np.inf,
        ],
        dtype=np.float32,
    )
    for f in (round_to_dl16_np, round_to_dl16, _round_jit):
        y = np.asarray(f(x))
        assert y[0] == dl16_max
        assert np.all(np.isposinf(y[1:]))
        yn = np.asarray(f(-x))
        assert yn[0] == -dl16_max
        assert np.all(np.isneginf(yn[1:]))


def test_underflow_to_signed_zero():
    tiny = np.array(
        [
            2.0**-31,  # its encoding is zero's
            2.0**-31 * (1 + 2.0**-11),  # rounds to 2^-31 -> zero
            2.0**-32,
            1e-30,
            1e-40,  # fp32 subnormal
            np.float32(1e-45),  # smallest fp32 subnormal
        ],
        dtype=np.float32,
    )
    for f in (round_to_dl16_np, round_to_dl16, _round_jit):
        y = np.asarray(f(tiny))
        assert np.all(y == 0) and not np.any(np.signbit(y))
        yn = np.asarray(f(-tiny))
        assert np.all(yn == 0) and np.all(np.signbit(yn))
    # Half an ulp above 2^-31 rounds up to the smallest nonzero value (tie away from zero).
    edge = np.float32(2.0**-31 * (1 + 2.0**-10))
    assert float(round_to_dl16_np(edge)) == dl16_min_normal
    assert float(round_to_dl16_np(-edge)) == -dl16_min_normal


def test_nan_and_shapes():
    x = np.array([[np.nan, 1.0], [-np.nan, 2.5]], dtype=np.float32)
    for f in (round_to_dl16_np, round_to_dl16, _round_jit):
        y = np.asarray(f(x))
        assert y.shape == (2, 2) and y.dtype == np.float32
        assert np.isnan(y[0, 0]) and np.isnan(y[1, 0])
        assert y[0, 1] == 1.0 and y[1, 1] == 2.5
    assert round_to_dl16_np(np.float32(1.0)).shape == ()
    assert round_to_dl16(jnp.float32(1.0)).shape == ()


def test_float64_input_cast_first():
    x = np.array([1.0 + 2.0**-11], dtype=np.float64)
    assert round_to_dl16_np(x).dtype == np.float32
    assert round_to_dl16(x).dtype == jnp.float32
    assert float(round_to_dl16_np(x)[0]) == 1.0


# --- store_round ------------------------------------------------------------------------------


_STORE_CASES = np.array(
    [1.0 + 2.0**-10, -2.7, 2.7, 0.1, 1e5, -1e5, 1e10, 1e-9, 1e-12, 0.0, np.nan, np.inf],
    dtype=np.float32,
)


@pytest.mark.parametrize("dl16", [False, True])
@pytest.mark.parametrize("name", STORE_DTYPES)
def test_store_round_dtypes(name, dl16):
    x = jnp.asarray(_STORE_CASES)
    y = store_round(x, name, dl16=dl16)
    assert y.dtype == jnp.dtype(name)
    assert y.shape == x.shape
    # Same result under jit and when dtype is passed as a dtype object.
    y_jit = jax.jit(lambda v: store_round(v, name, dl16=dl16))(x)
    y_obj = store_round(x, jnp.dtype(name), dl16=dl16)
    np.testing.assert_array_equal(np.asarray(y_jit), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(y_obj), np.asarray(y))


def test_store_round_values():
    x = jnp.asarray(_STORE_CASES)
    # No DL16: plain IEEE casts.
    for name in ("float16", "bfloat16", "float32"):
        np.testing.assert_array_equal(
            np.asarray(store_round(x, name, dl16=False)), np.asarray(x.astype(name))
        )
    # DL16: round to DL16 first, then cast.
    for name in ("float16", "bfloat16"):
        np.testing.assert_array_equal(
            np.asarray(store_round(x, name, dl16=True)),
            np.asarray(jnp.asarray(round_to_dl16_np(_STORE_CASES)).astype(name)),
        )
    f16 = np.asarray(store_round(x, "float16", dl16=True)).astype(np.float32)
    assert f16[0] == 1.0 + 2.0**-9  # DL16 tie away from zero, not fp16's exact value
    assert np.asarray(store_round(x, "float16", dl16=False))[0] == np.float16(1.0 + 2.0**-10)
    assert np.isposinf(f16[4]) and np.isneginf(f16[5])  # beyond fp16's range: inf
    bf = np.asarray(store_round(x, "bfloat16", dl16=True)).astype(np.float32)
    assert np.isposinf(bf[6])  # 1e10 > dl16_max: overflow even though bf16 could hold it
    assert bf[7] != 0 and bf[8] == 0  # 1e-12 < dl16_min_normal flushes; 1e-9 does not
    assert np.asarray(store_round(x, "bfloat16", dl16=False)).astype(np.float32)[8] != 0
    # float32 ignores dl16.
    np.testing.assert_array_equal(np.asarray(store_round(x, "float32", dl16=True)), np.asarray(x))
    # int32: toward zero; bool: != 0 (NaN is truthy).
    i = np.asarray(store_round(x, "int32", dl16=True))
    assert i[1] == -2 and i[2] == 2 and i[0] == 1 and i[3] == 0
    b = np.asarray(store_round(x, "bool", dl16=False))
    np.testing.assert_array_equal(b, _STORE_CASES != 0)
    assert b[10] and not b[9]


def test_store_round_rejects_unknown_dtype():
    with pytest.raises(ValueError):
        store_round(jnp.zeros(3), "int8", dl16=False)
    with pytest.raises(ValueError):
        store_round(jnp.zeros(3), "float64", dl16=True)
