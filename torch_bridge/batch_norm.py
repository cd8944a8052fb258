"""The spyre kernel of ``native_batch_norm``: batch norm on the card in both modes.

``F.batch_norm`` and ``nn.BatchNorm*d`` reach the device as ``aten::native_batch_norm``, an op
that updates its running statistics in place without saying so in its schema, so it has no
lowering rule of its own (compiled graphs meet its functional forms, which do). Its spyre kernel
runs those forms through the device's one-op kernels instead of the CPU:

- **training** with running statistics: ``_native_batch_norm_legit_functional`` (the output,
  the batch mean and inverse standard deviation, the moved running mean and unbiased running
  variance), then the new statistics copied into the running ones on the card;
- **training** without them: ``_native_batch_norm_legit.no_stats``;
- **evaluation**: ``spyre_jax::batch_norm_eval(x, weight, bias, mean, var, eps)``, the output
  alone, compiled from its decomposition (``_native_batch_norm_legit_no_training``'s first
  result). The op's two other results are empty there, and a one-op kernel with an empty result
  would run on the host.

Anything else (one running statistic without the other) takes the device's fallback.
"""

from __future__ import annotations

from typing import Any

import torch

from . import eager, one_op

__all__ = ["register"]

aten = torch.ops.aten
Tensor = torch.Tensor

_libs: list[torch.library.Library] = []
#: ``spyre_jax::batch_norm_eval``, set by :func:`register`
BATCH_NORM_EVAL: Any = None


def _eval(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, var: Tensor, eps: float
) -> Tensor:
    """``spyre_jax::batch_norm_eval``: ``(x - mean) / sqrt(var + eps) * weight + bias`` per
    channel (its decomposition, and its CPU kernel)."""
    return aten._native_batch_norm_legit_no_training.default(x, weight, bias, mean, var, 0.0, eps)[
        0
    ]


def _eval_fake(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, var: Tensor, eps: float
) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _native_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``native_batch_norm`` on spyre tensors (see the module's docstring)."""
    args = (x, weight, bias, running_mean, running_var, training, momentum, eps)
    have = (running_mean is not None, running_var is not None)
    if training and have == (True, True):
        assert running_mean is not None and running_var is not None
        out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
            x, weight, bias, running_mean, running_var, True, momentum, eps
        )
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
        return out, mean, rstd
    if training and have == (False, False):
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, True, momentum, eps)
    if not training and have == (True, True):
        out = BATCH_NORM_EVAL(x, weight, bias, running_mean, running_var, eps)
        empty = x.new_empty((0,))
        return out, empty, x.new_empty((0,))
    return eager.fallback(aten.native_batch_norm.default, *args)


def register(lib: torch.library.Library) -> None:
    """The spyre kernel of ``native_batch_norm``, and ``spyre_jax::batch_norm_eval``, the op
    its evaluation mode launches."""
    global BATCH_NORM_EVAL
    lib.impl("native_batch_norm", _native_batch_norm, "PrivateUse1")
    own = torch.library.Library("spyre_jax", "FRAGMENT")
    _libs.append(own)
    own.define(
        "batch_norm_eval(Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor var, "
        "float eps) -> Tensor"
    )
    own.impl("batch_norm_eval", _eval, "CPU")
    own.impl("batch_norm_eval", _eval_fake, "Meta")
    BATCH_NORM_EVAL = torch.ops.spyre_jax.batch_norm_eval.default
    own.impl("batch_norm_eval", eager._kernel_for(BATCH_NORM_EVAL), "PrivateUse1")
    one_op.DECOMPOSITIONS[BATCH_NORM_EVAL] = _eval
