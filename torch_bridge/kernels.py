"""Graph IR to a kernel loaded on the current card, and launches with torch tensors.

The one path the eager device and the ``torch.compile`` backend share: ``lowering.pipeline``
schedules the graph, ``device_model.runtime`` loads and launches it. Spyre tensors go in as the
card buffers they are (no host round trip, :func:`~torch_bridge.storage.as_card_buffer`), CPU
tensors are copied in; results on spyre come back as spyre tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from device_model.runtime import DeviceBuffer, Executable, check_fits, copy_out, launch, runtime
from lowering.graph import Graph
from lowering.pipeline import compile_graph

from .storage import NAME, as_card_buffer, from_card_buffer, from_host, is_spyre, to_host

__all__ = ["load", "run_graph"]


def load(graph: Graph) -> Executable:
    """Schedule ``graph`` for the current card and load it (its constants copied in).
    DeviceOOMError before scheduling when one of its tensors cannot fit device memory."""
    rt = runtime()
    values = [*graph.inputs, *(o for n in graph.nodes for o in n.outputs)]
    check_fits(((v.shape, v.dtype) for v in values), rt)
    return Executable(compile_graph(graph, rt.card), rt)


def run_graph(exe: Executable, args: Sequence[Any], out_meta: Sequence[Any]) -> tuple:
    """Launch ``exe`` with torch tensors (spyre or CPU) and numbers; each result as a spyre
    tensor where its ``out_meta`` is on spyre, else as a CPU tensor."""
    temps: list[DeviceBuffer] = []
    leaves: list[Any] = []
    try:
        for a in args:
            if is_spyre(a):
                b = as_card_buffer(a)
                temps.append(b)
                leaves.append(b)
            else:
                leaves.append(to_host(a))
        outs = launch(exe, leaves)
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
