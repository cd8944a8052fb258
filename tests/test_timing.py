"""The timing model: calibration, the per-unit breakdown, and that figures follow parameters."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spyre_jax
from spyre_jax.tools.bench import SOFTMAX_MEASURED_US
from spyre_jax.tools.testing import assert_close


def _cost(f, *xs, card: spyre_jax.CardSpec | None = None) -> dict:
    spyre_jax.set_card(card or spyre_jax.CardSpec())
    try:
        return spyre_jax.jit(f).lower(*xs).compile().cost_analysis()
    finally:
        spyre_jax.set_card(spyre_jax.CardSpec())


_X = np.zeros((4096, 2048), np.float16)


def _softmax(x):
    return jax.nn.softmax(x, axis=-1)


def test_softmax_calibrated_within_30_percent():
    c = _cost(_softmax, _X)
    assert 0.7 * SOFTMAX_MEASURED_US <= c["sim_time_us"] <= 1.3 * SOFTMAX_MEASURED_US
    # what the model assumes to get there: one read and one write of the tensor
    assert c["device_bytes"] == 2 * _X.nbytes
    assert c["bound"] == "load/store"


def test_breakdown_is_consistent():
    for f, xs in [
        (_softmax, (_X,)),
        (lambda a, b: a @ b, (np.zeros((1024, 1024), np.float16),) * 2),
    ]:
        c = _cost(f, *xs)
        total = c["sim_time_us"]
        assert set(c["breakdown"]) == {"PE", "SFU", "load/store", "ring"}
        for u, b in c["breakdown"].items():
            assert 0.0 <= b["busy_fraction"] <= 1.0 + 1e-9, u
            assert b["busy_us"] + b["idle_us"] == pytest.approx(total), u
        busiest = max(c["breakdown"], key=lambda u: c["breakdown"][u]["busy_us"])
        assert c["bound"] == busiest


def test_memory_time_follows_bandwidth_parameters():
    base = _cost(_softmax, _X)
    card = spyre_jax.CardSpec()
    faster = _cost(
        _softmax,
        _X,
        card=card.replace(
            device_memory_bw=2 * card.device_memory_bw,
            memory_bw_one_way=2 * card.memory_bw_one_way,
            memory_bw_write_only=2 * card.memory_bw_write_only,
            memory_bw_balanced=2 * card.memory_bw_balanced,
            reduction_read_bw=2 * card.reduction_read_bw,
        ),
    )
    assert faster["breakdown"]["load/store"]["busy_us"] == pytest.approx(
        base["breakdown"]["load/store"]["busy_us"] / 2
    )
    # the softmax reads each byte once (a row reduction: at the reduction rate) and writes it
    # once, in flight together: the turnaround of an even mix on top
    n = float(_X.nbytes)
    expect = card.memory_seconds(n, n, card.reduction_read_bw) * 1e6
    assert base["breakdown"]["load/store"]["busy_us"] == pytest.approx(expect)
    harmonic = 2 / (1 / card.memory_bw_one_way + 1 / card.memory_bw_write_only)
    unmixed = _cost(_softmax, _X, card=card.replace(memory_bw_balanced=harmonic))
    assert unmixed["breakdown"]["load/store"]["busy_us"] == pytest.approx(
        (n / card.reduction_read_bw + n / card.memory_bw_write_only) * 1e6
    )


def test_bandwidth_follows_the_read_write_mix():
    card = spyre_jax.CardSpec()
    assert card.memory_bw(1.0) == pytest.approx(card.memory_bw_one_way)
    assert card.memory_bw(0.0) == pytest.approx(card.memory_bw_write_only)
    assert card.memory_bw(0.5) == pytest.approx(card.memory_bw_balanced)
    assert card.memory_bw_balanced < card.memory_bw(0.9) < card.memory_bw_one_way
    assert card.memory_bw_balanced < card.memory_bw(0.1) < card.memory_bw_write_only
    # the published rates (CARD.md): 150 read only, 125-140 write only, 104 for an even mix
    assert (card.memory_bw_one_way, card.memory_bw_balanced) == (150e9, 104e9)
    assert 125e9 <= card.memory_bw_write_only <= 140e9
    with pytest.raises(ValueError, match="memory_bw_balanced"):
        card.replace(memory_bw_balanced=0.99 * card.memory_bw_one_way)


def test_pe_time_follows_the_sustained_rate_and_the_array():
    a = np.zeros((1024, 1024), np.float16)
    card = spyre_jax.CardSpec()
    base = _cost(lambda a, b: a @ b, a, a)
    fast = _cost(
        lambda a, b: a @ b,
        a,
        a,
        card=card.replace(pe_macs_per_ns_per_core=2 * card.pe_macs_per_ns_per_core),
    )
    pe, pe2 = base["breakdown"]["PE"]["busy_us"], fast["breakdown"]["PE"]["busy_us"]
    # the sustained rate (1140 MAC/ns/core) is below the array's nominal one (1536): doubling
    # it leaves the array's 1536 as the cap
    assert pe > 0 and pe2 == pytest.approx(pe * 1140 / 1536, rel=0.02)
    # a slower clock caps the rate at the array's own
    slow = _cost(lambda a, b: a @ b, a, a, card=card.replace(clock_hz=card.clock_hz / 4))
    nominal = card.pe_flops_per_cycle_per_core * card.clock_hz / 4
    assert slow["breakdown"]["PE"]["busy_us"] == pytest.approx(
        pe * card.pe_flops_sustained_per_core / nominal, rel=0.02
    )
    # the PE work is at least the matmul's flops over the card's sustained rate
    assert pe * 1e-6 * card.bound_flops >= 2 * 1024**3 * 0.99


def test_sfu_time_follows_sfu_rate():
    x = np.zeros((512, 1024), np.float32)
    card = spyre_jax.CardSpec()
    base = _cost(lambda x: jnp.tanh(jnp.exp(x) * 3.0), x)
    fast = _cost(
        lambda x: jnp.tanh(jnp.exp(x) * 3.0),
        x,
        card=card.replace(sfu_elems_per_cycle=2 * card.sfu_elems_per_cycle),
    )
    assert fast["breakdown"]["SFU"]["busy_us"] == pytest.approx(
        base["breakdown"]["SFU"]["busy_us"] / 2
    )


def test_stage_timelines_add_up():
    c = _cost(lambda a, b: jnp.tanh(a @ b), *(np.zeros((512, 512), np.float16),) * 2)
    for st in c["stages"]:
        tl = st["timeline"]
        assert len(tl["starts_s"]) == st["steps"] == len(tl["cores"])
        assert tl["starts_s"][0] == pytest.approx(tl["prologue_s"])
        assert all(b >= a for a, b in zip(tl["starts_s"], tl["starts_s"][1:], strict=False))
        assert tl["starts_s"][-1] <= st["time_s"] + 1e-12


def test_ring_broadcast_is_a_multicast():
    # regression: a block forwarded from one core to all others was costed as 31 separate
    # point-to-point copies (16x the bytes on the busiest link)
    from device_model.timing import _ring_time

    card = spyre_jax.CardSpec()
    nbytes = 256 * 1024
    bcast = [(0, 0, d, nbytes) for d in range(1, 32)]
    one_link = nbytes / card.ring_bytes_per_cycle / card.clock_hz
    fixed = card.ring_fixed_s
    assert _ring_time(bcast, card) == pytest.approx(fixed + one_link)
    # two different operands from the same source do share the links
    two = bcast + [(1, 0, d, nbytes) for d in range(1, 32)]
    assert _ring_time(two, card) == pytest.approx(fixed + 2 * one_link)
    # a point-to-point copy over 3 hops loads each of its links once
    assert _ring_time([(0, 5, 8, nbytes)], card) == pytest.approx(fixed + one_link)
    # no transfer, no time (the fixed cost is a transfer step's)
    assert _ring_time([], card) == 0.0


def test_ring_fixed_cost_is_a_parameter_of_forwarding_kernels():
    # the ring's fixed cost per transfer step (torch-spyre's fitted ring term, 5 ns) is charged
    # to every step that forwards over the ring: a matmul's, not an elementwise kernel's
    import jax.numpy as jnp

    from device_model.timing import _ring_time

    card = spyre_jax.CardSpec()
    assert card.ring_fixed_s == pytest.approx(5e-9)
    slow = card.replace(ring_fixed_s=1e-3)
    shift = [(0, c, (c + 1) % 32, 4096) for c in range(32)]  # a uniform shift, p -> p+1
    assert _ring_time(shift, slow) - _ring_time(shift, card) == pytest.approx(1e-3 - 5e-9)
    a = jnp.ones((512, 512), jnp.float16)
    mm = spyre_jax.jit(lambda x, y: x @ y).lower(a, a).compile()
    add = spyre_jax.jit(lambda x, y: x + y).lower(a, a).compile()
    from device_model.timing import kernel_cost

    def us(c: Any, spec: Any) -> float:
        return kernel_cost(c.kernel, spec)["sim_time_us"]

    assert us(mm, slow) > us(mm, card) + 1e3  # at least one ring step of 1 ms
    assert us(add, slow) == pytest.approx(us(add, card))
    assert add.parameter_shares()["ring_fixed_s"] == 0.0


def test_published_kernels_within_15_percent():
    # every kernel time of CARD.md the model is held to (spyre_jax/tools/calibration_cases.py),
    # by the schedules our compiler makes: within max(15%, 1 us), RMS error per family at most
    # 10%; the fitted parameters' defaults are what the fit gives; each fitted on >= 2 points
    from spyre_jax.tools.bench_calibrate import FITTED, bench_calibrate
    from spyre_jax.tools.calibration_cases import CASES

    res = bench_calibrate()
    for name, r in res["cases"].items():
        assert r["within"] or r["apart"], (name, r)
        assert r["bound_ratio"] >= 1.0 - 1e-9 or r["family"] == "rates", (name, r)
    for fam, f in res["families"].items():
        assert f["rms_error"] <= 0.10, (fam, f)
    card = spyre_jax.CardSpec()
    assert res["fitted_parameters"] == len(FITTED) == 3
    for p, v in res["fitted"].items():
        assert getattr(card, p) == pytest.approx(v, rel=0.02), p
        fams = FITTED[p]
        assert sum(c.family in fams and not c.apart for c in CASES.values()) >= 2


def test_schedules_within_the_goal_of_the_bound():
    # issue 12's shapes, compiled (not run): every matmul schedule within 1.15x of the external
    # bound: square, Granite prefill, decode, attention's batched matmuls, GPT-2 and Llama-1B
    # and the demo's block and a Llama-3-8B layer (prefill 512) within 1.3x of the sum of their
    # stages' own bounds; the convolutions apart
    from spyre_jax.tools.bench_schedules import BLOCK_GOAL, BLOCKS, GOAL, bench_schedules

    res = bench_schedules()
    for name, r in res.items():
        assert r["unit"] in ("PE", "load/store", "ring", "SFU"), (name, r)
        if name in BLOCKS:
            assert 1.0 - 1e-9 <= r["stages_bound_ratio"] <= BLOCK_GOAL, (name, r)
            assert r["bound_us"] <= r["stages_bound_us"], (name, r)
        elif r["family"] == "conv":
            # ResNet-50's convolutions as implicit GEMMs (not held to the matmul goal): within
            # 2x but for the 3-channel stem, whose 64-element sticks hold 3 useful channels
            assert 1.0 - 1e-9 <= r["bound_ratio"], (name, r)
            assert "stem" in name or r["bound_ratio"] <= 2.0, (name, r)
        else:
            # square-2048 over the goal since the mix-dependent memory rates (issue 33): its
            # last round's 4 MiB of stores drain after the K loop, and the first round's
            # stores share the second round's loads (the turnaround); docs/benchmarks.md
            limit = 1.25 if name == "square-2048" else GOAL
            assert 1.0 - 1e-9 <= r["bound_ratio"] <= limit, (name, r)
    assert set(BLOCKS) <= set(res)
    # the schedules read the large prefill operands about once: traffic near the minimum
    big = res["prefill-512x4096x12800"]
    assert big["device_bytes"] <= 1.1 * big["min_device_bytes"]


def _mm16(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.float16)


def test_stores_drain_over_the_next_round():
    # an accumulating stage stores each round's blocks while the next round's K loop runs (its
    # output is double-buffered); a single-buffered output stores in the step itself
    from device_model.timing import _drain

    S = np.asarray([0.0, 0, 0, 8, 0, 0, 0, 8])
    np.testing.assert_allclose(_drain(S, 2), [0, 0, 0, 2, 2, 2, 2, 8])
    np.testing.assert_allclose(_drain(S, 1), S)
    np.testing.assert_allclose(_drain(np.asarray([4.0, 4, 4]), 2), [4, 4, 4])
    a = np.zeros((2048, 2048), np.float16)
    c = _cost(_mm16, a, a)
    mm = [s for s in c["stages"] if s["kind"] == "matmul"][0]
    stores = [b for b in mm["timeline"]["store_bytes"] if b]
    assert len(stores) >= 2  # several rounds: the first rounds' stores hide behind compute
    # the time is about the PE work plus the last round's stores, not plus all of them
    tail = stores[-1] / mm["timeline"]["bandwidth"]
    assert mm["time_s"] <= mm["compute_s"] + tail + 0.1 * mm["compute_s"]


def test_relayout_and_batched_rates():
    # a transpose that moves the stick dim runs at the published restickify rate (116 GB/s);
    # a batched matmul's PE rate is the measured batch-outer
    # rate (616 MAC/ns/core, below the sustained 1140)
    card = spyre_jax.CardSpec()
    x = np.zeros((2048, 2048), np.float16)
    base = _cost(lambda x: x.T, x)
    slow = _cost(lambda x: x.T, x, card=card.replace(relayout_bw=58e9))
    assert slow["memory_us"] == pytest.approx(2 * base["memory_us"], rel=0.02)
    assert base["memory_us"] == pytest.approx(
        base["device_bytes"] / card.relayout_bw * 1e6, rel=0.02
    )
    assert card.pe_flops_batched_per_core == 2 * 616e9 < card.pe_flops_sustained_per_core
    q = np.zeros((8, 256, 1024), np.float16)
    k = np.zeros((8, 1024, 256), np.float16)
    bmm = _cost(_mm16, q, k)
    half = card.replace(bmm_batch_outer_macs_per_ns_per_core=308.0)
    bmm2 = _cost(_mm16, q, k, card=half)
    pe, pe2 = bmm["breakdown"]["PE"]["busy_us"], bmm2["breakdown"]["PE"]["busy_us"]
    assert pe2 == pytest.approx(2 * pe, rel=0.02)
    # a plain matmul does not use the batched rate
    a = np.zeros((256, 1024), np.float16)
    b = np.zeros((1024, 256), np.float16)
    assert _cost(_mm16, a, b, card=half)["breakdown"]["PE"]["busy_us"] == pytest.approx(
        _cost(_mm16, a, b)["breakdown"]["PE"]["busy_us"]
    )


def test_m_fastest_tiles_compute_the_product():
    # a matmul whose tiles are dealt M fastest (the cores of a step share one rhs block, read
    # once) computes the same product: within one fp16 ulp of XLA's (K blocks summed in order)
    import lowering.tile_matmul as sch

    picked = []
    orig = sch.pick_tiling

    def spy(ctx, cands, build):
        st, tiling = orig(ctx, cands, build)
        picked.append(st)
        return st, tiling

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((128, 256)), jnp.float16)
    b = jnp.asarray(rng.standard_normal((256, 1024)), jnp.float16)
    mp = pytest.MonkeyPatch()
    mp.setattr(sch, "pick_tiling", spy)
    mp.setattr(sch, "_matmul_choices", {})  # searched, not taken from an earlier identical one
    try:
        got = np.asarray(spyre_jax.jit(_mm16)(a, b)).astype(np.float32)
    finally:
        mp.undo()
    st = picked[0]
    stores = np.asarray(st.stores).reshape(st.steps, -1)
    row = stores[np.flatnonzero((stores >= 0).any(axis=1))[0]]
    gn = st.grid[2]
    assert gn > 1 and row[1] - row[0] == gn  # neighbouring cores: the next M block, same N
    # the exact product rounded once to fp16 (half an ulp), plus the fp32 sums' own error
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    assert (np.abs(got - ref) <= 0.5 * ulp + 1e-4).all()
    assert_close(got, jax.jit(_mm16)(a, b), dtype=np.float16, check_dtype=False)


def test_identical_matmuls_are_tiled_once(monkeypatch):
    # the tiling search of a matmul is done once per signature: a model's identical layers
    # reuse it, and get the same tiling (the same simulated time per layer)
    import lowering.tile_matmul as sch

    calls = []
    orig = sch.pick_tiling

    def spy(ctx, cands, build):
        calls.append(1)
        return orig(ctx, cands, build)

    monkeypatch.setattr(sch, "pick_tiling", spy)
    monkeypatch.setattr(sch, "_matmul_choices", {})

    def layers(x, w1, w2, w3, w4):
        for w in (w1, w2, w3, w4):
            x = jnp.tanh(_mm16(x, w))
        return x

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float16)
    ws = [jnp.asarray(rng.standard_normal((256, 256)) / 16, jnp.float16) for _ in range(4)]
    c = spyre_jax.jit(layers).lower(x, *ws).compile()
    assert len(calls) == 1
    mm = [s for s in c.cost_analysis()["stages"] if "matmul" in str(s.get("kind", s))]
    assert len(mm) == 4 and len({round(s["time_s"], 12) for s in mm}) == 1
    want = np.asarray(jax.jit(layers)(x, *ws)).astype(np.float32)
    got = np.asarray(spyre_jax.jit(layers)(x, *ws)).astype(np.float32)
    assert_close(got, want, dtype=np.float16)  # fp16 ulps of values below 1


def test_parameter_shares_name_what_a_kernel_waits_for():
    # each parameter's share of a kernel's time (its elasticity): a batched matmul waits for
    # the batched PE rate, a softmax for device memory and the row-reduction rate, and
    # neither for the ring's rate or the re-layout's
    f16 = jnp.float16
    bmm = spyre_jax.jit(_mm16).lower(
        jax.ShapeDtypeStruct((8, 1024, 2048), f16), jax.ShapeDtypeStruct((8, 2048, 1024), f16)
    )
    sh = bmm.compile().parameter_shares()
    assert sh == bmm.parameter_shares()
    assert sh["bmm_batch_outer_macs_per_ns_per_core"] > 0.9
    assert sh["pe_macs_per_ns_per_core"] == 0.0 and sh["relayout_bw"] == 0.0
    sm = spyre_jax.jit(_softmax).lower(jax.ShapeDtypeStruct((1, 512, 4096), f16))
    sh = sm.compile().parameter_shares()
    assert sh["memory_bw_balanced"] > 0.5 and sh["reduction_read_bw"] > 0.3
    assert 0 < sh["reduction_fixed_s"] < 0.1 and 0 < sh["kernel_fixed_s"] < 0.05
    assert sh["bmm_batch_outer_macs_per_ns_per_core"] == 0.0
    assert "parameter_shares" not in sm.compile().cost_analysis()
