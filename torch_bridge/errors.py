"""What the PyTorch side raises and warns."""

from __future__ import annotations

__all__ = ["SpyreFallbackWarning", "InferenceOnlyError", "UnsupportedLayoutError"]


class SpyreFallbackWarning(UserWarning):
    """An ATen op with no lowering rule runs on the CPU instead of the card."""


class InferenceOnlyError(RuntimeError):
    """Kept for compatibility; nothing raises it any more. The spyre backend once refused graphs
    that need gradients with it; it now compiles them for training (AOTAutograd's forward and
    backward graphs, ``torch_bridge.training``). Code that catches it keeps working."""


class UnsupportedLayoutError(TypeError):
    """A result of a layout the ``spyre`` device does not hold (sparse, ...): it holds strided
    (dense) tensors only, as it holds only the card's dtypes (an unsupported dtype is a
    ``TypeError`` too)."""
