"""Tests of the trace export (``device_model.trace``) and ``spyre_jax.profile``."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
import pytest

import spyre_jax
from device_model.runtime import runtime
from device_model.streams import StepRecord
from device_model.trace import CORE_UNITS, PIPELINES, UNITS, chrome_trace, format_summary, summary
from spyre_jax.profile import Profile

EPS_US = 2e-3  # times are quantized to whole nanoseconds


def _matmul_gelu(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ w)


def _gelu2(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x) * 2


f = spyre_jax.jit(_matmul_gelu)
g = spyre_jax.jit(_gelu2)


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r = np.random.default_rng(0)
    x = r.standard_normal((128, 256)).astype(np.float16)
    w = (r.standard_normal((256, 512)) / 16).astype(np.float16)
    xb = r.standard_normal((256, 512)).astype(np.float16)
    return x, w, xb


def _thread_names(trace: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def _process_names(trace: dict[str, Any]) -> dict[int, str]:
    return {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }


def _spans_on(trace: dict[str, Any], track: str) -> list[dict[str, Any]]:
    names = _thread_names(trace)
    return sorted(
        (
            e
            for e in trace["traceEvents"]
            if e["ph"] == "X" and names[(e["pid"], e["tid"])] == track
        ),
        key=lambda e: e["ts"],
    )


def _assert_no_overlap(spans: list[dict[str, Any]], what: str) -> None:
    for a, b in zip(spans, spans[1:], strict=False):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-9, (what, a, b)


def _not_recording(prof: Profile) -> bool:
    return all(r is not prof.records for r in runtime().queues.recording)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any], int]:
    """Two jitted functions, on the default stream and on a new stream, under a profile."""
    path = tmp_path_factory.mktemp("trace") / "t.json"
    x, w, xb = _inputs()
    f(x, w)
    g(xb)  # compiled outside the profile (the trace holds only card steps anyway)
    with spyre_jax.profile(path, print_summary=False) as prof:
        y = f(x, w)  # host inputs: copy-ins
        np.asarray(y)  # copy-out
        s = spyre_jax.Stream()
        with spyre_jax.stream(s):
            y2 = g(xb)
            e = s.record_event()
        spyre_jax.default_stream().wait_event(e)
        z = f(x, w)
        np.asarray(y2)
        np.asarray(z)
    assert _not_recording(prof)
    with open(path, encoding="utf-8") as fh:
        trace = json.load(fh)
    s.destroy()
    return prof, trace, s.id


# ---------------------------------------------------------------------------------------------
# the JSON written by spyre_jax.profile


def test_trace_structure_is_valid(profiled):
    _, trace, _ = profiled
    assert isinstance(trace["traceEvents"], list)
    assert trace["displayTimeUnit"] == "ns"
    phases = {e["ph"] for e in trace["traceEvents"]}
    assert phases <= {"X", "M", "i"}
    for e in trace["traceEvents"]:
        assert {"name", "ph", "pid"} <= e.keys()
        assert isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert {"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys()
            assert isinstance(e["tid"], int)
            assert e["ts"] >= 0 and e["dur"] >= 0
            assert isinstance(e["args"], dict)
        elif e["ph"] == "i":
            assert e["ts"] >= 0 and e["s"] in ("t", "p", "g")
    assert _process_names(trace) == {1: "spyre card", 2: "cores"}


def test_trace_track_names(profiled):
    _, trace, sid = profiled
    names = set(_thread_names(trace).values())
    for want in ("stream 0", f"stream {sid}", "compute", "copy in", "copy out"):
        assert want in names
    assert "core 0 PE" in names or "core 0 SFU" in names
    assert "core 0 load/store" in names
    for n in names:
        parts = n.split()
        assert (
            n.startswith("stream ")
            or n in PIPELINES
            or (parts[0] == "core" and parts[1].isdigit() and " ".join(parts[2:]) in CORE_UNITS)
        ), n


def test_tracks_sorted_core_0_before_core_10(profiled):
    _, trace, _ = profiled
    order = {
        (e["pid"], e["tid"]): e["args"]["sort_index"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_sort_index"
    }
    by_name = {n: order[k] for k, n in _thread_names(trace).items()}
    if "core 10 load/store" in by_name:
        assert by_name["core 0 load/store"] < by_name["core 2 load/store"]
        assert by_name["core 2 load/store"] < by_name["core 10 load/store"]
    assert by_name["stream 0"] < by_name["copy in"] < by_name["compute"] < by_name["copy out"]


def test_steps_appear_on_stream_and_pipeline_tracks(profiled):
    prof, trace, sid = profiled
    kinds = [r.kind for r in prof.records]
    assert kinds.count("run_kernel") == 3
    assert "copy_in" in kinds and "copy_out" in kinds
    assert "record_event" in kinds and "wait_event" in kinds
    compute = _spans_on(trace, "compute")
    assert [e["args"]["kind"] for e in compute] == ["run_kernel"] * 3
    assert {e["name"] for e in compute} == {r.name for r in prof.records if r.kind == "run_kernel"}
    on_s = _spans_on(trace, f"stream {sid}")
    assert {e["args"]["kind"] for e in on_s} == {"copy_in", "run_kernel", "copy_out"}
    assert all(e["args"]["stream"] == sid for e in on_s)
    copy_in = _spans_on(trace, "copy in")
    assert all(e["args"]["bytes"] > 0 for e in copy_in)
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert sorted(e["args"]["kind"] for e in instants) == ["record_event", "wait_event"]
    names = _thread_names(trace)
    rec = next(e for e in instants if e["args"]["kind"] == "record_event")
    wait = next(e for e in instants if e["args"]["kind"] == "wait_event")
    assert names[(rec["pid"], rec["tid"])] == f"stream {sid}"
    assert names[(wait["pid"], wait["tid"])] == "stream 0"


def test_flat_tracks_never_overlap(profiled):
    _, trace, _ = profiled
    for track in set(_thread_names(trace).values()):
        _assert_no_overlap(_spans_on(trace, track), track)


def test_core_spans_lie_within_their_kernel_step(profiled):
    _, trace, _ = profiled
    kernels = {e["args"]["step_id"]: e for e in _spans_on(trace, "compute")}
    core_events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    assert core_events
    seen = set()
    for e in core_events:
        k = kernels[e["args"]["step_id"]]
        seen.add(e["args"]["step_id"])
        assert e["ts"] >= k["ts"] - EPS_US, (e, k)
        assert e["ts"] + e["dur"] <= k["ts"] + k["dur"] + EPS_US, (e, k)
        assert {"stage", "step_index", "stream", "step"} <= e["args"].keys()
        assert e["args"]["step"] == k["name"]
    assert seen == set(kernels)


def test_summary_figures(profiled):
    prof, trace, _ = profiled
    d = prof.summary
    start = min(r.start for r in prof.records)
    end = max(r.end for r in prof.records)
    assert d["total_s"] == pytest.approx(end - start, rel=1e-12, abs=0)
    assert set(d["busy_fraction"]) == set(UNITS)
    for u in UNITS:
        assert 0.0 <= d["busy_fraction"][u] <= 1.0
        assert 0.0 <= d["busy_s"][u] <= d["total_s"] * (1 + 1e-9)
    assert d["bound"] in UNITS
    assert d["busy_fraction"]["compute"] > 0 and d["busy_fraction"]["copy in"] > 0
    assert d["busy_fraction"]["load/store"] > 0
    # the core units run inside kernels, so never longer than the compute pipeline
    for u in CORE_UNITS:
        assert d["busy_s"][u] <= d["busy_s"]["compute"] * (1 + 1e-9)
    # the trace spans the same simulated time
    xs = [e for e in trace["traceEvents"] if e["ph"] in ("X", "i")]
    span_us = max(e["ts"] + e.get("dur", 0) for e in xs) - min(e["ts"] for e in xs)
    assert span_us == pytest.approx(d["total_s"] * 1e6, abs=EPS_US)
    text = format_summary(d)
    for u in UNITS:
        assert u in text
    assert f"bound: {d['bound']}" in text


# ---------------------------------------------------------------------------------------------
# the context manager


def test_profile_prints_summary_and_stops_recording(capsys, tmp_path):
    x, w, _ = _inputs()
    with spyre_jax.profile(tmp_path / "p.json") as prof:
        assert prof.recording
        assert any(r is prof.records for r in runtime().queues.recording)
        np.asarray(f(x, w))
    assert not prof.recording and _not_recording(prof)
    out = capsys.readouterr().out
    assert "spyre profile:" in out and "bound:" in out
    n = len(prof.records)
    np.asarray(f(x, w))  # after the block: not recorded
    assert len(prof.records) == n
    assert (tmp_path / "p.json").exists()


def test_profile_without_path_or_print(capsys):
    x, w, _ = _inputs()
    with spyre_jax.profile(print_summary=False) as prof:
        np.asarray(f(x, w))
    assert capsys.readouterr().out == ""
    assert [r.kind for r in prof.records] == ["copy_in", "copy_in", "run_kernel", "copy_out"]
    assert prof.trace["traceEvents"]
    assert prof.summary["kernels"] == 1


def test_profile_removes_recording_after_an_error(tmp_path):
    x, w, _ = _inputs()
    before = list(runtime().queues.recording)
    with pytest.raises(ValueError, match="boom"):
        with spyre_jax.profile(tmp_path / "err.json", print_summary=False) as prof:
            f(x, w)
            raise ValueError("boom")
    assert _not_recording(prof)
    assert len(runtime().queues.recording) == len(before)
    assert any(r.kind == "run_kernel" for r in prof.records)
    assert not (tmp_path / "err.json").exists()


def test_nested_profiles_remove_their_own_list():
    x, w, _ = _inputs()
    with spyre_jax.profile(print_summary=False) as outer:
        with spyre_jax.profile(print_summary=False) as inner:
            f(x, w)
        # the two lists hold the same steps (they compare equal); the inner one must go
        assert _not_recording(inner) and not _not_recording(outer)
        f(x, w)
    assert _not_recording(outer)
    assert len(outer.records) == 2 * len(inner.records)


# ---------------------------------------------------------------------------------------------
# chrome_trace and summary on hand-made records (the timing model's formula, exactly)


def _stage(name: str, unit: str, bw: float) -> dict[str, Any]:
    # two steps; L = loads, S = stores, C = compute, R = ring (step 1 forwards from core 1)
    L, S, C, R = [1000, 2000], [500, 500], [1e-6, 2e-6], [0.0, 0.5e-6]
    starts = [L[0] / bw + R[0]]
    starts.append(starts[0] + max(C[0], R[1], (L[1] + S[0]) / bw))
    end = starts[1] + max(C[1], S[1] / bw)
    return {
        "stage": name,
        "kind": "matmul" if unit == "PE" else "map",
        "unit": unit,
        "steps": 2,
        "time_s": end,
        "timeline": {
            "prologue_s": L[0] / bw + R[0],
            "first_load_s": L[0] / bw,
            "starts_s": starts,
            "memory_s": [(L[1] + S[0]) / bw, S[1] / bw],
            "compute_s": C,
            "load_bytes": L,
            "store_bytes": S,
            "ring_s": R,
            "cores": [(0, 1), (1, 10)],
            "bandwidth": bw,
        },
    }


def _records() -> tuple[list[StepRecord], float]:
    bw = 1e9  # 1 byte per ns
    st0, st1 = _stage("s0", "PE", bw), _stage("s1", "SFU", bw)
    kt = st0["time_s"] + st1["time_s"]
    recs = [
        StepRecord(0, "copy_in", "copy in a", 0, "copy in", 1e-6, 3e-6, 4096),
        StepRecord(
            1, "run_kernel", "run k", 0, "compute", 3e-6, 3e-6 + kt, detail={"stages": [st0, st1]}
        ),
        StepRecord(2, "record_event", "record event9", 0, None, 3e-6 + kt, 3e-6 + kt),
        StepRecord(3, "copy_out", "copy out b", 0, "copy out", 3e-6 + kt, 5e-6 + kt, 2048),
    ]
    return recs, kt


def test_chrome_trace_follows_the_timing_formula():
    recs, kt = _records()
    t = chrome_trace(recs)
    assert t["otherData"]["origin_s"] == 1e-6
    k0 = 2.0  # the kernel starts 2 us after the first step
    pe = _spans_on(t, "core 1 PE")
    # stage s0: prologue 1000 ns of loads; step 0 computes at 1 us for 1 us; step 1 at
    # 1 + max(1, 0.5, 2.5) = 3.5 us for 2 us
    assert [(e["ts"], e["dur"]) for e in pe] == [
        pytest.approx((k0 + 1.0, 1.0)),
        pytest.approx((k0 + 3.5, 2.0)),
    ]
    assert [e["args"]["step_index"] for e in pe] == [0, 1]
    assert [(e["ts"], e["dur"]) for e in _spans_on(t, "core 0 PE")] == [
        pytest.approx((k0 + 1.0, 1.0))
    ]
    ls = _spans_on(t, "core 1 load/store")
    assert [(e["ts"], e["dur"]) for e in ls[:3]] == [
        pytest.approx((k0, 1.0)),  # prologue: step 0's loads
        pytest.approx((k0 + 1.0, 2.5)),  # step 1's loads + step 0's stores
        pytest.approx((k0 + 3.5, 0.5)),  # step 1's stores
    ]
    ring = _spans_on(t, "core 10 ring")  # step 1's forwards, during step 0 (both stages)
    assert [(e["ts"], e["dur"]) for e in ring[:1]] == [pytest.approx((k0 + 1.0, 0.5))]
    assert len(ring) == 2
    assert "core 0 ring" not in set(_thread_names(t).values())
    # stage s1 starts where s0 ends
    s0_end = recs[1].detail["stages"][0]["time_s"] * 1e6
    assert [e["ts"] for e in _spans_on(t, "core 1 SFU")] == pytest.approx(
        [k0 + s0_end + 1.0, k0 + s0_end + 3.5]
    )
    names = set(_thread_names(t).values())
    assert {"core 0 SFU", "core 10 SFU", "core 10 load/store"} <= names
    assert not any(n.startswith("core 2 ") for n in names)
    inst = [e for e in t["traceEvents"] if e["ph"] == "i"]
    assert len(inst) == 1 and inst[0]["ts"] == pytest.approx(k0 + kt * 1e6)
    comp = _spans_on(t, "compute")
    assert comp[0]["dur"] == pytest.approx(kt * 1e6, abs=EPS_US)


def test_summary_on_hand_made_records():
    recs, kt = _records()
    d = summary(recs)
    total = 5e-6 + kt - 1e-6
    assert d["total_s"] == pytest.approx(total)
    assert d["busy_s"]["copy in"] == pytest.approx(2e-6)
    assert d["busy_s"]["compute"] == pytest.approx(kt)
    assert d["busy_s"]["PE"] == pytest.approx(3e-6)
    assert d["busy_s"]["SFU"] == pytest.approx(3e-6)
    assert d["busy_s"]["ring"] == pytest.approx(1e-6)
    assert d["busy_s"]["load/store"] == pytest.approx(2 * 4e-6)
    assert d["busy_fraction"]["compute"] == pytest.approx(kt / total)
    assert d["bound_pipeline"] == "compute"
    assert d["bound"] == "load/store"
    assert d["steps"] == {"copy_in": 1, "run_kernel": 1, "record_event": 1, "copy_out": 1}


def test_empty_and_out_of_range():
    d = summary([])
    assert d["total_s"] == 0 and d["bound"] == "none"
    assert all(v == 0 for v in d["busy_fraction"].values())
    assert "0 steps" in format_summary(d)
    assert chrome_trace([])["traceEvents"][0]["args"] == {"name": "spyre card"}
    recs, _ = _records()
    with pytest.raises(ValueError, match="core 10"):
        chrome_trace(recs, num_cores=8)


def test_an_nt_products_restickify_is_drawn_before_its_loads(tmp_path):
    # x @ w.T with w an argument: the card restickifies (MatmulStep.nt_form); the trace draws it
    # on the cores' load/store tracks first, then the first load, with no overlap
    x, w = np.ones((8, 64), np.float16), np.ones((96, 64), np.float16)
    h = spyre_jax.jit(lambda x, w: x @ w.T)
    h(x, w)
    path = tmp_path / "nt.json"
    with spyre_jax.profile(path, print_summary=False):
        np.asarray(h(x, w))
    with open(path, encoding="utf-8") as fh:
        trace = json.load(fh)
    names = _thread_names(trace)
    tracks = {names[(e["pid"], e["tid"])] for e in trace["traceEvents"] if e["ph"] == "X"}
    drawn = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].endswith("restickify")]
    assert drawn and all(e["args"]["phase"] == "restickify" for e in drawn)
    for track in tracks:
        _assert_no_overlap(_spans_on(trace, track), track)
    for e in drawn:
        later = [s for s in _spans_on(trace, names[(e["pid"], e["tid"])]) if s is not e]
        assert all(s["ts"] >= e["ts"] + e["dur"] - EPS_US for s in later if s["ts"] >= e["ts"])
