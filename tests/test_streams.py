"""Streams, events, effect tokens, races and the pipelines of the simulated card."""

from __future__ import annotations

import contextlib
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import spyre_jax
from device_model.runtime import runtime
from device_model.streams import Queues, StepRecord
from spyre_jax.errors import RaceError, RaceWarning, StreamError
from spyre_jax.tools.testing import assert_close


@contextlib.contextmanager
def recorded():
    """The steps submitted inside, as the timeline keeps them."""
    q = runtime().queues
    recs: list[StepRecord] = []
    q.recording.append(recs)
    try:
        yield recs
    finally:
        q.recording.remove(recs)


pytestmark = pytest.mark.usefixtures("fresh_card")


def _overlap(a: StepRecord, b: StepRecord) -> float:
    return max(0.0, min(a.end, b.end) - max(a.start, b.start))


_f = spyre_jax.jit(lambda x: jnp.tanh(x) * 2.0)


def _x(seed: int = 0, shape=(256, 512)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


# ---------------------------------------------------------------------------------------------
# streams and priorities


def test_stream_ids_follow_the_card():
    lo, hi = spyre_jax.Stream(), spyre_jax.Stream(priority="high")
    assert 1 <= lo.id <= 32 and 33 <= hi.id <= 64
    assert spyre_jax.Stream(priority=-1).id >= 33 and spyre_jax.Stream(priority=0).id <= 32
    assert spyre_jax.default_stream().id == 0
    assert spyre_jax.current_stream().id == 0
    with spyre_jax.stream(hi):
        assert spyre_jax.current_stream() == hi
        with spyre_jax.stream(lo):
            assert spyre_jax.current_stream() == lo
        assert spyre_jax.current_stream() == hi
    assert spyre_jax.current_stream().id == 0


@pytest.mark.parametrize("bad", [5, "urgent", 1.5, None])
def test_priority_out_of_range(bad):
    with pytest.raises(ValueError, match="priority"):
        spyre_jax.Stream(priority=bad)


def test_stream_pool_exhausted_then_reused():
    streams = [spyre_jax.Stream(priority="high") for _ in range(32)]
    with pytest.raises(StreamError, match="33-64"):
        spyre_jax.Stream(priority="high")
    streams[5].destroy()
    assert spyre_jax.Stream(priority="high").id == streams[5].id


def test_destroyed_stream_refuses_everything():
    s = spyre_jax.Stream()
    y = None
    with spyre_jax.stream(s):
        y = _f(_x())
    s.destroy()
    before = spyre_jax.memory_stats()["bytes_in_use"]
    with pytest.raises(StreamError, match="destroyed"):
        s.record_event()
    with pytest.raises(StreamError, match="destroyed"):
        with spyre_jax.stream(s):
            pass
    with pytest.raises(StreamError, match="destroyed"):
        s.synchronize()
    assert spyre_jax.memory_stats()["bytes_in_use"] == before
    # the card is still usable, and the destroyed stream's result is complete and readable
    np.testing.assert_allclose(np.asarray(y), np.asarray(_f(_x())), rtol=0, atol=0)
    with pytest.raises(StreamError, match="default stream"):
        spyre_jax.default_stream().destroy()


def test_wait_on_event_never_recorded():
    s = spyre_jax.Stream()
    e = spyre_jax.Event()
    tok = s.token
    with pytest.raises(StreamError, match="never recorded"):
        s.wait_event(e)
    assert s.token == tok  # nothing was submitted


def test_stream_context_rejects_non_streams():
    with pytest.raises(TypeError, match="spyre_jax.Stream"):
        with spyre_jax.stream(3):
            pass


# ---------------------------------------------------------------------------------------------
# effect tokens


def test_tokens_are_values_threaded_by_steps():
    s = spyre_jax.Stream()
    t0 = s.token
    with spyre_jax.stream(s):
        y = _f(_x())
    t1 = s.token
    assert t1.stream == s.id and t1.seq == t0.seq + 2  # copy in, run kernel
    assert t1.time > t0.time
    assert t0.seq == 0  # the old token is unchanged: tokens are immutable values
    e = s.record_event()
    assert e.token == s.token and e.recorded
    other = spyre_jax.Stream()
    other.wait_event(e)
    assert dict(other.token.clock)[s.id] == e.token.seq  # the event handed s's order over
    assert other.token.time >= e.token.time
    del y


def test_queues_unit_level_race_and_event():
    q = Queues()
    a = q.open_stream("low")
    b = q.open_stream("low")
    q.submit(a, "run_kernel", "producer", writes=(0x100,), duration=1e-6)
    with pytest.raises(RaceError, match="producer") as ei:
        q.submit(b, "run_kernel", "consumer", reads=(0x100,), duration=1e-6)
    assert "consumer" in str(ei.value) and f"stream {a}" in str(ei.value)
    from device_model.streams import Event

    e = Event()
    q.record(a, e)
    q.wait(b, e)
    tok = q.submit(b, "run_kernel", "consumer", reads=(0x100,), duration=1e-6)
    assert tok.time >= 2e-6  # after the producer on the shared compute queue


# ---------------------------------------------------------------------------------------------
# races planted and caught


def test_race_without_event_is_caught_and_state_is_unchanged():
    s1, s2 = spyre_jax.Stream(), spyre_jax.Stream()
    with spyre_jax.stream(s1):
        a = _f(_x())
    before = spyre_jax.memory_stats()
    tok = s2.token
    with spyre_jax.stream(s2):
        with pytest.raises(RaceError) as ei:
            _f(a)
    msg = str(ei.value)
    assert f"stream {s1.id}" in msg and f"stream {s2.id}" in msg and "run fn" in msg
    after = spyre_jax.memory_stats()
    assert after["bytes_in_use"] == before["bytes_in_use"]
    assert after["num_live_allocs"] == before["num_live_allocs"]
    assert s2.token == tok


def test_same_program_with_event_is_accepted():
    s1, s2 = spyre_jax.Stream(), spyre_jax.Stream()
    with spyre_jax.stream(s1):
        a = _f(_x())
        e = s1.record_event()
    s2.wait_event(e)
    with spyre_jax.stream(s2):
        b = _f(a)
    ref = np.tanh(np.tanh(_x().astype(np.float32)) * 2) * 2
    assert_close(b, ref, dtype=np.float16, check_dtype=False)


def test_host_synchronize_orders_streams():
    s1, s2 = spyre_jax.Stream(), spyre_jax.Stream()
    with spyre_jax.stream(s1):
        a = _f(_x())
    s1.synchronize()
    with spyre_jax.stream(s2):
        _f(a)  # no race: the host saw s1 finish before submitting this
    with spyre_jax.stream(s1):
        c = _f(_x(1))
    c.block_until_ready()  # waits for the step that writes c
    with spyre_jax.stream(s2):
        _f(c)


def test_device_put_then_other_stream_needs_an_event():
    s = spyre_jax.Stream()
    w = spyre_jax.device_put(_x())  # copy in on stream 0
    with spyre_jax.stream(s):
        with pytest.raises(RaceError, match="copy in"):
            _f(w)
    spyre_jax.synchronize()
    with spyre_jax.stream(s):
        _f(w)


def test_race_mode_warn():
    s1, s2 = spyre_jax.Stream(), spyre_jax.Stream()
    with spyre_jax.stream(s1):
        a = _f(_x())
    assert spyre_jax.set_race_mode("warn") == "raise"
    with spyre_jax.stream(s2):
        with pytest.warns(RaceWarning, match="race"):
            b = _f(a)
    assert b.shape == a.shape
    spyre_jax.set_race_mode("off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with spyre_jax.stream(s2):
            _f(_f(a))
    with pytest.raises(ValueError, match="race mode"):
        spyre_jax.set_race_mode("sometimes")


def test_reading_a_result_on_the_host_uses_its_stream():
    s = spyre_jax.Stream()
    with spyre_jax.stream(s):
        a = _f(_x())
    with recorded() as recs:
        np.asarray(a)  # never a race: the copy out goes on the stream that wrote it
    (co,) = [r for r in recs if r.kind == "copy_out"]
    assert co.stream == s.id and co.pipeline == "copy out"
    assert co.nbytes == a.layout.nbytes


# ---------------------------------------------------------------------------------------------
# pipelines: what only a model of the card can answer


def test_two_models_compute_serializes_copies_overlap():
    f1 = spyre_jax.jit(lambda x: jnp.tanh(x @ x.T))
    f2 = spyre_jax.jit(lambda x: jax_gelu(x) * 3.0)
    s1, s2 = spyre_jax.Stream(), spyre_jax.Stream(priority="high")
    x1, x2 = _x(1, (512, 512)), _x(2, (1024, 1024))
    f1(x1), f2(x2)  # compile outside the recording
    spyre_jax.synchronize()
    with recorded() as recs:
        for _ in range(2):
            with spyre_jax.stream(s1):
                f1(x1)
            with spyre_jax.stream(s2):
                f2(x2)
    kernels = [r for r in recs if r.kind == "run_kernel"]
    copies = [r for r in recs if r.kind == "copy_in"]
    assert len(kernels) == 4 and len(copies) == 4
    assert {k.stream for k in kernels} == {s1.id, s2.id}
    # one compute queue: kernels from the two streams never overlap
    for i, a in enumerate(kernels):
        for b in kernels[i + 1 :]:
            assert _overlap(a, b) == 0.0, (a, b)
    # separate copy pipeline: some copy of one stream overlaps a kernel of the other
    cross = [(c, k) for c in copies for k in kernels if c.stream != k.stream and _overlap(c, k) > 0]
    assert cross, "no copy overlapped the other model's compute"


def jax_gelu(x):
    import jax

    return jax.nn.gelu(x)


def test_pipelined_batches_take_max_not_sum():
    # a kernel about as long as the copy-in of its batch: the case where overlap pays most
    w = spyre_jax.device_put(_x(3, (1, 1024)))
    f = spyre_jax.jit(lambda w, x: jnp.tanh(x * w))
    batches = [_x(10 + i, (1024, 1024)) for i in range(6)]
    f(w, batches[0]).block_until_ready()  # compile
    spyre_jax.synchronize()  # the weights' copy-in is done before either stream reads them
    copy_s, comp_s = spyre_jax.Stream(), spyre_jax.Stream()
    outs = []
    with recorded() as recs:
        for b in batches:
            with spyre_jax.stream(copy_s):
                xb = spyre_jax.device_put(b)
                e = copy_s.record_event()
            comp_s.wait_event(e)
            with spyre_jax.stream(comp_s):
                outs.append(f(w, xb))
        spyre_jax.synchronize()
    copies = [r for r in recs if r.kind == "copy_in"]
    kernels = [r for r in recs if r.kind == "run_kernel"]
    n = len(batches)
    c = copies[0].end - copies[0].start
    k = kernels[0].end - kernels[0].start
    t0 = min(r.start for r in recs)
    total = max(r.end for r in recs) - t0
    # a software pipeline: n x max(copy, compute) plus one of the other, not n x (copy + compute)
    assert total == pytest.approx(n * max(c, k) + min(c, k), rel=1e-6)
    assert total < 0.8 * n * (c + k)
    # and the results are right
    assert 0.3 < k / c < 3
    ref = np.tanh(batches[-1].astype(np.float32) * _x(3, (1, 1024)).astype(np.float32))
    assert_close(outs[-1], ref, dtype=np.float16, check_dtype=False)


def test_recipe_is_printable_and_typed():
    c = _f.lower(_x()).compile()
    kinds = [s.kind for s in c.recipe.steps]
    assert kinds == ["copy_in", "run_kernel", "copy_out"]
    text = str(c.recipe)
    assert "copy_in" in text and "run_kernel" in text and "us" in text
    assert c.recipe.steps[0].seconds == pytest.approx(
        c.recipe.steps[0].nbytes / spyre_jax.CardSpec().pcie_bw
    )


def test_reused_stream_id_still_catches_races():
    # regression: a destroyed stream's id restarted its count at 0, so clocks that had seen the
    # old stream's steps took the new stream's writes as seen
    q = Queues()
    a = q.open_stream("low")
    for i in range(3):
        q.submit(a, "copy_in", f"old{i}", writes=(0x200 + i,))
    q.destroy(a)
    b = q.open_stream("low")
    assert b == a
    q.submit(b, "copy_in", "new", writes=(0x100,))
    with pytest.raises(RaceError, match="new"):
        q.submit(0, "run_kernel", "k", reads=(0x100,))
