"""Convolutions on the card (issue 31, first step): ``lax.conv_general_dilated`` and
``aten.convolution`` as a GEMM of input patches and the kernel, against ``jax.jit`` on the CPU
and torch eager; every convolution of a 224x224 ResNet-50 at batch 1 fits the scratchpad.

Tolerance: one matmul, fp32 accumulation over ``taps * C`` terms, one rounding to the output
dtype (``assert_close`` with ``k`` the number of terms)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from jax import lax

import spyre_jax
import torch_bridge.backend as tb
from lowering.errors import LoweringError
from spyre_jax.tools.testing import assert_close

R = np.random.default_rng(0)
X = R.standard_normal((2, 3, 17, 19)).astype(np.float32)
W = R.standard_normal((8, 3, 3, 3)).astype(np.float32)
X8 = R.standard_normal((2, 8, 11, 13)).astype(np.float32)
W8 = R.standard_normal((6, 8, 3, 3)).astype(np.float32)
WP = R.standard_normal((8, 3, 4, 4)).astype(np.float32)

JAX_CASES = {
    "valid": (lambda x, w: lax.conv(x, w, (1, 1), "VALID"), X, W),
    "same_stride2": (lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "SAME"), X, W),
    "pad_dilation": (
        lambda x, w: lax.conv_general_dilated(x, w, (1, 1), ((2, 1), (0, 3)), rhs_dilation=(2, 2)),
        X,
        W,
    ),
    "channels_last_8": (
        lambda x, w: lax.conv_general_dilated(
            jnp.transpose(x, (0, 2, 3, 1)),
            jnp.transpose(w, (2, 3, 1, 0)),
            (1, 2),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
        X8,
        W8,
    ),
    "many_channels_stride2": (lambda x, w: lax.conv(x, w, (2, 2), "SAME"), X8, W8),
    "groups": (
        lambda x, w: lax.conv_general_dilated(x, w[:, :4], (1, 1), "VALID", feature_group_count=2),
        X8,
        W8,
    ),
    "depthwise": (
        lambda x, w: lax.conv_general_dilated(
            x, jnp.tile(w[:1, :1], (8, 1, 1, 1)), (1, 1), "SAME", feature_group_count=8
        ),
        X8,
        W8,
    ),
    "patchify": (lambda x, w: lax.conv(x[:, :, :16, :16], w, (4, 4), "VALID"), X, WP),
    "conv_transpose": (
        lambda x, w: lax.conv_transpose(
            x,
            jnp.transpose(w, (2, 3, 1, 0)),
            (2, 2),
            "SAME",
            dimension_numbers=("NCHW", "HWIO", "NCHW"),
        ),
        X8,
        W8,
    ),
    "conv1d": (
        lambda x, w: lax.conv_general_dilated(x[:, :, 0], w[:, :, 0], (2,), ((1, 1),)),
        X,
        W,
    ),
}


@pytest.mark.parametrize("name", sorted(JAX_CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_jax_convolutions(name, dtype):
    f, x, w = JAX_CASES[name]
    x, w = x.astype(dtype), w.astype(dtype)
    got, want = spyre_jax.jit(f)(x, w), jax.jit(f)(x, w)
    k = int(np.prod(w.shape[1:]))
    assert_close(np.asarray(got), np.asarray(want), k=k)


def test_3d_convolution_is_refused_with_the_users_line():
    x = np.ones((1, 2, 4, 4, 4), np.float32)
    w = np.ones((3, 2, 2, 2, 2), np.float32)
    with pytest.raises(LoweringError, match="3-D convolution is not supported") as e:
        spyre_jax.jit(lambda a, b: lax.conv(a, b, (1, 1, 1), "VALID"))(x, w)
    assert "test_conv.py" in str(e.value)


class _EqxCNN(eqx.Module):
    c1: eqx.nn.Conv2d
    c2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.c1 = eqx.nn.Conv2d(3, 16, 3, padding=1, key=k1)
        self.c2 = eqx.nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=4, key=k2)
        self.head = eqx.nn.Linear(16, 10, key=k3)

    def __call__(self, x):
        h = jax.nn.relu(self.c1(x))
        h = jax.nn.relu(self.c2(h))
        return self.head(jnp.mean(h, axis=(1, 2)))


def test_equinox_cnn_through_spyre_jit():
    model = _EqxCNN(jax.random.key(0))
    x = R.standard_normal((4, 3, 16, 16)).astype(np.float32)
    got = spyre_jax.jit(lambda m, a: jax.vmap(m)(a))(model, x)
    want = jax.vmap(model)(x)
    assert_close(np.asarray(got), np.asarray(want), k=16 * 9, chain=4)


# ---------------------------------------------------------------------------------------------
# torch


TORCH_CASES = {
    "conv2d": lambda: (nn.Conv2d(3, 8, 3, padding=1), torch.randn(2, 3, 17, 19)),
    "conv2d_stride2_nobias": lambda: (
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False),
        torch.randn(2, 8, 17, 19),
    ),
    "padding_same_dilated": lambda: (
        nn.Conv2d(3, 8, 4, padding="same", dilation=2),
        torch.randn(2, 3, 12, 13),
    ),
    "padding_mode_reflect": lambda: (
        nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"),
        torch.randn(2, 3, 9, 9),
    ),
    "padding_mode_circular": lambda: (
        nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
        torch.randn(1, 3, 8, 8),
    ),
    "groups": lambda: (nn.Conv2d(4, 8, 3, groups=2), torch.randn(2, 4, 9, 9)),
    "depthwise": lambda: (nn.Conv2d(16, 16, 3, groups=16, padding=1), torch.randn(2, 16, 9, 9)),
    "patch_embedding": lambda: (nn.Conv2d(3, 16, 4, stride=4), torch.randn(1, 3, 16, 16)),
    "conv1d": lambda: (nn.Conv1d(3, 5, 3, stride=2, padding=2), torch.randn(2, 3, 20)),
    "conv_transpose2d": lambda: (
        nn.ConvTranspose2d(3, 5, 3, stride=2, padding=1, output_padding=1),
        torch.randn(2, 3, 9, 9),
    ),
    "conv_transpose2d_groups": lambda: (
        nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2),
        torch.randn(1, 4, 7, 7),
    ),
    "conv_transpose1d": lambda: (
        nn.ConvTranspose1d(3, 5, 4, stride=2, padding=1),
        torch.randn(2, 3, 11),
    ),
    "channels_last_input": lambda: (
        nn.Conv2d(3, 8, 3),
        torch.randn(2, 3, 10, 10).to(memory_format=torch.channels_last),
    ),
}


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_compile_convolutions(name, dtype):
    torch.manual_seed(0)
    m, x = TORCH_CASES[name]()
    m, x = m.to(dtype), x.to(dtype)
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    with torch.no_grad():
        want = m(x)
        got = torch.compile(m, backend="spyre")(x)
    assert tb.fallback_stats() == {}
    k = int(np.prod(m.weight.shape[1:]))
    assert_close(got.numpy(), want.numpy(), k=k, chain=2)


def test_small_resnet_style_cnn_through_torch_compile():
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.a = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.b = nn.Conv2d(c, c, 3, padding=1, bias=False)

        def forward(self, x):
            return torch.relu(x + self.b(torch.relu(self.a(x))))

    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        Block(16),
        nn.Conv2d(16, 32, 1, stride=2),
        Block(32),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, backend="spyre")(x)
    assert tb.fallback_stats() == {}
    assert_close(got.numpy(), want.numpy(), k=32 * 9, chain=8)


# ---------------------------------------------------------------------------------------------
# ResNet-50's convolutions at 224x224, batch 1: each fits the usable scratchpad


def _resnet50_convs():
    # (in channels, out channels, kernel, stride, input size) of each distinct convolution
    convs = [(3, 64, 7, 2, 224)]
    cin, size = 64, 56
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        out = width * 4
        convs += [(cin, width, 1, 1, size), (width, width, 3, stride, size)]
        convs += [(cin, out, 1, stride, size)]  # the downsample
        size //= stride
        convs += [(width, out, 1, 1, size), (out, width, 1, 1, size), (width, width, 3, 1, size)]
        cin = out
        del blocks
    return sorted(set(convs))


@pytest.mark.parametrize("cin, cout, k, s, size", _resnet50_convs())
def test_every_resnet50_convolution_fits_the_scratchpad(cin, cout, k, s, size):
    S = jax.ShapeDtypeStruct
    x, w = S((1, cin, size, size), jnp.float16), S((cout, cin, k, k), jnp.float16)
    f = lambda a, b: lax.conv_general_dilated(a, b, (s, s), ((k // 2, k // 2),) * 2)  # noqa: E731
    cost = spyre_jax.jit(f).lower(x, w).compile().cost_analysis()
    assert 0 < cost["scratchpad_peak_bytes"] <= cost["scratchpad_usable_bytes"]
    assert cost["flops"] >= 2 * cout * cin * k * k * (size // s) ** 2


# ---------------------------------------------------------------------------------------------
# torch: pooling and batch norm

_RM, _RV = torch.randn(4), torch.rand(4) + 0.5
_W, _B = torch.randn(4), torch.randn(4)

POOL_CASES = {
    "max_pool2d": lambda x: F.max_pool2d(x, 3, 2, 1),
    "max_pool2d_ceil": lambda x: F.max_pool2d(x, 3, 2, ceil_mode=True),
    "max_pool2d_indices": lambda x: F.max_pool2d(x, 2, return_indices=True),
    "max_pool2d_dilation_indices": lambda x: F.max_pool2d(
        x, 2, 1, 1, dilation=2, return_indices=True
    ),
    "max_pool1d": lambda x: F.max_pool1d(x[:, :, 0], 3),
    "avg_pool2d": lambda x: F.avg_pool2d(x, 3, 2, 1),
    "avg_pool2d_exclude_pad_ceil": lambda x: F.avg_pool2d(
        x, 3, 2, 1, ceil_mode=True, count_include_pad=False
    ),
    "avg_pool2d_ceil": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
    "avg_pool2d_divisor": lambda x: F.avg_pool2d(x, 2, divisor_override=3),
    "avg_pool1d": lambda x: F.avg_pool1d(x[:, :, 0], 2),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, (3, 4)),
    "adaptive_avg_pool2d_1": lambda x: F.adaptive_avg_pool2d(x, 1),
    "batch_norm_eval": lambda x: F.batch_norm(x, _RM, _RV, _W, _B, training=False, eps=1e-3),
    "batch_norm_train": lambda x: F.batch_norm(x, None, None, _W, _B, training=True),
    "batch_norm_train_running": lambda x: (
        lambda m, v: (F.batch_norm(x, m, v, _W, _B, training=True, momentum=0.2), m, v)
    )(_RM.clone(), _RV.clone()),
}


def _pool_input(nan: bool) -> torch.Tensor:
    x = torch.randn(2, 4, 9, 10, generator=torch.Generator().manual_seed(5))
    if nan:
        x[0, 0, 0, 0] = float("nan")  # max pooling propagates it, as torch does
    return x


@pytest.mark.parametrize("name", sorted(POOL_CASES))
def test_torch_pooling_and_batch_norm(name):
    f = POOL_CASES[name]
    x = _pool_input("max" in name)
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    with torch.no_grad():
        want = f(x)
        got = torch.compile(f, backend="spyre")(x)
    assert tb.fallback_stats() == {}
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want, strict=True):
        if not w.dtype.is_floating_point:  # max pooling's indices: exact
            assert torch.equal(g, w)
            continue
        assert torch.equal(g.isnan(), w.isnan())
        assert_close(g.nan_to_num().numpy(), w.nan_to_num().numpy(), k=90, chain=4)


# ---------------------------------------------------------------------------------------------
# real programs: a ViT and a ResNet (transformers configs, random weights), both torch paths


def _vit_and_resnet():
    from transformers import ResNetConfig, ResNetModel, ViTConfig, ViTModel

    torch.manual_seed(0)
    vit = ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    res = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])
    return {
        "vit": (ViTModel, vit, torch.randn(1, 3, 32, 32), "last_hidden_state"),
        "resnet": (ResNetModel, res, torch.randn(1, 3, 64, 64), "pooler_output"),
    }


@pytest.mark.parametrize("name", ["vit", "resnet"])
def test_vit_and_resnet_on_both_torch_paths_with_no_cpu_op(name):
    from torch_bridge import device as dev

    cls, cfg, x, field = _vit_and_resnet()[name]
    model = cls(cfg).eval()
    torch._dynamo.reset()
    tb.reset_fallback_stats()
    with torch.no_grad():
        want = getattr(model(x), field)
        got = getattr(torch.compile(model, backend="spyre")(x), field)
        assert tb.fallback_stats() == {}
        assert_close(got.numpy(), want.numpy(), k=128, chain=12)
        on_card = cls(cfg).eval()
        on_card.load_state_dict(model.state_dict())
        dev.reset_stats()
        got = getattr(on_card.to("spyre")(x.to("spyre")), field).cpu()
        assert dev.eager_stats()["cpu_fallbacks"] == 0
        assert_close(got.numpy(), want.numpy(), k=128, chain=12)
