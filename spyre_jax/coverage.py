"""``spyre-jax coverage``: how much of PyTorch and JAX runs on the simulated card, and right.

**PyTorch** (:func:`coverage_torch`): PyTorch's own OpInfo database
(``torch.testing._internal.common_methods_invocations.op_db``) and its sample inputs, run
through two paths and compared with eager CPU:

- ``backend``: ``torch.compile(fn, backend="spyre", options={"strict": True}, dynamic=False,
  fullgraph=True)`` under ``torch.no_grad()``, with a fresh Dynamo cache per sample (past its
  recompile limit Dynamo would silently run a frame eagerly). ``fullgraph`` makes a graph break an
  error instead of a silent CPU run of part of the op; a sample for which the backend never
  received a graph is skipped (nothing ran on the card).
- ``device``: the sample's tensors moved to the ``spyre`` device (``torch_bridge.device``) and the
  op called eagerly. An op that runs on the CPU with a ``SpyreFallbackWarning`` is *unsupported*
  (it gives the right answer, but not from the card). When the device cannot be made the path is
  ``"unavailable"`` and skipped.

**JAX** (:func:`coverage_jax`): a table of ours (:data:`JAX_CASES`, about 250 entries: ``jax.numpy``
unary math, binary arithmetic and comparisons, reductions over axes with ``keepdims``,
cumulative ops, shape and indexing ops, linear algebra, ``jax.nn`` and ``jax.lax`` ops, control
flow), each with 2-3 samples at odd shapes in float32 and float16 (ints and bools where the op
needs them), run through ``spyre_jax.jit`` and compared with ``jax.jit`` on the CPU.

Every sample is classified as

- ``passed``: same result within tolerance: ``rtol = atol / scale = 1e-4`` for float32 and
  ``2e-2`` for float16/bfloat16 (``scale`` = the largest finite magnitude of the expected
  output, at least 1: the card sums in another order, with fp32 accumulation), exact for
  integers and bools;
- ``wrong``: a result that differs (shape, dtype class, structure or values);
- ``unsupported``: the compiler refused it: ``UnsupportedPrimitiveError``, ``LoweringError``,
  ``TilingError``, or a ``TypeError`` naming a dtype the card does not have (through Dynamo's
  ``BackendCompilerFailed.inner_exception``); Dynamo refused to capture it whole before our
  backend saw it (``torch._dynamo.exc.Unsupported``/``UserError``, data-dependent shapes); or,
  on the device, a CPU fallback;
- ``error``: anything else (the exception type and its first line are kept);
- ``skipped``: not a test of the card: non-deterministic ops (names with ``rand``, ``normal``,
  ``bernoulli``, ``dropout``, ``empty``, ``uniform``, ``multinomial``), in-place ops (names
  ending in ``_`` or samples that mutate their inputs), samples whose outputs are not tensors or
  differ between two eager runs, samples with more than :data:`MAX_ELEMENTS` elements, samples
  whose reference run fails.

Each sample runs under a time guard (``SIGALRM``, on the main thread) and inside a catch-all, so
one op cannot abort the run. Results are plain dicts (``json.dumps`` works); :func:`format_table`
prints them; :func:`main_coverage` is the ``spyre-jax coverage`` command line.

Running the backend path drops the card kernels it made from ``torch_bridge.backend``'s
``compiled_kernels()`` list again (one per sample would otherwise pile up); the counters of
``compile_stats()`` keep counting.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import re
import signal
import sys
import threading
import time
import types
import unittest
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "STATUSES",
    "MAX_ELEMENTS",
    "JAX_CASES",
    "JaxCase",
    "jax_cases",
    "coverage_torch",
    "coverage_jax",
    "format_table",
    "main_coverage",
]

#: how a sample can end (the keys of every per-op, per-path count)
STATUSES = ("passed", "wrong", "unsupported", "error", "skipped")

#: samples with more tensor elements than this (all inputs together) are skipped
MAX_ELEMENTS = 100_000

#: OpInfo names containing one of these give outputs that are not determined by their inputs
NONDETERMINISTIC = ("rand", "normal", "bernoulli", "dropout", "empty", "uniform", "multinomial")

#: rtol (and atol relative to the output's magnitude) by the expected output's dtype name
TOLERANCE = {"float32": 1e-4, "float64": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}

_NOTES_PER_OP = 3  # distinct non-pass reasons kept per op and path


# ---------------------------------------------------------------------------------------------
# shared: classification, time guard, bookkeeping


class SampleTimeout(Exception):
    """A sample ran past its time guard."""


@contextlib.contextmanager
def _time_guard(seconds: float | None) -> Iterator[None]:
    """Raise :class:`SampleTimeout` in the body after ``seconds`` (main thread only; else none)."""
    usable = (
        seconds is not None
        and seconds > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise SampleTimeout(f"sample ran past {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))  # type: ignore[arg-type]
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it wraps (Dynamo's ``inner_exception``, causes, contexts)."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [e]
    while todo and len(out) < 16:
        x = todo.pop(0)
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        todo += [getattr(x, "inner_exception", None), x.__cause__, x.__context__]
    return out


def _first_line(e: BaseException, n: int = 160) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else "")[:n]


def _is_dtype_type_error(e: BaseException) -> bool:
    s = str(e)
    return isinstance(e, TypeError) and "spyre" in s and "dtype" in s and "support" in s


#: errors of torch's symbolic shapes when an op's output shape depends on its data
_DATA_DEP = frozenset({"GuardOnDataDependentSymNode", "DataDependentOutputException"})


def _classify(e: BaseException) -> tuple[str, str, str]:
    """``(status, key, note)`` of an exception: ``unsupported`` for the compiler's refusals
    (``key`` names the primitive, dtype or error), else ``error`` (``key`` is the type)."""
    from lowering.errors import LoweringError, TilingError, UnsupportedPrimitiveError

    chain = _chain(e)
    for x in chain:
        if isinstance(x, UnsupportedPrimitiveError):
            return "unsupported", str(x.primitive), f"no lowering rule for {x.primitive}"
    for x in chain:
        if _is_dtype_type_error(x):
            m = re.search(r"dtype (?:torch\.)?([A-Za-z0-9_]+)", str(x))
            key = f"dtype {m.group(1)}" if m else "dtype"
            return "unsupported", key, _first_line(x)
        if isinstance(x, TilingError):
            return "unsupported", "TilingError", _first_line(x)
        if isinstance(x, LoweringError):
            line = _first_line(x, 80).removeprefix("spyre: ")
            return "unsupported", f"LoweringError: {line}", _first_line(x)
    dynamo = sys.modules.get("torch._dynamo.exc")
    ours = dynamo is not None and any(isinstance(x, dynamo.BackendCompilerFailed) for x in chain)
    for x in chain:  # Dynamo refused to capture the op whole (data-dependent shapes, ...)
        if ours or dynamo is None:
            break
        if isinstance(x, dynamo.Unsupported | dynamo.UserError) or type(x).__name__ in _DATA_DEP:
            return "unsupported", f"Dynamo: {_first_line(x, 60)}", _first_line(x)
    for x in chain:
        if isinstance(x, SampleTimeout):
            return "error", "SampleTimeout", _first_line(x)
    # the innermost exception says most (Dynamo's wrappers repeat it with a traceback)
    inner = e
    for x in chain:
        if getattr(x, "inner_exception", None) is not None:
            inner = x.inner_exception  # type: ignore[assignment]
    return "error", type(inner).__name__, f"{type(inner).__name__}: {_first_line(inner)}"


def _counts() -> dict[str, int]:
    return dict.fromkeys(STATUSES, 0)


class _Book:
    """Per-op, per-path counts, notes, and the unsupported/error tallies of one run."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)
        self.ops: dict[str, dict[str, Any]] = {}
        self.unsupported: dict[str, collections.Counter[str]] = {
            p: collections.Counter() for p in paths
        }
        self.errors: dict[str, collections.Counter[str]] = {p: collections.Counter() for p in paths}

    def op(self, name: str) -> dict[str, Any]:
        if name not in self.ops:
            self.ops[name] = {p: _counts() for p in self.paths} | {
                "notes": {p: [] for p in self.paths}
            }
        return self.ops[name]

    def add(self, name: str, path: str, status: str, key: str = "", note: str = "") -> None:
        rec = self.op(name)
        rec[path][status] += 1
        if status == "unsupported" and key:
            self.unsupported[path][key] += 1
        if status == "error" and key:
            self.errors[path][note or key] += 1
        if status != "passed" and note:
            notes = rec["notes"][path]
            text = f"{status}: {note}"
            if text not in notes and len(notes) < _NOTES_PER_OP:
                notes.append(text)

    def count_unsupported(self, path: str, key: str) -> None:
        """Count ``key`` (an ATen op that fell back, ...) once more among ``path``'s unsupported."""
        self.unsupported[path][key] += 1

    def at(self, name: str, what: str) -> None:
        """Where the run is (a worker process reports it, to name what it crashed on)."""

    def add_all(self, name: str, status: str, note: str) -> None:
        for p in self.paths:
            self.add(name, p, status, note=note)

    def result(self, frontend: str, **extra: Any) -> dict[str, Any]:
        totals = {}
        for p in self.paths:
            t = _counts()
            ops_tried = ops_passed = ops_some = 0
            for rec in self.ops.values():
                c = rec[p]
                for s in STATUSES:
                    t[s] += c[s]
                tried = sum(c[s] for s in STATUSES if s != "skipped")
                if tried:
                    ops_tried += 1
                    ops_passed += c["passed"] == tried
                    ops_some += c["passed"] > 0
            t.update(
                samples_tried=sum(t[s] for s in STATUSES if s != "skipped"),
                samples_passed=t["passed"],
                ops_tried=ops_tried,
                ops_passed=ops_passed,
                ops_partly_passed=ops_some,
            )
            totals[p] = t
        return {
            "frontend": frontend,
            **extra,
            "totals": totals,
            "unsupported": {p: dict(self.unsupported[p].most_common()) for p in self.paths},
            "errors": {p: dict(self.errors[p].most_common(30)) for p in self.paths},
            "ops": self.ops,
        }


def _tol(dtype_name: str) -> float | None:
    """rtol for a floating dtype name; None for exact (ints, bools)."""
    if dtype_name in TOLERANCE:
        return TOLERANCE[dtype_name]
    if "float" in dtype_name or "complex" in dtype_name:
        return 1e-4
    return None


_PART = {"complex64": "float32", "complex128": "float64"}  # the dtype of a complex's parts


def _close_np(got: np.ndarray, want: np.ndarray, dtype_name: str | None = None) -> str | None:
    """None when ``got`` matches ``want`` (tolerance by ``dtype_name``, default ``want``'s
    dtype), else why not."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if want.dtype.kind == "c" or got.dtype.kind == "c":
        g, w = got.astype(np.complex128), want.astype(np.complex128)
        for part, a, b in (("real", g.real, w.real), ("imag", g.imag, w.imag)):
            why = _close_np(a, b, dtype_name or _PART.get(want.dtype.name, "float64"))
            if why is not None:
                return f"{part} part: {why}"
        return None
    rt = _tol(dtype_name or want.dtype.name)
    if rt is None:
        if got.dtype.kind in "fc":
            return f"dtype {got.dtype} for an expected {want.dtype}"
        if not np.array_equal(got.astype(np.int64), want.astype(np.int64)):
            bad = int(np.sum(got.astype(np.int64) != want.astype(np.int64)))
            return f"{bad}/{want.size} elements differ (exact {want.dtype})"
        return None
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    if not np.array_equal(nan_g, nan_w):
        return f"NaN in {int(np.sum(nan_g != nan_w))} positions where the other has none"
    fin = np.isfinite(w)
    if not np.array_equal(g[~fin & ~nan_w], w[~fin & ~nan_w]):
        return "infinities differ"
    if not fin.any():
        return None
    scale = max(1.0, float(np.max(np.abs(w[fin]))))
    err = np.abs(g[fin] - w[fin])
    lim = rt * scale + rt * np.abs(w[fin])
    if np.any(~np.isfinite(g[fin])) or np.any(err > lim):
        i = int(np.argmax(err - lim))
        return (
            f"max abs error {float(np.max(err)):.3g} (tol {rt:g} x scale {scale:.3g}); "
            f"got {float(g[fin][i]):.6g} want {float(w[fin][i]):.6g}"
        )
    return None


# ---------------------------------------------------------------------------------------------
# PyTorch


def _import_op_db() -> list[Any]:
    """PyTorch's OpInfo list. ``torch.testing._internal`` imports ``expecttest``, a test-only
    package torch does not depend on; a stand-in is installed when it is missing (the OpInfo
    tables use none of it)."""
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stub = types.ModuleType("expecttest")
            stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
            stub.ACCEPT = False  # type: ignore[attr-defined]
            sys.modules["expecttest"] = stub
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def _op_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _device_status() -> tuple[bool, str]:
    """Whether spyre tensors can be made (and read back), and why not."""
    try:
        import torch

        import torch_bridge.device as dev

        t = torch.zeros(3, device=getattr(dev, "NAME", "spyre"))
        if t.device.type != "spyre":
            return False, f"tensors land on {t.device}, not spyre"
        if t.cpu().tolist() != [0.0, 0.0, 0.0]:
            return False, "a zeros tensor read back wrong"
        return True, ""
    except Exception as e:  # never crash: the device is another layer's work
        return False, f"{type(e).__name__}: {_first_line(e)}"


def _torch_leaves(x: Any) -> list[Any]:
    from torch.utils._pytree import tree_flatten

    return tree_flatten(x)[0]


def _numel(sample: Any) -> int:
    import torch

    leaves = _torch_leaves((sample.input, sample.args, sample.kwargs))
    return sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))


def _clone(x: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v), x)


def _same_torch(a: Any, b: Any) -> bool:
    """Exact equality of two eager outputs (NaN equal to NaN)."""
    import torch

    la, lb = _torch_leaves(a), _torch_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.is_floating_point() or x.is_complex():
                if not torch.equal(torch.nan_to_num(x), torch.nan_to_num(y)):
                    return False
                if not torch.equal(x.isnan(), y.isnan()):
                    return False
            elif not torch.equal(x, y):
                return False
        else:
            try:
                if bool(x != y):
                    return False
            except Exception:
                return False
    return True


def _to_np(t: Any) -> np.ndarray:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    if t.is_complex():
        return (
            t.resolve_conj().to(torch.complex64 if t.dtype == torch.complex32 else t.dtype).numpy()
        )
    return t.resolve_neg().resolve_conj().contiguous().numpy()


def _torch_close(got: Any, want: Any) -> str | None:
    """None when a compiled/device output matches the eager one, else why not."""
    import torch

    gl, wl = _torch_leaves(got), _torch_leaves(want)
    if len(gl) != len(wl):
        return f"{len(gl)} outputs, expected {len(wl)}"
    for i, (g, w) in enumerate(zip(gl, wl, strict=True)):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"output {i} is {type(g).__name__}, expected a tensor"
            why = _close_np(_to_np(g), _to_np(w), "bfloat16" if w.dtype == torch.bfloat16 else None)
            if why is not None:
                return f"output {i}: {why}"
        elif isinstance(g, torch.Tensor):
            if g.numel() != 1 or float(g) != float(w):
                return f"output {i}: {g!r} != {w!r}"
        else:
            try:
                equal = bool(g == w)
            except Exception:
                equal = False
            if not equal:
                return f"output {i}: {g!r} != {w!r}"
    return None


def _sample_dtypes(op: Any) -> list[Any]:
    """float32 (and float16 where the op supports it on the CPU); integer or bool for ops with
    no float32."""
    import torch

    try:
        have = set(op.supported_dtypes("cpu"))
    except Exception:
        have = {torch.float32}
    if torch.float32 in have:
        return [torch.float32] + ([torch.float16] if torch.float16 in have else [])
    for dt in (torch.int32, torch.int64, torch.bool):
        if dt in have:
            return [dt]
    return []


def _run_backend(op: Any, sample: Any) -> tuple[Any, bool]:
    """The sample through ``torch.compile(backend="spyre")``: (output, whether a graph reached
    the backend)."""
    import torch
    import torch._dynamo

    from torch_bridge import backend as tb

    def fn(inp: Any, *args: Any, **kwargs: Any) -> Any:
        return op.op(inp, *args, **kwargs)

    torch._dynamo.reset()
    inp, args, kwargs = _clone((sample.input, sample.args, sample.kwargs))
    before = tb.compile_stats()["graphs"]
    with tb._lock:
        n_kernels = len(tb._kernels)
    try:
        compiled = torch.compile(
            fn, backend="spyre", options={"strict": True}, dynamic=False, fullgraph=True
        )
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = compiled(inp, *args, **kwargs)
    finally:
        with tb._lock:
            del tb._kernels[n_kernels:]
    return out, tb.compile_stats()["graphs"] > before


_FALLBACK_OP = re.compile(r"ATen op (\S+)")


def _run_device(op: Any, sample: Any) -> tuple[Any, list[str]]:
    """The sample with its tensors on ``spyre``, eagerly: (output on the CPU, the ATen ops that
    fell back to the CPU)."""
    import torch
    from torch.utils._pytree import tree_map

    def put(v: Any) -> Any:
        return v.to("spyre") if isinstance(v, torch.Tensor) else copy.copy(v)

    def get(v: Any) -> Any:
        return v.cpu() if isinstance(v, torch.Tensor) and v.device.type != "cpu" else v

    inp, args, kwargs = tree_map(put, (sample.input, sample.args, sample.kwargs))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tree_map(get, op.op(inp, *args, **kwargs))
    fell = []
    for w in caught:
        if w.category.__name__ == "SpyreFallbackWarning":
            m = _FALLBACK_OP.search(str(w.message))
            fell.append(m.group(1) if m else "?")
    return out, sorted(set(fell))


def _torch_sample(
    book: _Book, name: str, op: Any, sample: Any, paths: Sequence[str], timeout: float | None
) -> None:
    """Run one sample through every path and book its status."""
    import torch

    try:
        n = _numel(sample)
    except Exception as e:
        book.add_all(name, "skipped", f"sample unreadable ({type(e).__name__})")
        return
    if n > MAX_ELEMENTS:
        book.add_all(name, "skipped", f"more than {MAX_ELEMENTS} elements")
        return
    # the reference: eager CPU, twice (determinism), on copies (in-place detection)
    book.at(name, "reference")
    try:
        with _time_guard(timeout), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            orig = (sample.input, sample.args, sample.kwargs)
            inp, args, kwargs = _clone(orig)
            want = op.op(inp, *args, **kwargs)
            mutated = not _same_torch((inp, args, kwargs), orig)
            inp2, args2, kwargs2 = _clone(orig)
            again = op.op(inp2, *args2, **kwargs2)
    except Exception as e:
        book.add_all(name, "skipped", f"eager reference failed ({type(e).__name__})")
        return
    if mutated:
        book.add_all(name, "skipped", "in-place (mutates its inputs)")
        return
    if not any(isinstance(t, torch.Tensor) for t in _torch_leaves(want)):
        book.add_all(name, "skipped", "non-tensor output")
        return
    if not _same_torch(want, again):
        book.add_all(name, "skipped", "non-deterministic output")
        return
    for path in paths:
        book.at(name, path)
        try:
            with _time_guard(timeout):
                if path == "backend":
                    got, compiled = _run_backend(op, sample)
                    if not compiled:
                        book.add(name, path, "skipped", note="no graph reached the backend")
                        continue
                else:
                    got, fell = _run_device(op, sample)
                    if fell:
                        for f in fell:
                            book.count_unsupported(path, f)
                        book.add(name, path, "unsupported", note="CPU fallback: " + ", ".join(fell))
                        continue
            why = _torch_close(got, want)
        except Exception as e:
            status, key, note = _classify(e)
            book.add(name, path, status, key, note)
            continue
        if why is None:
            book.add(name, path, "passed")
        else:
            book.add(name, path, "wrong", note=why)


def _torch_op(
    book: _Book,
    op: Any,
    paths: Sequence[str],
    run_paths: Sequence[str],
    limit_samples: int,
    timeout: float | None,
) -> None:
    """Every sample of one OpInfo (up to ``limit_samples`` per dtype) through ``run_paths``."""
    name = _op_name(op)
    book.op(name)
    lname = op.name.lower()
    if any(w in lname for w in NONDETERMINISTIC):
        book.add_all(name, "skipped", "non-deterministic op")
        return
    if op.name.endswith("_") and not op.name.endswith("__"):
        book.add_all(name, "skipped", "in-place op")
        return
    for p in paths:
        if p not in run_paths:
            book.add(name, p, "skipped", note="path unavailable")
    dtypes = _sample_dtypes(op)
    if not dtypes:
        book.add_all(name, "skipped", "no float32/int/bool dtype on the CPU")
        return
    for dt in dtypes:
        book.at(name, "sample_inputs")
        try:
            with _time_guard(timeout), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                samples = []
                for s in op.sample_inputs("cpu", dt, requires_grad=False):
                    samples.append(s)
                    if len(samples) >= limit_samples:
                        break
        except Exception as e:
            book.add_all(name, "skipped", f"sample_inputs failed ({type(e).__name__})")
            continue
        for s in samples:
            try:
                _torch_sample(book, name, op, s, run_paths, timeout)
            except Exception as e:  # pragma: no cover - _torch_sample catches per path
                book.add_all(name, "error", f"{type(e).__name__}: {_first_line(e)}")


class _PipeBook(_Book):
    """A worker process's book: every booking is sent to the parent, which keeps the real one."""

    def __init__(self, paths: Sequence[str], conn: Any):
        super().__init__(paths)
        self.conn = conn

    def op(self, name: str) -> dict[str, Any]:
        self.conn.send(("op", name))
        return super().op(name)

    def add(self, name: str, path: str, status: str, key: str = "", note: str = "") -> None:
        self.conn.send(("add", name, path, status, key, note))

    def count_unsupported(self, path: str, key: str) -> None:
        self.conn.send(("unsup", path, key))

    def at(self, name: str, what: str) -> None:
        self.conn.send(("at", name, what))
        if os.environ.get("SPYRE_COVERAGE_TEST_CRASH") == f"{name}:{what}":  # tests: a segfault
            os.kill(os.getpid(), signal.SIGSEGV)


def _torch_worker(
    conn: Any,
    names: list[str],
    paths: list[str],
    run_paths: list[str],
    limit_samples: int,
    timeout: float | None,
) -> None:
    """The body of an isolated worker process: run the named OpInfos, booking through ``conn``."""
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)
    by_name = {_op_name(o): o for o in _import_op_db()}
    if "device" in run_paths:
        _device_status()
    book = _PipeBook(paths, conn)
    for name in names:
        _torch_op(book, by_name[name], paths, run_paths, limit_samples, timeout)
        conn.send(("done", name))
        torch._dynamo.reset()
    conn.send(("end",))
    conn.close()


def _worker_main(job: str) -> None:
    """A worker process's entry point (``python -c``): ``job`` is the JSON of
    ``[fd, names, paths, run_paths, limit_samples, timeout]``; bookings go to pipe ``fd``."""
    from multiprocessing.connection import Connection

    fd, names, paths, run_paths, limit_samples, timeout = json.loads(job)
    _torch_worker(Connection(fd, readable=False), names, paths, run_paths, limit_samples, timeout)


def _run_isolated(
    book: _Book,
    names: list[str],
    paths: list[str],
    run_paths: list[str],
    limit_samples: int,
    timeout: float | None,
    deadline: float | None,
    on_done: Callable[[], None],
) -> bool:
    """Run ``names`` in worker processes; a worker that crashes (a segfault in native code) or
    hangs past the time guard is killed, the sample it was on is booked as an ``error`` and a
    fresh worker goes on with the next op. False when the deadline stopped the run."""
    import subprocess
    from multiprocessing.connection import Connection

    todo = list(names)
    silent = 0  # workers in a row that died before saying anything
    hard = (timeout or 600.0) + 120.0  # the worker's own guard fires first; this is for hangs
    startup = 300.0
    while todo:
        rfd, wfd = os.pipe()
        job = json.dumps([wfd, todo, paths, run_paths, limit_samples, timeout])
        proc = subprocess.Popen(
            [sys.executable, "-c", f"import spyre_jax.coverage as c; c._worker_main({job!r})"],
            pass_fds=(wfd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(wfd)
        parent = Connection(rfd, writable=False)
        current: tuple[str, str] | None = None
        finished = heard = False
        wait = startup
        try:
            while True:
                if not parent.poll(wait):
                    why = f"no progress for {wait:.0f} s (killed)"
                    break
                try:
                    msg = parent.recv()
                except EOFError:
                    try:
                        code = proc.wait(10)
                    except subprocess.TimeoutExpired:
                        code = None
                    sig = -code if code is not None and code < 0 else None
                    why = (
                        f"the process died of {signal.Signals(sig).name}"
                        if sig
                        else f"the process exited ({code})"
                    )
                    break
                wait, heard = hard, True
                kind = msg[0]
                if kind == "op":
                    book.op(msg[1])
                elif kind == "add":
                    book.add(*msg[1:])
                elif kind == "unsup":
                    book.count_unsupported(*msg[1:])
                elif kind == "at":
                    current = (msg[1], msg[2])
                elif kind == "done":
                    todo.remove(msg[1])
                    current = None
                    on_done()
                    if deadline is not None and time.perf_counter() > deadline:
                        return not todo
                elif kind == "end":
                    finished = True
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            parent.close()
        if finished:
            break
        silent = 0 if heard else silent + 1
        if silent >= 2:
            raise RuntimeError(f"coverage_torch: the worker process does not start: {why}")
        if current is None:  # died between ops (or while starting): skip the next op
            if not todo:
                break
            current = (todo[0], "startup")
        name, what = current
        book.op(name)
        if what in run_paths:
            book.add(name, what, "error", "WorkerCrash", f"WorkerCrash: {why} ({what})")
        else:
            book.add_all(name, "skipped", f"{what} crashed: {why}")
        if name in todo:
            todo.remove(name)
            on_done()
        if deadline is not None and time.perf_counter() > deadline:
            return not todo
    return True


def coverage_torch(
    ops: Sequence[str] | None = None,
    limit_samples: int = 3,
    paths: Sequence[str] = ("backend", "device"),
    *,
    limit: int | None = None,
    sample_timeout_s: float | None = 120.0,
    time_limit_s: float | None = None,
    isolate: bool | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """PyTorch's OpInfo samples through the compile backend and the ``spyre`` device.

    ``ops``: OpInfo names to run (``"add"``, or a variant's full name ``"max.reduction_no_dim"``;
    ``None``: all). ``limit_samples``: samples per dtype and op. ``paths``: ``"backend"`` and/or
    ``"device"`` (the device path is ``"unavailable"`` when spyre tensors cannot be made).
    ``limit``: at most this many ops. ``sample_timeout_s``: the per-sample time guard.
    ``time_limit_s``: stop starting new ops after this many seconds (``truncated`` says so).
    ``isolate``: run the ops in worker processes, so that a crash in native code (a segfault) or
    a hang costs one sample (an ``error``, ``WorkerCrash``) instead of the run; default: when
    more than 20 ops run. ``progress``: called with the partial result after every op.

    Returns ``{"frontend": "torch", "paths": {path: {"status", "available", "reason"}},
    "totals": {path: {status counts, samples_tried, samples_passed, ops_tried, ops_passed (every
    tried sample passed), ops_partly_passed}}, "unsupported": {path: {ATen op or reason:
    samples}}, "errors": {path: {first line: samples}}, "ops": {name: {path: {status: n},
    "notes": {path: [...]}}}, "elapsed_s", "truncated", "config"}``.
    """
    import torch

    t0 = time.perf_counter()
    paths = list(paths)
    unknown = set(paths) - {"backend", "device"}
    if unknown:
        raise ValueError(f"coverage_torch: unknown paths {sorted(unknown)}")
    path_info: dict[str, dict[str, Any]] = {}
    run_paths: list[str] = []
    for p in paths:
        ok, why = _device_status() if p == "device" else (True, "")
        path_info[p] = {"status": "ok" if ok else "unavailable", "available": ok, "reason": why}
        if ok:
            run_paths.append(p)
    db = _import_op_db()
    if ops is not None:
        want = set(ops)
        db = [o for o in db if o.name in want or _op_name(o) in want]
    if limit is not None:
        db = db[:limit]
    if isolate is None:
        isolate = len(db) > 20
    book = _Book(paths)
    config = {
        "limit_samples": limit_samples,
        "max_elements": MAX_ELEMENTS,
        "sample_timeout_s": sample_timeout_s,
        "isolated": isolate,
        "tolerance": TOLERANCE,
        "torch": torch.__version__,
    }
    truncated = False

    def snapshot() -> dict[str, Any]:
        return book.result(
            "torch",
            paths=path_info,
            elapsed_s=round(time.perf_counter() - t0, 1),
            truncated=truncated,
            config=config,
        )

    def on_done() -> None:
        if progress is not None:
            progress(snapshot())

    deadline = None if time_limit_s is None else t0 + time_limit_s
    if isolate:
        names = [_op_name(o) for o in db]
        truncated = not _run_isolated(
            book, names, paths, run_paths, limit_samples, sample_timeout_s, deadline, on_done
        )
    else:
        for op in db:
            if deadline is not None and time.perf_counter() > deadline:
                truncated = True
                break
            _torch_op(book, op, paths, run_paths, limit_samples, sample_timeout_s)
            on_done()
        torch._dynamo.reset()
    return snapshot()


# ---------------------------------------------------------------------------------------------
# JAX

#: one sample: the function and its positional arguments (NumPy arrays)
Sample = tuple[Callable[..., Any], tuple[Any, ...]]


@dataclass(frozen=True)
class JaxCase:
    """One entry of the JAX table: ``samples(rng, dtype)`` gives 2-3 (fn, args) for a dtype."""

    name: str
    samples: Callable[[np.random.Generator, np.dtype], list[Sample]]
    dtypes: tuple[str, ...] = ("float32", "float16")


SHAPES = ((5, 65), (3, 63), (2, 3, 100))


def _arr(
    rng: np.random.Generator, shape: tuple[int, ...], dt: Any, lo: float = -2.0, hi: float = 2.0
) -> np.ndarray:
    dt = np.dtype(dt)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        return rng.integers(int(lo), int(hi), shape).astype(dt)
    return rng.uniform(lo, hi, shape).astype(dt)


def _nonzero(rng: np.random.Generator, shape: tuple[int, ...], dt: Any) -> np.ndarray:
    """Magnitudes in [0.5, 2], random signs: safe divisors."""
    mag = rng.uniform(0.5, 2.0, shape)
    return (mag * np.where(rng.random(shape) < 0.5, -1.0, 1.0)).astype(dt)


def _unary(name: str, f: Callable, lo: float = -2.0, hi: float = 2.0, **kw: Any) -> JaxCase:
    return JaxCase(name, lambda rng, dt: [(f, (_arr(rng, s, dt, lo, hi),)) for s in SHAPES], **kw)


#: operand shapes of binary ops: equal, a broadcast row, a broadcast column
_BINARY_PAIRS = (((5, 65), (5, 65)), ((3, 63), (63,)), ((2, 3, 100), (3, 1)))


def _binary(
    name: str,
    f: Callable,
    lo: float = -2.0,
    hi: float = 2.0,
    lo2: float | None = None,
    hi2: float | None = None,
    divisor: bool = False,
    same_shape: bool = False,
    **kw: Any,
) -> JaxCase:
    """Same shapes, a broadcast row vector, and a broadcast column (``same_shape``: equal
    shapes only)."""
    pairs = tuple((s, s) for s in SHAPES) if same_shape else _BINARY_PAIRS
    lo2 = lo if lo2 is None else lo2
    hi2 = hi if hi2 is None else hi2

    def gen(rng: np.random.Generator, dt: np.dtype) -> list[Sample]:
        out = []
        for a, b in pairs:
            y = _nonzero(rng, b, dt) if divisor else _arr(rng, b, dt, lo2, hi2)
            out.append((f, (_arr(rng, a, dt, lo, hi), y)))
        return out

    return JaxCase(name, gen, **kw)


def _reduction(name: str, f: Callable, lo: float = -2.0, hi: float = 2.0, **kw: Any) -> JaxCase:
    """Over the last axis, over axis 0 with keepdims, over two axes (or all when ``f`` takes no
    tuple)."""

    def gen(rng: np.random.Generator, dt: np.dtype) -> list[Sample]:
        return [
            (lambda x: f(x, axis=-1), (_arr(rng, (5, 65), dt, lo, hi),)),
            (lambda x: f(x, axis=0, keepdims=True), (_arr(rng, (3, 63), dt, lo, hi),)),
            (lambda x: f(x, axis=(1, 2)), (_arr(rng, (2, 3, 100), dt, lo, hi),)),
        ]

    return JaxCase(name, gen, **kw)


def _reduction1(name: str, f: Callable, lo: float = -2.0, hi: float = 2.0, **kw: Any) -> JaxCase:
    """Reductions that take a single axis (argmax...): last axis, axis 0 with keepdims, axis 1."""

    def gen(rng: np.random.Generator, dt: np.dtype) -> list[Sample]:
        return [
            (lambda x: f(x, axis=-1), (_arr(rng, (5, 65), dt, lo, hi),)),
            (lambda x: f(x, axis=0, keepdims=True), (_arr(rng, (3, 63), dt, lo, hi),)),
            (lambda x: f(x, axis=1), (_arr(rng, (2, 3, 100), dt, lo, hi),)),
        ]

    return JaxCase(name, gen, **kw)


def _custom(name: str, gen: Callable[[np.random.Generator, np.dtype], list[Sample]], **kw: Any):
    return JaxCase(name, gen, **kw)


def _along(f: Callable, lo: float = -2.0, hi: float = 2.0) -> Callable:
    """Samples of ``f(x, axis)`` along the last axis and axis 0 (cumulative ops, softmax)."""

    def gen(rng: np.random.Generator, dt: np.dtype) -> list[Sample]:
        return [
            (lambda x: f(x, -1), (_arr(rng, (5, 65), dt, lo, hi),)),
            (lambda x: f(x, 0), (_arr(rng, (3, 63), dt, lo, hi),)),
            (lambda x: f(x, 1), (_arr(rng, (2, 3, 100), dt, lo, hi),)),
        ]

    return gen


def _same_shape(*fs: Callable) -> Callable:
    """One sample per (function, shape) pair: ``fs[i]`` on ``SHAPES[i]``."""

    def gen(rng: np.random.Generator, dt: np.dtype) -> list[Sample]:
        return [(f, (_arr(rng, s, dt),)) for f, s in zip(fs, SHAPES, strict=False)]

    return gen


def _build_jax_cases() -> list[JaxCase]:
    """The JAX table (built lazily: it imports jax)."""
    import jax
    import jax.numpy as jnp
    import jax.scipy.special as jss
    from jax import lax

    C: list[JaxCase] = []
    U, B = _unary, _binary

    # -- unary math
    for nm in ("abs", "negative", "positive", "exp", "exp2", "expm1", "sin", "cos", "tanh"):
        C.append(U(f"jnp.{nm}", getattr(jnp, nm)))
    for nm in ("arctan", "sinh", "cosh", "arcsinh", "sign", "floor", "ceil", "round", "trunc"):
        C.append(U(f"jnp.{nm}", getattr(jnp, nm)))
    for nm in ("square", "fabs", "deg2rad", "rad2deg", "cbrt", "signbit", "isnan", "isfinite"):
        C.append(U(f"jnp.{nm}", getattr(jnp, nm)))
    for nm in ("log", "log1p", "log2", "log10", "sqrt"):
        C.append(U(f"jnp.{nm}", getattr(jnp, nm), 0.1, 3.0))
    C.append(U("jnp.tan", jnp.tan, -1.2, 1.2))
    C.append(U("jnp.arcsin", jnp.arcsin, -0.95, 0.95))
    C.append(U("jnp.arccos", jnp.arccos, -0.95, 0.95))
    C.append(U("jnp.arctanh", jnp.arctanh, -0.9, 0.9))
    C.append(U("jnp.arccosh", jnp.arccosh, 1.1, 3.0))
    C.append(
        JaxCase(
            "jnp.reciprocal",
            lambda rng, dt: [(jnp.reciprocal, (_nonzero(rng, s, dt),)) for s in SHAPES],
        )
    )
    C.append(U("jnp.isinf", lambda x: jnp.isinf(x / (x - x.mean() + 0.5))))
    C.append(U("jnp.nan_to_num", lambda x: jnp.nan_to_num(jnp.log(x)), -1.0, 2.0))
    C.append(U("jnp.sinc", jnp.sinc))
    domain = {"logit": (0.05, 0.95), "erfinv": (-0.9, 0.9), "gammaln": (0.5, 4.0)}
    domain["digamma"] = (0.5, 4.0)
    for nm in ("erf", "erfc", "expit", "logit", "gammaln", "digamma", "erfinv", "i0e"):
        C.append(U(f"jax.scipy.special.{nm}", getattr(jss, nm), *domain.get(nm, (-2.0, 2.0))))
    C.append(U("jax.scipy.special.ndtr", jss.ndtr, dtypes=("float32",)))  # no float16 on CPU

    # -- jax.lax elementwise
    for nm in ("exp", "tanh", "logistic", "neg", "abs", "sin", "cos", "erf", "square", "sign"):
        C.append(U(f"lax.{nm}", getattr(lax, nm)))
    C.append(U("lax.rsqrt", lax.rsqrt, 0.1, 3.0))
    C.append(U("lax.sqrt", lax.sqrt, 0.1, 3.0))
    C.append(U("lax.log", lax.log, 0.1, 3.0))
    C.append(U("lax.exp2", lax.exp2))
    C.append(U("lax.integer_pow.2", lambda x: lax.integer_pow(x, 2)))
    C.append(U("lax.integer_pow.3", lambda x: lax.integer_pow(x, 3)))
    C.append(
        JaxCase(
            "lax.integer_pow.-1",
            lambda rng, dt: [
                (lambda x: lax.integer_pow(x, -1), (_nonzero(rng, s, dt),)) for s in SHAPES
            ],
        )
    )
    C.append(U("lax.convert_element_type", lambda x: lax.convert_element_type(x, jnp.float32)))
    C.append(
        U("lax.clamp", lambda x: lax.clamp(jnp.array(-0.5, x.dtype), x, jnp.array(0.75, x.dtype)))
    )
    C.append(U("lax.reduce_precision", lambda x: lax.reduce_precision(x, 5, 10)))

    # -- binary arithmetic and comparisons
    for nm in ("add", "subtract", "multiply", "maximum", "minimum", "fmax", "fmin"):
        C.append(B(f"jnp.{nm}", getattr(jnp, nm)))
    for nm in ("arctan2", "hypot", "copysign", "logaddexp", "logaddexp2", "heaviside"):
        C.append(B(f"jnp.{nm}", getattr(jnp, nm)))
    for nm in ("divide", "true_divide", "floor_divide", "remainder", "fmod"):
        C.append(B(f"jnp.{nm}", getattr(jnp, nm), divisor=True))
    C.append(B("jnp.power", jnp.power, 0.5, 2.0, -2.0, 2.0))
    C.append(B("jnp.float_power", jnp.float_power, 0.5, 2.0, -2.0, 2.0, dtypes=("float32",)))
    for nm in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal"):
        C.append(B(f"jnp.{nm}", getattr(jnp, nm), -2.0, 2.0))
    C.append(B("jnp.isclose", lambda a, b: jnp.isclose(a, jnp.round(b * 2) / 2 + a * 0)))
    # lax's binary ops take operands of one rank (no NumPy broadcasting)
    C.append(B("lax.max", lax.max, same_shape=True))
    C.append(B("lax.pow", lax.pow, 0.5, 2.0, -2.0, 2.0, same_shape=True))
    C.append(B("lax.rem", lax.rem, divisor=True, same_shape=True))
    C.append(B("lax.nextafter", lax.nextafter, dtypes=("float32",), same_shape=True))
    C.append(B("jnp.where(a>b)", lambda a, b: jnp.where(a > b, a, b * 2)))
    ints = ("int32",)
    for nm in ("add", "subtract", "multiply", "maximum", "floor_divide", "remainder"):
        C.append(B(f"jnp.{nm}[int32]", getattr(jnp, nm), -50, 50, 1, 9, dtypes=ints))
    for nm in ("bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift"):
        C.append(B(f"jnp.{nm}", getattr(jnp, nm), -1000, 1000, 0, 8, dtypes=ints))
    C.append(U("jnp.invert[int32]", jnp.invert, -100, 100, dtypes=ints))
    bools = ("bool",)
    for nm in ("logical_and", "logical_or", "logical_xor"):
        C.append(B(f"jnp.{nm}", getattr(jnp, nm), dtypes=bools))
    C.append(U("jnp.logical_not", jnp.logical_not, dtypes=bools))

    # -- reductions
    for nm in ("sum", "mean", "max", "min", "var", "std", "ptp", "nansum", "nanmax", "amax"):
        C.append(_reduction(f"jnp.{nm}", getattr(jnp, nm)))
    C.append(_reduction("jnp.prod", jnp.prod, 0.9, 1.1))
    C.append(_reduction("jnp.all", lambda x, **k: jnp.all(x > -1.8, **k)))
    C.append(_reduction("jnp.any", lambda x, **k: jnp.any(x > 1.9, **k)))
    C.append(_reduction("jnp.count_nonzero", lambda x, **k: jnp.count_nonzero(x > 0, **k)))
    C.append(
        _reduction(
            "jnp.linalg.norm",
            lambda x, axis, **k: jnp.linalg.norm(
                x, axis=axis if not isinstance(axis, tuple) else axis, **k
            ),
        )
    )
    C.append(_reduction("jax.nn.logsumexp", jax.nn.logsumexp))
    C.append(_reduction1("jnp.argmax", jnp.argmax))
    C.append(_reduction1("jnp.argmin", jnp.argmin))
    C.append(_reduction1("jnp.median", jnp.median, dtypes=("float32",)))
    C.append(_custom("jnp.sum(all)", _same_shape(jnp.sum, jnp.sum, jnp.sum)))
    C.append(
        _custom(
            "jnp.average(weights)",
            lambda rng, dt: [
                (
                    lambda x, w: jnp.average(x, axis=-1, weights=w),
                    (_arr(rng, (5, 65), dt), _arr(rng, (65,), dt, 0.1, 1.0)),
                )
            ],
        )
    )
    C.append(
        _custom(
            "lax.reduce_max",
            _same_shape(
                lambda x: lax.reduce_max(x, (1,)),
                lambda x: lax.reduce_max(x, (0,)),
                lambda x: lax.reduce_max(x, (0, 2)),
            ),
        )
    )
    C.append(
        _custom(
            "lax.reduce_sum",
            _same_shape(
                lambda x: lax.reduce_sum(x, (1,)),
                lambda x: lax.reduce_sum(x, (0, 1)),
                lambda x: lax.reduce_sum(x, (2,)),
            ),
        )
    )
    C.append(
        _custom(
            "lax.argmax",
            _same_shape(
                lambda x: lax.argmax(x, 1, jnp.int32), lambda x: lax.argmax(x, 0, jnp.int32)
            ),
        )
    )

    # -- cumulative
    C.append(_custom("jnp.cumsum", _along(lambda x, a: jnp.cumsum(x, axis=a))))
    C.append(_custom("jnp.cumprod", _along(lambda x, a: jnp.cumprod(x, axis=a), 0.95, 1.05)))
    C.append(_custom("jnp.diff", _along(lambda x, a: jnp.diff(x, axis=a))))
    C.append(_custom("lax.cumsum", _along(lambda x, a: lax.cumsum(x, axis=a % x.ndim))))
    C.append(_custom("lax.cummax", _along(lambda x, a: lax.cummax(x, axis=a % x.ndim))))
    C.append(_custom("lax.cummin", _along(lambda x, a: lax.cummin(x, axis=a % x.ndim))))
    C.append(_custom("lax.cumlogsumexp", _along(lambda x, a: lax.cumlogsumexp(x, axis=a % x.ndim))))
    C.append(
        _custom(
            "jnp.cumsum(reverse)",
            _along(lambda x, a: jnp.flip(jnp.cumsum(jnp.flip(x, a), axis=a), a)),
        )
    )

    # -- shape and data movement
    C.append(
        _custom(
            "jnp.reshape",
            _same_shape(
                lambda x: x.reshape(13, 25), lambda x: x.reshape(-1), lambda x: x.reshape(6, 100)
            ),
        )
    )
    C.append(_custom("jnp.ravel", _same_shape(jnp.ravel, jnp.ravel, jnp.ravel)))
    C.append(
        _custom(
            "jnp.transpose",
            _same_shape(jnp.transpose, jnp.transpose, lambda x: jnp.transpose(x, (2, 0, 1))),
        )
    )
    C.append(
        _custom(
            "jnp.swapaxes",
            _same_shape(
                lambda x: jnp.swapaxes(x, 0, 1),
                lambda x: jnp.swapaxes(x, 1, 0),
                lambda x: jnp.swapaxes(x, 1, 2),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.moveaxis",
            _same_shape(
                lambda x: jnp.moveaxis(x, 0, -1),
                lambda x: jnp.moveaxis(x, 1, 0),
                lambda x: jnp.moveaxis(x, -1, 0),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.expand_dims",
            _same_shape(
                lambda x: jnp.expand_dims(x, 0),
                lambda x: jnp.expand_dims(x, 1),
                lambda x: jnp.expand_dims(x, -1),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.squeeze",
            _same_shape(
                lambda x: jnp.squeeze(x[:1]),
                lambda x: jnp.squeeze(x[:, None], 1),
                lambda x: jnp.squeeze(x[:, :1], 1),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.broadcast_to",
            _same_shape(
                lambda x: jnp.broadcast_to(x[:1], (4, 65)),
                lambda x: jnp.broadcast_to(x, (2, 3, 63)),
                lambda x: jnp.broadcast_to(x[:, :1], (2, 5, 100)),
            ),
        )
    )

    def two(f: Callable, shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> Callable:
        def gen(rng: np.random.Generator, dt: np.dtype) -> list[Sample]:
            return [(f, (_arr(rng, a, dt), _arr(rng, b, dt))) for a, b in shapes]

        return gen

    C.append(
        _custom(
            "jnp.concatenate",
            lambda rng, dt: [
                (
                    lambda a, b: jnp.concatenate([a, b], axis=0),
                    (_arr(rng, (5, 65), dt), _arr(rng, (3, 65), dt)),
                ),
                (
                    lambda a, b: jnp.concatenate([a, b], axis=1),
                    (_arr(rng, (3, 63), dt), _arr(rng, (3, 37), dt)),
                ),
                (
                    lambda a, b: jnp.concatenate([a, b], axis=-1),
                    (_arr(rng, (2, 3, 100), dt), _arr(rng, (2, 3, 28), dt)),
                ),
            ],
        )
    )
    C.append(
        _custom(
            "jnp.stack",
            two(
                lambda a, b: jnp.stack([a, b], axis=1),
                (((5, 65), (5, 65)), ((2, 3, 100), (2, 3, 100))),
            ),
        )
    )
    C.append(_custom("jnp.hstack", two(lambda a, b: jnp.hstack([a, b]), (((5, 65), (5, 7)),))))
    C.append(_custom("jnp.vstack", two(lambda a, b: jnp.vstack([a, b]), (((5, 65), (3, 65)),))))
    C.append(
        _custom(
            "jnp.split",
            _same_shape(
                lambda x: jnp.split(x, [2, 4], axis=0),
                lambda x: jnp.split(x, 3, axis=1),
                lambda x: jnp.split(x, [30], axis=-1),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.tile",
            _same_shape(
                lambda x: jnp.tile(x, (2, 1)),
                lambda x: jnp.tile(x, (1, 3)),
                lambda x: jnp.tile(x, (1, 2, 1)),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.repeat",
            _same_shape(
                lambda x: jnp.repeat(x, 2, axis=0),
                lambda x: jnp.repeat(x, 3, axis=1),
                lambda x: jnp.repeat(x, 2, axis=-1),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.flip",
            _same_shape(lambda x: jnp.flip(x, 0), lambda x: jnp.flip(x, 1), lambda x: jnp.flip(x)),
        )
    )
    C.append(
        _custom(
            "jnp.roll",
            _same_shape(
                lambda x: jnp.roll(x, 2, axis=0),
                lambda x: jnp.roll(x, -5, axis=1),
                lambda x: jnp.roll(x, 7, axis=-1),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.pad",
            _same_shape(
                lambda x: jnp.pad(x, ((1, 2), (3, 0))),
                lambda x: jnp.pad(x, 1, constant_values=0.5),
                lambda x: jnp.pad(x, ((0, 0), (1, 1), (0, 28))),
            ),
        )
    )
    C.append(_custom("jnp.pad(edge)", _same_shape(lambda x: jnp.pad(x, 2, mode="edge"))))
    C.append(_custom("jnp.pad(reflect)", _same_shape(lambda x: jnp.pad(x, 2, mode="reflect"))))
    C.append(
        _custom(
            "jnp.where",
            _same_shape(
                lambda x: jnp.where(x > 0, x, 0.0),
                lambda x: jnp.where(x < 0.5, x * 2, -x),
                lambda x: jnp.where(x > 0, 1.0, x),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.clip",
            _same_shape(
                lambda x: jnp.clip(x, -1, 1),
                lambda x: jnp.clip(x, 0.0),
                lambda x: jnp.clip(x, max=0.3),
            ),
        )
    )
    C.append(_custom("jnp.triu", _same_shape(jnp.triu, lambda x: jnp.triu(x, 1))))
    C.append(_custom("jnp.tril", _same_shape(jnp.tril, lambda x: jnp.tril(x, -1))))
    C.append(
        _custom(
            "jnp.zeros_like+ones_like",
            _same_shape(
                lambda x: jnp.zeros_like(x) + x,
                lambda x: jnp.ones_like(x) * x,
                lambda x: jnp.full_like(x, 3.0) - x,
            ),
        )
    )
    C.append(
        _custom(
            "astype",
            _same_shape(
                lambda x: x.astype(jnp.float32) * 2,
                lambda x: x.astype(jnp.float16),
                lambda x: (x * 10).astype(jnp.int32),
            ),
        )
    )
    C.append(_custom("astype(bool)", _same_shape(lambda x: x.astype(bool), lambda x: (x > 0) * x)))

    def take_gen(rng: np.random.Generator, dt: np.dtype) -> list[Sample]:
        return [
            (
                lambda x, i: jnp.take(x, i, axis=0),
                (_arr(rng, (5, 65), dt), rng.integers(0, 5, (7,)).astype(np.int32)),
            ),
            (
                lambda x, i: jnp.take(x, i, axis=1),
                (_arr(rng, (3, 63), dt), rng.integers(0, 63, (9,)).astype(np.int32)),
            ),
            (
                lambda x, i: x[i],
                (_arr(rng, (2, 3, 100), dt), rng.integers(0, 2, (4,)).astype(np.int32)),
            ),
        ]

    C.append(_custom("jnp.take", take_gen))

    def tak_gen(rng: np.random.Generator, dt: np.dtype) -> list[Sample]:
        return [
            (
                lambda x, i: jnp.take_along_axis(x, i, axis=-1),
                (_arr(rng, (5, 65), dt), rng.integers(0, 65, (5, 3)).astype(np.int32)),
            ),
            (
                lambda x, i: jnp.take_along_axis(x, i, axis=0),
                (_arr(rng, (3, 63), dt), rng.integers(0, 3, (2, 63)).astype(np.int32)),
            ),
        ]

    C.append(_custom("jnp.take_along_axis", tak_gen))
    C.append(
        _custom(
            "embedding (table[idx])",
            lambda rng, dt: [
                (
                    lambda t, i: t[i],
                    (_arr(rng, (50, 65), dt), rng.integers(0, 50, (3, 7)).astype(np.int32)),
                ),
                (
                    lambda t, i: t[i],
                    (_arr(rng, (100, 63), dt), rng.integers(0, 100, (9,)).astype(np.int32)),
                ),
            ],
        )
    )
    C.append(
        _custom(
            "basic indexing",
            _same_shape(lambda x: x[1:4, ::2], lambda x: x[::-1, 3], lambda x: x[..., None, 5:50]),
        )
    )
    C.append(
        _custom(
            "x.at[].set",
            lambda rng, dt: [
                (lambda x, v: x.at[1:3].set(v), (_arr(rng, (5, 65), dt), _arr(rng, (2, 65), dt))),
                (
                    lambda x, i: x.at[i].add(1.0),
                    (_arr(rng, (3, 63), dt), rng.integers(0, 3, (4,)).astype(np.int32)),
                ),
            ],
        )
    )
    C.append(_custom("jnp.sort", _along(lambda x, a: jnp.sort(x, axis=a))))
    C.append(_custom("jnp.argsort", _along(lambda x, a: jnp.argsort(x, axis=a))))
    C.append(
        _custom("lax.top_k", _same_shape(lambda x: lax.top_k(x, 3), lambda x: lax.top_k(x, 5)))
    )
    C.append(
        _custom(
            "jnp.searchsorted",
            lambda rng, dt: [
                (
                    lambda s, v: jnp.searchsorted(s, v),
                    (np.sort(_arr(rng, (65,), dt)), _arr(rng, (5, 7), dt)),
                )
            ],
        )
    )

    # -- linear algebra
    mm_shapes = (((5, 65), (65, 33)), ((3, 63), (63, 100)), ((2, 3, 100), (2, 100, 17)))
    C.append(_custom("jnp.matmul", two(jnp.matmul, mm_shapes)))
    C.append(
        _custom("@ (broadcast)", two(jnp.matmul, (((2, 3, 100), (100, 17)), ((5, 65), (2, 65, 9)))))
    )
    C.append(
        _custom("jnp.dot", two(jnp.dot, (((5, 65), (65, 33)), ((63,), (63,)), ((3, 63), (63,)))))
    )
    C.append(
        _custom(
            "jnp.einsum(ij,jk)",
            two(lambda a, b: jnp.einsum("ij,jk->ik", a, b), (((5, 65), (65, 33)),)),
        )
    )
    C.append(
        _custom(
            "jnp.einsum(bij,bkj)",
            two(lambda a, b: jnp.einsum("bij,bkj->bik", a, b), (((2, 3, 100), (2, 17, 100)),)),
        )
    )
    C.append(
        _custom(
            "jnp.einsum(bhqd,bhkd)",
            two(
                lambda a, b: jnp.einsum("bhqd,bhkd->bhqk", a, b), (((2, 3, 5, 65), (2, 3, 7, 65)),)
            ),
        )
    )
    C.append(_custom("jnp.einsum(ij->j)", _same_shape(lambda x: jnp.einsum("ij->j", x))))
    C.append(
        _custom(
            "jnp.tensordot",
            two(
                lambda a, b: jnp.tensordot(a, b, axes=1),
                (((5, 65), (65, 33)), ((2, 3, 100), (100, 7))),
            ),
        )
    )
    C.append(
        _custom(
            "jnp.tensordot(2)",
            two(lambda a, b: jnp.tensordot(a, b, axes=2), (((2, 3, 100), (3, 100, 7)),)),
        )
    )
    C.append(_custom("jnp.outer", two(jnp.outer, (((65,), (33,)), ((5,), (100,))))))
    C.append(_custom("jnp.inner", two(jnp.inner, (((5, 65), (7, 65)),))))
    C.append(_custom("jnp.vdot", two(jnp.vdot, (((65,), (65,)),))))
    C.append(_custom("jnp.kron", two(jnp.kron, (((3, 5), (4, 7)),))))
    C.append(
        _custom(
            "lax.dot_general",
            two(
                lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))),
                (((2, 3, 100), (2, 100, 17)),),
            ),
        )
    )
    C.append(_custom("lax.batch_matmul", two(lax.batch_matmul, (((2, 3, 100), (2, 100, 17)),))))
    C.append(_custom("jnp.trace", _same_shape(jnp.trace, jnp.trace)))
    C.append(_custom("jnp.diagonal", _same_shape(jnp.diagonal, jnp.diagonal)))

    def spd(rng: np.random.Generator, dt: np.dtype) -> list[Sample]:
        a = _arr(rng, (7, 7), dt)
        m = (a @ a.T + 7 * np.eye(7)).astype(dt)
        return [
            (jnp.linalg.cholesky, (m,)),
            (jnp.linalg.inv, (m,)),
            (lambda m, b: jnp.linalg.solve(m, b), (m, _arr(rng, (7, 3), dt))),
        ]

    C.append(_custom("jnp.linalg (cholesky/inv/solve)", spd, dtypes=("float32",)))
    C.append(
        _custom(
            "jnp.fft.rfft", _same_shape(lambda x: jnp.abs(jnp.fft.rfft(x))), dtypes=("float32",)
        )
    )

    # -- nn
    for nm in ("relu", "relu6", "silu", "sigmoid", "softplus", "soft_sign", "elu", "celu", "selu"):
        C.append(U(f"jax.nn.{nm}", getattr(jax.nn, nm)))
    for nm in ("hard_tanh", "hard_sigmoid", "hard_swish", "log_sigmoid", "mish", "sparse_plus"):
        C.append(U(f"jax.nn.{nm}", getattr(jax.nn, nm)))
    C.append(U("jax.nn.gelu(tanh)", lambda x: jax.nn.gelu(x, approximate=True)))
    C.append(U("jax.nn.gelu(erf)", lambda x: jax.nn.gelu(x, approximate=False)))
    C.append(U("jax.nn.leaky_relu", lambda x: jax.nn.leaky_relu(x, 0.1)))
    C.append(
        _custom(
            "jax.nn.glu",
            _same_shape(lambda x: jax.nn.glu(x[:, :64]), lambda x: jax.nn.glu(x[:2], axis=0)),
        )
    )
    C.append(_custom("jax.nn.softmax", _along(lambda x, a: jax.nn.softmax(x, axis=a))))
    C.append(_custom("jax.nn.log_softmax", _along(lambda x, a: jax.nn.log_softmax(x, axis=a))))
    C.append(_custom("jax.nn.standardize", _along(lambda x, a: jax.nn.standardize(x, axis=a))))
    C.append(
        _custom(
            "jax.nn.one_hot",
            lambda rng, dt: [
                (
                    lambda i: jax.nn.one_hot(i, 10, dtype=dt),
                    (rng.integers(0, 10, (5, 7)).astype(np.int32),),
                ),
                (
                    lambda i: jax.nn.one_hot(i, 65, dtype=dt),
                    (rng.integers(0, 65, (9,)).astype(np.int32),),
                ),
            ],
        )
    )

    def layernorm(x: Any, w: Any, b: Any) -> Any:
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * lax.rsqrt(v + 1e-5) * w + b

    C.append(
        _custom(
            "layernorm",
            lambda rng, dt: [
                (layernorm, (_arr(rng, (5, 65), dt), _arr(rng, (65,), dt), _arr(rng, (65,), dt))),
                (
                    layernorm,
                    (_arr(rng, (2, 3, 100), dt), _arr(rng, (100,), dt), _arr(rng, (100,), dt)),
                ),
            ],
        )
    )
    C.append(
        _custom(
            "attention",
            lambda rng, dt: [
                (
                    lambda q, k, v: jax.nn.softmax(q @ k.swapaxes(-1, -2) / 8.0, axis=-1) @ v,
                    (
                        _arr(rng, (2, 5, 65), dt),
                        _arr(rng, (2, 7, 65), dt),
                        _arr(rng, (2, 7, 33), dt),
                    ),
                )
            ],
        )
    )
    C.append(
        _custom(
            "jax.nn.dot_product_attention",
            lambda rng, dt: [
                (
                    jax.nn.dot_product_attention,
                    (
                        _arr(rng, (2, 5, 3, 16), dt),
                        _arr(rng, (2, 7, 3, 16), dt),
                        _arr(rng, (2, 7, 3, 16), dt),
                    ),
                )
            ],
            dtypes=("float32",),  # XLA:CPU has no float16 dot_product_attention
        )
    )

    # -- lax structural ops
    C.append(
        _custom(
            "lax.select",
            _same_shape(
                lambda x: lax.select(x > 0, x, -x), lambda x: lax.select(x < 0.3, x * 3, x)
            ),
        )
    )
    C.append(
        _custom(
            "lax.dynamic_slice",
            lambda rng, dt: [
                (
                    lambda x, i: lax.dynamic_slice(x, (i, 0), (2, 17)),
                    (_arr(rng, (5, 65), dt), np.int32(2)),
                ),
                (
                    lambda x, i: lax.dynamic_slice(x, (0, i), (3, 10)),
                    (_arr(rng, (3, 63), dt), np.int32(40)),
                ),
            ],
        )
    )
    C.append(
        _custom(
            "lax.dynamic_update_slice",
            lambda rng, dt: [
                (
                    lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)),
                    (_arr(rng, (5, 65), dt), _arr(rng, (2, 65), dt), np.int32(1)),
                )
            ],
        )
    )
    C.append(
        _custom(
            "lax.slice",
            _same_shape(
                lambda x: lax.slice(x, (1, 3), (4, 60)),
                lambda x: lax.slice(x, (0, 0), (3, 63), (2, 3)),
            ),
        )
    )
    C.append(
        _custom(
            "lax.pad(interior)",
            _same_shape(lambda x: lax.pad(x, jnp.array(0, x.dtype), ((1, 1, 1), (0, 2, 0)))),
        )
    )
    C.append(
        _custom("lax.rev", _same_shape(lambda x: lax.rev(x, (0,)), lambda x: lax.rev(x, (1,))))
    )
    C.append(
        _custom(
            "lax.broadcast_in_dim",
            _same_shape(
                lambda x: lax.broadcast_in_dim(x, (4, 5, 65), (1, 2)),
                lambda x: lax.broadcast_in_dim(x[:, :1], (3, 63), (0, 1)),
            ),
        )
    )
    C.append(_custom("lax.reshape", _same_shape(lambda x: lax.reshape(x, (65, 5)))))
    C.append(_custom("lax.expand_dims", _same_shape(lambda x: lax.expand_dims(x, (0, 2)))))
    C.append(
        _custom(
            "lax.concatenate", two(lambda a, b: lax.concatenate([a, b], 1), (((5, 65), (5, 31)),))
        )
    )
    C.append(
        _custom(
            "lax.reduce_window(max)",
            _same_shape(
                lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3), (1, 2), "VALID"),
                lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3, 3), (1, 1), "SAME"),
            ),
        )
    )
    C.append(
        _custom(
            "lax.reduce_window(sum)",
            _same_shape(lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 4), (1, 4), "VALID")),
        )
    )
    C.append(
        _custom(
            "lax.conv_general_dilated",
            lambda rng, dt: [
                (
                    lambda x, w: lax.conv_general_dilated(x, w, (1,), "VALID"),
                    (_arr(rng, (2, 3, 100), dt), _arr(rng, (4, 3, 5), dt)),
                )
            ],
        )
    )
    C.append(_custom("lax.sort", _same_shape(lambda x: lax.sort(x, dimension=1))))
    C.append(
        _custom(
            "jnp.iota+arange",
            _same_shape(
                lambda x: x + jnp.arange(x.shape[-1], dtype=x.dtype),
                lambda x: x * lax.broadcasted_iota(x.dtype, x.shape, 0),
            ),
        )
    )

    # -- control flow
    C.append(
        _custom(
            "lax.cond",
            _same_shape(lambda x: lax.cond(x.sum() > 0, lambda v: v * 2, lambda v: -v, x)),
        )
    )
    C.append(
        _custom(
            "lax.fori_loop", _same_shape(lambda x: lax.fori_loop(0, 3, lambda i, v: v * 0.5 + 1, x))
        )
    )
    C.append(
        _custom(
            "lax.scan",
            _same_shape(lambda x: lax.scan(lambda c, r: (c + r, c * 2), jnp.zeros_like(x[0]), x)),
        )
    )
    C.append(
        _custom(
            "lax.while_loop",
            _same_shape(
                lambda x: lax.while_loop(
                    lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5), (0, x)
                )[1]
            ),
        )
    )
    C.append(_custom("jax.vmap", two(jax.vmap(lambda a, b: a @ b), (((4, 5, 65), (4, 65, 7)),))))
    C.append(_custom("jax.checkpoint", _same_shape(jax.checkpoint(lambda x: jnp.sin(x) * x))))
    C.append(_custom("jax.grad", _same_shape(jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2)))))
    return C


#: built on first use (see :func:`jax_cases`)
JAX_CASES: list[JaxCase] = []


def jax_cases() -> list[JaxCase]:
    """The JAX table (:data:`JAX_CASES`, filled on first call)."""
    if not JAX_CASES:
        JAX_CASES.extend(_build_jax_cases())
    return JAX_CASES


def _jax_close(got: Any, want: Any) -> str | None:
    import jax

    gl, gs = jax.tree_util.tree_flatten(got)
    wl, ws = jax.tree_util.tree_flatten(want)
    if len(gl) != len(wl):
        return f"{len(gl)} outputs, expected {len(wl)}"
    if gs != ws:
        return f"output structure {gs} != {ws}"
    for i, (g, w) in enumerate(zip(gl, wl, strict=True)):
        why = _close_np(np.asarray(g), np.asarray(w))
        if why is not None:
            return f"output {i}: {why}"
    return None


def coverage_jax(
    limit: int | None = None,
    *,
    names: Sequence[str] | None = None,
    seed: int = 0,
    sample_timeout_s: float | None = 120.0,
    time_limit_s: float | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The JAX table (:func:`jax_cases`) through ``spyre_jax.jit`` vs ``jax.jit`` on the CPU.

    ``limit``: the first ``limit`` entries only; ``names``: these entries only. One path,
    ``"jit"``. The result has the shape of :func:`coverage_torch`'s (``"frontend": "jax"``).
    """
    import jax

    import spyre_jax

    t0 = time.perf_counter()
    cases = jax_cases()
    if names is not None:
        want = set(names)
        cases = [c for c in cases if c.name in want]
    if limit is not None:
        cases = cases[:limit]
    book = _Book(["jit"])
    truncated = False
    config = {
        "cases": len(cases),
        "shapes": [list(s) for s in SHAPES],
        "tolerance": TOLERANCE,
        "sample_timeout_s": sample_timeout_s,
        "jax": jax.__version__,
    }

    def snapshot() -> dict[str, Any]:
        return book.result(
            "jax",
            paths={"jit": {"status": "ok", "available": True, "reason": ""}},
            elapsed_s=round(time.perf_counter() - t0, 1),
            truncated=truncated,
            config=config,
        )

    cpu = jax.devices("cpu")[0]
    for i, case in enumerate(cases):
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            truncated = True
            break
        book.op(case.name)
        for dt in case.dtypes:
            rng = np.random.default_rng([seed, i, case.dtypes.index(dt)])
            try:
                samples = case.samples(rng, np.dtype(dt))
            except Exception as e:
                book.add(case.name, "jit", "skipped", note=f"samples failed: {e!r}"[:160])
                continue
            for fn, args in samples:
                try:
                    with _time_guard(sample_timeout_s), jax.default_device(cpu):
                        want = jax.device_get(jax.jit(fn)(*args))
                except Exception as e:
                    book.add(
                        case.name, "jit", "skipped", note=f"jax.jit reference failed ({e!r})"[:160]
                    )
                    continue
                try:
                    with _time_guard(sample_timeout_s), warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out = spyre_jax.jit(fn)(*args)
                        got = jax.tree_util.tree_map(np.asarray, out)
                    why = _jax_close(got, want)
                except Exception as e:
                    status, key, note = _classify(e)
                    book.add(case.name, "jit", status, key, note)
                    continue
                if why is None:
                    book.add(case.name, "jit", "passed")
                else:
                    book.add(case.name, "jit", "wrong", note=why)
        if progress is not None:
            progress(snapshot())
    return snapshot()


# ---------------------------------------------------------------------------------------------
# printing and the command line


def format_table(result: dict[str, Any], *, top: int = 15, notes: bool = False) -> str:
    """A coverage result as a text table: one row per op (counts per path), the totals, and the
    ``top`` most common unsupported ops/primitives per path."""
    paths = list(result["totals"])
    short = {
        "passed": "pass",
        "wrong": "wrong",
        "unsupported": "unsup",
        "error": "err",
        "skipped": "skip",
    }
    width = max([len("op"), *(len(n) for n in result["ops"])]) + 2
    width = min(width, 48)
    cell = "".join(f"{short[s]:>6}" for s in STATUSES)
    head = f"{'op':<{width}}" + " | ".join(f"{p + ':':<8}{cell}" for p in paths)
    lines = [head, "-" * len(head)]
    for name, rec in result["ops"].items():
        row = " | ".join(f"{'':<8}" + "".join(f"{rec[p][s]:>6}" for s in STATUSES) for p in paths)
        lines.append(f"{name[: width - 1]:<{width}}{row}")
        if notes:
            for p in paths:
                for n in rec["notes"][p]:
                    lines.append(f"    [{p}] {n}")
    lines.append("")
    for p in paths:
        info = result.get("paths", {}).get(p, {})
        t = result["totals"][p]
        if info and not info.get("available", True):
            lines.append(f"{p}: unavailable ({info.get('reason', '')})")
            continue
        lines.append(
            f"{p}: ops passed {t['ops_passed']}/{t['ops_tried']} "
            f"(some samples passed: {t['ops_partly_passed']}), "
            f"samples passed {t['samples_passed']}/{t['samples_tried']}  ("
            + ", ".join(f"{s} {t[s]}" for s in STATUSES)
            + ")"
        )
    for p in paths:
        uns = list(result["unsupported"].get(p, {}).items())[:top]
        if uns:
            lines.append(f"most common unsupported ({p}): " + ", ".join(f"{k} {v}" for k, v in uns))
    if result.get("truncated"):
        lines.append("(truncated: the time limit stopped the run)")
    lines.append(f"elapsed {result.get('elapsed_s', 0)} s")
    return "\n".join(lines)


def main_coverage(argv: list[str]) -> int:
    """``spyre-jax coverage torch [--json] [--limit N] [--ops a,b] [--samples K]`` and
    ``spyre-jax coverage jax [--json] [--limit N]``: print the table, or one JSON object."""
    p = argparse.ArgumentParser(prog="spyre-jax coverage", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="frontend", required=True)
    pt = sub.add_parser("torch", help="PyTorch's OpInfo database (backend and spyre device)")
    pt.add_argument("--ops", default=None, help="comma-separated OpInfo names (default: all)")
    pt.add_argument("--samples", type=int, default=3, help="samples per dtype and op")
    pt.add_argument("--paths", default="backend,device", help="backend and/or device")
    pj = sub.add_parser("jax", help="our table of jax.numpy / jax.lax / jax.nn functions")
    for q in (pt, pj):
        q.add_argument("--json", action="store_true", help="print one JSON object")
        q.add_argument("--limit", type=int, default=None, help="at most N ops / entries")
        q.add_argument("--time-limit", type=float, default=None, help="stop after S seconds")
        q.add_argument("--notes", action="store_true", help="show why samples did not pass")
    args = p.parse_args(argv)
    if args.frontend == "torch":
        res = coverage_torch(
            ops=[o for o in args.ops.split(",") if o] if args.ops else None,
            limit_samples=args.samples,
            paths=tuple(x for x in args.paths.split(",") if x),
            limit=args.limit,
            time_limit_s=args.time_limit,
        )
    else:
        res = coverage_jax(limit=args.limit, time_limit_s=args.time_limit)
    if args.json:
        print(json.dumps(res))
    else:
        print(format_table(res, notes=args.notes))
    return 0
