"""The PyTorch half of ``spyre-jax bench train``: the same Llama-style layer as a ``torch.nn``
module through ``torch.compile(..., backend="spyre")`` with grad mode on (AOTAutograd's forward
and backward graphs, both compiled for the card), the weights on the CPU.

The forward's and the backward's simulated times are the card kernels launched while each ran
(a profile around each); the saved activations are the bytes of the tensors autograd keeps for
the backward (``torch.autograd.graph.saved_tensors_hooks``), the weights and the input left out;
the reference is eager torch on the
CPU, in the row's dtype for the wall time and in fp32 for the gradients' error.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

import spyre_jax

from .train_layer import best_seconds, layer_params

__all__ = ["TorchLayer", "torch_case"]


class TorchLayer(torch.nn.Module):
    """:func:`spyre_jax.tools.train_layer.layer` as a module (weights ``[in, out]``, as there)."""

    def __init__(self, p: dict[str, np.ndarray], heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        for k, v in p.items():
            setattr(self, k, torch.nn.Parameter(torch.from_numpy(np.array(v))))

    @staticmethod
    def _rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        n = x32 * torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + 1e-5)
        return n.to(x.dtype) * g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        h_, kvh = self.heads, self.kv_heads
        hd = d // h_
        h = self._rms(x, self.n1)
        q = (h @ self.wq).reshape(t, h_, hd).transpose(0, 1)
        k = (h @ self.wk).reshape(t, kvh, hd).transpose(0, 1)
        v = (h @ self.wv).reshape(t, kvh, hd).transpose(0, 1)
        k, v = (a.repeat_interleave(h_ // kvh, dim=0) for a in (k, v))
        s = (q @ k.transpose(1, 2)).float() / float(np.sqrt(hd))
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        s = s.masked_fill(~mask, -1e9)
        a = (torch.softmax(s, dim=-1).to(x.dtype) @ v).transpose(0, 1).reshape(t, d)
        x = x + a @ self.wo
        h = self._rms(x, self.n2)
        return x + (torch.nn.functional.silu(h @ self.wg) * (h @ self.wu)) @ self.wd


def _step(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    y = model(x).float()
    (y * y).mean().backward()
    return {
        k.removeprefix("_orig_mod."): p.grad.detach().clone() for k, p in model.named_parameters()
    }


def _kernel_us(prof: Any) -> float:
    return sum(r.end - r.start for r in prof.records if r.kind == "run_kernel") * 1e6


def _err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(
        float((got[k].float() - w).abs().max() / max(float(w.abs().max()), 1e-30))
        for k, w in want.items()
    )


def torch_case(shape: tuple[int, ...], dtype: Any, reps: int) -> dict[str, Any]:
    """One row of the table for the torch backend (see :mod:`spyre_jax.tools.bench_train`)."""
    d, f, heads, kvh, t = shape
    p = layer_params(d, f, d // heads * kvh, dtype)
    x = torch.from_numpy((np.random.default_rng(1).standard_normal((t, d)) * 0.5).astype(dtype))
    eager = TorchLayer(p, heads, kvh)
    card = torch.compile(TorchLayer(p, heads, kvh), backend="spyre")
    t0 = time.perf_counter()
    _step(card, x)
    compile_s = time.perf_counter() - t0
    saved = [0]
    weights = {q.data_ptr() for q in card.parameters()} | {x.data_ptr()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in weights:  # activations only, as JAX's residuals
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    card.zero_grad(set_to_none=True)
    with spyre_jax.profile(print_summary=False) as fwd:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
            y = card(x).float()
        loss = (y * y).mean()
    with spyre_jax.profile(print_summary=False) as bwd:
        loss.backward()
    grads = {
        k.removeprefix("_orig_mod."): q.grad.detach().clone() for k, q in card.named_parameters()
    }
    wall = best_seconds(lambda: _step(card, x), reps)
    cpu = best_seconds(lambda: _step(eager, x), reps)
    ref = _step(
        TorchLayer({k: np.asarray(v, np.float32) for k, v in p.items()}, heads, kvh), x.float()
    )
    return {
        "fwd_us": _kernel_us(fwd),
        "bwd_us": _kernel_us(bwd),
        "kernels": sum(r.kind == "run_kernel" for r in (*fwd.records, *bwd.records)),
        "saved_mb": saved[0] / 1e6,
        "compile_s": compile_s,
        "wall_ms": wall * 1e3,
        "cpu_ms": cpu * 1e3,
        "wall_over_cpu": wall / cpu,
        "grad_err": _err(grads, ref),
        "cpu_grad_err": _err(_step(eager, x), ref),
    }
