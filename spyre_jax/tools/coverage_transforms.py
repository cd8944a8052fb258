"""The ``grad`` and ``vmap`` paths of ``spyre-jax coverage jax``: a sample of the JAX op table
turned into a derivative or a batched program, run through ``spyre_jax.jit`` (whose
``spyre_call`` primitive, :mod:`spyre_jax.transforms`, sends the transformed program to the
card) and through ``jax.jit`` on the CPU.

* ``grad``: the sample's float outputs reduced to a scalar, ``sum(out * w)`` summed in float32
  with fixed random weights ``w`` (one array per float output, in its dtype), differentiated
  with respect to the sample's float array inputs: ``jax.grad(spyre_jax.jit(loss), argnums)``
  against ``jax.grad(jax.jit(loss), argnums)``. A sample without a float input or a float output
  is skipped (comparisons, ``argmax``, integer and key ops). Gradients are met at the forward's
  tolerance (:data:`GRAD_CHAIN`), and a float16 gradient passes when it matches either
  reference: the float16 one, or the float32 one (the same loss and weights at the same inputs
  widened to float32, the gradient rounded to float16). Why the second: XLA:CPU rounds every op
  of a float16 derivative program to float16, the card keeps a fused chain in float32 and
  rounds where it stores. Where the derivative crosses a discontinuity or cancels, the two
  float16 answers differ by more than a rounding: ``fmod(a, b)``'s ``d/db = -trunc(a/b)``,
  summed over a row, where float16 rounds one quotient onto an integer that float32 leaves
  below it (the card's quotient is float32's); ``sinc``'s ``(cos(pi x) - sinc(x)) / x`` near 0
  (at x = -0.0036 XLA's float16 gives -0.196, the card 0.0120, the exact value 0.0108). The
  float32 gradient tells which answer is right.
* ``vmap``: every input of the sample drawn :data:`BATCH` times and stacked along a new axis 0,
  ``jax.vmap(spyre_jax.jit(fn))`` against ``jax.vmap(jax.jit(fn))``.

Each case is a pair of thunks (:class:`Case`); :mod:`spyre_jax.tools.coverage_jax` runs them
under the time guard and books them as the forward samples are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import spyre_jax

from .jax_ops import JaxOp, make_samples

__all__ = ["BATCH", "Case", "grad_case", "vmap_case", "batched_samples", "GRAD_CHAIN"]

#: the batch size of the vmap path
BATCH = 3

#: the ``chain`` (:func:`spyre_jax.tools.oracle.tolerance`: the table times ``sqrt(k) * chain``)
#: a gradient of each dtype is met at, by the gradient's dtype name; absent: 1, the forward's.
#: Empty, float16 included: over the whole table every gradient but one sample of ``jnp.sinc``
#: met the forward's tolerance against one of the two references above, and that sample's
#: float16 residuals (``(pi x)^-2`` near x = 0) leave both XLA's answer and the card's without a
#: correct digit, which no tolerance short of several units would cover.
GRAD_CHAIN: dict[str, int] = {}


@dataclass(frozen=True)
class Case:
    """One transformed sample: ``card()`` and ``reference()`` compute the same thing on the card
    and on the CPU; ``skip``: why the sample is not tried (then both are None); ``chain``: the
    tolerance's chain length by the output dtype's name (default 1)."""

    card: Callable[[], Any] | None = None
    reference: Callable[[], Any] | None = None
    skip: str = ""
    chain: dict[str, int] = field(default_factory=dict)
    #: a second reference the card's result may match instead (rounded to the first's dtypes)
    alternate: Callable[[], Any] | None = None


def _is_float(dt: Any) -> bool:
    return jnp.issubdtype(dt, jnp.floating)


def _float_inputs(args: Sequence[Any]) -> tuple[int, ...]:
    """The positions of the float arrays among a sample's inputs."""
    return tuple(i for i, a in enumerate(args) if isinstance(a, np.ndarray) and _is_float(a.dtype))


def grad_case(fn: Callable, args: tuple, rng: np.random.Generator) -> Case:
    """The ``grad`` path of one sample (weights drawn from ``rng``)."""
    argnums = _float_inputs(args)
    if not argnums:
        return Case(skip="no float input to differentiate")
    try:
        out_shape = jax.eval_shape(fn, *args)
    except Exception as e:  # the reference's own failure is booked as the forward's
        return Case(skip=f"jax.eval_shape failed ({e!r})"[:160])
    leaves, tree = jax.tree_util.tree_flatten(out_shape)
    weights = [
        rng.uniform(-1.0, 1.0, leaf.shape).astype(leaf.dtype) if _is_float(leaf.dtype) else None
        for leaf in leaves
    ]
    if all(w is None for w in weights):
        return Case(skip="no float output to differentiate")

    def loss(*xs: Any) -> Any:
        outs = jax.tree_util.tree_leaves(fn(*xs))
        total = jnp.zeros((), jnp.float32)
        for o, w in zip(outs, weights, strict=True):
            if w is not None:  # the product in the output's dtype, the sum in float32
                total = total + jnp.sum((o * w).astype(jnp.float32))
        return total

    # float16 inputs: also the gradient at the same inputs computed in float32 (see the module)
    wide = tuple(
        a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == np.float16 else a
        for a in args
    )
    has_f16 = any(w is not a for w, a in zip(wide, args, strict=True))
    return Case(
        card=lambda: jax.grad(spyre_jax.jit(loss), argnums)(*args),
        reference=lambda: jax.grad(jax.jit(loss), argnums)(*args),
        chain=GRAD_CHAIN,
        alternate=(lambda: jax.grad(jax.jit(loss), argnums)(*wide)) if has_f16 else None,
    )


def _stack(xs: Sequence[Any]) -> Any:
    """``BATCH`` draws of one input, stacked along a new axis 0 (typed keys with JAX)."""
    if isinstance(xs[0], jax.Array):
        return jnp.stack(xs)
    return np.stack([np.asarray(x) for x in xs])


def batched_samples(
    op: JaxOp, seed: int, index: int, dtype: str, batch: int = BATCH
) -> list[tuple[Callable, tuple]]:
    """``op``'s samples in ``dtype`` with every input drawn ``batch`` times (a generator per
    draw, apart from the forward's) and stacked along axis 0."""
    di = op.dtypes.index(dtype)
    draws = [
        make_samples(op, np.random.default_rng([seed, index, di, 1000 + b]), dtype)
        for b in range(batch)
    ]
    out = []
    for j, (fn, _) in enumerate(draws[0]):
        cols = zip(*(d[j][1] for d in draws), strict=True)
        out.append((fn, tuple(_stack(c) for c in cols)))
    return out


def vmap_case(fn: Callable, args: tuple) -> Case:
    """The ``vmap`` path of one sample whose inputs are batched along axis 0."""
    if not args:
        return Case(skip="no input to batch")
    return Case(
        card=lambda: jax.vmap(spyre_jax.jit(fn))(*args),
        reference=lambda: jax.vmap(jax.jit(fn))(*args),
    )
