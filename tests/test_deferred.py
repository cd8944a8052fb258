"""The eager device's lazy trace (``device_model.deferred``): a launch's card program waits in
its card's trace and runs with the next ones when a value is needed; values, memory, streams
and errors are as if each had run at its launch."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import spyre_jax
from device_model import deferred
from device_model.deferred import Deferred, DeferredRunError, Trace
from device_model.runtime import runtime
from spyre_jax.tools.testing import assert_close
from torch_bridge import storage


def _trace() -> Trace:
    return runtime().trace


def _warm(*fns) -> None:
    """Run each once: a program's first launch runs at once (it compiles there)."""
    for f in fns:
        f().cpu()


def test_a_chain_of_ops_is_recorded_and_runs_when_the_host_reads_it():
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    a, b = x.to("spyre"), w.to("spyre")

    def chain():
        return ((a * 2 + b).relu() @ b) - a

    _warm(chain)
    tr = _trace()
    tr.flush()
    runs, traces = tr.counts["runs"], tr.counts["traces"]
    out = chain()
    assert tr.counts["runs"] - runs == 5 and len(tr) == 5  # mul, add, relu, matmul, sub
    assert tr.counts["traces"] == traces  # nothing ran yet
    assert type(storage.region(out).card_value()) is Deferred
    got = out.cpu()  # the host reads: the trace runs, in order
    assert len(tr) == 0 and tr.counts["traces"] == traces + 1
    assert_close(got, ((x * 2 + w).relu() @ w) - x)


def test_a_deferred_result_has_the_bits_of_one_run_at_its_launch(monkeypatch):
    x = torch.randn(32, 64, dtype=torch.float16)
    a = x.to("spyre")

    def f():
        return (a.float().exp() * 0.5).to(torch.float16) + a

    _warm(f)
    _trace().flush()
    deferred_bits = f().cpu()
    monkeypatch.setattr(deferred, "MAX_RUNS", 1)  # every run at its launch
    assert torch.equal(f().cpu(), deferred_bits)


def test_the_trace_runs_when_it_is_full(monkeypatch):
    monkeypatch.setattr(deferred, "MAX_RUNS", 3)
    a = torch.randn(16, 64).to("spyre")
    _warm(lambda: a + 1.0)
    tr = _trace()
    tr.flush()
    traces = tr.counts["traces"]
    outs = [a + float(i) for i in range(7)]
    assert tr.counts["traces"] == traces + 2 and len(tr) == 1
    for i, o in enumerate(outs):
        torch.testing.assert_close(o.cpu(), a.cpu() + i)


def test_a_host_write_runs_the_deferred_reads_of_its_bytes_first():
    x = torch.randn(128, 64)
    a = x.to("spyre")
    _warm(lambda: a * 3.0)
    _trace().flush()
    b = a * 3.0  # deferred; reads a's host bytes
    assert len(_trace()) == 1
    a.copy_(torch.zeros(128, 64))  # the host writes them: the run above goes first
    assert len(_trace()) == 0
    torch.testing.assert_close(b.cpu(), x * 3.0)
    assert bool((a.cpu() == 0).all())


def test_synchronize_runs_the_trace():
    a = torch.randn(8, 64).to("spyre")
    _warm(lambda: a - 1.0)
    a - 1.0
    assert len(_trace()) >= 1
    torch.spyre.synchronize()
    assert len(_trace()) == 0


def test_a_compiled_graph_takes_a_deferred_result():
    x = torch.randn(32, 64)
    a = x.to("spyre")
    _warm(lambda: a * 2.0)
    _trace().flush()
    y = a * 2.0
    assert type(storage.region(y).card_value()) is Deferred
    f = torch.compile(lambda t: torch.softmax(t, -1), backend="spyre")
    assert_close(f(y), torch.softmax(x * 2.0, -1))


def test_a_result_dropped_before_its_run_is_not_kept():
    a = torch.randn(64, 64).to("spyre")
    _warm(lambda: a + 2.0)
    tr = _trace()
    tr.flush()
    before = spyre_jax.memory_stats()["bytes_in_use"]
    for _ in range(10):
        a + 2.0  # each result dies at once: its device memory goes, its run holds no value
    assert spyre_jax.memory_stats()["bytes_in_use"] == before
    batch = tr.batch
    tr.flush()
    assert batch.values == []  # every run finished where it ran (synchronous dispatch)


def test_results_read_from_other_threads():
    a = torch.randn(64, 64).to("spyre")
    want = a.cpu()
    _warm(lambda: a * 2.0 + 1.0)
    errors: list[BaseException] = []

    def work(k: float) -> None:
        try:
            outs = [a * 2.0 + k for _ in range(20)]
            for o in outs:
                torch.testing.assert_close(o.cpu(), want * 2.0 + k)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(float(k),)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_failed_run_raises_where_the_trace_runs_and_from_each_later_result():
    tr = Trace()
    calls = {"n": 0}

    def prog(x):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("boom")
        return [x + 1]

    one = jnp.ones(4)
    first = tr.call(prog, [one], 1)  # the first call runs now
    assert not isinstance(first[0], Deferred)
    a = tr.call(prog, [one], 1)[0]
    b = tr.call(prog, [a], 1)[0]  # fails when the trace runs
    c = tr.call(prog, [b], 1)[0]
    assert all(type(d) is Deferred for d in (a, b, c))
    with pytest.raises(ValueError, match="boom"):
        c.block_until_ready()
    np.testing.assert_array_equal(np.asarray(a), np.full(4, 2.0))  # ran before the failure
    for d in (b, c):
        with pytest.raises(DeferredRunError, match="boom"):
            d.value()
    assert len(tr) == 0 and tr.batch.values is None
    d = tr.call(prog, [one], 1)[0]  # the trace goes on
    np.testing.assert_array_equal(np.asarray(d), np.full(4, 2.0))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_eager_op_error_leaves_the_trace_and_memory_as_they_were():
    a = torch.randn(8, 64).to("spyre")
    bad = torch.randn(3, 3).to("spyre")
    _warm(lambda: a + 1.0)
    _trace().flush()
    y = a + 1.0
    before = spyre_jax.memory_stats()["bytes_in_use"]
    with pytest.raises(RuntimeError):
        a @ bad
    assert spyre_jax.memory_stats()["bytes_in_use"] == before
    torch.testing.assert_close(y.cpu(), a.cpu() + 1.0)
    torch.testing.assert_close((y * 2.0).cpu(), (a.cpu() + 1.0) * 2.0)
