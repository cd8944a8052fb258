"""Differential testing across frontends: one model written in JAX and in PyTorch, four paths;
and the test oracle every test and tool compares numbers with.

:func:`assert_frontends_agree` runs ``jax.jit`` on the CPU, torch eager on the CPU,
``spyre_jax.jit`` on the card and ``torch.compile(backend="spyre")`` on the card on the same
example inputs, compares every pair, and compares the two graph IRs the card paths lowered to.
:func:`eqx_from_torch` / :func:`torch_from_eqx` copy weights between a ``torch.nn`` module and its
equinox twin (Linear, LayerNorm, Embedding, MLP, MultiheadAttention), so a model written twice can
be checked.

The oracle (:mod:`spyre_jax.tools.oracle`, re-exported here): one tolerance table by dtype
(:data:`TOLERANCES`: float16 2e-3, bfloat16 1.6e-2, float32 1e-5 for one rounded op; integers and
bools exact), one scaling rule (:func:`tolerance`: ``* sqrt(k) * chain`` for a reduction of length
``k`` and ``chain`` ops the reference rounds one by one), and the comparisons
:func:`assert_close` / :func:`assert_tree_close` / :func:`compare` over NumPy, JAX,
``spyre_jax.Array`` and torch (CPU or ``spyre``) values. The oracle module's docstring gives the
reasons for each number.

Default tolerances of :func:`assert_frontends_agree` (``rtol`` and ``atol``, the latter relative
to the reference's largest magnitude, at least 1), by the output's dtype: the table at
``k = UNKNOWN_K`` (100: a whole program, whose reductions the tool does not know, is checked as
one reduction of 100 terms), i.e. :data:`DEFAULT_TOLERANCES`: float32 1e-4, float16 2e-2,
bfloat16 1.6e-1; integers and bools exact. ``k=``/``chain=`` or ``rtol=``/``atol=`` override.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as pytree

import spyre_jax
from device_model.runtime import runtime
from lowering.graph import format_graph
from lowering.pipeline import graph_passes
from torch_bridge import backend as tb

from .oracle import (
    TOLERANCES,
    UNKNOWN_K,
    assert_close,
    assert_tree_close,
    compare,
    dtype_name,
    to_numpy,
    tolerance,
)

__all__ = [
    "assert_frontends_agree",
    "FrontendReport",
    "FrontendGraphsDiffer",
    "canonical_graph",
    "DEFAULT_TOLERANCES",
    "eqx_from_torch",
    "torch_from_eqx",
    # the oracle (spyre_jax.tools.oracle)
    "TOLERANCES",
    "UNKNOWN_K",
    "tolerance",
    "dtype_name",
    "to_numpy",
    "compare",
    "assert_close",
    "assert_tree_close",
]

#: :func:`assert_frontends_agree`'s default rtol (= atol relative to the output's magnitude) by
#: dtype name: the oracle's table at ``k = UNKNOWN_K`` (float32 1e-4, float16 2e-2, bfloat16
#: 1.6e-1)
DEFAULT_TOLERANCES = {name: tolerance(name, k=UNKNOWN_K)[0] for name in TOLERANCES}

PATHS = ("jax.jit (cpu)", "torch eager (cpu)", "spyre_jax.jit (card)", "torch.compile spyre (card)")


class FrontendGraphsDiffer(UserWarning):
    """The two frontends lowered the same computation to different graphs (the diff says how)."""


@dataclass
class FrontendReport:
    """What :func:`assert_frontends_agree` found: outputs per path, the pairs' errors, graphs."""

    outputs: dict[str, list[np.ndarray]]
    rows: list[dict[str, Any]] = field(default_factory=list)
    graphs_equal: bool | None = None
    graph_diff: str = ""

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)

    def table(self) -> str:
        head = f"  {'pair':<52} {'out':>3} {'max abs':>10} {'max rel':>10}  {'where':<14} ok"
        lines = [head]
        for r in self.rows:
            lines.append(
                f"  {r['a'] + ' vs ' + r['b']:<52} {r['output']:>3} {r['max_abs']:>10.3g} "
                f"{r['max_rel']:>10.3g}  {str(r['where']):<14} {'yes' if r['ok'] else 'NO'}"
                + (f"  ({r['note']})" if r.get("note") else "")
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the four paths


def _np_leaves(x: Any) -> list[np.ndarray]:
    out = []
    for leaf in jax.tree_util.tree_leaves(x):
        out.append(_to_np(leaf))
    return out


_to_np = to_numpy


def _torch_leaves(x: Any) -> list[np.ndarray]:
    return [_to_np(v) for v in pytree.tree_leaves(x)]


def _to_torch(a: np.ndarray) -> Any:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _run_paths(jax_fn: Any, torch_fn: Any, inputs: list[np.ndarray]) -> tuple[dict, Any, Any]:
    outs: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            outs[name] = fn()
        except Exception as e:  # a path that fails is reported in the table, not hidden
            inner = getattr(e, "inner_exception", e)
            errors[name] = f"{type(inner).__name__}: {str(inner).splitlines()[0][:120]}"

    attempt(PATHS[0], lambda: _np_leaves(jax.jit(jax_fn)(*[jnp.asarray(a) for a in inputs])))
    with torch.no_grad():
        attempt(PATHS[1], lambda: _torch_leaves(torch_fn(*[_to_torch(a) for a in inputs])))
    jgraph = tgraph = None
    sj = spyre_jax.jit(jax_fn)

    def spyre_path() -> list[np.ndarray]:
        nonlocal jgraph
        jgraph = sj.lower(*inputs).graph
        return _np_leaves(sj(*inputs))

    attempt(PATHS[2], spyre_path)

    def compile_path() -> list[np.ndarray]:
        nonlocal tgraph
        torch._dynamo.reset()
        tb.reset_fallback_stats()
        with torch.no_grad():
            c = torch.compile(torch_fn, backend="spyre", dynamic=False)
            res = _torch_leaves(c(*[_to_torch(a) for a in inputs]))
        ks = tb.compiled_kernels()
        if len(ks) == 1 and not tb.fallback_stats():
            tgraph = ks[0].graph
        return res

    attempt(PATHS[3], compile_path)
    return {"outputs": outs, "errors": errors}, jgraph, tgraph


# ---------------------------------------------------------------------------------------------
# comparing


def _compare(
    a: np.ndarray,
    b: np.ndarray,
    rtol: float | None,
    atol: float | None,
    k: int = UNKNOWN_K,
    chain: int = 1,
) -> dict:
    """A table row for output ``a`` against the reference ``b``; whether it passes is the
    oracle's :func:`compare` (the errors beside it are for the reader)."""
    why = compare(a, b, k=k, chain=chain, rtol=rtol, atol=atol)
    # the errors columns show a value beyond tolerance; other failures (shape, dtype, NaN) a note
    note = "" if why is None or "beyond tolerance" in why else why.split(";")[0]
    row: dict[str, Any] = {"ok": why is None, "note": note}
    if a.shape != b.shape:
        return {**row, "max_abs": float("nan"), "max_rel": float("nan"), "where": "-"}
    if np.dtype(a.dtype).kind in "biu" or np.dtype(b.dtype).kind in "biu":
        diff = a.astype(np.int64) != b.astype(np.int64)
        n = int(diff.sum())
        where = tuple(int(i) for i in np.argwhere(diff)[0]) if n else "-"
        return {**row, "max_abs": float(n), "max_rel": 0.0, "where": where}
    if not a.size:
        return {**row, "max_abs": 0.0, "max_rel": 0.0, "where": "-"}
    x, y = a.astype(np.float32), b.astype(np.float32)
    d = np.abs(x - y)
    d = np.where(np.isnan(x) & np.isnan(y), 0.0, d)
    d = np.where(np.isnan(x) ^ np.isnan(y), np.inf, d)
    rel = d / np.maximum(np.abs(y), 1e-30)
    i = int(np.argmax(d))
    where = tuple(int(j) for j in np.unravel_index(i, d.shape)) if d.ndim else ()
    return {**row, "max_abs": float(d.max()), "max_rel": float(rel.max()), "where": where}


def canonical_graph(graph: Any) -> str:
    """A graph as text with value ids renumbered in order, source lines dropped and scalar
    immediates normalized to float32 (``2`` and ``2.0``, ``0.70710677`` and
    ``0.7071067811865475`` print alike), after the graph passes (to_maps, fuse_maps, dce), so two
    frontends' graphs of the same computation compare equal."""
    text = format_graph(_passed(graph))
    ids: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        return ids.setdefault(m.group(0), f"%v{len(ids)}")

    lines = []
    for ln in text.splitlines()[1:]:  # the header names the function
        ln = ln.split("   # ")[0].rstrip()
        ln = re.sub(r"%\d+", rename, ln)
        ln = re.sub(r"(body=space=\[[^\]]*\] )(.*?)( -> \w+\])", _canon_program, ln)
        ln = re.sub(r"-?\d+\.\d+(?:e[-+]?\d+)?|(?<=[\[(, ])-?\d+(?=[\]),])", _norm_num, ln)
        lines.append(ln)
    return "\n".join(lines)


def _passed(g: Any) -> Any:
    """``g`` after the graph passes, and so is every body a loop or a branch of it holds."""
    for _, fn in graph_passes(runtime().card):
        g = fn(g)
    nodes = []
    for n in g.nodes:
        p = n.params
        if p.subgraphs():
            fields = {f: getattr(p, f) for f in ("body", "cond", "branches") if hasattr(p, f)}
            new = {
                f: tuple(_passed(b) for b in v) if isinstance(v, tuple) else _passed(v)
                for f, v in fields.items()
            }
            n = dataclasses.replace(n, params=dataclasses.replace(p, **new))
        nodes.append(n)
    return dataclasses.replace(g, nodes=tuple(nodes))


_REG = re.compile(r"^r(\d+)=([a-z_]+)(\[[^\]]*\])?\(([^)]*)\):(\w+)$")


def _canon_program(m: re.Match) -> str:
    """A map program without same-dtype copies (an importer's bookkeeping, no computation) and
    with registers renumbered in order."""
    prog = m.group(2).split("; ")
    alias: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    kept: list[tuple[str, str, str, list[str], str]] = []
    for op in prog:
        mm = _REG.match(op)
        if mm is None:
            return m.group(0)  # not a program this understands: leave it as printed
        reg, name, param, args, dt = mm.groups()
        reg = f"r{reg}"
        argl = [alias.get(a, a) for a in args.split(",") if a]
        if name == "copy" and len(argl) == 1 and dtypes.get(argl[0], dt) == dt:
            alias[reg] = argl[0]
            continue
        dtypes[reg] = dt
        kept.append((reg, name, param or "", argl, dt))
    names = {old: f"r{i}" for i, (old, *_rest) in enumerate(kept)}
    out = [
        f"{names[reg]}={name}{param}({','.join(names.get(a, a) for a in argl)}):{dt}"
        for reg, name, param, argl, dt in kept
    ]
    return m.group(1) + "; ".join(out) + m.group(3)


def _norm_num(m: re.Match) -> str:
    v = float(m.group(0))
    return repr(float(np.float32(v)))


# ---------------------------------------------------------------------------------------------
# the tool


def _failed_row(a: str, b: str, note: str) -> dict[str, Any]:
    """A table row for a pair that could not be compared (a path failed, outputs differ)."""
    nan = float("nan")
    return {
        "a": a,
        "b": b,
        "output": "-",
        "max_abs": nan,
        "max_rel": nan,
        "where": "-",
        "ok": False,
        "note": note,
    }


def assert_frontends_agree(
    jax_fn: Any,
    torch_fn: Any,
    *example_inputs: Any,
    rtol: float | None = None,
    atol: float | None = None,
    k: int = UNKNOWN_K,
    chain: int = 1,
    check_graphs: str = "warn",
) -> FrontendReport:
    """Run ``jax_fn`` and ``torch_fn`` on ``example_inputs`` (NumPy arrays, converted for each
    frontend) four ways -- ``jax.jit`` on the CPU, torch eager on the CPU, ``spyre_jax.jit`` on
    the card, ``torch.compile(backend="spyre")`` on the card -- and compare every pair.

    Raises ``AssertionError`` whose message is a table of the pairs (max abs/rel error, where,
    whether within tolerance) when any pair disagrees or a path fails. Tolerances default per
    dtype: the oracle's :func:`tolerance` at ``k`` (the longest reduction, default
    :data:`UNKNOWN_K`) and ``chain`` (:data:`DEFAULT_TOLERANCES` at the defaults; see the
    module docstring); ``rtol``/``atol`` override them. The two card paths' graph IRs
    are compared after canonicalization (:func:`canonical_graph`); when they differ, a readable
    diff is attached: as a :class:`FrontendGraphsDiffer` warning (``check_graphs="warn"``), in the
    AssertionError (``"raise"``), or not at all (``"off"``). Returns a :class:`FrontendReport`.
    """
    if check_graphs not in ("warn", "raise", "off"):
        raise ValueError(f"check_graphs must be 'warn', 'raise' or 'off', got {check_graphs!r}")
    inputs = [np.asarray(x) for x in example_inputs]
    for a in inputs:
        if a.dtype.kind == "c" or a.dtype == np.float64:
            raise TypeError(
                f"assert_frontends_agree: example input of dtype {a.dtype} is not supported on "
                "the card; use float32, float16, bfloat16, int32 or bool"
            )
    res, jgraph, tgraph = _run_paths(jax_fn, torch_fn, inputs)
    outs, errs = res["outputs"], res["errors"]
    report = FrontendReport(outputs=outs)
    names = list(PATHS)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if a in errs or b in errs:
                report.rows.append(_failed_row(a, b, "failed: " + (errs.get(a) or errs.get(b))))
                continue
            oa, ob = outs[a], outs[b]
            if len(oa) != len(ob):
                report.rows.append(_failed_row(a, b, f"{len(oa)} vs {len(ob)} outputs"))
                continue
            for k, (xa, xb) in enumerate(zip(oa, ob, strict=True)):
                # the reference of a pair is its first path (the CPU ones come first)
                row = _compare(xb, xa, rtol, atol, k, chain)
                report.rows.append({"a": a, "b": b, "output": k, **row})
    if jgraph is not None and tgraph is not None and check_graphs != "off":
        ja, tb_ = canonical_graph(jgraph), canonical_graph(tgraph)
        report.graphs_equal = ja == tb_
        if not report.graphs_equal:
            report.graph_diff = "\n".join(
                difflib.unified_diff(
                    ja.splitlines(),
                    tb_.splitlines(),
                    "graph from JAX",
                    "graph from torch",
                    lineterm="",
                    n=1,
                )
            )
    msg_graph = ""
    if report.graph_diff:
        msg_graph = "\nthe two frontends' graphs differ:\n" + report.graph_diff
        if check_graphs == "warn":
            warnings.warn(msg_graph.strip(), FrontendGraphsDiffer, stacklevel=2)
    if not report.ok or (check_graphs == "raise" and report.graph_diff):
        tol = f"per-dtype, k={k} chain={chain}"
        if rtol is not None or atol is not None:
            tol = f"rtol={rtol} atol={atol}"
        raise AssertionError(
            f"frontends disagree ({tol}):\n{report.table()}"
            + (msg_graph if check_graphs == "raise" or not report.ok else "")
        )
    return report


# ---------------------------------------------------------------------------------------------
# weights between torch.nn and equinox twins


def _j(t: Any, like: Any) -> Any:
    return jnp.asarray(_to_np(t)).astype(like.dtype)


def eqx_from_torch(tm: Any, em: Any) -> Any:
    """A copy of the equinox module ``em`` with the weights of the torch module ``tm``.

    Pairs: ``nn.Linear``/``eqx.nn.Linear``, ``nn.LayerNorm``/``eqx.nn.LayerNorm``,
    ``nn.Embedding``/``eqx.nn.Embedding``, an ``nn.Sequential`` of Linears (activations between
    them)/``eqx.nn.MLP``, ``nn.MultiheadAttention``/``eqx.nn.MultiheadAttention``.
    """
    if isinstance(tm, torch.nn.Linear) and isinstance(em, eqx.nn.Linear):
        em = eqx.tree_at(lambda m: m.weight, em, _j(tm.weight, em.weight))
        if tm.bias is not None and em.bias is not None:
            em = eqx.tree_at(lambda m: m.bias, em, _j(tm.bias, em.bias))
        return em
    if isinstance(tm, torch.nn.LayerNorm) and isinstance(em, eqx.nn.LayerNorm):
        if em.weight is not None:
            em = eqx.tree_at(lambda m: m.weight, em, _j(tm.weight, em.weight))
        if em.bias is not None:
            em = eqx.tree_at(lambda m: m.bias, em, _j(tm.bias, em.bias))
        return em
    if isinstance(tm, torch.nn.Embedding) and isinstance(em, eqx.nn.Embedding):
        return eqx.tree_at(lambda m: m.weight, em, _j(tm.weight, em.weight))
    if isinstance(tm, torch.nn.Sequential) and isinstance(em, eqx.nn.MLP):
        lins = [m for m in tm if isinstance(m, torch.nn.Linear)]
        if len(lins) != len(em.layers):
            raise ValueError(f"MLP has {len(em.layers)} layers, the Sequential {len(lins)} Linears")
        layers = tuple(eqx_from_torch(t, e) for t, e in zip(lins, em.layers, strict=True))
        return eqx.tree_at(lambda m: m.layers, em, layers)
    if isinstance(tm, torch.nn.MultiheadAttention) and isinstance(em, eqx.nn.MultiheadAttention):
        e = tm.embed_dim
        w = tm.in_proj_weight
        b = tm.in_proj_bias
        for i, name in enumerate(("query_proj", "key_proj", "value_proj")):
            lin = getattr(em, name)
            lin = eqx.tree_at(lambda m: m.weight, lin, _j(w[i * e : (i + 1) * e], lin.weight))
            if b is not None and lin.bias is not None:
                lin = eqx.tree_at(lambda m: m.bias, lin, _j(b[i * e : (i + 1) * e], lin.bias))
            em = eqx.tree_at(lambda m, n=name: getattr(m, n), em, lin)
        out = eqx_from_torch(tm.out_proj, em.output_proj)
        return eqx.tree_at(lambda m: m.output_proj, em, out)
    raise TypeError(
        f"eqx_from_torch: no weight mapping from {type(tm).__name__} to {type(em).__name__}"
    )


def torch_from_eqx(em: Any, tm: Any) -> Any:
    """Copy the weights of the equinox module ``em`` into the torch module ``tm`` (in place;
    returns ``tm``). The pairs of :func:`eqx_from_torch`."""

    def put(p: Any, v: Any) -> None:
        with torch.no_grad():
            p.copy_(_to_torch(np.asarray(v)).to(p.dtype))

    if isinstance(tm, torch.nn.Linear | torch.nn.LayerNorm) and isinstance(
        em, eqx.nn.Linear | eqx.nn.LayerNorm
    ):
        if em.weight is not None:
            put(tm.weight, em.weight)
        if getattr(em, "bias", None) is not None and tm.bias is not None:
            put(tm.bias, em.bias)
        return tm
    if isinstance(tm, torch.nn.Embedding) and isinstance(em, eqx.nn.Embedding):
        put(tm.weight, em.weight)
        return tm
    if isinstance(tm, torch.nn.Sequential) and isinstance(em, eqx.nn.MLP):
        lins = [m for m in tm if isinstance(m, torch.nn.Linear)]
        for t, e in zip(lins, em.layers, strict=True):
            torch_from_eqx(e, t)
        return tm
    if isinstance(tm, torch.nn.MultiheadAttention) and isinstance(em, eqx.nn.MultiheadAttention):
        e = tm.embed_dim
        for i, name in enumerate(("query_proj", "key_proj", "value_proj")):
            lin = getattr(em, name)
            with torch.no_grad():
                tm.in_proj_weight[i * e : (i + 1) * e].copy_(_to_torch(np.asarray(lin.weight)))
                if tm.in_proj_bias is not None and lin.bias is not None:
                    tm.in_proj_bias[i * e : (i + 1) * e].copy_(_to_torch(np.asarray(lin.bias)))
        torch_from_eqx(em.output_proj, tm.out_proj)
        return tm
    raise TypeError(
        f"torch_from_eqx: no weight mapping from {type(em).__name__} to {type(tm).__name__}"
    )
