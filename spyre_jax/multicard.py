"""Tensor parallelism over several simulated cards: ``jax.shard_map`` under ``spyre_jax.jit``.

A function written as one ``jax.shard_map`` over a ``Mesh`` of :func:`spyre_jax.devices` (N
cards when ``SPYRE_NUM_CARDS=N``) compiles into one schedule per card (SPMD: every card runs the
same program on its shard). The shard_map body is cut at its collectives: the runs of other
equations between them are compiled as card kernels (the usual graph IR and tiled schedule),
and each collective (``psum``, ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``,
``all_to_all``, ``ppermute``) is a transfer on the card-to-card link.

Running it, the N cards' simulations run under JAX's own distributed machinery: one
``jax.shard_map`` over N JAX devices when the process has them (host devices via
``XLA_FLAGS=--xla_force_host_platform_device_count=N``, GPUs, or the hosts of
``jax.distributed``), else one ``jax.vmap`` over the cards with the mesh's axis names, on one
device. The collectives between the kernels are JAX's ``lax`` collectives over those axes: the
simulation computes exactly what the cards exchange.

Timing: each card has a compute pipeline (its kernels, one after another, each taking its
schedule's simulated time) and a link (its collectives, ring algorithms over
:attr:`~device_model.card.CardSpec.link_bw` and ``link_latency_s``). A collective starts when
its operand is ready and the link is free; a kernel when the pipeline is free and its operands
(collective results included) are ready. A kernel that does not read a collective in flight
runs while it transfers: the body is cut so that the equations that wait for a collective are
a kernel of their own, and the rest overlap it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from device_model.card import CardSpec
from device_model.execute import run_kernel
from device_model.kernel import Kernel, format_kernel
from device_model.layout import TensorLayout, layout_for, np_dtype
from device_model.runtime import copy_in, runtime, to_device_layout
from device_model.timing import kernel_cost
from lowering.control import CONTROL_OPS, has_control, unroll_scans
from lowering.errors import LoweringError
from lowering.from_jaxpr import from_jaxpr
from lowering.pipeline import compile_graph

from .runtime import Array, Device, copy_out, host_dtype, num_cards

__all__ = [
    "COLLECTIVES",
    "MultiCompiled",
    "MultiLowered",
    "collective_seconds",
    "num_cards",
    "shard_map_eqn",
]

#: the jaxpr primitives of a shard_map body that move data between cards, and their kind
COLLECTIVES = {
    "psum": "all_reduce",
    "psum_invariant": "all_reduce",
    "pmax": "all_reduce",
    "pmin": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_invariant": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_to_all": "all_to_all",
    "ppermute": "ppermute",
}
#: per-card primitives of a shard_map body that move nothing: run as JAX has them
_LOCAL = ("axis_index",)
#: type-level primitives (JAX's varying-manual-axes checks): no data moves, dropped
_NO_OPS = ("pvary", "pbroadcast")


def collective_seconds(kind: str, nbytes: float, n: int, card: CardSpec) -> float:
    """A ring collective over ``n`` cards of ``nbytes`` (each card's full buffer: the operand of
    an all-reduce, reduce-scatter or all-to-all, the result of an all-gather). An all-reduce
    moves ``2 (n-1)/n`` of it over each link in ``2 (n-1)`` latency-bound hops; an all-gather,
    reduce-scatter or all-to-all ``(n-1)/n`` in ``n-1``; a ``ppermute`` all of it in one hop."""
    if n <= 1:
        return 0.0
    if kind == "ppermute":
        return nbytes / card.link_bw + card.link_latency_s
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps / n * nbytes / card.link_bw + steps * card.link_latency_s


# ---------------------------------------------------------------------------------------------
# the body, cut into kernels and collectives


@dataclass
class _Segment:
    """A kernel (``kernel`` set), a collective (``kind`` set) or a local primitive."""

    invars: list[Any]
    outvars: list[Any]
    eqn: Any = None
    kernel: Kernel | None = None
    kind: str = ""
    cards: int = 1
    nbytes: int = 0
    seconds: float = 0.0
    in_layouts: tuple[TensorLayout, ...] = ()
    out_layouts: tuple[TensorLayout, ...] = ()
    consts: list[np.ndarray] = field(default_factory=list)
    cost: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        if self.kernel is not None:
            return self.kernel.name
        return self.eqn.primitive.name


def shard_map_eqn(closed: Any) -> Any:
    """The ``shard_map`` equation of a traced function, None when it has none; LoweringError
    when the function does more than one shard_map of its arguments."""
    eqns = closed.jaxpr.eqns
    sm = [e for e in eqns if e.primitive.name == "shard_map"]
    if not sm:
        return None
    if len(eqns) != 1:
        others = sorted({e.primitive.name for e in eqns if e.primitive.name != "shard_map"})
        raise LoweringError(
            "spyre_jax.jit: a multi-card function is one jax.shard_map of its arguments; this "
            f"one also has {', '.join(others) or 'a second shard_map'} outside it (move it into "
            "the shard_map's body)"
        )
    e = sm[0]
    if list(e.outvars) != list(closed.jaxpr.outvars):
        raise LoweringError("spyre_jax.jit: the shard_map's results must be the function's")
    return e


def _axes_of(params: dict[str, Any]) -> tuple[str, ...]:
    for k in ("axes", "axis_name"):
        if k in params:
            v = params[k]
            return tuple(v) if isinstance(v, tuple | list) else (v,)
    return ()


def _nbytes(aval: Any) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _is_var(v: Any) -> bool:
    return not isinstance(v, jcore.Literal)


def _cut(body: Any, sizes: dict[str, int], card: CardSpec, name: str) -> list[_Segment]:
    """The body's equations as kernels and collectives, in program order."""
    eqns = _without_no_ops(body)
    last_read: dict[Any, int] = {}  # each value's last reader (the body's results: past the end)
    for i, e in enumerate(eqns):
        last_read.update((v, i) for v in e.invars if _is_var(v))
    last_read.update((v, len(eqns)) for v in body.outvars if _is_var(v))
    segs: list[_Segment] = []
    group: list[Any] = []
    in_flight: set[Any] = set()  # collective results issued since the current group began

    def flush(end: int) -> None:
        nonlocal group
        if group:
            live = {v for e in group for v in e.outvars if last_read.get(v, -1) >= end}
            segs.append(_kernel_segment(group, live, card, f"{name}_k{len(segs)}"))
        group = []

    for i, e in enumerate(eqns):
        pname = e.primitive.name
        if pname in COLLECTIVES or pname in _LOCAL:
            if e.params.get("axis_index_groups") is not None:
                raise LoweringError(f"spyre_jax.jit: {pname} with axis_index_groups is not run")
            flush(i)
            axes = _axes_of(e.params)
            unknown = [a for a in axes if a not in sizes]
            if unknown:
                raise LoweringError(f"spyre_jax.jit: {pname} over unknown mesh axes {unknown}")
            seg = _Segment([v for v in e.invars if _is_var(v)], list(e.outvars), eqn=e)
            if pname in COLLECTIVES:
                seg.kind = COLLECTIVES[pname]
                seg.cards = math.prod(sizes[a] for a in axes)
                aval = (e.outvars if seg.kind == "all_gather" else e.invars)[0].aval
                seg.nbytes = _nbytes(aval)
                seg.seconds = collective_seconds(seg.kind, seg.nbytes, seg.cards, card)
                in_flight.update(e.outvars)
            segs.append(seg)
            continue
        if in_flight and any(v in in_flight for v in e.invars if _is_var(v)):
            flush(i)  # what waits for a collective is a kernel of its own: the rest overlaps it
            in_flight = set()
        group.append(e)
    flush(len(eqns))
    return segs


def _without_no_ops(body: Any) -> list[Any]:
    """The body's equations, ``pvary`` and ``pbroadcast`` dropped (their readers read their
    operands)."""
    alias: dict[Any, Any] = {}
    out = []
    for e in body.eqns:
        ins = [alias.get(v, v) if _is_var(v) else v for v in e.invars]
        if e.primitive.name in _NO_OPS:
            alias.update(zip(e.outvars, ins, strict=True))
            continue
        out.append(e.replace(invars=ins) if ins != list(e.invars) else e)
    if any(_is_var(v) and v in alias for v in body.outvars):
        raise LoweringError("spyre_jax.jit: a shard_map result that is only pvary of a value")
    return out


def _kernel_segment(eqns: list[Any], live_after: set[Any], card: CardSpec, name: str) -> _Segment:
    defined: set[Any] = set()
    invars: list[Any] = []
    for e in eqns:
        for v in e.invars:
            if _is_var(v) and v not in defined and v not in invars:
                invars.append(v)
        defined.update(e.outvars)
    outvars = [v for e in eqns for v in e.outvars if v in live_after]
    info = jcore.DebugInfo(
        "spyre_jax.jit",
        name,
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    jaxpr = jcore.Jaxpr([], invars, outvars, eqns, debug_info=info)
    graph = from_jaxpr(jcore.ClosedJaxpr(jaxpr, []), name=name)
    graph = unroll_scans(graph, card, compile_graph) if has_control(graph) else graph
    if has_control(graph):
        (n,) = [n for n in graph.nodes if n.op in CONTROL_OPS][:1]
        raise LoweringError(
            f"spyre_jax.jit: a {n.op} inside a shard_map body is not run on several cards yet "
            f"(at {n.source or '<unknown source line>'}); move the loop outside the shard_map, "
            "or unroll it (unroll=True)"
        )
    kernel = compile_graph(graph, card)
    decls = {t.name: t for t in kernel.tensors}
    n_in = len(kernel.inputs) - len(kernel.consts)
    seg = _Segment(invars, outvars, kernel=kernel)
    seg.in_layouts = tuple(decls[n].layout for n in kernel.inputs[:n_in])
    seg.out_layouts = tuple(decls[o].layout for o in kernel.outputs)
    seg.consts = [to_device_layout(a, decls[n].layout) for n, a in kernel.consts]
    seg.cost = kernel_cost(kernel, card)
    seg.seconds = seg.cost["sim_time_us"] * 1e-6
    return seg


def _to_device(x: jax.Array, lay: TensorLayout) -> jax.Array:
    """Logical values -> the card layout inside the traced program
    (``device_model.runtime.to_device_layout``, in JAX)."""
    x = x.astype(np_dtype(lay.dtype))
    if not lay.shape:
        return x.reshape(1)
    pad = lay.device_shape[-1] - x.shape[-1]
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x


def _from_device(x: Any, lay: TensorLayout, dtype: Any) -> Any:
    x = x[0] if not lay.shape else x[..., : lay.shape[-1]]
    return x.astype(dtype)


# ---------------------------------------------------------------------------------------------
# running: one card's program, and the N cards under shard_map or vmap


def _collective(e: Any, x: Any) -> Any:
    p, n = e.params, e.primitive.name
    if n in ("psum", "psum_invariant"):
        return lax.psum(x, p["axes"])
    if n == "pmax":
        return lax.pmax(x, p["axes"])
    if n == "pmin":
        return lax.pmin(x, p["axes"])
    if n in ("all_gather", "all_gather_invariant"):
        return lax.all_gather(x, p["axis_name"], axis=p["all_gather_dimension"], tiled=p["tiled"])
    if n == "reduce_scatter":
        return lax.psum_scatter(
            x, p["axis_name"], scatter_dimension=p["scatter_dimension"], tiled=p["tiled"]
        )
    if n == "all_to_all":
        split, concat = p["split_axis"], p["concat_axis"]
        return lax.all_to_all(x, p["axis_name"], split, concat, tiled=p["tiled"])
    if n == "ppermute":
        return lax.ppermute(x, p["axis_name"], p["perm"])
    raise LoweringError(f"spyre_jax.jit: collective {n} is not supported")  # pragma: no cover


def _card_program(body: Any, segs: list[_Segment]) -> Callable[..., list[Any]]:
    """One card's program over its local (logical) arrays: its kernels run as the card runs
    them (``device_model.execute``), its collectives as JAX's over the mesh's axes."""

    def read(env: dict[Any, Any], v: Any) -> Any:
        return v.val if not _is_var(v) else env[v]

    def run(*args: Any) -> list[Any]:
        env = dict(zip(body.invars, args, strict=True))
        for s in segs:
            ins = [read(env, v) for v in s.invars]
            if s.kernel is not None:
                dev = [_to_device(x, lay) for x, lay in zip(ins, s.in_layouts, strict=True)]
                outs = run_kernel(s.kernel, dev + [jnp.asarray(c) for c in s.consts])
                outs = [
                    _from_device(o, lay, v.aval.dtype)
                    for o, lay, v in zip(outs, s.out_layouts, s.outvars, strict=True)
                ]
            elif s.kind:
                outs = [_collective(s.eqn, ins[0])]
            elif s.eqn.primitive.name == "axis_index":
                outs = [lax.axis_index(s.eqn.params["axis_name"])]
            else:  # pragma: no cover - _cut makes nothing else
                raise LoweringError(f"spyre_jax.jit: {s.name} on a card")
            env.update(zip(s.outvars, outs, strict=True))
        return [read(env, v) for v in body.outvars]

    return run


def _entries(spec: Any, ndim: int) -> list[tuple[str, ...]]:
    out = []
    for d in range(ndim):
        e = spec[d] if d < len(spec) else None
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    return out


def _split(x: Any, spec: Any, names: Sequence[str], sizes: dict[str, int]) -> Any:
    """A global array -> its shards stacked on leading axes, one per mesh axis (in the mesh's
    order; an axis the spec does not name replicates it)."""
    shape: list[int] = []
    pos: dict[str, int] = {}
    for n, axes in zip(x.shape, _entries(spec, x.ndim), strict=True):
        for a in axes:
            pos[a] = len(shape)
            shape.append(sizes[a])
        shape.append(n // math.prod(sizes[a] for a in axes))
    x = x.reshape(shape)
    front = [pos[a] for a in names if a in pos]
    x = jnp.transpose(x, front + [i for i in range(len(shape)) if i not in front])
    for i, a in enumerate(names):
        if a not in pos:
            x = jnp.expand_dims(x, i)
            x = jnp.broadcast_to(x, (*x.shape[:i], sizes[a], *x.shape[i + 1 :]))
    return x


def _assemble(y: Any, spec: Any, names: Sequence[str]) -> Any:
    """:func:`_split`'s inverse (a replicated axis: card 0's copy)."""
    k = len(names)
    ndim = y.ndim - k
    entries = _entries(spec, ndim)
    used = {a for axes in entries for a in axes}
    y = y[tuple(slice(None) if a in used else 0 for a in names)]
    kept = [a for a in names if a in used]
    perm: list[int] = []
    shape: list[int] = []
    for d, axes in enumerate(entries):
        perm += [kept.index(a) for a in axes]
        perm.append(len(kept) + d)
        shape.append(math.prod(y.shape[kept.index(a)] for a in axes) * y.shape[len(kept) + d])
    return jnp.transpose(y, perm).reshape(shape)


def _host_mesh(names: Sequence[str], shape: Sequence[int]) -> Any:
    """A Mesh of this process's JAX devices of the cards' shape, None when it has too few."""
    devs = jax.devices()
    n = math.prod(shape)
    if len(devs) < n:
        return None
    return jax.sharding.Mesh(np.array(devs[:n]).reshape(tuple(shape)), tuple(names))


# ---------------------------------------------------------------------------------------------
# lowered and compiled


def _schedule(segs: list[_Segment], invars: Sequence[Any], with_links: bool = True) -> list:
    """Start and end (s) of each segment on one card: kernels in order on the compute
    pipeline, collectives in order on the link, each after its operands."""
    ready: dict[Any, float] = {v: 0.0 for v in invars}
    free = {"compute": 0.0, "link": 0.0}
    spans = []
    for s in segs:
        unit = "link" if s.kind else "compute"
        dur = s.seconds if (with_links or not s.kind) else 0.0
        start = max([free[unit], *(ready.get(v, 0.0) for v in s.invars)])
        end = start + dur
        if s.kernel is not None or s.kind:
            free[unit] = end
        for v in s.outvars:
            ready[v] = end
        spans.append((s, unit, start, end))
    return spans


class MultiLowered:
    """A shard_map function lowered for N cards: its per-card kernels and collectives."""

    def __init__(
        self, jitted: Any, key: Any, closed: Any, eqn: Any, out_tree: Any, t0: float, name: str
    ):
        self._jitted, self._key, self._out_tree, self._t0 = jitted, key, out_tree, t0
        self.eqn = eqn
        self._invars = list(closed.jaxpr.invars)
        self._consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        p = eqn.params
        self.mesh = p["mesh"]
        self.axis_names = tuple(self.mesh.axis_names)
        self.axis_sizes = dict(zip(self.axis_names, self.mesh.axis_sizes, strict=True))
        self.cards = math.prod(self.mesh.axis_sizes)
        if isinstance(self.mesh, jax.sharding.Mesh):
            flat = list(np.asarray(self.mesh.devices).flat)
            other = [d for d in flat if type(d) is not Device]
            if other:
                raise LoweringError(
                    f"spyre_jax.jit: the shard_map's mesh holds {other[0]!r}; build the Mesh of "
                    "spyre_jax.devices() (SPYRE_NUM_CARDS=N gives N cards)"
                )
            have = num_cards()
            if max(d.id for d in flat) >= have:
                raise ValueError(
                    f"spyre_jax.jit: the mesh uses card {max(d.id for d in flat)} but "
                    f"SPYRE_NUM_CARDS is {have}"
                )
        self.in_specs, self.out_specs = tuple(p["in_specs"]), tuple(p["out_specs"])
        self.body = p["jaxpr"]
        self.card = runtime().card
        self.segments = _cut(self.body, self.axis_sizes, self.card, name)

    def as_text(self, ir: str = "schedule") -> str:
        """Each card's program: its kernels' schedules and its collectives, in order."""
        lines = [f"# {self.cards} cards, mesh {self.axis_sizes} (one program per card)"]
        for s in self.segments:
            if s.kernel is not None:
                lines.append(format_kernel(s.kernel))
            elif s.kind:
                lines.append(
                    f"{s.kind} ({s.eqn.primitive.name}) over {s.cards} cards: {s.nbytes} B, "
                    f"{s.seconds * 1e6:.2f} us on the link"
                )
            else:
                lines.append(f"{s.eqn.primitive.name}")
        return "\n".join(lines)

    def cost_analysis(self) -> dict[str, Any]:
        """Per card: ``sim_time_us`` (kernels and collectives, overlapped where the program
        lets them), ``sim_time_us_without_collectives`` (the same with the link free),
        ``compute_us``, ``collective_us``, ``overlap_us``, ``flops`` and ``device_bytes`` of
        its kernels, and ``collectives``: each one's kind, cards, bytes and time span."""
        spans = _schedule(self.segments, self.body.invars)
        bare = _schedule(self.segments, self.body.invars, with_links=False)
        total = max((e for *_, e in spans), default=0.0)
        compute = sum(s.seconds for s in self.segments if s.kernel is not None)
        coll = sum(s.seconds for s in self.segments if s.kind)
        kernels = [s for s in self.segments if s.kernel is not None]
        return {
            "cards": self.cards,
            "mesh": dict(self.axis_sizes),
            "sim_time_us": total * 1e6,
            "sim_time_us_without_collectives": max((e for *_, e in bare), default=0.0) * 1e6,
            "compute_us": compute * 1e6,
            "collective_us": coll * 1e6,
            "overlap_us": max(0.0, compute + coll - total) * 1e6,
            "flops": sum(s.cost.get("flops", 0) for s in kernels),
            "device_bytes": sum(s.cost.get("device_bytes", 0) for s in kernels),
            "kernels": [
                {"name": s.name, "us": s.seconds * 1e6, "start_us": a * 1e6, "end_us": b * 1e6}
                for s, unit, a, b in spans
                if s.kernel is not None
            ],
            "collectives": [
                {
                    "kind": s.kind,
                    "op": s.eqn.primitive.name,
                    "cards": s.cards,
                    "bytes": s.nbytes,
                    "us": s.seconds * 1e6,
                    "start_us": a * 1e6,
                    "end_us": b * 1e6,
                }
                for s, unit, a, b in spans
                if s.kind
            ],
        }

    def trace_events(self) -> list[dict[str, Any]]:
        """Chrome trace events: per card, its kernels on a compute row and its collectives on
        a link row (every card runs the same program: the rows are alike)."""
        spans = _schedule(self.segments, self.body.invars)
        ev: list[dict[str, Any]] = []
        for c in range(self.cards):
            ev.append({"ph": "M", "name": "process_name", "pid": c, "args": {"name": f"card {c}"}})
            for tid, row in ((0, "compute"), (1, "link")):
                ev.append(
                    {"ph": "M", "name": "thread_name", "pid": c, "tid": tid, "args": {"name": row}}
                )
            for s, _, a, b in spans:
                if s.kernel is None and not s.kind:
                    continue
                ev.append(
                    {
                        "ph": "X",
                        "name": s.kind or s.name,
                        "cat": "collective" if s.kind else "kernel",
                        "pid": c,
                        "tid": 1 if s.kind else 0,
                        "ts": a * 1e6,
                        "dur": (b - a) * 1e6,
                        "args": {"bytes": s.nbytes} if s.kind else {"kernel": s.name},
                    }
                )
        return ev

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """:meth:`trace_events` as a Chrome trace file (chrome://tracing, Perfetto)."""
        with open(path, "w") as fh:
            json.dump({"traceEvents": self.trace_events(), "displayTimeUnit": "ms"}, fh)

    def compile(self) -> MultiCompiled:
        c = self._jitted._cache.get(self._key)
        if c is None:
            c = MultiCompiled(self, time.perf_counter() - self._t0)
            self._jitted._cache[self._key] = c
        return c


class MultiCompiled:
    """A shard_map function compiled for N cards; calling it runs the N cards' simulations."""

    def __init__(self, lowered: MultiLowered, compile_s: float):
        self.lowered = lowered
        self.compile_seconds = compile_s
        self._runner: Any = None
        self.sharded_over: int = 0  # JAX devices the cards ran on (0: not run yet; 1: vmap)

    @property
    def cards(self) -> int:
        return self.lowered.cards

    def cost_analysis(self) -> dict[str, Any]:
        return self.lowered.cost_analysis()

    def as_text(self) -> str:
        return self.lowered.as_text()

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        self.lowered.write_trace(path)

    def _build(self) -> Any:
        lo = self.lowered
        card_fn = _card_program(lo.body, lo.segments)
        names = lo.axis_names
        mesh = _host_mesh(names, lo.mesh.axis_sizes)
        if mesh is not None:
            self.sharded_over = lo.cards
            f = jax.shard_map(
                lambda *a: tuple(card_fn(*a)),
                mesh=mesh,
                in_specs=lo.in_specs,
                out_specs=lo.out_specs,
                check_vma=False,
            )
            return jax.jit(f)
        self.sharded_over = 1
        per_card: Callable[..., Any] = lambda *a: tuple(card_fn(*a))  # noqa: E731
        for a in reversed(names):
            per_card = jax.vmap(per_card, axis_name=a)

        def run(*xs: Any) -> tuple[Any, ...]:
            specs = zip(xs, lo.in_specs, strict=True)
            shards = [_split(x, s, names, lo.axis_sizes) for x, s in specs]
            outs = per_card(*shards)
            return tuple(_assemble(y, s, names) for y, s in zip(outs, lo.out_specs, strict=True))

        return jax.jit(run)

    def _run(self, leaves: list[Any]) -> Any:
        lo = self.lowered
        if self._runner is None:
            self._runner = self._build()
        host = [copy_out(x._buf) if type(x) is Array else np.asarray(x) for x in leaves]
        env = {**lo._consts, **dict(zip(lo._invars, host, strict=True))}
        args = [env[v] if _is_var(v) else v.val for v in lo.eqn.invars]
        outs = [np.asarray(o) for o in self._runner(*args)]
        rt = runtime()
        res = []
        for a in outs:  # the cards' results, assembled, as arrays in (card 0's) device memory
            lay = layout_for(a.shape, host_dtype(a), rt.card.stick_bytes)
            res.append(Array(copy_in(a, lay, rt=rt, tag="multi-card result")))
        return jax.tree_util.tree_unflatten(lo._out_tree, res)
