"""``spyre-jax coverage torch``: PyTorch's OpInfo samples through the card, beside eager CPU.

:func:`coverage_torch` runs PyTorch's own OpInfo database
(``torch.testing._internal.common_methods_invocations.op_db``) and its sample inputs through two
paths and compares them with eager CPU:

- ``backend``: ``torch.compile(fn, backend="spyre", options={"strict": True}, dynamic=False,
  fullgraph=True)`` under ``torch.no_grad()``, with a fresh Dynamo cache per sample (past its
  recompile limit Dynamo would silently run a frame eagerly). ``fullgraph`` makes a graph break an
  error instead of a silent CPU run of part of the op; a sample for which the backend never
  received a graph is skipped (nothing ran on the card).
- ``device``: the sample's tensors moved to the ``spyre`` device (``torch_bridge.device``) and the
  op called eagerly. An op that runs on the CPU with a ``SpyreFallbackWarning`` is *unsupported*
  (it gives the right answer, but not from the card). When the device cannot be made the path is
  ``"unavailable"`` and skipped.

Outcomes are classified as :mod:`spyre_jax.tools.coverage_common` says. Running the backend
path resets ``torch_bridge.backend``'s figures (``reset_fallback_stats()``) around every sample,
so the card kernels it made do not pile up in ``compiled_kernels()``; after a run,
``compile_stats()`` and ``fallback_stats()`` start from zero.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import time
import types
import unittest
import warnings
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch._dynamo
from torch.utils._pytree import tree_flatten, tree_map

from torch_bridge import backend as tb
from torch_bridge import device as spyre_device

from .coverage_common import (
    MAX_ELEMENTS,
    TOLERANCE,
    Book,
    PipeBook,
    classify,
    close_np,
    first_line,
    run_isolated,
    time_guard,
)

__all__ = ["NONDETERMINISTIC", "RANDOM_OPS", "coverage_torch", "worker_main"]

#: OpInfo names containing one of these give uninitialized memory: skipped
NONDETERMINISTIC = ("empty",)
#: OpInfo ops that draw random numbers: checked statistically (:func:`_statistical`) against
#: :data:`REFERENCE_DRAWS` draws of the same sample on the CPU
RANDOM_OPS = frozenset(
    {
        "bernoulli",
        "log_normal",
        "multinomial",
        "normal",
        "normal.in_place",
        "normal.number_mean",
        "uniform",
        "randn",
        "randn_like",
        "rand_like",
        "randint",
        "randint_like",
        "nn.functional.dropout",
        "nn.functional.dropout2d",
        "nn.functional.dropout3d",
        "nn.functional.alpha_dropout",
        "nn.functional.feature_alpha_dropout.with_train",
    }
)
REFERENCE_DRAWS = 8
#: random ops whose values are not independent (whole channels dropped): each value is checked
#: to be one a CPU draw has at its position, not the pooled distribution
CORRELATED = frozenset(
    {
        "nn.functional.dropout2d",
        "nn.functional.dropout3d",
        "nn.functional.feature_alpha_dropout.with_train",
    }
)
#: a random op's output fails its statistical check below this p-value
STAT_ALPHA = 1e-4

PATHS = ("backend", "device")


def _import_op_db() -> list[Any]:
    """PyTorch's OpInfo list. ``torch.testing._internal`` imports ``expecttest``, a test-only
    package torch does not depend on; a stand-in is installed when it is missing (the OpInfo
    tables use none of it)."""
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401  (optional: a test-only package)
        except ImportError:
            stub = types.ModuleType("expecttest")
            stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
            stub.ACCEPT = False  # type: ignore[attr-defined]
            sys.modules["expecttest"] = stub
    from torch.testing._internal.common_methods_invocations import op_db  # needs the stand-in

    for op in op_db:  # random ops draw anew each call (OpInfo reseeds with 42 around each)
        g = getattr(op.op, "__globals__", {})
        if _op_name(op) in RANDOM_OPS and "wrapper_set_seed" in g:
            g["wrapper_set_seed"] = _unseeded
    return list(op_db)


def _unseeded(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """OpInfo's ``wrapper_set_seed`` without its reseeding: the statistical check needs
    independent draws, and Dynamo cannot trace ``torch.manual_seed``."""
    return op(*args, **kwargs)


def _op_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _device_status() -> tuple[bool, str]:
    """Whether spyre tensors can be made (and read back), and why not."""
    try:
        t = torch.zeros(3, device=spyre_device.NAME)
        if t.device.type != "spyre":
            return False, f"tensors land on {t.device}, not spyre"
        if t.cpu().tolist() != [0.0, 0.0, 0.0]:
            return False, "a zeros tensor read back wrong"
        return True, ""
    except Exception as e:  # never crash: the device is another layer's work
        return False, f"{type(e).__name__}: {first_line(e)}"


# ---------------------------------------------------------------------------------------------
# comparing torch outputs


def _torch_leaves(x: Any) -> list[Any]:
    return tree_flatten(x)[0]


def _numel(sample: Any) -> int:
    leaves = _torch_leaves((sample.input, sample.args, sample.kwargs))
    return sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))


def _clone(x: Any) -> Any:
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v), x)


def _same_torch(a: Any, b: Any) -> bool:
    """Exact equality of two eager outputs (NaN equal to NaN)."""
    la, lb = _torch_leaves(a), _torch_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or x.layout != y.layout:
                return False
            x, y = _comparable(x), _comparable(y)
            if x.is_floating_point():
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


def _comparable(t: torch.Tensor) -> torch.Tensor:
    """A tensor torch's comparisons take: a sparse one dense, a complex one as its real and
    imaginary parts (``nan_to_num`` has no ComplexHalf kernel, ``equal`` no sparse one)."""
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj().to(torch.complex64))
    return t


def _to_np(t: Any) -> np.ndarray:
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
    gl, wl = _torch_leaves(got), _torch_leaves(want)
    if len(gl) != len(wl):
        return f"{len(gl)} outputs, expected {len(wl)}"
    for i, (g, w) in enumerate(zip(gl, wl, strict=True)):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"output {i} is {type(g).__name__}, expected a tensor"
            why = close_np(_to_np(g), _to_np(w), "bfloat16" if w.dtype == torch.bfloat16 else None)
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


#: ops whose indices of equal values are unspecified unless ``stable=True``: the position of
#: ``dim`` among their arguments (``None``: ``dim`` is not positional)
_TIE_ORDER_FREE = {"sort": 0, "argsort": 0, "msort": None, "topk": 1, "kthvalue": 1}


def _ties_only(op: Any, sample: Any, got: Any, want: Any) -> bool:
    """Whether ``got`` differs from ``want`` only in the order of equal elements, for a sort
    whose order of ties torch leaves open (``stable=False``: the CPU's unstable sort puts ties in
    an order of its own, the card's sort keeps them in index order). Every value output must
    match, and the input read at each index output must equal it read at the reference's."""
    pos = _TIE_ORDER_FREE.get(op.name)
    if op.name not in _TIE_ORDER_FREE or sample.kwargs.get("stable"):
        return False
    x, args = sample.input, sample.args
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return False
    dim = sample.kwargs.get("dim", args[pos] if pos is not None and len(args) > pos else -1)
    dim = dim if dim >= 0 else dim + x.ndim
    gl, wl = _torch_leaves(got), _torch_leaves(want)
    if len(gl) != len(wl):
        return False
    for g, w in zip(gl, wl, strict=True):
        if not isinstance(g, torch.Tensor) or not isinstance(w, torch.Tensor):
            return False
        if w.dtype != torch.int64:
            if _torch_close(g, w) is not None:
                return False
            continue
        if g.shape != w.shape:
            return False
        gi, wi = (t if t.ndim == x.ndim else t.unsqueeze(dim) for t in (g, w))
        a, b = x.gather(dim, gi), x.gather(dim, wi)
        if not bool(((a == b) | (a.isnan() & b.isnan())).all()):
            return False
    return True


def _statistical(got: Any, draws: list[Any], correlated: bool = False) -> str | None:
    """None when a random op's output ``got`` could be a draw of the distribution that the
    CPU's ``draws`` of the same sample come from, else why not: each output's dtype and shape
    must match, its values pass a two-sample test against the draws pooled (chi-square of the
    counts for at most 32 distinct values, Kolmogorov-Smirnov otherwise) at :data:`STAT_ALPHA`,
    and NaNs appear in both or neither. Under 8 values, only the range is checked (within the
    draws' range widened by its width on each side; there are 256 draws then). ``correlated``
    (channel dropout): each value must be one some draw has at its position."""
    import scipy.stats

    gl = _torch_leaves(got)
    pools = [_torch_leaves(d) for d in draws]
    if any(len(p) != len(gl) for p in pools):
        return f"{len(gl)} outputs, expected {len(pools[0])}"
    for i, g in enumerate(gl):
        ws = [p[i] for p in pools]
        if not isinstance(ws[0], torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != ws[0].shape or g.dtype != ws[0].dtype:
            return f"output {i}: {getattr(g, 'dtype', type(g))}, expected {ws[0].dtype}"
        if correlated:  # whole channels kept or dropped: each value one that a draw has there
            tol = 1e-2 if g.dtype in (torch.float16, torch.bfloat16) else 1e-4
            dist = [(g.double() - w.double()).abs() <= tol * (1 + w.double().abs()) for w in ws]
            near = torch.stack(dist).any(0)
            if not bool(near.all()):
                return f"output {i}: a value no CPU draw has at its position"
            continue
        a = g.detach().double().flatten().numpy()
        b = torch.cat([w.detach().double().flatten() for w in ws]).numpy()
        if not a.size:
            continue
        if np.isnan(a).any() != np.isnan(b).any():
            return f"output {i}: NaNs in {'ours' if np.isnan(a).any() else 'the CPU draws'} only"
        a, b = a[~np.isnan(a)], b[~np.isnan(b)]
        if a.size < 8 or not b.size:
            lo, hi = (b.min(), b.max()) if b.size else (0.0, 0.0)
            if a.size and (a.min() < lo - (hi - lo) or a.max() > hi + (hi - lo)):
                return f"output {i}: values outside the CPU draws' range [{lo}, {hi}]"
            continue
        values = np.union1d(a, b)
        if values.size <= 32:
            if values.size == 1:
                continue
            table = np.array([[np.sum(a == v) for v in values], [np.sum(b == v) for v in values]])
            p = scipy.stats.chi2_contingency(table).pvalue
        else:
            p = scipy.stats.ks_2samp(a, b).pvalue
        if p < STAT_ALPHA:
            return f"output {i}: not the CPU's distribution (p = {p:.1e})"
    return None


# ---------------------------------------------------------------------------------------------
# the two paths


def _sample_dtypes(op: Any) -> list[Any]:
    """float32 (and float16 where the op supports it on the CPU); integer or bool for ops with
    no float32."""
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

    def fn(inp: Any, *args: Any, **kwargs: Any) -> Any:
        return op.op(inp, *args, **kwargs)

    torch._dynamo.reset()
    inp, args, kwargs = _clone((sample.input, sample.args, sample.kwargs))
    tb.reset_fallback_stats()
    try:
        compiled = torch.compile(
            fn, backend="spyre", options={"strict": True}, dynamic=False, fullgraph=True
        )
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = compiled(inp, *args, **kwargs)
        reached = tb.compile_stats()["graphs"] > 0
    finally:
        tb.reset_fallback_stats()  # drops this sample's card kernels
    return out, reached


_FALLBACK_OP = re.compile(r"ATen op (\S+)")


#: OpInfo name -> positions of its arguments that torch takes on the CPU only (as on CUDA):
#: they stay there when the sample's other tensors move to spyre
HOST_ARGS: dict[str, tuple[int, ...]] = {"tensor_split": (0,)}


def _run_device(op: Any, sample: Any) -> tuple[Any, list[str]]:
    """The sample with its tensors on ``spyre``, eagerly: (output on the CPU, the ATen ops that
    fell back to the CPU)."""

    def put(v: Any) -> Any:
        return v.to(spyre_device.NAME) if isinstance(v, torch.Tensor) else copy.copy(v)

    def get(v: Any) -> Any:
        return v.cpu() if isinstance(v, torch.Tensor) and v.device.type != "cpu" else v

    inp, args, kwargs = tree_map(put, (sample.input, sample.args, sample.kwargs))
    host = HOST_ARGS.get(op.name, ())
    args = tuple(sample.args[i] if i in host else a for i, a in enumerate(args))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tree_map(get, op.op(inp, *args, **kwargs))
    fell = []
    for w in caught:
        if issubclass(w.category, tb.SpyreFallbackWarning):
            m = _FALLBACK_OP.search(str(w.message))
            fell.append(m.group(1) if m else "?")
    return out, sorted(set(fell))


def _torch_sample(
    book: Book, name: str, op: Any, sample: Any, paths: Sequence[str], timeout: float | None
) -> None:
    """Run one sample through every path and book its status."""
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
        with time_guard(timeout), torch.no_grad(), warnings.catch_warnings():
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
    random = _op_name(op) in RANDOM_OPS
    if mutated and not random:  # (a random fill is in place: its result is what is checked)
        book.add_all(name, "skipped", "in-place (mutates its inputs)")
        return
    if not any(isinstance(t, torch.Tensor) for t in _torch_leaves(want)):
        book.add_all(name, "skipped", "non-tensor output")
        return
    draws = [want, again]
    if random:
        try:
            with time_guard(timeout), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                small = sum(t.numel() for t in _torch_leaves(want) if isinstance(t, torch.Tensor))
                # a few values, or values checked one by one: many draws, so that they hold
                # what a draw can be
                many = small < 8 or _op_name(op) in CORRELATED  # (each value needs its draw)
                for _ in range((256 if many else REFERENCE_DRAWS) - 2):
                    inp, args, kwargs = _clone(orig)
                    draws.append(op.op(inp, *args, **kwargs))
        except Exception as e:
            book.add_all(name, "skipped", f"eager reference failed ({type(e).__name__})")
            return
    elif not _same_torch(want, again):
        book.add_all(name, "skipped", "non-deterministic output")
        return
    for path in paths:
        book.at(name, path)
        try:
            with time_guard(timeout):
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
            corr = _op_name(op) in CORRELATED
            why = _statistical(got, draws, corr) if random else _torch_close(got, want)
            if why is not None and not random and _ties_only(op, sample, got, want):
                why = None
        except Exception as e:
            status, key, note = classify(e)
            book.add(name, path, status, key, note)
            continue
        if why is None:
            book.add(name, path, "passed")
        else:
            book.add(name, path, "wrong", note=why)


def _torch_op(
    book: Book,
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
        book.add_all(name, "skipped", "uninitialized memory")
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
            with time_guard(timeout), warnings.catch_warnings():
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
                book.add_all(name, "error", f"{type(e).__name__}: {first_line(e)}")


# ---------------------------------------------------------------------------------------------
# a worker process (see coverage_common.run_isolated)


def worker_main(job: str) -> None:
    """A worker process's entry point (``python -c``): ``job`` is the JSON of
    ``[fd, names, paths, run_paths, limit_samples, timeout]``; bookings go to pipe ``fd``."""
    fd, names, paths, run_paths, limit_samples, timeout = json.loads(job)
    conn = Connection(fd, readable=False)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    by_name = {_op_name(o): o for o in _import_op_db()}
    if "device" in run_paths:
        _device_status()
    book = PipeBook(paths, conn)
    for name in names:
        _torch_op(book, by_name[name], paths, run_paths, limit_samples, timeout)
        conn.send(("done", name))
        torch._dynamo.reset()
    conn.send(("end",))
    conn.close()


# ---------------------------------------------------------------------------------------------
# the run


def coverage_torch(
    ops: Sequence[str] | None = None,
    limit_samples: int = 3,
    paths: Sequence[str] = PATHS,
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
    t0 = time.perf_counter()
    paths = list(paths)
    unknown = set(paths) - set(PATHS)
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
    book = Book(paths)
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
        job = [paths, run_paths, limit_samples, sample_timeout_s]
        truncated = not run_isolated(
            book, __name__, names, run_paths, job, sample_timeout_s, deadline, on_done
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
