"""``spyre_jax.jit``: trace with JAX, lower through the shared IR, run on the simulated card."""

from __future__ import annotations

import functools
import inspect
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from device_model.card import CardSpec
from device_model.hostprog import LoadedProgram, Program, format_program, program_cost
from device_model.kernel import Kernel, format_kernel
from device_model.launching import launch
from device_model.runtime import Executable, runtime
from device_model.timing import kernel_cost, parameter_shares
from lowering.control import has_control, lower_program, unroll_scans
from lowering.from_jaxpr import from_jaxpr
from lowering.graph import Graph, format_graph
from lowering.loading import check_fits
from lowering.pipeline import compile_graph

from . import array_ops, spmd, transforms
from .multicard import MultiLowered, shard_map_eqn
from .runtime import Array, host_dtype
from .transforms import spyre_call

__all__ = ["jit", "Jitted", "Lowered", "Compiled"]


def _is_array_leaf(x: Any) -> bool:
    """Arrays are traced; Python scalars and other leaves are static (as ``eqx.filter_jit``)."""
    return isinstance(x, Array | np.ndarray | np.generic | jax.Array | jax.ShapeDtypeStruct)


#: a JAX array of typed PRNG keys (``jax.random.key``): its key data goes to the card
_is_key = transforms.is_key_array


def _leaf_aval(x: Any) -> tuple[tuple[int, ...], Any]:
    if _is_key(x):
        return tuple(np.shape(x)), x.dtype  # traced as keys; the card holds their uint32 data
    if isinstance(x, Array):
        x._check_alive()  # raises the RuntimeError saying it was deleted
        lay = x.layout
        return lay.shape, lay.dtype
    if isinstance(x, bool):
        return (), "bool"
    if isinstance(x, int) and not isinstance(x, np.generic):
        return (), "int32"
    if isinstance(x, float) and not isinstance(x, np.generic):
        return (), "float32"
    if np.iscomplexobj(x) or np.dtype(x.dtype).kind == "c":
        host_dtype(np.complex64(0))  # raises the TypeError listing the supported dtypes
    if _is_int64(x):
        return tuple(np.shape(x)), "int32"  # narrowed; ``Jitted._split`` warns once per call
    return tuple(np.shape(x)), host_dtype(x)


def _is_int64(x: Any) -> bool:
    """A host array or NumPy scalar of dtype int64 (narrowed to int32 on the card)."""
    if isinstance(x, Array) or not hasattr(x, "dtype") or _is_key(x):
        return False
    return np.dtype(x.dtype) == np.int64


_INT64_WARNING = "spyre: int64 is narrowed to int32 on the card"


def _host_arg(x: Any) -> Any:
    """A host value as the launch takes it (int64 narrowed to int32); an Array's buffer."""
    if isinstance(x, Array):
        x._check_alive()
        return x._buf
    if _is_key(x):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x).astype(np.int32) if _is_int64(x) else x


def _spec_dtype(d: Any) -> Any:
    """The dtype a traced argument's ShapeDtypeStruct gets (a key dtype is its own)."""
    if not isinstance(d, str):
        return d
    return jax.numpy.bfloat16 if d == "bfloat16" else np.dtype(d)


def _with_inlined(cost: dict[str, Any], inlined: list[dict]) -> dict[str, Any]:
    return {**cost, "inlined": list(inlined)} if inlined else cost


def _shares(kernel: Kernel | None, card: CardSpec) -> dict[str, float]:
    return {} if kernel is None else parameter_shares(kernel, card)


class Compiled:
    """A function compiled for the card: its graph, its kernel (or its host program, for a
    function with loops or branches), the loaded executable and its figures."""

    def __init__(
        self,
        graph: Graph,
        kernel: Kernel | None,
        out_tree: Any,
        compile_s: float,
        program: Program | None = None,
        inlined: list[dict] | None = None,
    ):
        self.graph = graph
        self.kernel = kernel
        self.program = program
        self.inlined = list(inlined or [])
        self._out_tree = out_tree
        #: per flat output: the PRNG implementation's name of a typed-key output, else None
        self.key_outs: tuple[str | None, ...] = ()
        self.compile_seconds = compile_s
        if program is not None:
            self.executable: Any = LoadedProgram(program, runtime())
            self.recipe = None
        else:
            assert kernel is not None
            self.executable = Executable(kernel, runtime())
            self.recipe = self.executable.recipe

    def cost_analysis(self) -> dict[str, Any]:
        """Figures of the schedule: flops, device_bytes, scratchpad_peak_bytes, padding_bytes,
        cores_used, sim_time_us (simulated time on the card), and a per-stage breakdown. With
        loops or branches: the host program's figures (``device_model.hostprog.program_cost``:
        launches, host round trips, and per loop or branch its iterations, per-iteration and
        total time; a while loop's iterations are those of its last run). ``inlined``, when
        the compiler unrolled a loop or computed every branch of a cond and selected: one row
        each, with the figures it decided on."""
        return _with_inlined(self.executable.cost_analysis(), self.inlined)

    def parameter_shares(self) -> dict[str, float]:
        """Each timing parameter's share of the kernel's simulated time (its elasticity:
        ``device_model.timing.parameter_shares``); empty for a host program of kernels. Apart
        from ``cost_analysis()``, which it would make about ten times slower."""
        return _shares(self.kernel, self.executable.rt.card)

    def as_text(self) -> str:
        """The schedule (the host program with its loops' bodies), readable."""
        if self.program is not None:
            return format_program(self.program)
        return format_kernel(self.kernel)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "call the jitted function, or Compiled.call(flat_leaves)"
        )  # pragma: no cover

    def call_flat(self, leaves: list[Any]) -> list[Array]:
        """Launch with one value per graph input (host arrays or :class:`Array` s); the outputs
        as a flat list of :class:`Array` s."""
        return list(jax.tree_util.tree_leaves(self._run(list(leaves))))

    def _run(self, leaves: list[Any], defer: bool = False, donate: Sequence[int] = ()) -> Any:
        """One launch (``device_model.launching.launch``) on the current stream (``defer``: its
        program recorded in the card's lazy trace, as an eager op's). Refused (RaceError,
        StreamError, DeviceOOMError) before anything changes."""
        # arrays were checked alive when the call was keyed (``Jitted._split``); the caller was
        # warned of int64 there too
        args = [x._buf if type(x) is Array else _host_arg(x) for x in leaves]
        if self.program is not None:
            bufs = self.executable.run(args)
        else:
            bufs = launch(self.executable, args, defer=defer, donate=donate)
        outs: list[Any] = [Array(b) for b in bufs]
        for i, kd in enumerate(self.key_outs):
            if kd is not None:  # typed keys: a JAX key array of the data (copied to the host)
                outs[i] = jax.random.wrap_key_data(np.asarray(outs[i]), impl=kd)
        return jax.tree_util.tree_unflatten(self._out_tree, outs)


class Lowered:
    """A traced and lowered function: the graph IR and the schedule, not yet compiled to JAX."""

    def __init__(
        self,
        jitted: Jitted,
        key: Any,
        graph: Graph,
        kernel: Kernel | None,
        out_tree: Any,
        t0: float,
        program: Program | None = None,
        inlined: list[dict] | None = None,
    ):
        self._jitted, self._key = jitted, key
        self.graph, self.kernel, self._out_tree, self._t0 = graph, kernel, out_tree, t0
        #: the host program of a function with loops or branches (``kernel`` is then None)
        self.program = program
        #: the loops the compiler unrolled and the branches it computed both ways, and why
        self.inlined = list(inlined or [])
        #: per flat output: the PRNG implementation's name of a typed-key output, else None
        self.key_outs: tuple[str | None, ...] = ()

    def as_text(self, ir: str = "schedule") -> str:
        """The schedule (``ir="schedule"``: the host program, with its loops' bodies, for a
        function with loops or branches) or the graph IR (``ir="graph"``), readable."""
        if ir == "graph":
            return format_graph(self.graph)
        if self.program is not None:
            return format_program(self.program)
        return format_kernel(self.kernel)

    def compile(self) -> Compiled:
        c = self._jitted._cache.get(self._key)
        if c is None:
            dt = time.perf_counter() - self._t0
            c = Compiled(self.graph, self.kernel, self._out_tree, dt, self.program, self.inlined)
            c.key_outs = self.key_outs
            self._jitted._cache[self._key] = c
        return c

    def cost_analysis(self) -> dict[str, Any]:
        if self.program is not None:
            cost = program_cost(self.program, runtime().card)
        else:
            cost = kernel_cost(self.kernel, runtime().card)
        return _with_inlined(cost, self.inlined)

    def parameter_shares(self) -> dict[str, float]:
        """As :meth:`Compiled.parameter_shares`."""
        return _shares(self.kernel, runtime().card)


class Jitted:
    """The result of :func:`jit`: callable, with ``.lower(*args)`` and a per-signature cache."""

    def __init__(
        self,
        fun: Callable,
        static_argnums: Sequence[int],
        static_argnames: Sequence[str],
        *,
        donate_argnums: Sequence[int] = (),
        donate_argnames: Sequence[str] = (),
        keep_unused: bool = False,
        inline: bool = False,
        in_shardings: Any = None,
        out_shardings: Any = None,
    ):
        self.fun = fun
        self.in_shardings, self.out_shardings = in_shardings, out_shardings
        self.donate_argnums = tuple(donate_argnums)
        self.donate_argnames = tuple(donate_argnames)
        self.keep_unused, self.inline = keep_unused, inline
        self.static_argnums = tuple(sorted(int(i) for i in static_argnums))
        self.static_argnames = tuple(static_argnames)
        self._cache: dict[Any, Compiled] = {}
        #: the closed jaxpr per signature (what ``spyre_call`` binds under a transformation)
        self._jaxprs: dict[Any, tuple[Any, Any, tuple, str]] = {}
        self.trace_count = 0
        # (not its __dict__: a wrapper of another Jitted, e.g. jax.grad(spyre_f), carries that
        # one's caches and function in its own)
        functools.update_wrapper(self, fun, updated=())
        try:
            self._sig = inspect.signature(fun)
        except (TypeError, ValueError):
            self._sig = None

    def _split(self, args: tuple, kwargs: dict) -> tuple[Any, list[Any], Any]:
        n = len(args)
        static_nums = tuple(i if i >= 0 else n + i for i in self.static_argnums)
        static = tuple((i, args[i]) for i in static_nums if i < n)
        static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static_nums)
        dyn_kw = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kw))
        dyn_pos, dyn_leaves, static_leaves = [], [], []
        for i, x in enumerate(leaves):
            if _is_array_leaf(x):
                dyn_pos.append(i)
                dyn_leaves.append(x)
            else:
                static_leaves.append((i, x))  # non-array leaves (functions, strings) are static
        avals = tuple(_leaf_aval(x) for x in dyn_leaves)
        if any(_is_int64(x) for x in dyn_leaves):
            # once per call, attributed to the user's call site: _split <- __call__/lower <- user
            warnings.warn(_INT64_WARNING, UserWarning, stacklevel=3)
        try:
            # a different card (set_card: a new runtime) is a different compilation
            rt = runtime()
            key = (tree, avals, tuple(dyn_pos), tuple(static_leaves), static, static_kw, rt)
            hash(key)
        except TypeError as e:
            raise TypeError(f"spyre_jax.jit: static arguments must be hashable ({e})") from None
        return key, dyn_leaves, (n, static_nums, static, static_kw, tree, dyn_pos, static_leaves)

    def _jaxpr(self, key: Any, info: Any, avals: tuple) -> tuple[Any, Any, tuple, str]:
        """The traced function's closed jaxpr for this signature (traced once, kept), its
        output tree, its typed-key outputs and its name."""
        hit = self._jaxprs.get(key)
        if hit is not None:
            return hit
        n, static_nums, static, static_kw, tree, dyn_pos, static_leaves = info
        nleaves = len(dyn_pos) + len(static_leaves)
        out_store: dict[str, Any] = {}

        def flat_fun(*dyn: Any) -> Any:
            leaves: list[Any] = [None] * nleaves
            for p, v in zip(dyn_pos, dyn, strict=True):
                leaves[p] = v
            for p, v in static_leaves:
                leaves[p] = v
            dyn_args, dyn_kw = jax.tree_util.tree_unflatten(tree, leaves)
            it = iter(dyn_args)
            smap = dict(static)
            args = [smap[i] if i in smap else next(it) for i in range(n)]
            out = self.fun(*args, **dyn_kw, **dict(static_kw))
            flat, out_tree = jax.tree_util.tree_flatten(out)
            out_store["tree"] = out_tree
            out_store["keys"] = tuple(
                str(jax.random.key_impl(o)) if _is_key(o) else None for o in flat
            )
            return flat

        specs = [jax.ShapeDtypeStruct(s, _spec_dtype(d)) for s, d in avals]
        self.trace_count += 1
        closed = jax.make_jaxpr(flat_fun)(*specs)
        name = getattr(self.fun, "__name__", "fn")
        name = name if name.isidentifier() else "fn"
        hit = (closed, out_store["tree"], out_store["keys"], name)
        self._jaxprs[key] = hit
        return hit

    def _partitioned(self, closed: Any, info: Any, out_tree: Any) -> Any:
        """``closed`` over a mesh of cards, as ``in_shardings``/``out_shardings`` split its
        arguments and results (:mod:`spyre_jax.spmd`); as it is when they name no mesh."""
        n, static_nums, static, static_kw, tree, dyn_pos, static_leaves = info
        dummy = jax.tree_util.tree_unflatten(tree, [0] * (len(dyn_pos) + len(static_leaves)))
        dyn_args = dummy[0]
        ins = self.in_shardings
        ins = tuple(ins) if isinstance(ins, list) else ins
        per_leaf = spmd.leaf_shardings(ins, dyn_args, "in_shardings")
        in_sh = [per_leaf[p] if p < len(per_leaf) else None for p in dyn_pos]
        out_dummy = jax.tree_util.tree_unflatten(out_tree, [0] * len(closed.out_avals))
        out_sh = spmd.leaf_shardings(self.out_shardings, out_dummy, "out_shardings")
        in_specs, mesh_in = spmd.specs_of(
            in_sh, [len(a.shape) for a in closed.in_avals], "in_shardings"
        )
        out_specs, mesh_out = spmd.specs_of(
            out_sh, [len(a.shape) for a in closed.out_avals], "out_shardings"
        )
        if mesh_in is not None and mesh_out is not None and mesh_in != mesh_out:
            raise ValueError("spyre_jax.jit: in_shardings and out_shardings name different meshes")
        mesh = mesh_in if mesh_in is not None else mesh_out
        if mesh is None:
            return closed
        given = [None if sh is None else sp for sh, sp in zip(out_sh, out_specs, strict=True)]
        return spmd.partition(closed, in_specs, given, mesh)

    def _trace(self, key: Any, info: Any, avals: tuple) -> Lowered:
        t0 = time.perf_counter()
        closed, out_tree, key_outs, name = self._jaxpr(key, info, avals)
        out_store = {"tree": out_tree, "keys": key_outs}
        if self.in_shardings is not None or self.out_shardings is not None:
            closed = self._partitioned(closed, info, out_tree)
        sm = shard_map_eqn(closed)
        if sm is not None:  # a multi-card function: one program per card, and collectives
            return MultiLowered(self, key, closed, sm, out_store["tree"], t0, name)  # type: ignore[return-value]
        graph = from_jaxpr(closed, name=name)
        check_fits(graph)
        card = runtime().card
        notes: list[dict] = []  # the loops unrolled and branches selected: cost_analysis()
        lowered = graph
        if has_control(graph):  # loops or branches: a host program of kernels
            lowered = unroll_scans(graph, card, compile_graph, notes)
        if has_control(lowered):
            program = lower_program(lowered, card, compile_graph, notes)
            low = Lowered(self, key, graph, None, out_store["tree"], t0, program, notes)
        else:
            kernel = compile_graph(lowered, card)
            low = Lowered(self, key, graph, kernel, out_store["tree"], t0, inlined=notes)
        low.key_outs = out_store["keys"]
        return low

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Trace and lower for these arguments (shapes, dtypes and static values). An array
        argument may be a ``jax.ShapeDtypeStruct``: the compiled function's figures
        (``cost_analysis()``) then come from shapes alone, no values materialized."""
        key, leaves, info = self._split(args, kwargs)
        return self._trace(key, info, key[1])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if jax.config.jax_disable_jit:  # as jax.jit: the Python function, op by op (on the CPU)
            return self.fun(*args, **kwargs)
        key, leaves, info = self._split(args, kwargs)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            if self.inline:
                return self.fun(*args, **kwargs)
            return self._bind(key, info, leaves)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            raise TypeError(
                "spyre_jax.jit: a jax.ShapeDtypeStruct has a shape and a dtype but no values, so "
                "it cannot be run; compile it for its figures instead: "
                "f.lower(*shapes).compile().cost_analysis()"
            )
        c = self._cache.get(key)
        if c is None:
            c = self._trace(key, info, key[1]).compile()
        donated = self._donated(args, kwargs, leaves)
        # (a multi-card function's donated arrays are deleted after it, their regions freed)
        out = c._run(leaves, donate=donated) if donated and type(c) is Compiled else c._run(leaves)
        for i in donated:
            leaves[i].delete()  # (idempotent: one an output took is deleted already)
        return out

    def _donated(self, args: tuple, kwargs: dict, leaves: list[Any]) -> tuple[int, ...]:
        """The positions among ``leaves`` of the :class:`Array` s of donated arguments."""
        if not (self.donate_argnums or self.donate_argnames):
            return ()
        n = len(args)
        given = [args[i if i >= 0 else n + i] for i in self.donate_argnums if -n <= i < n]
        names = list(self._sig.parameters) if self._sig is not None else []
        for name in self.donate_argnames:
            if name in kwargs:
                given.append(kwargs[name])
            elif name in names and names.index(name) < n:
                given.append(args[names.index(name)])
        ids = {id(x) for g in given for x in jax.tree_util.tree_leaves(g) if isinstance(x, Array)}
        return tuple(i for i, x in enumerate(leaves) if id(x) in ids)

    def _apply(self, args: list[Any], defer: bool = False) -> Any:
        """Call with positional arguments, the launch deferred (``spyre_jax.Array``'s
        operators: :mod:`spyre_jax.array_ops`)."""
        key, leaves, info = self._split(tuple(args), {})
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self._bind(key, info, leaves)
        c = self._cache.get(key)
        if c is None:
            c = self._trace(key, info, key[1]).compile()
        return c._run(leaves, defer=defer)

    def _bind(self, key: Any, info: Any, leaves: list[Any]) -> Any:
        """Under a JAX transformation (a tracer among the arguments): the ``spyre_call``
        primitive on the traced jaxpr (:mod:`spyre_jax.transforms`), whose rules transform it
        and run the result on the card."""
        closed, out_tree, _, name = self._jaxpr(key, info, key[1])
        args = [_traced_arg(x) for x in leaves]
        outs = spyre_call(closed, args, name)
        return jax.tree_util.tree_unflatten(out_tree, outs)


def _traced_arg(x: Any) -> Any:
    """An argument as ``spyre_call`` binds it: tracers and JAX values as they are, a spyre
    Array or host value as a JAX array (int64 narrowed to int32, as the card holds it)."""
    if isinstance(x, jax.core.Tracer):
        return x
    if isinstance(x, Array):
        x._check_alive()
        return jax.numpy.asarray(np.asarray(x))
    return jax.numpy.asarray(np.asarray(x).astype(np.int32) if _is_int64(x) else x)


def jit(
    fun: Callable | None = None,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    keep_unused: bool = False,
    inline: bool = False,
    in_shardings: Any = None,
    out_shardings: Any = None,
) -> Any:
    """Compile ``fun`` for the simulated Spyre card, like ``jax.jit``.

    Pytrees in and out; compiled once per argument shapes, dtypes and static values (a second
    call with the same signature does not retrace). Array leaves are traced; other leaves (such
    as an equinox module's functions) are treated as static. Results are :class:`Array` s that
    stay in device memory.

    ``donate_argnums``/``donate_argnames``: the :class:`Array` s in those arguments are given
    up by the call: an output of the same shape and dtype takes one's device memory (no new
    allocation), and every one is deleted after the call (using it again raises JAX's
    ``RuntimeError``); host values donated are left alone. ``keep_unused``: accepted (every
    argument is a kernel argument here). ``inline``: under an outer trace (``jax.jit``, another
    transformation), trace ``fun`` into it instead of binding ``spyre_call``. ``in_shardings``/
    ``out_shardings``: ``NamedSharding`` s over a mesh of :func:`spyre_jax.devices` (pytree
    prefixes of the positional arguments and of the result): the function, written on global
    arrays, is partitioned over the cards (:mod:`spyre_jax.spmd`) into a ``jax.shard_map``
    program (docs/multicard-and-estimates.md). Under ``jax.disable_jit()`` the function
    runs op by op, as JAX's.
    """
    spmd.check_shardings(in_shardings, "in_shardings")
    spmd.check_shardings(out_shardings, "out_shardings")
    opts = {
        "donate_argnums": _ints(donate_argnums),
        "donate_argnames": (donate_argnames,)
        if isinstance(donate_argnames, str)
        else tuple(donate_argnames),
        "keep_unused": bool(keep_unused),
        "inline": bool(inline),
        "in_shardings": in_shardings,
        "out_shardings": out_shardings,
    }
    static_argnums = _ints(static_argnums)
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    if fun is None:
        return lambda f: Jitted(f, static_argnums, static_argnames, **opts)
    return Jitted(fun, static_argnums, static_argnames, **opts)


def _ints(v: int | Sequence[int]) -> tuple[int, ...]:
    return (int(v),) if isinstance(v, int) else tuple(int(i) for i in v)


transforms.set_jit(lambda f: Jitted(f, (), ()))
array_ops.install(Array, jit)
