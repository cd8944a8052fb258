"""Tests for the device-memory allocator (device_model/memory.py)."""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from device_model.card import DEFAULT_CARD
from device_model.memory import DeviceMemory, DeviceOOMError

MiB = 2**20
GB = 10**9

STATS_KEYS = {
    "bytes_in_use",
    "peak_bytes_in_use",
    "bytes_limit",
    "bytes_reserved",
    "num_allocs",
    "num_live_allocs",
    "largest_alloc_size",
    "largest_free_block_bytes",
    "largest_free_block",
}


def test_alignment_and_rounding():
    m = DeviceMemory(MiB)
    addrs = [m.alloc(n) for n in (1, 127, 128, 129, 0, 0, 1000)]
    assert all(a % 128 == 0 for a in addrs)
    assert len(set(addrs)) == len(addrs)  # zero-byte requests still get distinct addresses
    assert [m.size_of(a) for a in addrs] == [128, 128, 128, 256, 128, 128, 1024]
    assert m.stats()["bytes_in_use"] == sum(m.live().values()) == 1920
    m.check_invariants()


def test_other_alignment():
    m = DeviceMemory(4096, alignment=512)
    a, b = m.alloc(1), m.alloc(600)
    assert (a, b) == (0, 512) and m.size_of(b) == 1024
    m.check_invariants()


def test_negative_size_is_value_error():
    m = DeviceMemory(MiB)
    with pytest.raises(ValueError):
        m.alloc(-1)
    assert m.stats()["num_allocs"] == 0


def test_reuse_after_free():
    m = DeviceMemory(MiB)
    a = m.alloc(1000)
    b = m.alloc(1000)
    m.free(a)
    assert a not in m and b in m
    assert m.alloc(900) == a  # best fit: the freed hole, not the big tail
    m.check_invariants()


def test_best_fit_picks_smallest_hole():
    m = DeviceMemory(MiB)
    a = m.alloc(1024)
    m.alloc(128)
    b = m.alloc(256)
    m.alloc(128)
    m.free(a)
    m.free(b)
    assert m.alloc(200) == b
    m.check_invariants()


def test_coalescing_three_adjacent():
    m = DeviceMemory(4096)
    a, b, c = m.alloc(1024), m.alloc(1024), m.alloc(1024)
    guard = m.alloc(1024)  # fills the rest, so the three cannot merge with the tail
    assert m.stats()["largest_free_block"] == 0
    for addr in (a, c, b):  # free the middle last: it must merge both sides
        m.free(addr)
        m.check_invariants()
    assert m._free == [(0, 3072)]
    assert m.stats()["largest_free_block_bytes"] == 3072
    assert m.alloc(3072) == a
    m.free(guard)
    m.check_invariants()


def test_oom_error_and_state_unchanged():
    m = DeviceMemory(112 * GB)
    m.alloc(10**6)
    before = m.stats()
    live_before = m.live()
    with pytest.raises(DeviceOOMError) as info:
        m.alloc(200 * GB)
    err = info.value
    assert isinstance(err, MemoryError)
    msg = str(err)
    assert "200.00 GB" in msg and str(200 * GB) in msg
    assert "1.00 MB in use" in msg and "112.00 GB" in msg
    assert "largest free block" in msg
    assert (err.requested, err.in_use, err.limit) == (200 * GB, 10**6 - 10**6 % 128 + 128, 112 * GB)
    assert err.largest_free == before["largest_free_block_bytes"]
    assert m.stats() == before and m.live() == live_before
    m.check_invariants()


def test_oom_from_fragmentation():
    m = DeviceMemory(1024)
    addrs = [m.alloc(128) for _ in range(8)]
    for a in addrs[::2]:
        m.free(a)
    assert m.stats()["bytes_in_use"] == 512
    with pytest.raises(DeviceOOMError) as info:
        m.alloc(256)  # 512 bytes free, but no hole larger than 128
    assert info.value.largest_free == 128


def test_allocate_many_success_and_rollback():
    m = DeviceMemory(4096)
    keep = m.alloc(1024)
    addrs = m.allocate_many([100, 200, 300], tag="batch")
    assert len(set(addrs)) == 3 and all(m.tag_of(a) == "batch" for a in addrs)
    for a in addrs:
        m.free(a)
    before, live_before = m.stats(), m.live()
    with pytest.raises(DeviceOOMError):
        m.allocate_many([1024, 1024, 1024, 0])  # 3072 bytes free: the last unit does not fit
    assert m.stats() == before and m.live() == live_before
    assert keep in m
    m.check_invariants()


def test_allocate_many_rolls_back_partial():
    m = DeviceMemory(4096)
    m.alloc(1024)
    before, live_before, free_before = m.stats(), m.live(), list(m._free)
    with pytest.raises(DeviceOOMError):
        m.allocate_many([1024, 1024, 1024, 128])
    assert m.stats() == before and m.live() == live_before and m._free == free_before
    with pytest.raises(ValueError):
        m.allocate_many([128, -5])
    assert m.stats() == before
    m.check_invariants()


def test_double_free_and_unknown_address():
    m = DeviceMemory(MiB)
    a = m.alloc(10)
    m.free(a)
    with pytest.raises(ValueError, match="not a live allocation"):
        m.free(a)
    with pytest.raises(ValueError):
        m.free(12345)
    m.check_invariants()


def test_store_load_and_free_drops_payload():
    m = DeviceMemory(MiB)
    x = jnp.arange(16, dtype=jnp.float32)
    a = m.alloc(x.nbytes)
    assert m.load(a) is None
    m.store(a, x)
    assert m.load(a) is x
    with pytest.raises(ValueError):
        m.store(a, jnp.zeros(1024, jnp.float32))  # 4 KB payload into a 128-byte region
    m.free(a)
    assert a not in m._payload
    with pytest.raises(ValueError):
        m.load(a)
    with pytest.raises(ValueError):
        m.store(a, x)
    b = m.alloc(x.nbytes)
    assert b == a and m.load(b) is None  # reuse does not resurrect the old payload


def test_stats_keys_and_counters():
    m = DeviceMemory(MiB)
    s = m.stats()
    assert set(s) == STATS_KEYS
    assert s["bytes_limit"] == MiB and s["bytes_reserved"] == 0
    assert s["largest_free_block"] == s["largest_free_block_bytes"] == MiB
    a = m.alloc(1000)
    b = m.alloc(5000)
    m.free(b)
    s = m.stats()
    assert s["num_allocs"] == 2  # cumulative
    assert s["num_live_allocs"] == 1
    assert s["largest_alloc_size"] == 5120
    assert s["peak_bytes_in_use"] == 1024 + 5120
    assert s["bytes_in_use"] == 1024
    m.reset_peak()
    assert m.stats()["peak_bytes_in_use"] == 1024
    m.free(a)
    assert m.stats()["peak_bytes_in_use"] == 1024


def test_card_capacity_is_cheap():
    m = DeviceMemory.for_card(DEFAULT_CARD)
    assert m.capacity == 112 * GB and m.alignment == 128
    t0 = time.perf_counter()
    big = m.alloc(100 * GB, tag="weights")
    rest = m.alloc(12 * GB)
    assert time.perf_counter() - t0 < 0.1
    assert m.stats()["bytes_in_use"] == 112 * GB and m.stats()["largest_free_block"] == 0
    m.free(big)
    m.free(rest)
    assert m._free == [(0, 112 * GB)]
    m.check_invariants()


def test_capacity_rounded_down_to_alignment():
    m = DeviceMemory(1000)
    assert m.capacity == 896
    m.check_invariants()
    with pytest.raises(ValueError):
        DeviceMemory(100)


def test_threads_do_not_corrupt():
    m = DeviceMemory(MiB)

    def worker(seed: int) -> None:
        mine = []
        for i in range(300):
            try:
                mine.append(m.alloc((seed * 37 + i * 101) % 5000))
            except DeviceOOMError:
                pass
            if i % 3 == 2:
                m.free(mine.pop(0))
        for a in mine:
            m.free(a)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.check_invariants()
    assert m.stats()["bytes_in_use"] == 0 and m.stats()["num_allocs"] > 0


def _check_state(m: DeviceMemory) -> None:
    m.check_invariants()
    live = sorted(m.live().items())
    for (a, sa), (b, _) in zip(live, live[1:], strict=False):
        assert a + sa <= b, "live regions overlap"
    assert all(a % 128 == 0 and s % 128 == 0 for a, s in live)
    s = m.stats()
    assert s["bytes_in_use"] <= s["bytes_limit"]
    assert s["bytes_in_use"] <= s["peak_bytes_in_use"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(0, 10_000)),
            st.tuples(st.just("free"), st.integers(0, 10**6)),
            st.tuples(st.just("many"), st.lists(st.integers(0, 10_000), max_size=4)),
        ),
        max_size=80,
    )
)
def test_random_sequence(ops):
    m = DeviceMemory(64 * 1024)  # small enough that OOMs happen
    peak = 0
    for kind, arg in ops:
        before = m.stats()
        if kind == "alloc":
            try:
                a = m.alloc(arg)
                assert m.size_of(a) >= arg
            except DeviceOOMError:
                assert m.stats() == before
        elif kind == "many":
            try:
                m.allocate_many(arg)
            except DeviceOOMError:
                assert m.stats() == before
        elif m.live():
            addrs = sorted(m.live())
            m.free(addrs[arg % len(addrs)])
        _check_state(m)
        assert m.stats()["peak_bytes_in_use"] >= peak
        peak = m.stats()["peak_bytes_in_use"]


class AllocatorMachine(RuleBasedStateMachine):
    """Model-based: a plain dict of address -> size mirrors the allocator."""

    def __init__(self) -> None:
        super().__init__()
        self.m = DeviceMemory(MiB)
        self.model: dict[int, int] = {}
        self.peak = 0

    @rule(n=st.integers(0, 10_000), big=st.booleans())
    def alloc(self, n: int, big: bool) -> None:
        n = n * 40 if big else n  # up to 400 KB, so a 1 MiB device runs out
        before = self.m.stats()
        try:
            a = self.m.alloc(n)
        except DeviceOOMError as e:
            assert e.requested == n and e.largest_free < max(128, -(-n // 128) * 128)
            assert self.m.stats() == before
            return
        assert a not in self.model
        self.model[a] = self.m.size_of(a)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(sorted(self.model)))
        self.m.free(a)
        del self.model[a]
        with pytest.raises(ValueError):
            self.m.free(a)

    @invariant()
    def consistent(self) -> None:
        _check_state(self.m)
        assert self.m.live() == self.model
        s = self.m.stats()
        assert s["bytes_in_use"] == sum(self.model.values())
        assert s["peak_bytes_in_use"] >= self.peak
        self.peak = s["peak_bytes_in_use"]


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
