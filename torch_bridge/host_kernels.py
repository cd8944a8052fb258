"""CPU kernels for the ATen ops PyTorch calls on a PrivateUse1 device but has no CPU kernel for.

The CPU fallback (:func:`torch_bridge.host_ops.run_on_host`) runs an op the card cannot run with
CPU tensors standing in for the spyre ones. A few ops reach the spyre device only because
PyTorch's composite kernels pick them for any device that is not the CPU, and the CPU has no
kernel of its own for them (they exist for CUDA): ``nn.LSTM``, ``nn.GRU``, ``nn.LSTMCell`` and
``nn.GRUCell`` (``at::native``'s RNN cells) go through the fused cells ``_thnn_fused_lstm_cell``
and ``_thnn_fused_gru_cell`` on a PrivateUse1 tensor, and their backward through
``_thnn_fused_lstm_cell_backward_impl`` and ``_thnn_fused_gru_cell_backward``. Run on the CPU as
they are, these end in the dispatcher's ``NotImplementedError`` ("Could not run ... from the
'CPU' backend"). :func:`host_kernel` gives the CPU fallback a kernel for each: the same math as
PyTorch's CUDA kernels, in CPU ops, with the same workspace layout (the activated gates), so a
cell's backward reads what its forward kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["host_kernel", "STAND_INS"]

aten = torch.ops.aten
Tensor = torch.Tensor


def _lstm_cell(
    input_gates: Tensor,
    hidden_gates: Tensor,
    cx: Tensor,
    input_bias: Tensor | None = None,
    hidden_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``_thnn_fused_lstm_cell``: (hy, cy, workspace); the workspace is the activated input,
    forget, cell and output gates side by side, ``(batch, 4 * hidden)``."""
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def _lstm_cell_backward(
    grad_hy: Tensor | None,
    grad_cy: Tensor | None,
    cx: Tensor,
    cy: Tensor,
    workspace: Tensor,
    has_bias: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``_thnn_fused_lstm_cell_backward_impl``: (grad of the gates, grad of cx, grad of the
    bias or None); an undefined incoming gradient is zeros."""
    i, f, g, o = workspace.chunk(4, 1)
    tcy = cy.tanh()
    ghy = torch.zeros_like(cy) if grad_hy is None else grad_hy
    gc = ghy * o * (1 - tcy * tcy)
    if grad_cy is not None:
        gc = gc + grad_cy
    grad_gates = torch.cat(
        [
            gc * g * i * (1 - i),
            gc * cx * f * (1 - f),
            gc * i * (1 - g * g),
            ghy * tcy * o * (1 - o),
        ],
        1,
    )
    return grad_gates, gc * f, grad_gates.sum(0) if has_bias else None


def _gru_cell(
    input_gates: Tensor,
    hidden_gates: Tensor,
    hx: Tensor,
    input_bias: Tensor | None = None,
    hidden_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``_thnn_fused_gru_cell``: (hy, workspace); the workspace is the reset, update and new
    gates, ``hx`` and the hidden part of the new gate, ``(batch, 5 * hidden)``."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hx, hn], 1)


def _gru_cell_backward(
    grad_hy: Tensor, workspace: Tensor, has_bias: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """``_thnn_fused_gru_cell_backward``: grads of the input gates, the hidden gates, ``hx``,
    and the two biases (None without a bias)."""
    r, z, n, hx, hn = workspace.chunk(5, 1)
    gz = grad_hy * (hx - n) * z * (1 - z)
    gn = grad_hy * (1 - z) * (1 - n * n)
    gr = gn * hn * r * (1 - r)
    grad_input = torch.cat([gr, gz, gn], 1)
    grad_hidden = torch.cat([gr, gz, gn * r], 1)
    if not has_bias:
        return grad_input, grad_hidden, grad_hy * z, None, None
    return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)


#: ATen op -> its CPU kernel here (ops with no CPU kernel in PyTorch)
STAND_INS: dict[Any, Callable[..., Any]] = {
    aten._thnn_fused_lstm_cell.default: _lstm_cell,
    aten._thnn_fused_lstm_cell_backward_impl.default: _lstm_cell_backward,
    aten._thnn_fused_gru_cell.default: _gru_cell,
    aten._thnn_fused_gru_cell_backward.default: _gru_cell_backward,
}


def host_kernel(op: Any) -> Callable[..., Any]:
    """What runs ``op`` on CPU tensors: its stand-in here, else the op itself."""
    return STAND_INS.get(op, op)
