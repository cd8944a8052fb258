"""What the PyTorch side raises and warns."""

from __future__ import annotations

__all__ = ["SpyreFallbackWarning", "InferenceOnlyError"]


class SpyreFallbackWarning(UserWarning):
    """An ATen op with no lowering rule runs on the CPU instead of the card."""


class InferenceOnlyError(RuntimeError):
    """The spyre backend compiles inference graphs only (no autograd)."""
