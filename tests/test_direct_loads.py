"""Large inputs read block by block from their device arrays
(``device_model.blocks.DIRECT_LOAD_BYTES``), and host payloads the card adopts without a second
copy.

A stage that read a large weight in blocks that are not a plain reshape of it (the LM head's
ragged vocabulary blocks, a K split into several blocks) used to cut the whole weight into
blocks first: a padded copy and a transposed copy of it, alive for the stage. The same stages
now gather each step's blocks from the weight itself. The values each core loads are the same
either way, so the results are bit-identical; XLA's buffer assignment shows the copies gone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rng

import spyre_jax
from device_model import blocks, program
from device_model.layout import layout_for
from device_model.payload import XLA_ALIGN
from device_model.runtime import copy_in, runtime
from spyre_jax.tools.testing import assert_close


def _kernel_and_args(f, *args):
    kernel = spyre_jax.jit(f).lower(*args).compile().executable.kernel
    layouts = [kernel.tensor(name).layout for name in kernel.inputs]
    dev = [
        np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, lay.device_shape[-1] - a.shape[-1])])
        if a.ndim and lay.device_shape[-1] != a.shape[-1]
        else a.reshape(lay.device_shape)
        for a, lay in zip(args, layouts, strict=True)
    ]
    return kernel, dev


def _run(kernel, dev, monkeypatch, direct_bytes):
    monkeypatch.setattr(blocks, "DIRECT_LOAD_BYTES", direct_bytes)
    monkeypatch.setattr(program, "STAGED_MIN_STAGES", 10**6)  # one program, traced now
    return [np.asarray(a) for a in program.build_runner(kernel)(*dev)]


def _f16(*shape, seed=0):
    return rng(seed).standard_normal(shape).astype(np.float16)


CASES = {
    # the LM head: ragged vocabulary blocks of a transposed weight, K in several blocks
    "nt-matmul-ragged": (lambda x, w: x @ w.T, (_f16(16, 768), _f16(2051, 768, seed=1))),
    "matmul-ragged": (lambda x, w: x @ w, (_f16(40, 320), _f16(320, 1000, seed=1))),
    "transpose-72x91": (lambda x: x.T + 1, (_f16(72, 91),)),
    "transpose-4d": (lambda x: jnp.swapaxes(x, 1, 2) * 2, (_f16(2, 2, 65, 64),)),
    "slice-unaligned": (lambda x: x[3:70, 5:131] * 2, (_f16(80, 200),)),
    "concat-unaligned": (
        lambda a, b: jnp.concatenate([a, b], axis=1) + 1,
        (_f16(24, 77), _f16(24, 150, seed=1)),
    ),
    "pad-unaligned": (lambda x: jnp.pad(x, ((1, 2), (3, 61))) - 1, (_f16(33, 70),)),
    "row-sum-long": (lambda x: x.astype(jnp.float32).sum(axis=-1), (_f16(7, 5000),)),
    "column-sum": (lambda x: x.astype(jnp.float32).sum(axis=0), (_f16(300, 100),)),
    "embedding": (
        lambda t, i: jnp.take(t, i, axis=0),
        (_f16(1001, 96), np.array([0, 5, 1000, 77, 3], np.int32)),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_direct_loads_give_the_same_bits_as_blocked_loads(fresh_card, monkeypatch, name):
    f, args = CASES[name]
    kernel, dev = _kernel_and_args(f, *args)
    blocked = _run(kernel, dev, monkeypatch, 1 << 62)
    direct = _run(kernel, dev, monkeypatch, 0)
    for a, b in zip(blocked, direct, strict=True):
        np.testing.assert_array_equal(a, b)
    assert_close(spyre_jax.jit(f)(*args), jax.jit(f)(*args))


def _temp_bytes(kernel, dev, monkeypatch, direct_bytes) -> int:
    monkeypatch.setattr(blocks, "DIRECT_LOAD_BYTES", direct_bytes)
    monkeypatch.setattr(program, "STAGED_MIN_STAGES", 10**6)
    runner = program.build_runner(kernel)
    return runner.lower(*dev).compile().memory_analysis().temp_size_in_bytes


def test_a_large_weight_is_not_copied_into_blocks(fresh_card, monkeypatch):
    # GPT-2's LM head: vocabulary rows in ragged blocks, K in blocks (compiled, never run: the
    # zeros are never touched)
    x, w = np.zeros((16, 768), np.float16), np.zeros((50257, 768), np.float16)
    kernel, dev = _kernel_and_args(lambda x, w: x @ w.T, x, w)
    assert [op.block[-1] for op in kernel.stages[0].inputs] == [192, 192]
    copied = _temp_bytes(kernel, dev, monkeypatch, 1 << 62)
    direct = _temp_bytes(kernel, dev, monkeypatch, 8 << 20)
    # the blocked copy of the weight (padded and transposed: XLA fuses one of the two) is gone;
    # what is left is every core's scratchpad slots and the PE's fp32 operands
    assert copied - direct > 0.9 * w.nbytes, (copied, direct, w.nbytes)


def test_a_host_payload_is_aligned_and_adopted_by_the_card(fresh_card):
    # regression: an unaligned payload was copied again on the first launch that read it, so a
    # weight was briefly held twice on the host
    raw = np.zeros(64 * 64 * 2 + 2, np.uint8)
    host = raw[2:].view(np.float16).reshape(64, 64)  # deliberately not 64-byte aligned
    host[:] = 1.5
    buf = copy_in(host, layout_for((64, 64), "float16", 128), rt=runtime())
    payload = buf.payload()
    assert isinstance(payload, np.ndarray) and payload.ctypes.data % XLA_ALIGN == 0
    assert not np.shares_memory(payload, host)
    host[:] = 0  # the buffer owns its bytes
    buf.delete()

    a = spyre_jax.device_put(host + np.float16(1.5))
    before = a.buffer.payload()
    assert isinstance(before, np.ndarray)
    np.testing.assert_array_equal(
        np.asarray(spyre_jax.jit(lambda v: v * 2)(a)), np.full((64, 64), 3.0, np.float16)
    )
    after = a.buffer.payload()  # the launch made it a card array over the same bytes
    assert isinstance(after, jax.Array)
    assert after.unsafe_buffer_pointer() == before.ctypes.data


def test_device_put_of_a_jax_array_keeps_its_bytes():
    # a JAX array never changes, so the card keeps its bytes (an equinox model's weights are
    # not held twice on the host); a NumPy array is still copied (test_scale: owns its bytes)
    x = jnp.arange(4 * 64, dtype=jnp.float16).reshape(4, 64)
    a = spyre_jax.device_put(x)
    assert a.buffer.payload().ctypes.data == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(spyre_jax.jit(lambda v: v + 1)(a)), np.asarray(x) + 1)
    del x  # the card's copy keeps the bytes alive
    np.testing.assert_array_equal(np.asarray(a)[1, :3], np.array([64, 65, 66], np.float16))
    padded = spyre_jax.device_put(jnp.ones((4, 100), jnp.float16))  # not the card's layout
    assert np.asarray(padded).shape == (4, 100)
