"""Tensors as the blocks stages load: cutting a device array into blocks, putting blocks back, and
where a stage's loads read an input's blocks from (:class:`Source`).

Blocks are row-major over an operand's grid (:func:`~device_model.kernel.operand_grid`); the
parts of a block that lie past the tensor read the uninitialized-scratchpad value
(:func:`uninit_value`). A small input is cut into blocks once per stage; a large one whose blocks
are not a plain reshape of it is read block by block from the array itself (a blocked copy of
a model's weight would otherwise live for the whole stage).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import xla_host  # noqa: F401  (first: the CPU client's dispatch)
from .kernel import Operand, blocks_of, operand_grid

__all__ = [
    "DIRECT_LOAD_BYTES",
    "Source",
    "from_blocks",
    "operand_blocks",
    "static",
    "take",
    "take_blocks",
    "to_blocks",
    "uninit_value",
]

#: an input of at least this many bytes whose blocks are not a plain reshape of its device array
#: is read block by block from the array itself (no blocked copy of it lives during the stage)
DIRECT_LOAD_BYTES = 8 << 20


def to_blocks(xp: Any, arr: Any, block: tuple[int, ...]) -> Any:
    """``[*device_shape]`` -> ``[num_blocks, *block]``, blocks in row-major order."""
    shape = arr.shape
    nb = blocks_of(tuple(shape), block)
    if all(n == 1 for n in nb):
        return arr[None]
    inter = []
    for n, b in zip(nb, block, strict=True):
        inter += [n, b]
    x = arr.reshape(inter)
    r = len(shape)
    perm = [2 * i for i in range(r)] + [2 * i + 1 for i in range(r)]
    moved = [p for p in perm if x.shape[p] != 1]
    if moved != sorted(moved):  # only a real transpose when non-trivial axes change order
        x = xp.transpose(x, perm)
    return x.reshape((math.prod(nb), *block))


def from_blocks(xp: Any, blocks: Any, device_shape: tuple[int, ...], block: tuple[int, ...]) -> Any:
    """Inverse of :func:`to_blocks` (ragged edge blocks: what lies past the tensor is dropped)."""
    nb = blocks_of(device_shape, block)
    padded = tuple(n * b for n, b in zip(nb, block, strict=True))
    if all(n == 1 for n in nb):
        x = blocks[0]
    else:
        r = len(device_shape)
        x = blocks.reshape((*nb, *block))
        perm = []
        for i in range(r):
            perm += [i, r + i]
        moved = [p for p in perm if x.shape[p] != 1]
        if moved != sorted(moved):
            x = xp.transpose(x, perm)
        x = x.reshape(padded)
    if padded != tuple(device_shape):
        x = x[tuple(slice(0, d) for d in device_shape)]
    return x


def operand_blocks(xp: Any, arr: Any, op: Operand, fill: Any) -> Any:
    """An input tensor as the blocks its operand reads, ``[num_blocks, *block]`` (row-major over
    :func:`~device_model.kernel.operand_grid`); the parts of blocks outside the tensor read
    ``fill`` (the uninitialized-scratchpad value)."""
    dev = tuple(arr.shape)
    if not op.windowed:
        nb = blocks_of(dev, op.block)
        padded = tuple(n * b for n, b in zip(nb, op.block, strict=True))
        if padded != dev:
            arr = xp.pad(
                arr, [(0, p - d) for p, d in zip(padded, dev, strict=True)], constant_values=fill
            )
        return to_blocks(xp, arr, op.block)
    grid = operand_grid(op, dev)
    x = arr
    r = len(dev)
    for d in range(r):
        o, s, b, n = op.origins[d], op.steps[d], op.block[d], grid[d]
        ax = 2 * d  # dims before d are already split into (n, b) pairs
        lo = max(0, -o)
        end = max(o + n * s, o + (n - 1) * s + b)
        hi = max(0, end - dev[d])
        if lo or hi:
            pads = [(0, 0)] * x.ndim
            pads[ax] = (lo, hi)
            x = xp.pad(x, pads, constant_values=fill)
        start = o + lo
        shp = x.shape
        if s >= b:
            x = (
                lax.slice_in_dim(x, start, start + n * s, axis=ax)
                if xp is jnp
                else x[(slice(None),) * ax + (slice(start, start + n * s),)]
            )
            x = x.reshape((*shp[:ax], n, s, *shp[ax + 1 :]))
            if s != b:
                x = x[(slice(None),) * (ax + 1) + (slice(0, b),)]
        else:  # overlapping windows
            idx = start + np.arange(n)[:, None] * s + np.arange(b)[None, :]
            x = xp.take(x, idx.reshape(-1), axis=ax)
            x = x.reshape((*shp[:ax], n, b, *shp[ax + 1 :]))
    perm = [2 * i for i in range(r)] + [2 * i + 1 for i in range(r)]
    moved = [p for p in perm if x.shape[p] != 1]
    if moved != sorted(moved):
        x = xp.transpose(x, perm)
    return x.reshape((math.prod(grid), *op.block))


def uninit_value(dtype: str) -> Any:
    """What an all-ones-bytes (never written) scratchpad word reads as in ``dtype``."""
    if dtype == "bool":
        return True
    if dtype == "int32":
        return -1
    if dtype == "uint32":
        return np.uint32(0xFFFFFFFF)
    return np.nan


def static(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def take(x: jax.Array, idx: np.ndarray) -> jax.Array:
    """``x[idx]`` along axis 0 for a static index vector, as a slice or broadcast when it is one
    (fewer gathers: smaller programs that XLA compiles faster)."""
    n = len(idx)
    if n == 0:
        return x[:0]
    a = int(idx[0])
    if n == x.shape[0] and (idx == np.arange(n)).all():
        return x
    if (idx == a).all():
        return jnp.broadcast_to(x[a], (n, *x.shape[1:]))
    if (idx == np.arange(a, a + n)).all():
        return lax.slice_in_dim(x, a, a + n, axis=0)
    return x[idx]


def take_blocks(blocked: jax.Array, idx: Any) -> jax.Array:
    """Blocks ``idx`` (one per row; -1 entries are fetched clamped and masked by the caller)."""
    nb = blocked.shape[0]
    if static(idx):
        return take(blocked, np.clip(idx, 0, nb - 1))
    return blocked[jnp.clip(idx, 0, nb - 1)]


def _plain_blocks(dev: tuple[int, ...], op: Operand) -> bool:
    """Whether an operand's blocks are a reshape of its device array (no padding, no transpose)."""
    if op.windowed or any(d % b for d, b in zip(dev, op.block, strict=True)):
        return False
    split = [i for i, (d, b) in enumerate(zip(dev, op.block, strict=True)) if d != b]
    # blocks are contiguous when only leading dims are split and every later dim is whole
    return all(b == 1 for b in op.block[: split[-1]]) if split else True


class Source:
    """Where one input's loads read their blocks: the array cut into blocks once per stage
    (:func:`operand_blocks`), or, for a large array whose blocks are not a plain reshape of it,
    the array itself with every step's blocks gathered from it (:data:`DIRECT_LOAD_BYTES`)."""

    def __init__(self, arr: jax.Array, op: Operand, fill: Any):
        dev = tuple(arr.shape)
        self.op, self.fill = op, fill
        self.grid = operand_grid(op, dev)
        nbytes = math.prod(dev) * np.dtype(arr.dtype).itemsize
        self.direct = nbytes >= DIRECT_LOAD_BYTES and not _plain_blocks(dev, op)
        if self.direct:  # a dim shorter than its block is padded (the rest never is)
            pads = [(0, max(0, b - d)) for d, b in zip(dev, op.block, strict=True)]
            if any(hi for _, hi in pads):
                arr = jnp.pad(arr, pads, constant_values=fill)
            self.arr = arr
            # the axes along which some block of the grid runs past the tensor: only these
            # need a block's window shifted and masked (known here, whatever the step)
            self.edges = [
                ax
                for ax, (g, o, s, b, d) in enumerate(
                    zip(self.grid, op.origins, op.steps, op.block, arr.shape, strict=True)
                )
                if ((o + np.arange(g) * s < 0) | (o + np.arange(g) * s > d - b)).any()
            ]
        else:
            self.blocked = operand_blocks(jnp, arr, op, fill)

    def take(self, idx: Any) -> jax.Array:
        """Blocks ``idx`` (one per row; -1 entries are fetched clamped and masked by the
        caller), ``[len(idx), *block]``."""
        if not self.direct:
            return take_blocks(self.blocked, idx)
        xp = np if static(idx) else jnp
        op, arr = self.op, self.arr
        flat = xp.clip(idx, 0, math.prod(self.grid) - 1)
        coords = []
        for g in reversed(self.grid):
            coords.append(flat % g)
            flat = flat // g
        coords.reverse()
        starts, clamped = [], []
        for c, o, s, b, d in zip(coords, op.origins, op.steps, op.block, arr.shape, strict=True):
            st = o + c * s
            starts.append(st)
            clamped.append(xp.clip(st, 0, d - b))
        at = jnp.stack([jnp.asarray(c, jnp.int32) for c in clamped], axis=1)
        win = jax.vmap(lambda s: lax.dynamic_slice(arr, tuple(s), op.block))(at)
        # an edge block: the window was clamped inside the array; shift its part of the tensor
        # to the block's start and fill what lies past the tensor
        for ax, (st, cl, b, d) in enumerate(zip(starts, clamped, op.block, arr.shape, strict=True)):
            if ax not in self.edges or (xp is np and (st == cl).all()):
                continue
            i = xp.arange(b)
            src = xp.clip(i[None, :] + (st - cl)[:, None], 0, b - 1)
            inside = (st[:, None] + i[None, :] >= 0) & (st[:, None] + i[None, :] < d)
            shape = [len(idx)] + [1] * len(op.block)
            shape[1 + ax] = b
            win = jnp.take_along_axis(win, jnp.asarray(src).reshape(shape), axis=1 + ax)
            win = jnp.where(jnp.asarray(inside).reshape(shape), win, self.fill)
        return win
