"""The card as one vectorized JAX program: every stage of a kernel over all 32 cores at once.

``build_runner(kernel)`` turns a :class:`~device_model.kernel.Kernel` into one ``jax.jit``-ed
function from the kernel's input device buffers to its output device buffers. Inside, each stage
keeps a real scratchpad: a ``[cores, planned bytes]`` uint8 array that starts as all-ones bytes
(NaN for every float type: uninitialized scratchpad reads as NaN), receives whole stick blocks from
device memory by the load table, forwards blocks core to core by the ring table, is read (bitcast
to the tile's dtype) by the compute units, and is the source of every store. Cores are an array
axis; steps are unrolled when few and a ``lax.scan`` otherwise, so no Python loop runs over cores
or tiles at run time. The semantics of the compute are ``device_model.ops``, shared with the
NumPy reference evaluator (``device_model.reference``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import ops
from .kernel import Kernel, Operand, Stage, blocks_of
from .layout import DTYPES, np_dtype

__all__ = ["build_runner", "to_blocks", "from_blocks", "UNROLL_STEPS"]

#: stages with at most this many steps are unrolled; longer ones run as a lax.scan
UNROLL_STEPS = 4


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
    x = xp.transpose(x, [2 * i for i in range(r)] + [2 * i + 1 for i in range(r)])
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
    x = xp.transpose(x, perm)
    return x.reshape(device_shape)


def _to_bytes(tile: jax.Array) -> jax.Array:
    c = tile.shape[0]
    if tile.dtype == jnp.bool_:
        return tile.astype(jnp.uint8).reshape(c, -1)
    return lax.bitcast_convert_type(tile, jnp.uint8).reshape(c, -1)


def _from_bytes(b: jax.Array, block: tuple[int, ...], dtype: str) -> jax.Array:
    c = b.shape[0]
    if dtype == "bool":
        return (b != 0).reshape((c, *block))
    isz = DTYPES[dtype]
    return lax.bitcast_convert_type(b.reshape(c, -1, isz), np_dtype(dtype)).reshape((c, *block))


class _Scratchpad:
    """Reads and writes of named buffers in the ``[cores, bytes]`` scratchpad array."""

    def __init__(self, stage: Stage, ncores: int):
        self.stage = stage
        self.arr = jnp.full((ncores, max(stage.sp_peak_bytes, 128)), 0xFF, jnp.uint8)

    def _span(self, name: str, slot: Any) -> tuple[Any, int]:
        b = self.stage.sp(name)
        n = math.prod(b.block) * DTYPES[b.dtype]
        if isinstance(slot, int | np.integer):
            return b.offset + int(slot) * b.slot_bytes, n
        return b.offset + slot * b.slot_bytes, n

    def read_bytes(self, name: str, slot: Any) -> jax.Array:
        off, n = self._span(name, slot)
        if isinstance(off, int):
            return self.arr[:, off : off + n]
        return lax.dynamic_slice_in_dim(self.arr, off, n, axis=1)

    def write_bytes(self, name: str, slot: Any, data: jax.Array) -> None:
        off, n = self._span(name, slot)
        if isinstance(off, int):
            self.arr = self.arr.at[:, off : off + n].set(data)
        else:
            self.arr = lax.dynamic_update_slice_in_dim(self.arr, data, off, axis=1)

    def read(self, name: str, slot: Any) -> jax.Array:
        b = self.stage.sp(name)
        return _from_bytes(self.read_bytes(name, slot), b.block, b.dtype)

    def write(self, name: str, slot: Any, tile: jax.Array) -> None:
        self.write_bytes(name, slot, _to_bytes(tile))


def _static(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _gather_blocks(blocked: jax.Array, idx: Any) -> jax.Array:
    if _static(idx):
        nb = blocked.shape[0]
        safe = np.clip(idx, 0, nb - 1)
        if nb == len(safe) and (safe == np.arange(nb)).all():
            return blocked
        if (safe == safe[0]).all():
            return jnp.broadcast_to(blocked[int(safe[0])], (len(safe), *blocked.shape[1:]))
        return blocked[safe]
    return blocked[jnp.clip(idx, 0, blocked.shape[0] - 1)]


def _load(sp: _Scratchpad, op: Operand, blocked: jax.Array, idx: Any, ring: Any, slot: Any) -> None:
    """Load-unit step for one operand: device blocks -> scratchpad, then ring forwarding."""
    if _static(idx) and (idx < 0).all() and (ring < 0).all():
        return
    tiles = _gather_blocks(blocked, idx)
    data = _to_bytes(tiles)
    if _static(idx) and (idx >= 0).all():
        sp.write_bytes(op.sp, slot, data)
    else:
        cur = sp.read_bytes(op.sp, slot)
        data = jnp.where(jnp.asarray(idx >= 0)[:, None], data, cur)
        sp.write_bytes(op.sp, slot, data)
    if _static(ring) and (ring < 0).all():
        return
    region = sp.read_bytes(op.sp, slot)
    src = np.clip(ring, 0, None) if _static(ring) else jnp.clip(ring, 0, None)
    recv = region[src]
    region = jnp.where(jnp.asarray(ring >= 0)[:, None], recv, region)
    sp.write_bytes(op.sp, slot, region)


def _store(out_blocked: jax.Array, tile: jax.Array, idx: Any) -> jax.Array:
    nb = out_blocked.shape[0]
    if _static(idx):
        if len(idx) == nb and (idx == np.arange(nb)).all():
            return tile.astype(out_blocked.dtype)
        if (idx < 0).all():
            return out_blocked
        safe = np.where(idx < 0, nb, idx)
    else:
        safe = jnp.where(idx < 0, nb, idx)
    return out_blocked.at[safe].set(tile.astype(out_blocked.dtype), mode="drop")


def _space_block(stage: Stage) -> tuple[int, ...]:
    return stage.body[0][2][1]


def _grouped_matmul(lhs: jax.Array, rhs: jax.Array, ring: np.ndarray, loads: np.ndarray) -> Any:
    """The PE step of all cores, as one GEMM per group of cores that hold the same rhs block.

    Cores that received their rhs block over the ring from the same source hold byte-identical
    copies of it (the ring table says so), so their products are computed against the source's
    scratchpad copy, stacked along M. Same result as per-core products, far fewer XLA dots.
    """
    from jax import lax

    c = lhs.shape[0]
    k = rhs.shape[2]
    owner = np.where(ring >= 0, ring, np.arange(c))
    groups: dict[int, list[int]] = {}
    for core in range(c):
        if loads[core] >= 0 or ring[core] >= 0:
            groups.setdefault(int(owner[core]), []).append(core)
    tm = lhs.shape[2]
    parts, order = [], []
    for o, cores in groups.items():
        a = lhs[np.asarray(cores), 0, :, :k].reshape(len(cores) * tm, k)
        a, b = lax.optimization_barrier((a, rhs[o, 0]))
        p = lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=np.float32)
        parts.append(p.reshape(len(cores), 1, tm, -1))
        order += cores
    idle = [core for core in range(c) if core not in set(order)]
    if idle:
        parts.append(jnp.zeros((len(idle), 1, tm, rhs.shape[3]), jnp.float32))
        order += idle
    out = jnp.concatenate(parts, axis=0)
    inv = np.argsort(np.asarray(order))
    return out if (inv == np.arange(c)).all() else out[inv]


def _compute(
    stage: Stage,
    sp: _Scratchpad,
    slot: Any,
    t_first: Any,
    decls: dict[str, Any],
    env: dict[str, Any],
    store_idx: Any,
    ring_rows: Any = None,
    loads_rows: Any = None,
) -> None:
    """The PEs/SFUs (and, for gathers, the indirect loads) of one step, scratchpad to scratchpad."""
    unit, kind, params = stage.body[0]
    out = stage.output
    out_layout = decls[out.tensor].layout
    if stage.kind == "map":
        body, space_block = params
        tiles = [sp.read(op.sp, slot) for op in stage.inputs]
        dts = [decls[op.tensor].layout.dtype for op in stage.inputs]
        r = ops.run_map(jnp, body, tiles, dts, space_block, sp.arr.shape[0])
        r = ops.narrow(jnp, r, body.out_dtype)
        want = out.block
        if r.ndim - 1 < len(want):
            r = r.reshape((r.shape[0], *([1] * (len(want) - r.ndim + 1)), *r.shape[1:]))
        sp.write(out.sp, slot, ops.fit(jnp, r, want))
    elif stage.kind == "matmul":
        body = params
        lhs = sp.read(stage.inputs[0].sp, slot)
        rhs = sp.read(stage.inputs[1].sp, slot)
        acc = sp.read("acc", 0)
        if ring_rows is not None and _static(ring_rows[1]):
            prod = _grouped_matmul(lhs, rhs, ring_rows[1], loads_rows[1])
            acc = (
                prod
                if t_first is True
                else (acc + prod if t_first is False else jnp.where(t_first, prod, acc + prod))
            )
        else:
            acc = ops.run_matmul_step(jnp, acc, lhs, rhs, t_first)
        sp.write("acc", 0, acc)
        r = ops.narrow(jnp, acc, body.out_dtype)
        sp.write(out.sp, slot, ops.fit(jnp, r, out.block))
    elif stage.kind == "gather":
        body = params
        idx = sp.read(stage.inputs[0].sp, slot).astype(jnp.int32)  # [C, tr]
        table = env[body.table]
        td = out.block[-1]
        ncb = table.shape[-1] // td
        t3 = table.reshape(table.shape[0], ncb, td)
        sidx = jnp.asarray(store_idx)
        col = jnp.where(sidx < 0, 0, sidx % ncb)
        valid = (idx >= 0) & (idx < body.num_rows)
        rows = t3[jnp.clip(idx, 0, body.num_rows - 1), col[:, None]]  # [C, tr, td]
        if body.mode == "fill":
            fillv = jnp.nan if rows.dtype.kind == "f" else 0
            rows = jnp.where(valid[..., None], rows, jnp.asarray(fillv, rows.dtype))
        sp.write(out.sp, slot, ops.fit(jnp, rows, out.block))
    elif stage.kind == "reshape":
        body = params
        x = sp.read(stage.inputs[0].sp, slot)
        c = x.shape[0]
        r_out = out.block[0]
        x = x[:, :, : body.l_in].reshape(c, r_out, body.l_out)
        sp.write(out.sp, slot, ops.fit(jnp, x, out.block))
    elif stage.kind == "concat":
        body = params
        parts = []
        for op, n in zip(stage.inputs, body.sizes, strict=True):
            x = sp.read(op.sp, slot)
            sl = [slice(None)] * x.ndim
            sl[1 + body.axis] = slice(0, n)
            parts.append(x[tuple(sl)])
        x = jnp.concatenate(parts, axis=1 + body.axis)
        sp.write(out.sp, slot, ops.fit(jnp, x.astype(np_dtype(out_layout.dtype)), out.block))
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


def run_stage(stage: Stage, env: dict[str, Any], decls: dict[str, Any], ncores: int) -> Any:
    """Execute one stage on the vectorized card; returns the output tensor's device array."""
    sp = _Scratchpad(stage, ncores)
    blocked = [to_blocks(jnp, env[op.tensor], op.block) for op in stage.inputs]
    out = stage.output
    out_layout = decls[out.tensor].layout
    nb_out = math.prod(blocks_of(out_layout.device_shape, out.block))
    out_blocked = jnp.zeros((nb_out, *out.block), np_dtype(out_layout.dtype))
    tab = _tables(stage)
    T = stage.steps
    nslots = [stage.sp(op.sp).slots for op in stage.inputs]
    oslots = stage.sp(out.sp).slots

    def load_step(t: Any, loads: Any, ring: Any) -> None:
        for i, op in enumerate(stage.inputs):
            slot = t % nslots[i]
            _load(sp, op, blocked[i], loads[i], ring[i], slot)

    def step(
        t: Any, stores: Any, first: Any, ob: jax.Array, ring: Any = None, loads: Any = None
    ) -> jax.Array:
        _compute(stage, sp, t % oslots if oslots > 1 else 0, first, decls, env, stores, ring, loads)
        tile = sp.read(out.sp, t % oslots if oslots > 1 else 0)
        return _store(ob, tile, stores)

    if T <= UNROLL_STEPS:
        load_step(0, tab["loads"][0], tab["ring"][0])
        for t in range(T):
            if t + 1 < T:
                load_step(t + 1, tab["loads"][t + 1], tab["ring"][t + 1])
            out_blocked = step(
                t,
                tab["stores"][t],
                bool(tab["first"][t]),
                out_blocked,
                tab["ring"][t],
                tab["loads"][t],
            )
    else:
        load_step(0, tab["loads"][0], tab["ring"][0])
        nxt_loads = np.concatenate([tab["loads"][1:], -np.ones_like(tab["loads"][:1])])
        nxt_ring = np.concatenate([tab["ring"][1:], -np.ones_like(tab["ring"][:1])])
        xs = (
            jnp.arange(T, dtype=jnp.int32),
            jnp.asarray(nxt_loads),
            jnp.asarray(nxt_ring),
            jnp.asarray(tab["stores"]),
            jnp.asarray(tab["first"]),
        )

        def body(carry: tuple[jax.Array, jax.Array], x: Any) -> tuple[Any, None]:
            sp.arr, ob = carry
            t, nl, nr, st, fi = x
            load_step(t + 1, nl, nr)
            ob = step(t, st, fi, ob)
            return (sp.arr, ob), None

        (sp.arr, out_blocked), _ = lax.scan(body, (sp.arr, out_blocked), xs)
    return from_blocks(jnp, out_blocked, out_layout.device_shape, out.block)


def run_kernel(kernel: Kernel, args: list[Any]) -> list[Any]:
    """Trace-time interpreter over a kernel's stages (call it under ``jax.jit``)."""
    decls = {t.name: t for t in kernel.tensors}
    env: dict[str, Any] = dict(zip(kernel.inputs, args, strict=True))

    def resolve() -> None:
        # a view and its base are the same buffer: whichever exists gives the other
        changed = True
        while changed:
            changed = False
            for view, base in kernel.aliases:
                for have, want in ((base, view), (view, base)):
                    if have in env and want not in env:
                        env[want] = env[have].reshape(decls[want].layout.device_shape)
                        changed = True

    resolve()
    for st in kernel.stages:
        env[st.output.tensor] = run_stage(st, env, decls, kernel.num_cores)
        resolve()
    return [env[o] for o in kernel.outputs]


def build_runner(kernel: Kernel) -> Callable[..., list[jax.Array]]:
    """One jitted program for the whole kernel: ``runner(*input_buffers) -> output_buffers``."""

    def program(*args: jax.Array) -> list[jax.Array]:
        return run_kernel(kernel, list(args))

    return jax.jit(program)
