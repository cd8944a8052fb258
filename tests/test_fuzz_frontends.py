"""The net: random small programs over the shared op set, written once as data and emitted as a
JAX function and a torch function, through all four paths (``assert_frontends_agree``).

A program is a list of steps over a list of values (starting with the inputs); each step reads
one or two earlier values and appends its result. Shapes include odd sizes (1, 3, 63, 65, 100),
broadcasting (a row vector), reductions with keepdims, matmuls against a weight input, transposes
and reshapes. Failures shrink (hypothesis) and each one found is kept below as an ``@example``
regression. ``SPYRE_FUZZ_EXAMPLES`` sets how many programs run (CI: the default).
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowering.builder import Lit
from lowering.from_fx import RULES
from spyre_jax.tools.testing import FrontendGraphsDiffer, assert_frontends_agree

N_EXAMPLES = int(os.environ.get("SPYRE_FUZZ_EXAMPLES", "200"))

UNARY = ("tanh", "neg", "abs", "sigmoid", "relu", "square", "exp_clip", "softmax", "scale")
BINARY = ("add", "sub", "mul", "max")
REDUCE = ("sum", "max", "mean")


def _emit(program: list[tuple], lib: str):
    """The program as a function of ``(x, row, w)`` in ``lib`` ("jax" or "torch")."""
    J = lib == "jax"

    def unary(op: str, v):
        if op == "tanh":
            return jnp.tanh(v) if J else torch.tanh(v)
        if op == "neg":
            return -v
        if op == "abs":
            return jnp.abs(v) if J else torch.abs(v)
        if op == "sigmoid":
            return jax.nn.sigmoid(v) if J else torch.sigmoid(v)
        if op == "relu":
            return jax.nn.relu(v) if J else torch.relu(v)
        if op == "square":
            return v * v
        if op == "exp_clip":
            return jnp.exp(jnp.clip(v, -4.0, 4.0)) if J else torch.exp(torch.clamp(v, -4.0, 4.0))
        if op == "softmax":
            return jax.nn.softmax(v, axis=-1) if J else torch.softmax(v, -1)
        if op == "scale":
            return v * 0.5 + 0.25
        raise AssertionError(op)

    def binary(op: str, a, b):
        if op == "add":
            return a + b
        if op == "sub":
            return a - b
        if op == "mul":
            return a * b
        if op == "max":
            return jnp.maximum(a, b) if J else torch.maximum(a, b)
        raise AssertionError(op)

    def fn(x, row, w):
        vals = [x]
        for step in program:
            kind = step[0]
            v = vals[step[1] % len(vals)]
            if kind == "unary":
                out = unary(step[2], v)
            elif kind == "binary":
                other = vals[step[3] % len(vals)] if step[4] else row
                if other.shape != v.shape and not step[4]:
                    out = binary(step[2], v, other)  # a [1, C] row broadcasts
                elif other.shape == v.shape:
                    out = binary(step[2], v, other)
                else:
                    out = binary(step[2], v, row)
            elif kind == "reduce":
                op = step[2]
                if J:
                    f = {"sum": jnp.sum, "max": jnp.max, "mean": jnp.mean}[op]
                    r = f(v, axis=step[3], keepdims=True)
                else:
                    if op == "max":
                        r = torch.amax(v, dim=step[3], keepdim=True)
                    else:
                        r = getattr(torch, op)(v, dim=step[3], keepdim=True)
                out = v - r  # broadcast back: keeps every value the same shape
            elif kind == "matmul":
                out = v @ w  # [R, C] @ [C, C]
            elif kind == "transpose2":
                out = (v.T if J else v.t()).reshape(v.shape) if v.shape[0] == v.shape[1] else v
            elif kind == "reshape":
                r, c = v.shape
                out = v.reshape(r * c).reshape(r, c)
            else:
                raise AssertionError(kind)
            vals.append(out)
        return vals[-1]

    return fn


_step = st.one_of(
    st.tuples(st.just("unary"), st.integers(0, 9), st.sampled_from(UNARY)),
    st.tuples(
        st.just("binary"),
        st.integers(0, 9),
        st.sampled_from(BINARY),
        st.integers(0, 9),
        st.booleans(),
    ),
    st.tuples(
        st.just("reduce"), st.integers(0, 9), st.sampled_from(REDUCE), st.sampled_from([0, 1])
    ),
    st.tuples(st.just("matmul"), st.integers(0, 9)),
    st.tuples(st.just("transpose2"), st.integers(0, 9)),
    st.tuples(st.just("reshape"), st.integers(0, 9)),
)


@st.composite
def programs(draw):
    rows = draw(st.sampled_from([1, 3, 5, 63, 65]))
    cols = draw(st.sampled_from([1, 7, 64, 65, 100]))
    prog = draw(st.lists(_step, min_size=1, max_size=6))
    seed = draw(st.integers(0, 2**16))
    return rows, cols, prog, seed


def _run(rows, cols, prog, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    row = rng.standard_normal((1, cols)).astype(np.float32)
    w = (rng.standard_normal((cols, cols)) / max(1, np.sqrt(cols))).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FrontendGraphsDiffer)
        # matmuls of matmuls of random data grow; the tolerance is relative to the magnitude
        assert_frontends_agree(
            _emit(prog, "jax"), _emit(prog, "torch"), x, row, w, rtol=2e-4, atol=2e-4
        )


@settings(
    max_examples=N_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(programs())
def test_random_programs_agree_across_frontends(case):
    _run(*case)


def test_program_emitters_agree_with_each_other_on_cpu():
    # the net itself: the two emitters write the same program (checked on the CPU paths alone)
    prog = [
        ("unary", 0, "tanh"),
        ("binary", 1, "add", 0, False),
        ("reduce", 2, "max", 1),
        ("matmul", 3),
        ("unary", 4, "softmax"),
    ]
    rng = np.random.default_rng(0)
    x, row = rng.standard_normal((5, 65)).astype(np.float32), rng.standard_normal((1, 65))
    w = rng.standard_normal((65, 65)).astype(np.float32) / 8
    row = row.astype(np.float32)
    a = np.asarray(jax.jit(_emit(prog, "jax"))(x, row, w))
    with torch.no_grad():
        b = _emit(prog, "torch")(*(torch.from_numpy(v) for v in (x, row, w))).numpy()
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_net_catches_a_planted_lowering_bug(monkeypatch):
    # the torch importer's rule for aten.tanh computes 1.01 * tanh(x): the real rule, times a
    # wrong constant
    real = RULES[torch.ops.aten.tanh.default]

    def wrong_rule(b, node, *args, **kwargs):
        r = real(b, node, *args, **kwargs)
        return b.elementwise("mul", [r, Lit(1.01, r.dtype)], r.shape, r.dtype)

    monkeypatch.setitem(RULES, torch.ops.aten.tanh.default, wrong_rule)
    with pytest.raises(AssertionError, match="torch.compile spyre"):
        _run(5, 65, [("unary", 0, "tanh"), ("reduce", 1, "sum", 1)], 0)
