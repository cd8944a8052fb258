"""``spyre-jax fuzz``: random programs over the op set JAX and PyTorch share, each written once as
data, emitted as a JAX function and a torch function, and run through all four paths of
:func:`spyre_jax.tools.testing.assert_frontends_agree` (``jax.jit`` and torch eager on the CPU,
``spyre_jax.jit`` and ``torch.compile(backend="spyre")`` on the simulated card).

A program (:class:`Case`) is a list of steps over a list of values that starts with the input
``x`` of shape ``[rows, cols]``; each step reads one or two earlier values and appends its result,
always of shape ``[rows, cols]``, so every program is valid in both frontends. The other inputs
are ``row`` (``[1, cols]``, broadcast against a value) and the weight ``w``: ``[cols, cols]``
(``k == 0``; a matmul step is ``v @ w``) or ``[cols, k]`` (``k > 0``; a matmul step is
``(v @ w) @ w.T``: a reduction over ``cols`` into ``k``, then ``k`` back out to ``cols``, as a
tied-embedding LM head does with a ``[vocab, d]`` table). Control flow too: a loop step applies
a unary op 1-3 times in a loop of each frontend's (``lax.fori_loop``; torch's ``while_loop``
with a counter), a cond step one of two unary ops by the sign of the value's sum
(``lax.cond``; ``torch.cond``).

Shapes (:func:`programs`): most programs have small odd shapes (1, 3, 63, 65, 100: partial sticks
and tiles); with ``real_shapes="mix"`` about one in :data:`REAL_ONE_IN` (``"only"``: all) has a
real-size shape instead: a few rows of a vocabulary's width (32000, 49159, 50257, 128256) or of a
row longer than one core's usable scratchpad (:data:`LONG_COLS`, more than ~420k fp32), with a
low-rank weight, or a vocabulary's worth of rows of a few columns. Every value stays under
12 MiB and the weight under 32 MiB (:data:`MAX_ELEMENTS`), so a program stays under a few
hundred MB.

:func:`fuzz` runs ``N`` programs drawn by hypothesis (seeded), records every disagreement instead
of stopping at the first, shrinks each distinct one (a greedy shrinker over the program: fewer
steps, smaller shapes, simpler ops) and returns a report. ``tests/test_fuzz_frontends.py`` runs
the same strategy under pytest (hypothesis' own shrinking).
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from spyre_jax.tools.oracle import UNKNOWN_K, tolerance
from spyre_jax.tools.testing import PATHS, FrontendGraphsDiffer, assert_frontends_agree

__all__ = [
    "Case",
    "programs",
    "run_program",
    "program_error",
    "shrink",
    "fuzz",
    "format_report",
    "is_real_shape",
    "UNARY",
    "BINARY",
    "REDUCE",
    "REAL_MODES",
]

UNARY = ("tanh", "neg", "abs", "sigmoid", "relu", "square", "exp_clip", "softmax", "scale")
BINARY = ("add", "sub", "mul", "max")
REDUCE = ("sum", "max", "mean")
REAL_MODES = ("mix", "only", "off")

#: small shapes: odd sizes, so 128-byte sticks and tiles are partly filled
SMALL_ROWS = (1, 3, 5, 63, 65)
SMALL_COLS = (1, 7, 64, 65, 100)
#: vocabulary sizes: Llama-2 / Mistral, a StarCoder-like odd one, GPT-2, Llama-3
VOCAB = (32000, 49159, 50257, 128256)
#: rows longer than one core's usable scratchpad (CardSpec(): 0.8 * 2 MiB, about 419k fp32):
#: an odd length just past it and 2^20 (4 MiB)
LONG_COLS = (419_431, 1_048_576)
#: a few rows of a wide value
WIDE_ROWS = (1, 2, 3)
#: a vocabulary's worth of rows (an embedding table, a logits column) of a few columns
TALL_COLS = (1, 7, 16)
#: the low-rank weight's inner dimension for wide values
RANKS = (1, 3, 8)
#: about one program in REAL_ONE_IN has a real-size shape under real_shapes="mix"
REAL_ONE_IN = 10
#: the most elements an input may have: a value is at most 3 * 2^20 (12 MiB), the low-rank weight
#: at most 8 * 2^20 (32 MiB); a square weight must fit too
MAX_ELEMENTS = 8 * 1_048_576
#: a long run drops JAX's compiled programs every CLEAR_EVERY programs: each
#: ``torch.compile(backend="spyre")`` of a program leaves its card kernel alive (held by dynamo's
#: per-code-object cache entries past ``torch._dynamo.reset()``; every program is the same ``fn``
#: code), and with it the kernel's XLA executable, about 2 MB a program
CLEAR_EVERY = 100
#: the tolerances for a program's output: the test oracle's (:mod:`spyre_jax.tools.oracle`) at
#: ``k = UNKNOWN_K`` (a program's reductions are not known) and ``chain = CHAIN``: 2, not 1,
#: since matmuls of matmuls of random data and reductions feeding reductions grow the
#: summation-order differences of each step (a float32 output: rtol = atol / its largest
#: magnitude = 2e-4, twice the fp32 default of ``assert_frontends_agree``)
CHAIN = 2
RTOL, ATOL = tolerance("float32", k=UNKNOWN_K, chain=CHAIN)


class Case(NamedTuple):
    """One program: ``x`` is ``[rows, cols]``, inputs drawn from ``seed``, weight ``[cols, k]``
    (``k > 0``) or ``[cols, cols]`` (``k == 0``). ``run_program(case)`` reproduces it."""

    rows: int
    cols: int
    prog: list
    seed: int
    k: int = 0


def is_real_shape(case: Case) -> bool:
    """Whether a program has a real-size shape (more than 100 rows or columns)."""
    return case.rows > max(SMALL_ROWS) or case.cols > max(SMALL_COLS)


# ---------------------------------------------------------------------------------------------
# the program language, emitted for each frontend


def _emit(program: list[tuple], lib: str) -> Callable[..., Any]:
    """The program as a function of ``(x, row, w)`` in ``lib`` ("jax" or "torch")."""
    J = lib == "jax"

    def unary(op: str, v):
        if op == "tanh":
            return jnp.tanh(v) if J else torch.tanh(v)
        if op == "neg":
            return -v
        if op == "abs":
            return jnp.abs(v) if J else torch.abs(v)
        if op == "sigmoid":
            return jax.nn.sigmoid(v) if J else torch.sigmoid(v)
        if op == "relu":
            return jax.nn.relu(v) if J else torch.relu(v)
        if op == "square":
            return v * v
        if op == "exp_clip":
            return jnp.exp(jnp.clip(v, -4.0, 4.0)) if J else torch.exp(torch.clamp(v, -4.0, 4.0))
        if op == "softmax":
            return jax.nn.softmax(v, axis=-1) if J else torch.softmax(v, -1)
        if op == "scale":
            return v * 0.5 + 0.25
        raise AssertionError(op)

    def binary(op: str, a, b):
        if op == "add":
            return a + b
        if op == "sub":
            return a - b
        if op == "mul":
            return a * b
        if op == "max":
            return jnp.maximum(a, b) if J else torch.maximum(a, b)
        raise AssertionError(op)

    def fn(x, row, w):
        vals = [x]
        for step in program:
            kind = step[0]
            v = vals[step[1] % len(vals)]
            if kind == "unary":
                out = unary(step[2], v)
            elif kind == "binary":
                other = vals[step[3] % len(vals)] if step[4] else row
                if other.shape != v.shape and not step[4]:
                    out = binary(step[2], v, other)  # a [1, C] row broadcasts
                elif other.shape == v.shape:
                    out = binary(step[2], v, other)
                else:
                    out = binary(step[2], v, row)
            elif kind == "reduce":
                op = step[2]
                if J:
                    f = {"sum": jnp.sum, "max": jnp.max, "mean": jnp.mean}[op]
                    r = f(v, axis=step[3], keepdims=True)
                else:
                    if op == "max":
                        r = torch.amax(v, dim=step[3], keepdim=True)
                    else:
                        r = getattr(torch, op)(v, dim=step[3], keepdim=True)
                out = v - r  # broadcast back: keeps every value the same shape
            elif kind == "matmul":
                if w.shape[0] == w.shape[1]:
                    out = v @ w  # [R, C] @ [C, C]
                else:  # [R, C] @ [C, k] @ [k, C]: the weight's transpose brings C back
                    out = (v @ w) @ (w.T if J else w.t())
            elif kind == "transpose2":
                out = (v.T if J else v.t()).reshape(v.shape) if v.shape[0] == v.shape[1] else v
            elif kind == "reshape":
                r, c = v.shape
                out = v.reshape(r * c).reshape(r, c)
            elif kind == "loop":  # a fori_loop (JAX) or while_loop (torch) of a unary op
                out = _loop(J, step[2], lambda c, op=step[3]: unary(op, c), v)
            elif kind == "cond":  # on the sign of the value's sum
                out = _cond(
                    J, lambda c, op=step[2]: unary(op, c), lambda c, op=step[3]: unary(op, c), v
                )
            else:
                raise AssertionError(kind)
            vals.append(out)
        return vals[-1]

    return fn


def _loop(J: bool, n: int, f: Callable[[Any], Any], v: Any) -> Any:
    """``n`` applications of ``f`` as a loop of the frontend's: JAX's ``fori_loop``, torch's
    ``while_loop`` with a counter."""
    if J:
        return jax.lax.fori_loop(0, n, lambda i, c: f(c), v)
    from torch._higher_order_ops.while_loop import while_loop

    body = lambda i, c: (i + 1, f(c))  # noqa: E731
    return while_loop(lambda i, c: i < n, body, (torch.tensor(0), v))[1]


def _cond(J: bool, f: Callable[[Any], Any], g: Callable[[Any], Any], v: Any) -> Any:
    """``f(v)`` where ``v`` sums above zero, else ``g(v)``: ``lax.cond`` / ``torch.cond``."""
    if J:
        return jax.lax.cond(jnp.sum(v) > 0, f, g, v)
    return torch.cond(v.sum() > 0, f, g, (v,))


def _inputs(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, cols, _, seed, k = case
    if rows * cols > MAX_ELEMENTS or cols * (k or cols) > MAX_ELEMENTS:
        raise ValueError(f"{case}: over {MAX_ELEMENTS} elements (give a large cols a small k)")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    row = rng.standard_normal((1, cols)).astype(np.float32)
    w = (rng.standard_normal((cols, k or cols)) / max(1, np.sqrt(cols))).astype(np.float32)
    return x, row, w


def run_program(case: Case | tuple) -> None:
    """Run one program through the four paths; ``AssertionError`` (a table) when they disagree."""
    case = Case(*case)
    x, row, w = _inputs(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FrontendGraphsDiffer)
        assert_frontends_agree(
            _emit(case.prog, "jax"), _emit(case.prog, "torch"), x, row, w, k=UNKNOWN_K, chain=CHAIN
        )


def program_error(case: Case | tuple) -> str | None:
    """The error text of one program (``None`` when all four paths agree): the
    ``AssertionError``'s table, or any other exception as ``Type: message``."""
    try:
        run_program(case)
    except AssertionError as e:
        return str(e)
    except Exception as e:  # a crash outside the four paths (inputs, emitters) is a finding too
        return f"{type(e).__name__}: {e}"
    return None


def _signature(err: str) -> str:
    """A disagreement's kind, to group and to keep a shrink on the same bug: the card paths that
    disagree with a CPU path or fail (``cpu`` when the two CPU paths disagree: an emitter bug;
    ``card vs card`` when only the two card paths disagree) and the exception types of failed
    paths."""
    if not err.startswith("frontends disagree"):
        return err.split(":")[0]
    card = PATHS[2:]
    who, kinds = set(), set()
    for line in err.splitlines():
        if not (line.rstrip().endswith(" NO") or " NO  (" in line):
            continue
        pair = [p for p in PATHS if p in line.split(" NO")[0]]
        on_card = [p for p in pair if p in card]
        if len(on_card) == 1:
            who.add(on_card[0])
        elif not on_card:
            who.add("cpu")
        else:
            who.add("card vs card")
        if "failed: " in line:
            kinds.add(line.split("failed: ")[1].split(":")[0])
    if len(who) > 1:
        who.discard("card vs card")
    return ", ".join(sorted(who)) + (f" [{', '.join(sorted(kinds))}]" if kinds else "")


# ---------------------------------------------------------------------------------------------
# the strategies

_IDX = st.integers(0, 9)
_step = st.one_of(
    st.tuples(st.just("unary"), _IDX, st.sampled_from(UNARY)),
    st.tuples(st.just("binary"), _IDX, st.sampled_from(BINARY), _IDX, st.booleans()),
    st.tuples(st.just("reduce"), _IDX, st.sampled_from(REDUCE), st.sampled_from([0, 1])),
    st.tuples(st.just("matmul"), _IDX),
    st.tuples(st.just("transpose2"), _IDX),
    st.tuples(st.just("reshape"), _IDX),
    st.tuples(st.just("loop"), _IDX, st.integers(1, 3), st.sampled_from(UNARY)),
    st.tuples(st.just("cond"), _IDX, st.sampled_from(UNARY), st.sampled_from(UNARY)),
)


@st.composite
def programs(draw: Any, real_shapes: str = "mix") -> Case:
    """A hypothesis strategy for :class:`Case`. ``real_shapes``: ``"mix"`` (about one in
    :data:`REAL_ONE_IN` real-size), ``"only"`` or ``"off"`` (small shapes only; draws exactly
    as the net always has)."""
    if real_shapes not in REAL_MODES:
        raise ValueError(f"real_shapes must be one of {REAL_MODES}, got {real_shapes!r}")
    real = real_shapes == "only" or (
        real_shapes == "mix" and draw(st.integers(0, REAL_ONE_IN - 1)) == REAL_ONE_IN - 1
    )
    k = 0
    if not real:
        rows = draw(st.sampled_from(SMALL_ROWS))
        cols = draw(st.sampled_from(SMALL_COLS))
    elif draw(st.booleans()):  # wide: a few rows of a vocabulary or of more than a scratchpad
        rows = draw(st.sampled_from(WIDE_ROWS))
        cols = draw(st.sampled_from(VOCAB + LONG_COLS))
        k = draw(st.sampled_from(RANKS))
    else:  # tall: a vocabulary's worth of rows
        rows = draw(st.sampled_from(VOCAB))
        cols = draw(st.sampled_from(TALL_COLS))
    prog = draw(st.lists(_step, min_size=1, max_size=6))
    seed = draw(st.integers(0, 2**16))
    return Case(rows, cols, prog, seed, k)


# ---------------------------------------------------------------------------------------------
# shrinking a found disagreement (hypothesis shrinks under pytest; a fuzz run keeps going, so it
# records each failing program and shrinks the distinct ones afterwards)


def _simpler_steps(step: tuple) -> list[tuple]:
    first = {"unary": UNARY[0], "binary": BINARY[0], "reduce": REDUCE[0], "cond": UNARY[0]}
    out = []
    if step[1] != 0:
        out.append((step[0], 0, *step[2:]))
    if step[0] in first and step[2] != first[step[0]]:
        out.append((*step[:2], first[step[0]], *step[3:]))
    if step[0] == "binary" and step[4]:
        out.append((*step[:4], False))
    if step[0] == "binary" and step[3] != 0:
        out.append((*step[:3], 0, step[4]))
    if step[0] == "reduce" and step[3] != 0:
        out.append((*step[:3], 0))
    return out


def _candidates(c: Case) -> list[Case]:
    """Simpler variants of ``c``, simplest-first: fewer steps, smaller shapes, simpler steps."""
    out = []
    for i in range(len(c.prog)):
        if len(c.prog) > 1:
            out.append(c._replace(prog=c.prog[:i] + c.prog[i + 1 :]))
    all_rows = sorted(set(SMALL_ROWS + WIDE_ROWS + VOCAB))
    all_cols = sorted(set(SMALL_COLS + TALL_COLS + VOCAB + LONG_COLS))
    for r in all_rows:
        if r < c.rows:
            out.append(c._replace(rows=r))
    for col in all_cols:
        if col < c.cols:
            k = c.k if c.k or col <= max(SMALL_COLS) else min(RANKS)
            out.append(c._replace(cols=col, k=k))
    if c.k and c.cols <= max(SMALL_COLS):
        out.append(c._replace(k=0))
    for k in RANKS:
        if 0 < k < c.k:
            out.append(c._replace(k=k))
    for i, step in enumerate(c.prog):
        for s in _simpler_steps(step):
            out.append(c._replace(prog=[*c.prog[:i], s, *c.prog[i + 1 :]]))
    if c.seed:
        out.append(c._replace(seed=0))
    return out


def shrink(case: Case | tuple, err: str, max_runs: int = 200) -> tuple[Case, str, int]:
    """A smaller program that still fails the same way (same :func:`_signature`), greedily:
    the first simpler variant that fails is taken and tried again. Returns (case, its error, the
    programs run)."""
    case, sig, runs = Case(*case), _signature(err), 0
    improved = True
    while improved and runs < max_runs:
        improved = False
        for cand in _candidates(case):
            if runs >= max_runs:
                break
            runs += 1
            e = program_error(cand)
            if e is not None and _signature(e) == sig:
                case, err, improved = cand, e, True
                break
    return case, err, runs


# ---------------------------------------------------------------------------------------------
# a run


def fuzz(
    examples: int,
    seed: int = 0,
    real_shapes: str = "mix",
    *,
    shrink_runs: int = 200,
    max_shrunk: int = 5,
    progress: Callable[[int, int, float], None] | None = None,
) -> dict[str, Any]:
    """Run ``examples`` programs drawn by hypothesis from ``programs(real_shapes)`` with seed
    ``seed``; every disagreement is recorded (the run does not stop at the first), grouped by kind,
    and the first of each of at most ``max_shrunk`` kinds is shrunk (:func:`shrink`).

    Returns ``{"programs", "real_shape_programs", "failed", "disagreements", "wall_s",
    "run_s", "shrink_s", "seed", "real_shapes"}``; ``disagreements`` is a list of
    ``{"kind", "count", "case", "error", "original"}`` (cases as ``repr(Case)``: paste into
    ``run_program`` to reproduce). ``progress(done, failed, seconds)`` is called after each
    program.
    """
    if real_shapes not in REAL_MODES:
        raise ValueError(f"real_shapes must be one of {REAL_MODES}, got {real_shapes!r}")
    t0 = time.perf_counter()
    found: dict[str, list[tuple[Case, str]]] = {}
    n = {"programs": 0, "real": 0, "failed": 0}

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis_seed(seed)
    @given(programs(real_shapes))
    def one(case: Case) -> None:
        n["programs"] += 1
        n["real"] += is_real_shape(case)
        err = program_error(case)
        if err is not None:
            n["failed"] += 1
            found.setdefault(_signature(err), []).append((case, err))
        if n["programs"] % CLEAR_EVERY == 0:
            jax.clear_caches()
            gc.collect()
        if progress is not None:
            progress(n["programs"], n["failed"], time.perf_counter() - t0)

    if examples > 0:
        one()
    t_run = time.perf_counter() - t0
    out = []
    for i, (kind, cases) in enumerate(found.items()):
        case, err = cases[0]
        small, small_err = (case, err)
        if i < max_shrunk and shrink_runs > 0:
            small, small_err, _ = shrink(case, err, max_runs=shrink_runs)
        out.append(
            {
                "kind": kind,
                "count": len(cases),
                "case": repr(small),
                "error": small_err,
                "original": repr(case),
            }
        )
    wall = time.perf_counter() - t0
    return {
        "programs": n["programs"],
        "real_shape_programs": n["real"],
        "failed": n["failed"],
        "disagreements": out,
        "wall_s": wall,
        "run_s": t_run,
        "shrink_s": wall - t_run,
        "seed": seed,
        "real_shapes": real_shapes,
    }


def format_report(rep: dict[str, Any]) -> str:
    """The report as the command prints it."""
    lines = [
        f"programs run        {rep['programs']} ({rep['real_shape_programs']} real-shape, "
        f"--real-shapes {rep['real_shapes']}, seed {rep['seed']})",
        f"disagreements       {rep['failed']} ({len(rep['disagreements'])} kinds)",
        f"wall time           {rep['wall_s']:.1f} s ({rep['shrink_s']:.1f} s shrinking)",
    ]
    for d in rep["disagreements"]:
        lines += [
            "",
            f"-- {d['kind']}: {d['count']} program(s); smallest found:",
            f"   run_program({d['case']})",
            d["error"],
        ]
    return "\n".join(lines)
