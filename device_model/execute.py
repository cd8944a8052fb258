"""The card as one vectorized JAX program: every stage of a kernel over all its cores at once.

``build_runner(kernel)`` turns a :class:`~device_model.kernel.Kernel` into one ``jax.jit``-ed
function from the kernel's input device buffers to its output device buffers.

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
cores or tiles at run time. The semantics of every compute body are ``device_model.ops``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import ops
from .kernel import Kernel, Operand, SpBuf, Stage, blocks_of, resolve_aliases
from .layout import np_dtype

__all__ = ["build_runner", "run_kernel", "run_stage", "to_blocks", "from_blocks", "UNROLL_STEPS"]

#: stages with at most this many steps are unrolled; longer ones run as a lax.scan
UNROLL_STEPS = 4

#: XLA options for the card program. LLVM's backend optimization level 1 instead of the default
#: 2 cuts cold compile of a transformer block by ~40% with no measurable loss of run speed (the
#: heavy work is GEMMs, done by XLA's runtime library either way); see ``bench sim``.
COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 1}


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
    """Inverse of :func:`to_blocks`."""
    nb = blocks_of(device_shape, block)
    if all(n == 1 for n in nb):
        return blocks[0]
    r = len(device_shape)
    x = blocks.reshape((*nb, *block))
    perm = []
    for i in range(r):
        perm += [i, r + i]
    moved = [p for p in perm if x.shape[p] != 1]
    if moved != sorted(moved):
        x = xp.transpose(x, perm)
    return x.reshape(device_shape)


def uninit_value(dtype: str) -> Any:
    """What an all-ones-bytes (never written) scratchpad word reads as in ``dtype``."""
    if dtype == "bool":
        return True
    if dtype == "int32":
        return -1
    return np.nan


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
    """The scratchpad buffers of one stage on all cores (see the module docstring)."""

    def __init__(self, stage: Stage, ncores: int, plans: dict[str, _BufPlan]):
        self.ncores = ncores
        self.plans = plans
        self.data: dict[str, jax.Array] = {}
        for b in stage.scratch:
            p = plans.get(b.name)
            nrows = p.nrows if p is not None else ncores
            self.data[b.name] = _fresh(b, nrows)

    def rows(self, name: str) -> np.ndarray | None:
        p = self.plans.get(name)
        if p is None or (p.rows == np.arange(self.ncores)).all():
            return None
        return p.rows

    def read(self, name: str, slot: Any) -> jax.Array:
        """Every core's view of one slot: ``[cores, *block]``."""
        x = _slot(self.data[name], slot)
        r = self.rows(name)
        return x if r is None else _take(x, r)

    def read_rows(self, name: str, slot: Any) -> jax.Array:
        """The stored rows of one slot (one per loading core): ``[rows, *block]``."""
        return _slot(self.data[name], slot)

    def write_rows(self, name: str, slot: Any, tile: jax.Array) -> None:
        """Write the first ``len(tile)`` stored rows of one slot."""
        arr = self.data[name]
        self.data[name] = _update(arr, slot, tile.astype(arr.dtype))

    def write(self, name: str, slot: Any, tile: jax.Array) -> None:
        """Write all stored rows of one slot."""
        arr = self.data[name]
        if arr.shape[1] == 1 and tile.shape[0] == arr.shape[0]:
            self.data[name] = tile.astype(arr.dtype)[:, None]
            return
        self.data[name] = _update(arr, slot, tile.astype(arr.dtype))


def _update(arr: jax.Array, slot: Any, tile: jax.Array) -> jax.Array:
    """``arr[:len(tile), slot] = tile`` as one dynamic-update-slice (never a scatter)."""
    z = np.int32(0)
    s = np.int32(slot) if isinstance(slot, int | np.integer) else slot.astype(np.int32)
    return lax.dynamic_update_slice(arr, tile[:, None], (z, s) + (z,) * (arr.ndim - 2))


def _fresh(b: SpBuf, rows: int) -> jax.Array:
    return jnp.full((rows, b.slots, *b.block), uninit_value(b.dtype), np_dtype(b.dtype))


def _slot(arr: jax.Array, slot: Any) -> jax.Array:
    if arr.shape[1] == 1:
        return arr[:, 0]
    if isinstance(slot, int | np.integer):
        return arr[:, int(slot)]
    return lax.dynamic_index_in_dim(arr, slot, axis=1, keepdims=False)


def _static(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _take(x: jax.Array, idx: np.ndarray) -> jax.Array:
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


def _take_blocks(blocked: jax.Array, idx: Any) -> jax.Array:
    """Blocks ``idx`` (one per row; -1 entries are fetched clamped and masked by the caller)."""
    nb = blocked.shape[0]
    if _static(idx):
        return _take(blocked, np.clip(idx, 0, nb - 1))
    return blocked[jnp.clip(idx, 0, nb - 1)]


def _load(bufs: _Buffers, op: Operand, blocked: jax.Array, idx: Any, ring: Any, slot: Any) -> None:
    """Load-unit step for one operand: device blocks -> scratchpad, then ring forwarding."""
    p = bufs.plans[op.sp]
    if p.lazy:
        idx = idx[p.loaders]
        if _static(idx) and (idx < 0).all():
            return
        new = _take_blocks(blocked, idx)
        if not (_static(idx) and (idx >= 0).all()):
            old = bufs.read_rows(op.sp, slot)[: len(p.loaders)]
            new = jnp.where(_bmask(idx >= 0, new), new, old)
        bufs.write_rows(op.sp, slot, new)  # the never-written row (if any) keeps its bytes
        return
    # materialized: every core has its own copy
    if _static(idx) and (idx < 0).all() and _static(ring) and (ring < 0).all():
        return
    new = _take_blocks(blocked, idx)
    if not (_static(idx) and (idx >= 0).all()):
        new = jnp.where(_bmask(idx >= 0, new), new, bufs.read_rows(op.sp, slot))
    if not (_static(ring) and (ring < 0).all()):
        src = np.clip(ring, 0, None) if _static(ring) else jnp.clip(ring, 0, None)
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
    if _static(idx):
        if len(idx) == nb and (idx == np.arange(nb)).all():
            return tile
        if (idx < 0).all():
            return out_blocked
        keep = np.flatnonzero(idx >= 0)
        tgt = idx[keep]
        if len(tgt) == nb:  # every block stored: a permutation of the stored tiles
            return _take(tile, keep[np.argsort(tgt)])
        return out_blocked.at[tgt].set(_take(tile, keep))
    safe = jnp.where(idx < 0, nb, idx)
    return out_blocked.at[safe].set(tile, mode="drop")


# ---------------------------------------------------------------------------------------------
# compute


def _matmul(bufs: _Buffers, lhs_op: Operand, rhs_op: Operand, slot: Any) -> jax.Array:
    """The PE step of every core: fp32 products ``[cores, 1, tm, tn]`` of its lhs and rhs tiles.

    Cores reading the same stored rhs row (it reached them over the ring) are stacked along M into
    one GEMM; cores sharing an lhs row are joined along N. Cores holding no operand (never
    loaded) compute on uninitialized scratchpad, which is NaN; their results are never stored.
    """
    c = bufs.ncores
    pl, pr = bufs.plans[lhs_op.sp], bufs.plans[rhs_op.sp]
    lhs = bufs.read_rows(lhs_op.sp, slot)  # [rl, 1, tm, tkp]
    rhs = bufs.read_rows(rhs_op.sp, slot)  # [rr, 1, tk, tn]
    tm, k, tn = lhs.shape[2], rhs.shape[2], rhs.shape[3]
    lrows, rrows = pl.rows, pr.rows
    live = np.asarray([lrows[q] != pl.nan_row and rrows[q] != pr.nan_row for q in range(c)], bool)
    by_r: dict[int, list[int]] = {}
    by_l: dict[int, list[int]] = {}
    for q in np.flatnonzero(live):
        by_r.setdefault(int(rrows[q]), []).append(int(q))
        by_l.setdefault(int(lrows[q]), []).append(int(q))

    def dot(a: jax.Array, b: jax.Array) -> jax.Array:
        a, b = lax.optimization_barrier((a, b))  # hand XLA two materialized tiles: its GEMM
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=np.float32)

    parts, order = [], []
    if by_r and len(by_r) <= len(by_l):
        for r, cores in by_r.items():
            li = lrows[np.asarray(cores)]
            a = _take(lhs, li)
            a = a[:, 0, :, :k].reshape(len(cores) * tm, k)
            parts.append(dot(a, rhs[r, 0]).reshape(len(cores), 1, tm, tn))
            order += cores
    elif by_l:
        for r, cores in by_l.items():
            ri = rrows[np.asarray(cores)]
            b = _take(rhs, ri)
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
    return _take(out, inv)


def _compute(
    stage: Stage,
    bufs: _Buffers,
    slot: Any,
    oslot: Any,
    first: Any,
    env: dict[str, Any],
    decls: dict[str, Any],
    store_idx: Any,
    dl16: bool = False,
    last: Any = True,
) -> None:
    """The PEs/SFUs (and, for gathers, the indirect loads) of one step, scratchpad to scratchpad."""
    unit, kind, params = stage.body[0]
    out = stage.output
    out_layout = decls[out.tensor].layout
    c = bufs.ncores
    if stage.kind == "map":
        body, space_block = params
        tiles = [bufs.read(op.sp, slot) for op in stage.inputs]
        dts = [decls[op.tensor].layout.dtype for op in stage.inputs]
        r = ops.run_map(jnp, body, tiles, dts, space_block, c)
        r = ops.narrow(jnp, r, body.out_dtype, dl16)
        want = out.block
        if r.ndim - 1 < len(want):
            r = r.reshape((r.shape[0], *([1] * (len(want) - r.ndim + 1)), *r.shape[1:]))
        bufs.write(out.sp, oslot, ops.fit(jnp, r, want))
    elif stage.kind == "matmul":
        body = params
        prod = _matmul(bufs, stage.inputs[0], stage.inputs[1], slot)
        if first is True:
            acc = prod
        else:
            acc = bufs.read("acc", 0)
            acc = acc + prod if first is False else jnp.where(first, prod, acc + prod)
        bufs.write("acc", 0, acc)
        if last is False:  # the output tile is written (and stored) after the last K step only
            return
        r = ops.narrow(jnp, acc, body.out_dtype, dl16)
        bufs.write(out.sp, oslot, ops.fit(jnp, r, out.block))
    elif stage.kind == "gather":
        body = params
        idx = bufs.read(stage.inputs[0].sp, slot).astype(jnp.int32)  # [C, tr]
        table = env[body.table]
        td = out.block[-1]
        ncb = table.shape[-1] // td
        t3 = table.reshape(table.shape[0], ncb, td)
        sidx = jnp.asarray(store_idx)
        col = jnp.where(sidx < 0, 0, sidx % ncb)
        valid = (idx >= 0) & (idx < body.num_rows)
        rows = t3[jnp.clip(idx, 0, body.num_rows - 1), col[:, None]]  # [C, tr, td]
        if body.mode == "fill":
            fill = getattr(body, "fill_value", None)
            if fill is None:
                fill = jnp.nan if rows.dtype.kind == "f" else 0
            rows = jnp.where(valid[..., None], rows, jnp.asarray(fill).astype(rows.dtype))
        bufs.write(out.sp, oslot, ops.fit(jnp, rows, out.block))
    elif stage.kind == "reshape":
        body = params
        x = bufs.read(stage.inputs[0].sp, slot)
        r_out = out.block[0]
        x = x[:, :, : body.l_in].reshape(c, r_out, body.l_out)
        bufs.write(out.sp, oslot, ops.fit(jnp, x, out.block))
    elif stage.kind == "concat":
        body = params
        parts = []
        for op, n in zip(stage.inputs, body.sizes, strict=True):
            x = bufs.read(op.sp, slot)
            sl = [slice(None)] * x.ndim
            sl[1 + body.axis] = slice(0, n)
            parts.append(x[tuple(sl)])
        x = jnp.concatenate(parts, axis=1 + body.axis)
        bufs.write(out.sp, oslot, ops.fit(jnp, x.astype(np_dtype(out_layout.dtype)), out.block))
    else:  # pragma: no cover - the checker rejects unknown kinds
        raise ValueError(f"unknown stage kind {stage.kind}")


def _tables(stage: Stage) -> dict[str, np.ndarray]:
    n_in = len(stage.inputs)
    c = len(stage.stores[0])
    loads = np.asarray(stage.loads, np.int32).reshape(stage.steps, n_in, c)
    ring = np.asarray(stage.ring, np.int32).reshape(stage.steps, n_in, c)
    return {
        "loads": loads,
        "ring": ring,
        "stores": np.asarray(stage.stores, np.int32),
        "first": np.asarray(stage.first, bool),
        "last": np.asarray(stage.last, bool),
    }


def run_stage(
    stage: Stage, env: dict[str, Any], decls: dict[str, Any], ncores: int, dl16: bool = False
) -> Any:
    """Execute one stage on the vectorized card; returns the output tensor's device array."""
    tab = _tables(stage)
    plans = {
        op.sp: _plan_input(tab["loads"][:, i], tab["ring"][:, i], ncores)
        for i, op in enumerate(stage.inputs)
    }
    bufs = _Buffers(stage, ncores, plans)
    blocked = [to_blocks(jnp, env[op.tensor], op.block) for op in stage.inputs]
    out = stage.output
    out_layout = decls[out.tensor].layout
    nb_out = math.prod(blocks_of(out_layout.device_shape, out.block))
    out_blocked = jnp.zeros((nb_out, *out.block), np_dtype(out_layout.dtype))
    T = stage.steps
    nslots = [stage.sp(op.sp).slots for op in stage.inputs]
    oslots = stage.sp(out.sp).slots

    def load_step(t: Any, loads: Any, ring: Any) -> None:
        for i, op in enumerate(stage.inputs):
            _load(bufs, op, blocked[i], loads[i], ring[i], t % nslots[i] if nslots[i] > 1 else 0)

    def step(t: Any, stores: Any, first: Any, ob: jax.Array, last: Any = True) -> jax.Array:
        oslot = t % oslots if oslots > 1 else 0
        slot = t % nslots[0] if stage.inputs and nslots[0] > 1 else 0
        if stage.kind != "matmul" or last is True:
            _compute(stage, bufs, slot, oslot, first, env, decls, stores, dl16)
            return _store(ob, bufs.read(out.sp, oslot), stores)
        if last is False:
            _compute(stage, bufs, slot, oslot, first, env, decls, stores, dl16, last=False)
            return ob
        # a K loop inside a scan: accumulate every step; round, write and store on the last
        _compute(stage, bufs, slot, oslot, first, env, decls, stores, dl16, last=False)
        acc = bufs.read("acc", 0)
        mm = stage.body[0][2]

        def finish(operands: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            out_data, ob = operands
            bufs.data[out.sp] = out_data
            r = ops.fit(jnp, ops.narrow(jnp, acc, mm.out_dtype, dl16), out.block)
            bufs.write(out.sp, oslot, r)
            return bufs.data[out.sp], _store(ob, bufs.read(out.sp, oslot), stores)

        out_data, ob = lax.cond(last, finish, lambda o: o, (bufs.data[out.sp], ob))
        bufs.data[out.sp] = out_data
        return ob

    if T <= UNROLL_STEPS:
        load_step(0, tab["loads"][0], tab["ring"][0])
        for t in range(T):
            if t + 1 < T:
                load_step(t + 1, tab["loads"][t + 1], tab["ring"][t + 1])
            out_blocked = step(
                t, tab["stores"][t], bool(tab["first"][t]), out_blocked, bool(tab["last"][t])
            )
    else:
        load_step(0, tab["loads"][0], tab["ring"][0])
        nxt_loads = np.concatenate([tab["loads"][1:], -np.ones_like(tab["loads"][:1])])
        nxt_ring = np.concatenate([tab["ring"][1:], -np.ones_like(tab["ring"][:1])])
        lazy = [plans[op.sp].lazy for op in stage.inputs]
        first_all = tab["first"].all()
        first_none = not tab["first"].any()
        xs = (
            jnp.arange(T, dtype=jnp.int32),
            jnp.asarray(nxt_loads),
            jnp.asarray(nxt_ring),
            jnp.asarray(tab["stores"]),
            jnp.asarray(tab["first"]),
            jnp.asarray(tab["last"]),
        )
        last_all = bool(tab["last"].all())

        def body(carry: tuple[dict[str, jax.Array], jax.Array], x: Any) -> tuple[Any, None]:
            bufs.data, ob = dict(carry[0]), carry[1]
            t, nl, nr, st, fi, la = x
            # a lazily forwarded operand's ring table is the same every step: keep it static
            rings = [tab["ring"][0, i] if lazy[i] else nr[i] for i in range(len(stage.inputs))]
            load_step(t + 1, nl, rings)
            fi = True if first_all else (False if first_none else fi)
            ob = step(t, st, fi, ob, True if last_all else la)
            return (dict(bufs.data), ob), None

        (data, out_blocked), _ = lax.scan(body, (dict(bufs.data), out_blocked), xs)
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
    return [env[o] for o in kernel.outputs]


def build_runner(kernel: Kernel) -> Callable[..., list[jax.Array]]:
    """One jitted program for the whole kernel: ``runner(*input_buffers) -> output_buffers``."""

    def program(*args: jax.Array) -> list[jax.Array]:
        return run_kernel(kernel, list(args))

    return jax.jit(program, compiler_options=COMPILER_OPTIONS)
