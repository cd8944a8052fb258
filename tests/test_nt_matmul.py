"""NT matmuls: an rhs given transposed (``x @ w.T``, a torch Linear's ``[out, in]`` weight) is
read in place (``matmul[rhs_t=True]``: blocks ``(1, tn, tk)`` of ``[B, N, K]``) instead of
being re-laid out by a transpose stage on every call. The card's PE takes the rhs sticked on N,
so the timing model charges the restickify of the cheaper form the schedule names
(``MatmulStep.nt_form``): the rhs, or the swapped product; nothing for a constant rhs, laid out
once (a torch model's weights: their layouts, ``lowering.hoist``).

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

import spyre_jax
import torch_bridge
from device_model.runtime import runtime
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
    # the weight, sticked on K as stored, is restickified once with the weights' layouts (the
    # card's PE takes the rhs sticked on N): every call runs an NN product, no re-layout, and
    # the bias add rides the matmul's store (its epilogue)
    assert ck.weight_layouts is not None and not _nt_stages(ck.kernel)
    assert kinds == ["matmul"], kinds
    assert (ck.kernel.stages[0].step.epilogue is not None) == bias
    assert_close(got, want)


def _nt_kernel(f: Any, *xs: Any) -> Any:
    return spyre_jax.jit(f).lower(*xs).compile()


def test_the_schedule_names_the_cheaper_form_and_the_model_charges_it():
    # a decode step's row: the swapped product restickifies the row and the product (a stick a
    # row each: 2048 + 2048 rows), far less than the 2048 x 2048 weight; a 512-row prefill: the
    # swap still (512 x (2048 + 2048) < 2048 x 2048 elements, read and written); 4096 rows: the rhs
    card = runtime().card
    w = jnp.ones((2048, 2048), jnp.float16)
    for rows, form in ((1, "swap"), (512, "swap"), (4096, "rhs")):
        x = jnp.ones((rows, 2048), jnp.float16)
        c = _nt_kernel(lambda x, w: x @ w.T, x, w)
        (st,) = _nt_stages(c.kernel)
        assert st.step.nt_form == form, rows
        if form == "rhs":
            assert st.step.relayout_bytes == 2 * 2048 * 2048 * 2
        elif rows == 1:  # [1, K] -> [K, 1]: one stick per row; the product [N, 1] -> [1, N]
            assert st.step.relayout_bytes == 4096 + 2048 * 128 + 2048 * 128 + 4096
        nn = _nt_kernel(lambda x, w: x @ w, x, w)  # the same product with w as stored: NN
        extra = c.cost_analysis()["sim_time_us"] - nn.cost_analysis()["sim_time_us"]
        assert extra == pytest.approx(st.step.relayout_bytes / card.relayout_bw * 1e6, rel=0.02)
        assert c.parameter_shares()["relayout_bw"] > 0 == nn.parameter_shares()["relayout_bw"]
    # a constant weight is laid out once, when loaded: charged nothing per call
    x = jnp.ones((512, 2048), jnp.float16)
    c = _nt_kernel(lambda x: x @ w.T, x)
    (st,) = _nt_stages(c.kernel)
    assert st.step.nt_form == "resident" and st.step.relayout_bytes == 0
    assert "restickify resident" in str(st.step)
