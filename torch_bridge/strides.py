"""Strides of torch tensors on the card: contiguous strides, a storage's byte count, the
strides that key a view's geometry, and the dense permutations a result may keep."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["contig_strides", "storage_nbytes", "key_strides", "dense_strides"]


def contig_strides(size: Sequence[int]) -> tuple[int, ...]:
    """torch's strides of a contiguous tensor of ``size`` (a dim of size 0 or 1 counts as 1)."""
    n = len(size)
    st, acc = [1] * n, 1
    for i in range(n - 1, 0, -1):
        s = int(size[i])
        if s > 1:
            acc *= s
        st[i - 1] = acc
    return tuple(st)


def storage_nbytes(
    size: Sequence[int], stride: Sequence[int], itemsize: int, offset: int = 0
) -> int:
    """The bytes a storage needs to hold a ``size``/``stride`` view at element ``offset``."""
    if any(int(s) == 0 for s in size):
        return offset * itemsize
    return (
        offset + 1 + sum((int(s) - 1) * int(st) for s, st in zip(size, stride, strict=True))
    ) * itemsize


def key_strides(t: torch.Tensor) -> tuple[int, ...]:
    """A tensor's strides as a key of its geometry: a dimension of size 1 has none (``x[:, -1:]``
    of any length is one geometry)."""
    shape = t.shape
    if 1 not in shape:
        return t.stride()
    return tuple([0 if n == 1 else s for s, n in zip(t.stride(), shape, strict=True)])


def dense_strides(meta: Any, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """``meta``'s strides when they are a permutation of a dense layout other than the
    contiguous one, else None (contiguous)."""
    if not isinstance(meta, torch.Tensor) or meta.dim() != len(shape):
        return None
    st = tuple(int(s) for s in meta.stride())
    if st == contig_strides(shape) or not _dense_permutation(shape, st):
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
