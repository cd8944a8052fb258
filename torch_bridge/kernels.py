"""Graph IR to a kernel loaded on the current card, and launches with torch tensors.

The one path the eager device and the ``torch.compile`` backend share: ``lowering.pipeline``
schedules the graph, ``device_model.runtime`` loads and launches it. Spyre tensors go in as the
card buffers they are (no host round trip, :func:`~torch_bridge.operands.as_card_buffer`), CPU
tensors are copied in; results on spyre come back as spyre tensors.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from device_model.hostprog import LoadedProgram
from device_model.launching import launch
from device_model.layout import TensorLayout
from device_model.runtime import DeviceBuffer, Executable, copy_in, copy_out, runtime
from lowering import hoist, loading
from lowering.graph import Graph

from .operands import as_card_buffer
from .storage import NAME, from_card_buffer, from_host, is_spyre, to_host

__all__ = ["load", "run_graph", "resident_parameter", "resident_stats", "WeightLayouts"]


def load(graph: Graph) -> Executable:
    """Schedule ``graph`` for the current card and load it (its constants copied in), with the
    one fit check (``lowering.loading.check_fits``): DeviceOOMError before scheduling, and
    before anything is copied, when one of its tensors, or its weights and inputs together,
    cannot fit the card's device memory."""
    return loading.load(graph, together="its weights and inputs")


class _Resident:
    """A CPU parameter's copy in device memory, valid while the parameter is the same tensor
    (its id, data pointer and version counter unchanged) on the same card."""

    __slots__ = ("ref", "ptr", "version", "buf")

    def __init__(self, ref: weakref.ref, ptr: int, version: int, buf: DeviceBuffer):
        self.ref, self.ptr, self.version, self.buf = ref, ptr, version, buf


#: (id(parameter), layout) -> its resident copy; an entry goes with its parameter
_resident: dict[tuple[int, TensorLayout], _Resident] = {}
_resident_lock = threading.Lock()


def resident_stats() -> dict[str, int]:
    """How many CPU parameters are resident on the current card and their bytes there, the
    weights laid out once by :class:`WeightLayouts` included (copies on an earlier card, before
    ``set_card``, are not counted)."""
    rt = runtime()
    with _resident_lock:
        live = [e.buf for e in _resident.values() if e.buf.alive and e.buf.rt is rt]
        live += [b for w in list(_laid_out) for b in w.bufs if b.alive and b.rt is rt]
    return {"parameters": len(live), "bytes": sum(b.nbytes for b in live)}


def _forget(key: tuple[int, TensorLayout]) -> None:
    with _resident_lock:
        e = _resident.pop(key, None)
    if e is not None:
        e.buf.delete()


def resident_parameter(p: torch.Tensor, layout: TensorLayout) -> DeviceBuffer:
    """The device-memory copy of CPU parameter ``p`` in ``layout``, copied in once.

    A model's weights are copied in on its first call and live once in device memory, shared
    by every kernel that reads them: each later launch finds them there (no copy per kernel or
    per call). An in-place change of ``p`` (its version counter moves) or a new card copies it in
    again; the copy is freed when ``p`` goes. Where the bytes are already in the card's layout
    the simulation keeps ``p``'s own memory as the payload (``copy_in(alias=True)``): the
    weights are not held twice on the host either.
    """
    rt = runtime()
    key = (id(p), layout)
    with _resident_lock:
        e = _resident.get(key)
    if (
        e is not None
        and e.ref() is p
        and e.version == _version(p)
        and e.ptr == p.data_ptr()
        and e.buf.rt is rt
        and e.buf.alive
    ):
        return e.buf
    buf = copy_in(to_host(p), layout, rt=rt, tag="parameter", alias=True)
    ref = weakref.ref(p, lambda _r, key=key: _forget(key))
    with _resident_lock:
        old = _resident.get(key)
        _resident[key] = _Resident(ref, p.data_ptr(), _version(p), buf)
    if old is not None and old.buf is not buf:
        old.buf.delete()
    return buf


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter; 0 for an inference tensor, which keeps none (it cannot change
    outside ``torch.inference_mode``)."""
    return 0 if t.is_inference() else t._version


def _identity(w: torch.Tensor) -> tuple:
    """What says a weight (the same tensor: :class:`WeightLayouts` holds a weak reference) is as
    it was laid out: its storage (``p.data = t`` keeps the tensor and its version counter),
    where it sits in it, and its version counter (an in-place change; an inference tensor has
    none). A write through ``p.data`` moves a counter of its own: after ``p.data.mul_(...)``
    call ``torch._dynamo.reset()``."""
    return (
        w.untyped_storage().data_ptr(),
        w.storage_offset(),
        tuple(w.shape),
        w.stride(),
        _version(w),
    )


#: every WeightLayouts holding laid-out weights (for resident_stats), weakly
_laid_out: weakref.WeakSet = weakref.WeakSet()


class WeightLayouts:
    """The prelude of a graph split by ``lowering.hoist.split_weight_layouts``: its kernel and
    the laid-out weights it made, kept in device memory while the weights it read are the same
    tensors (identity and version counter) on the same card, and made again otherwise.

    Weights on the spyre device are re-laid out by its kernel, on the card (``card_runs``
    counts those runs); CPU weights by NumPy as they are copied in, where that gives the same
    bytes (:func:`lowering.hoist.host_computable`), as a compiler packs constant weights. Either
    way only the laid-out copies stay in device memory."""

    def __init__(self, graph: Graph, args: Sequence[int]):
        self.graph = graph
        self.args = tuple(args)
        self.executable = load(graph)
        #: CPU weights are re-laid out on the host where NumPy gives the card's bytes (data
        #: movement and float converts, and a card that does not round stores to DL16)
        self.host_computable = hoist.host_computable(graph)
        self.card_runs = 0
        self.key: tuple = ()
        self.bufs: tuple[DeviceBuffer, ...] = ()
        self.refs: tuple[weakref.ref, ...] = ()
        self.runs = 0
        with _resident_lock:
            _laid_out.add(self)

    def buffers(self, args: Sequence[Any]) -> tuple[DeviceBuffer, ...]:
        """The laid-out weights for ``args`` (the whole graph's arguments)."""
        ws = [args[i] for i in self.args]
        rt = runtime()
        key = (rt, *(_identity(w) for w in ws))
        if (
            key == self.key
            and all(r() is w for r, w in zip(self.refs, ws, strict=True))
            and all(b.alive for b in self.bufs)
        ):
            return self.bufs
        if self.executable.rt is not rt:  # set_card since
            self.executable = load(self.graph)
        on_host = self.host_computable and not rt.card.dl16_rounding
        if on_host and not any(is_spyre(w) for w in ws):
            outs = self._on_host(ws, rt)
        else:
            outs = self._on_card(ws)
        for b in self.bufs:
            b.delete()
        self.bufs, self.key, self.runs = outs, key, self.runs + 1
        me = weakref.ref(self)

        def gone(_r: weakref.ref, me: weakref.ref = me) -> None:
            s = me()
            if s is not None:
                s.release()

        self.refs = tuple(weakref.ref(w, gone) for w in ws)
        return outs

    def release(self) -> None:
        """Free the laid-out copies: a weight they were made from is gone (the compiled graph
        may outlive its model in torch's caches; a later call lays its weights out again)."""
        bufs, self.bufs, self.key = self.bufs, (), ()
        for b in bufs:
            b.delete()

    def _on_host(self, ws: Sequence[Any], rt: Any) -> tuple[DeviceBuffer, ...]:
        """CPU weights: re-laid out by NumPy as they are copied in (no card time, and no padded
        copy of them in device memory on the way)."""
        laid = hoist.run_on_host(self.graph, [to_host(w) for w in ws])
        return tuple(
            copy_in(a, lay, rt=rt, tag="parameter", alias=True)
            for a, lay in zip(laid, self.executable.out_layouts, strict=True)
        )

    def _on_card(self, ws: Sequence[Any]) -> tuple[DeviceBuffer, ...]:
        self.card_runs += 1
        temps: list[DeviceBuffer] = []
        leaves: list[Any] = []
        try:
            for w in ws:
                if is_spyre(w):
                    temps.append(as_card_buffer(w))
                    leaves.append(temps[-1])
                else:
                    leaves.append(to_host(w))
            return tuple(launch(self.executable, leaves))
        finally:
            for b in temps:
                b.delete()


def run_graph(exe: Executable, args: Sequence[Any], out_meta: Sequence[Any]) -> tuple:
    """Launch ``exe`` with torch tensors (spyre or CPU) and numbers; each result as a spyre
    tensor where its ``out_meta`` is on spyre, else as a CPU tensor. CPU parameters
    (``torch.nn.Parameter``) stay resident on the card between calls
    (:func:`resident_parameter`); other CPU tensors are copied in for the launch."""
    temps: list[DeviceBuffer] = []
    leaves: list[Any] = []
    try:
        for i, a in enumerate(args):
            if type(a) is DeviceBuffer:  # a laid-out weight (WeightLayouts), used in place
                leaves.append(a)
            elif is_spyre(a):
                b = as_card_buffer(a)
                temps.append(b)
                leaves.append(b)
            elif isinstance(a, torch.nn.Parameter) and a.device.type == "cpu":
                leaves.append(resident_parameter(a, exe.in_layouts[i]))
            else:
                leaves.append(to_host(a))
        outs = exe.run(leaves) if type(exe) is LoadedProgram else launch(exe, leaves)
    finally:
        for b in temps:
            b.delete()
    return tuple(
        from_card_buffer(b, m) if _on_spyre(m) else from_host(copy_out(b), m)
        for b, m in zip(outs, out_meta, strict=True)
    )


def _on_spyre(meta: Any) -> bool:
    d = getattr(meta, "device", None)
    return isinstance(d, torch.device) and d.type == NAME
