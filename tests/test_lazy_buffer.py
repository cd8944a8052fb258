"""One lazy buffer (``device_model.runtime.DeviceBuffer`` and ``device_model.payload``): one
payload state per buffer, its transitions, the two host operations (materialize before a read,
settle readers before a write), the one launch every path goes through, the one fit check, and
the one-op kernel cache below both frontends (``lowering.loading``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

import spyre_jax
from device_model import launching
from device_model import runtime as rtm
from device_model.card import CardSpec
from device_model.deferred import Deferred
from device_model.launching import launch
from device_model.layout import layout_for
from device_model.memory import DeviceOOMError
from device_model.payload import (
    Deleted,
    HostBytes,
    OnCard,
    PendingRun,
    Unwritten,
    state_of,
)
from device_model.runtime import DeviceBuffer, copy_in, runtime
from lowering.from_jaxpr import from_jaxpr
from lowering.loading import OP_KERNELS, OpKernels, OpKey, check_fits, load
from torch_bridge import card_cat, storage

ROOT = Path(__file__).resolve().parent.parent


def _layout(shape=(8, 64), dtype="float32"):
    return layout_for(shape, dtype, runtime().card.stick_bytes)


def _add_one(shape=(8, 64)):
    spec = jax.ShapeDtypeStruct(shape, np.float32)
    return load(from_jaxpr(jax.make_jaxpr(lambda x: x + 1.0)(spec), name="add_one"))


def _small_card(usable: int) -> CardSpec:
    return CardSpec(device_memory_bytes=2 * usable, device_memory_ecc_bytes=usable)


class _Reader:
    """A run in flight that reads host bytes: records when the host waits for it."""

    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def is_ready(self) -> bool:
        return False

    def block_until_ready(self) -> _Reader:
        self.log.append(self.name)
        return self


# ---------------------------------------------------------------------------------------------
# states and transitions


def test_a_buffer_holds_one_state_from_allocation_to_deletion():
    lay = _layout()
    b = DeviceBuffer.allocate(lay.nbytes, lay)
    assert type(b.state) is Unwritten and b.payload() is None
    b.store(np.zeros(lay.device_shape, np.float32))
    assert type(b.state) is HostBytes and not b.shared_with_host
    b.store(jax.numpy.ones(lay.device_shape))
    assert type(b.state) is OnCard
    b.delete()
    assert type(b.state) is Deleted and not b.alive
    with pytest.raises(RuntimeError, match="deleted"):
        b.payload()
    with pytest.raises(RuntimeError, match="deleted"):
        b.materialize()
    b.delete()  # idempotent


def test_state_of_picks_the_state_by_the_payload():
    assert type(state_of(np.zeros(3))) is HostBytes
    assert state_of(np.zeros(3), shared=True).shared
    assert type(state_of(jax.numpy.zeros(3))) is OnCard
    assert type(state_of((jax.numpy.zeros(3), np.zeros(2, np.int32)))) is OnCard  # a view source
    assert type(state_of(None)) is Unwritten
    with pytest.raises(AttributeError):
        state_of(np.zeros(3)).shared = True  # frozen


def test_a_launch_adopts_a_resident_host_payload_as_a_card_array_once():
    exe = _add_one()
    lay = exe.in_layouts[0]
    x = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    b = copy_in(x, lay)
    assert type(b.state) is HostBytes
    (out,) = launch(exe, [b])
    assert type(b.state) is OnCard  # the same bytes, as a card array, for the next launches
    assert type(out.state) is OnCard
    np.testing.assert_array_equal(rtm.copy_out(out), x + 1)


def test_a_deferred_launch_leaves_a_pending_run_that_a_host_read_materializes():
    exe = _add_one()
    x = np.ones((8, 64), np.float32)
    launch(exe, [x], defer=True)  # a program's first launch runs at once (it compiles)
    (out,) = launch(exe, [x], defer=True)
    assert type(out.state) is PendingRun and type(out.payload()) is Deferred
    assert len(runtime().trace) >= 1
    host = out.materialize()
    assert type(out.state) is HostBytes and out.state.shared
    assert len(runtime().trace) == 0  # the trace ran for it
    np.testing.assert_array_equal(host[:, :64], x + 1)
    assert out.materialize() is host  # host bytes stay as they are
    # through a frontend's own byte layout
    (out2,) = launch(exe, [x], defer=True)
    flat = out2.materialize(lambda a: np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    assert flat.dtype == np.uint8 and flat.ndim == 1


def test_a_view_lives_and_dies_with_its_base_and_reads_its_base_readers():
    lay = _layout()
    base = DeviceBuffer.allocate(lay.nbytes, lay, payload=np.zeros(lay.device_shape, np.float32))
    base.track_readers()
    v = DeviceBuffer.view(base, lay, base.payload())
    assert v.is_view and v.shared_with_host and v.addr == base.addr
    log: list[str] = []
    v.add_reader(_Reader(log, "r1"))  # recorded with the base: its writer waits for it
    assert base.has_readers()
    v.delete()  # a view frees nothing
    assert base.alive
    base.settle_readers()
    assert log == ["r1"] and not base.has_readers()
    base.delete()
    assert not v.alive
    with pytest.raises(RuntimeError):
        v.payload()


def test_a_buffer_without_a_record_waits_for_its_reader_at_once():
    lay = _layout()
    b = DeviceBuffer.allocate(lay.nbytes, lay)
    log: list[str] = []
    b.add_reader(_Reader(log, "r"))
    assert log == ["r"] and not b.has_readers()


def test_settle_readers_waits_for_each_reader_once_in_order_of_need():
    lay = _layout()
    b = DeviceBuffer.allocate(lay.nbytes, lay)
    b.track_readers()
    log: list[str] = []
    for k in range(3):
        b.add_reader(_Reader(log, f"r{k}"))
    b.settle_readers()
    b.settle_readers()
    assert sorted(log) == ["r0", "r1", "r2"]


# ---------------------------------------------------------------------------------------------
# the torch storage over the buffer


def test_a_torch_result_is_a_pending_run_until_the_host_reads_it():
    x = torch.randn(16, 64)
    a = x.to("spyre")
    (a * 2.0).cpu()  # the program's first run (it compiles there)
    runtime().trace.flush()
    y = a * 2.0
    r = storage.region(y)
    assert type(r.buf.state) is PendingRun
    assert r.pending.shape == (16, 64) and r.pending.dtype == torch.float32
    got = y.cpu()  # host read: materialized as torch's bytes
    assert type(r.buf.state) is HostBytes and r.buf.state.shared and r.pending is None
    torch.testing.assert_close(got, x * 2.0)


def test_a_torch_host_write_waits_for_the_launches_reading_the_bytes():
    x = torch.randn(64, 64)
    a = x.to("spyre")
    r = storage.region(a)
    log: list[str] = []
    r.buf.add_reader(_Reader(log, "kernel"))
    a.fill_(3.0)  # the host writes the bytes: the reader goes first
    assert log == ["kernel"] and not r.buf.has_readers()
    assert bool((a.cpu() == 3.0).all())


def test_a_whole_copy_on_the_card_shares_the_result_state():
    a = torch.randn(32, 64).to("spyre")
    b = torch.empty(32, 64, device="spyre")
    b.copy_(a + 1.0)
    rb = storage.region(b)
    assert rb.pending is not None and type(rb.buf.state) in (OnCard, PendingRun)
    torch.testing.assert_close(b.cpu(), a.cpu() + 1.0)
    assert type(rb.buf.state) is HostBytes


# ---------------------------------------------------------------------------------------------
# the one launch


def test_every_path_launches_through_device_model_launch(monkeypatch):
    calls: list[str] = []
    real = launching.LaunchRecord._run

    def counting(rec, *a, **k):
        calls.append(rec.exe.name)
        return real(rec, *a, **k)

    monkeypatch.setattr(launching.LaunchRecord, "_run", counting)
    # spyre_jax.jit
    f = spyre_jax.jit(lambda v: v * 2.0)
    np.testing.assert_allclose(np.asarray(f(np.ones((4, 64), np.float32))), 2.0)
    assert calls
    # torch.compile
    n = len(calls)
    g = torch.compile(lambda t: t + 1.0, backend="spyre")
    torch.testing.assert_close(g(torch.ones(4, 64).to("spyre")).cpu(), torch.full((4, 64), 2.0))
    assert len(calls) > n
    # an eager op
    n = len(calls)
    t = torch.randn(4, 64).to("spyre")
    (t - 1.0).cpu()
    assert len(calls) > n
    # cat on a size bucket (once its sizes vary)
    cats = card_cat.stats()["card_cats"]
    k = torch.randn(1, 5, 32).to("spyre")
    for _ in range(4):
        k = torch.cat([k, torch.randn(1, 1, 32).to("spyre")], dim=1)
    assert card_cat.stats()["card_cats"] > cats
    assert any(c.startswith("cat x2") for c in calls)
    assert k.shape == (1, 9, 32)


def test_an_oom_in_a_launch_leaves_no_buffer_allocated(fresh_card):
    spyre_jax.set_card(_small_card(1 << 20))
    try:
        exe = _add_one((64, 256))  # 64 KiB in, 64 KiB out
        mem = runtime().memory
        free = mem.stats()["largest_free_block"]
        # leave room for the argument's copy in but not for the output
        hog = DeviceBuffer.allocate(free - exe.in_layouts[0].nbytes - mem.alignment)
        before = mem.stats()["bytes_in_use"]
        with pytest.raises(DeviceOOMError):
            launch(exe, [np.ones((64, 256), np.float32)])
        assert mem.stats()["bytes_in_use"] == before  # the copied-in argument was freed too
        mem.check_invariants()
        hog.delete()
        (out,) = launch(exe, [np.ones((64, 256), np.float32)])  # and the card goes on
        np.testing.assert_array_equal(rtm.copy_out(out), 2.0)
    finally:
        spyre_jax.set_card(CardSpec())


def test_a_failed_run_frees_the_outputs_it_allocated(monkeypatch):
    exe = _add_one()
    mem = runtime().memory
    before = mem.stats()["bytes_in_use"]

    def boom(*a):
        raise ValueError("boom")

    monkeypatch.setattr(exe, "_runner", boom)
    with pytest.raises(ValueError, match="boom"):
        launch(exe, [np.ones((8, 64), np.float32)])
    assert mem.stats()["bytes_in_use"] == before
    mem.check_invariants()


# ---------------------------------------------------------------------------------------------
# the one fit check, and the one-op kernel cache


def test_the_fit_check_refuses_before_anything_is_allocated(fresh_card):
    big = jax.ShapeDtypeStruct((4096, 4096), np.float32)  # 64 MiB
    graph = from_jaxpr(jax.make_jaxpr(lambda x: x * 2.0)(big), name="big")
    spyre_jax.set_card(_small_card(1 << 24))
    try:
        before = runtime().memory.stats()["bytes_in_use"]
        with pytest.raises(DeviceOOMError, match="big: its weights and inputs together"):
            check_fits(graph, together="its weights and inputs")
        with pytest.raises(DeviceOOMError):
            load(graph)
        assert runtime().memory.stats()["bytes_in_use"] == before
    finally:
        spyre_jax.set_card(CardSpec())


def test_the_op_kernel_cache_compiles_once_per_key():
    cache = OpKernels()
    spec = jax.ShapeDtypeStruct((8, 64), np.float32)
    builds = []

    def build():
        builds.append(1)
        return from_jaxpr(jax.make_jaxpr(lambda x: x - 1.0)(spec), name="sub_one")

    key = OpKey("sub", "(*,)", (("T", (8, 64), "float32"),), runtime())
    a = cache.get_or_load(key, build)
    b = cache.get_or_load(key, build)
    assert a is b and len(builds) == 1 and key in cache
    assert cache.stats() == {"compiles": 1, "hits": 1, "entries": 1}
    other = OpKey("sub", "(*,)", (("T", (8, 64), "float16"),), runtime())
    assert cache.get(other) is None
    cache.forget([key])
    assert len(cache) == 0


def test_eager_ops_share_the_kernel_cache_below_the_frontends():
    a = torch.randn(8, 64).to("spyre")
    (a * 5.0).cpu()
    keys = [k for k in list(OP_KERNELS._kernels) if k.op == "aten.mul.Tensor"]
    assert keys
    for k in keys:  # plain data: no torch object in the key
        assert type(k.op) is str and type(k.structure) is str
        for e in k.args:
            assert all(type(v).__module__ != "torch" for v in e)


def test_the_op_kernel_cache_is_usable_without_torch_bridge():
    code = textwrap.dedent(
        """
        import sys
        import jax
        import numpy as np
        from device_model.launching import launch
        from device_model.runtime import copy_out, runtime
        from lowering.from_jaxpr import from_jaxpr
        from lowering.loading import OP_KERNELS, OpKey

        spec = jax.ShapeDtypeStruct((8, 64), np.float32)
        key = OpKey("neg", "(*,)", (("T", (8, 64), "float32"),), runtime())
        build = lambda: from_jaxpr(jax.make_jaxpr(lambda x: -x)(spec), name="neg")
        exe = OP_KERNELS.get_or_load(key, build)
        assert OP_KERNELS.get_or_load(key, build) is exe
        x = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
        (out,) = launch(exe, [x], defer=True)
        np.testing.assert_array_equal(copy_out(out), -x)
        bad = [m for m in ("torch_bridge", "torch", "spyre_jax") if m in sys.modules]
        assert not bad, bad
        print("ok")
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")
