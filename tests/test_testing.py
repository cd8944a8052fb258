"""spyre_jax.tools.testing: the four-path differential tool, its graph diff, the weight helpers,
and the test oracle (one tolerance table, the sqrt(k) scaling, assert_close)."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import spyre_jax
from lowering.builder import Lit
from lowering.from_fx import RULES
from spyre_jax.tools import coverage_common, oracle
from spyre_jax.tools.testing import (
    DEFAULT_TOLERANCES,
    TOLERANCES,
    UNKNOWN_K,
    FrontendGraphsDiffer,
    assert_close,
    assert_frontends_agree,
    assert_tree_close,
    compare,
    dtype_name,
    eqx_from_torch,
    to_numpy,
    tolerance,
    torch_from_eqx,
)


def _x(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def plant_tanh_bug(monkeypatch):
    """A planted lowering bug: the torch importer's rule for ``aten.tanh`` computes
    ``1.01 * tanh(x)`` (the real rule, times a wrong constant)."""
    real = RULES[torch.ops.aten.tanh.default]

    def wrong_rule(b, node, *args, **kwargs):
        r = real(b, node, *args, **kwargs)
        return b.elementwise("mul", [r, Lit(1.01, r.dtype)], r.shape, r.dtype)

    monkeypatch.setitem(RULES, torch.ops.aten.tanh.default, wrong_rule)


def _quiet(*a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FrontendGraphsDiffer)
        return assert_frontends_agree(*a, **k)


def test_same_computation_same_graph():
    r = assert_frontends_agree(lambda x: jnp.tanh(x) * 2, lambda x: torch.tanh(x) * 2, _x((8, 65)))
    assert r.ok and r.graphs_equal is True and r.graph_diff == ""
    assert len(r.rows) == 6  # every pair of the four paths


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_agree_matmul_gelu_softmax(dtype):
    x, w = _x((8, 65), 1, dtype), (_x((65, 100), 2, dtype) / 8).astype(dtype)
    _quiet(
        lambda x, w: jax.nn.softmax(jax.nn.gelu(x @ w, approximate=False), -1),
        lambda x, w: torch.softmax(torch.nn.functional.gelu(x @ w), -1),
        x,
        w,
    )


def test_graph_difference_is_shown_as_a_diff():
    # jax.nn.softmax clamps its row max with -inf; torch's does not: same values, other graph
    with pytest.warns(FrontendGraphsDiffer, match="graph from JAX") as rec:
        r = assert_frontends_agree(
            lambda x: jax.nn.softmax(x, -1), lambda x: torch.softmax(x, -1), _x((8, 65))
        )
    assert r.ok and r.graphs_equal is False
    assert "-inf" in str(rec[0].message) and r.graph_diff.startswith("--- graph from JAX")
    with pytest.raises(AssertionError, match="graphs differ"):
        assert_frontends_agree(
            lambda x: jax.nn.softmax(x, -1),
            lambda x: torch.softmax(x, -1),
            _x((8, 65)),
            check_graphs="raise",
        )


def test_planted_wrong_constant_in_torch_twin_is_caught():
    with pytest.raises(AssertionError) as ei:
        _quiet(lambda x: jnp.tanh(x) * 2, lambda x: torch.tanh(x) * 2.01, _x((8, 65)))
    msg = str(ei.value)
    assert "frontends disagree" in msg and "max abs" in msg
    lines = {ln.split("  ")[1].strip(): ln for ln in msg.splitlines() if " vs " in ln}
    assert lines["jax.jit (cpu) vs spyre_jax.jit (card)"].rstrip().endswith("yes")
    assert lines["jax.jit (cpu) vs torch eager (cpu)"].rstrip().endswith("NO")


def test_planted_lowering_bug_is_caught(monkeypatch):
    plant_tanh_bug(monkeypatch)
    with pytest.raises(AssertionError) as ei:
        _quiet(lambda x: jnp.tanh(x) + 1, lambda x: torch.tanh(x) + 1, _x((8, 65)))
    bad = [ln for ln in str(ei.value).splitlines() if ln.rstrip().endswith("NO")]
    # exactly the pairs with the torch.compile path are wrong: the bug is in from_fx
    assert bad and all("torch.compile spyre" in ln for ln in bad)
    assert len(bad) == 3


def test_a_failing_path_is_reported_not_hidden():
    def bad_jax(x):  # no rule on the card
        return jax.lax.linalg.triangular_solve(x[:, :4], x, left_side=True)

    def torch_solve(x):
        return torch.linalg.solve_triangular(x[:, :4], x, upper=True)

    with pytest.raises(AssertionError, match="failed: UnsupportedPrimitiveError"):
        _quiet(bad_jax, torch_solve, _x((4, 65)))


def test_float64_inputs_are_refused():
    with pytest.raises(TypeError, match="float64"):
        assert_frontends_agree(jnp.tanh, torch.tanh, np.ones((3, 3)))


# ---------------------------------------------------------------------------------------------
# one model written twice: weights copied between torch.nn and equinox


def test_linear_layernorm_embedding_twins():
    torch.manual_seed(0)
    tl, tn, te = torch.nn.Linear(65, 100), torch.nn.LayerNorm(100), torch.nn.Embedding(50, 65)
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    el = eqx_from_torch(tl, eqx.nn.Linear(65, 100, key=k[0]))
    en = eqx_from_torch(tn, eqx.nn.LayerNorm(100))
    ee = eqx_from_torch(te, eqx.nn.Embedding(50, 65, key=k[1]))
    idx = np.array([3, 0, 49, 7, 7], np.int32)
    _quiet(
        lambda i: jax.vmap(en)(jax.vmap(el)(jax.vmap(ee)(i))),
        lambda i: tn(tl(te(i))),
        idx,
    )


def test_mlp_twins_both_directions():
    torch.manual_seed(1)
    tm = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(128, 32)
    )
    em = eqx.nn.MLP(64, 32, 128, 1, activation=jax.nn.gelu, key=jax.random.PRNGKey(1))
    em = eqx_from_torch(tm, em)
    x = _x((5, 64), 3)
    _quiet(lambda x: jax.vmap(em)(x), tm, x)
    # and back: a fresh torch twin takes the equinox weights
    tm2 = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(128, 32)
    )
    torch_from_eqx(em, tm2)
    with torch.no_grad():
        np.testing.assert_array_equal(
            tm2(torch.from_numpy(x)).numpy(), tm(torch.from_numpy(x)).numpy()
        )


def test_attention_twins():
    torch.manual_seed(2)
    e, h, s = 64, 4, 16
    tm = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
    em = eqx_from_torch(
        tm,
        eqx.nn.MultiheadAttention(
            h,
            e,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=jax.random.PRNGKey(2),
        ),
    )

    def torch_attn(x):
        return tm(x[None], x[None], x[None], need_weights=False)[0][0]

    _quiet(lambda x: em(x, x, x), torch_attn, _x((s, e), 4))


def test_no_mapping_is_a_type_error():
    with pytest.raises(TypeError, match="no weight mapping"):
        eqx_from_torch(torch.nn.ReLU(), eqx.nn.Lambda(jax.nn.relu))


# ---------------------------------------------------------------------------------------------
# the oracle: one table, one scaling rule, one comparison


def test_one_table_keyed_by_any_dtype_spelling():
    assert TOLERANCES == {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5, "float64": 1e-5}
    for spellings, name in [
        (
            (np.float16, np.dtype("float16"), jnp.float16, torch.float16, torch.half, "f16"),
            "float16",
        ),
        ((ml_dtypes.bfloat16, jnp.bfloat16, torch.bfloat16, "bfloat16", "bf16"), "bfloat16"),
        ((np.float32, jnp.float32, torch.float32, "float32", torch.zeros(1)), "float32"),
    ]:
        for d in spellings:
            assert dtype_name(d) == name, d
            assert tolerance(d) == (TOLERANCES[name], TOLERANCES[name]), d
    for d in (np.int32, torch.int64, bool, torch.bool, jnp.uint8):
        assert tolerance(d, k=1000, chain=3) == (0.0, 0.0), d  # integers and bools: exact
    with pytest.raises(KeyError, match="float8"):
        tolerance("float8_e4m3fn")
    # the tools read the same table: k = UNKNOWN_K where a program's reductions are unknown
    assert DEFAULT_TOLERANCES == pytest.approx(
        {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1.6e-1, "float64": 1e-4}
    )
    assert coverage_common.TOLERANCE == pytest.approx(DEFAULT_TOLERANCES)
    assert tolerance("float32", k=UNKNOWN_K)[0] == pytest.approx(10 * TOLERANCES["float32"])


def test_scaling_is_sqrt_k_times_chain():
    rt, at = TOLERANCES["float16"], TOLERANCES["float16"]
    assert tolerance(np.float16, k=100) == pytest.approx((10 * rt, 10 * at))
    assert tolerance(np.float16, k=256, chain=3) == pytest.approx((48 * rt, 48 * at))
    assert tolerance(np.float16, k=0, chain=0) == tolerance(np.float16)
    # a difference of 5 table units fails at k=1, passes at k=25 (sqrt: 5), fails at k=16 (4)
    w = np.linspace(0.0, 1.0, 33, dtype=np.float32)
    g = w + np.float32(5 * TOLERANCES["float32"] / 2)  # /2: rtol * |w| + atol, |w| <= 1
    g[-1] = w[-1] + 5 * TOLERANCES["float32"] * 2 * 0.999
    assert compare(g, w) is not None
    assert compare(g, w, k=25) is None
    assert compare(g, w, k=16) is not None
    assert compare(g, w, chain=5) is None


def test_assert_close_numpy_jax_spyre_torch():
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    small = x * (1 + 3e-6)  # within float32's 1e-5
    big = x * (1 + 1e-3)
    for want in (x, jnp.asarray(x), torch.from_numpy(x), spyre_jax.device_put(x)):
        assert_close(small, want)
        assert_close(torch.from_numpy(small), want)
        with pytest.raises(AssertionError, match="beyond tolerance"):
            assert_close(big, want)
    on_card = torch.from_numpy(x).to("spyre")
    assert_close(on_card * 2, x * 2)
    with pytest.raises(AssertionError, match="my output: .*beyond tolerance"):
        assert_close(on_card * 2, x * 2.01, err_msg="my output")
    # shapes and dtypes count
    with pytest.raises(AssertionError, match="shape"):
        assert_close(x[:4], x)
    with pytest.raises(AssertionError, match="dtype float16 != float32"):
        assert_close(x.astype(np.float16), x)
    assert_close(x.astype(np.float16), x, check_dtype=False, dtype=np.float16)
    # NaN where the other has none, and infinities, are differences
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(np.array([np.nan, 1.0]), np.array([0.0, 1.0]))
    assert_close(np.array([np.nan, np.inf]), np.array([np.nan, np.inf]))
    with pytest.raises(AssertionError, match="infinities"):
        assert_close(np.array([-np.inf, 1.0]), np.array([np.inf, 1.0]))


def test_bfloat16_numpy_and_torch():
    w = np.linspace(-2, 2, 40).astype(ml_dtypes.bfloat16)
    nudged = (w.astype(np.float32) * (1 + 2**-8)).astype(ml_dtypes.bfloat16)  # <= an ulp
    assert_close(nudged, w)
    assert_close(torch.from_numpy(nudged.view(np.int16)).view(torch.bfloat16), w)
    tw = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    assert to_numpy(tw).dtype == w.dtype and np.array_equal(to_numpy(tw), w)
    assert_close(tw, tw.float().to(torch.bfloat16))
    with pytest.raises(AssertionError, match="bfloat16"):
        assert_close(w.astype(np.float32) * 1.1, w.astype(np.float32), dtype=torch.bfloat16)


def test_integers_and_bools_exact():
    i = np.arange(-5, 50, dtype=np.int32)
    assert_close(i, i.copy())
    assert_close(torch.arange(4), torch.arange(4))
    with pytest.raises(AssertionError, match="1/55 elements differ"):
        assert_close(i + (i == 7), i, rtol=1.0, atol=1.0)  # no tolerance makes ints inexact
    with pytest.raises(AssertionError, match="differ"):
        assert_close(np.array([True, False]), np.array([True, True]))
    with pytest.raises(AssertionError, match="dtype"):
        assert_close(i.astype(np.float32), i)


def test_assert_tree_close():
    a = {"x": np.ones(3, np.float32), "p": (np.arange(3, dtype=np.int32), np.zeros(2, np.float16))}
    b = {"x": jnp.ones(3) * (1 + 1e-6), "p": [jnp.arange(3), jnp.zeros(2, jnp.float16)]}
    assert_tree_close(a, b)  # a list and a tuple of the same leaves are the same
    with pytest.raises(AssertionError, match="output 1"):
        assert_tree_close((np.ones(2), np.ones(2)), (np.ones(2), np.full(2, 2.0)))
    with pytest.raises(AssertionError, match="2 outputs, expected 1"):
        assert_tree_close((np.ones(2), np.ones(2)), (np.ones(2),))
    torch_out = (torch.ones(2), torch.arange(3))
    assert_tree_close(torch_out, (np.ones(2, np.float32), np.arange(3)))


def test_atol_is_relative_to_the_largest_magnitude():
    # a sum that cancels to 0 keeps an error of its terms: atol scales with max(1, max|want|)
    want = np.array([100.0, 0.0], np.float32)
    assert oracle.compare(np.array([100.0, 5e-4], np.float32), want) is None
    assert oracle.compare(np.array([100.0, 5e-3], np.float32), want) is not None
    one = np.array([1.0, 0.0], np.float32)
    assert oracle.compare(np.array([1.0, 5e-4], np.float32), one) is not None
