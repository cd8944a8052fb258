"""The ``sink_transposes`` pass (lowering/layout_pass.py): transposes sunk through elementwise
ops, slices, concatenations and reductions until inverse pairs meet and cancel; never more
transpose bytes than before. Results against ``jax.jit`` on the CPU and torch eager in fp32:
the pass moves data, and only a sum's order of accumulation may change with the layout it runs
on (within 1e-6 relative to the result's scale, fp32 rounding of a few dozen terms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import spyre_jax
from lowering.from_jaxpr import from_jaxpr
from lowering.graph import check_graph
from lowering.layout_pass import sink_transposes
from torch_bridge import backend as tb

NCHW, NHWC = (0, 3, 1, 2), (0, 2, 3, 1)


def _graph(f, *xs):
    return from_jaxpr(jax.make_jaxpr(f)(*xs), "f")


def _transposes(g):
    return [n for n in g.nodes if n.op == "transpose"]


def _same(f, *xs):
    got, want = jax.tree.leaves(spyre_jax.jit(f)(*xs)), jax.tree.leaves(jax.jit(f)(*xs))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        tol = 1e-6 * max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=tol)


def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_an_inverse_pair_cancels():
    f = lambda x: jnp.transpose(jnp.transpose(x, NHWC), NCHW) * 2.0  # noqa: E731
    x = _x(2, 3, 4, 5)
    g = sink_transposes(_graph(f, x))
    check_graph(g)
    assert not _transposes(g)
    _same(f, x)


def test_a_per_channel_affine_and_relu_run_on_the_source_layout():
    # the batch norm and ReLU between two convolutions: NHWC -> NCHW, per-channel scale and
    # shift (broadcasts, and an elementwise op of them), ReLU, -> NHWC: no transpose left
    def f(x, s, b):
        y = jnp.transpose(x, NCHW)
        scale = lax.rsqrt(s + 1e-5)[None, :, None, None]
        y = jnp.maximum(y * scale + b[None, :, None, None], 0.0)
        return jnp.transpose(y, NHWC)

    x, s, b = _x(1, 6, 7, 16), np.abs(_x(16, seed=1)), _x(16, seed=2)
    g = sink_transposes(_graph(f, x, s, b))
    check_graph(g)
    assert not _transposes(g)
    _same(f, x, s, b)


def test_slices_concatenations_and_reductions_follow_the_permutation():
    def f(x):
        y = jnp.transpose(x, NCHW)  # [N, C, H, W]
        y = jnp.pad(y, ((0, 0), (0, 0), (1, 2), (2, 1)), constant_values=-1.0)
        y = y[:, 1:, ::2, 1:-1]
        z = jnp.concatenate([y, y * 3.0], axis=1)
        return jnp.transpose(z, NHWC), jnp.max(z, axis=(2, 3)), jnp.sum(z, axis=1)

    x = _x(2, 5, 6, 4, seed=3)
    g = sink_transposes(_graph(f, x))
    check_graph(g)
    _same(f, x)


def test_it_never_adds_transpose_bytes():
    # a transposed value read by two matmuls: sinking would not cancel anything
    def f(x, w):
        y = jnp.transpose(x, (1, 0))
        return y @ w, (y * 2.0) @ w

    x, w = _x(64, 32), _x(64, 8, seed=1)
    g = _graph(f, x, w)
    out = sink_transposes(g)
    check_graph(out)
    before = sum(np.prod(n.out.shape) for n in _transposes(g))
    after = sum(np.prod(n.out.shape) for n in _transposes(out))
    assert after <= before


@settings(max_examples=12, deadline=None)
@given(
    perm=st.permutations(range(4)),
    ops=st.lists(
        st.sampled_from(["affine", "relu", "slice", "sum", "concat", "convert"]), max_size=4
    ),
    back=st.booleans(),
)
def test_chains_of_ops_after_a_transpose_match_jax(perm, ops, back):
    perm = tuple(perm)
    inv = tuple(int(i) for i in np.argsort(perm))

    def f(x, v):
        y = jnp.transpose(x, perm)
        for op in ops:
            if op == "affine":
                y = y * v[: y.shape[-1]] + 1.0
            elif op == "relu":
                y = jnp.maximum(y, 0.0)
            elif op == "slice" and y.ndim == 4:
                y = y[:, ::2, 1:, :]
            elif op == "sum" and y.ndim == 4:
                y = jnp.sum(y, axis=1, keepdims=True)
            elif op == "concat":
                y = jnp.concatenate([y, -y], axis=0)
            elif op == "cvt":
                y = y.astype(jnp.float16).astype(jnp.float32)
        return jnp.transpose(y, inv) if back else y

    x, v = _x(3, 4, 5, 6, seed=len(ops)), _x(8, seed=9)
    g = sink_transposes(_graph(f, x, v))
    check_graph(g)
    _same(f, x, v)


def test_a_torch_conv_bn_relu_stack_keeps_two_relayouts():
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
    ).eval()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 16, 12, 12)
    torch._dynamo.reset()
    tb.reset_fallback_stats()  # compiled_kernels(): this test's only
    with torch.no_grad():
        got = torch.compile(m, backend="spyre", dynamic=False)(x)
        want = m(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (card_graph,) = [c for c in tb.compiled_kernels() if "conv" in {n.op for n in c.graph.nodes}]
    g = card_graph.graph
    # imported: each convolution wrapped in NCHW -> NHWC and back; after the pass only the
    # input's and the result's re-layouts are left (none around the pool or between the convs)
    assert len(_transposes(g)) == 4
    assert len(_transposes(sink_transposes(g))) == 2


def test_nhwc_convolutions_have_no_relayout():
    from spyre_jax.tools.bench_schedules import CASES

    fn, shapes, _ = CASES["conv-56x64x64-3"]
    args = [jax.ShapeDtypeStruct(s, jnp.float16) for s in shapes]
    k = spyre_jax.jit(fn).lower(*args).kernel
    assert [s.kind for s in k.stages] == ["matmul"]
    assert k.stages[0].step.window is not None
