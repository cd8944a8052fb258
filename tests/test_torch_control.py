"""torch.cond, while_loop and scan through torch.compile(backend="spyre") (issue 30): the same
IR nodes and host program as JAX's loops and branches, against torch eager."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

import torch_bridge  # noqa: F401  (registers the backend)
from spyre_jax.tools.testing import assert_tree_close
from torch_bridge import backend as tb


def _compiled(f):
    torch._dynamo.reset()
    return torch.compile(f, backend="spyre", options={"strict": True})


def _check(f, *args, k=1):
    before = sum(tb.fallback_stats().values())
    with torch.no_grad():
        got = _compiled(f)(*args)
        want = f(*args)
    assert sum(tb.fallback_stats().values()) == before, tb.fallback_stats()
    assert_tree_close(got, want, k=k)
    return got


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("read_back", [True, False], ids=["branch", "selected"])
@pytest.mark.parametrize("positive", [True, False])
def test_cond_runs_the_branch_the_predicate_names(positive, read_back, monkeypatch):
    from lowering import control

    if read_back:  # nothing inlined: the host reads the predicate and runs one branch
        monkeypatch.setattr(control, "UNROLL_MAX_NODES", 0)

    def f(x, p):
        return torch.cond(p.sum() > 0, lambda x: x.sin() * 2, lambda x: x.cos() - 1, (x,))

    x = _rand(4, 70)
    before = {id(k) for k in tb.compiled_kernels()}
    _check(f, x, x.abs() if positive else -x.abs())
    new = [k for k in tb.compiled_kernels() if id(k) not in before]
    assert new, "nothing compiled"
    assert any("branch(" in k.as_text() for k in new) == read_back


def test_while_loop_with_carried_and_additional_inputs():
    def f(x, w):
        def cond(i, h):
            return (i < 5) & (h.abs().max() < 100)

        def body(i, h):
            return i + 1, torch.tanh(h @ w) * 3

        return while_loop(cond, body, (torch.tensor(0), x))

    _check(f, _rand(2, 64), _rand(64, 64, seed=1) / 8, k=64)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_with_carry_and_stacked_outputs(reverse):
    def f(xs, w):
        def step(c, x):
            c = torch.tanh(c @ w + x)
            return c, c.sum(-1)

        return scan(step, torch.zeros(2, 64), xs, reverse=reverse)

    _check(f, _rand(6, 2, 64), _rand(64, 64, seed=2) / 8, k=64)


def test_flip():
    x = _rand(3, 5, 70)
    for dims in ([0], [2], [0, 1, 2]):
        _check(lambda x, d=dims: x.flip(d), x)


def test_the_difftest_tool_compares_branches_and_their_bodies():
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from spyre_jax.tools.testing import assert_frontends_agree

    def jf(x):
        return lax.cond(jnp.sum(x) > 0, lambda v: jnp.tanh(v), lambda v: v * 2, x)

    def tf(x):
        return torch.cond(x.sum() > 0, lambda v: torch.tanh(v), lambda v: v * 2, (x,))

    x = np.random.default_rng(0).standard_normal((3, 65)).astype(np.float32)
    rep = assert_frontends_agree(jf, tf, [x], check_graphs="raise")
    assert rep.graphs_equal  # the same cond node, each branch's body canonicalized alike
