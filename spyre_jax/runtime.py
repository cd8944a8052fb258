"""The simulated card's runtime state: its description, device memory, and device arrays."""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from device_model.card import DEFAULT_CARD, CardSpec
from device_model.layout import SUPPORTED_DTYPES, TensorLayout, layout_for, np_dtype
from device_model.memory import DeviceMemory, DeviceOOMError
from device_model.recipe import copy_seconds
from device_model.streams import DEFAULT_STREAM, Queues

__all__ = [
    "Array",
    "Device",
    "device_put",
    "devices",
    "memory_stats",
    "runtime",
    "set_card",
    "host_dtype",
    "DeviceOOMError",
]


class Runtime:
    """One card: its spec, its device memory, and its streams (``device_model.streams``)."""

    def __init__(self, card: CardSpec, race_mode: str = "raise"):
        self.card = card
        self.memory = DeviceMemory(card.device_memory_usable_bytes, card.stick_bytes)
        self.queues = Queues(race_mode=race_mode)
        self.lock = threading.RLock()


_local = threading.local()


def stream_stack() -> list[Any]:
    """This thread's ``with spyre_jax.stream(s)`` stack (innermost last)."""
    st = getattr(_local, "stack", None)
    if st is None:
        st = _local.stack = []
    return st


def current_stream_id() -> int:
    """The id of the stream launches go to now (0 outside any ``with spyre_jax.stream``)."""
    st = getattr(_local, "stack", None)
    if st and st[-1]._rt is _runtime:
        return st[-1].id
    return DEFAULT_STREAM


_runtime = Runtime(DEFAULT_CARD)


def runtime() -> Runtime:
    return _runtime


def set_card(card: CardSpec) -> None:
    """Simulate another card from now on: a new, empty device memory and fresh streams.

    Arrays and compiled functions of the previous card stay valid on it (they keep its memory
    alive); passing one of its arrays to a function compiled for the new card is a ValueError.
    """
    global _runtime
    _runtime = Runtime(card, _runtime.queues.race_mode)


class Device:
    """The card as a JAX-style device."""

    platform = "spyre"
    device_kind = "IBM Spyre (simulated)"
    id = 0

    def memory_stats(self) -> dict[str, int]:
        return memory_stats()

    def __repr__(self) -> str:
        return "SpyreDevice(id=0)"


_DEVICE = Device()


def devices() -> list[Device]:
    """The simulated cards (one)."""
    return [_DEVICE]


def memory_stats() -> dict[str, int]:
    """Device-memory figures, with the keys of JAX's ``Device.memory_stats()``."""
    return _runtime.memory.stats()


def host_dtype(x: Any) -> str:
    """The device dtype for a host value; TypeError for float64/complex/unsupported dtypes."""
    dt = np.asarray(x).dtype if not hasattr(x, "dtype") else np.dtype(x.dtype)
    name = dt.name
    if name == "int64" or name == "uint32" or name == "int16" or name == "int8" or name == "uint8":
        if name == "int64":
            warnings.warn("spyre: int64 is narrowed to int32 on the card", stacklevel=3)
        return "int32"
    if name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"spyre: dtype {name} is not supported on the card; supported dtypes: "
            f"{', '.join(SUPPORTED_DTYPES)}"
        )
    return name


def to_device_buffer(host: np.ndarray, layout: TensorLayout) -> jax.Array:
    """Host values -> the padded device-layout buffer (padding zero-filled)."""
    a = np.asarray(host).astype(np_dtype(layout.dtype), copy=False)
    if not layout.shape:
        a = a.reshape(1)
    pad = layout.device_shape[-1] - a.shape[-1]
    if pad:
        a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return jnp.asarray(a)


class Array:
    """A tensor resident in the card's device memory (``spyre_jax.Array``).

    Feeds jitted functions without a host round trip; ``np.asarray(a)`` copies it out.
    Freed when deleted or garbage-collected.
    """

    __slots__ = ("_addr", "_layout", "_rt", "_fin", "__weakref__")

    def __init__(self, rt: Runtime, addr: int, layout: TensorLayout):
        self._rt = rt
        self._addr = addr
        self._layout = layout
        self._fin = weakref.finalize(self, _free_quiet, rt, addr)

    # --- metadata
    @property
    def shape(self) -> tuple[int, ...]:
        return self._layout.shape

    @property
    def dtype(self) -> np.dtype:
        return np_dtype(self._layout.dtype)

    @property
    def ndim(self) -> int:
        return len(self._layout.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._layout.shape, dtype=np.int64))

    @property
    def layout(self) -> TensorLayout:
        """The stick layout the tensor has in device memory."""
        return self._layout

    @property
    def nbytes(self) -> int:
        return self._layout.logical_bytes

    def devices(self) -> set[Device]:
        return {_DEVICE}

    # --- lifetime
    def is_deleted(self) -> bool:
        return not self._fin.alive

    def delete(self) -> None:
        """Free the device memory now; any later use raises RuntimeError."""
        self._fin()

    def _buffer(self) -> jax.Array:
        if not self._fin.alive:
            raise RuntimeError(
                f"Array has been deleted with shape={self._layout.dtype}{list(self.shape)}."
            )
        return self._rt.memory.load(self._addr)

    def block_until_ready(self) -> Array:
        """Wait (the host, in simulated time too) for the step that computes this array."""
        self._buffer().block_until_ready()
        self._rt.queues.wait_for_writer(self._addr)
        return self

    # --- host access
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        buf = np.asarray(self._buffer())
        # a copy-out step on the stream that wrote the array; the host waits for it
        q = self._rt.queues
        sid = q.writer_stream(self._addr)
        n = self._layout.nbytes
        q.submit(
            sid,
            "copy_out",
            f"copy out {self._layout.dtype}{list(self.shape)}",
            reads=(self._addr,),
            duration=copy_seconds(n, self._rt.card),
            nbytes=n,
        )
        q.synchronize(sid)
        if self.shape:
            out = buf[..., : self.shape[-1]]
        else:
            out = buf[0]
        out = np.array(out, dtype=dtype) if dtype is not None else np.array(out)
        return out

    def __repr__(self) -> str:
        if self.is_deleted():
            return f"spyre_jax.Array(<deleted>, shape={self.shape}, dtype={self._layout.dtype})"
        return f"spyre_jax.Array({np.asarray(self)!r}, dtype={self._layout.dtype})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]


def _free_quiet(rt: Runtime, addr: int) -> None:
    if addr in rt.memory:
        rt.memory.free(addr)
        rt.queues.forget(addr)


def new_array(rt: Runtime, addr: int, layout: TensorLayout, buf: jax.Array) -> Array:
    rt.memory.store(addr, buf, layout.nbytes)
    return Array(rt, addr, layout)


def device_put(x: Any, device: Device | None = None) -> Array:
    """Copy a host value (NumPy/JAX array or scalar) into device memory (an :class:`Array`)."""
    if isinstance(x, Array):
        x._buffer()
        return x
    if isinstance(x, (list, tuple, dict)):
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
    layout = layout_for(host.shape, dt, _runtime.card.stick_bytes)
    rt = _runtime
    sid = current_stream_id()
    rt.queues.state(sid)  # a destroyed stream is refused before anything is allocated
    with rt.lock:
        addr = rt.memory.alloc(layout.nbytes, tag="device_put")
        try:
            buf = to_device_buffer(host, layout)
        except BaseException:
            rt.memory.free(addr)
            raise
        arr = new_array(rt, addr, layout, buf)
    n = layout.nbytes
    rt.queues.submit(
        sid,
        "copy_in",
        f"copy in {layout.dtype}{list(layout.shape)}",
        writes=(addr,),
        duration=copy_seconds(n, rt.card),
        nbytes=n,
    )
    return arr
