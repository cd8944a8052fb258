"""``spyre_jax.tools.coverage_*``: PyTorch's OpInfo samples and our JAX table through the card."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
import torch
import torch._dynamo.exc

from lowering.errors import UnsupportedPrimitiveError
from spyre_jax.tools import cli, coverage_torch
from spyre_jax.tools import coverage_common as cov
from spyre_jax.tools.coverage_jax import coverage_jax
from spyre_jax.tools.jax_ops import JAX_OPS, Arg, JaxOp, Sample, make_samples


@pytest.fixture(scope="module")
def torch_result() -> dict:
    return coverage_torch.coverage_torch(
        ops=["add", "mul", "tanh", "sort", "special.i1"], limit_samples=2
    )


@pytest.fixture(scope="module")
def jax_result() -> dict:
    return coverage_jax(limit=15, paths=("jit",))


def _check_structure(res: dict, paths: list[str]) -> None:
    assert set(res["totals"]) == set(paths)
    assert set(res["paths"]) == set(paths)
    for p in paths:
        t = res["totals"][p]
        for k in (*cov.STATUSES, "samples_tried", "samples_passed", "ops_tried", "ops_passed"):
            assert isinstance(t[k], int) and t[k] >= 0, (p, k)
        assert t["samples_tried"] == sum(t[s] for s in cov.STATUSES if s != "skipped")
        assert t["ops_passed"] <= t["ops_tried"] <= len(res["ops"])
        assert t["samples_passed"] == sum(rec[p]["passed"] for rec in res["ops"].values())
    for rec in res["ops"].values():
        for p in paths:
            assert set(rec[p]) == set(cov.STATUSES)
            assert all(isinstance(n, str) for n in rec["notes"][p])
    json.loads(json.dumps(res))  # JSON-ready


@pytest.mark.slow
def test_torch_structure_and_statuses(torch_result):
    res = torch_result
    assert res["frontend"] == "torch"
    _check_structure(res, ["backend", "device"])
    assert {"add", "mul", "tanh", "sort", "special.i1"} <= set(res["ops"])
    for name in ("add", "mul", "tanh", "sort"):
        rec = res["ops"][name]["backend"]
        assert rec["passed"] > 0 and rec["wrong"] == rec["error"] == 0, res["ops"][name]
    i1 = res["ops"]["special.i1"]["backend"]
    assert i1["unsupported"] > 0 and i1["error"] == 0 and i1["passed"] == 0, i1
    assert any("special_i1" in k for k in res["unsupported"]["backend"])
    dev = res["paths"]["device"]
    if dev["available"]:  # the spyre device: the same ops run eagerly on spyre tensors
        assert res["ops"]["tanh"]["device"]["passed"] > 0, res["ops"]["tanh"]
        assert res["ops"]["sort"]["device"]["passed"] > 0
        assert res["ops"]["special.i1"]["device"]["unsupported"] > 0  # a CPU fallback
    else:
        assert res["totals"]["device"]["samples_tried"] == 0


def test_ties_of_an_unstable_sort_may_come_in_any_order():
    """Regression: torch's CPU sort with ``stable=False`` orders equal fp16 values its own way
    (OpInfo's 8000-element sample); the card's index order is as valid, a wrong value is not."""
    x = torch.tensor([3.0, 1.0, 3.0, 1.0, 2.0])
    op = next(o for o in coverage_torch._import_op_db() if o.name == "sort")
    sample = types.SimpleNamespace(input=x, args=(), kwargs={})
    want = (torch.tensor([1.0, 1.0, 2.0, 3.0, 3.0]), torch.tensor([3, 1, 4, 2, 0]))
    ours = (want[0], torch.tensor([1, 3, 4, 0, 2]))
    assert coverage_torch._ties_only(op, sample, ours, want)
    wrong = (want[0], torch.tensor([1, 3, 4, 0, 1]))
    assert not coverage_torch._ties_only(op, sample, wrong, want)
    stable = types.SimpleNamespace(input=x, args=(), kwargs={"stable": True})
    assert not coverage_torch._ties_only(op, stable, ours, want)


def test_harness_compares_complex_and_sparse_and_keeps_cpu_only_arguments():
    """Regressions: the harness's own determinism check raised on ComplexHalf (no nan_to_num
    kernel) and sparse outputs (no equal kernel), and moved tensor_split's index tensor to
    spyre, which torch refuses (as on CUDA): errors of the tool, counted against the card."""
    c = torch.tensor([1 + 2j, float("nan") + 0j], dtype=torch.complex32)
    assert coverage_torch._same_torch(c, c.clone())
    assert not coverage_torch._same_torch(c, c * 2)
    sp = torch.eye(3).to_sparse()
    assert coverage_torch._same_torch(sp, torch.eye(3).to_sparse())
    assert not coverage_torch._same_torch(sp, (2 * torch.eye(3)).to_sparse())
    res = coverage_torch.coverage_torch(ops=["tensor_split", "to_sparse"], paths=("device",))
    ts, sp_row = res["ops"]["tensor_split"]["device"], res["ops"]["to_sparse"]["device"]
    assert ts["passed"] > 0 and ts["error"] == 0, ts
    assert sp_row["error"] == 0 and sp_row["unsupported"] > 0, sp_row  # sparse: refused, named


def test_torch_checks_random_ops_statistically_and_skips_uninitialized_ones():
    res = coverage_torch.coverage_torch(
        ops=["bernoulli", "nn.functional.dropout2d", "empty_like"], limit_samples=2
    )
    for name in ("bernoulli", "nn.functional.dropout2d"):
        for path in ("backend", "device"):
            rec = res["ops"][name][path]
            assert rec["passed"] > 0 and rec["wrong"] == rec["error"] == 0, res["ops"][name]
    rec = res["ops"]["empty_like"]["backend"]
    assert rec["skipped"] >= 1 and rec["passed"] == rec["error"] == 0
    with pytest.raises(ValueError):
        coverage_torch.coverage_torch(ops=["add"], paths=("gpu",))


def test_the_statistical_check_tells_a_wrong_distribution():
    g = torch.Generator().manual_seed(0)
    draws = [torch.randn(400, generator=g) for _ in range(8)]
    assert coverage_torch._statistical(torch.randn(400, generator=g), draws) is None
    assert "distribution" in coverage_torch._statistical(torch.rand(400, generator=g), draws)
    coins = [torch.bernoulli(torch.full((400,), 0.5), generator=g) for _ in range(8)]
    assert coverage_torch._statistical(torch.bernoulli(torch.full((400,), 0.5)), coins) is None
    assert coverage_torch._statistical(torch.bernoulli(torch.full((400,), 0.2)), coins)
    assert "float16" in coverage_torch._statistical(draws[0].half(), draws)
    # channel dropout: each value one some draw has at its position
    x = torch.ones(4, 3, 1)
    masks = [x * torch.bernoulli(torch.full((4, 3, 1), 0.5), generator=g) * 2 for _ in range(64)]
    assert coverage_torch._statistical(masks[0], masks[1:], correlated=True) is None
    assert coverage_torch._statistical(x * 3, masks, correlated=True)


@pytest.mark.slow
def test_jax_structure_and_passes(jax_result):
    res = jax_result
    assert res["frontend"] == "jax"
    _check_structure(res, ["jit"])
    assert len(res["ops"]) == 15
    t = res["totals"]["jit"]
    assert t["samples_tried"] > 0
    assert t["passed"] >= 0.6 * t["samples_tried"], t
    assert t["error"] == 0 and t["wrong"] == 0, res["errors"]
    assert res["ops"]["jnp.exp"]["jit"]["passed"] == 6  # 3 shapes x (float32, float16)


def test_jax_table_breadth():
    names = [c.name for c in JAX_OPS]
    assert len(names) >= 120 and len(set(names)) == len(names)
    must = ["jnp.matmul", "jnp.einsum(ij,jk)", "jax.nn.softmax", "lax.dynamic_slice"]
    must += ["jnp.take_along_axis", "jnp.cumsum", "jnp.pad", "jax.nn.one_hot"]
    assert set(must) <= set(names)


def test_jax_table_is_data():
    # a module-level list of frozen records, one per op, unique names; samples drawn from them
    assert isinstance(JAX_OPS, list) and all(isinstance(o, JaxOp) for o in JAX_OPS)
    names = [o.name for o in JAX_OPS]
    assert len(set(names)) == len(names)
    with pytest.raises(dataclasses.FrozenInstanceError):
        JAX_OPS[0].name = "renamed"
    for o in JAX_OPS:
        assert o.samples and o.dtypes, o.name
        assert set(o.dtypes) <= {"float32", "float16", "int32", "bool"}, o.name
        for s in o.samples:
            assert isinstance(s, Sample) and callable(s.fn), o.name
            assert all(isinstance(a, Arg) for a in s.args), o.name
    exp = next(o for o in JAX_OPS if o.name == "jnp.exp")
    drawn = make_samples(exp, np.random.default_rng(0), "float16")
    assert [args[0].shape for _, args in drawn] == [(5, 65), (3, 63), (2, 3, 100)]
    assert all(args[0].dtype == np.float16 for _, args in drawn)
    again = make_samples(exp, np.random.default_rng(0), "float16")
    assert all(np.array_equal(a[1][0], b[1][0]) for a, b in zip(drawn, again, strict=True))


def test_jax_unsupported_is_not_error():
    res = coverage_jax(names=["jnp.linalg (cholesky/inv/solve)"], paths=("jit",))
    t = res["totals"]["jit"]
    assert t["unsupported"] > 0 and t["error"] == 0, res["ops"]["jnp.linalg (cholesky/inv/solve)"]


def test_format_table(torch_result, jax_result):
    text = cov.format_table(torch_result)
    for name in ("add", "mul", "tanh", "sort", "backend", "device"):
        assert name in text
    assert "samples passed" in text
    text = cov.format_table(jax_result, notes=True)
    assert "jnp.exp" in text and "jit" in text


def test_close_tolerances():
    w = np.linspace(-3, 3, 50, dtype=np.float32)
    assert cov.close_np(w + 1e-5, w) is None
    assert cov.close_np(w + 1e-2, w) is not None
    assert cov.close_np((w + 1e-2).astype(np.float16), w.astype(np.float16)) is None
    assert cov.close_np(w.reshape(5, 10), w) is not None
    i = np.arange(10, dtype=np.int32)
    assert cov.close_np(i, i) is None and cov.close_np(i + 1, i) is not None
    nan = np.array([np.nan, 1.0], np.float32)
    assert cov.close_np(nan, nan) is None
    assert cov.close_np(np.array([0.0, 1.0], np.float32), nan) is not None


def test_classify_unwraps_dynamo():
    inner = UnsupportedPrimitiveError("ATen", "aten.sort.default", "x = sort(y)", "")
    try:
        raise torch._dynamo.exc.BackendCompilerFailed(lambda: None, inner, None)
    except Exception as e:
        assert cov.classify(e)[:2] == ("unsupported", "aten.sort.default")
    dtype_err = TypeError(
        "spyre: a tensor has dtype torch.float64, which the card does not support"
    )
    assert cov.classify(dtype_err)[:2] == ("unsupported", "dtype float64")
    assert cov.classify(RuntimeError("boom"))[:2] == ("error", "RuntimeError")


def test_main_coverage_json(capsys):
    assert cli.main_coverage(["jax", "--json", "--limit", "2", "--paths", "jit"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["frontend"] == "jax" and len(res["ops"]) == 2


def test_device_unavailable_is_skipped(monkeypatch):
    monkeypatch.setattr(coverage_torch, "_device_status", lambda: (False, "no spyre device here"))
    res = coverage_torch.coverage_torch(ops=["tanh"], limit_samples=1)
    assert res["paths"]["device"] == {
        "status": "unavailable",
        "available": False,
        "reason": "no spyre device here",
    }
    assert res["totals"]["device"]["samples_tried"] == 0
    assert res["totals"]["backend"]["samples_passed"] > 0
    assert "device: unavailable" in cov.format_table(res)


@pytest.mark.slow
def test_isolated_worker_survives_a_crash(monkeypatch):
    # the worker segfaults on tanh's backend run: that sample is an error, the run goes on
    monkeypatch.setenv("SPYRE_COVERAGE_TEST_CRASH", "tanh:backend")
    res = coverage_torch.coverage_torch(
        ops=["tanh", "sigmoid"], limit_samples=1, paths=("backend",), isolate=True
    )
    tanh = res["ops"]["tanh"]
    assert tanh["backend"]["error"] == 1, tanh
    assert any("SIGSEGV" in n for n in tanh["notes"]["backend"]), tanh
    assert res["ops"]["sigmoid"]["backend"]["passed"] > 0, res["ops"]["sigmoid"]
    assert res["config"]["isolated"] and not res["truncated"]
