"""The simulator's rounding model, and DL16 (IBM DLFloat16) emulation.

Rounding model
--------------
* PE (processing-element array) products accumulate in fp32: a matmul or convolution on the
  card reads its operands in their stored dtype, widens them to fp32 and accumulates in fp32.
  The simulator computes these with fp32 inputs and ``preferred_element_type=float32``.
* SFU (special-function unit) math -- exp, rsqrt, tanh, division, reductions, ... -- is fp32.
* Every store to device memory rounds to the tensor's dtype with round-to-nearest-even, the
  IEEE cast (:func:`store_round`). fp32 stays fp32; int32 truncates toward zero; bool is
  ``x != 0``.
* Optionally (``dl16=True``) a store of a float16 or bfloat16 tensor first rounds to DL16,
  the 16-bit format the card actually holds 16-bit floats in, and then casts to the tensor's
  dtype. The container stays fp16/bf16 -- values are DL16-rounded but stored in the tensor's
  dtype -- so the host sees ordinary fp16/bf16 arrays.

DL16 (DLFloat16)
----------------
From Agrawal et al., "DLFloat: A 16-b Floating Point Format Designed for Deep Learning
Training and Inference", ARITH 2019, as implemented by IBM's own converters (onnx-mlir
``src/Accelerators/NNPA/Support/Stickify/DLF16Conversion.hpp``, class ``NNP1``; zDNN
``zdnn_fl32_to_dlflt16``) and range constants (onnx-mlir ``NNPALimit.h``):

* 1 sign bit, 6 exponent bits (bias 31), 9 fraction bits; value
  ``(-1)^s * 2^(e - 31) * (1 + m / 512)`` for ``e`` in [0, 63], ``m`` in [0, 511].
* No subnormals. The encoding with ``e = 0, m = 0`` is (signed) zero; ``e = 0, m != 0`` is a
  *normal* number. So 2^-31 itself is not representable and the smallest nonzero magnitude is
  ``dl16_min_normal = 2^-31 * (1 + 2^-9)`` (about 4.66e-10). Anything that rounds below it
  flushes to zero of the same sign.
* One special value: ``e = 63, m = 511`` (bit pattern ``s|0x7FFF``) is the merged
  NaN/infinity ("NINF"). The largest finite value is ``e = 63, m = 510``:
  ``dl16_max = 2^32 * (1 + 510/512) = 8573157376``.
* Rounding: round to nearest, ties away from zero (the paper's "round-nearest-up"; both IBM
  converters add half an ulp to the magnitude and truncate). This differs from IEEE
  round-to-nearest-even only on exact ties.

Conversion from fp32 (what :func:`round_to_dl16` implements):

* finite ``|x|`` rounds (ties away from zero) to 9 fraction bits;
* a result above ``dl16_max`` -- including a value that rounds onto the NINF pattern -- is an
  overflow and becomes the special value; a result below ``dl16_min_normal`` becomes ``±0``;
  fp32 subnormals therefore flush to ``±0``;
* ``±inf`` maps to the special value, NaN stays NaN.

Approximations
--------------
* The special value NINF is represented in fp32 as **signed infinity** when it comes from
  overflow or from ``±inf``, and as **NaN** when the input was NaN. The card has only one
  encoding (IBM's decoder reads it back as NaN regardless of sign), so the simulator keeps one
  bit of information -- inf versus NaN -- that the hardware does not. Signed inf was chosen
  because a 16-bit IEEE container would hold inf after such an overflow anyway and it keeps
  the sign, which the DL16 encoding also keeps. Callers that want the hardware's readback can
  map ``isinf`` to NaN.
* NaN inputs are passed through unchanged (same bits, payload included).
* Inputs that are not float32 (e.g. float64 numpy arrays) are first cast to float32
  (round-to-nearest-even), so such inputs see two roundings; the card's own inputs to
  DL16 conversion are fp32, where this does not arise.
* With ``dl16=True`` the value stored in an fp16/bf16 container is ``cast(dl16(x))``: a second
  rounding to the container's precision and range. For float16, DL16 values above 65504
  become ``±inf`` (the cast saturates to inf), and DL16 values below fp16's normal range
  are re-rounded to fp16 subnormals or zero. For bfloat16 (7 fraction bits) DL16's 9 fraction
  bits are re-rounded to 7 with round-to-nearest-even, so ``dl16`` then matters mainly through
  DL16's range (overflow above ``dl16_max``, flush below ``dl16_min_normal``).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import xla_host  # noqa: F401  (first: the CPU client's dispatch)

__all__ = [
    "STORE_DTYPES",
    "dl16_eps",
    "dl16_max",
    "dl16_min_normal",
    "round_to_dl16",
    "round_to_dl16_np",
    "store_round",
]

# --- DL16 format parameters ------------------------------------------------------------------
_DL16_EXP_BITS = 6
_DL16_FRAC_BITS = 9
_DL16_BIAS = 31
_F32_FRAC_BITS = 23
_F32_BIAS = 127
_SHIFT = _F32_FRAC_BITS - _DL16_FRAC_BITS  # 14 fp32 fraction bits dropped

#: Largest finite DL16 value, 2^32 * (1 + 510/512) (the pattern e=63, m=511 is NaN/inf).
dl16_max: float = float(2.0**32 * (1.0 + 510.0 / 512.0))
#: Smallest nonzero DL16 magnitude, 2^-31 * (1 + 2^-9): the e=0, m=0 pattern is zero.
dl16_min_normal: float = float(2.0**-31 * (1.0 + 2.0**-9))
#: Machine epsilon: the gap between 1.0 and the next DL16 value, 2^-9. The unit roundoff
#: (largest relative error of a rounding, for results in the normal range) is dl16_eps / 2.
dl16_eps: float = float(2.0**-_DL16_FRAC_BITS)

# --- fp32 bit patterns used by the conversion ------------------------------------------------
_SIGN_MASK = 0x8000_0000
_ABS_MASK = 0x7FFF_FFFF
_F32_INF = 0x7F80_0000
_HALF_ULP = 1 << (_SHIFT - 1)  # 0x2000: half a DL16 ulp, in fp32 fraction units
_TRUNC_MASK = ~((1 << _SHIFT) - 1) & 0xFFFF_FFFF  # clears the 14 dropped fraction bits
# fp32 bits of dl16_max: exponent 63 - 31 + 127, fraction 510 << 14.
_MAX_BITS = ((2**_DL16_EXP_BITS - 1 - _DL16_BIAS + _F32_BIAS) << _F32_FRAC_BITS) | (
    ((1 << _DL16_FRAC_BITS) - 2) << _SHIFT
)
# fp32 bits of 2^-31, the value of DL16's zero pattern; a rounded magnitude <= this is zero.
_ZERO_BITS = (_F32_BIAS - _DL16_BIAS) << _F32_FRAC_BITS

assert np.float32(dl16_max).view(np.uint32) == _MAX_BITS
assert np.float32(dl16_min_normal).view(np.uint32) == _ZERO_BITS + (1 << _SHIFT)


def round_to_dl16(x: Any) -> jnp.ndarray:
    """Round float32 values to the nearest DL16 value, returned as float32 (jit-compatible).

    Round to nearest with ties away from zero to 9 fraction bits; results above
    :data:`dl16_max` (and ``±inf``) become ``±inf`` (the DL16 NaN/inf value, see the module
    docstring); results below :data:`dl16_min_normal` become ``±0``; NaN passes through.

    Args:
        x: array-like (numpy or jax) of any shape; cast to float32 if it is not float32.

    Returns:
        A float32 jax array of the same shape whose finite values are exactly representable
        in DL16.
    """
    x = jnp.asarray(x, dtype=jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & jnp.uint32(_SIGN_MASK)
    mag = bits & jnp.uint32(_ABS_MASK)
    # Add half an ulp to the magnitude and truncate: ties away from zero. A carry out of the
    # fraction correctly bumps the exponent. Cannot wrap (mag <= 0x7FFFFFFF); NaN lanes are
    # discarded by the final select.
    rounded = (mag + jnp.uint32(_HALF_ULP)) & jnp.uint32(_TRUNC_MASK)
    rounded = jnp.where(rounded > jnp.uint32(_MAX_BITS), jnp.uint32(_F32_INF), rounded)
    rounded = jnp.where(rounded <= jnp.uint32(_ZERO_BITS), jnp.uint32(0), rounded)
    out = jnp.where(mag > jnp.uint32(_F32_INF), bits, sign | rounded)
    return lax.bitcast_convert_type(out, jnp.float32)


def round_to_dl16_np(x: np.ndarray) -> np.ndarray:
    """Pure-numpy reference for :func:`round_to_dl16`; same semantics, bit for bit.

    Args:
        x: array-like of any shape; cast to float32 if it is not float32.

    Returns:
        A float32 numpy array of the same shape (a 0-d array for scalar input).
    """
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = bits & np.uint32(_SIGN_MASK)
    mag = bits & np.uint32(_ABS_MASK)
    is_nan = mag > np.uint32(_F32_INF)
    rounded = (mag + np.uint32(_HALF_ULP)) & np.uint32(_TRUNC_MASK)
    rounded = np.where(rounded > np.uint32(_MAX_BITS), np.uint32(_F32_INF), rounded)
    rounded = np.where(rounded <= np.uint32(_ZERO_BITS), np.uint32(0), rounded)
    out = np.where(is_nan, bits, sign | rounded).astype(np.uint32)
    return out.view(np.float32)


_JNP_DTYPES: dict[str, Any] = {
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "float32": jnp.float32,
    "int32": jnp.int32,
    "uint32": jnp.uint32,
    "bool": jnp.bool_,
}
#: The storage dtypes :func:`store_round` accepts, by name.
STORE_DTYPES: tuple[str, ...] = tuple(_JNP_DTYPES)


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = jnp.dtype(dtype).name
        except TypeError as e:
            raise ValueError(f"unsupported storage dtype {dtype!r}") from e
    if name not in _JNP_DTYPES:
        raise ValueError(f"unsupported storage dtype {dtype!r}; expected one of {STORE_DTYPES}")
    return name


def store_round(x: Any, dtype: Any, *, dl16: bool) -> jnp.ndarray:
    """Model a store of fp32 results to device memory as a tensor of ``dtype``.

    * ``"float16"`` / ``"bfloat16"``: IEEE cast (round-to-nearest-even; for float16, values
      beyond its range become ``±inf`` and small values become fp16 subnormals or zero). With
      ``dl16=True`` the values are first rounded to DL16 (:func:`round_to_dl16`) and then cast,
      i.e. the result is DL16-rounded but held in the tensor's own dtype.
    * ``"float32"``: unchanged (``dl16`` does not apply: fp32 tensors are stored as fp32).
    * ``"int32"``: round toward zero, like a cast. Out-of-range values and NaN follow XLA's
      conversion (currently: saturate to the int32 limits, NaN -> 0).
    * ``"bool"``: ``x != 0`` (so NaN -> True).

    Args:
        x: float32 values (a jax or numpy array, or anything ``jnp.asarray`` accepts).
        dtype: one of :data:`STORE_DTYPES` by name, or the matching numpy/jax dtype.
        dl16: whether 16-bit float stores go through DL16 emulation.

    Returns:
        A jax array of dtype ``jnp.float16``, ``jnp.bfloat16``, ``jnp.float32``, ``jnp.int32``
        or ``jnp.bool_``, same shape as ``x``. Works inside ``jax.jit`` (``dtype`` and ``dl16``
        static).
    """
    name = _dtype_name(dtype)
    target = _JNP_DTYPES[name]
    x = jnp.asarray(x)
    if name == "bool":
        return x != 0
    if name in ("int32", "uint32"):
        return x.astype(target)
    x = x.astype(jnp.float32)
    if dl16 and name in ("float16", "bfloat16"):
        x = round_to_dl16(x)
    return x.astype(target)
