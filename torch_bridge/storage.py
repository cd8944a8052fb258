"""Spyre tensors' storage: torch storages over the card's device buffers, and the copies.

The bottom layer of the PyTorch side; it stands on ``device_model.runtime`` only (no JAX is
imported, since ``import torch`` loads the device, which stands on this module).

A spyre tensor is a plain ``torch.Tensor`` on PrivateUse1 whose storage is a non-owning
``c10::Storage`` at a *simulated device address*: ``t.untyped_storage().data_ptr()`` is the
address of a :class:`~device_model.runtime.DeviceBuffer` in the current card's device memory
(stick-aligned), so ``spyre_jax.memory_stats()`` counts torch tensors. The buffer's payload is a
writable, flat 1-D ``numpy.uint8`` array of the storage's bytes, in torch's own layout (the
logical, unpadded bytes); views are torch's view metadata (sizes, strides, offset) over that
storage and never copy. The buffer is freed when the storage dies.

Every movement of data is a step on the current stream (``device_model.runtime``): copies in
and out over PCIe, device-side copies at the device-memory bandwidth. :func:`as_card_buffer` and
:func:`from_card_buffer` turn spyre tensors into the stick-layout buffers a launch takes and
launch results back into spyre tensors, without a host round trip.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch

from device_model import runtime as card_runtime
from device_model.layout import TensorLayout
from device_model.payload import PendingRun, State
from device_model.runtime import DeviceBuffer, Runtime, runtime
from lowering.from_fx import card_dtype

from .strides import contig_strides, dense_strides, storage_nbytes

__all__ = [
    "NAME",
    "is_spyre",
    "from_card_buffer",
    "to_host",
    "from_host",
]

NAME = "spyre"

_lock = threading.RLock()
CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# device memory: storages at simulated addresses


@dataclasses.dataclass(frozen=True, slots=True)
class CardResult:
    """A launch result held on the card (its buffer's state: a card array or a pending run) as
    torch sees it: the card ``layout`` it was computed in, the torch ``dtype``, the ``stride``
    (None: contiguous), the storage's ``nbytes``, and the tensor's ``shape``, smaller than the
    layout's where the result was computed at a size bucket and not cropped."""

    layout: TensorLayout
    dtype: torch.dtype
    stride: tuple[int, ...] | None
    nbytes: int
    shape: tuple[int, ...]
    #: the tensor's strides (``stride``, or the contiguous ones)
    strides: tuple[int, ...]

    def torch_bytes(self, data: np.ndarray) -> np.ndarray:
        """The result's values (``data``, in :attr:`layout`) as the storage's flat bytes."""
        return _torch_bytes(data, self.layout, self.dtype, self.stride, self.shape)


def card_result(
    layout: TensorLayout, dtype: torch.dtype, stride: tuple[int, ...] | None, shape: Sequence[int]
) -> CardResult:
    """The :class:`CardResult` of a ``shape`` tensor of ``dtype`` laid out by ``stride`` (None:
    contiguous), computed in ``layout``."""
    isz = dtype.itemsize
    nbytes = math.prod(shape) * isz if stride is None else storage_nbytes(shape, stride, isz)
    shape = tuple(shape)
    strides = contig_strides(shape) if stride is None else tuple(stride)
    return CardResult(layout, dtype, stride, nbytes, shape, strides)


class Region:
    """One torch storage: its device buffer, and torch's view of the buffer's contents.

    The contents are the buffer's state (``device_model.payload``): torch's bytes on the host,
    or a launch's result on the card (a card array or a pending run of the lazy trace) until
    the host needs its bytes, with :attr:`pending` saying how it maps to torch's bytes. The next
    kernel reading the tensor takes the result as it is, so a chain of eager ops never waits
    for the card. The first host access (:attr:`payload`, :attr:`host`: a print, a CPU kernel, a
    copy) materializes torch's bytes, after the launches in flight that read the old host bytes
    (the buffer's readers) have finished (a CPU write never races a kernel's read)."""

    __slots__ = ("buf", "_host", "views", "pending", "ref")

    def __init__(self, buf: DeviceBuffer, pending: CardResult | None = None):
        self.buf = buf
        self._host: torch.Tensor | None = None
        #: (offset, layout) -> (buf.version, view): the card buffers of its tensors
        self.views: dict[tuple, tuple[int, DeviceBuffer]] = {}
        #: the result on the card, while its bytes are not on the host (else None)
        self.pending = pending
        #: the weak reference to its torch storage whose callback frees it (_storage_at)
        self.ref: Any = None

    @property
    def rt(self) -> Runtime:
        return self.buf.rt

    @property
    def base(self) -> int:
        return self.buf.addr

    @property
    def nbytes(self) -> int:
        if self.pending is not None:
            return self.pending.nbytes
        return self.buf.payload().nbytes

    def card_value(self) -> Any:
        """The result on the card (a card array or a pending result), while :attr:`pending`."""
        return self.buf.payload()

    def device_bytes(self) -> np.ndarray:
        """The storage's bytes for a kernel to read (materialized from a result on the card;
        kernels in flight that read them too are not waited for)."""
        if self.pending is not None:
            with _lock:
                pend = self.pending
                if pend is not None:
                    data = self.buf.materialize(pend.torch_bytes)
                    self.pending = None
                    self.views.clear()
                    return data
        return self.buf.payload()

    @property
    def payload(self) -> np.ndarray:
        """The bytes, for the host (waits for the card where it must)."""
        self.buf.settle_readers()
        return self.device_bytes()

    @property
    def host(self) -> torch.Tensor:
        p = self.payload
        if self._host is None:
            self._host = torch.from_numpy(p)  # a CPU uint8 tensor over the same bytes
        return self._host


#: storage data pointer -> its region (live torch storages only)
_regions: dict[int, Region] = {}
#: address of a previous card's live storage -> later cards' blocks kept there (see _alloc)
_shadowed: dict[int, list[tuple[Runtime, int]]] = {}


def wait_all() -> None:
    """Wait for every launch in flight: each result on the card and each read of host bytes."""
    with _lock:
        regions = list(_regions.values())
    for r in regions:
        if r.pending is not None:
            v = r.buf.state.value
            if v is not None:
                v.block_until_ready()
        r.buf.settle_readers()


@functools.cache
def device() -> torch.device:
    """``spyre:0`` (made once: a storage is made with it for every result)."""
    return torch.device(NAME, 0)


def _alloc(rt: Runtime, nbytes: int) -> tuple[DeviceBuffer, int]:
    """(buffer, data pointer) of a new region of at least ``nbytes`` for a torch storage.

    Address 0 is torch's null pointer: a region there takes one more alignment unit and its data
    starts one stick in. An address a previous card's live storage holds is kept allocated until
    that storage dies (torch never sees one pointer twice), and another is taken."""
    mem = rt.memory
    while True:
        base = mem.alloc(nbytes, tag="torch")
        if base == 0:
            mem.free(0)
            base = mem.alloc(nbytes + mem.alignment, tag="torch")
            ptr = base + mem.alignment if base == 0 else base
        else:
            ptr = base
        if ptr not in _regions:
            return DeviceBuffer(rt, base, nbytes), ptr
        _shadowed.setdefault(ptr, []).append((rt, base))


def _release(ptr: int, region: Region, _ref: Any = None) -> None:
    """The storage at ``ptr`` died (the callback of its weak reference): free its buffer."""
    with _lock:
        if _regions.get(ptr) is region:
            del _regions[ptr]
        kept = _shadowed.pop(ptr, ())
    for rt, base in kept:  # the address is free for torch again: so are the blocks kept there
        rt.memory.free(base)
    region.ref = None  # the reference and its callback held the region: they go now
    region.buf.delete()


def _storage_at(
    buf: DeviceBuffer, ptr: int, payload: np.ndarray | None, pending: CardResult | None = None
) -> torch.UntypedStorage:
    region = Region(buf, pending)
    if payload is not None:
        buf.store(payload, shared=True)  # torch's bytes: the host writes them in place
    buf.track_readers()  # launches reading a view of it record themselves there
    with _lock:
        _regions[ptr] = region
    st = torch._C._construct_storage_from_data_pointer(ptr, device(), region.nbytes)
    # a weak reference with a callback, kept by the region (cheaper than weakref.finalize:
    # one per result of every eager op)
    region.ref = weakref.ref(st, functools.partial(_release, ptr, region))
    return st


def new_storage(
    nbytes: int,
    payload: np.ndarray | None = None,
    pending: CardResult | None = None,
    state: State | None = None,
) -> torch.UntypedStorage:
    """A fresh storage of ``nbytes`` in device memory (zero-filled unless ``payload`` is given,
    or a result on the card: its buffer ``state`` and how torch sees it, ``pending``)."""
    rt = runtime()
    with rt.lock, _lock:
        buf, ptr = _alloc(rt, nbytes)
        if pending is not None:
            buf.state = state
        elif payload is None:
            payload = np.zeros(nbytes, np.uint8)
        return _storage_at(buf, ptr, payload, pending)


def region(t: torch.Tensor | torch.UntypedStorage) -> Region:
    """The region behind a spyre tensor or storage (RuntimeError if freed or of another card)."""
    st = t.untyped_storage() if isinstance(t, torch.Tensor) else t
    ptr = st.data_ptr()
    r = _regions.get(ptr)
    if r is None:
        raise RuntimeError(
            f"spyre: tensor storage at {ptr:#x} is not in the card's device memory "
            "(freed, or made outside torch_bridge)"
        )
    if r.buf.rt is not runtime():
        raise RuntimeError(
            "spyre: this tensor lives on a previous card (before spyre_jax.set_card); "
            "copy it to the CPU first"
        )
    return r


def set_storage(
    t: torch.Tensor,
    storage: torch.UntypedStorage,
    offset: int,
    size: Sequence[int],
    stride: Sequence[int],
) -> torch.Tensor:
    """Point ``t`` at ``storage`` (the CPU ``set_`` kernel is device agnostic: metadata only)."""
    return _SET.redispatch_boxed(CPU_KEYS, t, storage, offset, tuple(size), tuple(stride))


#: the ``set_`` overload's dispatcher handle (every result tensor is made with it)
_SET = aten.set_.source_Storage_storage_offset._handle


def new_tensor(
    size: Sequence[int], dtype: torch.dtype | None = None, stride: Sequence[int] | None = None
) -> torch.Tensor:
    """A new spyre tensor with fresh (zero-filled) storage."""
    dtype = dtype or torch.get_default_dtype()
    if dtype.is_complex:
        # the card has no complex numbers (and a complex PrivateUse1 storage crashes torch)
        raise TypeError(
            f"spyre: dtype {dtype} is not supported on the card; supported dtypes: float16, "
            "bfloat16, float32, int32 and int64 (narrowed), bool"
        )
    size = tuple(int(s) for s in size)
    stride = tuple(int(s) for s in stride) if stride is not None else contig_strides(size)
    t = torch._C._acc.create_empty_tensor([0], dtype)
    st = new_storage(storage_nbytes(size, stride, t.element_size()))
    return set_storage(t, st, 0, size, stride)


def _tensor_on(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    """A new tensor over all of ``storage`` (``set_storage`` for sizes already tuples: one per
    eager op's result)."""
    t = torch._C._acc.create_empty_tensor([0], dtype)
    return _SET.redispatch_boxed(CPU_KEYS, t, storage, 0, size, stride)


def alias(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same bytes as spyre tensor ``t`` (zero copy, same view metadata)."""
    r = region(t)
    isz = t.element_size()
    n = r.payload.nbytes - r.payload.nbytes % isz
    if n == 0:  # no bytes (a tensor with no elements)
        return torch.empty(0, dtype=t.dtype).as_strided(t.shape, t.stride(), 0)
    flat = r.host[:n].view(t.dtype)
    return flat.as_strided(t.shape, t.stride(), t.storage_offset())


def is_spyre(t: Any) -> bool:
    """Whether ``t`` is a tensor on the spyre device."""
    return isinstance(t, torch.Tensor) and t.device.type == NAME


# ---------------------------------------------------------------------------------------------
# the timeline: every movement of data is a step on the current stream


def describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def host_reads(t: torch.Tensor) -> None:
    """The host reads ``t``: a copy-out step on the stream that wrote it, and the host waits."""
    card_runtime.host_reads(region(t).buf, f"copy out {describe(t)}", t.numel() * t.element_size())


def host_writes(t: torch.Tensor, what: str = "copy in") -> None:
    """The host wrote ``t``'s bytes: a copy-in step on the current stream."""
    card_runtime.host_wrote(region(t).buf, f"{what} {describe(t)}", t.numel() * t.element_size())


def device_step(what: str, dst: torch.Tensor, srcs: Sequence[torch.Tensor] = ()) -> None:
    """A device-side copy or fill into ``dst``: a step on the current stream."""
    card_runtime.device_copy(
        f"{what} {describe(dst)}",
        [region(s).buf for s in srcs if is_spyre(s)],
        [region(dst).buf],
        dst.numel() * dst.element_size(),
    )


def copy_on_card(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst.copy_(src)`` without the host, when it is a whole result moving: ``src`` all of a
    pending launch result (contiguous), ``dst`` all of its storage, same dtype and number of
    elements. ``dst``'s storage then holds that result, pending, as if the launch had made it
    (the host neither waits for it nor touches the bytes); a device-side copy on the stream.
    False (nothing done) for every other copy."""
    if dst.dtype != src.dtype or dst.numel() != src.numel() or dst.numel() == 0:
        return False
    rs, rd = region(src), region(dst)
    pend = rs.pending
    if (
        pend is None
        or pend.stride is not None
        or pend.dtype != src.dtype
        or rs is rd
        or src.storage_offset() != 0
        or dst.storage_offset() != 0
        or not src.is_contiguous()
        or not dst.is_contiguous()
        or math.prod(pend.shape) != src.numel()
        or rd.nbytes != pend.nbytes
    ):
        return False
    with _lock:
        if rs.pending is not pend:  # the host took the result's bytes meanwhile
            return False
        # the result's state, as the launch made it; the old bytes stay as they are for kernels
        # in flight that read them
        rd.buf.state, rd.pending, rd._host = rs.buf.state, pend, None
        rd.views.clear()
    device_step("copy", dst, [src])
    return True


def takes_storage(out: torch.Tensor, dtype: torch.dtype) -> bool:
    """``out`` (an ``out=`` tensor) has no bytes yet, is nobody's view and is of ``dtype``: it
    can take a result's storage as its own (:func:`adopt`) where torch would resize it to fresh
    memory and copy the result in."""
    return out.dtype == dtype and not out._is_view() and out.untyped_storage().nbytes() == 0


def adopt(out: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``out`` made ``r``'s view of ``r``'s storage (:func:`takes_storage` said it may)."""
    return set_storage(out, r.untyped_storage(), r.storage_offset(), r.shape, r.stride())


def new_from_cpu(c: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's values as a new (contiguous) spyre tensor; a copy-in step."""
    out = new_tensor(c.shape, c.dtype)
    alias(out).copy_(c)
    host_writes(out)
    return out


def check_same_device(tensors: Sequence[Any]) -> None:
    """torch's device-mismatch RuntimeError; 0-dim CPU tensors (scalars) may join any device."""
    first = None
    for a in tensors:
        if not isinstance(a, torch.Tensor):
            continue
        d = a.device
        if d.type == "cpu" and a.dim() == 0:
            continue
        if first is None:
            first = d
        elif d != first:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{first} and {d}!"
            )


# ---------------------------------------------------------------------------------------------
# host values: CPU tensors as the NumPy arrays the card takes, and back


def to_host(t: Any) -> np.ndarray:
    """A CPU torch tensor as the NumPy array the card copies in (bf16 via ml_dtypes)."""
    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    card_dtype(t.dtype, "an input")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.int64:
        return t.numpy().astype(np.int32)
    return t.contiguous().numpy()


def from_host(a: np.ndarray, meta: Any) -> torch.Tensor:
    """A result copied out of the card as a torch tensor of the dtype torch expects."""
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    want = getattr(meta, "dtype", None)
    if want is not None and t.dtype != want:
        t = t.to(want)
    shape = getattr(meta, "shape", None)
    if shape is not None and tuple(t.shape) != tuple(shape) and t.numel() == math.prod(shape):
        t = t.reshape(tuple(shape))  # rank-0 results travel as one-element sticks
    return t


# ---------------------------------------------------------------------------------------------
# launch results as spyre tensors (the operands: torch_bridge.operands)


_TORCH_OF_CARD = {
    k: getattr(torch, k) for k in ("float32", "float16", "bfloat16", "int32", "int8", "uint8")
}
_TORCH_OF_CARD["bool"] = torch.bool


def from_card_buffer(buf: DeviceBuffer, meta: Any = None) -> torch.Tensor:
    """A stick-layout buffer (a launch's result) as a spyre tensor, in place when it can.

    ``meta`` (a fake/meta tensor, optional) gives the torch dtype (int32 results of int64 ops
    are widened back) and the strides (a dense permutation is kept, as torch would). The
    buffer's region becomes the tensor's storage when the bytes fit (``buf`` belongs to the
    tensor then); otherwise the tensor gets fresh storage and ``buf`` is freed.
    """
    dtype = getattr(meta, "dtype", None)
    return from_card(buf, dtype, dense_strides(meta, tuple(buf.layout.shape)))


def from_card(
    buf: DeviceBuffer,
    dtype: torch.dtype | None,
    stride: tuple[int, ...] | None,
    shape: tuple[int, ...] | None = None,
    result: CardResult | None = None,
) -> torch.Tensor:
    """:func:`from_card_buffer` with the torch dtype and strides given. A card array result
    stays pending (the host does not wait for it) until the host needs its bytes. ``shape``:
    the tensor's, where the buffer holds it at a larger size (a size bucket's result: the rest
    is cropped when the host reads it, and masked by the kernels that read it). ``result``: the
    :class:`CardResult` of these arguments where the caller keeps one (an eager plan's
    output), made here otherwise."""
    lay = buf.layout
    if result is not None and type(buf.state) is PendingRun:  # an eager launch's result
        data, host = None, False
    else:
        data = buf.payload()
        host = type(data) is np.ndarray  # (a launch's result: a card array, pending or run)
    if result is None or host:
        shape = lay.shape if shape is None else tuple(shape)
        result = card_result(lay, dtype or _TORCH_OF_CARD[lay.dtype], stride, shape)
    shape, dtype, nbytes = result.shape, result.dtype, result.nbytes
    payload, pending = (result.torch_bytes(data), None) if host else (None, result)
    rt = buf.rt
    base = buf.addr
    with rt.lock, _lock:
        fits = (
            rt is runtime()
            and buf.alive
            and base != 0
            and base not in _regions
            and (nbytes <= buf.nbytes or nbytes <= rt.memory.size_of(base))
        )
        if fits:  # the buffer's region becomes the storage
            st = _storage_at(buf, base, payload, pending)
    if not fits:
        st = new_storage(nbytes, payload, pending, buf.state)
        buf.delete()
    return _tensor_on(st, dtype, shape, result.strides)


def _torch_bytes(
    data: np.ndarray,
    lay: TensorLayout,
    dtype: torch.dtype,
    stride: tuple[int, ...] | None,
    shape: tuple[int, ...],
) -> np.ndarray:
    """A result in the card's layout (``data``, of ``lay``) as the flat bytes of a torch
    storage of a ``shape`` tensor: the stick padding (and a size bucket's) dropped, widened to
    ``dtype`` as torch expects, laid out by ``stride`` (None: contiguous)."""
    if not shape:
        host = data[:1].reshape(())
    elif data.shape != tuple(shape):
        host = data[tuple(slice(0, n) for n in shape)]
    else:
        host = data
    if dtype != _TORCH_OF_CARD[lay.dtype]:
        if dtype == torch.int64:
            host = host.astype(np.int64)
        else:  # any other widening torch expects: convert with torch's own rules
            c = from_host(np.array(host), None).to(dtype)
            host = c.view(torch.int16).numpy() if dtype == torch.bfloat16 else c.numpy()
    if stride is None:
        return np.array(host, copy=True).reshape(-1).view(np.uint8)
    isz = host.dtype.itemsize
    payload = np.zeros(storage_nbytes(shape, stride, isz), np.uint8)
    np.ndarray(shape, host.dtype, payload, 0, tuple(s * isz for s in stride))[...] = host
    return payload
