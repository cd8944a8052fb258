"""spyre_jax.tools.testing: the four-path differential tool, its graph diff, the weight helpers."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from lowering.builder import Lit
from lowering.from_fx import RULES
from spyre_jax.tools.testing import (
    FrontendGraphsDiffer,
    assert_frontends_agree,
    eqx_from_torch,
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
    def bad_jax(x):
        return jnp.sort(x, axis=-1)  # no rule on the card

    with pytest.raises(AssertionError, match="failed: UnsupportedPrimitiveError"):
        _quiet(bad_jax, lambda x: torch.sort(x, -1)[0], _x((4, 65)))


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
