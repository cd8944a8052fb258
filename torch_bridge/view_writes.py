"""Writes into spyre tensors that stay on the card: ``dst.copy_(src)``, ``dst.fill_(v)`` and an
in-place op's result, where ``dst`` is one slice of a contiguous tensor (``x[..., -1:] = 0``, as
``generate()``'s top-p warper writes).

The host path (``alias(dst).copy_(...)``) brings the storage's bytes to the host: the lazy
trace runs up to there and the next kernel reading ``dst`` copies them in again. Here the write
is card ops instead: the value (of ``dst``'s dtype) broadcast to ``dst``'s shape and
``slice_scatter`` of it into the whole tensor, and the result moved into the storage as a
launch's result (``storage.copy_on_card``), pending like any other. False (nothing done) where
the write is of another form, or where neither the storage nor the value is a result on the
card (the host's copy then waits for nothing); the caller then takes the host path.
"""

from __future__ import annotations

import torch

from . import storage as st

__all__ = ["write_on_card", "fill_on_card"]

aten = torch.ops.aten


def _whole(t: torch.Tensor) -> bool:
    """``t`` is all of its storage, contiguous from its start."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


def _slice_of(dst: torch.Tensor) -> tuple[torch.Tensor, int, int, int] | None:
    """``(base, dim, start, end)`` where ``dst`` (not all of its storage) is ``base`` sliced
    along one dim with step 1 and ``base`` is all of its storage; else None."""
    base = dst._base
    if base is None or dst.numel() == 0 or dst.dim() == 0 or _whole(dst):
        return None  # not a view, or all of its storage (copy_on_card's)
    if not _whole(base) or base.dim() != dst.dim() or dst.dtype != base.dtype:
        return None
    if base.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr():
        return None  # base given other storage since (set_, .data =): dst is not in it
    if dst.stride() != base.stride():
        return None
    diff = [d for d in range(dst.dim()) if dst.shape[d] != base.shape[d]]
    if len(diff) != 1:
        return None
    d = diff[0]
    stride = base.stride(d)
    off = dst.storage_offset()
    if stride <= 0 or off % stride:
        return None
    start = off // stride
    if start + dst.shape[d] > base.shape[d]:
        return None
    return base, d, start, start + dst.shape[d]


def _scatter(found: tuple[torch.Tensor, int, int, int], dst: torch.Tensor, v: torch.Tensor) -> bool:
    """``v`` broadcast to ``dst`` and scattered into the slice ``found`` of its base, on the
    card; the base's storage takes the result."""
    target, dim, start, end = found
    if tuple(v.shape) != tuple(dst.shape):
        v = v.expand(dst.shape)
    return st.copy_on_card(target, aten.slice_scatter(target, v, dim, start, end))


def write_on_card(dst: torch.Tensor, value: torch.Tensor) -> bool:
    """``dst`` (a spyre tensor) given ``value`` (a spyre tensor that broadcasts to it) on the
    card; False where it takes the host path (nothing done then)."""
    if not st.is_spyre(value) or value.dtype != dst.dtype:
        return False  # a conversion is _to_copy's own copy_ (which comes here): the host's
    found = _slice_of(dst)
    if found is None:
        return False
    if st.region(found[0]).pending is None and st.region(value).pending is None:
        return False  # both on the host already: the host's copy waits for nothing
    return _scatter(found, dst, value)


def fill_on_card(dst: torch.Tensor, value: object) -> bool:
    """``dst.fill_(value)`` on the card where ``dst`` is a slice of a tensor whose contents are
    a result on the card (see :func:`write_on_card`); False (nothing done) otherwise."""
    found = _slice_of(dst)
    if found is None or st.region(found[0]).pending is None:
        return False
    # torch's own fill_ on the host makes the value: its range check and rounding
    return _scatter(found, dst, torch.empty((), dtype=dst.dtype).fill_(value).to(dst.device))
