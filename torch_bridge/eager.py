"""Eager compute ops on ``spyre`` tensors: one-op graphs through the compile path, cached.

An op on spyre tensors becomes a one-op FX graph built by hand (placeholders whose
``meta["val"]`` are fake tensors, one ``call_function`` node whose ``meta["val"]`` is the fake
result computed by torch's own fake kernels), imported by ``lowering.from_fx`` and loaded by
``torch_bridge.kernels.load``: the same lowering, kernel and launch as ``torch.compile``.
A node ``from_fx`` has no rule for is retried as the op's core-ATen decomposition
(``make_fx`` with ``core_aten_decompositions``) when every op of that has a rule.

Compiled kernels live in the one-op kernel cache below both frontends
(``lowering.loading.OP_KERNELS``), keyed by plain data (:func:`op_key`: the op's name, the
argument structure, each tensor's shape and dtype name, the static arguments, the card): the
same op on the same shapes never compiles twice (:func:`stats`, ``"compiles"``). This module
keeps the torch side: turning an ATen call into that key, and its plans (how a call's tensors
become the kernel's arguments), found by a cheap key of the call. Inputs are gathered from their
storage into the card's stick layout for the launch (a strided view is a re-layout step);
results become fresh storage (the launch's own output region where it fits). Python numbers in
tensor positions (``x + 2.5``) are rank-0 inputs, not compile-time constants, so ``x + 2.5`` and
``x + 3.5`` share one kernel; numbers in scalar positions (``alpha``, ``dim``, ``eps``, a
``pow`` exponent) are static and in the key.

In-place and ``out=`` variants run their functional op on the card and copy the result into
the written tensor. An op with no lowering rule (or one the card cannot run: float64, a
data-dependent shape, ...) runs on the CPU with a :class:`~torch_bridge.backend.
SpyreFallbackWarning` naming it, counted in :func:`fallback_counts`. Ops with no spyre inputs
(factories such as ``arange(..., device="spyre")``) are computed on the host and copied in,
uncounted as fallbacks (``"host_factories"``).
"""

from __future__ import annotations

import collections
import math
import sys
import threading
import warnings
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from device_model.launching import launch
from device_model.layout import layout_for, np_dtype
from device_model.memory import DeviceOOMError
from device_model.runtime import runtime
from lowering.from_fx import RULES, card_dtype, from_fx, supported
from lowering.loading import OP_KERNELS, OpKey

from . import buckets
from . import operands as ops
from . import storage as st
from .card_cat import reset_stats as reset_card_cats
from .card_cat import stats as card_cat_stats
from .card_cat import try_card_cat, without_skipped
from .errors import SpyreFallbackWarning
from .host_ops import run_on_host
from .kernels import load
from .one_op import NT_OPS, decomposed, is_nt, one_op_graph, same_results
from .registration import eligible, is_tensor_type
from .strides import key_strides
from .written import functional, functional_args, has_spyre_input, write_back, written_tensors

__all__ = ["register_kernels", "fallback", "stats", "fallback_counts", "reset_stats"]

aten = torch.ops.aten
_lock = threading.RLock()
_counts = {
    "compiles": 0,
    "launches": 0,
    "cache_hits": 0,
    "cpu_fallbacks": 0,
    "host_factories": 0,
    "padded_launches": 0,
    "padding_bytes": 0,
}
_fallbacks: collections.Counter[str] = collections.Counter()


def stats() -> dict[str, int]:
    """compiles (card kernels built), launches, cache_hits, cpu_fallbacks, host_factories, and
    the launches on a size bucket's kernel with the bytes of padding their operands carried
    (``padded_launches``, ``padding_bytes``: work the card does on padding), and the ``cat``
    calls that ran as a bucket's data movement (``card_cats``, :mod:`torch_bridge.card_cat`)."""
    with _lock:
        return dict(_counts, cache_entries=len(_plans), **card_cat_stats())


def count(name: str) -> None:
    """Add one to a counter of :func:`stats` (``host_factories``: a factory made on the host by
    a kernel of its own, e.g. ``arange``)."""
    with _lock:
        _counts[name] += 1


def fallback_counts() -> dict[str, int]:
    """ATen op -> eager calls of it that ran on the CPU."""
    with _lock:
        return dict(_fallbacks)


def reset_stats() -> None:
    with _lock:
        for k in _counts:
            _counts[k] = 0
        _fallbacks.clear()
    reset_card_cats()


# ---------------------------------------------------------------------------------------------
# which ops get a PrivateUse1 kernel of their own (torch_bridge.registration)


def register_kernels(lib: torch.library.Library) -> None:
    """A PrivateUse1 kernel for every functional op ``lowering.from_fx`` has a rule for."""
    for op in list(RULES):
        if eligible(op) and op.namespace == "aten":  # (our own ops: registered by their owners)
            lib.impl(op, _kernel_for(op), "PrivateUse1")


def _kernel_for(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _compute(op, args, kwargs)  # the device check is part of the signature

    kernel.__name__ = f"spyre_{op.name().replace('::', '_').replace('.', '_')}"
    return kernel


# ---------------------------------------------------------------------------------------------
# the boxed fallback: every other op on spyre tensors


def fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """PrivateUse1 fallback: views are metadata (CPU kernels), in-place and ``out=`` ops run
    their functional op on the card and copy into the written tensor, functional ops go to the
    card, and what the card cannot run goes to the CPU with a warning."""
    s = op._schema
    if s.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in s.returns):
        return op._handle.redispatch_boxed(st.CPU_KEYS, *args, **kwargs)
    st.check_same_device(tree_flatten((args, kwargs))[0])
    written = written_tensors(op, args, kwargs)
    if not has_spyre_input(op, args, kwargs):
        with _lock:
            _counts["host_factories"] += 1
        return _run_cpu(op, args, kwargs, reason=None)
    if not written:
        return _compute(op, args, kwargs)
    func = functional(op)
    if func is not None:
        fargs, fkwargs = functional_args(op, args, kwargs)
        res = _try_card(func, fargs, fkwargs)
        if res is not None:
            outs = list(res) if isinstance(res, tuple | list) else [res]
            if len(outs) == len(written):
                return write_back(op, written, outs)
        reason = _reason(func, fargs, fkwargs)
        if reason is None:  # nothing to compute (no elements)
            with _lock:
                _counts["host_factories"] += 1
    else:
        reason = "no functional form"
    return _run_cpu(op, args, kwargs, reason=reason, name=func)


# ---------------------------------------------------------------------------------------------
# plans: one per (op, signature)


class _Lift:
    """A Python number in a tensor position (a wrapped number): a rank-0 graph input. Equal to
    any other of its type: its value is an argument of the kernel, not part of its signature
    (nor of an op's family in :mod:`torch_bridge.buckets`)."""

    __slots__ = ("v",)

    def __init__(self, v: Any):
        self.v = v

    def __eq__(self, other: object) -> bool:
        return type(other) is _Lift and type(other.v) is type(self.v)

    def __hash__(self) -> int:
        return hash((_Lift, type(self.v)))


_LIFT_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float32}
_NP_OF = {torch.bool: np.bool_, torch.int64: np.int32, torch.float32: np.float32}


class _Plan:
    """How to run one op signature: the compiled graph (or why it runs on the CPU), the graph
    inputs (leaf index, kind, placeholder dtype), the results' fake tensors."""

    __slots__ = ("compiled", "inputs", "outs", "single", "reason", "host", "pad", "results")

    def __init__(self) -> None:
        self.compiled: Any = None
        #: (leaf index, kind: T spyre tensor / C cpu 0-dim tensor / S number, dtype, layout,
        #: NT: the kernel reads the tensor's transpose, its own bytes, and transposes it back)
        self.inputs: list[tuple[int, str, torch.dtype, Any, bool]] = []
        #: each result's (torch dtype, strides or None for contiguous)
        self.outs: list[tuple[torch.dtype, tuple[int, ...] | None]] = []
        self.single = True
        self.reason: str | None = None
        self.host = False  # runs on the host silently (no elements to compute)
        #: on a size bucket's kernel: (the padding, each result's own layout), else None
        self.pad: tuple[buckets.Padding, list[Any]] | None = None
        #: each result as torch sees it on the card (``storage.CardResult``; not on a bucket's
        #: kernel, whose results' sizes are the call's), made by the first launch
        self.results: list[st.CardResult] | None = None


_plans: dict[Any, _Plan] = {}
_lift_slots: dict[Any, tuple[frozenset, frozenset]] = {}


def _slots(op: Any) -> tuple[frozenset, frozenset]:
    r = _lift_slots.get(op)
    if r is None:
        args = op._schema.arguments
        r = (
            frozenset(i for i, a in enumerate(args) if not a.kwarg_only and is_tensor_type(a.type)),
            frozenset(a.name for a in args if is_tensor_type(a.type)),
        )
        _lift_slots[op] = r
    return r


def _is_number(v: Any) -> bool:
    return isinstance(v, bool | int | float) and not isinstance(v, torch.SymInt)


def _signature(op: Any, args: tuple, kwargs: dict) -> tuple[list, Any, tuple, tuple]:
    """(leaves, treespec, card key, strides of the spyre inputs)."""
    pos, names = _slots(op)
    if pos or names:
        args = tuple(_Lift(v) if i in pos and _is_number(v) else v for i, v in enumerate(args))
        kwargs = {k: _Lift(v) if k in names and _is_number(v) else v for k, v in kwargs.items()}
    leaves, spec = tree_flatten((args, kwargs))
    sig = []
    strides = []
    first = None
    for x in leaves:
        if isinstance(x, torch.Tensor):
            d = x.device
            if not (d.type == "cpu" and x.dim() == 0):
                if first is None:
                    first = d
                elif d != first:
                    st.check_same_device(leaves)  # raises torch's device-mismatch error
            if d.type == st.NAME:
                sig.append(("T", tuple(x.shape), x.dtype))
                strides.append(_strides(x))
            else:
                sig.append(("C", tuple(x.shape), x.dtype))
        elif isinstance(x, _Lift):
            sig.append(("S", type(x.v)))
        else:
            try:
                hash(x)
                sig.append(("V", type(x), x))
            except TypeError:
                sig.append(("R", type(x), repr(x)))
    key = (op, spec, tuple(sig), runtime())
    return leaves, spec, key, tuple(strides)


def op_key(key: tuple, nts: tuple[int, ...] = ()) -> OpKey:
    """The one-op kernel cache's key (``lowering.loading.OpKey``: plain data, no torch object)
    of a card key of :func:`_signature` (op, argument tree, argument signature, card) and the
    inputs the kernel reads transposed (``nts``)."""
    op, spec, sig, rt = key
    return OpKey(str(op), str(spec), tuple(_plain(e) for e in sig), rt, nts)


def _plain(e: tuple) -> tuple:
    """One argument's signature as plain data: dtypes by name, static values by their repr."""
    kind = e[0]
    if kind in ("T", "C"):
        return (kind, e[1], str(e[2]).removeprefix("torch."))
    if kind == "S":
        return (kind, e[1].__name__)
    return (kind, e[1].__name__, repr(e[2]) if kind == "V" else e[2])


def _plan_for(op: Any, args: tuple, kwargs: dict) -> tuple[_Plan, list]:
    leaves, spec, key, strides = _signature(op, args, kwargs)
    pkey = (key, strides)
    plan = _plans.get(pkey)
    if plan is not None:
        with _lock:
            _counts["cache_hits"] += 1
        return plan, leaves
    with _lock:
        plan = _plans.get(pkey)
        if plan is None:
            plan = _bucketed(op, leaves, spec, key, args, kwargs) or _build(op, leaves, spec, key)
            _plans[pkey] = plan
    return plan, leaves


def _bucketed(
    op: Any, leaves: list, spec: Any, key: Any, args: tuple, kwargs: dict
) -> _Plan | None:
    """The call on its size bucket's kernel (:mod:`torch_bridge.buckets`), or None: nothing
    varied, or an op whose results padding could change."""
    if not any(st.is_spyre(x) for x in leaves):
        return None
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        orig, _ = _fake_leaves(leaves, mode)
        a, k = tree_unflatten(orig, spec)
        with mode:
            out = op(*a, **k)
    except Exception:  # noqa: BLE001 - the exact path reports what is wrong with the call
        return None
    outs = list(out) if isinstance(out, tuple | list) else [out]
    stick = runtime().card.stick_bytes
    pad = buckets.plan_padding(op, spec, leaves, args, kwargs, outs, stick)
    earlier = buckets.seen_sizes(op, spec, leaves)
    if earlier:  # the op's exact plans go: its earlier sizes run on their buckets from now on
        for k in [k for k, p in _plans.items() if k[0][0] is op and p.pad is None]:
            del _plans[k]
        for k in [k for k in _fast if k[0] is op]:
            del _fast[k]
    for sizes in earlier:
        _compile_bucket_of(op, spec, leaves, sizes)
    if pad is None:
        return None
    sig = [(e[0], pad.shapes[i], e[2]) if e[0] in ("T", "C") else e for i, e in enumerate(key[2])]
    bkey = (key[0], key[1], tuple(sig), key[3])
    base = _plans.get(("bucket", bkey))
    if base is None:
        stand = [
            torch.empty(s, dtype=x.dtype, device=x.device) if s is not None else x
            for x, s in zip(leaves, pad.shapes, strict=True)
        ]
        base = _plans[("bucket", bkey)] = _build(op, stand, spec, bkey)
    if base.compiled is None:
        return None
    have = base.compiled.out_layouts
    if len(have) != len(pad.out_shapes) or any(
        len(h.shape) != len(w) or any(a < b for a, b in zip(h.shape, w, strict=True))
        for h, w in zip(have, pad.out_shapes, strict=True)
    ):
        return None
    plan = _Plan()
    plan.compiled, plan.inputs, plan.single = base.compiled, base.inputs, base.single
    # each result as torch makes it at the call's own sizes (the strides of a permuted input)
    plan.outs = [(o.dtype, st.dense_strides(o, tuple(o.shape))) for o in outs]
    lays = [layout_for(w, h.dtype, stick) for h, w in zip(have, pad.out_shapes, strict=True)]
    plan.pad = (pad, lays)
    return plan


def _compile_bucket_of(op: Any, spec: Any, leaves: list, sizes: list[list[int]]) -> None:
    """An earlier call of the family (``sizes``, :func:`buckets.seen_sizes`) on the bucket it
    now belongs to: that kernel compiled now, so a later call of a size in that bucket (a second
    prompt length) finds it. Speculative: where it cannot be built, the call that needs it
    builds it (or says why) then."""
    try:
        vals = [
            torch.empty(n, dtype=x.dtype, device=x.device)
            if isinstance(x, torch.Tensor)
            else x.v
            if type(x) is _Lift
            else x
            for x, n in zip(leaves, sizes, strict=True)
        ]
        a, k = tree_unflatten(vals, spec)
        leaves2, spec2, key2, _ = _signature(op, a, k)
        _bucketed(op, leaves2, spec2, key2, a, k)
    except Exception:  # noqa: BLE001, S110 - nothing of the user's call depends on it
        pass


def _fake_leaves(leaves: list, mode: Any) -> tuple[list, list]:
    """(fakes with the call's own values, for the result's meta; placeholder fakes)."""
    orig, ph = [], []
    with mode:
        for x in leaves:
            if isinstance(x, torch.Tensor):
                f = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype)
                orig.append(f)
                pdt = torch.float32 if x.dtype == torch.float64 and x.dim() == 0 else x.dtype
                ph.append(f if pdt == x.dtype else torch.empty((), dtype=pdt))
            elif isinstance(x, _Lift):
                orig.append(x.v)
                ph.append(torch.empty((), dtype=_LIFT_DTYPE[type(x.v)]))
            else:
                orig.append(x)
                ph.append(None)
    return orig, ph


def _build(op: Any, leaves: list, spec: Any, key: Any) -> _Plan:
    """Trace, import and compile the op for this signature (or say why it cannot be)."""
    plan = _Plan()
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)  # decompositions make constants
        orig, ph = _fake_leaves(leaves, mode)
        a, k = tree_unflatten(orig, spec)
        with mode:
            out = op(*a, **k)
        outs = list(out) if isinstance(out, tuple | list) else [out]
        if not all(isinstance(o, torch.Tensor) for o in outs):
            plan.reason = "a result that is not a tensor"
            return plan
        plan.single = not isinstance(out, tuple | list)
        plan.outs = [(o.dtype, st.dense_strides(o, tuple(o.shape))) for o in outs]
        spyre_in = [x for x in leaves if st.is_spyre(x)]
        if any(x.numel() == 0 for x in spyre_in) or any(o.numel() == 0 for o in outs):
            plan.host = True
            plan.reason = "no elements"
            return plan
        stick = runtime().card.stick_bytes
        inputs = []
        for i, (x, p) in enumerate(zip(leaves, ph, strict=True)):
            if p is None:
                continue
            if st.is_spyre(x):
                nt = op in NT_OPS and is_nt(x)
                shape = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if nt else tuple(x.shape)
                lay = layout_for(shape, card_dtype(x.dtype, "an input"), stick)
                inputs.append((i, "T", x.dtype, lay, nt))
            else:
                kind = "C" if isinstance(x, torch.Tensor) else "S"
                inputs.append((i, kind, p.dtype, None, False))
        plan.inputs = inputs
        nts = tuple(i for i, *_, nt in inputs if nt)
        gm = one_op_graph(op, spec, leaves, ph, out, outs, nts, mode)
        okey = op_key(key, nts)
        compiled = OP_KERNELS.get(okey)  # another stride pattern may have compiled it
        if compiled is None:
            compiled = _compile(op, gm, spec, orig, inputs)
            OP_KERNELS.put(okey, compiled)
        plan.compiled = compiled
    except DeviceOOMError:
        raise
    except Exception as e:  # no rule, a dtype the card lacks, a data-dependent shape, ...
        plan.compiled = None
        plan.reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return plan


def _compile(op: Any, gm: torch.fx.GraphModule, spec: Any, orig: list, inputs: list) -> Any:
    """``from_fx`` + ``compile_graph`` for the one-op graph, or for the op's core-ATen
    decomposition when the op itself has no rule (only without lifted numbers)."""
    name = "eager_" + op.name().replace("::", "_").replace(".", "_")
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    if not supported(node):
        if any(kind != "T" or nt for _, kind, _, _, nt in inputs):
            raise NotImplementedError(f"no lowering rule for {op}")
        gm = decomposed(op, spec, orig, inputs)
        if not same_results(gm, node.meta["val"]):
            raise NotImplementedError(f"no lowering rule for {op} (its decomposition differs)")
        bad = [n for n in gm.graph.nodes if not supported(n)]
        if bad:
            raise NotImplementedError(
                f"no lowering rule for {op} (nor for {bad[0].target} in its decomposition)"
            )
    graph = from_fx(gm, name=name)
    compiled = load(graph)
    with _lock:
        _counts["compiles"] += 1
    return compiled


# ---------------------------------------------------------------------------------------------
# running


def _try_card(op: Any, args: tuple, kwargs: dict) -> Any:
    """The op's results as spyre tensors, computed on the card; None if it runs on the CPU."""
    plan, leaves, hit = _cached_plan(op, args, kwargs)
    if plan.compiled is None:
        return None
    return _run_plan(plan, leaves, hit)


def _reason(op: Any, args: tuple, kwargs: dict) -> str | None:
    plan, _ = _plan_for(op, args, kwargs)
    return None if plan.host else plan.reason


#: plans by the fast key (:func:`_fast_key`): at most this many, then the cache starts over
FAST_PLANS = 4096
_fast: dict[Any, _Plan] = {}


_strides = key_strides


def _fast_key(op: Any, args: tuple) -> tuple[Any, list] | None:
    """A cheap key for the common call (positional tensors, numbers, lists of them, None): the
    op, each tensor's device, shape, strides and dtype, each number's type and value, the card;
    with the call's leaves. None for anything else (the general path keys it)."""
    key: list[Any] = [op, runtime()]
    leaves: list[Any] = []
    for a in args:
        ta = type(a)
        if ta is torch.Tensor or isinstance(a, torch.Tensor):
            key.append((a.device, a.shape, _strides(a), a.dtype))
            leaves.append(a)
        elif ta is int or ta is float or ta is bool:
            key.append((ta, a))
            leaves.append(a)
        elif a is None:
            key.append(None)
            leaves.append(a)
        elif ta is list or ta is tuple:
            sub: list[Any] = [ta, len(a)]
            for x in a:
                tx = type(x)
                if tx is torch.Tensor or isinstance(x, torch.Tensor):
                    sub.append((x.device, x.shape, _strides(x), x.dtype))
                elif tx is int or tx is bool:
                    sub.append((tx, x))
                else:
                    return None
                leaves.append(x)
            key.append(tuple(sub))
        else:
            return None
    return tuple(key), leaves


def _cached_plan(op: Any, args: tuple, kwargs: dict) -> tuple[_Plan, list, bool]:
    """:func:`_plan_for` through the fast key where the call has one (a card plan found by it
    skips the general signature); and whether the fast key found it (a ``cache_hits``, which
    :func:`_run_plan` counts with the launch)."""
    fast = None if kwargs else _fast_key(op, args)
    if fast is not None:
        plan = _fast.get(fast[0])
        if plan is not None:
            return plan, fast[1], True
    plan, leaves = _plan_for(op, args, kwargs)
    if plan.compiled is not None and fast is not None:
        if len(_fast) >= FAST_PLANS:
            _fast.clear()
        _fast[fast[0]] = plan
    return plan, leaves, False


#: ``cat``, which runs on a size bucket as a data movement once its sizes vary (card_cat)
_CAT = aten.cat.default


def _compute(op: Any, args: tuple, kwargs: dict) -> Any:
    if op is _CAT:  # sizes that keep changing: a bucket's data movement, no kernel per size
        res = try_card_cat(args, kwargs)
        if res is not None:
            return res
        kept = without_skipped(args, kwargs)
        if kept is not None:  # (an empty input torch skips: on the card without it)
            if len(kept[0]) > 1:
                return _compute(op, kept, {})
            out = st.new_tensor(kept[0][0].shape, kept[0][0].dtype)
            if st.copy_on_card(out, kept[0][0]):  # a whole result: moved, no kernel
                return out
            del out  # (else the host copies it, below: no kernel for the prompt's length)
    plan, leaves, hit = _cached_plan(op, args, kwargs)
    if plan.compiled is not None:
        return _run_plan(plan, leaves, hit)
    if plan.host:
        with _lock:
            _counts["host_factories"] += 1
        return _run_cpu(op, args, kwargs, reason=None)
    return _run_cpu(op, args, kwargs, reason=plan.reason)


def _run_plan(plan: _Plan, leaves: list, hit: bool = False) -> Any:
    """Launch the plan's kernel (``device_model.launching.launch``) with the call's leaves as
    its arguments; its results as spyre tensors. The common call first: no size bucket, each
    tensor read in its own bytes (a weight, the result of the op before); else
    :func:`_run_gathered`. ``hit``: the plan was found by the fast key (counted here)."""
    if plan.pad is not None:
        return _run_gathered(plan, leaves, hit)
    operands: list[Any] = []
    for i, kind, pdt, lay, nt in plan.inputs:
        x = leaves[i]
        if kind == "T":
            b = ops.own_bytes(x.transpose(-1, -2) if nt else x, lay)
            if b is None:  # gathered: by the kernel, or on the host
                return _run_gathered(plan, leaves, hit)
            operands.append(b)
        else:
            operands.append(_host_operand(x, kind, pdt))
    bufs = launch(plan.compiled, operands, defer=True)
    with _lock:
        _counts["launches"] += 1
        _counts["cache_hits"] += hit
    return _as_tensors(plan, bufs)


def _host_operand(x: Any, kind: str, pdt: torch.dtype) -> np.ndarray:
    """A CPU 0-dim tensor (``C``) or a number (``S``: lifted on the general path, as the call
    gave it on the fast path) as the host value the launch copies in."""
    if kind == "C":
        return st.to_host(x.to(pdt) if x.dtype != pdt else x)
    return np.asarray(x.v if type(x) is _Lift else x, dtype=_NP_OF[pdt])


def _as_tensors(plan: _Plan, bufs: list) -> Any:
    """The launch's results (not on a size bucket) as spyre tensors, pending on the card."""
    results = plan.results
    if results is None:
        results = plan.results = [
            st.card_result(b.layout, dt, sd, b.layout.shape)
            for b, (dt, sd) in zip(bufs, plan.outs, strict=True)
        ]
    if plan.single:
        return st.from_card(bufs[0], *plan.outs[0], None, results[0])
    res = zip(bufs, plan.outs, results, strict=True)
    return tuple(st.from_card(b, dt, sd, None, r) for b, (dt, sd), r in res)


def _run_gathered(plan: _Plan, leaves: list, hit: bool = False) -> Any:
    """:func:`_run_plan` with operands gathered (by the kernel, fused into its program, or on
    the host) or padded to a size bucket."""
    operands: list[Any] = []
    temps = []
    pad = plan.pad
    padding = 0
    geometries: list[Any] = []
    try:
        for i, kind, pdt, lay, nt in plan.inputs:
            x = leaves[i]
            g = None
            if nt:  # its own bytes: the kernel transposes it
                x = x.transpose(-1, -2)
            if kind == "T":
                # on a bucket's kernel: gathered into the bucket's size, the rest filled
                b, g = ops.card_operand(x, lay, pad[0].fills[i] if pad else 0)
                if pad:
                    padding += (math.prod(lay.shape) - x.numel()) * np_dtype(lay.dtype).itemsize
                temps.append(b)
                operands.append(b)
            else:
                operands.append(_host_operand(x, kind, pdt))
            geometries.append(g)
        exe = plan.compiled
        if any(g is not None for g in geometries):
            exe = _fused(plan, tuple(geometries))
        bufs = launch(exe, operands, defer=True)
    finally:
        for b in temps:
            b.delete()
    with _lock:
        _counts["launches"] += 1
        _counts["cache_hits"] += hit
        if pad is not None:
            _counts["padded_launches"] += 1
            _counts["padding_bytes"] += padding
    if pad is None:
        return _as_tensors(plan, bufs)
    # computed at the bucket's sizes: each result keeps them, its own size the tensor's (the
    # host crops it when it reads it, the next kernel masks the rest)
    res = [
        st.from_card(b, dt, sd, lay.shape)
        for b, (dt, sd), lay in zip(bufs, plan.outs, pad[1], strict=True)
    ]
    return res[0] if plan.single else tuple(res)


def _fused(plan: _Plan, geometries: tuple) -> Any:
    """The plan's executable with the gathers of its strided, offset, re-typed or padded
    operands folded into its program (:func:`torch_bridge.relayout.fused`): one dispatch per
    launch, cached on the executable by the operands' geometries, which hold no sizes (every
    call of a size bucket's kernel shares them). A kernel run stage by stage takes its
    operands gathered one by one."""
    fused = plan.compiled.variants
    exe = fused.get(geometries)
    if exe is None:
        runner = plan.compiled.runner()
        if not hasattr(runner, "lower"):  # staged: not one program
            exe = plan.compiled.with_runner(_gathering(runner, geometries))
        else:
            exe = plan.compiled.with_runner(ops.relayout_module().fused(runner, geometries))
        with _lock:
            if len(fused) >= FUSED_PER_PLAN:
                fused.clear()
            fused[geometries] = exe
    return exe


#: fused programs kept per executable (one per combination of operand geometries seen)
FUSED_PER_PLAN = 64


def _gathering(runner: Any, geometries: tuple) -> Any:
    gather = ops.relayout_module().gather_view

    def run(*args: Any) -> Any:
        ins = [a if g is None else gather(*a, g) for g, a in zip(geometries, args, strict=False)]
        return runner(*ins, *args[len(geometries) :])

    return run


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside torch and torch_bridge (the user's line)."""
    f = sys._getframe(1)
    level = 1
    while f is not None:
        fn = f.f_code.co_filename
        if "/torch/" not in fn and "/torch_bridge/" not in fn and not fn.startswith("<"):
            return level
        f = f.f_back
        level += 1
    return 2


def _run_cpu(op: Any, args: tuple, kwargs: dict, *, reason: str | None, name: Any = None) -> Any:
    """Run ``op`` on the CPU over the spyre tensors' bytes (:func:`torch_bridge.host_ops.
    run_on_host`). With a ``reason``, warn (naming the op, or ``name``: the functional op of an
    in-place/out= one) and count it as a fallback."""
    if reason is not None:
        what = str(name or op)
        warnings.warn(
            f"spyre: ATen op {what} has no card kernel here; it runs on the CPU ({reason})",
            SpyreFallbackWarning,
            stacklevel=_user_stacklevel(),
        )
        with _lock:
            _counts["cpu_fallbacks"] += 1
            _fallbacks[what] += 1
    return run_on_host(op, args, kwargs)
