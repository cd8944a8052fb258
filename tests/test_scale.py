"""Whole models: stage programs shared by identical layers, weights that live once on the card.

* A kernel of many stages runs stage by stage, each stage a jitted program cached by its
  signature (``device_model.program.stage_program``): N identical layers compile one layer's
  stages. The staged run equals the one-program run and ``jax.jit`` on the CPU.
* A CPU model's parameters are copied into device memory on the first call and found there by
  every later call and every kernel (``torch_bridge.kernels.resident_parameter``); an in-place
  change of a parameter is seen.
* ``device_put`` owns its bytes: a later write to the host array does not reach the card.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import rng

import spyre_jax
from device_model import program
from lowering.passes import fuse_maps
from lowering.pipeline import compile_graph
from spyre_jax.tools.testing import assert_close
from torch_bridge import kernels as tk


def _layers(n: int):
    def f(x, ws):
        for i in range(n):
            h = jnp.tanh(x @ ws[i])
            x = x + jax.nn.softmax(h, axis=-1) * 0.5
        return x

    return f


def _inputs(n: int):
    r = rng(1)
    x = r.standard_normal((8, 64)).astype(np.float32)
    ws = [(r.standard_normal((64, 64)) / 8).astype(np.float32) for _ in range(n)]
    return x, ws


def test_identical_layers_compile_their_stages_once(fresh_card, monkeypatch):
    monkeypatch.setattr(program, "STAGED_MIN_STAGES", 4)
    n = 6
    x, ws = _inputs(n)
    jf = spyre_jax.jit(_layers(n))
    stages = len(jf.lower(x, ws).compile().executable.kernel.stages)
    assert stages >= 2 * n
    before = program.stage_cache_stats()
    got = np.asarray(jf(x, ws))
    after = program.stage_cache_stats()
    built = after["compiled"] - before["compiled"]
    reused = after["reused"] - before["reused"]
    assert built + reused == stages
    # the first layer and the last one may differ (no residual input / the final output);
    # every layer between them is one layer's stages again
    assert built <= 3 * stages // n, (built, stages)
    want = np.asarray(jax.jit(_layers(n))(x, ws))
    # fp32 products and sums (the PE accumulator), tanh keeping values in [-1, 1]: the oracle's
    # one-op fp32 tolerance (spyre_jax.tools.testing) holds
    assert_close(got, want)


def test_staged_run_equals_one_program(fresh_card, monkeypatch):
    n = 3
    x, ws = _inputs(n)
    kernel = spyre_jax.jit(_layers(n)).lower(x, ws).compile().executable.kernel
    args = [x, *ws]
    layouts = [kernel.tensor(name).layout for name in kernel.inputs]
    dev = [
        np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, lay.device_shape[-1] - a.shape[-1])])
        for a, lay in zip(args, layouts, strict=True)
    ]
    monkeypatch.setattr(program, "STAGED_MIN_STAGES", 10**6)
    whole = program.build_runner(kernel)
    monkeypatch.setattr(program, "STAGED_MIN_STAGES", 0)
    staged = program.build_runner(kernel)
    assert not hasattr(staged, "lower")  # a Python loop over cached stage programs
    for a, b in zip(whole(*dev), staged(*dev), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stage_signature_ignores_names_not_layouts(fresh_card):
    x, ws = _inputs(2)
    kernel = spyre_jax.jit(_layers(2)).lower(x, ws).compile().executable.kernel
    decls = {t.name: t for t in kernel.tensors}
    sig = {}
    for st in kernel.stages:
        key, _ = program._canonical(st, decls, kernel.num_cores, kernel.dl16)
        sig.setdefault(key, []).append(st.name)
    assert len(sig) < len(kernel.stages)  # the second layer repeats the first one's stages
    # another width is another signature
    x3, ws3 = (np.zeros((8, 128), np.float32), [np.zeros((128, 128), np.float32)] * 2)
    k3 = spyre_jax.jit(_layers(2)).lower(x3, ws3).compile().executable.kernel
    d3 = {t.name: t for t in k3.tensors}
    keys3 = {program._canonical(st, d3, k3.num_cores, k3.dl16)[0] for st in k3.stages}
    assert not keys3 & set(sig)


def test_fusion_of_a_deep_graph_takes_a_few_rounds_not_one_per_merge(fresh_card, monkeypatch):
    # the chain fusions of a whole graph are one forward pass, and the recomputations of
    # independent producers (every layer's softmax) go in one round: a few rounds (each with a
    # dead-node sweep) for the whole depth, not one per merge (quadratic in depth)
    from lowering import passes

    n = 12
    x, ws = _inputs(n)
    g = spyre_jax.jit(_layers(n)).lower(x, ws).graph
    card = spyre_jax.CardSpec()
    g = passes.to_maps(g, card)
    rounds = []
    real = passes.dce
    monkeypatch.setattr(passes, "dce", lambda graph: rounds.append(1) or real(graph))
    fused = fuse_maps(g, card)
    merged = len(g.nodes) - len(fused.nodes)
    assert merged >= 3 * n, merged
    assert len(rounds) <= 8, (len(rounds), merged)
    assert len(compile_graph(spyre_jax.jit(_layers(n)).lower(x, ws).graph, card).stages) >= n


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 128)
        self.b = torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_parameters_are_copied_in_once(fresh_card):
    torch.manual_seed(0)
    m = _MLP().half().eval()
    f = torch.compile(m, backend="spyre")
    x = torch.randn(4, 64).half()
    with torch.no_grad():
        f(x)
        first = tk.resident_stats()
        used = spyre_jax.memory_stats()["bytes_in_use"]
        for _ in range(3):
            y = f(x)
        assert tk.resident_stats() == first
        assert spyre_jax.memory_stats()["bytes_in_use"] == used
    assert first["parameters"] == 4
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert nbytes <= first["bytes"] <= nbytes + 4 * 128  # stick padding of the biases at most
    with torch.no_grad():
        want = m(x.float().half())
    assert_close(y, want)


def test_an_in_place_change_of_a_parameter_is_seen(fresh_card):
    torch.manual_seed(0)
    m = _MLP().eval()
    f = torch.compile(m, backend="spyre")
    x = torch.randn(4, 64)
    with torch.no_grad():
        f(x)
        m.b.bias.add_(1.0)
        got = f(x)
        want = m(x)
    assert_close(got, want)


@pytest.mark.slow
def test_a_parameter_copy_goes_with_its_parameter(fresh_card):
    import gc

    m = _MLP().eval()
    f = torch.compile(m, backend="spyre")
    with torch.no_grad():
        f(torch.randn(4, 64))
    assert tk.resident_stats()["parameters"] >= 4
    del f, m
    torch._dynamo.reset()
    gc.collect()
    assert tk.resident_stats()["parameters"] == 0


def test_device_put_owns_its_bytes(fresh_card):
    # regression: the device buffer was a view of the host array while no padding was needed
    x = np.ones((4, 64), np.float32)
    a = spyre_jax.device_put(x)
    x[:] = 5.0
    np.testing.assert_array_equal(np.asarray(a), np.ones((4, 64), np.float32))
    y = spyre_jax.jit(lambda v: v + 1)(a)
    np.testing.assert_array_equal(np.asarray(y), np.full((4, 64), 2.0, np.float32))


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Tty:
    def __init__(self):
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_progress_is_a_bar_on_a_terminal_after_a_few_seconds(monkeypatch):
    import logging

    from device_model.progress import QUIET_SECONDS, Progress

    monkeypatch.delenv("SPYRE_PROGRESS", raising=False)
    clock, tty = _Clock(), _Tty()
    with Progress(
        "gpt2: stages", 4, logging.getLogger("device_model"), stream=tty, clock=clock
    ) as p:
        p.update(compiled=1)
        assert tty.text == ""  # quick work shows nothing
        clock.t = QUIET_SECONDS + 1
        p.update(reused=1)
        assert "gpt2: stages: 2/4 (1 compiled, 1 reused)" in tty.text
        assert tty.text.startswith("\r[############............]")
    assert tty.text.endswith("\n")


def test_progress_logs_when_not_on_a_terminal(monkeypatch, caplog):
    import io
    import logging

    from device_model.progress import LOG_EVERY_SECONDS, QUIET_SECONDS, Progress

    monkeypatch.delenv("SPYRE_PROGRESS", raising=False)
    clock, out = _Clock(), io.StringIO()
    caplog.set_level(logging.INFO, logger="device_model")
    with Progress("m: stages", 3, logging.getLogger("device_model"), stream=out, clock=clock) as p:
        clock.t = QUIET_SECONDS + 1
        p.update(compiled=1)
        p.update(reused=1)  # within LOG_EVERY_SECONDS of the last line: not logged
        clock.t += LOG_EVERY_SECONDS
        p.update(reused=1)
    lines = [r.getMessage() for r in caplog.records if r.name == "device_model"]
    assert lines[0].startswith("m: stages: 1/3 (1 compiled)")
    assert lines[1].startswith("m: stages: 3/3 (1 compiled, 2 reused)")
    assert lines[-1].endswith("(done)")
    assert out.getvalue() == ""  # no bare writes off a terminal
    monkeypatch.setenv("SPYRE_PROGRESS", "0")
    caplog.clear()
    with Progress("m", 1, logging.getLogger("device_model"), stream=out, clock=clock) as p:
        clock.t += 100
        p.update()
    assert not caplog.records


@pytest.mark.slow
def test_a_model_too_big_for_the_card_fails_at_load_before_any_copy(small_card):
    # each weight fits the card, all of them together do not: DeviceOOMError when the graph is
    # loaded, naming the graph, with nothing copied in and nothing left allocated
    from device_model.memory import DeviceOOMError

    small_card(device_memory_bytes=80 * 1024, device_memory_ecc_bytes=16 * 1024)
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)]).eval()
    f = torch.compile(m, backend="spyre")
    before = spyre_jax.memory_stats()["bytes_in_use"]
    with torch.no_grad(), pytest.raises(Exception) as ei:
        f(torch.randn(2, 64))
    err = getattr(ei.value, "inner_exception", ei.value)  # Dynamo wraps backend errors
    assert isinstance(err, DeviceOOMError), repr(ei.value)
    assert "weights and inputs together" in str(err)
    assert err.requested > err.limit
    assert spyre_jax.memory_stats()["bytes_in_use"] == before
    assert tk.resident_stats()["parameters"] == 0
    torch._dynamo.reset()


@pytest.mark.slow
def test_jit_arguments_too_big_together_fail_before_any_copy(small_card):
    from device_model.memory import DeviceOOMError

    small_card(device_memory_bytes=80 * 1024, device_memory_ecc_bytes=16 * 1024)
    xs = [np.ones((64, 64), np.float32) for _ in range(5)]  # 16 KiB each, 80 KiB together
    with pytest.raises(DeviceOOMError, match="arguments and constants together"):
        spyre_jax.jit(lambda xs: sum(xs)).lower(xs)
    assert spyre_jax.memory_stats()["bytes_in_use"] == 0


def test_spyre_weights_are_read_in_place_not_copied_per_launch(fresh_card):
    # a model on the spyre device: each launch reads the weights' own bytes (a view of their
    # storage), so device memory holds them once and a call allocates only activations
    from torch_bridge.operands import as_card_buffer

    torch.manual_seed(0)
    cpu = _MLP().half().eval()
    m = _MLP().half().eval()
    m.load_state_dict(cpu.state_dict())
    m = m.to("spyre")
    f = torch.compile(m, backend="spyre")
    x = torch.randn(4, 64).half()
    xs = x.to("spyre")
    with torch.no_grad():
        f(xs)
        used = spyre_jax.memory_stats()["bytes_in_use"]
        y = f(xs)
        del y
        assert spyre_jax.memory_stats()["bytes_in_use"] == used
        w = m.a.weight
        b1, b2 = as_card_buffer(w), as_card_buffer(w)
        assert b1 is b2 and b1.is_view and b1.addr == b1._base.addr
        # a write to the weight is seen by the next launch (a new view of the new bytes)
        m.a.weight.mul_(0.5)
        cpu.a.weight.mul_(0.5)
        assert as_card_buffer(m.a.weight) is not b1
        got = f(xs).cpu()
        want = cpu(x)
    assert_close(got, want)


def test_views_only_where_the_bytes_are_the_card_layout(fresh_card):
    from torch_bridge.operands import as_card_buffer

    padded = torch.randn(4, 100).half().to("spyre")  # rows of 100 fp16: padded to 128 on card
    strided = torch.randn(64, 64).half().to("spyre").t()
    wide = torch.randn(64).long().to("spyre")  # int64 is int32 on the card
    for t in (padded, strided, wide):
        b = as_card_buffer(t)
        assert not b.is_view
        b.delete()
    ok = torch.randn(3, 64).half().to("spyre")[1:]  # a contiguous slice at an offset
    b = as_card_buffer(ok)
    assert b.is_view
    np.testing.assert_array_equal(np.asarray(b.payload()), ok.cpu().numpy())


def test_a_staged_run_drops_each_intermediate_after_its_last_reader(fresh_card):
    n = 3
    x, ws = _inputs(n)
    kernel = spyre_jax.jit(_layers(n)).lower(x, ws).compile().executable.kernel
    decls = {t.name: t for t in kernel.tensors}
    steps = [
        (st.output.tensor, *program.stage_program(st, decls, kernel.num_cores, kernel.dl16))
        for st in kernel.stages
    ]
    groups = program._alias_groups(kernel)
    frees = program._last_uses(kernel, steps, groups)
    dropped = [m for f in frees for m in f]
    assert len(dropped) == len(set(dropped))
    outs = {m for o in kernel.outputs for m in groups.get(o, (o,))}
    written = {out for out, *_ in steps}
    assert not outs & set(dropped)
    assert written - outs <= set(dropped)  # every intermediate goes before the run ends
    for i, f in enumerate(frees):  # ... and only after its last reader
        for m in f:
            later = {n for _, _, reads, _ in steps[i + 1 :] for n in reads}
            assert not {m, *groups.get(m, ())} & later


def test_warm_staged_runs_hand_the_heap_back_before_big_stages(fresh_card, monkeypatch):
    """A warm run trims the heap before each stage of a large working set and once at its end
    (the host's peak is then the big stage's, not that plus the freed pages before it); the
    results are the one-program run's."""
    n = 2
    x, ws = _inputs(n)
    kernel = spyre_jax.jit(_layers(n)).lower(x, ws).compile().executable.kernel
    layouts = [kernel.tensor(name).layout for name in kernel.inputs]
    dev = [
        np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, lay.device_shape[-1] - a.shape[-1])])
        for a, lay in zip([x, *ws], layouts, strict=True)
    ]
    monkeypatch.setattr(program, "STAGED_MIN_STAGES", 10**6)
    want = [np.asarray(a) for a in program.build_runner(kernel)(*dev)]
    monkeypatch.setattr(program, "STAGED_MIN_STAGES", 0)
    monkeypatch.setattr(program, "BIG_STAGE_BYTES", 0)  # every stage is big
    trims = []
    monkeypatch.setattr(program, "release_free_memory", lambda: trims.append(1))
    staged = program.build_runner(kernel)
    staged(*dev)  # the first run: compiles (and trims after each new program)
    trims.clear()
    for _ in range(2):
        for a, b in zip(want, staged(*dev), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
    # every stage but the first is preceded by a trim, and each run ends with one
    assert len(trims) == 2 * len(kernel.stages)


def test_a_stage_reading_a_model_input_shares_the_program_of_one_reading_an_intermediate(
    fresh_card,
):
    # regression: a tensor's role was part of a stage's signature, so a layer whose residual is
    # a model input (the first) or an output (the last) compiled programs of its own although the
    # program is the same function of arrays of the same layouts
    x, ws = _inputs(4)
    kernel = spyre_jax.jit(_layers(4)).lower(x, ws).compile().executable.kernel
    decls = {t.name: t for t in kernel.tensors}
    keys = [program._canonical(st, decls, kernel.num_cores, kernel.dl16)[0] for st in kernel.stages]
    per_layer = len(keys) // 4
    assert len(keys) == 4 * per_layer
    first, *rest = [keys[i * per_layer : (i + 1) * per_layer] for i in range(4)]
    assert all(layer == first for layer in rest)


def test_compiled_programs_are_dropped_before_the_process_runs_out_of_mappings(
    fresh_card, monkeypatch
):
    # regression: each XLA CPU program holds some six memory mappings; a long test run (or a
    # long-lived server) compiling thousands of kernels reached Linux's limit of 65530 and the
    # next compile died in LLVM with a segmentation fault (CI: a crashed pytest worker)
    x, ws = _inputs(2)
    f = spyre_jax.jit(_layers(2))
    want = np.asarray(f(x, ws))
    monkeypatch.setattr(program, "MAP_CHECK_EVERY", 1)
    monkeypatch.setattr(program, "MAP_BUDGET", 0.0)  # always over budget: drop at every build
    monkeypatch.setitem(program._map_state, "floor", 0)
    before = program._map_state["cleared"]
    assert program.guard_mappings()
    assert program.stage_cache_stats()["cached"] == 0
    got = spyre_jax.jit(_layers(2))(x, ws)  # compiles again and gives the same result
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(f(x, ws)), want)  # an older function still runs
    assert program._map_state["cleared"] > before
    # what a drop could not free raises the bar for the next one (no drop at every build)
    assert program._map_state["floor"] > 0
    assert not program.guard_mappings()
