"""``torch.cat`` of spyre tensors whose sizes keep changing (a KV cache or an attention mask
that grows by one each decode step), as a data movement on the card: one program per size
bucket, the sizes and offsets its arguments.

A one-op kernel of ``cat`` cannot run on a size bucket (:mod:`torch_bridge.buckets`): padding
an input along the joined dim would move every input after it. Here each input is gathered into
the result's bucket layout at its own sizes (zeros past them, the operand gathers of every
kernel: :func:`torch_bridge.operands.card_operand`) and written at its offset along the dim
(:func:`torch_bridge.relayout.cat_program`). The result keeps the bucket's size, like every
bucketed result (the host crops it when it reads it, the next kernel masks the rest). On the
timeline it is a device-side copy of the result's bytes on the current stream.

Used once ``cat``'s family has been seen at two sizes (before that it compiles at its exact
sizes, like any op), for inputs that are all spyre tensors of one dtype, none empty.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch

from device_model.launching import launch
from device_model.layout import TensorLayout, layout_for
from device_model.runtime import Executable, Runtime, check_reads, runtime
from lowering.from_fx import card_dtype

from . import buckets
from . import operands as ops
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
    nothing varied yet, mixed dtypes or devices, an empty input). It runs once per decode step
    for each growing cache, so it keeps to plain loops (no pytree, no NumPy on sizes)."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, list | tuple) or len(tensors) < 2 or type(dim) is not int:
        return None
    first = tensors[0]
    if not st.is_spyre(first):
        return None
    dtype, rank = first.dtype, first.dim()
    if rank == 0 or not -rank <= dim < rank:
        return None
    dim %= rank
    sizes: list[list[int]] = []
    for t in tensors:
        if not st.is_spyre(t) or t.dtype != dtype or t.dim() != rank or not t.numel():
            return None
        sizes.append(list(t.shape))
    rest = sizes[0][:dim] + sizes[0][dim + 1 :]
    offsets, total = [], 0
    for s in sizes:
        if s[:dim] + s[dim + 1 :] != rest:
            return None  # torch's own error, on the ordinary path
        offsets.append(total)
        total += s[dim]
    dyn = buckets.varied((_FAMILY, len(tensors), dim, rank, dtype), sizes)
    if dyn is None:
        return None
    vary = set().union(*dyn)
    shape = (*rest[:dim], total, *rest[dim:])
    bshape = tuple(buckets.bucket(n) if d in vary else n for d, n in enumerate(shape))
    rt = runtime()
    layout = _layout(bshape, dtype, rt.card.stick_bytes)
    sources = [st.region(t).buf for t in tensors]
    check_reads("cat", sources)  # refused (RaceError) before anything changes
    operands, geometries = [], []
    try:
        for t in tensors:
            b, g = ops.card_operand(t, layout, 0)
            operands.append(b)
            geometries.append(g)
        exe = _movement(tuple(geometries), layout, dim, rt)
        nbytes = math.prod(shape) * first.element_size()
        # a device-side copy of the result's bytes (one read and one write of each)
        seconds = 2 * nbytes / rt.copy_bw
        offs = np.array(offsets, np.int32)
        (buf,) = launch(exe, operands, defer=True, params=(offs,), seconds=seconds)
    finally:
        for b in operands:
            b.delete()
    with _lock:
        _counts["card_cats"] += 1
    return st.from_card(buf, dtype, None, shape)


def without_skipped(args: tuple, kwargs: dict) -> tuple | None:
    """``cat``'s arguments less the inputs torch skips: 1-D tensors of no elements (an empty
    cache that a first ``cat`` fills), where every input is a spyre tensor of one dtype (an
    empty input still takes part in the result's dtype); None when there are none of them, or
    nothing else. Without this the call would have no elements to compute on the card and would
    run on the host (``generate()``'s first ``cat`` of each layer's keys and values: the one
    input left, a whole pending result, moves on the card instead, no kernel compiled for the
    prompt's length)."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, list | tuple) or type(dim) is not int:
        return None
    if not all(st.is_spyre(t) for t in tensors) or len({t.dtype for t in tensors}) != 1:
        return None
    rest = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]
    if len(rest) == len(tensors) or not rest:
        return None
    return rest, dim


def _movement(
    geometries: tuple[tuple | None, ...], layout: TensorLayout, dim: int, rt: Runtime
) -> Executable:
    """The cat program of these operand geometries (:func:`torch_bridge.relayout.cat_program`)
    loaded as a data movement on ``rt``, kept per geometry."""
    key = (geometries, layout, dim, rt)
    exe = _movements.get(key)
    if exe is None:
        program = ops.relayout_module().cat_program(geometries, layout, dim)
        n = len(geometries)
        exe = Executable.for_program(f"cat x{n}", program, (layout,) * n, (layout,), rt)
        if len(_movements) >= 1024:
            _movements.clear()
        _movements[key] = exe
    return exe


_movements: dict[tuple, Executable] = {}


#: the family of every cat call in :mod:`torch_bridge.buckets` (with its count, dim, rank, dtype)
_FAMILY = "aten::cat"


@functools.lru_cache(maxsize=1024)
def _layout(shape: tuple[int, ...], dtype: torch.dtype, stick_bytes: int) -> TensorLayout:
    return layout_for(shape, card_dtype(dtype, "an input"), stick_bytes)
