"""The card program: a kernel as one jitted program, or a whole model as cached stage programs.

``build_runner(kernel)`` turns a :class:`~device_model.kernel.Kernel` into a function from the
kernel's input device buffers to its output device buffers, running every stage on the
vectorized card (:func:`device_model.execute.run_stage`). A short kernel is one ``jax.jit``
program; a long one runs stage by stage, each stage a jitted program cached by its signature,
so that the identical layers of a model compile once.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp

from . import xla_host  # noqa: F401  (first: the CPU client's dispatch)
from .execute import COMPILER_OPTIONS, run_kernel, run_stage
from .kernel import Kernel, Stage, TensorDecl, step_reads
from .layout import np_dtype
from .progress import Progress
from .steps import GatherStep

__all__ = [
    "build_runner",
    "stage_program",
    "stage_cache_stats",
    "guard_mappings",
    "STAGED_MIN_STAGES",
]

log = logging.getLogger("device_model")

#: kernels of more stages than this run stage by stage (see :func:`build_runner`)
STAGED_MIN_STAGES = 24

#: a staged run lets at most this many stages be dispatched ahead of the one that runs
INFLIGHT_STAGES = 8

#: jitted stage programs by structural signature, shared by every kernel (LRU, this many)
STAGE_CACHE_SIZE = 4096
_stage_cache: OrderedDict[Any, Callable[..., jax.Array]] = OrderedDict()
_stage_stats = {"compiled": 0, "reused": 0}


def _malloc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``, or a no-op where the C library has none."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]

    def release() -> None:
        trim(0)

    return release


#: after each new stage program compiles, the heap's free pages go back to the OS: XLA's
#: compiler threads free their working memory into per-thread arenas, which would otherwise stay
#: in the process's resident memory and grow it by some MB per program compiled
release_free_memory = _malloc_trim()


def _map_limit() -> int:
    """The OS's limit on one process's memory mappings (Linux: ``vm.max_map_count``; 0 where
    there is none to read)."""
    try:
        with open("/proc/sys/vm/max_map_count") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return 0


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as fh:
            return fh.read().count(b"\n")
    except OSError:
        return 0


#: the share of the process's mapping limit the compiled card programs may take before
#: :func:`guard_mappings` drops JAX's compiled programs (each XLA CPU program holds about six
#: memory mappings of its code and data: some ten thousand of them reach Linux's default limit
#: of 65530, where the next compile fails inside LLVM and the process dies)
MAP_BUDGET = 0.5
#: :func:`guard_mappings` reads the mapping count once per this many programs built
MAP_CHECK_EVERY = 64
_map_state = {"limit": -1, "built": 0, "cleared": 0, "floor": 0}


def guard_mappings() -> bool:
    """Called as card programs are built: every :data:`MAP_CHECK_EVERY` of them, when the
    process holds more than :data:`MAP_BUDGET` of its mapping limit, drop the compiled programs
    (the stage cache and JAX's caches: ``jax.clear_caches``; each compiles again when next
    used) and say so in the log. True when it dropped them."""
    _map_state["built"] += 1
    if _map_state["built"] % MAP_CHECK_EVERY:
        return False
    if _map_state["limit"] < 0:
        _map_state["limit"] = _map_limit()
    limit = _map_state["limit"]
    if not limit:
        return False
    held = _mappings()
    if held <= max(MAP_BUDGET * limit, _map_state["floor"]):
        return False
    _stage_cache.clear()
    jax.clear_caches()
    release_free_memory()
    _map_state["cleared"] += 1
    after = _mappings()
    # what the drop could not free (other libraries' mappings) is not the card's to free: the
    # next drop waits until the programs built since hold half of what is left
    _map_state["floor"] = after + (limit - after) // 2
    log.info(
        "spyre: %d memory mappings of a limit of %d: compiled card programs dropped "
        "(they compile again when next used); now %d",
        held,
        limit,
        after,
    )
    return True


def stage_cache_stats() -> dict[str, int]:
    """How many stage programs were built and how many times one was reused (see
    :func:`build_runner`), and how many the cache holds."""
    return {**_stage_stats, "cached": len(_stage_cache)}


def _canonical(
    stage: Stage, decls: dict[str, TensorDecl], ncores: int, dl16: bool
) -> tuple[Any, tuple[str, ...]]:
    """A stage's signature, free of tensor names, and the tensors it reads, in order.

    Two stages with one signature compute the same function of their inputs: the same tables,
    bodies and scratchpad plan over tensors of the same layouts (the tensors renamed ``t0``,
    ``t1``, ... in order of first use, whatever their roles). The identical layers of a model
    give identical stages.
    """
    reads = [op.tensor for op in stage.inputs]
    reads.extend(step_reads(stage.step))
    names = list(dict.fromkeys([*reads, stage.output.tensor]))
    ren = {n: f"t{i}" for i, n in enumerate(names)}
    step = stage.step
    if isinstance(step, GatherStep):
        step = replace(step, table=ren[step.table])
    canon = replace(
        stage,
        name="",
        source="",
        inputs=tuple(replace(op, tensor=ren[op.tensor]) for op in stage.inputs),
        output=replace(stage.output, tensor=ren[stage.output.tensor]),
        step=step,
    )
    # a tensor's role (input, view, temp, ...) is not part of it: the program reads and writes
    # arrays of the same layouts either way (the same layer's stages read a model input in the
    # first layer and an intermediate in the others)
    layouts = tuple(decls[n].layout for n in names)
    return (canon, layouts, ncores, dl16), tuple(dict.fromkeys(reads))


def _stage_program(key: Any) -> Callable[..., jax.Array]:
    canon, layouts, ncores, dl16 = key
    decls = {f"t{i}": TensorDecl(f"t{i}", lay, "temp") for i, lay in enumerate(layouts)}

    def program(*args: jax.Array) -> jax.Array:
        # an argument may be another view of the tensor's buffer: reshaped here, inside the jit
        env = {f"t{i}": a.reshape(decls[f"t{i}"].layout.device_shape) for i, a in enumerate(args)}
        return run_stage(canon, env, decls, ncores, dl16)

    return jax.jit(program, compiler_options=COMPILER_OPTIONS)


def stage_program(
    stage: Stage, decls: dict[str, TensorDecl], ncores: int, dl16: bool
) -> tuple[Callable[..., jax.Array], tuple[str, ...], bool]:
    """The jitted program of one stage, shared by every stage of the same signature, the names
    of the tensors it takes (in order), and whether it is new (not found in the cache)."""
    key, reads = _canonical(stage, decls, ncores, dl16)
    try:
        fn = _stage_cache.get(key)
    except TypeError:  # a body with an unhashable parameter: a program of its own
        _stage_stats["compiled"] += 1
        return _stage_program(key), reads, True
    if fn is None:
        guard_mappings()
        fn = _stage_cache[key] = _stage_program(key)
        _stage_stats["compiled"] += 1
        while len(_stage_cache) > STAGE_CACHE_SIZE:
            _stage_cache.popitem(last=False)
        return fn, reads, True
    with contextlib.suppress(KeyError):  # guard_mappings may have emptied the cache since
        _stage_cache.move_to_end(key)
    _stage_stats["reused"] += 1
    return fn, reads, False


def _alias_groups(kernel: Kernel) -> dict[str, list[str]]:
    """Each tensor's alias group (itself, its views and bases: one buffer), itself first."""
    adj: dict[str, set[str]] = {}
    for v, b in kernel.aliases:
        adj.setdefault(v, set()).add(b)
        adj.setdefault(b, set()).add(v)
    groups: dict[str, list[str]] = {}
    for name in adj:
        seen, todo = [name], [name]
        while todo:
            for m in adj[todo.pop()]:
                if m not in seen:
                    seen.append(m)
                    todo.append(m)
        groups[name] = seen
    return groups


def _last_uses(
    kernel: Kernel,
    steps: list[tuple[str, Any, tuple[str, ...], bool]],
    groups: dict[str, list[str]],
) -> list[list[str]]:
    """For each step, the tensors (with their views) no later step reads and that are not
    outputs: a staged run drops them after that step, so a model's intermediates (a layer's
    activations, a weight re-laid out for its matmul) do not all stay alive to the end."""
    last: dict[str, int] = {}
    for i, (out, _, reads, _) in enumerate(steps):
        for n in (*reads, out):
            for m in groups.get(n, (n,)):
                last[m] = i
    keep = {m for o in kernel.outputs for m in groups.get(o, (o,))}
    frees: list[list[str]] = [[] for _ in steps]
    for name, i in last.items():
        if name not in keep:
            frees[i].append(name)
    return frees


#: a stage whose simulated scratchpads and output take at least this many bytes is run, in a
#: warm run, after the heap's free pages went back to the OS (``malloc_trim``, a few ms): its
#: temporaries would otherwise come on top of the earlier stages' freed but retained ones, and
#: the host's peak memory be theirs and its together
BIG_STAGE_BYTES = 32 << 20


def _big_stages(kernel: Kernel, decls: dict[str, TensorDecl]) -> set[int]:
    big = set()
    for i, st in enumerate(kernel.stages):
        work = kernel.num_cores * st.sp_peak_bytes + decls[st.output.tensor].layout.nbytes
        if work >= BIG_STAGE_BYTES:
            big.add(i)
    return big


def build_runner(kernel: Kernel) -> Callable[..., list[jax.Array]]:
    """The kernel as a function ``runner(*input_buffers) -> output_buffers``.

    A kernel of up to :data:`STAGED_MIN_STAGES` stages is one ``jax.jit`` program (XLA sees it
    whole; its launch is one dispatch). A longer one, a whole model, runs stage by stage, each
    stage a jitted program cached by its signature (:func:`stage_program`): the identical layers
    of a model compile once, so compile time does not grow with depth.
    """
    guard_mappings()
    if len(kernel.stages) <= STAGED_MIN_STAGES:

        def program(*args: jax.Array) -> list[jax.Array]:
            return run_kernel(kernel, list(args))

        return jax.jit(program, compiler_options=COMPILER_OPTIONS)

    decls = {t.name: t for t in kernel.tensors}
    steps = [
        (st.output.tensor, *stage_program(st, decls, kernel.num_cores, kernel.dl16))
        for st in kernel.stages
    ]
    groups = _alias_groups(kernel)

    def lookup(env: dict[str, Any], name: str) -> Any:
        for m in groups.get(name, (name,)):
            if m in env:
                return env[m]
        raise KeyError(name)

    frees = _last_uses(kernel, steps, groups)
    first_run = [True]
    big = _big_stages(kernel, decls)

    def runner(*args: Any) -> list[jax.Array]:
        env: dict[str, Any] = dict(zip(kernel.inputs, args, strict=True))
        bar = Progress(f"{kernel.name}: stages", len(steps), log) if first_run[0] else None
        # the first run compiles the new stage programs: a progress bar when it is long
        for i, (out, fn, reads, new) in enumerate(steps):
            if i in big and bar is None and i > 0:
                # a stage of a large working set starts from a heap with the free pages of the
                # stages before it handed back (see :data:`BIG_STAGE_BYTES`)
                jax.block_until_ready([env[o] for o, *_ in steps[i - 1 : i] if o in env])
                release_free_memory()
            env[out] = fn(*[lookup(env, n) for n in reads])
            if new and bar is not None:
                release_free_memory()
            elif i % INFLIGHT_STAGES == INFLIGHT_STAGES - 1:
                # JAX dispatches ahead and each dispatched stage holds its output already:
                # without a wait, a warm run would hold every intermediate of the model at once
                env[out].block_until_ready()
            for name in frees[i]:  # dead after its last reader: its memory goes now
                env.pop(name, None)
            if bar is not None:
                bar.update(1, **({"compiled": 1} if new else {"reused": 1}))
        if bar is not None:
            bar.close()
            first_run[0] = False
        else:
            # the freed intermediates' pages go back too, or each run's would add to the next
            jax.block_until_ready([env[o] for o, *_ in steps[-1:] if o in env])
            release_free_memory()
        results = []
        for o in kernel.outputs:
            lay = decls[o].layout
            try:
                a = lookup(env, o)
            except KeyError:  # a tensor without elements: no stage writes it
                a = jnp.zeros(lay.device_shape, np_dtype(lay.dtype))
            results.append(jnp.asarray(a).reshape(lay.device_shape))
        return results

    return runner
