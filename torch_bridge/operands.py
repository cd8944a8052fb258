"""Spyre tensors as the card buffers a launch takes: their own bytes where they already are the
tensor in the kernel's layout, else gathered on the card (folded into the kernel that reads
them) or, a geometry's first time, on the host.

The counterpart of :mod:`torch_bridge.storage` (storages over device buffers, launch results
back as spyre tensors); the launch itself is ``device_model.launching.launch``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import ml_dtypes
import numpy as np
import torch

from device_model import runtime as card_runtime
from device_model.layout import TensorLayout, layout_for, np_dtype
from device_model.payload import Deleted
from device_model.runtime import DeviceBuffer
from lowering.from_fx import card_dtype

from .storage import Region, alias, region
from .strides import contig_strides, key_strides

__all__ = ["as_card_buffer", "card_operand", "own_bytes", "relayout_module"]


def as_card_buffer(
    t: torch.Tensor, layout: TensorLayout | None = None, fill: Any = 0
) -> DeviceBuffer:
    """A spyre tensor as a new stick-layout :class:`~device_model.runtime.DeviceBuffer` (the
    dtype as the card has it: int64 narrowed to int32, bf16 via ml_dtypes), the argument a
    launch takes. When the tensor's bytes already are that layout (contiguous, rows of whole
    sticks, the card's dtype) it is a view of them (:func:`_card_view`: no copy, nothing
    allocated, the same view each launch until they are written); otherwise a new buffer, and
    for a strided view a device-side re-layout (a gather), recorded on the current stream.
    The caller deletes the buffer when done (a view frees nothing). A ``layout`` larger than
    ``t`` (a size bucket, :mod:`torch_bridge.buckets`) pads it with ``fill``.
    """
    r = region(t)
    if layout is None:
        dt = card_dtype(t.dtype, "a spyre tensor")
        layout = layout_for(tuple(t.shape), dt, r.rt.card.stick_bytes)
    view = None if layout.shape != tuple(t.shape) else _card_view(r, t, layout)
    if view is not None:  # the kernel reads the tensor's own bytes: it must not race their writer
        card_runtime.check_reads("read operand", [r.buf])
        return view
    return _operand(r, t, layout, _gathered(r, t, layout, fill))


def own_bytes(t: torch.Tensor, layout: TensorLayout) -> DeviceBuffer | None:
    """:func:`card_operand`'s first case alone, for a ``t`` of ``layout``'s shape: its own
    bytes as a view in ``layout`` (not race-checked: the launch that takes it checks), or None
    where they are not (the caller goes to :func:`card_operand`)."""
    return _card_view(region(t), t, layout)


def card_operand(
    t: torch.Tensor, layout: TensorLayout, fill: Any = 0
) -> tuple[DeviceBuffer, tuple[Any, ...] | None]:
    """``t`` as a launch argument in ``layout``, its re-layout left to the kernel.

    ``(buffer, None)``: the buffer is ``t`` in ``layout`` (:func:`as_card_buffer`'s view, or
    on a geometry's first use a copy gathered on the host). ``(buffer, geometry)``: the buffer
    holds the *source* of the view (the pending result, or the storage's bytes as a card array)
    and the kernel that reads it gathers ``geometry`` first
    (:func:`torch_bridge.relayout.view_program`'s key), in the same program: one dispatch for the
    re-layout and the kernel. Either way the re-layout is a step on the current stream, and
    the caller deletes the buffer when done. A direct view is not race-checked here: the
    launch that takes it (``device_model.launching.launch``) checks every buffer it reads.
    """
    r = region(t)
    padded = layout.shape != tuple(t.shape)
    if not padded:
        view = _card_view(r, t, layout)
        if view is not None:  # the launch that takes it checks its read of the storage
            return view, None
    key, sizes = _view_key(r, t, layout, fill)
    if t.numel() == 0 or not relayout_module().worth_compiling(("view", *key)):
        return _operand(r, t, layout, _host_gathered(t, layout, fill)), None
    src, shares = _view_array(r, key[0])
    if key[0][0] in _SAME_BYTES:  # the kernel reads the result's own bytes: no re-layout step
        return DeviceBuffer.view(r.buf, layout, (src, sizes), shared=False), key
    buf = _operand(r, t, layout, None)  # the gathered operand's place in device memory
    # where the kernel reads the storage's host bytes, their writer waits for it (r's readers)
    view = DeviceBuffer.view(buf, layout, (src, sizes), shared=shares, owns=True, readers_of=r.buf)
    return view, key


#: view sources whose gather leaves the bytes where they are on the card (padding masked, or
#: leading dims regrouped over the same sticks): the kernel reads the result's own region
_SAME_BYTES = frozenset({"masked", "reshape"})
#: view sources that are the storage's bytes (not a pending result)
_BYTES = frozenset({"bytes", "flat"})


def _view_key(
    r: Region, t: torch.Tensor, layout: TensorLayout, fill: Any
) -> tuple[tuple[Any, ...], np.ndarray]:
    """The :func:`torch_bridge.relayout.view_program` key of ``t`` gathered into ``layout``
    (it holds no size of ``t``) and the sizes its program runs with."""
    source, dyn = _view_source(r, t, layout)
    return (source, layout, fill), np.array(dyn, np.int32)


def _view_source(
    r: Region, t: torch.Tensor, layout: TensorLayout
) -> tuple[tuple[Any, ...], list[int]]:
    """What a view ``t`` is gathered from on the card, without the host waiting, and the
    sizes its program takes (see :func:`torch_bridge.relayout.view_program`): the pending
    result when it holds ``t``'s dtype (``masked`` when ``t`` is all of it and it is in
    ``layout`` already, ``reshape`` when only its leading dims are regrouped, ``box`` when
    ``t`` is a box of it), else the storage's bytes padded to a power of two (a size bucket of
    bytes, at least the target layout's elements; ``flat`` when ``t`` is a contiguous run of
    them)."""
    pend = r.pending
    shape, off = tuple(t.shape), t.storage_offset()
    if pend is not None and pend.dtype == t.dtype:
        lay, stride, dims = pend.layout, pend.stride, pend.shape
        whole = stride is None and off == 0 and t.is_contiguous()
        if lay == layout and shape == dims and off == 0 and (whole or _same_strides(t, stride)):
            # the whole result at the bucket the kernel runs at, smaller than it (else it is
            # read as it is, _card_view): only its padding changes
            return ("masked",), list(dims)
        if (
            whole
            and lay.dtype == layout.dtype
            and dims == lay.shape
            and shape == layout.shape
            and lay.shape[-1:] == layout.shape[-1:]
            and lay.device_shape[-1:] == layout.device_shape[-1:]
            and math.prod(lay.device_shape) == math.prod(layout.device_shape)
        ):  # the whole result with its leading dims regrouped: the same sticks on the card
            return ("reshape", lay.device_shape), []
        if stride is None and shape and len(shape) == len(dims) == len(layout.shape):
            cs = contig_strides(dims)
            if all(n == 1 or s == c for n, s, c in zip(shape, t.stride(), cs, strict=True)):
                # a box of the result (a slice along some dims): where it starts, its sizes
                start = [off // c % max(d, 1) for c, d in zip(cs, dims, strict=True)]
                if all(a + n <= d for a, n, d in zip(start, shape, dims, strict=True)):
                    return ("box", lay.device_shape), [*start, *shape]
                # rows that run on into the next ones (an as_strided run): not a box
        if stride is None and dims == lay.shape == lay.device_shape:
            # a whole result with no padding: its elements in torch's order, indexed flat
            return ("flat card", lay.device_shape), [*shape, *key_strides(t), off]
        order = None
        if stride is not None:  # laid out by strides: its dims in the storage's order
            order = tuple(sorted(range(len(stride)), key=lambda k: -stride[k]))
        dyn = [*dims, *shape, *key_strides(t), off]
        return ("card", lay.device_shape, len(lay.shape), order), dyn
    # (at least the target's elements in the source dtype: every size of one bucket gathers
    # by one program)
    n = 1 << (max(r.nbytes, 64, math.prod(layout.shape) * t.element_size()) - 1).bit_length()
    if shape == layout.shape and t.is_contiguous():  # a run of elements: a slice of them
        return ("flat", t.dtype, n), [off]
    return ("bytes", t.dtype, n), [*shape, *key_strides(t), off]


def _same_strides(t: torch.Tensor, stride: tuple[int, ...] | None) -> bool:
    """``t``'s strides are ``stride`` (dims of size 1 have none)."""
    return stride is not None and key_strides(t) == tuple(
        s if n != 1 else 0 for s, n in zip(stride, t.shape, strict=True)
    )


def _view_array(r: Region, source: tuple[Any, ...]) -> tuple[Any, bool]:
    """The card array :func:`_view_source` names, and whether it is the host's memory (the
    storage's bytes, as they are; a padded copy of them is not). Cached until written."""
    if source[0] not in _BYTES:
        return r.card_value(), False
    key = ("bytes", source[2])
    hit = r.views.get(key)
    if hit is not None and hit[0] == r.buf.version:
        return hit[1]
    payload = r.device_bytes()
    if payload.nbytes == source[2]:
        raw, shares = payload, True
    else:
        raw, shares = np.zeros(source[2], np.uint8), False
        raw[: payload.nbytes] = payload
    out = (relayout_module().host_bytes(raw), shares)
    r.views[key] = (r.buf.version, out)
    return out


def _operand(r: Region, t: torch.Tensor, layout: TensorLayout, data: Any) -> DeviceBuffer:
    """A new buffer for ``t`` in ``layout`` holding ``data``, its re-layout a step."""
    buf = DeviceBuffer.allocate(layout.nbytes, layout, rt=r.rt, tag="torch-operand", payload=data)
    shape = tuple(t.shape)
    if layout.shape != shape:
        name = _step_name("pad", t.dtype, shape, layout.shape)
        card_runtime.device_copy(name, [r.buf], [buf], layout.nbytes)
    elif not t.is_contiguous():
        name = _step_name("relayout", t.dtype, shape, None)
        card_runtime.device_copy(name, [r.buf], [buf], layout.nbytes)
    else:  # the kernel reads the tensor's own bytes: it must not race their writer
        card_runtime.check_reads("read operand", [r.buf])
    return buf


@functools.lru_cache(maxsize=4096)
def _step_name(what: str, dtype: torch.dtype, shape: tuple, target: tuple | None) -> str:
    """The timeline's name of an operand's re-layout step (made once per geometry: one step
    per gathered operand of every eager op)."""
    name = f"{what} {str(dtype).removeprefix('torch.')}{list(shape)}"
    return name if target is None else f"{name} to {list(target)}"


def _gathered(r: Region, t: torch.Tensor, layout: TensorLayout, fill: Any = 0) -> Any:
    """``t`` in ``layout`` as a card array gathered on the card (by the program
    :func:`card_operand` folds into a kernel, run alone) from its pending result or its
    storage's bytes, so the host does not wait; a read of host bytes is recorded in the
    buffer's readers."""
    key, sizes = _view_key(r, t, layout, fill)
    if t.numel() == 0 or not relayout_module().worth_compiling(("view", *key)):
        return _host_gathered(t, layout, fill)
    src, shares = _view_array(r, key[0])
    out = relayout_module().gather_view(card_runtime.card_array(src), sizes, key)
    if shares:
        r.buf.add_reader(out)
    return out


def _host_gathered(t: torch.Tensor, layout: TensorLayout, fill: Any) -> np.ndarray:
    """:func:`_gathered` on the host, for a geometry's first use: the tensor's values (waited
    for) copied into ``layout``, ``fill`` past ``t``'s own size."""
    al = alias(t)
    if t.dtype == torch.bfloat16:
        host = al.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    elif t.dtype == torch.int64:
        host = al.numpy().astype(np.int32)
    else:
        host = al.numpy()
    data = np.full(layout.device_shape, fill, np_dtype(layout.dtype))
    if host.ndim:
        data[tuple(slice(0, n) for n in host.shape)] = host
    else:
        data[0] = host
    return data


@functools.cache  # the module, kept: an import statement costs a microsecond per operand
def relayout_module() -> Any:
    """:mod:`torch_bridge.relayout` (JAX: loaded with the first launch that needs it, never by
    ``import torch``)."""
    from . import relayout

    return relayout


def _card_view(r: Region, t: torch.Tensor, layout: TensorLayout) -> DeviceBuffer | None:
    """The card buffer of ``t`` as a view of its storage's bytes, when they already are ``t`` in
    ``layout`` (contiguous, the card's dtype, rows a whole number of sticks): no copy and no
    second allocation, so a model's weights live once in device memory. Cached on the storage
    until its bytes are written (the buffer's ``version``); None when a re-layout is needed."""
    pend = r.pending
    if pend is not None:
        pl = pend.layout
        if (
            (pl is layout or pl == layout)
            and t.storage_offset() == 0
            and pend.dtype == t.dtype
            and t.shape == layout.shape
            and ((pend.stride is None and t.is_contiguous()) or _same_strides(t, pend.stride))
        ):  # the launch's result as it is (by strides too: the card array is in its logical
            # order): no wait, no copy
            key = (0, layout)
            hit = r.views.get(key)
            if hit is not None and hit[0] == r.buf.version:
                return hit[1]
            view = DeviceBuffer.view(r.buf, layout, r.card_value(), shared=False)
            r.views[key] = (r.buf.version, view)
            return view
        return None  # gathered from the pending result (:func:`_gathered`)
    shape = layout.shape
    if (
        not shape
        or layout.device_shape[-1] != shape[-1]
        or t.dtype == torch.int64
        or t.element_size() != layout.itemsize
        or not t.is_contiguous()
        or t.numel() == 0
    ):
        return None
    off = t.storage_offset()
    key = (off, layout)
    hit = r.views.get(key)
    if hit is not None and hit[0] == r.buf.version and type(r.buf.state) is not Deleted:
        return hit[1]  # (a view of r.buf: alive while it is)
    npd = np_dtype(layout.dtype)
    start = off * t.element_size()
    n = math.prod(layout.device_shape) * npd.itemsize
    payload = r.device_bytes()
    if start + n > payload.nbytes:
        return None
    data = payload[start : start + n].view(npd).reshape(layout.device_shape)
    view = DeviceBuffer.view(r.buf, layout, data)
    r.views[key] = (r.buf.version, view)
    return view
