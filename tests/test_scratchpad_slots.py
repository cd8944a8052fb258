"""Scratchpad slots written at steps known when the program is traced stay values of their own
(``device_model.execute._Buffers``): a load read by the next compute is not written into the
stacked buffer array and read back out of it, which XLA does not fold (a decode step's matmul
spent 4x its time there). Stages whose steps run in a ``lax.scan`` still use the stacked array.
Results must not change: the reference tests (``tests/test_reference.py``) compare every kernel
with the NumPy card; here the compiled program's shape and a few stages against ``jax.jit``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rng

import spyre_jax
from device_model import execute, program
from spyre_jax.tools.testing import assert_close


def _kernel(f, *args):
    return spyre_jax.jit(f).lower(*args).compile().executable.kernel


def _hlo(kernel, *args) -> str:
    layouts = [kernel.tensor(name).layout for name in kernel.inputs]
    dev = [jnp.zeros(lay.device_shape, a.dtype) for a, lay in zip(args, layouts, strict=True)]
    return program.build_runner(kernel).lower(*dev).as_text()


def test_an_unrolled_matmul_reads_its_loads_directly(fresh_card):
    x = rng(0).standard_normal((1, 128)).astype(np.float32)
    w = rng(1).standard_normal((384, 128)).astype(np.float32)
    kernel = _kernel(lambda x, w: x @ w.T, x, w)
    (stage,) = kernel.stages
    assert 1 < stage.steps <= execute.UNROLL_STEPS  # double-buffered loads, unrolled
    assert "dynamic_update_slice" not in _hlo(kernel, x, w)


def test_a_long_k_matmul_runs_its_steps_in_a_scan(fresh_card):
    x = rng(0).standard_normal((8, 16384)).astype(np.float16)
    w = rng(1).standard_normal((16384, 64)).astype(np.float16)
    (stage,) = _kernel(lambda x, w: x @ w, x, w).stages
    assert stage.steps > execute.UNROLL_STEPS  # so "long-k" below covers the stacked buffers


CASES = {
    # unrolled: K in two steps, double-buffered operands, an accumulator slot
    "decode-matmul": (lambda x, w: x @ w.T, ((1, 128), (384, 128))),
    # many K steps: the stage runs in a scan (traced slot indices, the stacked buffers)
    "long-k": (lambda x, w: x @ w, ((8, 16384), (16384, 64))),
    # a row reduction carried over several steps, then an elementwise tail
    "row-sum": (lambda x: jnp.tanh(x.sum(axis=-1)), ((16, 3000),)),
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), ((24, 700),)),
    "elementwise": (lambda a, b: a * b + 1, ((40, 200), (40, 200))),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.slow
def test_results_match_jax(fresh_card, name, dtype):
    f, shapes = CASES[name]
    args = [rng(i).standard_normal(s).astype(dtype) for i, s in enumerate(shapes)]
    # fp32: accumulation order only; fp16: the card rounds where it stores
    assert_close(spyre_jax.jit(f)(*args), jax.jit(f)(*args))
