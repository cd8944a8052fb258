"""``spyre-jax coverage jax``'s ``grad`` and ``vmap`` paths
(``spyre_jax/tools/coverage_transforms.py``): a handful of table entries through
``jax.grad(spyre_jax.jit(f))`` and ``jax.vmap(spyre_jax.jit(f))`` against ``jax.jit`` on the
CPU."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spyre_jax
from spyre_jax.tools import cli, coverage_run
from spyre_jax.tools import coverage_common as cov
from spyre_jax.tools import coverage_transforms as ct
from spyre_jax.tools.coverage_jax import PATHS, coverage_jax
from spyre_jax.tools.jax_ops import JAX_OPS

#: differentiable entries whose derivative programs hold transposes, reversed cumulative sums,
#: pads and scatter-adds, and non-differentiable ones (grad skipped, vmap tried)
NAMES = ["jnp.tanh", "jnp.cumsum", "jnp.transpose", "jnp.argmax", "jnp.equal"]


@pytest.fixture(scope="module")
def result() -> dict:
    return coverage_jax(names=NAMES)


def test_book_has_three_paths_and_they_pass(result):
    res = result
    assert list(res["totals"]) == list(PATHS) == ["jit", "grad", "vmap"]
    assert set(res["paths"]) == set(PATHS)
    assert set(res["ops"]) == set(NAMES)
    for rec in res["ops"].values():
        for p in PATHS:
            assert set(rec[p]) == set(cov.STATUSES)
            assert rec[p]["wrong"] == rec[p]["error"] == rec[p]["unsupported"] == 0, rec
    # every sample: 3 shapes x 2 dtypes (argmax, equal: no float output, grad skipped)
    for name in ("jnp.tanh", "jnp.cumsum", "jnp.transpose"):
        assert res["ops"][name]["grad"]["passed"] == 6, res["ops"][name]
    for name in ("jnp.argmax", "jnp.equal"):
        g = res["ops"][name]["grad"]
        assert g["skipped"] == 6 and g["passed"] == 0, g
        assert any("no float output" in n for n in res["ops"][name]["notes"]["grad"])
    assert all(res["ops"][n]["vmap"]["passed"] == 6 for n in NAMES)
    tr = res["transforms"]
    assert tr["forward_ops_passed"] == len(NAMES) and tr["fraction"] == 1.0, tr
    assert tr["grad_tried"] == 3 and tr["grad_untried"] == 2 and tr["vmap_passed"] == 5, tr
    json.loads(json.dumps(res))
    text = cov.format_table(res)
    assert "grad:" in text and "vmap:" in text and "passing all: 5 (100.0%)" in text


def test_paths_subset_and_cli(capsys):
    res = coverage_jax(names=["jnp.exp"], paths=("vmap",))
    assert list(res["totals"]) == ["vmap"] and "transforms" not in res
    assert res["ops"]["jnp.exp"]["vmap"]["passed"] == 6
    with pytest.raises(ValueError):
        coverage_jax(names=["jnp.exp"], paths=("jit", "hessian"))
    assert cli.main_coverage(["jax", "--json", "--ops", "jnp.exp", "--paths", "jit,grad"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["totals"]) == ["jit", "grad"] and list(out["ops"]) == ["jnp.exp"]
    assert out["totals"]["grad"]["passed"] == 6
    with pytest.raises(SystemExit):
        cli.main_coverage(["jax", "--paths", "jit,hessian"])


def test_entry_names_with_commas():
    assert coverage_run.jax_entries("jnp.einsum(ij,jk),jnp.exp") == [
        "jnp.exp",
        "jnp.einsum(ij,jk)",
    ]
    with pytest.raises(ValueError):
        coverage_run.jax_entries("jnp.exp,no.such.op")


def test_grad_and_vmap_cases_are_built_from_the_sample():
    rng = np.random.default_rng(0)
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    case = ct.grad_case(lambda a, i: a[i], (x, np.int32(1)), rng)
    assert not case.skip
    (g,) = case.reference()
    assert g.shape == x.shape and np.count_nonzero(np.asarray(g)[[0, 2]]) == 0
    assert ct.grad_case(lambda a: a > 0, (x,), rng).skip.startswith("no float output")
    assert ct.grad_case(lambda i: i * 2, (np.arange(3, dtype=np.int32),), rng).skip
    op = next(o for o in JAX_OPS if o.name == "jnp.add")
    batched = ct.batched_samples(op, 0, 0, "float16")
    assert [tuple(a.shape for a in args) for _, args in batched][0] == ((3, 5, 65), (3, 5, 65))
    assert all(a.dtype == np.float16 for _, args in batched for a in args)
    assert not np.array_equal(batched[0][1][0][0], batched[0][1][0][1])  # distinct draws


def _take_grad(x: np.ndarray) -> object:
    return jax.grad(lambda x: jnp.sum(jnp.take_along_axis(x, jnp.argsort(x, -1)[:, :3], -1)))(x)


#: the primitives derivative and batched programs bring in, each in a program of its own:
#: spyre_jax.jit of it against jax.jit (lowering/jaxpr_special.py, jaxpr_gather.py,
#: jaxpr_control.py, from_jaxpr.py's reshape)
_X = np.linspace(-2.0, 2.0, 5 * 65, dtype=np.float32).reshape(5, 65)
#: -6 to 6, kept 0.05 away from the integers (polygamma's poles, where both sides blow up)
_AWAY = (np.floor(_X * 3) + 0.05 + 0.9 * ((_X * 3) % 1)).astype(np.float32)
RULE_CASES = {
    "polygamma(1)": (lambda x: jax.lax.polygamma(jnp.float32(1), x), (_AWAY,)),
    "polygamma(2)": (lambda x: jax.lax.polygamma(jnp.float32(2), x), (_AWAY,)),
    "select_and_scatter_add": (
        jax.grad(
            lambda x: jnp.sum(
                jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (3, 3), (1, 2), "SAME") ** 2
            )
        ),
        (np.round(_X * 3),),  # ties: the first maximum of a window is selected
    ),
    "gather(windows)": (
        lambda x, i: jax.lax.gather(
            x,
            i,
            jax.lax.GatherDimensionNumbers((0, 1), (), (0,)),
            (2, 65),
            mode="fill",
            fill_value=0,
        ),
        (_X, np.array([[1], [4], [3]], np.int32)),
    ),
    "scatter(batching dims)": (_take_grad, (_X,)),
    "unstack": (jax.grad(lambda a: jnp.sum(jnp.stack([a, a * 2], 1) ** 2)), (_X,)),
    "while(batched predicate)": (
        jax.vmap(
            lambda v: jax.lax.while_loop(lambda v: jnp.max(jnp.abs(v)) > 0.3, lambda v: v / 2, v)
        ),
        (_X[:, None, :] * np.arange(1, 6, dtype=np.float32)[:, None, None],),
    ),
    "reshape(dimensions)": (lambda x: jax.lax.reshape(x, (65, 5), (1, 0)), (_X,)),
}


@pytest.mark.parametrize("name", list(RULE_CASES))
def test_rules_of_derivative_and_batched_programs(name):
    fn, args = RULE_CASES[name]
    want = jax.jit(fn)(*args)
    got = spyre_jax.jit(fn)(*args)
    assert cov.close_np(np.asarray(got), np.asarray(want)) is None
