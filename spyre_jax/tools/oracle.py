"""The test oracle: one tolerance table, one scaling rule, one comparison.

Every test of the card and the tools that compare a card result with a reference
(``spyre-jax coverage``, ``spyre-jax fuzz``,
:func:`~spyre_jax.tools.testing.assert_frontends_agree`) read their tolerances here.
Re-exported by :mod:`spyre_jax.tools.testing`.

The table (:data:`TOLERANCES`): ``rtol`` (and ``atol``, the same number) for ONE rounded op, by
the dtype of the result:

================  ==========  =====================================================================
dtype             tolerance   why
================  ==========  =====================================================================
float16           2e-3        2 ulps: fp16 has 11 significant bits, eps = 2^-10 ~ 9.8e-4
bfloat16          1.6e-2      2 ulps: bf16 has 8 significant bits, eps = 2^-7 ~ 7.8e-3
float32           1e-5        ~84 ulps (eps = 2^-23 ~ 1.2e-7): room for other fp32 implementations
                              of the transcendentals (exp, tanh, erf, rsqrt ...) and for fp32
                              sums in another order
float64           1e-5        the card has no fp64: a float64 reference is met at fp32 precision
ints, bools       exact       the card moves and compares integers exactly; nothing rounds
================  ==========  =====================================================================

Why 2 ulps for one op: the card widens every tile to fp32, computes in fp32 and rounds each store
to the tensor's dtype once (round to nearest even); the CPU reference (``jax.jit`` on the CPU,
torch eager) rounds to the dtype after (nearly) every op, from its own fp32 (or wider)
computation. The two results are each within half an ulp of their own fp32 value, and those fp32
values differ by the implementations' errors, so they agree to about one ulp, two where the
values straddle a rounding boundary.

The scaling rule (:func:`tolerance`): ``tol * sqrt(k) * chain``.

* ``k``, the length of a reduction (a sum, a mean, a matmul's contraction): the card sums in
  another order than the CPU (tiles over 32 cores, fp32 accumulators; the CPU sums pairwise, or
  in the dtype). Each addition contributes an independent rounding error of a fraction of an
  ulp with either sign, so the difference of the two sums grows like a random walk, as
  ``sqrt(k)``, not as ``k`` (``k`` is the worst case, when every error has the same sign, which
  round-to-nearest-even does not give). ``k`` counts the additions rounded at the precision the
  table entry is for: where both sides accumulate an fp16/bf16 result in fp32 and round it once
  (a matmul on the card and in torch or XLA on the CPU, torch's sums), the fp32 errors stay far
  below one ulp of the result and ``k = 1`` holds; a test may then pass ``k = 1`` (tighter).
* ``chain``, the number of ops in a row that the CPU rounds one by one and the card fuses into
  one fp32 computation with a single rounding (gelu = 3, softmax = 3, a layernorm = 2 ...): each
  CPU rounding adds up to an ulp, linearly (the errors of a chain are not independent: the next
  op carries the last one's error forward).

``atol`` is relative to the reference's largest finite magnitude, at least 1 (``scale``): a sum
that cancels to near zero keeps the rounding error of its terms, whose size the output's largest
value approximates; for outputs of magnitude up to 1 it is an absolute tolerance. An element
passes when ``|got - want| <= atol * scale + rtol * |want|``; NaNs must sit at the same places and
infinities must be equal.

One named multiplier of the table, for callers that cannot know ``k``:
:data:`UNKNOWN_K` = 100: a whole program or an OpInfo sample, compared without knowing its
reductions, is checked as one reduction of 100 terms (the table times 10):
:func:`~spyre_jax.tools.testing.assert_frontends_agree`'s defaults
(:data:`~spyre_jax.tools.testing.DEFAULT_TOLERANCES`), ``spyre-jax fuzz`` (with ``chain = 2``)
and ``spyre-jax coverage`` (:data:`~spyre_jax.tools.coverage_common.TOLERANCE`).

The torch frontend needs no entry of its own: torch eager on the CPU rounds fp16/bf16 results
once per op as jax does (its fp16 matmul accumulates in fp32, as the card does), so the same
table holds for both frontends.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "TOLERANCES",
    "UNKNOWN_K",
    "dtype_name",
    "tolerance",
    "to_numpy",
    "compare",
    "assert_close",
    "assert_tree_close",
]

#: rtol (= atol, relative to ``max(1, max|want|)``) for one rounded op, by the result's dtype
#: name; see the module docstring. Integer and bool dtypes are not here: they compare exactly.
TOLERANCES: dict[str, float] = {
    "float16": 2e-3,  # 2 ulps of fp16 (eps 2^-10)
    "bfloat16": 1.6e-2,  # 2 ulps of bf16 (eps 2^-7)
    "float32": 1e-5,  # other fp32 transcendentals and summation orders
    "float64": 1e-5,  # no fp64 on the card: met at fp32 precision
}

#: the reduction length assumed where the caller cannot know it (a whole program, an OpInfo
#: sample): the table times ``sqrt(100) = 10``
UNKNOWN_K = 100

_COMPLEX_PART = {"complex64": "float32", "complex128": "float64", "complex32": "float16"}


def dtype_name(dtype: Any) -> str:
    """The NumPy-style name of a dtype given as a NumPy/ml_dtypes dtype or scalar type, a JAX
    dtype, a torch dtype (``torch.float16`` -> ``"float16"``) or a name (``"bf16"`` too)."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        return {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "half": "float16"}.get(
            name, {"float": "float32", "double": "float64"}.get(name, name)
        )
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if hasattr(dtype, "dtype") and not isinstance(dtype, type):  # an array
        return dtype_name(dtype.dtype)
    return np.dtype(dtype).name


def tolerance(dtype: Any, k: int = 1, chain: int = 1) -> tuple[float, float]:
    """``(rtol, atol)`` for a result of ``dtype`` that went through a reduction of length ``k``
    and ``chain`` ops the reference rounds one by one: the table times ``sqrt(k) * chain``
    (``atol`` relative to ``max(1, max|want|)``). ``(0.0, 0.0)`` for integers and bools; a
    complex dtype takes its parts' entry."""
    name = dtype_name(dtype)
    name = _COMPLEX_PART.get(name, name)
    if name not in TOLERANCES:
        if "float" in name:
            raise KeyError(f"no tolerance for dtype {name!r}; the table has {list(TOLERANCES)}")
        return 0.0, 0.0
    s = math.sqrt(max(k, 1)) * max(chain, 1)
    t = TOLERANCES[name] * s
    return t, t


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy array of ``x``: a NumPy array or scalar, a JAX array, a ``spyre_jax.Array``, a
    torch tensor (CPU or the ``spyre`` device, detached; bfloat16 as ``ml_dtypes.bfloat16``),
    a Python number or a nested list."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(x)


def _where(d: np.ndarray, i: int) -> tuple[int, ...]:
    return tuple(int(j) for j in np.unravel_index(i, d.shape)) if d.ndim else ()


def compare(
    got: Any,
    want: Any,
    *,
    k: int = 1,
    chain: int = 1,
    rtol: float | None = None,
    atol: float | None = None,
    dtype: Any = None,
    check_dtype: bool = True,
) -> str | None:
    """``None`` when ``got`` matches ``want``, else why not (one line).

    Shapes must be equal, and dtypes (``check_dtype``). Integers and bools compare exactly;
    floats within :func:`tolerance` of ``dtype`` (default ``want``'s dtype) at ``k`` and
    ``chain``, unless ``rtol``/``atol`` are given (``atol`` is still relative to
    ``max(1, max|want|)``); complex values part by part."""
    g, w = to_numpy(got), to_numpy(want)
    if g.shape != w.shape:
        return f"shape {g.shape} != {w.shape}"
    if check_dtype and g.dtype != w.dtype:
        return f"dtype {g.dtype} != {w.dtype}"
    if w.dtype.kind == "c" or g.dtype.kind == "c":
        part_dtype = dtype if dtype is not None else _COMPLEX_PART.get(w.dtype.name, "float64")
        g, w = g.astype(np.complex128), w.astype(np.complex128)
        for part, a, b in (("real", g.real, w.real), ("imag", g.imag, w.imag)):
            why = compare(
                a, b, k=k, chain=chain, rtol=rtol, atol=atol, dtype=part_dtype, check_dtype=False
            )
            if why is not None:
                return f"{part} part: {why}"
        return None
    if w.dtype.kind in "biu":  # integers and bools: exact, whatever the tolerance
        if g.dtype.kind not in "biu":
            return f"dtype {g.dtype} for an expected {w.dtype}"
        gi, wi = g.astype(np.int64), w.astype(np.int64)
        bad = gi != wi
        if bad.any():
            i = int(np.argmax(bad.reshape(-1)))
            at_ = _where(bad, i)
            return (
                f"{int(bad.sum())}/{w.size} elements differ (exact {w.dtype}); "
                f"at {at_}: got {gi.reshape(-1)[i]} want {wi.reshape(-1)[i]}"
            )
        return None
    rt, at = tolerance(w.dtype if dtype is None else dtype, k, chain)
    rt = rt if rtol is None else rtol
    at = at if atol is None else atol
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    nan_g, nan_w = np.isnan(g64), np.isnan(w64)
    if not np.array_equal(nan_g, nan_w):
        n = int(np.sum(nan_g != nan_w))
        i = int(np.argmax((nan_g != nan_w).reshape(-1)))
        return (
            f"NaN in {n} positions where the other has none; at {_where(nan_g, i)}: "
            f"got {g64.reshape(-1)[i]:.6g} want {w64.reshape(-1)[i]:.6g}"
        )
    inf_w = np.isinf(w64)
    if not np.array_equal(g64[inf_w], w64[inf_w]) or np.isinf(g64[~inf_w]).any():
        return "infinities differ"
    fin = np.isfinite(w64)
    if not fin.any():
        return None
    scale = max(1.0, float(np.max(np.abs(w64[fin]))))
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, NaN - NaN: not counted
        err = np.where(fin, np.abs(g64 - w64), 0.0)
    lim = at * scale + rt * np.abs(w64)
    bad = err > lim
    if not bad.any():
        return None
    i = int(np.argmax(np.where(bad, err - lim, -np.inf).reshape(-1)))
    rel = err / np.maximum(np.abs(w64), 1e-300)
    return (
        f"{int(bad.sum())}/{w.size} elements beyond tolerance; max abs error "
        f"{float(err.max()):.3g}, max rel error {float(rel[fin].max()):.3g} "
        f"(rtol {rt:.3g}, atol {at:.3g} x scale {scale:.3g}; k={k}, chain={chain}, "
        f"{dtype_name(w.dtype if dtype is None else dtype)}); worst at {_where(err, i)}: "
        f"got {g64.reshape(-1)[i]:.7g} want {w64.reshape(-1)[i]:.7g}"
    )


def assert_close(got: Any, want: Any, *, err_msg: str = "", **kw: Any) -> None:
    """Raise ``AssertionError`` unless ``got`` matches ``want`` (see :func:`compare`): NumPy
    arrays and scalars, JAX arrays, ``spyre_jax.Array``, torch tensors (CPU or ``spyre``).
    ``kw``: :func:`compare`'s keywords (``k``, ``chain``, ``rtol``, ``atol``, ``dtype``,
    ``check_dtype``)."""
    why = compare(got, want, **kw)
    if why is not None:
        raise AssertionError(f"{err_msg}: {why}" if err_msg else why)


def _flatten(tree: Any, leaves: list[Any]) -> Any:
    """Append ``tree``'s leaves to ``leaves``; return its structure, with a tuple, a list, a
    named tuple and torch's return types (``torch.return_types.max``) all alike."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tree, torch.Tensor) or isinstance(tree, np.ndarray):
        leaves.append(tree)
        return "*"
    if isinstance(tree, tuple | list):
        return tuple(_flatten(t, leaves) for t in tree)
    if isinstance(tree, dict):
        return {key: _flatten(tree[key], leaves) for key in sorted(tree, key=repr)}
    import jax

    sub, treedef = jax.tree_util.tree_flatten(tree)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:  # a leaf (an array, a number)
        leaves.append(tree)
        return "*"
    return (str(treedef), tuple(_flatten(t, leaves) for t in sub))


def assert_tree_close(got: Any, want: Any, *, err_msg: str = "", **kw: Any) -> None:
    """:func:`assert_close` leaf by leaf over two pytrees (tuples, lists, dicts, named tuples,
    torch's return types, JAX pytrees such as equinox modules; a tensor or an array is a leaf)
    of the same structure (a list and a tuple of the same leaves count as the same). ``kw``:
    :func:`assert_close`'s keywords (``k``, ``chain``, ``rtol``, ``atol``, ``dtype``,
    ``check_dtype``)."""
    gl: list[Any] = []
    wl: list[Any] = []
    gs, ws = _flatten(got, gl), _flatten(want, wl)
    pre = f"{err_msg}: " if err_msg else ""
    if len(gl) != len(wl):
        raise AssertionError(f"{pre}{len(gl)} outputs, expected {len(wl)}")
    if gs != ws:
        raise AssertionError(f"{pre}output structure {gs} != {ws}")
    for i, (g, w) in enumerate(zip(gl, wl, strict=True)):
        assert_close(g, w, err_msg=f"{pre}output {i}", **kw)
