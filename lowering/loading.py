"""Graphs loaded on a card: the one fit check, loading, and the cache of one-op kernels.

Both frontends load what they compile through here:

* :func:`check_fits`: DeviceOOMError before anything is scheduled or copied in, when one tensor
  of a graph, or the tensors that must be in device memory at once (its inputs and constants),
  cannot fit the card's device memory.
* :func:`load`: check, schedule (``lowering.pipeline.compile_graph``) and load the kernel
  (``device_model.runtime.Executable``: its constants copied in).
* :class:`OpKernels` (the instance :data:`OP_KERNELS`): the kernels of single ops, compiled
  once per :class:`OpKey` (the op's name, its arguments' shapes, dtypes and static values, the
  card), for op-by-op work. The key holds plain data only (strings, numbers, tuples, the
  card's runtime), never a frontend's objects: ``torch_bridge.eager`` turns an ATen call into
  one, and ``spyre_jax`` arrays can use the same cache without importing ``torch_bridge``.

The launch itself is ``device_model.launching.launch``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from device_model.hostprog import LoadedProgram
from device_model.layout import layout_for
from device_model.memory import DeviceOOMError
from device_model.runtime import Executable, Runtime, runtime

from .control import has_control, lower_program, unroll_scans
from .graph import Graph
from .pipeline import compile_graph

__all__ = ["check_fits", "load", "OpKey", "OpKernels", "OP_KERNELS"]


def check_fits(
    graph: Graph, rt: Runtime | None = None, *, together: str = "its arguments and constants"
) -> None:
    """DeviceOOMError, before anything is compiled or allocated, when one of ``graph``'s tensors
    cannot fit ``rt``'s device memory at all, or its inputs and constants (what must be in
    device memory at once) exceed it in sum; the error names the graph and ``together``."""
    rt = rt or runtime()
    values = [*graph.inputs, *(o for n in graph.nodes for o in n.outputs)]
    held = [*graph.inputs, *(v for v, _ in graph.consts)]
    what = f"{graph.name}: {together} together"
    st = rt.memory.stats()
    stick = rt.card.stick_bytes
    for v in values:
        _refuse(layout_for(tuple(v.shape), v.dtype, stick).nbytes, st, what)
    _refuse(sum(layout_for(tuple(v.shape), v.dtype, stick).nbytes for v in held), st, what)


def _refuse(need: int, st: dict[str, int], what: str) -> None:
    if need > st["bytes_limit"]:
        raise DeviceOOMError(
            need, st["bytes_in_use"], st["bytes_limit"], st["largest_free_block"], what
        )


def load(
    graph: Graph, rt: Runtime | None = None, *, together: str = "its arguments and constants"
) -> Executable:
    """``graph`` scheduled for ``rt``'s card (the current one by default) and loaded on it:
    :func:`check_fits` first, then ``compile_graph``, then its constants copied in."""
    rt = rt or runtime()
    check_fits(graph, rt, together=together)
    if has_control(graph):  # loops or branches: a host program (lowering.control)
        graph = unroll_scans(graph, rt.card, compile_graph)
        if has_control(graph):
            return LoadedProgram(lower_program(graph, rt.card, compile_graph), rt)  # type: ignore[return-value]
    return Executable(compile_graph(graph, rt.card), rt)


@dataclass(frozen=True, slots=True)
class OpKey:
    """One op at one signature on one card: what a one-op kernel is compiled for.

    ``op``: the op's name (``"aten.add.Tensor"``, ``"add"``); ``structure``: how its arguments
    nest (a frontend's tree of them, as text); ``args``: per argument plain data, e.g.
    ``("T", shape, dtype name)`` for a tensor and the value itself for a static one;
    ``variant``: anything else the kernel depends on (operands it reads transposed); ``card``:
    the runtime it is loaded on."""

    op: str
    structure: str
    args: tuple[Hashable, ...]
    card: Runtime
    variant: tuple[Hashable, ...] = ()


class OpKernels:
    """The one-op kernels compiled so far, by :class:`OpKey` (thread-safe).

    :meth:`get` finds one; :meth:`get_or_load` compiles one on a miss with the frontend's
    ``build`` (its one-op graph) and keeps it. A failed build is not kept (the next call tries
    again and raises again)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._kernels: dict[OpKey, Executable] = {}
        self._counts = {"compiles": 0, "hits": 0}

    def get(self, key: OpKey) -> Executable | None:
        exe = self._kernels.get(key)
        if exe is not None:
            self._counts["hits"] += 1
        return exe

    def get_or_load(self, key: OpKey, build: Callable[[], Graph]) -> Executable:
        """The kernel of ``key``, compiled from ``build()`` (and loaded on ``key.card``) the
        first time."""
        exe = self.get(key)
        if exe is not None:
            return exe
        with self._lock:
            exe = self._kernels.get(key)
            if exe is None:
                exe = load(build(), key.card)
                self._kernels[key] = exe
                self._counts["compiles"] += 1
        return exe

    def put(self, key: OpKey, exe: Executable) -> None:
        """Keep ``exe`` as the kernel of ``key`` (compiled by the caller)."""
        with self._lock:
            self._kernels[key] = exe
            self._counts["compiles"] += 1

    def forget(self, keys: Iterable[OpKey] | None = None) -> None:
        """Drop the given kernels (all of them by default)."""
        with self._lock:
            if keys is None:
                self._kernels.clear()
            else:
                for k in keys:
                    self._kernels.pop(k, None)

    def __len__(self) -> int:
        return len(self._kernels)

    def __contains__(self, key: object) -> bool:
        return key in self._kernels

    def stats(self) -> dict[str, Any]:
        """compiles (kernels built), hits (found built), entries (kept now)."""
        return {**self._counts, "entries": len(self._kernels)}


#: the process's one-op kernels (both frontends' op-by-op paths)
OP_KERNELS = OpKernels()
