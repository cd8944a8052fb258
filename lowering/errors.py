"""Errors the compiler raises at the user."""

from __future__ import annotations

__all__ = [
    "UnsupportedPrimitiveError",
    "TilingError",
    "LoweringError",
    "LoweringRuleError",
    "PRNGKeyError",
    "rule_error",
]


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


class LoweringRuleError(Exception):
    """A lowering rule raised: both importers wrap the rule's exception in one of these, once.

    Fields: ``frontend`` (``"JAX"`` or ``"ATen"``), ``op`` (the JAX primitive or the ATen
    overload, as text), ``equation`` (the jaxpr equation, or the FX node's ``format_node()``),
    ``where`` (the user's source line, ``"file.py:12 (fn)"``, or ``""``) and ``cause`` (the
    rule's exception, also ``__cause__``). The message is the cause's, then the op, the
    equation and the line.

    Build them with :func:`rule_error`: the instance is then also of the cause's kind
    (:class:`LoweringError`, ``TypeError``, ``NotImplementedError`` or ``ValueError``), so a
    handler that caught the rule's exception before still catches it.
    """

    def __init__(
        self,
        frontend: str,
        op: str,
        equation: str,
        where: str,
        cause: BaseException,
        context: str = "",
    ):
        self.frontend, self.op, self.equation, self.where = frontend, op, equation, where
        self.cause, self.context = cause, context
        super().__init__(_rule_message(frontend, op, equation, where, cause, context))
        self.__cause__ = cause

    def __reduce__(self) -> tuple:
        return (
            rule_error,
            (self.frontend, self.op, self.equation, self.where, self.cause, self.context),
        )


def _rule_message(
    frontend: str, op: str, equation: str, where: str, cause: BaseException, context: str
) -> str:
    text = str(cause).strip() or type(cause).__name__
    head, _, rest = text.partition("\n")
    if not head.startswith("spyre"):
        kind = "" if isinstance(cause, LoweringError) else f"{type(cause).__name__}: "
        head = f"spyre: {kind}{head}"
    lines = [head, *([rest] if rest else [])]
    lines += [
        f"  in the lowering rule of {frontend} op '{op}'",
        f"  equation: {equation}",
        f"  at: {where or '<unknown source line>'}",
    ]
    if context:
        lines.append(f"  in:\n{context}")
    return "\n".join(lines)


def _kind(base: type[BaseException]) -> type[LoweringRuleError]:
    cls = type("LoweringRuleError", (LoweringRuleError, base), {"__module__": __name__})
    cls.__doc__ = f"A :class:`LoweringRuleError` whose cause is a {base.__name__}."
    return cls


#: the structured error's class for each kind of cause, the most specific first
_KINDS: tuple[tuple[type[BaseException], type[LoweringRuleError]], ...] = tuple(
    (base, _kind(base)) for base in (LoweringError, NotImplementedError, TypeError, ValueError)
)


def rule_error(
    frontend: str,
    op: str,
    equation: str,
    where: str,
    cause: BaseException,
    context: str = "",
) -> LoweringRuleError:
    """The :class:`LoweringRuleError` for ``cause``, raised by the rule of ``op``; also an
    instance of the cause's kind (see :class:`LoweringRuleError`)."""
    cls = next((c for base, c in _KINDS if isinstance(cause, base)), LoweringRuleError)
    return cls(frontend, op, equation, where, cause, context)


#: errors a rule may raise that already say what they need, and pass through unwrapped
PASS_THROUGH: tuple[type[BaseException], ...] = (
    LoweringRuleError,
    UnsupportedPrimitiveError,
    TilingError,
)


class PRNGKeyError(TypeError):
    """A PRNG key of an implementation the card does not run (only threefry2x32, JAX's
    default, is supported)."""
