"""Stick layouts: how a logical tensor lies in device memory.

A tensor on the card is stored row-major with its last dimension as the *stick dimension*: that
dimension is split into sticks of the card's ``CardSpec.stick_bytes`` (128 bytes on the real
card) and padded to a whole number of them (CARD.md, "Sticks and layout"). A rank-0 tensor
takes one stick. The record mirrors torch-spyre's: ``device_size`` splits the stick dimension
into (sticks, elements per stick) and ``stride_map`` gives each device dimension's stride in the
logical (unpadded, row-major) tensor, -1 for none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = ["DTYPES", "TensorLayout", "layout_for", "np_dtype", "check_dtype", "SUPPORTED_DTYPES"]

#: Device dtypes and their item sizes in bytes. bool is stored one byte per element.
#: uint32 is held as int32 bits (the card's integer type is int32, CARD.md); the units compute
#: on it as unsigned (comparisons, shifts, division, conversions), as a compiler for the card
#: would emit for it. int8 (CARD.md) and uint8 are one byte an element, 128 to a stick; their
#: arithmetic wraps at 8 bits. int16 is not a card type (CARD.md lists int4, int8 and int32).
DTYPES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "int32": 4,
    "uint32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
SUPPORTED_DTYPES: tuple[str, ...] = tuple(DTYPES)
FLOAT_DTYPES = ("float16", "bfloat16", "float32")


_NP_DTYPES: dict[str, np.dtype] = {}


def np_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype for a device dtype name (bfloat16 via ml_dtypes, as JAX uses)."""
    found = _NP_DTYPES.get(dtype)
    if found is None:  # made once per name (every launch asks)
        found = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        _NP_DTYPES[dtype] = found
    return found


def check_dtype(dtype: str, what: str = "tensor") -> str:
    """Return ``dtype`` if the card supports it, else raise TypeError listing the supported ones."""
    if dtype not in DTYPES:
        raise TypeError(
            f"spyre: {what} has dtype {dtype}, which the card does not support; "
            f"supported dtypes: {', '.join(SUPPORTED_DTYPES)}"
        )
    return dtype


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """A logical shape and dtype with its padded device shape (last dim padded to sticks of
    ``stick_bytes``, the card's :attr:`~device_model.card.CardSpec.stick_bytes`)."""

    shape: tuple[int, ...]
    dtype: str
    device_shape: tuple[int, ...]
    stick_bytes: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def elems_per_stick(self) -> int:
        return self.stick_bytes // self.itemsize

    @property
    def stick_dim(self) -> int:
        """Index of the stick dimension in the logical shape (-1 for a rank-0 tensor)."""
        return len(self.shape) - 1

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies in device memory, padding included."""
        return math.prod(self.device_shape) * self.itemsize

    @property
    def logical_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def padding_bytes(self) -> int:
        return self.nbytes - self.logical_bytes

    @property
    def num_sticks(self) -> int:
        return self.nbytes // self.stick_bytes

    @property
    def device_size(self) -> tuple[int, ...]:
        """torch-spyre style: (leading dims..., sticks, elements per stick)."""
        last = self.device_shape[-1]
        return (*self.device_shape[:-1], last // self.elems_per_stick, self.elems_per_stick)

    @property
    def stride_map(self) -> tuple[int, ...]:
        """Stride of each ``device_size`` dim in the logical row-major tensor (-1: none)."""
        if not self.shape:
            return (-1, 1)
        strides = []
        acc = 1
        for d in reversed(self.shape):
            strides.append(acc)
            acc *= d
        strides.reverse()
        return (*strides[:-1], self.elems_per_stick, 1)

    def __str__(self) -> str:
        dims = ",".join(map(str, self.shape))
        return f"{self.dtype}[{dims}] sticks@dim{self.stick_dim} device{list(self.device_shape)}"


def layout_for(shape: tuple[int, ...], dtype: str, stick_bytes: int) -> TensorLayout:
    """The canonical stick layout of a tensor: row-major, last dim padded to whole sticks of
    ``stick_bytes`` (the card's ``CardSpec.stick_bytes``; required, there is no default card
    here). ValueError when a stick does not hold a whole number of elements of ``dtype``."""
    check_dtype(dtype)
    if stick_bytes <= 0 or stick_bytes % DTYPES[dtype]:
        raise ValueError(
            f"spyre: a stick of {stick_bytes} B does not hold a whole number of {dtype} elements"
        )
    shape = tuple(int(d) for d in shape)
    eps = stick_bytes // DTYPES[dtype]
    if not shape:
        dev = (eps,)
    else:
        last = max(shape[-1], 1)
        dev = (*shape[:-1], -(-last // eps) * eps)
    return TensorLayout(shape, dtype, dev, stick_bytes)
