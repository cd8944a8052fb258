"""The ``spyre`` device: PyTorch tensors that live in the simulated card's device memory.

PrivateUse1 is renamed ``spyre`` in Python (``torch.utils.backend_registration.
_setup_privateuseone_for_python_backend``); ``torch.spyre`` is the backend module. Loaded by the
``torch.backends`` entry point (:func:`_autoload`), so ``import torch`` alone makes the device
exist; importing this module does the same when autoloading is off
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). Registration imports neither jax nor ``spyre_jax``: the
card's runtime is imported by the first kernel that needs it.

**Tensors.** A spyre tensor is a plain ``torch.Tensor`` on PrivateUse1 whose storage is a
non-owning ``c10::Storage`` at a *simulated device address*: ``t.untyped_storage().data_ptr()``
is the address of a region of ``spyre_jax.runtime.runtime().memory`` (the card's
``DeviceMemory``, 128-byte aligned), so ``spyre_jax.memory_stats()`` counts torch tensors. The
region's payload is a writable, flat 1-D ``numpy.uint8`` array of the storage's bytes, in torch's
own layout (the logical, unpadded bytes); views are torch's view metadata (sizes, strides,
offset) over that storage and never copy. The region is freed when the storage dies.

Address 0 is torch's null pointer: a storage whose region would start at 0 takes one more
alignment unit and starts 128 bytes in (its data pointer is still an address inside its region).

**Kernels.** Storage plumbing (empty, set_, resize_, views) is registered per op; host<->device
copies and pure data movement (``copy_``, ``fill_``, ``zero_``, RNG fills, ``.item()``) work on
the payload directly and are steps on the current stream's timeline (copy in, copy out, or a
device-side copy). Compute ops go through :mod:`torch_bridge.eager`: a one-op FX graph, imported
by ``lowering.from_fx``, compiled by ``spyre_jax.api.compile_graph`` and cached by op, shapes,
dtypes and static arguments; ops with no lowering rule run on the CPU with a
``SpyreFallbackWarning`` (counted, :func:`fallback_stats`).

**Compile backend.** :func:`is_spyre`, :func:`as_card_array` and :func:`from_card_array` let
``torch_bridge.backend`` pass spyre tensors to a compiled graph as ``spyre_jax.Array`` s and get
spyre tensors back, without a host round trip.
"""

from __future__ import annotations

import threading
import types
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from spyre_jax.runtime import Array, Runtime

__all__ = [
    "NAME",
    "register",
    "is_spyre",
    "as_card_array",
    "from_card_array",
    "compile_count",
    "eager_stats",
    "fallback_stats",
    "reset_stats",
]

NAME = "spyre"

_lock = threading.RLock()
_registered = False
_CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# device memory: storages at simulated addresses


class _Region:
    """One torch storage's region of device memory: its runtime, base address and payload."""

    __slots__ = ("rt", "base", "payload", "host")

    def __init__(self, rt: Runtime, base: int, payload: np.ndarray):
        self.rt = rt
        self.base = base
        self.payload = payload
        self.host = torch.from_numpy(payload)  # a CPU uint8 tensor over the same bytes


#: storage data pointer -> its region (live torch storages only)
_regions: dict[int, _Region] = {}


def _runtime() -> Runtime:
    from spyre_jax.runtime import runtime

    return runtime()


def _device() -> torch.device:
    return torch.device(NAME, 0)


def _alloc(rt: Runtime, nbytes: int) -> tuple[int, int]:
    """(base, data pointer) of a new region of at least ``nbytes`` for a torch storage.

    Address 0 is torch's null pointer: such a region takes one more alignment unit and its data
    starts there. An address a storage of a previous card (before ``set_card``) still uses is
    kept allocated (never handed to torch twice) and another is taken.
    """
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
            return base, ptr
        # a tensor of a previous card lives at this address: keep the block, take another


def _release(ptr: int, region: _Region) -> None:
    """The storage at ``ptr`` died: free its region."""
    with _lock:
        if _regions.get(ptr) is region:
            del _regions[ptr]
    mem = region.rt.memory
    if region.base in mem:
        mem.free(region.base)
        region.rt.queues.forget(region.base)


def _storage_at(rt: Runtime, base: int, ptr: int, payload: np.ndarray) -> torch.UntypedStorage:
    region = _Region(rt, base, payload)
    rt.memory.store(base, payload)
    with _lock:
        _regions[ptr] = region
    st = torch._C._construct_storage_from_data_pointer(ptr, _device(), payload.nbytes)
    fin = weakref.finalize(st, _release, ptr, region)
    fin.atexit = False
    return st


def _new_storage(nbytes: int, payload: np.ndarray | None = None) -> torch.UntypedStorage:
    """A fresh storage of ``nbytes`` in device memory (zero-filled unless ``payload`` given)."""
    rt = _runtime()
    with rt.lock, _lock:
        base, ptr = _alloc(rt, nbytes)
        if payload is None:
            payload = np.zeros(nbytes, np.uint8)
        return _storage_at(rt, base, ptr, payload)


def _region(t: torch.Tensor | torch.UntypedStorage) -> _Region:
    st = t.untyped_storage() if isinstance(t, torch.Tensor) else t
    ptr = st.data_ptr()
    r = _regions.get(ptr)
    if r is None:
        raise RuntimeError(
            f"spyre: tensor storage at {ptr:#x} is not in the card's device memory "
            "(freed, or made outside torch_bridge)"
        )
    if r.rt is not _runtime():
        raise RuntimeError(
            "spyre: this tensor lives on a previous card (before spyre_jax.set_card); "
            "copy it to the CPU first"
        )
    return r


def _contig_strides(size: Sequence[int]) -> tuple[int, ...]:
    st, acc = [], 1
    for s in reversed(tuple(size)):
        st.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(st))


def _storage_nbytes(
    size: Sequence[int], stride: Sequence[int], itemsize: int, offset: int = 0
) -> int:
    if any(int(s) == 0 for s in size):
        return offset * itemsize
    return (
        offset + 1 + sum((int(s) - 1) * int(st) for s, st in zip(size, stride, strict=True))
    ) * itemsize


def _set(
    t: torch.Tensor,
    storage: torch.UntypedStorage,
    offset: int,
    size: Sequence[int],
    stride: Sequence[int],
) -> torch.Tensor:
    """Point ``t`` at ``storage`` (the CPU ``set_`` kernel is device agnostic: metadata only)."""
    return aten.set_.source_Storage_storage_offset.redispatch(
        _CPU_KS, t, storage, offset, list(size), list(stride)
    )


def _new_tensor(
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
    stride = tuple(int(s) for s in stride) if stride is not None else _contig_strides(size)
    t = torch._C._acc.create_empty_tensor([0], dtype)
    st = _new_storage(_storage_nbytes(size, stride, t.element_size()))
    return _set(t, st, 0, size, stride)


def _tensor_on(
    storage: torch.UntypedStorage, dtype: torch.dtype, size: Sequence[int], stride: Sequence[int]
) -> torch.Tensor:
    t = torch._C._acc.create_empty_tensor([0], dtype)
    return _set(t, storage, 0, size, stride)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same bytes as spyre tensor ``t`` (zero copy, same view metadata)."""
    r = _region(t)
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


def _submit(
    kind: str, name: str, reads: Sequence[int] = (), writes: Sequence[int] = (), nbytes: int = 0
) -> None:
    """Record a step: ``copy_in``/``copy_out`` over PCIe, ``run_kernel`` for a device-side copy
    (read and write ``nbytes`` at the device-memory bandwidth)."""
    from device_model.recipe import copy_seconds
    from spyre_jax.runtime import current_stream_id

    rt = _runtime()
    card = rt.card
    if kind == "run_kernel":
        dur = 2 * nbytes / (card.device_memory_bw * card.device_memory_efficiency)
    else:
        dur = copy_seconds(nbytes, card)
    rt.queues.submit(
        current_stream_id(), kind, name, reads=reads, writes=writes, duration=dur, nbytes=nbytes
    )


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _host_reads(t: torch.Tensor) -> None:
    """The host reads ``t``: a copy-out step on the stream that wrote it, and the host waits."""
    r = _region(t)
    q = r.rt.queues
    sid = q.writer_stream(r.base)
    n = t.numel() * t.element_size()
    from device_model.recipe import copy_seconds

    q.submit(
        sid,
        "copy_out",
        f"copy out {_describe(t)}",
        reads=(r.base,),
        duration=copy_seconds(n, r.rt.card),
        nbytes=n,
    )
    q.synchronize(sid)


def _host_writes(t: torch.Tensor, what: str = "copy in") -> None:
    r = _region(t)
    _submit(
        "copy_in", f"{what} {_describe(t)}", writes=(r.base,), nbytes=t.numel() * t.element_size()
    )


def _device_step(what: str, dst: torch.Tensor, srcs: Sequence[torch.Tensor] = ()) -> None:
    reads = tuple(_region(s).base for s in srcs if is_spyre(s))
    _submit(
        "run_kernel",
        f"{what} {_describe(dst)}",
        reads=reads,
        writes=(_region(dst).base,),
        nbytes=dst.numel() * dst.element_size(),
    )


# ---------------------------------------------------------------------------------------------
# the compile backend's doors: spyre tensors as card arrays and back


def as_card_array(t: torch.Tensor) -> Array:
    """A spyre tensor as a ``spyre_jax.Array`` in the card's stick layout (dtype as the card
    has it: int64 narrowed to int32, bf16 via ml_dtypes).

    The array is a new device buffer built from the tensor's bytes: for a strided view that is a
    device-side re-layout (a gather), recorded on the current stream. The caller owns the array
    (freed when deleted or garbage-collected). Its payload is a host NumPy array in the padded
    device shape, which the card program takes as is: use it for launches.
    """
    from device_model.layout import layout_for
    from lowering.from_fx import card_dtype

    dt = card_dtype(t.dtype, "a spyre tensor")
    return _card_array(t, layout_for(tuple(t.shape), dt, _region(t).rt.card.stick_bytes))


def _card_host(t: torch.Tensor) -> np.ndarray:
    """The logical values of spyre tensor ``t`` as a (strided, zero-copy where the dtype allows)
    NumPy array of its card dtype."""
    al = _alias(t)
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return al.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.int64:
        return al.numpy().astype(np.int32)
    return al.numpy()


def _card_array(t: torch.Tensor, layout: Any) -> Array:
    from spyre_jax.runtime import Array, current_stream_id

    r = _region(t)
    rt = r.rt
    host = _card_host(t)
    buf = np.zeros(layout.device_shape, host.dtype)
    if host.ndim:
        buf[..., : host.shape[-1]] = host
    else:
        buf[0] = host
    with rt.lock:
        addr = rt.memory.alloc(layout.nbytes, tag="torch-operand")
        rt.memory.store(addr, buf)
        arr = Array(rt, addr, layout)
    if not t.is_contiguous():
        _submit("run_kernel", f"relayout {_describe(t)}", (r.base,), (addr,), layout.nbytes)
    else:  # the kernel reads the tensor's own bytes: it must not race their writer
        rt.queues.check_reads(current_stream_id(), "run_kernel", "read operand", (r.base,))
    return arr


def _dense_strides(meta: Any, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """``meta``'s strides when they are a permutation of a dense layout other than the
    contiguous one, else None (contiguous)."""
    if not isinstance(meta, torch.Tensor) or meta.dim() != len(shape):
        return None
    st = tuple(int(s) for s in meta.stride())
    if st == _contig_strides(shape) or not _dense_permutation(shape, st):
        return None
    return st


def _dense_permutation(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely in some dimension order (no gaps, no
    overlap), as torch's ``is_non_overlapping_and_dense``."""
    acc = 1
    for size, st in sorted(
        ((s, t) for s, t in zip(shape, stride, strict=True) if s != 1), key=lambda p: p[1]
    ):
        if st != acc:
            return False
        acc *= size
    return True


def from_card_array(a: Array, meta: Any = None) -> torch.Tensor:
    """A ``spyre_jax.Array`` (a launch's result) as a spyre tensor, in place when it can.

    ``meta`` (a fake/meta tensor, optional) gives the torch dtype (int32 results of int64 ops
    are widened back) and the strides (a dense permutation is kept, as torch would). The array's
    region becomes the tensor's storage when the bytes fit (``a`` must not be used afterwards);
    otherwise the tensor gets fresh storage and ``a`` is deleted.
    """
    dtype = getattr(meta, "dtype", None)
    return _from_card(a, dtype, _dense_strides(meta, tuple(a.shape)))


_TORCH_OF_CARD = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "bool": torch.bool,
}


def _from_card(a: Array, dtype: torch.dtype | None, stride: tuple[int, ...] | None) -> torch.Tensor:
    lay = a._layout
    shape = lay.shape
    buf = np.asarray(a._buffer())
    if not shape:
        host = buf[:1].reshape(())
    elif buf.shape[-1] != shape[-1]:
        host = buf[..., : shape[-1]]
    else:
        host = buf
    have = _TORCH_OF_CARD[lay.dtype]
    dtype = dtype or have
    if dtype != have:
        if dtype == torch.int64:
            host = host.astype(np.int64)
        else:  # any other widening torch expects: convert with torch's own rules
            from .backend import from_host

            c = from_host(np.array(host), None).to(dtype)
            host = c.view(torch.int16).numpy() if dtype == torch.bfloat16 else c.numpy()
    if stride is None:
        payload = np.array(host, copy=True).reshape(-1).view(np.uint8)
        stride = _contig_strides(shape)
    else:
        isz = host.dtype.itemsize
        payload = np.zeros(_storage_nbytes(shape, stride, isz), np.uint8)
        np.ndarray(shape, host.dtype, payload, 0, tuple(s * isz for s in stride))[...] = host
    rt = a._rt
    base = a._addr
    with rt.lock, _lock:
        fits = (
            rt is _runtime()
            and a._fin.alive
            and base != 0
            and base not in _regions
            and payload.nbytes <= rt.memory.size_of(base)
        )
        if fits:
            a._fin.detach()  # the region now belongs to the storage
            st = _storage_at(rt, base, base, payload)
    if not fits:
        st = _new_storage(payload.nbytes, payload)
        a.delete()
    return _tensor_on(st, dtype, shape, stride)


def _new_from_cpu(c: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's values as a new (contiguous) spyre tensor; a copy-in step."""
    out = _new_tensor(c.shape, c.dtype)
    _alias(out).copy_(c)
    _host_writes(out)
    return out


# ---------------------------------------------------------------------------------------------
# device checks


def _check_same_device(tensors: Sequence[Any]) -> None:
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
# kernels: storage plumbing and data movement


def _k_empty(
    size: Sequence[int],
    dtype: torch.dtype | None = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
    memory_format: Any = None,
) -> torch.Tensor:
    if memory_format in (torch.channels_last, torch.channels_last_3d):
        cpu = torch.empty(size, dtype=dtype, device="meta", memory_format=memory_format)
        return _new_tensor(size, dtype, cpu.stride())
    return _new_tensor(size, dtype)


def _k_empty_strided(
    size: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype | None = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
) -> torch.Tensor:
    return _new_tensor(size, dtype, stride)


def _k_set_storage_offset(
    self: torch.Tensor,
    source: torch.UntypedStorage,
    storage_offset: int,
    size: Sequence[int],
    stride: Sequence[int] = (),
) -> torch.Tensor:
    return _set(self, source, storage_offset, size, stride or _contig_strides(size))


def _k_set_storage(self: torch.Tensor, source: torch.UntypedStorage) -> torch.Tensor:
    return _set(self, source, 0, (source.nbytes() // self.element_size(),), (1,))


def _k_set_tensor(self: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return _set(
        self, source.untyped_storage(), source.storage_offset(), source.shape, source.stride()
    )


def _k_resize(self: torch.Tensor, size: Sequence[int], memory_format: Any = None) -> torch.Tensor:
    size = tuple(int(s) for s in size)
    if tuple(self.shape) == size and self.is_contiguous():
        return self
    stride = _contig_strides(size)
    need = _storage_nbytes(size, stride, self.element_size(), self.storage_offset())
    old = self.untyped_storage()
    if need > old.nbytes():
        st = _new_storage(need)
        src = _region(old)
        _region(st).payload[: old.nbytes()] = src.payload[: old.nbytes()]
        old = st
    return _set(self, old, self.storage_offset(), size, stride)


def _k_copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(self)`` where either is on spyre: host<->device copies and device copies,
    with torch's broadcasting and dtype conversion."""
    if is_spyre(dst) and is_spyre(self):
        _alias(dst).copy_(_alias(self))
        _device_step("copy", dst, [self])
    elif is_spyre(dst):
        if self.device.type != "cpu":
            self = self.cpu()
        _alias(dst).copy_(self)
        _host_writes(dst)
    else:
        _host_reads(self)
        dst.copy_(_alias(self))
    return dst


def _k_copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if tuple(dst.shape) != tuple(self.shape):
        dst.resize_(self.shape)
    return _k_copy_from(self, dst)


def _k_local_scalar_dense(self: torch.Tensor) -> Any:
    _host_reads(self)
    return _alias(self).item()


def _k_fill_scalar(self: torch.Tensor, value: Any) -> torch.Tensor:
    _alias(self).fill_(value)
    _device_step("fill", self)
    return self


def _k_fill_tensor(self: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if value.dim() != 0:
        raise RuntimeError(
            "fill_ only supports 0-dimension value tensor but got tensor with "
            f"{value.dim()} dimensions."
        )
    return _k_fill_scalar(self, value.item())


def _k_zero(self: torch.Tensor) -> torch.Tensor:
    _alias(self).zero_()
    _device_step("zero", self)
    return self


#: in-place RNG fills: drawn from torch's CPU generator (so ``torch.manual_seed`` gives the same
#: numbers as on the CPU) and copied in
_RNG_OPS = (
    "normal_",
    "uniform_",
    "random_",
    "random_.from",
    "random_.to",
    "bernoulli_.float",
    "bernoulli_.Tensor",
    "exponential_",
    "log_normal_",
    "cauchy_",
    "geometric_",
)


def _rng_kernel(op: Any) -> Any:
    def k(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        _check_same_device([self, *args])
        args = tuple(a.cpu() if is_spyre(a) else a for a in args)
        tmp = torch.empty(self.shape, dtype=self.dtype)
        op(tmp, *args, **kwargs)
        _alias(self).copy_(tmp)
        _host_writes(self, "random")
        return self

    return k


_VIEW_OPS = ("view", "as_strided", "_reshape_alias", "unfold", "view_as_real", "view_as_complex")


def _view_kernel(op: Any) -> Any:
    def k(*args: Any, **kwargs: Any) -> torch.Tensor:
        return op.redispatch(_CPU_KS, *args, **kwargs)

    return k


# ---------------------------------------------------------------------------------------------
# pitfalls patched at the Python level


def _patch_storage() -> None:
    """``torch.UntypedStorage(n, device="spyre")`` would crash (no C++ allocator for
    PrivateUse1, and none can be registered from Python): the Python paths that construct one
    make our storages instead."""
    import torch.storage as ts

    orig_new = torch.UntypedStorage.__new__

    def new(cls: type, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is not None and torch.device(device).type == NAME:
            if kwargs or len(args) > 1 or (args and not isinstance(args[0], int)):
                raise RuntimeError(
                    "spyre: UntypedStorage(..., device='spyre') takes only a size; "
                    "make a tensor and use its untyped_storage()"
                )
            return _new_storage(int(args[0]) if args else 0)
        if device is None:
            return orig_new(cls, *args, **kwargs)
        return orig_new(cls, *args, device=device, **kwargs)

    torch.UntypedStorage.__new__ = new  # type: ignore[method-assign]

    orig_clone = ts._StorageBase.clone

    def clone(self: Any) -> Any:
        if self.device.type == NAME:
            st = _new_storage(self.nbytes())
            _region(st).payload[:] = _region(self).payload[: self.nbytes()]
            return st
        return orig_clone(self)

    ts._StorageBase.clone = clone  # type: ignore[method-assign]

    orig_to = ts._to

    def to(self: Any, device: Any, non_blocking: bool = False) -> Any:
        device = torch.device(device)
        if device.type == NAME and self.device.type != NAME:
            src = self.untyped() if hasattr(self, "untyped") else self
            st = _new_storage(src.nbytes())
            host = torch.empty(0, dtype=torch.uint8).set_(src.cpu())
            _region(st).payload[:] = host.numpy()
            return st
        return orig_to(self, device, non_blocking)

    ts._to = to
    ts._StorageBase.spyre = (  # type: ignore[attr-defined]
        lambda self, device=None, non_blocking=False: to(self, _device(), non_blocking)
    )


def _patch_printing() -> None:
    """Printing formats the values on the CPU (one copy out), as torch does for XLA tensors,
    instead of running the formatter's dozen ops on the card; the device suffix stays."""
    import torch._tensor_str as tstr

    orig = tstr._tensor_str

    def _tensor_str(self: torch.Tensor, indent: int) -> str:
        if self.device.type == NAME:
            self = self.cpu()
        return orig(self, indent)

    tstr._tensor_str = _tensor_str


# ---------------------------------------------------------------------------------------------
# the backend module: torch.spyre


class _DeviceContext:
    """``torch.spyre.device(idx)``: the card has one device, so this only checks the index."""

    def __init__(self, device: Any):
        self.device = device

    def __enter__(self) -> _DeviceContext:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


def _synchronize(device: Any = None) -> None:
    """Wait (in simulated time too) for all work on the card: ``spyre_jax.synchronize()``."""
    import spyre_jax

    spyre_jax.synchronize()


def _memory_stats(device: Any = None) -> dict[str, int]:
    import spyre_jax

    return spyre_jax.memory_stats()


def _make_module() -> types.ModuleType:
    mod = types.ModuleType(f"torch.{NAME}", "The simulated IBM Spyre card (torch_bridge.device).")
    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: 0
    mod.set_device = lambda device: None
    mod.synchronize = _synchronize
    mod.device = _DeviceContext
    mod._is_in_bad_fork = lambda: False
    mod.manual_seed = lambda seed: None  # random fills use torch's CPU generator
    mod.manual_seed_all = lambda seed: None
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    mod.memory_stats = _memory_stats
    mod.memory_allocated = lambda device=None: _memory_stats()["bytes_in_use"]
    mod.max_memory_allocated = lambda device=None: _memory_stats()["peak_bytes_in_use"]
    mod.compile_count = compile_count
    return mod


def _make_hooks() -> Any:
    class _Hooks(torch._C._acc.PrivateUse1Hooks):  # type: ignore[misc, name-defined]
        def is_available(self) -> bool:
            return True

        def has_primary_context(self, dev_id: int) -> bool:
            return True

        def is_built(self) -> bool:
            return True

    return _Hooks()


_libs: list[Any] = []


def register() -> None:
    """Make the ``spyre`` device (idempotent): rename PrivateUse1, install ``torch.spyre``, the
    kernels and the fallback. Imports neither jax nor spyre_jax."""
    global _registered
    with _lock:
        if _registered:
            return
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            raise RuntimeError(
                f"spyre: PrivateUse1 is already the {current!r} backend; cannot register spyre"
            )
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(
            NAME if current != NAME else None, backend_module=_make_module(), hook=_make_hooks()
        )
        from . import eager

        lib = torch.library.Library("aten", "IMPL")
        _libs.append(lib)
        k = "PrivateUse1"
        lib.impl("empty.memory_format", _k_empty, k)
        lib.impl("empty_strided", _k_empty_strided, k)
        lib.impl("set_.source_Storage_storage_offset", _k_set_storage_offset, k)
        lib.impl("set_.source_Storage", _k_set_storage, k)
        lib.impl("set_.source_Tensor", _k_set_tensor, k)
        lib.impl("resize_", _k_resize, k)
        lib.impl("_copy_from", _k_copy_from, k)
        lib.impl("_copy_from_and_resize", _k_copy_from_and_resize, k)
        lib.impl("_local_scalar_dense", _k_local_scalar_dense, k)
        lib.impl("fill_.Scalar", _k_fill_scalar, k)
        lib.impl("fill_.Tensor", _k_fill_tensor, k)
        lib.impl("zero_", _k_zero, k)
        for name in _VIEW_OPS:
            lib.impl(name, _view_kernel(getattr(aten, name).default), k)
        for name in _RNG_OPS:
            base, _, ov = name.partition(".")
            lib.impl(name, _rng_kernel(getattr(getattr(aten, base), ov or "default")), k)
        eager.register_kernels(lib)
        fb = torch.library.Library("_", "IMPL")
        _libs.append(fb)
        fb.fallback(eager.fallback, k)
        _patch_storage()
        _patch_printing()
        _registered = True


def _autoload() -> None:
    """The ``torch.backends`` entry point: called inside ``import torch``; never breaks it."""
    try:
        register()
    except Exception as e:  # pragma: no cover - a broken install must not break import torch
        warnings.warn(f"spyre: could not register the spyre device: {e!r}", stacklevel=2)


# ---------------------------------------------------------------------------------------------
# stats (the eager path's counters live in torch_bridge.eager)


def compile_count() -> int:
    """Card compiles made by eager ops so far (one per op, shapes, dtypes and static args)."""
    from . import eager

    return eager.stats()["compiles"]


def eager_stats() -> dict[str, int]:
    """Eager-op counters: compiles, launches, cache_hits, cpu_fallbacks, host_factories."""
    from . import eager

    return eager.stats()


def fallback_stats() -> dict[str, int]:
    """ATen op -> how many eager calls of it ran on the CPU (no lowering rule)."""
    from . import eager

    return eager.fallback_counts()


def reset_stats() -> None:
    """Zero the eager counters (the compile cache is kept)."""
    from . import eager

    eager.reset_stats()


register()
