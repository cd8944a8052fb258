"""The ``spyre`` device: PyTorch's PrivateUse1 backend, registered as ``spyre``.

PrivateUse1 is renamed ``spyre`` in Python (``torch.utils.backend_registration.
_setup_privateuseone_for_python_backend``); ``torch.spyre`` is the backend module. Loaded by the
``torch.backends`` entry point (:func:`_autoload`), so ``import torch`` alone makes the device
exist; importing this module does the same when autoloading is off
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). Registration does not import JAX (the card program is
built by the first launch).

The PyTorch side is stacked one way: :mod:`torch_bridge.storage` (tensors' storage in the card's
device memory, copies) <- :mod:`torch_bridge.eager` (compute ops as cached one-op kernels) <-
this module (the kernels for storage plumbing and data movement, the registration, the counters);
:mod:`torch_bridge.backend` (``torch.compile``) stands on storage beside eager.

**Kernels.** Storage plumbing (empty, set_, resize_, views) is registered per op; host<->device
copies and pure data movement (``copy_``, ``fill_``, ``zero_``, ``.item()``) work on
the payload directly and are steps on the current stream's timeline (copy in, copy out, or a
device-side copy). Random ops draw on the card from its own generator (:mod:`torch_bridge.rng`).
Compute ops go through :mod:`torch_bridge.eager`; ops with no lowering rule
run on the CPU with a ``SpyreFallbackWarning`` (counted, :func:`fallback_stats`). No op ends in
PyTorch's dispatcher ``NotImplementedError``: the ``*_overrideable`` hooks whose composite
kernels raise for every backend (convolution, fused attention) have kernels of their own
(:mod:`torch_bridge.overrideable`), the CUDA-only RNN cells PyTorch picks off the CPU have CPU
stand-ins (:mod:`torch_bridge.host_kernels`), ``_to_copy`` never pins a host result (a Python
backend has no pinned-memory allocator) and ``record_stream`` has nothing to do.
"""

from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch._tensor_str as tensor_str
import torch.storage as torch_storage
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from device_model import runtime as card_runtime

from . import attention, batch_norm, eager, overrideable, rng
from .errors import UnsupportedLayoutError
from .host_ops import write_out
from .storage import (
    CPU_KEYS,
    NAME,
    alias,
    contig_strides,
    copy_on_card,
    device_step,
    host_reads,
    host_writes,
    is_spyre,
    new_storage,
    new_tensor,
    region,
    set_storage,
    storage_nbytes,
    wait_all,
)
from .storage import device as spyre_device
from .view_writes import fill_on_card, write_on_card

__all__ = [
    "NAME",
    "register",
    "is_spyre",
    "compile_count",
    "eager_stats",
    "fallback_stats",
    "reset_stats",
]

_lock = threading.RLock()
_registered = False
aten = torch.ops.aten


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
        return new_tensor(size, dtype, cpu.stride())
    return new_tensor(size, dtype)


def _k_empty_strided(
    size: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype | None = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
) -> torch.Tensor:
    return new_tensor(size, dtype, stride)


def _k_set_storage_offset(
    self: torch.Tensor,
    source: torch.UntypedStorage,
    storage_offset: int,
    size: Sequence[int],
    stride: Sequence[int] = (),
) -> torch.Tensor:
    return set_storage(self, source, storage_offset, size, stride or contig_strides(size))


def _k_set_storage(self: torch.Tensor, source: torch.UntypedStorage) -> torch.Tensor:
    return set_storage(self, source, 0, (source.nbytes() // self.element_size(),), (1,))


def _k_set_tensor(self: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return set_storage(
        self, source.untyped_storage(), source.storage_offset(), source.shape, source.stride()
    )


def _k_resize(self: torch.Tensor, size: Sequence[int], memory_format: Any = None) -> torch.Tensor:
    size = tuple(int(s) for s in size)
    if tuple(self.shape) == size and self.is_contiguous():
        return self
    stride = contig_strides(size)
    need = storage_nbytes(size, stride, self.element_size(), self.storage_offset())
    old = self.untyped_storage()
    if need > old.nbytes():
        st = new_storage(need)
        src = region(old)
        region(st).payload[: old.nbytes()] = src.payload[: old.nbytes()]
        old = st
    return set_storage(self, old, self.storage_offset(), size, stride)


def _k_copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(self)`` where either is on spyre: host<->device copies and device copies,
    with torch's broadcasting and dtype conversion."""
    if is_spyre(dst) and is_spyre(self):
        if not copy_on_card(dst, self) and not write_on_card(dst, self):
            alias(dst).copy_(alias(self))
            device_step("copy", dst, [self])
    elif is_spyre(dst):
        if self.device.type != "cpu":
            self = self.cpu()
        alias(dst).copy_(self)
        host_writes(dst)
    else:
        host_reads(self)
        dst.copy_(alias(self))
    return dst


def _k_copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if tuple(dst.shape) != tuple(self.shape):
        dst.resize_(self.shape)
    return _k_copy_from(self, dst)


def _k_local_scalar_dense(self: torch.Tensor) -> Any:
    host_reads(self)
    return alias(self).item()


def _k_fill_scalar(self: torch.Tensor, value: Any) -> torch.Tensor:
    if fill_on_card(self, value):
        return self
    alias(self).fill_(value)
    device_step("fill", self)
    return self


def _k_fill_tensor(self: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if value.dim() != 0:
        raise RuntimeError(
            "fill_ only supports 0-dimension value tensor but got tensor with "
            f"{value.dim()} dimensions."
        )
    return _k_fill_scalar(self, value.item())


def _k_zero(self: torch.Tensor) -> torch.Tensor:
    alias(self).zero_()
    device_step("zero", self)
    return self


_TO_COPY = aten._to_copy.default
_COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd


def _k_to_copy(
    self: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: bool | None = None,
    non_blocking: bool = False,
    memory_format: Any = None,
) -> torch.Tensor:
    """``_to_copy`` (``.to``, ``.cpu()``, ``.half()``) of a spyre tensor: PyTorch's composite
    kernel, except that a copy to the host never lands in pinned memory. For a PrivateUse1
    source and ``non_blocking=True`` that kernel allocates its CPU result pinned, which needs a
    pinned-memory allocator from the backend's C++ hooks (a Python backend has none:
    ``NotImplementedError``). Copies out of the card wait for it anyway (``_copy_from``), so
    pinned memory would buy nothing here."""
    if device is not None and torch.device(device).type == "cpu":
        non_blocking, pin_memory = False, None
    return _TO_COPY._op_dk(
        _COMPOSITE,
        self,
        dtype=dtype,
        layout=layout,
        device=device,
        pin_memory=pin_memory,
        non_blocking=non_blocking,
        memory_format=memory_format,
    )


def _k_record_stream(self: torch.Tensor, stream: Any) -> None:
    """``Tensor.record_stream``: nothing to do. It keeps a caching allocator from handing the
    tensor's memory out again while another stream may still use it; here a launch or copy in
    flight holds its own reference to the bytes it reads, and a freed region is forgotten by
    the stream queues (``device_model.runtime``), so reusing its address is safe at once."""
    del self, stream


def _k_arange_out(start: Any, end: Any, step: Any = 1, *, out: torch.Tensor) -> torch.Tensor:
    # a factory (``arange(n, device="spyre")`` comes here with an empty ``out``): made on the
    # host and copied in, as every factory; directly, not through the fallback's generic walk
    res = write_out(out, torch.arange(start, end, step, dtype=out.dtype))
    eager.count("host_factories")
    return res


_VIEW_OPS = ("view", "as_strided", "_reshape_alias", "unfold", "view_as_real", "view_as_complex")


def _view_kernel(op: Any) -> Any:
    redispatch = op._handle.redispatch_boxed  # (OpOverload.redispatch, less a Python frame)

    def k(*args: Any, **kwargs: Any) -> torch.Tensor:
        return redispatch(CPU_KEYS, *args, **kwargs)

    return k


# ---------------------------------------------------------------------------------------------
# pitfalls patched at the Python level


def _patch_storage() -> None:
    """``torch.UntypedStorage(n, device="spyre")`` would crash (no C++ allocator for
    PrivateUse1, and none can be registered from Python): the Python paths that construct one
    make our storages instead."""
    ts = torch_storage
    orig_new = torch.UntypedStorage.__new__

    def new(cls: type, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is not None and torch.device(device).type == NAME:
            if kwargs or len(args) > 1 or (args and not isinstance(args[0], int)):
                raise RuntimeError(
                    "spyre: UntypedStorage(..., device='spyre') takes only a size; "
                    "make a tensor and use its untyped_storage()"
                )
            return new_storage(int(args[0]) if args else 0)
        if device is None:
            return orig_new(cls, *args, **kwargs)
        return orig_new(cls, *args, device=device, **kwargs)

    torch.UntypedStorage.__new__ = new  # type: ignore[method-assign]

    orig_clone = ts._StorageBase.clone

    def clone(self: Any) -> Any:
        if self.device.type == NAME:
            st = new_storage(self.nbytes())
            region(st).payload[:] = region(self).payload[: self.nbytes()]
            return st
        return orig_clone(self)

    ts._StorageBase.clone = clone  # type: ignore[method-assign]

    orig_to = ts._to

    def to(self: Any, device: Any, non_blocking: bool = False) -> Any:
        device = torch.device(device)
        if device.type == NAME and self.device.type != NAME:
            src = self.untyped() if hasattr(self, "untyped") else self
            st = new_storage(src.nbytes())
            host = torch.empty(0, dtype=torch.uint8).set_(src.cpu())
            region(st).payload[:] = host.numpy()
            return st
        return orig_to(self, device, non_blocking)

    ts._to = to
    ts._StorageBase.spyre = (  # type: ignore[attr-defined]
        lambda self, device=None, non_blocking=False: to(self, spyre_device(), non_blocking)
    )


def _patch_printing() -> None:
    """Printing formats the values on the CPU (one copy out), as torch does for XLA tensors,
    instead of running the formatter's dozen ops on the card; the device suffix stays."""
    tstr = tensor_str
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
    """Wait (in simulated time too) for all work on the card: ``spyre_jax.synchronize()``, and
    for the simulation's launches still in flight."""
    card_runtime.synchronize()
    wait_all()


def _memory_stats(device: Any = None) -> dict[str, int]:
    return card_runtime.runtime().memory.stats()


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
    mod.manual_seed = rng.manual_seed  # the card's generator (torch_bridge.rng)
    mod.manual_seed_all = rng.manual_seed
    mod.seed = mod.seed_all = rng.seed
    mod.initial_seed = rng.initial_seed
    mod.get_rng_state = rng.get_rng_state
    mod.set_rng_state = rng.set_rng_state
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


def _refuse_sparse(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Every op on a sparse tensor on spyre (``x.to_sparse_csr().to("spyre")`` makes one: its
    index and value tensors are dense): a TypeError naming the op, as for a dtype the card does
    not have, instead of the dispatcher's NotImplementedError."""
    raise UnsupportedLayoutError(
        f"spyre: {op} on a sparse tensor; the spyre device holds strided (dense) tensors only: "
        f"keep sparse tensors on the CPU, or call .to_dense() first"
    )


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
        _setup_privateuseone_for_python_backend(
            NAME if current != NAME else None, backend_module=_make_module(), hook=_make_hooks()
        )
        lib = torch.library.Library("aten", "IMPL")
        _libs.append(lib)
        k = "PrivateUse1"
        for name, kernel in {
            "empty.memory_format": _k_empty,
            "empty_strided": _k_empty_strided,
            "set_.source_Storage_storage_offset": _k_set_storage_offset,
            "set_.source_Storage": _k_set_storage,
            "set_.source_Tensor": _k_set_tensor,
            "resize_": _k_resize,
            "_copy_from": _k_copy_from,
            "_copy_from_and_resize": _k_copy_from_and_resize,
            "_local_scalar_dense": _k_local_scalar_dense,
            "fill_.Scalar": _k_fill_scalar,
            "fill_.Tensor": _k_fill_tensor,
            "zero_": _k_zero,
            "arange.start_out": _k_arange_out,
            "_to_copy": _k_to_copy,
            "record_stream": _k_record_stream,
        }.items():
            lib.impl(name, kernel, k)
        for name in _VIEW_OPS:
            lib.impl(name, _view_kernel(getattr(aten, name).default), k)
        rng.register(lib)
        eager.register_kernels(lib)
        attention.register(lib)
        batch_norm.register(lib)
        overrideable.register(lib)
        fb = torch.library.Library("_", "IMPL")
        _libs.append(fb)
        fb.fallback(eager.fallback, k)
        for key in ("SparsePrivateUse1", "SparseCsrPrivateUse1"):
            fb.fallback(_refuse_sparse, key)  # not PyTorch's NotImplementedError
        _patch_storage()
        _patch_printing()
        _route_inductor()
        _registered = True


def _on_spyre(inputs: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == NAME for t in inputs)


def _route_inductor() -> None:
    """``torch.compile(fn)`` with no ``backend=`` (Inductor, the default) on spyre tensors
    compiles through our backend: Inductor has no code generator for the card, so the graph
    Dynamo hands it is given to ``torch_bridge.backend.spyre_backend`` instead when any of its
    inputs (parameters included) is on spyre. Graphs of CPU or CUDA tensors still go to
    Inductor. Inductor's ``mode`` and ``options`` do not apply to the card."""
    cls = torch._TorchCompileInductorWrapper
    inner = cls.__call__
    if getattr(inner, "_spyre_routed", False):
        return

    def __call__(self: Any, model_: Any, inputs_: Any, **kwargs: Any) -> Any:
        if _on_spyre(inputs_):
            from .backend import spyre_backend

            return spyre_backend(model_, inputs_)
        return inner(self, model_, inputs_, **kwargs)

    __call__._spyre_routed = True  # type: ignore[attr-defined]
    cls.__call__ = __call__


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
    return eager.stats()["compiles"]


def eager_stats() -> dict[str, int]:
    """Eager-op counters: compiles, launches, cache_hits, cpu_fallbacks, host_factories."""
    return eager.stats()


def fallback_stats() -> dict[str, int]:
    """ATen op -> how many eager calls of it ran on the CPU (no lowering rule)."""
    return eager.fallback_counts()


def reset_stats() -> None:
    """Zero the eager counters (the compile cache is kept)."""
    eager.reset_stats()


register()
