"""What a device buffer holds: one payload state out of a small closed set.

A :class:`~device_model.runtime.DeviceBuffer` is a region of device memory; what the simulation
keeps for its contents is exactly one of these frozen states (``DeviceBuffer.state``):

* :class:`Unwritten`: allocated, nothing written yet.
* :class:`HostBytes`: a NumPy array in host memory. ``shared``: memory the host itself reads
  and writes in place (a torch storage's bytes, a host array adopted by
  ``copy_in(alias=True)``), so a launch in flight that reads it is a *reader* the host waits
  for before it writes (``DeviceBuffer.settle_readers``).
* :class:`OnCard`: a card (JAX) array a run computed, or host bytes a launch adopted as one
  (``shared`` as above: the same memory), or a view's ``(source, sizes)`` that the program
  reading it gathers first.
* :class:`PendingRun`: the result of a run recorded in the card's lazy trace
  (:class:`~device_model.deferred.Deferred`), computed when a value is needed.
* :class:`Deleted`: freed (``DeviceBuffer.delete`` or garbage collection); any use raises
  ``RuntimeError`` naming ``why``.

The two operations the frontends need are on the buffer: ``materialize`` (host bytes before a
host read: a card array or pending run is converted, kernels in flight that read the bytes are
not waited for) and ``settle_readers`` (before a host write: every launch in flight that reads
the buffer's host-visible bytes finishes first).

The set is closed on purpose: a state the runtime does not know is an error, never a guess.
The next states keep this shape: a *donated* buffer is :class:`Deleted` with ``why="donated"``
(its memory reused by the launch it was given to); a buffer *aliased* by an in-place update is a
state naming the launch that writes it; a buffer *carried by a loop* is a state naming the loop
and its iteration. Each is one more frozen class here and one more case in
``DeviceBuffer.materialize``.

Beside the states, how host values become a buffer's host bytes: :func:`to_device_layout` (the
padded device layout) and :func:`aligned_copy` (memory a launch can adopt as a card array without
a copy). This module imports no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .deferred import Deferred
from .layout import TensorLayout, np_dtype

__all__ = [
    "Unwritten",
    "HostBytes",
    "OnCard",
    "PendingRun",
    "Deleted",
    "State",
    "UNWRITTEN",
    "DELETED",
    "state_of",
    "to_device_layout",
    "aligned_copy",
    "XLA_ALIGN",
]


@dataclass(frozen=True, slots=True)
class Unwritten:
    """Allocated; nothing written yet (its ``value`` is None)."""

    value: ClassVar[None] = None
    shared: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class HostBytes:
    """The contents as a NumPy array in host memory (``shared``: the host writes it in place)."""

    value: np.ndarray
    shared: bool = False


@dataclass(frozen=True, slots=True)
class OnCard:
    """The contents as a card (JAX) array, or a view's ``(source, sizes)`` gathered by the
    program that reads it (``shared``: over host memory the host writes in place)."""

    value: Any
    shared: bool = False


@dataclass(frozen=True, slots=True)
class PendingRun:
    """The result of a run recorded in the card's lazy trace, not computed yet."""

    value: Deferred
    shared: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class Deleted:
    """Freed; using the buffer raises (``why``: ``"deleted"``; ``"donated"`` to come)."""

    why: str = "deleted"
    shared: ClassVar[bool] = False


#: the states a buffer can be in
State = Unwritten | HostBytes | OnCard | PendingRun | Deleted

UNWRITTEN = Unwritten()
DELETED = Deleted()


def state_of(value: Any, shared: bool = False) -> State:
    """The state holding ``value``: host bytes for a NumPy array, a pending run for a
    :class:`~device_model.deferred.Deferred`, a card array otherwise."""
    t = type(value)
    if t is np.ndarray:
        return HostBytes(value, shared)
    if t is Deferred:
        return PendingRun(value)
    if value is None:
        return UNWRITTEN
    return OnCard(value, shared)


def to_device_layout(host: Any, layout: TensorLayout) -> np.ndarray:
    """Host values -> the padded device-layout array (padding zero-filled; rank 0 takes one
    element)."""
    a = np.asarray(host).astype(np_dtype(layout.dtype), copy=False)
    if not layout.shape:
        a = a.reshape(1)
    pad = layout.device_shape[-1] - a.shape[-1]
    if pad:
        a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return a


#: XLA's CPU client adopts host memory aligned to this many bytes as a card array without a copy
XLA_ALIGN = 64


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` in memory aligned to :data:`XLA_ALIGN`: the launch that first reads it
    adopts those bytes instead of holding a second copy of them while it converts."""
    raw = np.empty(a.nbytes + XLA_ALIGN, np.uint8)
    off = -raw.ctypes.data % XLA_ALIGN
    out = raw[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out
