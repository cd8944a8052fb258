"""The schedule IR's living definition: a plain NumPy interpreter of a :class:`Kernel`.

``run_kernel_reference(kernel, args)`` takes and returns device-shaped buffers exactly like
:func:`device_model.execute.run_kernel`, but it is written to be obviously right rather than
fast, the opposite of the vectorized executor:

* Device memory is a dict from tensor name to a NumPy array of the tensor's device shape and
  dtype. A tensor and its views (``kernel.aliases``) share the data, reshaped.
* Every core has a real scratchpad: ``np.full(stage.sp_peak_bytes, 0xFF, np.uint8)``, fresh for
  each stage. A buffer's slot ``s`` is the byte range ``[offset + s * slot_bytes, ... +
  prod(block) * itemsize)`` seen in the buffer's dtype, so a never-written word reads as NaN for
  float types, -1 for int32 and True for bool (the all-ones bytes).
* A stage runs step by step and core by core in plain Python loops. Load units copy whole block
  bytes from device memory into the slot; ring transfers copy the bytes of the source core's slot
  after the sources' loads of that step; the compute units read their tiles out of scratchpad
  bytes and write their results back as bytes; the store units copy the output slot's bytes to
  device memory. A block that reaches past the tensor (a ragged edge block, or a window of a
  slice or a concatenation that starts before element 0) loads the part inside the tensor and
  all-ones bytes for the rest; a store writes only the part inside the tensor.
* Double buffering as in :func:`device_model.execute.run_stage`: step 0's loads, then for each
  step ``t``: step ``t + 1``'s loads into slot ``(t + 1) % slots``, step ``t``'s compute on slot
  ``t % slots``, step ``t``'s stores. An input buffer with a single slot in a stage of several
  steps is loaded after step ``t``'s compute instead.
* Accumulating stages (a matmul's K loop, a map's reduction split across steps: its body
  carries a :class:`~device_model.steps.SplitReduce`) keep their running result in the
  scratchpad accumulators ``acc``/``acci`` from a ``first`` step to a ``last`` one.
* Compute semantics come from :mod:`device_model.ops` with ``xp=numpy``, applied to one core's
  tile at a time (a leading core axis of size 1); with ``kernel.dl16`` the map and matmul results
  stored as fp16/bf16 round through DL16 first, as in the vectorized executor.

It is slow (a Python loop over cores and steps); use it on small kernels, in tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from . import matmul_ops, ops, sorting
from .kernel import (
    Kernel,
    Operand,
    SpBuf,
    Stage,
    TensorDecl,
    block_window,
    blocks_of,
    check_kernel,
    resolve_aliases,
)
from .layout import DTYPES, np_dtype
from .steps import ConcatStep, GatherStep, MapStep, MatmulStep, ReshapeStep, SortStep, TakeStep

__all__ = ["run_kernel_reference", "reference_runner", "run_stage_reference", "Scratchpad"]


# ---------------------------------------------------------------------------------------------
# one core's scratchpad


class Scratchpad:
    """One core's scratchpad for one stage: raw bytes, addressed through the stage's buffers."""

    def __init__(self, stage: Stage):
        self.nbytes = stage.sp_peak_bytes
        self.mem = np.full(self.nbytes, 0xFF, np.uint8)
        self.bufs = {b.name: b for b in stage.scratch}

    def _span(self, buf: SpBuf, slot: int) -> tuple[int, int]:
        if not 0 <= slot < buf.slots:
            raise IndexError(f"scratchpad buffer {buf.name}: slot {slot} of {buf.slots}")
        start = buf.offset + slot * buf.slot_bytes
        end = start + math.prod(buf.block) * DTYPES[buf.dtype]
        if start < 0 or end > self.nbytes or end > buf.end:
            raise IndexError(
                f"scratchpad buffer {buf.name}: bytes [{start}, {end}) outside the "
                f"{self.nbytes} B scratchpad or the buffer"
            )
        return start, end

    def read_bytes(self, name: str, slot: int) -> np.ndarray:
        """A copy of the bytes of one slot of buffer ``name``."""
        start, end = self._span(self.bufs[name], slot)
        return self.mem[start:end].copy()

    def write_bytes(self, name: str, slot: int, data: np.ndarray) -> None:
        """Overwrite one slot of buffer ``name`` with exactly its size in bytes."""
        start, end = self._span(self.bufs[name], slot)
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if data.size != end - start:
            raise ValueError(f"scratchpad buffer {name}: writing {data.size} B into {end - start}")
        self.mem[start:end] = data

    def read(self, name: str, slot: int) -> np.ndarray:
        """One slot of buffer ``name`` seen as its dtype and block shape (a copy)."""
        buf = self.bufs[name]
        raw = self.read_bytes(name, slot)
        if buf.dtype == "bool":
            # any nonzero byte is True (the never-written 0xFF bytes included)
            return (raw != 0).reshape(buf.block)
        return raw.view(np_dtype(buf.dtype)).reshape(buf.block)

    def write(self, name: str, slot: int, tile: Any) -> None:
        """Write a tile of the buffer's block shape, converted to the buffer's dtype."""
        buf = self.bufs[name]
        tile = np.asarray(tile)
        if tuple(tile.shape) != tuple(buf.block):
            raise ValueError(
                f"scratchpad buffer {name}: tile {tuple(tile.shape)} is not its block {buf.block}"
            )
        self.write_bytes(name, slot, tile.astype(np_dtype(buf.dtype)))


# ---------------------------------------------------------------------------------------------
# device memory blocks


def block_slices(
    device_shape: tuple[int, ...], block: tuple[int, ...], index: int
) -> tuple[slice, ...]:
    """Where block ``index`` (row-major over the block grid) lies in the device tensor (a
    ragged edge block: only the part inside it)."""
    grid = blocks_of(device_shape, block)
    n = math.prod(grid)
    if not 0 <= index < n:
        raise IndexError(f"block {index} out of range for {n} blocks of {block} in {device_shape}")
    coord = np.unravel_index(index, grid) if grid else ()
    return tuple(
        slice(int(i) * b, min((int(i) + 1) * b, d))
        for i, b, d in zip(coord, block, device_shape, strict=True)
    )


def _check_dtype(what: str, tensor_dtype: str, buf: SpBuf) -> None:
    if tensor_dtype != buf.dtype:
        raise TypeError(
            f"{what}: tensor dtype {tensor_dtype} differs from scratchpad buffer "
            f"{buf.name} dtype {buf.dtype}; a byte copy would reinterpret the data"
        )


# ---------------------------------------------------------------------------------------------
# the units of one core


def _load(sp: Scratchpad, op: Operand, mem: dict[str, np.ndarray], block: int, slot: int) -> None:
    """Load unit: one block's bytes from device memory into a scratchpad slot. The part of the
    block outside the tensor (a ragged edge, a window before element 0) gets all-ones bytes, or
    the operand's ``pad_value``."""
    dev = mem[op.tensor]
    src, dst = block_window(op, dev.shape, block)
    whole = all(s.start == 0 and s.stop == b for s, b in zip(dst, op.block, strict=True))
    if whole:
        sp.write_bytes(op.sp, slot, np.ascontiguousarray(dev[src]))
        return
    raw = np.full(math.prod(op.block) * dev.dtype.itemsize, 0xFF, np.uint8)
    tile = raw.view(dev.dtype).reshape(op.block)
    if op.pad_value is not None:  # the load unit writes the halo's value
        tile[...] = op.pad_value
    tile[dst] = dev[src]
    sp.write_bytes(op.sp, slot, raw)


def _store(sp: Scratchpad, op: Operand, mem: dict[str, np.ndarray], block: int, slot: int) -> None:
    """Store unit: the output slot's bytes into one block of device memory (of a ragged edge
    block, the part inside the tensor)."""
    dev = mem[op.tensor]
    raw = sp.read_bytes(op.sp, slot)
    sl = block_slices(dev.shape, op.block, block)
    tile = raw.view(dev.dtype).reshape(op.block)
    dev[sl] = tile[tuple(slice(0, s.stop - s.start) for s in sl)]


class _Core:
    """What one core's compute at one step reads and writes: its scratchpad, the step's store
    block, device memory (a gather's table), the tensors' declarations and DL16 rounding
    (``Kernel.dl16``: float results stored as fp16/bf16 round through DL16 first)."""

    def __init__(
        self,
        stage: Stage,
        sp: Scratchpad,
        t: int,
        store_block: int,
        mem: dict[str, np.ndarray],
        decls: dict[str, TensorDecl],
        dl16: bool,
    ):
        self.stage, self.sp, self.t, self.store_block = stage, sp, t, store_block
        self.mem, self.decls, self.dl16 = mem, decls, dl16
        self.out = stage.output
        self.oslot = t % stage.sp(self.out.sp).slots

    def tile(self, op: Operand) -> np.ndarray:
        """The tile of one input with a leading core axis of size 1."""
        return self.sp.read(op.sp, self.t % self.stage.sp(op.sp).slots)[None]

    def tiles(self, operands: Any = None) -> list[np.ndarray]:
        return [self.tile(op) for op in (self.stage.inputs if operands is None else operands)]

    def dtypes(self, operands: Any = None) -> list[str]:
        ops_ = self.stage.inputs if operands is None else operands
        return [self.decls[op.tensor].layout.dtype for op in ops_]

    def write(self, r: np.ndarray) -> None:
        """A result ``[1, *dims]`` into the output slot, fit to the output block."""
        want = self.out.block
        if r.ndim - 1 < len(want):
            r = r.reshape((1, *([1] * (len(want) - r.ndim + 1)), *r.shape[1:]))
        self.sp.write(self.out.sp, self.oslot, ops.fit(np, r, want)[0])


def _map(cx: _Core, kpos: int) -> None:
    step: MapStep = cx.stage.step
    body, split = step.body, step.split
    if split is None:
        r = ops.run_map(np, body, cx.tiles(), cx.dtypes(), tuple(step.space_block), 1)
        cx.write(ops.narrow(np, r, body.out_dtype, cx.dl16))
        return
    coord = kpos if not split.reverse else split.nk - 1 - kpos
    part = ops.run_map(
        np, body, cx.tiles(), cx.dtypes(), tuple(step.space_block), 1, split=split, coord=coord
    )
    sp = cx.sp
    first, last = bool(cx.stage.first[cx.t]), bool(cx.stage.last[cx.t])
    if body.reduction.scan:
        carry = None if first else sp.read("acc", 0)[None]
        res, carry = ops.scan_carry(np, body.reduce, part, carry, first, split)
        sp.write("acc", 0, carry[0])
        cx.write(ops.narrow(np, res, body.out_dtype, cx.dl16))
        return
    if body.reduction.index_of:
        acc = None if first else (sp.read("acc", 0)[None], sp.read("acci", 0)[None])
        v, i = ops.combine_partial(np, body.reduce, acc, part, first)
        sp.write("acc", 0, v[0])
        sp.write("acci", 0, i[0])
        res = i
    else:
        acc = None if first else sp.read("acc", 0)[None]
        res = ops.combine_partial(np, body.reduce, acc, part, first)
        sp.write("acc", 0, res[0])
    if last:
        cx.write(ops.narrow(np, res, body.out_dtype, cx.dl16))


def _matmul(cx: _Core, kpos: int) -> None:
    stage, step, out = cx.stage, cx.stage.step, cx.out
    lhs_op, rhs_op, extras, pro_ops = step.split_inputs(stage.inputs)
    lhs, rhs = cx.tile(lhs_op), cx.tile(rhs_op)  # [1, 1, tm, tkp], [1, 1, tk, tn]
    if step.window is not None:  # a convolution: the patches of the window, read in place
        lhs, rhs = matmul_ops.conv_patches(np, lhs, rhs, step.window)
    if step.prologue is not None:  # the lhs tile through the SFUs on its way to the PE
        lhs_dt = cx.decls[lhs_op.tensor].layout.dtype
        lhs = matmul_ops.run_prologue(
            np, step, lhs, cx.tiles(pro_ops), cx.dtypes(pro_ops), lhs_dt, cx.dl16
        )
    tk = step.tk(rhs.shape)  # rhs_t: the rhs tile is [1, 1, tn, tk]
    k_valid = step.k_logical - kpos * tk if step.k_logical % tk else None
    acc = cx.sp.read("acc", 0)[None]
    acc = matmul_ops.run_matmul_step(
        np, acc, lhs, rhs, bool(stage.first[cx.t]), k_valid, step.rhs_t, step.k_logical
    )
    cx.sp.write("acc", 0, acc[0])
    r = ops.narrow(np, acc, step.out_dtype, cx.dl16)
    if step.n_logical:
        ncol = blocks_of(cx.decls[out.tensor].layout.device_shape, out.block)[-1]
        col0 = np.asarray([max(cx.store_block, 0) % ncol * out.block[-1]])
        r = matmul_ops.mask_n(np, r, col0, step.n_logical)
    r = ops.fit(np, r, out.block)
    if step.epilogue is not None:
        if not stage.last[cx.t]:
            return  # the epilogue's operands arrive with the block's last K step
        r = matmul_ops.run_epilogue(
            np,
            step,
            r,
            cx.tiles(extras),
            cx.dtypes(extras),
            out.block,
            step.epilogue.space,
            cx.dl16,
        )
    cx.sp.write(out.sp, cx.oslot, r[0])


def _gather(cx: _Core, kpos: int) -> None:
    """The indirect loads: one row segment per index straight from device memory."""
    step, out = cx.stage.step, cx.out
    idx = cx.tile(cx.stage.inputs[0])[0].astype(np.int32)  # [trp]
    table = cx.mem[step.table]
    td = out.block[-1]
    ncb = table.shape[-1] // td
    col = 0 if cx.store_block < 0 else cx.store_block % ncb
    fill = step.fill_value
    if fill is None:
        fill = np.nan if table.dtype.kind == "f" else 0
    rows = np.empty((len(idx), td), table.dtype)
    for i, ix in enumerate(idx):
        ix = int(ix)
        row = min(max(ix, 0), step.num_rows - 1)
        rows[i] = table[row, col * td : (col + 1) * td]
        if step.mode == "fill" and not 0 <= ix < step.num_rows:
            rows[i] = np.asarray(fill).astype(table.dtype)
    rows = ops.fit(np, rows[None], (out.block[0], td))
    cx.sp.write(out.sp, cx.oslot, rows[0])


def _reshape(cx: _Core, kpos: int) -> None:
    step, out = cx.stage.step, cx.out
    x = cx.tile(cx.stage.inputs[0])
    x = x[..., : step.l_in].reshape(1, *out.block[:-1], step.l_out)
    cx.sp.write(out.sp, cx.oslot, ops.fit(np, x, out.block)[0])


def _concat(cx: _Core, kpos: int) -> None:
    step, out = cx.stage.step, cx.out
    k = None
    if step.tile:
        sb = max(cx.store_block, 0)
        inner = math.prod(step.out_grid[step.axis + 1 :])
        k = np.asarray([(sb // inner) % step.out_grid[step.axis]])
    x = ops.run_concat(np, step, cx.tiles(), k)
    x = x.astype(np_dtype(cx.decls[out.tensor].layout.dtype))
    cx.sp.write(out.sp, cx.oslot, ops.fit(np, x, out.block)[0])


def _sort(cx: _Core, kpos: int) -> None:
    """The rows of the block's keys sorted; their first ``k`` indices stored."""
    step: SortStep = cx.stage.step
    keys = [t[..., : step.n] for t in cx.tiles()]
    cx.write(sorting.argsort_rows(np, keys, step.order, step.descending, step.k))


def _take(cx: _Core, kpos: int) -> None:
    """Each row's elements at the block's indices."""
    step: TakeStep = cx.stage.step
    x, idx = cx.tiles()
    m = cx.decls[cx.stage.inputs[1].tensor].layout.shape[-1]
    r = sorting.take_rows(np, x[..., : step.n], idx[..., :m], step.n, step.mode, step.fill_value)
    cx.write(r)


#: one core's compute at one step, per step kind
_COMPUTE: dict[type, Callable[[_Core, int], None]] = {
    MapStep: _map,
    MatmulStep: _matmul,
    GatherStep: _gather,
    ReshapeStep: _reshape,
    ConcatStep: _concat,
    SortStep: _sort,
    TakeStep: _take,
}


# ---------------------------------------------------------------------------------------------
# stages and kernels


def run_stage_reference(
    stage: Stage,
    mem: dict[str, np.ndarray],
    decls: dict[str, TensorDecl],
    ncores: int,
    dl16: bool = False,
) -> np.ndarray:
    """Run one stage on ``ncores`` fresh scratchpads; returns the output tensor's device array.

    Every core's compute at every step is its step kind's function in ``_COMPUTE``; ``dl16``:
    float results stored as fp16/bf16 round through DL16 first (``Kernel.dl16``).
    """
    compute = _COMPUTE.get(type(stage.step))
    if compute is None:
        raise ValueError(f"stage {stage.name}: unknown step {type(stage.step).__name__}")
    out = stage.output
    out_layout = decls[out.tensor].layout
    for op in stage.inputs:
        where = f"stage {stage.name} input {op.tensor}"
        _check_dtype(where, _dtype_name(mem[op.tensor]), stage.sp(op.sp))
    _check_dtype(f"stage {stage.name} output {out.tensor}", out_layout.dtype, stage.sp(out.sp))
    # the output's device buffer starts as zeros, as in the vectorized executor
    mem[out.tensor] = np.zeros(out_layout.device_shape, np_dtype(out_layout.dtype))
    cores = [Scratchpad(stage) for _ in range(ncores)]
    T = stage.steps
    # an input with one slot in a stage of several steps is loaded after the step's compute
    late = {i for i, op in enumerate(stage.inputs) if stage.sp(op.sp).slots == 1 and T > 1}

    def load_step(t: int, which: list[int]) -> None:
        for i in which:
            op = stage.inputs[i]
            slot = t % stage.sp(op.sp).slots
            for c in range(ncores):
                blk = stage.loads[t][i][c]
                if blk >= 0:
                    _load(cores[c], op, mem, blk, slot)
            # ring transfers, after every source has loaded its block of this step
            for c in range(ncores):
                src = stage.ring[t][i][c]
                if src >= 0:
                    cores[c].write_bytes(op.sp, slot, cores[src].read_bytes(op.sp, slot))

    every = list(range(len(stage.inputs)))
    early = [i for i in every if i not in late]
    if T:
        load_step(0, every)
    kpos = 0
    for t in range(T):
        kpos = 0 if stage.first[t] else kpos + 1
        if t + 1 < T:
            load_step(t + 1, early)
        oslot = t % stage.sp(out.sp).slots
        for c in range(ncores):
            compute(_Core(stage, cores[c], t, stage.stores[t][c], mem, decls, dl16), kpos)
            blk = stage.stores[t][c]
            if blk >= 0:
                _store(cores[c], out, mem, blk, oslot)
        if t + 1 < T:
            load_step(t + 1, sorted(late))
    return mem[out.tensor]


def _dtype_name(a: np.ndarray) -> str:
    return "bfloat16" if a.dtype == np_dtype("bfloat16") else a.dtype.name


def run_kernel_reference(kernel: Kernel, args: list[np.ndarray]) -> list[np.ndarray]:
    """Interpret ``kernel`` on its input device buffers; returns its output device buffers."""
    check_kernel(kernel)
    decls = {t.name: t for t in kernel.tensors}
    if len(args) != len(kernel.inputs):
        raise TypeError(f"kernel {kernel.name}: {len(kernel.inputs)} inputs, got {len(args)}")
    mem: dict[str, np.ndarray] = {}
    for name, a in zip(kernel.inputs, args, strict=True):
        lay = decls[name].layout
        arr = np.array(a, copy=True)
        if tuple(arr.shape) != tuple(lay.device_shape) or _dtype_name(arr) != lay.dtype:
            raise TypeError(
                f"kernel {kernel.name}: input {name} wants {lay.dtype}{list(lay.device_shape)}, "
                f"got {_dtype_name(arr)}{list(arr.shape)}"
            )
        mem[name] = arr

    resolve_aliases(kernel, mem)
    with np.errstate(all="ignore"):  # NaN from uninitialized scratchpad is expected
        for st in kernel.stages:
            run_stage_reference(st, mem, decls, kernel.num_cores, getattr(kernel, "dl16", False))
            resolve_aliases(kernel, mem)
    for o in kernel.outputs:
        if o not in mem:  # a tensor without elements: no stage writes it
            lay = decls[o].layout
            mem[o] = np.zeros(lay.device_shape, np_dtype(lay.dtype))
    return [np.array(mem[o], copy=True) for o in kernel.outputs]


def reference_runner(kernel: Kernel) -> Callable[..., list[np.ndarray]]:
    """Like :func:`device_model.program.build_runner`: ``runner(*input_buffers) -> outputs``."""

    def runner(*args: Any) -> list[np.ndarray]:
        return run_kernel_reference(kernel, [np.asarray(a) for a in args])

    return runner
