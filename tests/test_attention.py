"""``F.scaled_dot_product_attention`` on the spyre device (torch_bridge.attention): one launch
(``spyre_jax::attention``, on a size bucket as the keys grow) instead of PyTorch's eight-launch
math path, the same results as eager CPU, and the math path wherever a mask, dropout, a
gradient or a trace needs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spyre_jax  # noqa: F401  (the device)
from spyre_jax.tools.testing import assert_close
from torch_bridge import attention, eager


def _qkv(b, hq, hk, lq, lk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(b, h, n, d, generator=g).to(dtype)  # noqa: E731
    return mk(hq, lq), mk(hk, lk), mk(hk, lk)


def _launches() -> int:
    return eager.stats()["launches"]


def _on_card(q, k, v, **kw):
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q.to("spyre"), k.to("spyre"), v.to("spyre"), **kw)
    return out.cpu()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.sampled_from([1, 2, 4]),
    hk=st.integers(1, 2),
    lq=st.sampled_from([1, 3, 8]),
    lk=st.integers(1, 40),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.5]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
@pytest.mark.slow
def test_attention_matches_eager_cpu(groups, hk, lq, lk, causal, scale, dtype):
    q, k, v = _qkv(1, groups * hk, hk, lq, lk, 32, dtype, seed=lk)
    kw = dict(is_causal=causal, scale=scale, enable_gqa=groups > 1)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)
    got = _on_card(q, k, v, **kw)
    assert got.dtype == dtype and got.shape == want.shape
    # the reference computes in fp32; the tolerance is the result dtype's, for two roundings in
    # a row: the card rounds the probabilities and the output to it where stored
    assert_close(got.float(), want, dtype=dtype, chain=2)


def test_attention_is_one_launch_and_one_kernel_per_bucket_as_the_keys_grow():
    q, k, v = _qkv(1, 4, 2, 1, 9, 32, torch.float32)
    _on_card(q, k, v, enable_gqa=True)  # compiles
    before, fb = _launches(), eager.stats()["cpu_fallbacks"]
    got = _on_card(q, k, v, enable_gqa=True)
    assert _launches() - before == 1 and eager.stats()["cpu_fallbacks"] == fb
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    compiles = eager.stats()["compiles"]
    for lk in range(10, 40):  # a decode loop: the keys grow by one a step
        q, k, v = _qkv(1, 4, 2, 1, lk, 32, torch.float32, seed=lk)
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.testing.assert_close(_on_card(q, k, v, enable_gqa=True), want)
    assert eager.stats()["compiles"] - compiles <= 1  # bucket 64; padded keys masked by -inf
    assert eager.stats()["padded_launches"] > 0
    q, k, v = _qkv(1, 4, 2, 6, 6, 32, torch.float32)
    _on_card(q, k, v, enable_gqa=True, is_causal=True)
    before = _launches()
    _on_card(q, k, v, enable_gqa=True, is_causal=True)
    assert _launches() - before == 1  # the causal bias is kept on the device


def test_a_mask_takes_the_math_path_and_a_fully_masked_row_gives_zeros():
    q, k, v = _qkv(1, 2, 2, 3, 7, 32, torch.float32)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1] = False  # row 1 sees no key: the math path's safe softmax gives zeros there
    before = _launches()
    got = _on_card(q, k, v, attn_mask=mask.to("spyre"))
    assert _launches() - before > 3  # PyTorch's math path, launch by launch
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want)
    assert not got[:, :, 1].any()
    assert not attention.fast_path(q, k, v, attn_mask=mask)
    assert not attention.fast_path(q, k, v, dropout_p=0.1)


def test_inference_mode_and_inputs_that_need_gradients():
    q, k, v = _qkv(1, 2, 2, 1, 5, 32, torch.float32)
    want = F.scaled_dot_product_attention(q, k, v)
    with torch.inference_mode():  # below autograd: the device key's kernel
        got = F.scaled_dot_product_attention(q.to("spyre"), k.to("spyre"), v.to("spyre"))
    torch.testing.assert_close(got.cpu(), want)
    sq = q.to("spyre").requires_grad_()
    assert not attention.fast_path(sq, k, v)  # the math path, which autograd can go through
    out = F.scaled_dot_product_attention(sq, k.to("spyre"), v.to("spyre"))
    assert out.requires_grad and out.grad_fn is not None
    torch.testing.assert_close(out.detach().cpu(), want)


def test_grouped_heads_need_enable_gqa_as_on_the_cpu():
    q, k, v = _qkv(1, 4, 2, 1, 5, 32, torch.float32)
    with pytest.raises(RuntimeError) as cpu_err:
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError) as card_err:
        _on_card(q, k, v)
    assert str(card_err.value) == str(cpu_err.value)


def test_the_causal_bias_is_made_again_on_a_new_card():
    # regression: the bias kept on the device outlived spyre_jax.set_card ("lives on a
    # previous card")
    q, k, v = _qkv(1, 2, 2, 5, 5, 32, torch.float32)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(_on_card(q, k, v, is_causal=True), want)
    spyre_jax.set_card(spyre_jax.CardSpec())
    torch.testing.assert_close(_on_card(q, k, v, is_causal=True), want)


def test_a_trace_keeps_pytorchs_decomposition():
    # the four-launch path is for eager tensors: fake tensors (torch.compile's trace) and
    # dispatch modes get PyTorch's decomposition, and no bias made in a trace is kept
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv(1, 2, 2, 4, 4, 32, torch.float32)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq = mode.from_tensor(q.to("spyre"))
        assert not attention.fast_path(fq, fq, fq)
        out = F.scaled_dot_product_attention(fq, fq, fq, is_causal=True)
        assert out.shape == q.shape
    assert not attention._biases or all(type(b) is torch.Tensor for b in attention._biases.values())
    compiled = torch.compile(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), backend="spyre"
    )
    got = compiled(q.to("spyre"), k.to("spyre"), v.to("spyre"))
    torch.testing.assert_close(got.cpu(), F.scaled_dot_product_attention(q, k, v, is_causal=True))
