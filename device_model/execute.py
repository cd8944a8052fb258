"""The card as one vectorized JAX program: every stage of a kernel over all its cores at once.

:func:`run_stage` runs one stage of a :class:`~device_model.kernel.Kernel` and :func:`run_kernel`
all of them, under ``jax.jit`` (``device_model.program.build_runner`` makes the jitted programs).

Scratchpads. Every stage's buffer plan (:class:`~device_model.kernel.SpBuf`: name, offset, slots,
block, dtype; the checker proves the buffers are stick-aligned, disjoint and within the usable
scratchpad) is held as one typed array per planned buffer, ``[rows, slots, *block]``: the bytes
``[offset, offset + nbytes)`` of each core's scratchpad seen in the buffer's dtype. Every buffer
starts filled with all-ones bytes, which read as NaN in every float type (uninitialized scratchpad
reads as NaN; -1 for int32, True for bool). Data really passes through them: the load units copy
whole stick blocks from device memory into them by the load table, the compute units read only
them and write their results into them, and the store units copy output blocks from them back.

Ring forwarding is copy-on-write. When a stage's ring table is the same at every step (the usual
case: core ``c`` always receives operand ``i`` from the same core ``s``), a receiving core's copy
of the block is byte-identical to its source's, so the buffer keeps one row per *loading* core and
a static map ``core -> row``; receivers read the source's row. A ring table that changes from
step to step is executed by materializing every forwarded copy. Either way the values each core
computes on are the ones the ring table implies (``device_model.reference`` checks this against a
per-core NumPy interpreter).

The PE step of a matmul stage runs as one GEMM per group of cores that share an operand block
(stacked along M when they share the rhs, along N when they share the lhs). Cores are an array
axis; steps are unrolled when few and a ``lax.scan`` otherwise, so no Python loop runs over
cores or tiles at run time. The semantics of every step (``device_model.steps``) are
``device_model.ops``; the compute of each step kind is looked up in a table by the step's class.

Blocks that reach past a tensor (ragged edge blocks, windows of slices and concatenations, see
``device_model.kernel``) are read from the tensor padded with the uninitialized value and
stored cropped. A large input (``blocks.DIRECT_LOAD_BYTES``) whose blocks are not a plain reshape of
its device array is not cut into blocks up front (that would copy a whole weight, twice with the
padding, for the stage's lifetime): each step gathers its blocks straight from the array, edge
blocks shifted into place and filled past the tensor (``blocks.Source``). Accumulating stages
(a matmul's K loop; a map whose reduction is split across
steps, its step carrying a ``steps.SplitReduce``) combine each step into the ``acc`` buffers and,
on the last step of a block, store the rounded accumulator. The stored bytes are what the card
stores from its output buffer, but the simulation keeps no copy of them in that buffer: for a
large output block (a vocabulary projection) the copy would double the stage's host memory. A
split cumsum stores every block and carries its running total. An input buffer with a single
slot in a stage of several steps is loaded after the step's compute (single buffering).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import matmul_ops, ops, sorting
from .blocks import Source, from_blocks, static, take, uninit_value
from .kernel import (
    Kernel,
    Operand,
    SpBuf,
    Stage,
    blocks_of,
    resolve_aliases,
)
from .layout import np_dtype
from .steps import ConcatStep, GatherStep, MapStep, MatmulStep, ReshapeStep, SortStep, TakeStep

__all__ = [
    "run_kernel",
    "run_stage",
    "UNROLL_STEPS",
]

#: stages with at most this many steps are unrolled; longer ones run as a lax.scan
UNROLL_STEPS = 4

#: XLA options for the card program. LLVM's backend optimization level 1 instead of the default
#: 2 cuts cold compile of a transformer block by ~40% with no measurable loss of run speed (the
#: heavy work is GEMMs, done by XLA's runtime library either way); see ``bench sim``. XLA:CPU's
#: older loop emitters instead of its MLIR fusion emitters compile GPT-2 small's stage programs
#: in about 35% less time and leave less host memory behind (``bench models``: cold compile
#: 14.8 -> 10-12 s, 10.4 -> 6-7 s for the equinox model), at the same run speed.
COMPILER_OPTIONS: dict[str, Any] = {
    "xla_backend_optimization_level": 1,
    "xla_cpu_use_fusion_emitters": False,
}


# ---------------------------------------------------------------------------------------------
# the static plan of a stage: which core's copy of each buffer lives in which row


@dataclass(frozen=True)
class _BufPlan:
    """How one input buffer is held: ``rows[c]`` is the storage row core ``c`` reads.

    ``loaders`` are the cores with a row of their own (storage row ``k`` is core
    ``loaders[k]``'s); ``nan_row`` (if not None) is a row never written, read by cores that never
    hold the operand. ``lazy`` says ring transfers are resolved through ``rows`` (no copy);
    otherwise storage has one row per core and forwarded blocks are copied.
    """

    lazy: bool
    loaders: np.ndarray
    rows: np.ndarray
    nrows: int
    nan_row: int | None


def _plan_input(loads: np.ndarray, ring: np.ndarray, ncores: int) -> _BufPlan:
    """``loads``/``ring``: ``[steps, cores]`` tables of one input."""
    const_ring = bool((ring == ring[:1]).all())
    lazy = const_ring and not ((ring >= 0) & (loads >= 0)).any()
    if not lazy:
        return _BufPlan(False, np.arange(ncores), np.arange(ncores), ncores, None)
    loaders = np.flatnonzero((loads >= 0).any(axis=0))
    row_of = {int(c): k for k, c in enumerate(loaders)}
    nan_row = len(loaders) if len(loaders) < ncores else None
    rows = np.empty(ncores, np.int64)
    r0 = ring[0]
    for c in range(ncores):
        owner = int(r0[c]) if r0[c] >= 0 else c
        if owner in row_of:
            rows[c] = row_of[owner]
        else:
            rows[c] = nan_row if nan_row is not None else 0
    nrows = len(loaders) + (1 if nan_row is not None else 0)
    return _BufPlan(True, loaders, rows, nrows, nan_row)


class _Buffers:
    """The scratchpad buffers of one stage on all cores (see the module docstring).

    ``data`` holds each buffer as one array ``[rows, slots, *block]``. A slot written at a
    step known when the program is traced (an unrolled stage, a single-slot buffer) is kept
    as its own array until a step with a traced slot index needs the stacked one
    (:meth:`flush`): a load read by the next compute then is one value, not a write into the
    buffer and a read back out of it (XLA does not fold that pair, and it dominated small
    stages: a decode step's matmul ran 4x slower)."""

    def __init__(
        self,
        stage: Stage,
        ncores: int,
        plans: dict[str, _BufPlan],
        skip: frozenset[str] = frozenset(),
    ):
        self.ncores = ncores
        self.plans = plans
        self.data: dict[str, jax.Array] = {}
        #: (buffer, static slot) -> that slot's rows as written since the last flush
        self.slots: dict[tuple[str, int], jax.Array] = {}
        for b in stage.scratch:
            if b.name in skip:
                continue
            p = plans.get(b.name)
            nrows = p.nrows if p is not None else ncores
            self.data[b.name] = _fresh(b, nrows)

    def _stacked(self, name: str) -> jax.Array:
        """Buffer ``name`` as one array, its slots kept apart written in (nothing stored: a
        read under ``lax.cond`` must not change the state)."""
        arr = self.data[name]
        for (n, slot), rows in self.slots.items():
            if n == name:
                arr = rows[:, None] if arr.shape[1] == 1 else _update(arr, slot, rows)
        return arr

    def flush(self) -> dict[str, jax.Array]:
        """Write the slots kept apart into the stacked arrays; returns :attr:`data`."""
        for name in {n for n, _ in self.slots}:
            self.data[name] = self._stacked(name)
        self.slots.clear()
        return self.data

    def rows(self, name: str) -> np.ndarray | None:
        p = self.plans.get(name)
        if p is None or (p.rows == np.arange(self.ncores)).all():
            return None
        return p.rows

    def read(self, name: str, slot: Any) -> jax.Array:
        """Every core's view of one slot: ``[cores, *block]``."""
        x = self.read_rows(name, slot)
        r = self.rows(name)
        return x if r is None else take(x, r)

    def read_rows(self, name: str, slot: Any) -> jax.Array:
        """The stored rows of one slot (one per loading core): ``[rows, *block]``."""
        if isinstance(slot, int | np.integer):
            kept = self.slots.get((name, int(slot)))
            return kept if kept is not None else _slot(self.data[name], slot)
        return _slot(self._stacked(name), slot)

    def write_rows(self, name: str, slot: Any, tile: jax.Array) -> None:
        """Write the first ``len(tile)`` stored rows of one slot."""
        dtype = self.data[name].dtype
        if isinstance(slot, int | np.integer):
            tile = tile.astype(dtype)
            if len(tile) < self.data[name].shape[0]:  # the rows past the tile keep their bytes
                tile = jnp.concatenate([tile, self.read_rows(name, slot)[len(tile) :]])
            self.slots[(name, int(slot))] = tile
            return
        arr = self._stacked(name)
        self.slots = {k: v for k, v in self.slots.items() if k[0] != name}
        self.data[name] = _update(arr, slot, tile.astype(dtype))

    def write(self, name: str, slot: Any, tile: jax.Array) -> None:
        """Write all stored rows of one slot."""
        self.write_rows(name, slot, tile)


def _update(arr: jax.Array, slot: Any, tile: jax.Array) -> jax.Array:
    """``arr[:len(tile), slot] = tile`` as one dynamic-update-slice (never a scatter)."""
    z = np.int32(0)
    s = np.int32(slot) if isinstance(slot, int | np.integer) else slot.astype(np.int32)
    return lax.dynamic_update_slice(arr, tile[:, None], (z, s) + (z,) * (arr.ndim - 2))


def _outside(op: Operand, dtype: str) -> Any:
    """What an operand's blocks read outside the tensor: its ``pad_value``, or the
    uninitialized scratchpad's value."""
    return uninit_value(dtype) if op.pad_value is None else np_dtype(dtype).type(op.pad_value)


def _fresh(b: SpBuf, rows: int) -> jax.Array:
    return jnp.full((rows, b.slots, *b.block), uninit_value(b.dtype), np_dtype(b.dtype))


def _slot(arr: jax.Array, slot: Any) -> jax.Array:
    if arr.shape[1] == 1:
        return arr[:, 0]
    if isinstance(slot, int | np.integer):
        return arr[:, int(slot)]
    return lax.dynamic_index_in_dim(arr, slot, axis=1, keepdims=False)


def _load(bufs: _Buffers, op: Operand, src: Source, idx: Any, ring: Any, slot: Any) -> None:
    """Load-unit step for one operand: device blocks -> scratchpad, then ring forwarding."""
    p = bufs.plans[op.sp]
    if p.lazy:
        idx = idx[p.loaders]
        if static(idx) and (idx < 0).all():
            return
        new = src.take(idx)
        if not (static(idx) and (idx >= 0).all()):
            old = bufs.read_rows(op.sp, slot)[: len(p.loaders)]
            new = jnp.where(_bmask(idx >= 0, new), new, old)
        bufs.write_rows(op.sp, slot, new)  # the never-written row (if any) keeps its bytes
        return
    # materialized: every core has its own copy
    if static(idx) and (idx < 0).all() and static(ring) and (ring < 0).all():
        return
    new = src.take(idx)
    if not (static(idx) and (idx >= 0).all()):
        new = jnp.where(_bmask(idx >= 0, new), new, bufs.read_rows(op.sp, slot))
    if not (static(ring) and (ring < 0).all()):
        src = np.clip(ring, 0, None) if static(ring) else jnp.clip(ring, 0, None)
        new = jnp.where(_bmask(ring >= 0, new), new[src], new)
    bufs.write(op.sp, slot, new)


def _is_arange(idx: np.ndarray, n: int) -> bool:
    return len(idx) == n and bool((idx == np.arange(n)).all())


def _bmask(m: Any, like: jax.Array) -> Any:
    m = jnp.asarray(m)
    return m.reshape(m.shape + (1,) * (like.ndim - 1))


def _store(out_blocked: jax.Array, tile: jax.Array, idx: Any) -> jax.Array:
    nb = out_blocked.shape[0]
    tile = tile.astype(out_blocked.dtype)
    if static(idx):
        if len(idx) == nb and (idx == np.arange(nb)).all():
            return tile
        if (idx < 0).all():
            return out_blocked
        keep = np.flatnonzero(idx >= 0)
        tgt = idx[keep]
        if len(tgt) == nb:  # every block stored: a permutation of the stored tiles
            return take(tile, keep[np.argsort(tgt)])
        return out_blocked.at[tgt].set(take(tile, keep))
    safe = jnp.where(idx < 0, nb, idx)
    return out_blocked.at[safe].set(tile, mode="drop")


# ---------------------------------------------------------------------------------------------
# compute


def _matmul(
    bufs: _Buffers,
    lhs_op: Operand,
    rhs_op: Operand,
    slot: Any,
    k_valid: Any = None,
    body: MatmulStep | None = None,
    prologue: tuple[list[jax.Array], list[str], str, bool] | None = None,
) -> jax.Array:
    """The PE step of every core: fp32 products ``[cores, 1, tm, tn]`` of its lhs and rhs tiles.

    Cores reading the same stored rhs row (it reached them over the ring) are stacked along M into
    one GEMM; cores sharing an lhs row are joined along N. Cores holding no operand (never
    loaded) compute on uninitialized scratchpad, which is NaN; their results are never stored.
    ``k_valid``: only the K block's first ``k_valid`` positions count (the last block of a K the
    block size does not divide). ``body.rhs_t``: the rhs tiles are ``[tn, tk]`` (contracted
    along their last axis, no transposed copy). ``prologue``: the body's prologue runs on each
    stored lhs row first, with (every core's tiles of its other inputs, their dtypes, the lhs's
    dtype, DL16 rounding); a row takes the tiles of the first core that reads it (the cores
    sharing an lhs block share its step's blocks of the prologue's inputs).
    """
    c = bufs.ncores
    rt = body is not None and body.rhs_t
    pl, pr = bufs.plans[lhs_op.sp], bufs.plans[rhs_op.sp]
    lhs = bufs.read_rows(lhs_op.sp, slot)  # [rl, 1, tm, tkp]
    rhs = bufs.read_rows(rhs_op.sp, slot)  # [rr, 1, tk, tn] ([rr, 1, tn, tkr] with rhs_t)
    if body is not None and body.window is not None:  # a convolution's windows, read in place
        lhs, rhs = matmul_ops.conv_patches(jnp, lhs, rhs, body.window)
    if prologue is not None:
        tiles, dts, lhs_dt, dl16 = prologue
        first = np.zeros(len(lhs), np.int64)  # each stored row's first reader (0 if none)
        for q in range(c - 1, -1, -1):
            first[pl.rows[q]] = q
        tiles = [take(x, first) for x in tiles]
        lhs = matmul_ops.run_prologue(jnp, body, lhs, tiles, dts, lhs_dt, dl16)
    tm = lhs.shape[2]
    if rt:
        k, tn = body.tk(rhs.shape), rhs.shape[2]
        rhs = rhs[..., :k]
    else:
        k, tn = rhs.shape[2], rhs.shape[3]
    if k_valid is not None:
        lhs, rhs = matmul_ops.mask_k(jnp, lhs[..., :k], rhs, k_valid, rt)
    lrows, rrows = pl.rows, pr.rows
    live = np.asarray([lrows[q] != pl.nan_row and rrows[q] != pr.nan_row for q in range(c)], bool)
    by_r: dict[int, list[int]] = {}
    by_l: dict[int, list[int]] = {}
    for q in np.flatnonzero(live):
        by_r.setdefault(int(rrows[q]), []).append(int(q))
        by_l.setdefault(int(lrows[q]), []).append(int(q))

    def dot(a: jax.Array, b: jax.Array) -> jax.Array:
        a, b = lax.optimization_barrier((a, b))  # hand XLA two materialized tiles: its GEMM
        dims = (((1,), (1 if rt else 0,)), ((), ()))
        return lax.dot_general(a, b, dims, preferred_element_type=np.float32)

    parts, order = [], []
    if by_r and len(by_r) <= len(by_l):
        for r, cores in by_r.items():
            li = lrows[np.asarray(cores)]
            a = take(lhs, li)
            a = a[:, 0, :, :k].reshape(len(cores) * tm, k)
            parts.append(dot(a, rhs[r, 0]).reshape(len(cores), 1, tm, tn))
            order += cores
    elif by_l:
        for r, cores in by_l.items():
            ri = rrows[np.asarray(cores)]
            b = take(rhs, ri)
            if rt:
                b = b[:, 0].reshape(len(cores) * tn, k)  # [n*tn, k]
            else:
                b = jnp.moveaxis(b[:, 0], 0, 1).reshape(k, len(cores) * tn)  # [k, n*tn]
            p = dot(lhs[r, 0, :, :k], b).reshape(tm, len(cores), tn)
            parts.append(jnp.moveaxis(p, 1, 0)[:, None])
            order += cores
    idle = [q for q in range(c) if not live[q]]
    if idle:
        parts.append(jnp.full((len(idle), 1, tm, tn), np.nan, np.float32))
        order += idle
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    inv = np.argsort(np.asarray(order))
    return take(out, inv)


def _out_tile(out: Operand, r: jax.Array) -> jax.Array:
    """A result ``[C, *dims]`` fit to the output block."""
    want = out.block
    if r.ndim - 1 < len(want):
        r = r.reshape((r.shape[0], *([1] * (len(want) - r.ndim + 1)), *r.shape[1:]))
    return ops.fit(jnp, r, want)


class _StepCtx:
    """What the compute of one step reads: the stage, its buffers, the tensors, the card."""

    def __init__(
        self, stage: Stage, bufs: _Buffers, env: dict[str, Any], decls: dict[str, Any], dl16: bool
    ):
        self.stage, self.bufs, self.env, self.decls, self.dl16 = stage, bufs, env, decls, dl16
        self.nslots = {b.name: b.slots for b in stage.scratch}

    def slot(self, name: str, t: Any) -> Any:
        n = self.nslots[name]
        return t % n if n > 1 else 0

    def tiles(self, t: Any, operands: Any = None) -> list[jax.Array]:
        ops_ = self.stage.inputs if operands is None else operands
        return [self.bufs.read(op.sp, self.slot(op.sp, t)) for op in ops_]

    def in_dtypes(self, operands: Any = None) -> list[str]:
        ops_ = self.stage.inputs if operands is None else operands
        return [self.decls[op.tensor].layout.dtype for op in ops_]

    def write_out(self, t: Any, r: jax.Array) -> None:
        """A result ``[C, *dims]`` into the output buffer's slot of step ``t``."""
        out = self.stage.output
        self.bufs.write(out.sp, self.slot(out.sp, t), _out_tile(out, r))


# ---------------------------------------------------------------------------------------------
# the compute of one step, per step kind. A "plain" step computes and writes its output block;
# an "acc" step accumulates and its block's last step finishes (rounds) the result; a "carry"
# step writes its block and passes a carry on.


def _map_plain(cx: _StepCtx, t: Any, store_idx: Any) -> None:
    step: MapStep = cx.stage.step
    r = ops.run_map(jnp, step.body, cx.tiles(t), cx.in_dtypes(), step.space_block, cx.bufs.ncores)
    cx.write_out(t, ops.narrow(jnp, r, step.body.out_dtype, cx.dl16))


def _gather(cx: _StepCtx, t: Any, store_idx: Any) -> None:
    """The indirect loads of one step: every core's rows of the table by its index tile."""
    stage, bufs, step = cx.stage, cx.bufs, cx.stage.step
    (idx,) = cx.tiles(t)
    idx = idx.astype(jnp.int32)  # [C, tr]
    table = cx.env[step.table]
    td = stage.output.block[-1]
    ncb = table.shape[-1] // td
    t3 = table.reshape(table.shape[0], ncb, td)
    sidx = jnp.asarray(store_idx)
    col = jnp.where(sidx < 0, 0, sidx % ncb)
    valid = (idx >= 0) & (idx < step.num_rows)
    rows = t3[jnp.clip(idx, 0, step.num_rows - 1), col[:, None]]  # [C, tr, td]
    if step.mode == "fill":
        fill = step.fill_value
        if fill is None:
            fill = jnp.nan if rows.dtype.kind == "f" else 0
        rows = jnp.where(valid[..., None], rows, jnp.asarray(fill).astype(rows.dtype))
    out = stage.output
    bufs.write(out.sp, cx.slot(out.sp, t), ops.fit(jnp, rows, out.block))


def _reshape(cx: _StepCtx, t: Any, store_idx: Any) -> None:
    step, out = cx.stage.step, cx.stage.output
    (x,) = cx.tiles(t)
    x = x[..., : step.l_in].reshape(cx.bufs.ncores, *out.block[:-1], step.l_out)
    cx.bufs.write(out.sp, cx.slot(out.sp, t), ops.fit(jnp, x, out.block))


def _concat(cx: _StepCtx, t: Any, store_idx: Any) -> None:
    step, out = cx.stage.step, cx.stage.output
    k = None
    if step.tile:
        sidx = jnp.maximum(jnp.asarray(store_idx), 0)
        inner = math.prod(step.out_grid[step.axis + 1 :])
        k = (sidx // inner) % step.out_grid[step.axis]
    x = ops.run_concat(jnp, step, cx.tiles(t), k)
    dt = np_dtype(cx.decls[out.tensor].layout.dtype)
    cx.bufs.write(out.sp, cx.slot(out.sp, t), ops.fit(jnp, x.astype(dt), out.block))


def _sort(cx: _StepCtx, t: Any, store_idx: Any) -> None:
    """Every core's rows of keys sorted; their first ``k`` indices stored."""
    step: SortStep = cx.stage.step
    # only the cores the stage uses sort (an idle core's tile is never stored): a row of a
    # vocabulary sorts on one core, and 31 copies of it would cost the host 31 sorts more
    used = _cores_used(cx.stage)
    keys = [x[:used, ..., : step.n] for x in cx.tiles(t)]
    perm = sorting.argsort_rows(jnp, keys, step.order, step.descending, step.k)
    if used < cx.bufs.ncores:
        perm = jnp.pad(perm, [(0, cx.bufs.ncores - used)] + [(0, 0)] * (perm.ndim - 1))
    cx.write_out(t, perm)


def _cores_used(stage: Stage) -> int:
    """How many cores (the first ones) store a block at some step of ``stage``."""
    return max((c + 1 for row in stage.stores for c, s in enumerate(row) if s >= 0), default=1)


def _take(cx: _StepCtx, t: Any, store_idx: Any) -> None:
    """Every core's rows read at its block of indices."""
    step: TakeStep = cx.stage.step
    x, idx = cx.tiles(t)
    m = cx.decls[cx.stage.inputs[1].tensor].layout.shape[-1]
    r = sorting.take_rows(jnp, x[..., : step.n], idx[..., :m], step.n, step.mode, step.fill_value)
    cx.write_out(t, r)


def _matmul_acc(cx: _StepCtx, t: Any, first: Any, kpos: Any) -> None:
    """One K block's products of every core, added into the accumulator."""
    stage, bufs, step = cx.stage, cx.bufs, cx.stage.step
    lhs_op, rhs_op, _, pro_ops = step.split_inputs(stage.inputs)
    tk = step.tk(rhs_op.block)
    k_valid = step.k_logical - kpos * tk if step.k_logical % tk else None
    pro = None
    if step.prologue is not None:  # each core's tiles of the prologue's other inputs
        pro = (
            cx.tiles(t, pro_ops),
            cx.in_dtypes(pro_ops),
            cx.decls[lhs_op.tensor].layout.dtype,
            cx.dl16,
        )
    prod = _matmul(bufs, lhs_op, rhs_op, cx.slot(lhs_op.sp, t), k_valid, step, pro)
    if first is True:
        acc = prod
    else:
        acc = bufs.read("acc", 0)
        acc = acc + prod if first is False else jnp.where(first, prod, acc + prod)
    bufs.write("acc", 0, acc)


def _matmul_finish(cx: _StepCtx, t: Any, stores: Any) -> jax.Array:
    """The accumulator rounded, its masked N tail zeroed, through the epilogue."""
    stage, bufs, step = cx.stage, cx.bufs, cx.stage.step
    out = stage.output
    r = ops.narrow(jnp, bufs.read("acc", 0), step.out_dtype, cx.dl16)
    if step.n_logical:
        ncol = blocks_of(cx.decls[out.tensor].layout.device_shape, out.block)[-1]
        col0 = (jnp.maximum(jnp.asarray(stores), 0) % ncol) * out.block[-1]
        r = matmul_ops.mask_n(jnp, r, col0, step.n_logical)
    r = ops.fit(jnp, r, out.block)
    if step.epilogue is not None:
        extras = step.split_inputs(stage.inputs)[2]
        r = matmul_ops.run_epilogue(
            jnp,
            step,
            r,
            cx.tiles(t, extras),
            cx.in_dtypes(extras),
            out.block,
            step.epilogue.space,
            cx.dl16,
        )
    return r


def _map_part(cx: _StepCtx, t: Any, kpos: Any) -> jax.Array:
    """This block's part of a split reduction (every core's)."""
    step: MapStep = cx.stage.step
    split = step.split
    coord = kpos if not split.reverse else split.nk - 1 - kpos
    return ops.run_map(
        jnp,
        step.body,
        cx.tiles(t),
        cx.in_dtypes(),
        step.space_block,
        cx.bufs.ncores,
        split=split,
        coord=coord,
    )


def _map_acc(cx: _StepCtx, t: Any, first: Any, kpos: Any) -> None:
    """This block's partial reduction combined into the accumulators."""
    bufs, body = cx.bufs, cx.stage.step.body
    part = _map_part(cx, t, kpos)
    if body.reduction.index_of:
        acc = None if first is True else (bufs.read("acc", 0), bufs.read("acci", 0))
        v, i = ops.combine_partial(jnp, body.reduce, acc, part, first)
        bufs.write("acc", 0, v)
        bufs.write("acci", 0, i)
    else:
        acc = None if first is True else bufs.read("acc", 0)
        bufs.write("acc", 0, ops.combine_partial(jnp, body.reduce, acc, part, first))


def _map_finish(cx: _StepCtx, t: Any, stores: Any) -> jax.Array:
    body = cx.stage.step.body
    r = cx.bufs.read("acci" if body.reduction.index_of else "acc", 0)
    return _out_tile(cx.stage.output, ops.narrow(jnp, r, body.out_dtype, cx.dl16))


def _map_carry(cx: _StepCtx, t: Any, first: Any, kpos: Any) -> None:
    """One step of a split scan (cumsum...): the block's running results and the carry."""
    bufs, body = cx.bufs, cx.stage.step.body
    local = _map_part(cx, t, kpos)
    carry = None if first is True else bufs.read("acc", 0)
    out, carry = ops.scan_carry(jnp, body.reduce, local, carry, first, cx.stage.step.split)
    bufs.write("acc", 0, carry)
    cx.write_out(t, ops.narrow(jnp, out, body.out_dtype, cx.dl16))


#: per step kind, what a step of each mode runs: "plain" (ctx, t, stores), "acc" (accumulate
#: (ctx, t, first, kpos), finish (ctx, t, stores) -> the output block), "carry" (ctx, t, first,
#: kpos)
_PLAIN = {
    MapStep: _map_plain,
    GatherStep: _gather,
    ReshapeStep: _reshape,
    ConcatStep: _concat,
    SortStep: _sort,
    TakeStep: _take,
}
_ACC = {MatmulStep: (_matmul_acc, _matmul_finish), MapStep: (_map_acc, _map_finish)}
_CARRY = {MapStep: _map_carry}


def _kpos(first: np.ndarray) -> np.ndarray:
    """Per step, its position in the run of steps that accumulate one output block (0 on a
    ``first`` step)."""
    k = np.zeros(len(first), np.int32)
    for t in range(1, len(first)):
        k[t] = 0 if first[t] else k[t - 1] + 1
    return k


def _tables(stage: Stage) -> dict[str, np.ndarray]:
    n_in = len(stage.inputs)
    c = len(stage.stores[0])
    loads = np.asarray(stage.loads, np.int32).reshape(stage.steps, n_in, c)
    ring = np.asarray(stage.ring, np.int32).reshape(stage.steps, n_in, c)
    first = np.asarray(stage.first, bool)
    return {
        "loads": loads,
        "ring": ring,
        "stores": np.asarray(stage.stores, np.int32),
        "first": first,
        "last": np.asarray(stage.last, bool),
        "kpos": _kpos(first),
    }


def run_stage(
    stage: Stage, env: dict[str, Any], decls: dict[str, Any], ncores: int, dl16: bool = False
) -> Any:
    """Execute one stage on the vectorized card; returns the output tensor's device array.

    Double buffering: step t+1's loads go into the other slot before step t computes. An input
    buffer with one slot in a stage of several steps is loaded after step t's compute instead
    (single buffering: no overlap, the loads wait for the compute).
    """
    tab = _tables(stage)
    plans = {
        op.sp: _plan_input(tab["loads"][:, i], tab["ring"][:, i], ncores)
        for i, op in enumerate(stage.inputs)
    }
    mode = stage.step.combine
    kind = type(stage.step)
    # an accumulating stage's output block goes from the accumulator straight to its store
    skip = frozenset({stage.output.sp}) if mode == "acc" else frozenset()
    bufs = _Buffers(stage, ncores, plans, skip)
    sources = [
        Source(env[op.tensor], op, _outside(op, decls[op.tensor].layout.dtype))
        for op in stage.inputs
    ]
    out = stage.output
    out_layout = decls[out.tensor].layout
    nb_out = math.prod(blocks_of(out_layout.device_shape, out.block))
    out_blocked = jnp.zeros((nb_out, *out.block), np_dtype(out_layout.dtype))
    T = stage.steps
    nslots = [stage.sp(op.sp).slots for op in stage.inputs]
    late = [nslots[i] == 1 and T > 1 for i in range(len(stage.inputs))]
    early_ops = [i for i in range(len(stage.inputs)) if not late[i]]
    late_ops = [i for i in range(len(stage.inputs)) if late[i]]
    cx = _StepCtx(stage, bufs, env, decls, dl16)

    def load_step(t: Any, loads: Any, ring: Any, which: list[int]) -> None:
        for i in which:
            op = stage.inputs[i]
            _load(bufs, op, sources[i], loads[i], ring[i], cx.slot(op.sp, t))

    def store(t: Any, stores: Any, ob: jax.Array) -> jax.Array:
        return _store(ob, bufs.read(out.sp, cx.slot(out.sp, t)), stores)

    def step(t: Any, stores: Any, first: Any, ob: jax.Array, last: Any, kpos: Any) -> jax.Array:
        if mode == "plain":
            _PLAIN[kind](cx, t, stores)
            return store(t, stores, ob)
        if mode == "carry":
            _CARRY[kind](cx, t, first, kpos)
            return store(t, stores, ob)
        accumulate, finish = _ACC[kind]
        accumulate(cx, t, first, kpos)
        if last is True:
            return _store(ob, finish(cx, t, stores), stores)
        if last is False:
            return ob
        # an accumulation inside a scan: round and store on the last step only
        return lax.cond(last, lambda ob: _store(ob, finish(cx, t, stores), stores), lambda o: o, ob)

    all_ops = list(range(len(stage.inputs)))
    if T <= UNROLL_STEPS:
        load_step(0, tab["loads"][0], tab["ring"][0], all_ops)
        for t in range(T):
            if t + 1 < T:
                load_step(t + 1, tab["loads"][t + 1], tab["ring"][t + 1], early_ops)
            out_blocked = step(
                t,
                tab["stores"][t],
                bool(tab["first"][t]),
                out_blocked,
                bool(tab["last"][t]),
                int(tab["kpos"][t]),
            )
            if t + 1 < T:
                load_step(t + 1, tab["loads"][t + 1], tab["ring"][t + 1], late_ops)
    else:
        load_step(0, tab["loads"][0], tab["ring"][0], all_ops)
        nxt_loads = np.concatenate([tab["loads"][1:], -np.ones_like(tab["loads"][:1])])
        nxt_ring = np.concatenate([tab["ring"][1:], -np.ones_like(tab["ring"][:1])])
        lazy = [plans[op.sp].lazy for op in stage.inputs]
        first_all = tab["first"].all()
        first_none = not tab["first"].any()
        last_all = bool(tab["last"].all())
        kpos_zero = not tab["kpos"].any()
        xs = (
            jnp.arange(T, dtype=jnp.int32),
            jnp.asarray(nxt_loads),
            jnp.asarray(nxt_ring),
            jnp.asarray(tab["stores"]),
            jnp.asarray(tab["first"]),
            jnp.asarray(tab["last"]),
            jnp.asarray(tab["kpos"]),
        )

        def body(carry: tuple[dict[str, jax.Array], jax.Array], x: Any) -> tuple[Any, None]:
            bufs.data, ob = dict(carry[0]), carry[1]
            t, nl, nr, st, fi, la, kp = x
            # a lazily forwarded operand's ring table is the same every step: keep it static
            rings = [tab["ring"][0, i] if lazy[i] else nr[i] for i in range(len(stage.inputs))]
            load_step(t + 1, nl, rings, early_ops)
            fi = True if first_all else (False if first_none else fi)
            ob = step(t, st, fi, ob, True if last_all else la, 0 if kpos_zero else kp)
            load_step(t + 1, nl, rings, late_ops)
            return (dict(bufs.flush()), ob), None

        (data, out_blocked), _ = lax.scan(body, (dict(bufs.flush()), out_blocked), xs)
        bufs.data = dict(data)
    return from_blocks(jnp, out_blocked, out_layout.device_shape, out.block)


def run_kernel(kernel: Kernel, args: list[Any]) -> list[Any]:
    """Trace-time interpreter over a kernel's stages (call it under ``jax.jit``)."""
    decls = {t.name: t for t in kernel.tensors}
    env: dict[str, Any] = dict(zip(kernel.inputs, args, strict=True))

    resolve_aliases(kernel, env)
    for st in kernel.stages:
        env[st.output.tensor] = run_stage(st, env, decls, kernel.num_cores, kernel.dl16)
        resolve_aliases(kernel, env)
    for o in kernel.outputs:
        if o not in env:  # a tensor without elements: no stage writes it
            lay = decls[o].layout
            env[o] = jnp.zeros(lay.device_shape, np_dtype(lay.dtype))
    return [env[o] for o in kernel.outputs]
