"""Errors the compiler raises at the user."""

from __future__ import annotations

__all__ = ["UnsupportedPrimitiveError", "TilingError", "LoweringError"]


class UnsupportedPrimitiveError(NotImplementedError):
    """A frontend op with no lowering rule. Names the op, shows the equation and the user's line."""

    def __init__(self, frontend: str, name: str, equation: str, where: str, context: str = ""):
        self.frontend, self.primitive, self.equation, self.where = frontend, name, equation, where
        msg = (
            f"spyre: no lowering rule for {frontend} primitive '{name}'\n"
            f"  equation: {equation}\n"
            f"  at: {where or '<unknown source line>'}"
        )
        if context:
            msg += f"\n  in:\n{context}"
        super().__init__(msg)


class LoweringError(ValueError):
    """An op the importer knows but cannot lower with these parameters."""


class TilingError(ValueError):
    """An op that cannot be tiled into the usable scratchpad at all, whatever the tile size."""
