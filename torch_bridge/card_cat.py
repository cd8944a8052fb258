"""``torch.cat`` of spyre tensors whose sizes keep changing (a KV cache or an attention mask
that grows by one each decode step), as a data movement on the card: one program per size
bucket, the sizes and offsets its arguments.

A one-op kernel of ``cat`` cannot run on a size bucket (:mod:`torch_bridge.buckets`): padding
an input along the joined dim would move every input after it. Here each input is gathered into
the result's bucket layout at its own sizes (zeros past them, the operand gathers of every
kernel: :func:`torch_bridge.storage.card_operand`) and written at its offset along the dim
(:func:`torch_bridge.relayout.cat_program`). The result keeps the bucket's size, like every
bucketed result (the host crops it when it reads it, the next kernel masks the rest). On the
timeline it is a device-side copy of the result's bytes on the current stream.

Used once ``cat``'s family has been seen at two sizes (before that it compiles at its exact
sizes, like any op), for inputs that are all spyre tensors of one dtype, none empty.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from device_model.layout import layout_for
from device_model.runtime import DeviceBuffer, check_reads, device_copy, runtime
from lowering.from_fx import card_dtype

from . import buckets
from . import storage as st

__all__ = ["try_card_cat", "stats", "reset_stats"]

aten = torch.ops.aten
_lock = threading.Lock()
_counts = {"card_cats": 0}


def stats() -> dict[str, int]:
    """How many ``cat`` calls ran as a bucket's data movement (``card_cats``)."""
    with _lock:
        return dict(_counts)


def reset_stats() -> None:
    with _lock:
        _counts["card_cats"] = 0


def try_card_cat(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``aten.cat(tensors, dim)`` on the card at its size bucket, or None (the ordinary path:
    nothing varied yet, mixed dtypes or devices, an empty input)."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, list | tuple) or len(tensors) < 2 or not isinstance(dim, int):
        return None
    first = tensors[0]
    if not all(
        st.is_spyre(t) and t.dtype == first.dtype and t.dim() == first.dim() and t.numel()
        for t in tensors
    ):
        return None
    rank = first.dim()
    if rank == 0 or not -rank <= dim < rank:
        return None
    dim %= rank
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    if any(
        tuple(t.shape[:dim]) + tuple(t.shape[dim + 1 :]) != tuple(shape[:dim] + shape[dim + 1 :])
        for t in tensors
    ):
        return None  # torch's own error, on the ordinary path
    leaves, spec = tree_flatten((tuple(args), kwargs))
    dyn = buckets.dynamic_dims(aten.cat.default, spec, leaves)
    if dyn is None:
        return None
    varied = set().union(*dyn)
    bshape = tuple(buckets.bucket(n) if d in varied else n for d, n in enumerate(shape))
    rt = runtime()
    layout = layout_for(bshape, card_dtype(first.dtype, "an input"), rt.card.stick_bytes)
    sources = [st.region(t).buf for t in tensors]
    check_reads("cat", sources)  # refused (RaceError) before anything changes
    operands, geometries = [], []
    try:
        for t in tensors:
            b, g = st.card_operand(t, layout, 0)
            operands.append(b)
            geometries.append(g)
        offsets = np.cumsum([0] + [t.shape[dim] for t in tensors[:-1]]).astype(np.int32)
        program = st._relayout().cat_program(tuple(geometries), layout, dim)
        out = program(*[b.payload() for b in operands], offsets)
        if any(b.shares_host for b in operands):  # the host may write those bytes next
            out.block_until_ready()
        buf = DeviceBuffer.allocate(layout.nbytes, layout, rt=rt, tag="torch-cat", payload=out)
    finally:
        for b in operands:
            b.delete()
    nbytes = int(np.prod(shape)) * first.element_size()
    device_copy(f"cat {st.describe(first)} x{len(tensors)}", sources, [buf], nbytes)
    with _lock:
        _counts["card_cats"] += 1
    return st.from_card(buf, first.dtype, None, tuple(shape))
