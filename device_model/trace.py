"""The trace export: a timeline of submitted steps as Chrome trace-event JSON, and its summary.

:func:`chrome_trace` turns the :class:`~device_model.streams.StepRecord` s the queues keep into
the JSON object format of the trace-event spec (``{"traceEvents": [...]}``), which Perfetto
(https://ui.perfetto.dev) and ``chrome://tracing`` open. Times are simulated time, in
microseconds from the first step's start (``otherData["origin_s"]`` keeps that start).

Two processes, each a set of tracks (threads):

* ``spyre card``: one track per stream that has steps (``stream 0``, ``stream 33``, ...), each
  step a span on it (record/wait event markers as instant events), then one track per pipeline
  (``copy in``, ``compute``, ``copy out``) with the steps that pipeline ran;
* ``cores``: for every kernel step, the per-core timeline of ``device_model.timing``, for the
  cores that are ever busy: ``core 3 PE`` / ``core 3 SFU`` (the compute of each stage step the
  core works in), ``core 3 load/store`` (device-memory traffic) and ``core 3 ring`` (forwards,
  where a stage has ring time).

The per-core spans follow the timing model's double-buffering formula (``device_model.timing``):
a stage starts with the prologue (an NT product's restickify, ``restick_s``, then step 0's
loads, ``first_load_s``, then its ring forwards);
step ``t``'s compute runs from ``starts_s[t]`` for ``compute_s[t]``, and at the same time the
load/store units move step ``t+1``'s loads and step ``t``'s stores for ``memory_s[t]`` (the
timing model's rates for that mix of reads and writes) and the ring forwards step ``t+1``'s
blocks. A one-step stage has no prologue load: its loads stream with its compute. Stages run back to
back from the kernel step's start. The device-memory bandwidth is shared, so every core that
loads or stores in an interval is shown busy for the whole interval's traffic.

:func:`summary` gives busy fractions per unit over the trace's span and the unit that bounds it;
:func:`format_summary` prints that as a small table.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .card import DEFAULT_CARD
from .streams import StepRecord

__all__ = ["chrome_trace", "summary", "format_summary", "PIPELINES", "CORE_UNITS", "UNITS"]

#: the card's pipelines, in the order their tracks are shown
PIPELINES = ("copy in", "compute", "copy out")
#: the per-core units, in the order their tracks are shown (each core: PE/SFU, load/store, ring)
CORE_UNITS = ("PE", "SFU", "load/store", "ring")
#: every unit :func:`summary` reports
UNITS = PIPELINES + CORE_UNITS

_CARD_PID = 1
_CORES_PID = 2
_STREAM_TID0 = 1  # stream s -> tid 1 + s
_PIPE_TID0 = 1001  # pipelines after every stream (ids 0-64)
_NS = 1e-9  # times are quantized to whole nanoseconds
_OVERLAP_TOL_US = 1e-3  # adjacent spans that overlap by under 1 ns (rounding) are clipped


@dataclass(frozen=True, slots=True)
class _Span:
    """One busy interval of a core unit inside a kernel step, for the cores in ``cores``."""

    unit: str
    start: float  # s, absolute simulated time
    dur: float  # s
    cores: tuple[int, ...]
    name: str
    args: dict[str, Any]


def _kernel_spans(rec: StepRecord) -> Iterator[_Span]:
    """The per-core busy intervals of one ``run_kernel`` step, from its cost analysis."""
    detail = rec.detail
    if not isinstance(detail, dict):
        return
    offset = rec.start
    for st in detail.get("stages", ()):
        tl = st.get("timeline")
        if tl is None:
            offset += st.get("time_s", 0.0)
            continue
        steps = st["steps"]
        starts, comp, mem_s = tl["starts_s"], tl["compute_s"], tl["memory_s"]
        first = tl["first_load_s"]
        loads, stores, ring, cores = tl["load_bytes"], tl["store_bytes"], tl["ring_s"], tl["cores"]
        unit = st.get("unit", "load/store")
        base_args = {
            "step": rec.name,
            "step_id": rec.id,
            "stream": rec.stream,
            "stage": st["stage"],
            "stage_kind": st["kind"],
            "steps": steps,
        }
        name = st["stage"]
        for t in range(steps):
            here = tuple(cores[t])
            nxt = tuple(cores[t + 1]) if t + 1 < steps else ()
            a = {**base_args, "step_index": t}
            # a one-step stage streams its loads with its compute (no load before it)
            streamed = loads[0] if t == 0 and first == 0 else 0
            if t == 0:
                restick = tl.get("restick_s", 0.0)
                if restick > 0:
                    yield _Span(
                        "load/store",
                        offset,
                        restick,
                        here,
                        f"{name} restickify",
                        {**a, "phase": "restickify"},
                    )
                if first > 0:
                    yield _Span(
                        "load/store",
                        offset + restick,
                        first,
                        here,
                        f"{name} load",
                        {**a, "load_bytes": loads[0], "store_bytes": 0, "phase": "prologue"},
                    )
                if ring[0] > 0:
                    at = offset + restick + first
                    yield _Span("ring", at, ring[0], here, f"{name} ring", dict(a))
            if unit in ("PE", "SFU") and comp[t] > 0:
                yield _Span(unit, offset + starts[t], comp[t], here, name, dict(a))
            nl = loads[t + 1] if t + 1 < steps else 0
            if nl + stores[t] + streamed > 0 and mem_s[t] > 0:
                busy = set(here if stores[t] or streamed else ()) | set(nxt if nl else ())
                yield _Span(
                    "load/store",
                    offset + starts[t],
                    mem_s[t],
                    tuple(sorted(busy)),
                    f"{name} load/store",
                    {
                        **a,
                        "load_bytes": nl + streamed,
                        "store_bytes": stores[t],
                        "load_step": t if streamed else t + 1,
                    },
                )
            if t + 1 < steps and ring[t + 1] > 0:
                yield _Span(
                    "ring",
                    offset + starts[t],
                    ring[t + 1],
                    nxt,
                    f"{name} ring",
                    {**a, "ring_step": t + 1},
                )
        offset += st["time_s"]


def _ns(t: float) -> int:
    return round(t / _NS)


def _us(ns: int) -> float:
    return ns / 1000


def _step_args(rec: StepRecord) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kind": rec.kind,
        "stream": rec.stream,
        "pipeline": rec.pipeline,
        "step_id": rec.id,
        "bytes": rec.nbytes,
        "start_us": rec.start * 1e6,
        "end_us": rec.end * 1e6,
    }
    args.update(dict(rec.args))
    if isinstance(rec.detail, dict):
        for k, v in rec.detail.items():
            if isinstance(v, int | float | str | bool):
                args[k] = v
    return args


def _meta(pid: int, tid: int | None, name: str, value: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": {}}
    if tid is not None:
        e["tid"] = tid
    e["args"] = {"name": value} if name.endswith("_name") else {"sort_index": value}
    return e


def _clip_overlaps(events: list[dict[str, Any]]) -> None:
    """Clip rounding-level overlaps between consecutive spans of one track (flat tracks)."""
    last: dict[tuple[int, int], dict[str, Any]] = {}
    for e in sorted(
        (e for e in events if e["ph"] == "X"), key=lambda e: (e["pid"], e["tid"], e["ts"])
    ):
        key = (e["pid"], e["tid"])
        prev = last.get(key)
        if prev is not None:
            over = prev["ts"] + prev["dur"] - e["ts"]
            if 0 < over < _OVERLAP_TOL_US:
                prev["dur"] = max(0.0, e["ts"] - prev["ts"])
        last[key] = e


def chrome_trace(
    records: Sequence[StepRecord], num_cores: int = DEFAULT_CARD.num_cores
) -> dict[str, Any]:
    """Chrome trace-event JSON (object format) of ``records``; see the module docstring.

    ``num_cores``: the card's core count, ``CardSpec.num_cores`` (kernel timelines naming a
    core outside ``range(num_cores)`` raise ValueError); the default card's when not given. The
    result is plain data: ``json.dump`` it.

    >>> t = chrome_trace([])
    >>> t["displayTimeUnit"], t["traceEvents"][0]["args"]
    ('ns', {'name': 'spyre card'})
    """
    records = list(records)
    origin = min((r.start for r in records), default=0.0)
    o_ns = _ns(origin)
    events: list[dict[str, Any]] = []
    streams: set[int] = set()
    pipes: set[str] = set()
    core_tracks: set[tuple[int, int]] = set()  # (core, unit index)

    def span(pid: int, tid: int, name: str, cat: str, s: float, d: float, args: dict) -> None:
        a, b = _ns(s) - o_ns, _ns(s + d) - o_ns
        events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": _us(a),
                "dur": _us(max(0, b - a)),
                "pid": pid,
                "tid": tid,
                "args": args,
            }
        )

    for rec in records:
        streams.add(rec.stream)
        args = _step_args(rec)
        stid = _STREAM_TID0 + rec.stream
        if rec.pipeline is None:
            events.append(
                {
                    "name": rec.name,
                    "cat": rec.kind,
                    "ph": "i",
                    "s": "t",
                    "ts": _us(_ns(rec.start) - o_ns),
                    "pid": _CARD_PID,
                    "tid": stid,
                    "args": args,
                }
            )
            continue
        dur = rec.end - rec.start
        span(_CARD_PID, stid, rec.name, rec.kind, rec.start, dur, args)
        pipes.add(rec.pipeline)
        ptid = _PIPE_TID0 + PIPELINES.index(rec.pipeline)
        span(_CARD_PID, ptid, rec.name, rec.kind, rec.start, dur, args)
        if rec.kind != "run_kernel":
            continue
        for sp in _kernel_spans(rec):
            k = CORE_UNITS.index(sp.unit)
            for c in sp.cores:
                if not 0 <= c < num_cores:
                    raise ValueError(
                        f"trace: {rec.describe()} names core {c}, outside the card's "
                        f"{num_cores} cores (pass num_cores=)"
                    )
                core_tracks.add((c, k))
                tid = 1 + c * len(CORE_UNITS) + k
                span(_CORES_PID, tid, sp.name, sp.unit, sp.start, sp.dur, {**sp.args, "core": c})
    _clip_overlaps(events)

    meta = [
        _meta(_CARD_PID, None, "process_name", "spyre card"),
        _meta(_CARD_PID, None, "process_sort_index", 0),
    ]
    for s in sorted(streams):
        meta.append(_meta(_CARD_PID, _STREAM_TID0 + s, "thread_name", f"stream {s}"))
        meta.append(_meta(_CARD_PID, _STREAM_TID0 + s, "thread_sort_index", s))
    for i, p in enumerate(PIPELINES):
        if p in pipes:
            meta.append(_meta(_CARD_PID, _PIPE_TID0 + i, "thread_name", p))
            meta.append(_meta(_CARD_PID, _PIPE_TID0 + i, "thread_sort_index", _PIPE_TID0 + i))
    if core_tracks:
        meta.append(_meta(_CORES_PID, None, "process_name", "cores"))
        meta.append(_meta(_CORES_PID, None, "process_sort_index", 1))
    for c, k in sorted(core_tracks):
        tid = 1 + c * len(CORE_UNITS) + k
        meta.append(_meta(_CORES_PID, tid, "thread_name", f"core {c} {CORE_UNITS[k]}"))
        meta.append(_meta(_CORES_PID, tid, "thread_sort_index", tid))
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ns",
        "otherData": {
            "source": "spyre-jax simulated card",
            "time": "simulated",
            "origin_s": origin,
            "num_steps": len(records),
            "num_cores": num_cores,
        },
    }


# --------------------------------------------------------------------------------------------
# summary


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summary(records: Sequence[StepRecord]) -> dict[str, Any]:
    """Busy time per unit over the span of ``records``, and the unit that bounds it.

    Units: the pipelines (``copy in``, ``compute``, ``copy out``: time running steps) and the
    core units aggregated over the cores (``PE``, ``SFU``, ``load/store``, ``ring``: time in
    which any core's unit is busy, from the kernels' timelines). Keys:

    * ``total_s``: last end - first start (simulated seconds); ``start_s``, ``end_s``;
    * ``busy_s`` / ``busy_fraction``: per unit (in :data:`UNITS` order), the fraction of
      ``total_s`` (0 for an empty trace);
    * ``bound``: the busiest pipeline; where that is ``compute``, the busiest core unit inside
      it instead (``bound_pipeline`` keeps the pipeline); ``"none"`` when nothing ran;
    * ``num_steps``, ``steps`` (count per kind), ``kernels`` (``run_kernel`` steps).
    """
    records = list(records)
    start = min((r.start for r in records), default=0.0)
    end = max((r.end for r in records), default=0.0)
    total = end - start
    ivs: dict[str, list[tuple[float, float]]] = {u: [] for u in UNITS}
    kinds: dict[str, int] = {}
    for rec in records:
        kinds[rec.kind] = kinds.get(rec.kind, 0) + 1
        if rec.pipeline is not None:
            ivs[rec.pipeline].append((rec.start, rec.end))
        if rec.kind == "run_kernel":
            for sp in _kernel_spans(rec):
                if sp.cores:
                    ivs[sp.unit].append((sp.start, sp.start + sp.dur))
    busy = {u: _union(iv) for u, iv in ivs.items()}
    frac = {u: (min(1.0, max(0.0, b / total)) if total > 0 else 0.0) for u, b in busy.items()}
    bound_pipe = max(PIPELINES, key=lambda u: busy[u]) if total > 0 else "none"
    bound = bound_pipe
    if bound_pipe == "compute" and any(busy[u] > 0 for u in CORE_UNITS):
        bound = max(CORE_UNITS, key=lambda u: busy[u])
    return {
        "total_s": total,
        "start_s": start,
        "end_s": end,
        "busy_s": busy,
        "busy_fraction": frac,
        "bound": bound,
        "bound_pipeline": bound_pipe,
        "num_steps": len(records),
        "steps": kinds,
        "kernels": kinds.get("run_kernel", 0),
    }


def _fmt_time(s: float) -> str:
    a = abs(s)
    if a == 0:
        return "0 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if a >= scale:
            return f"{s / scale:.3f} {unit}"
    return f"{s / 1e-9:.1f} ns"


def format_summary(d: dict[str, Any]) -> str:
    """The summary of :func:`summary` as a short aligned text table.

    >>> print(format_summary(summary([])))  # doctest: +NORMALIZE_WHITESPACE
    spyre profile: 0 steps (0 kernels), 0 s simulated
    unit             busy    busy %
    copy in           0 s      0.0%
    compute           0 s      0.0%
    copy out          0 s      0.0%
      PE              0 s      0.0%
      SFU             0 s      0.0%
      load/store      0 s      0.0%
      ring            0 s      0.0%
    bound: none
    """
    busy, frac = d["busy_s"], d["busy_fraction"]
    lines = [
        f"spyre profile: {d['num_steps']} steps ({d['kernels']} kernels), "
        f"{_fmt_time(d['total_s'])} simulated",
        f"{'unit':<12} {'busy':>12} {'busy %':>8}",
    ]
    for u in UNITS:
        label = u if u in PIPELINES else f"  {u}"
        lines.append(f"{label:<12} {_fmt_time(busy[u]):>12} {frac[u] * 100:>7.1f}%")
    bound = d["bound"]
    if d.get("bound_pipeline") not in (None, bound, "none"):
        bound = f"{bound} (inside {d['bound_pipeline']})"
    lines.append(f"bound: {bound}")
    return "\n".join(lines)
