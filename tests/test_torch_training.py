"""Training through ``torch.compile(backend="spyre")`` (``torch_bridge.training``): AOTAutograd's
forward and backward graphs both on the card, against eager CPU.

Tolerance: every gradient and every parameter after the optimizer steps is compared with eager
CPU's in fp32 by its relative error ``max|got - want| / max|want|`` (one number per tensor),
which must stay under ``REL = 1e-4``. Why that figure: the card computes in fp32 as the CPU
does, but sums in another order (its matmuls tile the contraction over 32 cores, its
reductions tree-reduce), so each op differs from the CPU's by a few fp32 ulps (~1e-7
relative); a backward pass chains a few dozen such ops and ten optimizer steps feed each
step's error into the next, which we measured at 1e-7 to 5e-7 (gradients, the MLP's
parameters after 10 steps) and at most ~4e-6 (the tiny Llama's parameters after 10 steps of
SGD). 1e-4 keeps 25x margin above that, while a wrong gradient (a missing term, a transposed
operand, a wrong dropout mask, a wrong saved tensor) is off by 1e-2 or more.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from spyre_jax.tools.bench_serve import llama_tiny
from torch_bridge import backend as tb
from torch_bridge import conv_grad, training
from torch_bridge.errors import InferenceOnlyError, SpyreFallbackWarning

#: the largest relative error (``max|got - want| / max|want|``) of a gradient or parameter
REL = 1e-4


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _compile(model, **kw):
    torch._dynamo.reset()  # a fresh Dynamo cache, so that this test compiles its own graphs
    tb.reset_fallback_stats()
    return torch.compile(model, backend="spyre", dynamic=False, **kw)


class MLP(torch.nn.Module):
    """Embedding, Linear, GELU, LayerNorm, ReLU, Linear, log-softmax: their backward ops
    (``embedding_dense_backward``, ``gelu_backward``, ``native_layer_norm_backward``,
    ``threshold_backward``, ``_log_softmax_backward_data``, ``mm`` with transposed operands,
    sums to a bias's size) all come to the backend."""

    def __init__(self, p: float = 0.0, ckpt: bool = False):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.a = torch.nn.Linear(16, 48)
        self.norm = torch.nn.LayerNorm(48)
        self.b = torch.nn.Linear(48, 48)
        self.c = torch.nn.Linear(48, 10)
        self.drop = torch.nn.Dropout(p)
        self.ckpt = ckpt

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b(self.drop(h)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.a(self.emb(ids))))
        h = checkpoint(self.block, h, use_reentrant=False) if self.ckpt else self.block(h)
        return F.log_softmax(self.c(h), dim=-1)


def _mlp(**kw) -> MLP:
    torch.manual_seed(0)
    return MLP(**kw)


def _ids(seed: int = 1, shape=(4, 6)) -> torch.Tensor:
    return torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(seed))


def _loss(logp: torch.Tensor, seed: int = 2) -> torch.Tensor:
    target = torch.randint(0, 10, logp.shape[:-1], generator=torch.Generator().manual_seed(seed))
    return F.nll_loss(logp.reshape(-1, logp.shape[-1]), target.reshape(-1).to(logp.device))


def _assert_grads_close(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        assert _rel(p.grad, q.grad) < REL, (name, _rel(p.grad, q.grad))


def test_forward_backward_matches_cpu():
    model = _mlp()
    ref = copy.deepcopy(model)
    ids = _ids()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpyreFallbackWarning)
        out = _compile(model)(ids)  # no torch.no_grad(): a training graph
        assert out.requires_grad
        _loss(out).backward()
    want = ref(ids)
    _loss(want).backward()
    assert _rel(out, want) < REL
    _assert_grads_close(model, ref)
    assert tb.fallback_stats() == {}
    stats = tb.compile_stats()
    assert stats["graphs"] == 2 and stats["kernels"] == 2, stats  # forward, backward: one each


def test_autograd_grad_with_input_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    x = torch.randn(5, 12, requires_grad=True)
    out = _compile(model)(x)
    gx, gw = torch.autograd.grad(out.pow(2).sum(), (x, model[0].weight))
    want = model(x)
    wx, ww = torch.autograd.grad(want.pow(2).sum(), (x, model[0].weight))
    assert _rel(gx, wx) < REL and _rel(gw, ww) < REL
    assert model[0].weight.grad is None  # autograd.grad accumulates nothing
    assert tb.fallback_stats() == {}


def test_checkpoint_inside_compiled_model():
    model = _mlp(ckpt=True)
    ref = copy.deepcopy(model)
    ids = _ids(3)
    _loss(_compile(model)(ids)).backward()
    _loss(ref(ids)).backward()
    _assert_grads_close(model, ref)
    assert tb.fallback_stats() == {}


def _dropout_run(fn, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(8, 128, requires_grad=True)
    y = fn(x)
    y.sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpoint"])
def test_train_mode_dropout_draws_on_the_card(ckpt):
    def drop(x):
        return F.dropout(torch.sin(x), 0.5, training=True) * 3

    fn = (lambda x: checkpoint(drop, x, use_reentrant=False)) if ckpt else drop
    cf = _compile(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpyreFallbackWarning)  # no CPU random op
        y, gx = _dropout_run(cf, 7)
        y2, gx2 = _dropout_run(cf, 7)
        y3, _ = _dropout_run(cf, 8)
    assert torch.equal(y, y2) and torch.equal(gx, gx2)  # reproducible under manual_seed
    assert not torch.equal(y, y3)
    torch.manual_seed(7)
    x = torch.randn(8, 128)
    kept = y != 0
    assert 0.4 < kept.float().mean() < 0.6
    assert not torch.equal(kept, drop(x) != 0)  # the card's generator, not the CPU's
    # the backward applies the forward's mask (saved, or drawn again from the saved state)
    torch.testing.assert_close(y, torch.where(kept, torch.sin(x) * 6, 0.0))
    torch.testing.assert_close(gx, torch.where(kept, torch.cos(x) * 6, 0.0))


def _small() -> torch.nn.Module:
    """Two layers (four parameter tensors): every eager kernel of an optimizer step on spyre
    compiles once per parameter shape, so the optimizer tests keep the shapes few."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 10))


def _train(opt_cls, device: str, compiled: bool, steps: int = 10, **kw) -> list:
    model = _small().to(device)
    f = _compile(model) if compiled else model
    opt = opt_cls(model.parameters(), **kw)
    for s in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + s)).to(device)
        opt.zero_grad()
        F.cross_entropy(f(x), _ids(20 + s, (4,)).remainder(10).to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


@pytest.mark.parametrize("device", ["cpu", "spyre"])
def test_optimizer_steps_match_cpu(device):
    """10 steps of SGD (momentum), Adam and AdamW, the model compiled, the optimizer eager
    (on the CPU, or on spyre: ``model.to("spyre")``), against all of it eager on the CPU."""
    for name, (opt_cls, kw) in OPTIMIZERS.items():
        want = _train(opt_cls, "cpu", False, **kw)
        got = _train(opt_cls, device, True, **kw)
        for g, w in zip(got, want, strict=True):
            assert _rel(g, w) < REL, (name, _rel(g, w))
        assert tb.fallback_stats() == {}, name


def test_llama_sgd_steps_match_cpu():
    """The 2-layer tiny Llama of ``spyre-jax bench serve`` (random weights), 10 SGD steps."""
    torch.manual_seed(0)
    model = llama_tiny(2)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(3))
    f = _compile(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for _ in range(10):
        for fn, opt in zip((f, ref), opts, strict=True):
            opt.zero_grad()
            fn(ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert _rel(p, q) < REL, _rel(p, q)
    assert tb.fallback_stats() == {}
    assert tb.compile_stats()["graphs"] == 2  # one forward, one backward, for all 10 steps


def test_conv_net_sgd_steps_match_cpu():
    """Convolutions (strided, grouped, transposed), batch norm in training (its running
    statistics too) and max pooling: their backward on the card too (``convolution_backward``
    as convolutions, ``torch_bridge.conv_grad``; ``max_pool2d_with_indices_backward`` as a
    scatter-add), the weights' layouts made again after each step changes them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2),
        torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 5),
    )
    ref = copy.deepcopy(model)
    f = _compile(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for s in range(3):
        x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(s))
        for fn, opt in zip((f, ref), opts, strict=True):
            opt.zero_grad()
            fn(x).pow(2).mean().backward()
            opt.step()
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        if p.is_floating_point():
            assert _rel(p, q) < REL, (name, _rel(p, q))
    assert tb.fallback_stats() == {}


@pytest.mark.parametrize(
    "transposed,stride,padding,dilation,groups,output_padding",
    [
        (False, 1, 1, 1, 1, 0),
        (False, 2, 3, 1, 1, 0),
        (False, 2, 0, 2, 2, 0),
        (False, 1, 2, 1, 1, 0),  # the padding passes a 1x1 kernel's reach: cropped
        (True, 2, 1, 1, 1, 1),
        (True, 1, 0, 2, 2, 1),  # output_padding past the stride
    ],
)
def test_convolution_backward_decomposition(
    transposed, stride, padding, dilation, groups, output_padding
):
    """``conv_grad.convolution_backward`` against PyTorch's kernel, eagerly on the CPU."""
    torch.manual_seed(0)
    k = 1 if padding == 2 else 3
    x = torch.randn(2, 4, 9, 8)
    w = torch.randn(*((4, 6 // groups) if transposed else (6, 4 // groups)), k, k)
    conv = (stride, stride), (padding, padding), (dilation, dilation)
    ops = (transposed, (output_padding,) * 2, groups)
    y = torch.ops.aten.convolution(x, w, None, *conv, *ops)
    gy = torch.randn_like(y)
    args = (gy, x, w, [6], *conv, *ops, [True, True, True])
    want = torch.ops.aten.convolution_backward(*args)
    got = conv_grad.convolution_backward(*args)
    for g, v in zip(got, want, strict=True):
        assert g.shape == v.shape and _rel(g, v) < REL


def _bessel(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.special.i1(x)) * 2  # i1 and its derivative: no card kernel


def test_backward_op_without_rule_falls_back_to_cpu():
    x = torch.randn(4, 65, requires_grad=True)
    with pytest.warns(SpyreFallbackWarning) as record:
        y = _compile(_bessel)(x)
        (gx,) = torch.autograd.grad(y.sum(), x)
    (wx,) = torch.autograd.grad(_bessel(x).sum(), x)
    assert _rel(gx, wx) < REL
    stats = tb.fallback_stats()
    # i1 in the forward graph; i0, in i1's derivative, only in the backward graph
    assert "aten.special_i1.default" in stats and "aten.i0.default" in stats, stats
    assert any("aten.i0.default" in str(w.message) for w in record)
    assert tb.compile_stats()["kernels"] >= 2  # tanh * 2 and its backward still on the card


def test_no_grad_inference_is_one_forward_graph(monkeypatch):
    model = _mlp()
    ids = _ids()

    def refuse(*a, **k):
        raise AssertionError("an inference graph took the training path")

    monkeypatch.setattr(training, "compile_training", refuse)
    with torch.no_grad():
        got = _compile(model)(ids)
        want = model(ids)
    assert not got.requires_grad
    assert _rel(got, want) < REL
    stats = tb.compile_stats()
    assert stats["graphs"] == 1 and stats["kernels"] == 1, stats


def test_inference_only_error_is_still_exported():
    assert issubclass(InferenceOnlyError, RuntimeError)
    assert tb.InferenceOnlyError is InferenceOnlyError
