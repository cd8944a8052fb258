"""The timing model: calibration, the per-unit breakdown, and that figures follow parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spyre_jax
from spyre_jax.tools.bench import SOFTMAX_MEASURED_US


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
            memory_bw_balanced=2 * card.memory_bw_balanced,
        ),
    )
    assert faster["breakdown"]["load/store"]["busy_us"] == pytest.approx(
        base["breakdown"]["load/store"]["busy_us"] / 2
    )
    # the softmax reads and writes each byte once: an even mix, at the balanced rate
    expect = 2 * _X.nbytes / card.memory_bw_balanced * 1e6
    assert base["breakdown"]["load/store"]["busy_us"] == pytest.approx(expect)
    mixed = _cost(_softmax, _X, card=card.replace(memory_bw_balanced=card.memory_bw_one_way))
    assert mixed["breakdown"]["load/store"]["busy_us"] == pytest.approx(
        2 * _X.nbytes / card.memory_bw_one_way * 1e6
    )


def test_bandwidth_follows_the_read_write_mix():
    card = spyre_jax.CardSpec()
    assert card.memory_bw(1.0) == card.memory_bw(0.0) == card.memory_bw_one_way
    assert card.memory_bw(0.5) == pytest.approx(card.memory_bw_balanced)
    assert card.memory_bw_balanced < card.memory_bw(0.9) < card.memory_bw_one_way
    with pytest.raises(ValueError, match="memory_bw_balanced"):
        card.replace(memory_bw_balanced=2 * card.memory_bw_one_way)


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
    assert _ring_time(bcast, card) == pytest.approx(one_link)
    # two different operands from the same source do share the links
    two = bcast + [(1, 0, d, nbytes) for d in range(1, 32)]
    assert _ring_time(two, card) == pytest.approx(2 * one_link)
    # a point-to-point copy over 3 hops loads each of its links once
    assert _ring_time([(0, 5, 8, nbytes)], card) == pytest.approx(one_link)


def test_published_kernels_within_15_percent():
    # every published kernel measurement (CARD.md), by the schedules our compiler makes: the
    # softmax and the three Granite prefill matmuls, each within 15% of the card's time
    from spyre_jax.tools.bench_calibrate import bench_calibrate

    for name, r in bench_calibrate().items():
        assert 0.85 <= r["model_over_measured"] <= 1.15, (name, r)
        assert r["bound_ratio"] >= 1.0 - 1e-9, (name, r)
