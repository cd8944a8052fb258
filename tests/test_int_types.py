"""int8 and uint8 on the card (one byte an element, 8-bit wrapping arithmetic), through
``spyre_jax.jit``, ``torch.compile(backend="spyre")`` and the ``spyre`` device, bit-equal to the
CPU; int16 refused with a TypeError naming it and what the card has."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch._dynamo.exc

import spyre_jax
import torch_bridge.device as dev

TORCH_FNS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "neg_abs": lambda a, b: (-a).abs(),
    "max": lambda a, b: torch.maximum(a, b),
    "compare": lambda a, b: torch.where(a > b, a, b) + (a == b).to(a.dtype),
    "bitwise": lambda a, b: (a & b) ^ (a | 5) ^ ~b,
    "shifts": lambda a, b: (a << 2) + (a >> 1),
    "floor_divide": lambda a, b: a // 3 + a % 7,
    "to_float": lambda a, b: a.float() * 0.5,
    "from_float": lambda a, b: (a.float() * 0.5).to(a.dtype),
    "to_int32": lambda a, b: a.int() + 1000,
    "sum_amax": lambda a, b: a.sum(-1) + a.amax(-1),
    "movement": lambda a, b: torch.cat([a, b], 1).t().contiguous(),
}


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
    a = torch.randint(lo, hi, (5, 140), generator=g).to(dtype)
    b = torch.randint(lo, hi, (5, 140), generator=g).to(dtype)
    return a, b


@pytest.mark.parametrize("name", sorted(TORCH_FNS))
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=["int8", "uint8"])
def test_torch_int8_uint8_on_both_paths(name, dtype):
    fn = TORCH_FNS[name]
    a, b = _inputs(dtype)
    want = fn(a, b)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend="spyre", options={"strict": True})(a, b)
    assert got.dtype == want.dtype and torch.equal(got, want)
    dev.reset_stats()
    got = fn(a.to("spyre"), b.to("spyre")).cpu()
    assert dev.fallback_stats() == {}
    assert got.dtype == want.dtype and torch.equal(got, want)


JAX_FNS = {
    "add_mul": lambda x, y: x + y * x,
    "compare": lambda x, y: jnp.where(x < y, x, y),
    "bitwise_shift": lambda x, y: (x ^ y) >> 1,
    "convert": lambda x, y: x.astype(jnp.float32) * 0.5,
    "sum": lambda x, y: x.sum(-1),
    "max": jnp.maximum,
}


@pytest.mark.parametrize("name", sorted(JAX_FNS))
@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["int8", "uint8"])
def test_jax_int8_uint8_keep_their_dtype(name, dtype):
    """Regression: int8, uint8 (and int16) arguments used to be widened to int32 silently, so
    results came back int32 and did not wrap as JAX's do."""
    a, b = (t.numpy().astype(dtype) for t in _inputs(torch.int32))
    f = JAX_FNS[name]
    want = np.asarray(jax.jit(f)(a, b))
    got = np.asarray(spyre_jax.jit(f)(a, b))
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_int16_is_refused_naming_it():
    with pytest.raises(TypeError, match="int16.*supported dtypes: .*int8"):
        spyre_jax.jit(lambda x: x + 1)(np.arange(4, dtype=np.int16))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info, torch.no_grad():
        torch.compile(lambda x: x + 1, backend="spyre", options={"strict": True})(
            torch.arange(4, dtype=torch.int16)
        )
    inner = info.value.inner_exception
    assert isinstance(inner, TypeError) and "torch.int16" in str(inner)
    # without strict, and on the device: the CPU runs it, with the fallback warning
    x = torch.arange(4, dtype=torch.int16)
    with pytest.warns(UserWarning, match="int16|CPU"):
        assert torch.equal((x.to("spyre") + 1).cpu(), x + 1)
    warnings.resetwarnings()
