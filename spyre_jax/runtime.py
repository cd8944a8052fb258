"""Device arrays for JAX users: ``spyre_jax.Array``, ``device_put``, ``devices``, ``set_card``.

A thin layer over ``device_model.runtime``, which owns the card's memory, streams and launches:
an :class:`Array` wraps one :class:`~device_model.runtime.DeviceBuffer`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import numpy as np

from device_model import runtime as card_runtime
from device_model.card import CardSpec
from device_model.layout import SUPPORTED_DTYPES, TensorLayout, layout_for, np_dtype
from device_model.memory import DeviceOOMError
from device_model.runtime import DeviceBuffer, copy_in, copy_out, runtime, wait_until_written

from . import jax_private

__all__ = [
    "Array",
    "Device",
    "device_put",
    "devices",
    "memory_stats",
    "set_card",
    "host_dtype",
    "DeviceOOMError",
]


def set_card(card: CardSpec) -> None:
    """Simulate another card from now on: a new, empty device memory and fresh streams.

    Arrays and compiled functions of the previous card stay valid on it (they keep its memory
    alive); passing one of its arrays to a function compiled for the new card is a ValueError.
    """
    card_runtime.set_card(card)


class Device:
    """A simulated card as a JAX-style device: the devices of a ``jax.sharding.Mesh`` that a
    multi-card function (``jax.shard_map``) runs over."""

    platform = "spyre"
    device_kind = "IBM Spyre (simulated)"
    process_index = 0
    num_cores = None  # a JAX device attribute; the card's cores are ``CardSpec.num_cores``

    def __init__(self, id: int = 0):
        self.id = id

    def memory_stats(self) -> dict[str, int]:
        return memory_stats()

    def __eq__(self, other: object) -> bool:
        return type(other) is Device and other.id == self.id

    def __hash__(self) -> int:
        return hash(("spyre", self.id))

    def __repr__(self) -> str:
        return f"SpyreDevice(id={self.id})"


_DEVICE = Device()


def devices() -> list[Device]:
    """The simulated cards: ``SPYRE_NUM_CARDS`` of them (one when unset). Build a
    ``jax.sharding.Mesh`` of them for a ``jax.shard_map`` function (tensor parallelism); a
    single-card function runs on the first."""
    n = num_cards()
    return [_DEVICE] + [Device(i) for i in range(1, n)]


def num_cards() -> int:
    """The number of simulated cards: ``SPYRE_NUM_CARDS`` (1 when unset; ValueError when it
    is not a positive integer)."""
    raw = os.environ.get("SPYRE_NUM_CARDS", "1").strip() or "1"
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"spyre: SPYRE_NUM_CARDS must be a positive integer, got {raw!r}")
    return n


def memory_stats() -> dict[str, int]:
    """Device-memory figures, with the keys of JAX's ``Device.memory_stats()``."""
    return runtime().memory.stats()


def host_dtype(x: Any) -> str:
    """The device dtype for a host value; TypeError for float64/complex/unsupported dtypes."""
    dt = np.asarray(x).dtype if not hasattr(x, "dtype") else np.dtype(x.dtype)
    name = dt.name
    if name == "int64":
        warnings.warn("spyre: int64 is narrowed to int32 on the card", stacklevel=3)
        return "int32"
    if name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"spyre: dtype {name} is not supported on the card; supported dtypes: "
            f"{', '.join(SUPPORTED_DTYPES)}"
        )
    return name


class Array:
    """A tensor resident in the card's device memory (``spyre_jax.Array``).

    Feeds jitted functions without a host round trip; ``np.asarray(a)`` copies it out.
    Freed when deleted or garbage-collected. Its operators and methods are ``jax.Array``'s,
    run on the card op by op (:mod:`spyre_jax.array_ops`, installed by ``spyre_jax.api``); it
    is not a ``jax.Array``
    (``isinstance`` answers False: JAX's array type cannot be subclassed, and its values live in
    the simulated card's memory, not in a JAX buffer), and ``jnp`` functions take it through
    ``__jax_array__``. Pickled as its values (unpickled into device memory again).
    """

    __slots__ = ("_buf", "__weakref__")

    def __init__(self, buf: DeviceBuffer):
        self._buf = buf

    # --- metadata
    @property
    def shape(self) -> tuple[int, ...]:
        return self._buf.layout.shape

    @property
    def dtype(self) -> np.dtype:
        return np_dtype(self._buf.layout.dtype)

    @property
    def ndim(self) -> int:
        return len(self._buf.layout.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._buf.layout.shape, dtype=np.int64))

    @property
    def layout(self) -> TensorLayout:
        """The stick layout the tensor has in device memory."""
        return self._buf.layout

    @property
    def nbytes(self) -> int:
        return self._buf.layout.logical_bytes

    @property
    def buffer(self) -> DeviceBuffer:
        """The device buffer this array wraps (``device_model.runtime.DeviceBuffer``)."""
        self._check_alive()
        return self._buf

    def devices(self) -> set[Device]:
        return {_DEVICE}

    # --- lifetime
    def is_deleted(self) -> bool:
        return not self._buf.alive

    def delete(self) -> None:
        """Free the device memory now; any later use raises RuntimeError."""
        self._buf.delete()

    def _check_alive(self) -> None:
        if not self._buf.alive:
            lay = self._buf.layout
            raise RuntimeError(f"Array has been deleted with shape={lay.dtype}{list(lay.shape)}.")

    def _buffer(self) -> Any:
        """The payload: the padded device-layout array."""
        self._check_alive()
        return self._buf.payload()

    def block_until_ready(self) -> Array:
        """Wait (the host, in simulated time too) for the step that computes this array."""
        p = self._buffer()
        if hasattr(p, "block_until_ready"):
            p.block_until_ready()
        wait_until_written(self._buf)
        return self

    # --- host access
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self._check_alive()
        out = copy_out(self._buf)
        return out.astype(dtype, copy=False) if dtype is not None else out

    def __repr__(self) -> str:
        lay = self._buf.layout
        if self.is_deleted():
            return f"spyre_jax.Array(<deleted>, shape={lay.shape}, dtype={lay.dtype})"
        return f"spyre_jax.Array({np.asarray(self)!r}, dtype={lay.dtype})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return device_put, (np.asarray(self),)


jax_private.register_array_type(Array)


def device_put(x: Any, device: Device | None = None) -> Array:
    """Copy a host value (NumPy/JAX array or scalar) into device memory (an :class:`Array`)."""
    if isinstance(x, Array):
        x._check_alive()
        return x
    if isinstance(x, list | tuple | dict):
        return jax.tree_util.tree_map(device_put, x)
    if np.iscomplexobj(x) or (hasattr(x, "dtype") and np.dtype(x.dtype).kind == "c"):
        raise TypeError(
            f"spyre: dtype {np.asarray(x).dtype.name} is not supported on the card; "
            f"supported dtypes: {', '.join(SUPPORTED_DTYPES)}"
        )
    if isinstance(x, float) and not hasattr(x, "dtype"):
        x = np.float32(x)
    elif isinstance(x, bool):
        x = np.bool_(x)
    elif isinstance(x, int) and not hasattr(x, "dtype"):
        x = np.int32(x)
    dt = host_dtype(x)
    host = np.asarray(x)
    rt = runtime()
    layout = layout_for(host.shape, dt, rt.card.stick_bytes)
    # a JAX array never changes: where its bytes are already in the card's layout the card may
    # keep them (no second copy of a model's weights on the host); a NumPy array is copied
    immutable = isinstance(x, jax.Array)
    return Array(copy_in(host, layout, rt=rt, tag="device_put", alias=immutable))
