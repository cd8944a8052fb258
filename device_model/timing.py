"""The timing model: simulated time of a kernel from its schedule, every figure from a parameter.

Per stage and step ``t`` the model counts, from the schedule's own tables:

* ``L_t``: bytes loaded from device memory (whole blocks; gathers add their indirect rows),
  ``S_t``: bytes stored;
* ``R_t``: ring time, ``ring_fixed_s`` plus the busiest directed ring link's bytes over
  ``ring_bytes_per_cycle`` per cycle (each forward takes the shorter way round the ring);
* ``C_t``: the slowest core's compute: PE flops (on padded sticks) at the sustained rate
  ``pe_flops_sustained_per_core`` (1140 MAC/ns, published; a batched matmul at the measured
  batch-outer rate, ``pe_flops_batched_per_core``), SFU element-ops over
  ``sfu_elems_per_cycle`` x corelets (a sort's compare-exchanges: :mod:`device_model.sorting`,
  shared evenly by its blocks). A matmul's epilogue (an elementwise map fused into
  its store) adds its SFU time to the last K step of each output block; its prologue (a norm's
  per-element part fused into its lhs loads) adds the SFU time of the step's lhs tile to every
  step (the tile passes the SFUs before the PE: counted in series, not overlapped).

Double buffering overlaps step t's compute with step t+1's loads and the stores in flight:
``T = M(L_0, 0) + R_0 + sum_t max(C_t, R_{t+1}, M(L_{t+1}, D_t))``, where ``D_t`` is the store
bytes draining in step t's span: a step's stores spread over the spans up to the next step that
stores (the output buffer's other slot), so an accumulating stage's stores of one round overlap
the next round's K loop. ``M(reads, writes)`` is the time of that traffic in flight together
(:meth:`~device_model.card.CardSpec.memory_seconds`): reads at 150 GB/s, writes at 132.5, and a
turnaround on the alternating bytes that makes an even mix run at 104 (measured rates, see the
:class:`~device_model.card.CardSpec` docstring); a stage that reduces along its rows reads at
``reduction_read_bw`` and pays ``reduction_fixed_s`` per reduction; a re-layout (a transpose
moving the stick dim, a reshape across sticks) moves its bytes at the restickify rate,
``relayout_bw``, as does the restickify an NT product needs (``MatmulStep.nt_form``: the rhs,
or the lhs and the product of the swapped form; in series before its steps). A stage of one
step streams its loads, compute and stores together
(``max(C_0, M(L_0, S_0))``). Stages run one after another, after the kernel's fixed
``kernel_fixed_s``.

``kernel_cost`` adds a per-unit breakdown: busy and idle time of the PEs, the SFUs, the load/store
units (device-memory traffic) and the ring over the kernel, and the unit that bounds it (the
busiest).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .card import CardSpec
from .kernel import Kernel, Stage
from .layout import DTYPES
from .ops import ROW_REDUCTIONS
from .steps import MapStep, MatmulStep, SortStep, TakeStep

__all__ = ["stage_cost", "kernel_cost"]


def _ring_time(transfers: list[tuple[int, int, int, int]], card: CardSpec) -> float:
    """The busiest directed link's time. ``transfers``: (operand, source, dest, bytes).

    One operand's block sent from one source to several cores is a multicast: it travels each
    way round the ring once, store-and-forward, as far as the furthest destination that way
    (each takes the shorter way), so every link on the way carries it once.
    """
    n = card.num_cores
    links: dict[tuple[int, int], int] = {}
    reach: dict[tuple[int, int, int], tuple[int, int]] = {}  # (operand, src, dir) -> hops, bytes
    for op, src, dst, nbytes in transfers:
        fwd = (dst - src) % n
        step = 1 if fwd <= n - fwd else -1
        hops = fwd if step == 1 else n - fwd
        key = (op, src, step)
        prev = reach.get(key, (0, nbytes))
        reach[key] = (max(prev[0], hops), nbytes)
    for (_op, src, step), (hops, nbytes) in reach.items():
        c = src
        for _ in range(hops):
            nxt = (c + step) % n
            links[(c, nxt)] = links.get((c, nxt), 0) + nbytes
            c = nxt
    if not links:
        return 0.0
    return card.ring_fixed_s + max(links.values()) / card.ring_bytes_per_cycle / card.clock_hz


def _drain(S: np.ndarray, slots: int) -> np.ndarray:
    """The store bytes that drain during each step's span. A step's output block is stored
    while the steps after it compute: with a double-buffered output (``slots`` > 1) the store
    has until the next step that stores (whose block goes to the other slot) to finish, so its
    bytes spread evenly over the spans up to that step. A stage that stores on every step
    drains each store in its own span; an accumulating one (a matmul's K loop) spreads each
    round's stores over the next round's steps. The last stores drain in the last span."""
    if slots < 2 or not S.any():
        return S
    at = np.flatnonzero(S)
    out = np.zeros_like(S)
    ends = np.append(at[1:], len(S))
    for t, e in zip(at.tolist(), ends.tolist(), strict=True):
        out[t:e] += S[t] / (e - t)
    return out


def _is_relayout(s: Stage) -> bool:
    """Whether a stage only moves data between stick layouts (a restickify): a reshape across
    sticks, or a map that copies one input while moving its stick dim (a transpose)."""
    if s.kind == "reshape":
        return True
    if s.kind != "map" or len(s.inputs) != 1:
        return False
    body = s.step.body
    if body.reduce or any(op != "copy" for op, *_ in body.program):
        return False
    dims = body.views[0].dims
    return bool(dims) and dims[-1] != len(body.space) - 1


def _reductions(s: Stage) -> int:
    """How many reductions along the rows (the last space axis, the stick dim) a map stage's
    body makes: in-program row reductions and a final one (a scan is not one)."""
    if s.kind != "map" or not isinstance(s.step, MapStep):
        return 0
    body = s.step.body
    last = len(body.space) - 1
    # which registers hold one value per row (the same along the row): an input not read along
    # the rows, a constant, a row reduction's result, and what is computed from those alone
    uniform = [
        all(d != last for d, b in zip(v.dims, v.bcast, strict=True) if not b) for v in body.views
    ]
    n = 0
    for op, args, p, _ in body.program:
        if op in ROW_REDUCTIONS and last in p:
            n += 1
            uniform.append(True)
        else:
            uniform.append(all(uniform[a] for a in args))
    # a final reduction of a row-uniform value (how the IR collapses a row's statistic to one
    # value) is no second pass over the row: the card stores the statistic it already has
    if body.reduce and not body.reduction.scan and last in body.reduce_axes and not uniform[-1]:
        n += 1
    return n


def _batched(s: Stage) -> bool:
    """A batched matmul: [B, M, K] x [B, K, N] with B > 1 (a convolution's batch is images
    sharing one kernel: a plain GEMM's rate)."""
    return isinstance(s.step, MatmulStep) and s.grid[0] > 1 and s.step.window is None


def _pe_seconds(s: Stage, card: CardSpec) -> float:
    """The stage's flops at the card's PE roof for its kind of matmul (the batched rate for a
    batched one), over all its cores."""
    if _batched(s):
        return s.flops / (card.pe_flops_batched_per_core * card.num_cores)
    return s.flops / card.bound_flops


def _block_bytes(block: tuple[int, ...], dtype: str) -> int:
    return math.prod(block) * DTYPES[dtype]


def _compute_time(s: Stage, card: CardSpec) -> tuple[float, float]:
    """One step's compute time on a core, and the time a matmul's epilogue adds to the last K
    step of each output block (see the module docstring)."""
    step = s.step
    c_step = 0.0
    ep_s = 0.0
    if isinstance(step, MatmulStep):
        lhs, rhs = s.inputs[:2]
        tm, tkp, tn = step.pe_block(lhs.block, rhs.block)
        batched = _batched(s)
        rate = card.pe_flops_batched_per_core if batched else card.pe_flops_sustained_per_core
        c_step = 2 * tm * tn * tkp / rate
        sfu_rate = card.sfu_elems_per_cycle * card.corelets_per_core * card.clock_hz
        ep_ops = s.sfu_elem_ops
        if step.prologue is not None:
            # the prologue: the SFUs on the step's lhs tile before the PE (each core its own;
            # the stage's SFU count holds one pass over the lhs per N block)
            pro = step.prologue
            ep_ops -= step.prologue_sfu * s.grid[2]
            elems = math.prod(min(b, e) for b, e in zip(lhs.block, pro.space, strict=True))
            c_step += step.prologue_sfu / max(1, math.prod(pro.space)) * elems / sfu_rate
        if step.epilogue is not None:
            # the epilogue: the SFUs on each output block after its last K step
            space = step.epilogue.space
            elems = math.prod(min(b, e) for b, e in zip(s.output.block, space, strict=True))
            per_core = ep_ops / max(1, math.prod(step.epilogue.space)) * elems
            ep_s = per_core / sfu_rate
    elif isinstance(step, MapStep):
        body, space_block = step.body, step.space_block
        elems = math.prod(space_block)
        per_core = s.sfu_elem_ops / max(1, math.prod(body.space)) * elems
        rate = card.sfu_elems_per_cycle * card.corelets_per_core
        c_step = per_core / rate / card.clock_hz
    elif isinstance(step, SortStep | TakeStep):
        # the stage's SFU work (compare-exchanges, indexed reads) shared evenly by its blocks
        rate = card.sfu_elems_per_cycle * card.corelets_per_core * card.clock_hz
        c_step = s.sfu_elem_ops / max(1, math.prod(s.grid)) / rate
    return c_step, ep_s


def stage_cost(s: Stage, dtypes: dict[str, str], card: CardSpec) -> dict[str, Any]:
    """Time (s) and traffic of one stage; see the module docstring for the formula.

    A stage whose input buffers have a single slot while it runs several steps is single
    buffered: step t+1's loads wait for step t's compute, nothing overlaps."""
    in_bytes = np.asarray([_block_bytes(op.block, dtypes[op.tensor]) for op in s.inputs], float)
    out_bytes = _block_bytes(s.output.block, dtypes[s.output.tensor])
    T = s.steps
    nin = len(s.inputs)
    ncores = len(s.stores[0]) if T else card.num_cores
    loads = np.asarray(s.loads, np.int64).reshape(T, nin, ncores)
    ring = np.asarray(s.ring, np.int64).reshape(T, nin, ncores)
    stores = np.asarray(s.stores, np.int64).reshape(T, ncores)
    kind = s.kind
    L = ((loads >= 0) * in_bytes[None, :, None]).sum(axis=(1, 2)) if nin else np.zeros(T)
    nstore = (stores >= 0).sum(axis=1)
    S = nstore * float(out_bytes)
    if kind == "gather":
        L = L + nstore * float(out_bytes)  # the indirectly loaded rows
    recv = ring >= 0
    ring_bytes = int(((recv) * in_bytes[None, :, None]).sum()) if nin else 0
    # ring time per step: the same ring pattern always takes the same time (computed once)
    R = np.zeros(T)
    if nin and recv.any():
        flat = ring.reshape(T, -1)
        pats, inv = np.unique(flat, axis=0, return_inverse=True)
        times = []
        for pat in pats:
            pr = pat.reshape(nin, ncores)
            transfers = [
                (i, int(pr[i, c]), c, int(in_bytes[i]))
                for i in range(nin)
                for c in range(ncores)
                if pr[i, c] >= 0
            ]
            times.append(_ring_time(transfers, card))
        R = np.asarray(times)[np.asarray(inv).reshape(-1)]
    busy_in = ((loads >= 0) | recv).any(axis=1) if nin else np.zeros((T, ncores), bool)
    active = set(np.flatnonzero(busy_in.any(axis=0)).tolist())
    c_step, ep_s = _compute_time(s, card)
    C = np.full(T, c_step)
    if ep_s:
        C = C + ep_s * np.asarray(s.last, float)
    moved = float(L.sum() + S.sum())
    nred = _reductions(s)
    # a stage that reduces along rows reads at the reduction rate (CardSpec.reduction_read_bw)
    read_bw = min(card.memory_bw_one_way, card.reduction_read_bw) if nred else None
    relayout = _is_relayout(s)

    def mem(reads: Any, writes: Any) -> Any:
        # the traffic in flight together, at the card's rates for its mix of reads and writes
        # (CardSpec.memory_seconds); a re-layout at the measured restickify rate
        if relayout:
            return (reads + writes) / card.relayout_bw
        return card.memory_seconds(reads, writes, read_bw)

    nxt_l = np.concatenate([L[1:], [0.0]])
    nxt_r = np.concatenate([R[1:], [0.0]])
    single = T > 1 and any(s.sp(op.sp).slots == 1 for op in s.inputs)
    first = float(mem(L[0], 0.0)) if T else 0.0
    if T == 1:
        # one step (the whole tensor at once in the scratchpads): on the card its loads, compute
        # and stores stream through together, finer than the schedule's one block
        first = 0.0
        mem_t = mem(L, S)
        span = np.maximum(C, mem_t)
    elif single:
        mem_t = mem(nxt_l, S)
        span = C + nxt_r + mem_t
    else:
        mem_t = mem(nxt_l, _drain(S, s.sp(s.output.sp).slots))
        span = np.maximum(np.maximum(C, nxt_r), mem_t)
    memory_s = first + float(np.sum(mem_t))
    bw = moved / memory_s if memory_s else card.memory_bw_one_way  # the stage's average rate
    # each reduction's synchronization across a row's sticks (CardSpec.reduction_fixed_s)
    # an NT product's restickify (MatmulStep.nt_form), in series before the product's steps
    restick = getattr(s.step, "relayout_bytes", 0) / card.relayout_bw
    memory_s += restick
    prologue = (restick + first + R[0] + nred * card.reduction_fixed_s) if T else 0.0
    ends = prologue + np.cumsum(span)
    total = float(ends[-1]) if T else prologue
    starts = [float(prologue)] + [float(x) for x in ends[:-1]]
    # per step: which cores work (load, receive or store) -- for the trace's per-core tracks
    busy = busy_in | (stores >= 0)
    cores = [tuple(np.flatnonzero(row).tolist()) for row in busy]
    unit = "load/store" if s.unit == "LSU" else s.unit
    return {
        "stage": s.name,
        "kind": s.kind,
        "steps": T,
        "time_s": total,
        "compute_s": float(C.sum()),
        "memory_s": memory_s,
        "ring_s": float(R.sum()),
        "load_bytes": int(L.sum()),
        "store_bytes": int(S.sum()),
        "ring_bytes": ring_bytes,
        "cores_used": len(active) if active else int(nstore[0]) if T else 0,
        "scratchpad_bytes": s.sp_peak_bytes,
        "flops": s.flops,
        "unit": unit,  # the compute unit the stage's body runs on
        # the timeline of the stage, for the trace: per step its compute start (s from the
        # stage's start), compute time, load/store bytes and ring time, and its busy cores
        "timeline": {
            "prologue_s": float(prologue),
            "restick_s": float(restick),  # an NT product's restickify, before the loads
            "first_load_s": float(first),  # the first step's loads before any compute
            "starts_s": starts,
            "memory_s": np.broadcast_to(np.asarray(mem_t, float), (T,)).tolist(),
            "compute_s": C.tolist(),
            "load_bytes": [int(x) for x in L],
            "store_bytes": [int(x) for x in S],
            "ring_s": R.tolist(),
            "cores": cores,
            "bandwidth": bw,
        },
    }


def kernel_cost(k: Kernel, card: CardSpec) -> dict[str, Any]:
    """The figures of ``Compiled.cost_analysis()`` for one kernel, on the card it was scheduled
    for (ValueError when ``card`` has another core count or stick size than the kernel's)."""
    if (k.num_cores, k.stick_bytes) != (card.num_cores, card.stick_bytes):
        raise ValueError(
            f"spyre: kernel {k.name} was scheduled for {k.num_cores} cores and "
            f"{k.stick_bytes}-byte sticks, not for this card's {card.num_cores} cores and "
            f"{card.stick_bytes}-byte sticks"
        )
    dtypes = {t.name: t.layout.dtype for t in k.tensors}
    stages = [stage_cost(s, dtypes, card) for s in k.stages]
    padding = sum(t.layout.padding_bytes for t in k.tensors if t.role != "view")
    # the kernel's fixed device time (CardSpec.kernel_fixed_s): in its total and its bound
    fixed = card.kernel_fixed_s
    total = fixed + sum(s["time_s"] for s in stages)
    busy = {"PE": 0.0, "SFU": 0.0, "load/store": 0.0, "ring": 0.0}
    for s in stages:
        if s["unit"] in ("PE", "SFU"):
            busy[s["unit"]] += s["compute_s"]
        busy["load/store"] += s["memory_s"]
        busy["ring"] += s["ring_s"]
    breakdown = {
        u: {
            "busy_us": b * 1e6,
            "idle_us": max(0.0, total - b) * 1e6,
            "busy_fraction": (b / total) if total else 0.0,
        }
        for u, b in busy.items()
    }
    bound = max(busy, key=lambda u: busy[u]) if total else "none"
    # the external bound: the fixed cost, and each input read once and each output written
    # once (at the card's read and write rates, CardSpec.memory_seconds), or the flops at the
    # PE roof of their kind of matmul; the schedule's time over it
    sizes = {t.name: math.prod(t.layout.shape) * DTYPES[t.layout.dtype] for t in k.tensors}
    outs = set(k.outputs)  # an output may be a view of a temp (a free reshape)
    reads = float(sum(sizes[t.name] for t in k.tensors if t.name in k.inputs or t.role == "const"))
    writes = float(sum(sizes[t.name] for t in k.tensors if t.name in outs))
    min_bytes = reads + writes
    pe_s = sum(_pe_seconds(st, card) for st in k.stages)
    # (the reads apart from the writes: no turnaround, which a schedule may avoid); an NT
    # product's restickify, in its cheaper form, is the card's to pay whatever the schedule
    restick_s = [c["timeline"]["restick_s"] for c in stages]
    bound_s = fixed + sum(restick_s) + max(card.memory_seconds(reads, writes, mixed=False), pe_s)
    # each stage's own bound (the fused op it runs: its inputs read once, at the reduction rate
    # for a row reduction, with its reductions' fixed costs; its output written once; or its
    # flops at the PE roof); their sum is what a schedule of these stages, one after another,
    # could reach at best
    for st, c, rs in zip(k.stages, stages, restick_s, strict=True):
        rd = float(sum(sizes[n] for n in {op.tensor for op in st.inputs}))
        if st.kind == "gather":
            rd += sizes[st.output.tensor]  # the table's rows it reads
        nred = _reductions(st)
        read_bw = min(card.memory_bw_one_way, card.reduction_read_bw) if nred else None
        mem = card.memory_seconds(rd, float(sizes[st.output.tensor]), read_bw, mixed=False)
        c["bound_s"] = rs + nred * card.reduction_fixed_s + max(mem, _pe_seconds(st, card))
    stages_bound_s = fixed + sum(c["bound_s"] for c in stages)
    out = {
        "flops": float(sum(s["flops"] for s in stages)),
        "device_bytes": float(sum(s["load_bytes"] + s["store_bytes"] for s in stages)),
        "bytes accessed": float(sum(s["load_bytes"] + s["store_bytes"] for s in stages)),
        "scratchpad_peak_bytes": max((s["scratchpad_bytes"] for s in stages), default=0),
        "scratchpad_usable_bytes": card.scratchpad_usable_bytes,
        "padding_bytes": padding,
        "cores_used": max((s["cores_used"] for s in stages), default=0),
        "sim_time_us": total * 1e6,
        "fixed_us": fixed * 1e6,
        "compute_us": sum(s["compute_s"] for s in stages) * 1e6,
        "memory_us": sum(s["memory_s"] for s in stages) * 1e6,
        "ring_bytes": float(sum(s["ring_bytes"] for s in stages)),
        "num_stages": len(stages),
        "breakdown": breakdown,
        "bound": bound,
        "min_device_bytes": min_bytes,
        "bound_us": bound_s * 1e6,
        "bound_ratio": (total / bound_s) if bound_s else float("nan"),
        "stages_bound_us": stages_bound_s * 1e6,
        "stages_bound_ratio": (total / stages_bound_s) if stages_bound_s else float("nan"),
        "stages": stages,
    }
    return out


#: the timing model's parameters (``CardSpec`` fields) whose share of a kernel's time
#: :func:`parameter_shares` reports: True for a rate (the kernel is slower when it is lower),
#: False for a time (slower when it is higher)
MODEL_PARAMETERS: dict[str, bool] = {
    "kernel_fixed_s": False,
    "reduction_fixed_s": False,
    "memory_bw_one_way": True,
    "memory_bw_write_only": True,
    "memory_bw_balanced": True,
    "reduction_read_bw": True,
    "relayout_bw": True,
    "pe_macs_per_ns_per_core": True,
    "bmm_batch_outer_macs_per_ns_per_core": True,
    "sfu_elems_per_cycle": True,
    "ring_bytes_per_cycle": True,
    "ring_fixed_s": False,
}


def parameter_shares(k: Kernel, card: CardSpec, step: float = 0.01) -> dict[str, float]:
    """Each timing parameter's share of ``k``'s simulated time: the time's elasticity to it
    (how much of the time grows with the parameter's cost: a kernel bound by device memory at
    the balanced rate has a share near 1 for ``memory_bw_balanced``; a parameter the kernel
    does not touch has 0). Measured by making each parameter ``step`` costlier in turn. A
    term hidden behind another (overlapped) has none; the shares of terms that add up sum to
    1, except where one term derives from several parameters (the turnaround of a read/write
    mix grows with ``memory_bw_balanced`` 's cost and shrinks with the others')."""
    base = kernel_cost(k, card)["sim_time_us"]
    out: dict[str, float] = {}
    for name, is_rate in MODEL_PARAMETERS.items():
        v = getattr(card, name)
        costlier = v / (1 + step) if is_rate else v * (1 + step)
        try:
            t = kernel_cost(k, card.replace(**{name: costlier}))["sim_time_us"]
        except ValueError:  # (a rate the others must stay below: the share is not defined)
            continue
        out[name] = round(max(0.0, (t - base) / base / step), 4) if base else 0.0
    return out
