"""A slice of the JAX op table on other cards: every ``CardSpec`` field is honoured end to end.

The entries of ``spyre_jax.tools.jax_ops.JAX_OPS`` named below (elementwise, binary with
broadcasting, reductions, scans, data movement, indexing, matmuls, the fused norms and
attention) run through ``spyre_jax.jit`` on cards with 64-byte and 256-byte sticks and with a
256 KiB scratchpad, and are compared with ``jax.jit`` on the CPU at the coverage run's
tolerances (``coverage_common.close_np``). Layouts, tiles, scratchpad plans, device-memory
alignment and the timing all take the card's numbers: a 128 written anywhere would put a wrong
value or a checker error here.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import spyre_jax
from spyre_jax.tools.coverage_common import close_np
from spyre_jax.tools.jax_ops import JAX_OPS, make_samples

NAMES = (
    "jnp.exp",
    "jnp.tanh",
    "jax.scipy.special.erf",
    "jnp.add",
    "jnp.where(a>b)",
    "jnp.sum",
    "jnp.max",
    "jnp.argmax",
    "jnp.cumsum",
    "jnp.transpose",
    "jnp.concatenate",
    "lax.slice",
    "embedding (table[idx])",
    "jnp.tril",
    "jnp.var",
    "jnp.matmul",
    "jnp.einsum(bhqd,bhkd)",
    "jax.nn.softmax",
    "layernorm",
    "attention",
)

CARDS = {
    "stick64": {"stick_bytes": 64},
    "stick256": {"stick_bytes": 256},
    "sp256k": {"scratchpad_bytes": 256 * 1024},
}

_BY_NAME = {op.name: (i, op) for i, op in enumerate(JAX_OPS)}


def test_the_slice_is_in_the_table():
    missing = [n for n in NAMES if n not in _BY_NAME]
    assert not missing, missing


@pytest.mark.parametrize("card", sorted(CARDS))
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_op_table_slice_on_other_cards(name, card, small_card):
    spec = small_card(**CARDS[card])
    i, op = _BY_NAME[name]
    dt = op.dtypes[0]
    rng = np.random.default_rng([0, i, 0])
    cpu = jax.devices("cpu")[0]
    for fn, args in make_samples(op, rng, dt):
        with jax.default_device(cpu):
            want = jax.device_get(jax.jit(fn)(*args))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f = spyre_jax.jit(fn)
            got = jax.tree_util.tree_map(np.asarray, f(*args))
        for g, w in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            why = close_np(np.asarray(g), np.asarray(w))
            assert why is None, f"{name} on {card}: {why}"
        compiled = f.lower(*args).compile()
        kernel = compiled.kernel
        assert kernel.stick_bytes == spec.stick_bytes and kernel.num_cores == spec.num_cores
        for t in kernel.tensors:
            assert t.layout.stick_bytes == spec.stick_bytes, (name, t)
        cost = compiled.cost_analysis()
        assert cost["scratchpad_peak_bytes"] <= spec.scratchpad_usable_bytes
        for a in jax.tree_util.tree_leaves(f(*args)):
            assert a.layout.stick_bytes == spec.stick_bytes
            assert a.buffer.addr % spec.stick_bytes == 0  # device memory aligns to the card's
