"""NT matmuls: an rhs given transposed (``x @ w.T``, a torch Linear's ``[out, in]`` weight) is
read in place (``matmul[rhs_t=True]``: blocks ``(1, tn, tk)`` of ``[B, N, K]``) instead of
being re-laid out by a transpose stage on every call.

Each jax case runs on the vectorized card and the NumPy reference interpreter (whole device
buffers, stick padding included, and no NaN in them: the last N block of a ragged N reads rows
past the weight) and against ``jax.jit``; the torch cases against eager.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from test_reference import _arr, _check

import torch_bridge
from lowering.graph import Graph, Node, Var, check_graph
from lowering.matmul_passes import nt_matmul
from lowering.op_params import Matmul, Reshape, Transpose
from spyre_jax.tools.testing import assert_close

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
SMALL = dict(scratchpad_bytes=16 * 1024, num_cores=4)


def _nt_stages(kern: Any) -> list[Any]:
    return [s for s in kern.stages if s.kind == "matmul" and s.step.rhs_t]


def _run(f: Any, *xs: Any, k: int) -> Any:
    kern, ref = _check(f, *xs, k=k)
    for buf in ref:
        if buf.dtype.kind == "f":
            assert not np.isnan(buf.astype(np.float32)).any(), "NaN in the output's padding"
    return kern


@pytest.mark.parametrize(
    "m,k,n,dt",
    [
        (3, 96, 100, F16),
        (1, 70, 130, F32),
        (5, 128, 64, BF16),
        (4, 200, 33, F16),
        (1, 64, 1, F32),
    ],
)
def test_x_at_w_t_folds_the_transpose(m, k, n, dt):
    x, w = _arr((m, k), dt, 1), _arr((n, k), dt, 2)
    kern = _run(lambda x, w: x @ w.T, x, w, k=k)
    assert [s.kind for s in kern.stages] == ["matmul"]
    assert len(_nt_stages(kern)) == 1


def test_batched_nt_einsum():
    x, w = _arr((2, 5, 64), F16, 3), _arr((2, 7, 64), F16, 4)
    kern = _run(lambda x, w: jnp.einsum("bmk,bnk->bmn", x, w), x, w, k=64)
    assert [s.kind for s in kern.stages] == ["matmul"]
    assert len(_nt_stages(kern)) == 1


def test_leading_dims_of_lhs():
    x, w = _arr((2, 3, 96), F32, 5), _arr((40, 96), F32, 6)
    kern = _run(lambda x, w: x @ w.T, x, w, k=96)
    assert len(_nt_stages(kern)) == 1
    assert "map" not in [s.kind for s in kern.stages]


def test_transpose_kept_when_used_elsewhere():
    x, w = _arr((3, 64), F16, 7), _arr((50, 64), F16, 8)
    kern = _run(lambda x, w: (x @ w.T, w.T * 2), x, w, k=64)
    assert len(_nt_stages(kern)) == 1
    assert sorted(s.kind for s in kern.stages) == ["map", "matmul"]


@pytest.mark.parametrize(
    "m,k,n,dt",
    [(5, 1000, 300, F16), (3, 517, 150, F32), (70, 2100, 90, BF16)],
)
@pytest.mark.slow
def test_general_tiler_ragged_n_and_k(small_card, m, k, n, dt):
    """Whole blocks do not fit a 16 KiB scratchpad: N in blocks that do not divide it (the last
    one's output columns masked), K split in whole sticks with a masked ragged last block."""
    small_card(**SMALL)
    x, w = _arr((m, k), dt, 9), _arr((n, k), dt, 10)
    kern = _run(lambda x, w: x @ w.T, x, w, k=k)
    (st,) = _nt_stages(kern)
    body = st.step
    assert body.n_logical == n and st.grid[3] > 1
    rhs = st.inputs[1]
    assert rhs.block[1] < n and n % rhs.block[1]


def test_pass_rewrites_and_checks():
    w = Var((30, 64), "float16")
    a = Var((1, 3, 64), "float16")
    t, r, o = Var((64, 30), "float16"), Var((1, 64, 30), "float16"), Var((1, 3, 30), "float16")
    g = Graph(
        "g",
        (a, w),
        (
            Node("transpose", (w,), (t,), Transpose((1, 0))),
            Node("reshape", (t,), (r,), Reshape((1, 64, 30))),
            Node("matmul", (a, r), (o,), Matmul("float16")),
        ),
        (o,),
    )
    g2 = nt_matmul(g)
    check_graph(g2)
    assert [n.op for n in g2.nodes] == ["reshape", "matmul"]
    assert g2.nodes[1].params.rhs_t is True and g2.nodes[1].inputs[1].shape == (1, 30, 64)
    assert nt_matmul(g2) is g2


@pytest.mark.parametrize(
    "shape,k,n,dt,bias",
    [
        ((3, 96), 96, 100, torch.float16, True),
        ((1, 70), 70, 130, torch.float32, False),
        ((2, 3, 64), 64, 45, torch.bfloat16, True),
    ],
)
def test_torch_linear(shape, k, n, dt, bias):
    torch.manual_seed(0)
    m = torch.nn.Linear(k, n, bias=bias).to(dt).eval()
    x = torch.randn(*shape).to(dt)
    f = torch.compile(m, backend="spyre", dynamic=False)
    with torch.no_grad():
        got, want = f(x), m(x)
    ck = torch_bridge.backend.compiled_kernels()[-1]
    kinds = [s.kind for s in ck.kernel.stages]
    assert len(_nt_stages(ck.kernel)) == 1
    # no re-layout, and the bias add rides the matmul's store (its epilogue)
    assert kinds == ["matmul"], kinds
    assert (ck.kernel.stages[0].step.epilogue is not None) == bias
    assert_close(got, want)
