"""The command line: the demo, the benchmarks and the fuzzer run and report what the README
says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from device_model.card import CardSpec
from spyre_jax.tools import bench, bench_eager, cli, coverage_common


@pytest.mark.slow
def test_demo_prints_figures_and_writes_trace(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert cli.main(["demo", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    for label in (
        "max |spyre - jax.jit(cpu)|",
        "simulated time on the card",
        "cores used",
        "scratchpad peak",
        "padding waste",
        "device-memory traffic",
        str(path),
        "bound:",
    ):
        assert label in out, label
    err = float(out.split("max |spyre - jax.jit(cpu)|")[1].split()[0])
    assert err < 0.05  # fp16 block, outputs of magnitude ~4
    torch_part = out.split("PyTorch part")[1]
    assert "card kernels / CPU fallbacks" in torch_part
    assert torch_part.split("card kernels / CPU fallbacks")[1].split()[2] == "0"
    terr = float(torch_part.split("max |spyre - torch eager(cpu)|")[1].split()[0])
    assert terr < 0.05
    trace = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"stream 0", "compute", "copy in", "copy out"} <= names


def test_demo_trace_goes_to_the_temporary_directory_by_default(monkeypatch):
    # a run in a checkout leaves no trace file in it: without --trace the demo writes to the
    # system's temporary directory; --trace PATH goes where asked
    import os
    import tempfile

    from spyre_jax.tools import demo

    assert demo.DEFAULT_TRACE == os.path.join(tempfile.gettempdir(), "spyre-demo-trace.json")
    asked: list[object] = []
    monkeypatch.setattr(demo, "run_demo", lambda trace: asked.append(trace))
    assert cli.main(["demo"]) == 0
    assert cli.main(["demo", "--trace", "elsewhere.json"]) == 0
    assert asked == [demo.DEFAULT_TRACE, "elsewhere.json"]


def test_bench_launch_and_softmax_json(capsys):
    # the bench's keys and the ratio it derives (few calls: the figures are not compared)
    res = bench.bench_launch(calls=50, reps=2)
    assert set(res) == {
        "launch_us",
        "jax_dispatch_us",
        "ratio",
        "launch_with_kernel_us",
        "jax_dispatch_64_us",
        "with_kernel_ratio",
    }
    # wall-clock figures, reported by the bench, not compared here: under the full suite on 2
    # workers the launch alone has measured above the launch with its kernel (83.8 vs 73.5 us)
    assert res["launch_us"] > 0 and res["jax_dispatch_us"] > 0
    assert res["launch_with_kernel_us"] > 0
    assert res["with_kernel_ratio"] == pytest.approx(
        res["launch_with_kernel_us"] / res["jax_dispatch_64_us"]
    )
    assert cli.main(["bench", "softmax", "--json"]) == 0
    sm = json.loads(capsys.readouterr().out)
    assert sm["measured_us"] == 390.0
    assert sm["ratio"] == pytest.approx(sm["model_us"] / 390.0)


@pytest.mark.slow
def test_bench_sim_json(capsys):
    assert cli.main(["bench", "sim", "--json", "--reps", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res) == {"matmul_1024", "matmul_1024_mixed", "demo_block"}
    for v in res.values():
        assert v["sim_s"] > 0 and v["native_s"] > 0
        assert v["ratio"] == pytest.approx(v["sim_s"] / v["native_s"])


def test_cli_module_loads_no_torch_jax_equinox():
    # the command line starts (--help, argument errors) without the heavy frameworks: cli.py on
    # its own loads none of torch, JAX, equinox; through the package (spyre_jax/__init__ is the
    # JAX user surface, so it loads JAX) still no torch or equinox
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('spyre_cli', {cli.__file__!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "assert not any(m in sys.modules for m in ('torch', 'jax', 'equinox')), 'cli.py alone'\n"
        "import spyre_jax.tools.cli\n"
        "assert not any(m in sys.modules for m in ('torch', 'equinox')), 'through spyre_jax'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_help_exits_zero_and_lists_the_commands():
    r = subprocess.run(
        [sys.executable, "-m", "spyre_jax", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for cmd in ("coverage", "demo", "bench", "fuzz"):
        assert cmd in r.stdout, cmd
    assert "the demo, the benchmarks and the fuzzer" in " ".join(r.stdout.split())


def test_bench_memory_peak_sees_a_short_peak():
    # regression: the host peak was sampled by a thread every 20 ms, which misses an allocation
    # made and freed while the main thread holds the GIL; the kernel's own peak record does not
    import numpy as np

    from spyre_jax.tools import bench_models

    if bench_models._hwm_bytes() is None or not bench_models._reset_hwm():
        pytest.skip("no resettable peak-RSS record (Linux /proc/self/clear_refs)")
    with bench_models._PeakRSS() as mem:
        a = np.ones(96 << 20, np.uint8)
        del a
    assert mem.added >= 90 << 20


def test_coverage_description_is_coverage_common_first_line():
    assert cli.COVERAGE_DESCRIPTION == coverage_common.__doc__.split("\n")[0]


@pytest.mark.slow
def test_bench_models_json(capsys):
    # shortened, narrowed models through the same harness the full-size benchmark uses (one
    # subprocess per model): a language model and a vision model (32x32 images; the ResNet's
    # convolutions, batch norms and pooling on the card; the ViT is test_conv's); an unknown
    # name is a ValueError naming the known ones
    names = ["gpt2-small", "resnet-50"]
    argv = ["bench", "models", "--models", ",".join(names), "--tiny", "--layers", "1"]
    assert cli.main([*argv, "--seq", "8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res) == names
    for r in res.values():
        assert "error" not in r, r
        for key in (
            "params",
            "cold_compile_s",
            "sim_prefill_us",
            "sim_wall_s",
            "eager_cpu_s",
            "sim_over_eager",
            "scratchpad_peak_bytes",
            "device_memory_peak_bytes",
            "host_peak_rss_bytes",
            "fallbacks",
            "cosine",
            "max_abs_err",
        ):
            assert key in r, key
        assert r["fallbacks"] == 0 and r["cosine"] >= 0.999 and r["sim_prefill_us"] > 0
    assert res["resnet-50"]["layers"] == 2  # a block in each of the tiny ResNet's two stages
    with pytest.raises(ValueError, match="gpt2-small"):
        cli.main(["bench", "models", "--models", "nope"])


@pytest.mark.slow
def test_bench_serve_dynamic_cache_json(capsys):
    # the default (dynamic) cache: decode kernels per bucket of the KV length; a prompt of
    # another length compiles at most its prefill and one bucket
    argv = ["bench", "serve", "--models", "llama-tiny", "--layers", "1", "--seq", "8"]
    assert cli.main([*argv, "--tokens", "4", "--cache", "dynamic", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["llama-tiny"]
    assert r["cache"] == "dynamic" and r["fallbacks"] == 0 and r["tokens_equal"] == 4
    assert r["compiles_other_prompt"] <= 2 and r["sim_decode_us_per_token"] > 0


def _check_eager_json(r: dict) -> None:
    assert r["op"]["add_host_us"] > 0 and r["op"]["add_cpu_us"] > 0
    g = r["generate"]
    assert g["tokens_equal"] == 3 and g["fallbacks"] == 0 and g["runs_agree"]
    assert g["compiles_warm"] == 0 and g["compiles_cold"] > 0
    assert g["compiles_other_prompt"] == 0  # 4 and 9 tokens: buckets the first call compiled
    assert g["compiles_inside_prompt"] == 0 and g["inside_prompt"] == 2
    # the simulated card's XLA programs are counted (the cold call compiles every kernel's)
    assert g["host_programs_cold"] >= g["compiles_cold"] > 0
    assert g["host_programs_inside_prompt"] >= 0 and g["host_programs_other_prompt"] >= 0
    assert g["generate_warm_s"] > 0 and g["warm_over_cpu"] > 0
    d = r["decoding"]
    assert set(d) == {"greedy", "sample", "beam3"}
    assert all(v["fallbacks"] == 0 and v["card_ms_per_token"] > 0 for v in d.values())
    assert all(v["rounds"] == 1 for v in d.values())  # --reps rounds of the strategies in turn
    assert d["beam3"]["tokens_equal_cpu"] and d["greedy"]["tokens_equal_cpu"]


@pytest.mark.slow
def test_bench_eager_json_and_against_a_revision(monkeypatch, capsys):
    # `bench eager --json` (the small op's host cost, generate() on the device with the dynamic
    # cache, the decoding strategies, beside eager CPU), run in this process as this tree's side
    # of `--against`; the revision's side (here the same commit, checked out in a worktree) runs
    # in a process of its own as both sides do outside this test. One run of each: the bench
    # compiles every kernel of the model cold in each process (about 25 s on CI).
    here = str(Path(bench_eager.__file__).resolve().parents[2])
    ran = {"subprocess": 0}
    spawn = bench_eager._run_tree

    def run_tree(root: str, args: list[str]) -> dict:
        if root != here:
            ran["subprocess"] += 1
            return spawn(root, args)
        assert cli.main(["bench", "eager", "--json", *args]) == 0
        r = json.loads(capsys.readouterr().out)
        _check_eager_json(r)
        return r

    monkeypatch.setattr(bench_eager, "_run_tree", run_tree)
    r = bench_eager.bench_against("HEAD", runs=1, reps=1, prompt=4, tokens=3)
    assert ran["subprocess"] == 1
    f = r["figures"]
    assert set(f) == {key for _, key in bench_eager.COMPARED}
    assert f["add_host_us"]["before"] > 0 and f["add_host_us"]["now"] > 0
    assert f["compiles_other_prompt"]["before"] == 0  # 4 and 9 tokens: one stick of int32 each
    assert "now/before" in bench_eager.format_against(r)


@pytest.mark.slow
def test_bench_loops_json(capsys):
    # a scan compiles one layer; a loop iteration costs about a cached call; a long loop's
    # trace keeps its first iterations and one summary span
    assert cli.main(["bench", "loops", "--reps", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    c, it, w = r["compile"], r["iteration"], r["while_10k"]
    assert c["layers_4_kernels"] == c["layers_32_kernels"] and c["ratio"] > 0
    assert it["iteration_s"] > 0 and it["call_s"] > 0
    assert w["iterations"] == 10_000 and w["trace_kinds"]["loop_summary"] == 1
    assert w["trace_records"] < 200


@pytest.mark.slow
def test_bench_jax_decode_json(capsys):
    # a Llama in plain JAX, one spyre_jax.jit call: greedy tokens equal jax.jit's and torch's
    argv = ["bench", "jax-decode", "--layers", "1", "--seq", "4", "--tokens", "3", "--json"]
    assert cli.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tokens_equal_cpu"] == 3 and r["tokens_equal_torch"] == 3 and r["runs_agree"]
    assert r["fp16_mismatch_within_tolerance"]
    assert r["sim_us_per_token"] > 0 and r["torch_sim_us_per_token"] > 0
    assert r["sim_wall_s_per_token"] > 0 and r["cpu_wall_s_per_token"] > 0
    # the sampled variant: jax.random and top_k on the card, the same tokens as jax.jit
    assert r["sampled_tokens_equal_cpu"] == 3 and r["sampled_sim_us_per_token"] > 0


@pytest.mark.slow
def test_bench_train_json(capsys):
    # both frontends, fp16 and fp32: two card kernels a step, gradients close to fp32 CPU's
    assert cli.main(["bench", "train", "--tiny", "--reps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["rows"]) == {"jax float16", "jax float32", "torch float16", "torch float32"}
    for name, row in r["rows"].items():
        assert "error" not in row, (name, row)
        assert row["kernels"] == 2 and row["fwd_us"] > 0 and row["bwd_us"] > 0
        assert row["saved_mb"] > 0
        assert row["grad_err"] < (1e-5 if name.endswith("32") else 1e-2)
    assert r["grad_overhead"]["second_call_compiles"] == 0


def test_fuzz_runs_programs_and_reports(capsys):
    assert cli.main(["fuzz", "--examples", "3", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["programs"] == 3 and rep["failed"] == 0 and rep["disagreements"] == []
    assert rep["wall_s"] > 0 and rep["real_shapes"] == "mix" and rep["seed"] == 0
    assert cli.main(["fuzz", "--examples", "1", "--real-shapes", "off"]) == 0
    out = capsys.readouterr().out
    assert "programs run        1 (0 real-shape" in out and "disagreements       0" in out


def test_fuzz_shrinks_each_disagreement_and_exits_one(monkeypatch, capsys):
    # a planted finding (no card runs): every program with a tanh step "disagrees"; the run
    # keeps going, counts them, shrinks the first to one tanh on a [1, 1] input and exits 1
    from spyre_jax.tools import fuzz

    err = (
        "frontends disagree (rtol=0.0002 atol=0.0002):\n"
        "  jax.jit (cpu) vs torch.compile spyre (card)  0  0.01  0.01  (0, 0)  NO"
    )
    monkeypatch.setattr(
        fuzz, "program_error", lambda c: err if any("tanh" in s for s in c.prog) else None
    )
    assert cli.main(["fuzz", "--examples", "40", "--real-shapes", "off", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["programs"] == 40 and 0 < rep["failed"] < 40
    (d,) = rep["disagreements"]
    assert d["kind"] == "torch.compile spyre (card)" and d["count"] == rep["failed"]
    assert d["case"] == "Case(rows=1, cols=1, prog=[('unary', 0, 'tanh')], seed=0, k=0)"
    assert cli.main(["fuzz", "--examples", "40", "--real-shapes", "off"]) == 1
    assert "run_program(Case(rows=1, cols=1, prog=[('unary', 0, 'tanh')]" in capsys.readouterr().out


def test_bench_calibrate_json(capsys):
    # a published case: our schedule's time, the card's, the ratio and the external bound
    # (13.6 MB read and written at the card's read and write rates, plus the kernel's fixed
    # cost); the family statistics and the fitted parameters
    argv = ["bench", "calibrate", "--models", "matmul-512x4096x1024", "--json"]
    assert cli.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    r = res["cases"]["matmul-512x4096x1024"]
    assert r["measured_us"] == 90.0 and r["model_us"] > 0 and r["family"] == "matmul"
    assert r["bound_us"] == pytest.approx(12.58e6 / 150e3 + 1.05e6 / 132.5e3 + 0.86, rel=1e-3)
    assert r["model_over_measured"] == pytest.approx(r["model_us"] / 90.0)
    assert r["bound_ratio"] >= 1.0 - 1e-9 and r["bound_unit"] in ("PE", "load/store", "ring", "SFU")
    assert res["families"]["matmul"]["cases"] == 1
    assert res["fitted_parameters"] == 0  # one matmul fits nothing
    assert any("ring" in e["what"] for e in res["excluded"])
    with pytest.raises(ValueError, match="softmax-4096x2048"):
        cli.main(["bench", "calibrate", "--models", "nope"])


def test_bench_calibrate_plot(tmp_path, capsys):
    # the model against the card's measurements, log-log, one marker per family, the 15% band
    png = tmp_path / "cal.png"
    names = "add-4x1x4096,softmax-4x1x4096,matmul-4x4096x1024"
    assert cli.main(["bench", "calibrate", "--models", names, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "add-4x1x4096" in out and "RMS err" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="--plot is for bench calibrate"):
        cli.main(["bench", "schedules", "--models", "decode-1x4096x4096", "--plot", str(png)])


def test_bench_schedules_json(capsys):
    # each case: simulated time, the bound, the ratio and the unit that bounds the schedule
    argv = ["bench", "schedules", "--models", "decode-1x4096x4096,gpt2-128x768x3072", "--json"]
    assert cli.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res) == {"decode-1x4096x4096", "gpt2-128x768x3072"}
    r = res["decode-1x4096x4096"]
    # the decode matmul reads its 32 MiB weight once: the bound is that at 150 GB/s, plus the
    # kernel's fixed cost (CardSpec.kernel_fixed_s)
    read_us = (4096 * 4096 + 2 * 4096) * 2 / 150e9 * 1e6
    fixed_us = CardSpec().kernel_fixed_s * 1e6
    assert r["bound_us"] == pytest.approx(read_us + fixed_us, rel=1e-3)
    assert r["bound_ratio"] == pytest.approx(r["sim_us"] / r["bound_us"])
    assert r["unit"] in ("PE", "load/store", "ring", "SFU") and r["steps"] >= 1
    assert cli.main(["bench", "schedules", "--models", "square-1024"]) == 0
    assert "worst: square-1024" in capsys.readouterr().out
    with pytest.raises(ValueError, match="prefill-512x4096x1024"):
        cli.main(["bench", "schedules", "--models", "nope"])
