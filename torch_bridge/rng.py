"""Random numbers on the card for PyTorch: the ``spyre`` device's generator, its eager kernels, and
the rewrite of random ops in graphs compiled with ``torch.compile(backend="spyre")``.

**The generator.** Like CUDA's Philox generator, the card's is counter-based: its state is a
64-bit seed and a 64-bit offset, the count of draws made so far. ``torch.manual_seed(s)`` (through
``torch.spyre.manual_seed_all``) and ``torch.spyre.manual_seed(s)`` set the seed to ``s`` and the
offset to 0; ``torch.seed()`` seeds it at random; ``torch.spyre.get_rng_state()`` is the state
as 16 bytes (seed, offset; little-endian) and ``set_rng_state`` puts one back (so
``torch.random.fork_rng(device_type="spyre")`` works). Each random op takes the state, advances
the offset by one and passes the state to the card with the op (int32 ``[4]``, copied in), where
Threefry-2x32 computes the numbers (:mod:`lowering.rng_ops`): the same seed gives the same
numbers run to run, on the eager device and in compiled graphs, but not the CPU's numbers (a
different generator, as on CUDA).

**generator=.** PyTorch cannot make a ``torch.Generator`` for a device registered from Python
(its C++ hooks would have to make one), so a random op on spyre tensors accepts a CPU
``torch.Generator``: the op draws a 64-bit seed from it (advancing it) and uses that seed with
offset 0. The same generator state gives the same numbers; ``generator.get_state()`` saves it.

**Eager ops.** The in-place fills (``uniform_``, ``normal_``, ``random_``, ``bernoulli_``,
``exponential_``, ``log_normal_``, ``cauchy_``, ``geometric_``: what ``torch.rand``,
``randn``, ``randint``, ``rand_like`` ... become on a device), ``bernoulli``, ``multinomial``,
``native_dropout`` and ``randperm`` run on the card as the op ``spyre_jax::random`` (or
``spyre_jax::dropout``), one cached kernel per shape and distribution.

**Compiled graphs.** :func:`rewrite_random` replaces the random ops of a graph by those two ops,
each reading the state from a new graph input; :func:`draw_states` makes the states for a call.
In training graphs the forward's dropout mask is saved for the backward; a random op that
``torch.utils.checkpoint`` recomputes in the backward replays the forward's state there.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from lowering.fx_random import DROPOUT, RANDOM

from . import eager

__all__ = [
    "manual_seed",
    "seed",
    "initial_seed",
    "get_rng_state",
    "set_rng_state",
    "next_state",
    "rewrite_random",
    "draw_states",
    "register",
]

aten = torch.ops.aten
_Gen = torch.Generator | None
_MASK64 = (1 << 64) - 1
#: the seed before any ``manual_seed`` (CUDA's default seed, for the same reason: a fixed one)
DEFAULT_SEED = 67280421310721


class _Generator:
    """The device's generator: seed and offset (draws made), under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seed = DEFAULT_SEED
        self.offset = 0

    def take(self) -> tuple[int, int]:
        with self.lock:
            s, o = self.seed, self.offset
            self.offset = (o + 1) & _MASK64
            return s, o


_gen = _Generator()


def manual_seed(seed: int) -> None:
    """Seed the card's generator (offset back to 0); ``torch.manual_seed`` calls it too."""
    with _gen.lock:
        _gen.seed, _gen.offset = int(seed) & _MASK64, 0


def seed() -> int:
    """Seed the card's generator with a random number; returns it."""
    s = int.from_bytes(os.urandom(8), "little") >> 1
    manual_seed(s)
    return s


def initial_seed() -> int:
    """The seed of the card's generator."""
    return _gen.seed


def get_rng_state(device: Any = None) -> torch.Tensor:
    """The generator's state: uint8 ``[16]``, the seed and the offset (little-endian)."""
    with _gen.lock:
        raw = _gen.seed.to_bytes(8, "little") + _gen.offset.to_bytes(8, "little")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    """Put back a state of :func:`get_rng_state`."""
    if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
        raise TypeError("spyre: set_rng_state takes a uint8 tensor (get_rng_state's)")
    if new_state.numel() != 16:
        raise ValueError(f"spyre: an RNG state has 16 bytes, not {new_state.numel()}")
    raw = bytes(new_state.cpu().contiguous().tolist())
    with _gen.lock:
        _gen.seed = int.from_bytes(raw[:8], "little")
        _gen.offset = int.from_bytes(raw[8:], "little")


def _words(s: int, o: int) -> torch.Tensor:
    vals = [s & 0xFFFFFFFF, s >> 32, o & 0xFFFFFFFF, (o >> 32) & 0xFFFFFFFF]
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in vals], dtype=torch.int32)


def next_state(generator: torch.Generator | None = None) -> torch.Tensor:
    """The state for one draw (int32 ``[4]`` on the CPU): the device generator's, advanced by
    one; or, with a CPU ``generator``, a seed drawn from it and offset 0."""
    if generator is None:
        return _words(*_gen.take())
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"spyre: generator= takes a torch.Generator, not {type(generator)}")
    if generator.device.type != "cpu":
        raise RuntimeError(
            f"spyre: a random op on spyre tensors takes a CPU generator (it draws the card's "
            f"seed from it), not one of device {generator.device}"
        )
    s = int(torch.empty((), dtype=torch.int64).random_(generator=generator))
    return _words(s, 0)


# ---------------------------------------------------------------------------------------------
# eager kernels


def _draw(
    like: torch.Tensor,
    dist: str,
    a: float = 0.0,
    b: float = 0.0,
    *,
    x: torch.Tensor | None = None,
    n: int = 0,
    shape: Any = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    state = next_state(generator).to(like.device)
    size = list(like.shape if shape is None else shape)
    return RANDOM(state, x, dist, size, dtype or like.dtype, float(a), float(b), int(n))


def _fill(self: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    with torch._C._AutoDispatchBelowAutograd():
        self.copy_(r)
    return self


#: the largest integer ``random_()`` draws for a float dtype (its contiguous integers) or an
#: integer dtype (on the card's int32)
def _random_top(dtype: torch.dtype) -> int:
    if dtype.is_floating_point:
        return {torch.float16: 1 << 11, torch.bfloat16: 1 << 8}.get(dtype, 1 << 24)
    if dtype == torch.bool:
        return 1
    return min(torch.iinfo(dtype).max, (1 << 31) - 1)


def _uniform_(
    self: torch.Tensor, from_: float = 0.0, to: float = 1.0, *, generator: _Gen = None
) -> torch.Tensor:
    return _fill(self, _draw(self, "uniform", from_, to, generator=generator))


def _normal_(
    self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: _Gen = None
) -> torch.Tensor:
    return _fill(self, _draw(self, "normal", mean, std, generator=generator))


def _log_normal_(
    self: torch.Tensor, mean: float = 1.0, std: float = 2.0, *, generator: _Gen = None
) -> torch.Tensor:
    return _fill(self, _draw(self, "log_normal", mean, std, generator=generator))


def _exponential_(
    self: torch.Tensor, lambd: float = 1.0, *, generator: _Gen = None
) -> torch.Tensor:
    return _fill(self, _draw(self, "exponential", lambd, generator=generator))


def _cauchy_(
    self: torch.Tensor, median: float = 0.0, sigma: float = 1.0, *, generator: _Gen = None
) -> torch.Tensor:
    return _fill(self, _draw(self, "cauchy", median, sigma, generator=generator))


def _geometric_(self: torch.Tensor, p: float, *, generator: _Gen = None) -> torch.Tensor:
    return _fill(self, _draw(self, "geometric", p, generator=generator))


def _random_(self: torch.Tensor, *, generator: _Gen = None) -> torch.Tensor:
    top = _random_top(self.dtype)
    return _fill(self, _draw(self, "randint", 0, top + 1, generator=generator))


def _random_from(
    self: torch.Tensor, from_: int, to: int | None = None, *, generator: _Gen = None
) -> torch.Tensor:
    hi = _random_top(self.dtype) + 1 if to is None else to
    return _fill(self, _draw(self, "randint", from_, hi, generator=generator))


def _random_to(self: torch.Tensor, to: int, *, generator: _Gen = None) -> torch.Tensor:
    return _fill(self, _draw(self, "randint", 0, to, generator=generator))


def _bernoulli_float(self: torch.Tensor, p: float = 0.5, *, generator: _Gen = None) -> torch.Tensor:
    return _fill(self, _draw(self, "bernoulli", p, generator=generator))


def _bernoulli_tensor(
    self: torch.Tensor, p: torch.Tensor, *, generator: _Gen = None
) -> torch.Tensor:
    probs = p.to(self.device).expand(self.shape)
    return _fill(self, _draw(self, "bernoulli", x=probs, generator=generator))


def _bernoulli(self: torch.Tensor, *, generator: _Gen = None) -> torch.Tensor:
    return _draw(self, "bernoulli", x=self, generator=generator)


def _bernoulli_p(self: torch.Tensor, p: float, *, generator: _Gen = None) -> torch.Tensor:
    return _draw(self, "bernoulli", p, generator=generator)


def _multinomial(
    self: torch.Tensor, num_samples: int, replacement: bool = False, *, generator: _Gen = None
) -> torch.Tensor:
    _check_multinomial(self, num_samples, replacement)
    return _draw(
        self,
        "multinomial",
        0.0,
        float(bool(replacement)),
        x=self,
        n=num_samples,
        dtype=torch.int64,
        generator=generator,
    )


def _check_multinomial(probs: torch.Tensor, n: int, replacement: bool) -> None:
    """torch's argument checks of ``multinomial`` (those that need no look at the values)."""
    if probs.dim() not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not probs.dtype.is_floating_point:
        raise RuntimeError(
            f"multinomial only supports floating-point dtypes for input, got: "
            f"{str(probs.dtype).removeprefix('torch.').title()}"
        )
    if n <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and n > probs.shape[-1]:
        raise RuntimeError(
            "cannot sample n_sample > prob_dist.size(-1) samples without replacement"
        )


def _native_dropout(
    x: torch.Tensor, p: float, train: bool | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    return DROPOUT(next_state().to(x.device), x, float(p))


def _randperm_out(n: int, *, generator: _Gen = None, out: torch.Tensor) -> torch.Tensor:
    if n < 0:
        raise RuntimeError(f"randperm: n must be non-negative, got {n}")
    out.resize_(n)
    if n:
        r = _draw(out, "randperm", n=n, shape=(), dtype=out.dtype, generator=generator)
        _fill(out, r)
    return out


def _normal_of(mean: Any, std: Any = 1.0, *, generator: _Gen = None) -> torch.Tensor:
    """``torch.normal`` with a tensor mean and/or std: ``mean + std * z``."""
    like = mean if isinstance(mean, torch.Tensor) else std
    shape = torch.broadcast_shapes(*(t.shape for t in (mean, std) if isinstance(t, torch.Tensor)))
    z = _draw(like, "normal", 0.0, 1.0, shape=shape, generator=generator)
    return mean + std * z


_KERNELS = {
    "normal.Tensor_Tensor": _normal_of,
    "normal.Tensor_float": _normal_of,
    "normal.float_Tensor": _normal_of,
    "uniform_": _uniform_,
    "normal_": _normal_,
    "log_normal_": _log_normal_,
    "exponential_": _exponential_,
    "cauchy_": _cauchy_,
    "geometric_": _geometric_,
    "random_": _random_,
    "random_.from": _random_from,
    "random_.to": _random_to,
    "bernoulli_.float": _bernoulli_float,
    "bernoulli_.Tensor": _bernoulli_tensor,
    "bernoulli": _bernoulli,
    "bernoulli.p": _bernoulli_p,
    "multinomial": _multinomial,
    "native_dropout": _native_dropout,
    "randperm.generator_out": _randperm_out,
}


def _skip_empty(kernel: Any) -> Any:
    """Draws of no element take no state and launch nothing."""

    def k(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, torch.Tensor) and self.numel() == 0 and kernel is not _randperm_out:
            if kernel is _native_dropout:
                return self.clone(), torch.ones_like(self, dtype=torch.bool)
            return self if kernel.__name__.endswith("_") else torch.empty_like(self)
        return kernel(self, *args, **kwargs)

    k.__name__ = kernel.__name__
    return k


_libs: list[torch.library.Library] = []


def register(lib: torch.library.Library) -> None:
    """The spyre kernels of the random ops (into ``lib``, PyTorch's ``aten`` namespace) and of
    ``spyre_jax::random``/``dropout`` (compiled per signature like every eager op)."""
    for name, kernel in _KERNELS.items():
        lib.impl(name, _skip_empty(kernel), "PrivateUse1")
    own = torch.library.Library("spyre_jax", "IMPL")
    _libs.append(own)
    own.impl("random", eager._kernel_for(RANDOM), "PrivateUse1")
    own.impl("dropout", eager._kernel_for(DROPOUT), "PrivateUse1")


# ---------------------------------------------------------------------------------------------
# compiled graphs


def _dist_of(n: torch.fx.Node) -> tuple[str, Any, float, float, int] | None:
    """(distribution, tensor operand, a, b, n) of a random ATen node, or None."""
    t, args, kw = n.target, n.args, n.kwargs
    val = n.meta.get("val")
    dtype = getattr(val, "dtype", torch.float32)

    def arg(i: int, name: str, default: Any) -> Any:
        return args[i] if len(args) > i else kw.get(name, default)

    if t in (aten.rand.default, aten.rand_like.default):
        return "uniform", None, 0.0, 1.0, 0
    if t in (aten.randn.default, aten.randn_like.default):
        return "normal", None, 0.0, 1.0, 0
    if t == aten.randint.default:
        return "randint", None, 0, arg(0, "high", 0), 0
    if t == aten.randint.low:
        return "randint", None, arg(0, "low", 0), arg(1, "high", 0), 0
    if t == aten.randint_like.default:
        return "randint", None, 0, arg(1, "high", 0), 0
    if t == aten.randint_like.low_dtype:
        return "randint", None, arg(1, "low", 0), arg(2, "high", 0), 0
    if t == aten.uniform.default:
        return "uniform", None, arg(1, "from", 0.0), arg(2, "to", 1.0), 0
    if t == aten.normal_functional.default:
        return "normal", None, arg(1, "mean", 0.0), arg(2, "std", 1.0), 0
    if t == aten.exponential.default:
        return "exponential", None, arg(1, "lambd", 1.0), 0.0, 0
    if t == aten.cauchy.default:
        return "cauchy", None, arg(1, "median", 0.0), arg(2, "sigma", 1.0), 0
    if t == aten.log_normal.default:
        return "log_normal", None, arg(1, "mean", 1.0), arg(2, "std", 2.0), 0
    if t == aten.geometric.default:
        return "geometric", None, arg(1, "p", 0.5), 0.0, 0
    if t == aten.random.default:
        return "randint", None, 0, _random_top(dtype) + 1, 0
    if t == aten.random.to:
        return "randint", None, 0, arg(1, "to", 1), 0
    if t == getattr(aten.random, "from"):
        hi = arg(2, "to", None)
        return "randint", None, arg(1, "from", 0), _random_top(dtype) + 1 if hi is None else hi, 0
    if t == aten.bernoulli.default:
        return "bernoulli", args[0], 0.0, 0.0, 0
    if t == aten.bernoulli.p:
        return "bernoulli", None, arg(1, "p", 0.5), 0.0, 0
    if t == aten.multinomial.default:
        return (
            "multinomial",
            args[0],
            0.0,
            float(bool(arg(2, "replacement", False))),
            arg(1, "num_samples", 1),
        )
    if t in (aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor):
        return "normal_of", None, 0.0, 0.0, 0
    if t == aten.normal.float_float:
        return "normal", None, arg(0, "mean", 0.0), arg(1, "std", 1.0), 0
    if t == aten.randperm.default:
        return "randperm", None, 0.0, 0.0, arg(0, "n", 0)
    return None


#: random factories' ``size`` argument: its position
_SIZE_AT = {
    aten.rand.default: 0,
    aten.randn.default: 0,
    aten.randint.default: 1,
    aten.randint.low: 2,
    aten.normal.float_float: 2,
}


def _size(g: torch.fx.Graph, n: torch.fx.Node) -> list[Any]:
    """The size of ``n``'s draw as graph values: a factory's own ``size`` argument, else the
    sizes of the tensor operand of the result's shape (``aten.sym_size`` nodes for symbolic
    ones, so that a graph of symbolic sizes stays one)."""
    at = _SIZE_AT.get(n.target)
    if at is not None:
        return list(n.args[at] if len(n.args) > at else n.kwargs["size"])
    shape = n.meta["val"].shape
    for x in n.args:
        v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if isinstance(v, torch.Tensor) and v.shape == shape:
            out: list[Any] = []
            for i, d in enumerate(shape):
                if isinstance(d, int):
                    out.append(d)
                else:
                    s = g.call_function(aten.sym_size.int, (x, i))
                    s.meta["val"] = d
                    out.append(s)
            return out
    return [int(d) for d in shape]


#: the higher-order ops AOTAutograd wraps a random op in when ``torch.utils.checkpoint``
#: recomputes it in the backward: the forward saves the generator's state, the backward replays
_SAVE_RNG = getattr(torch.ops.higher_order, "run_and_save_rng_state", None)
_WITH_RNG = getattr(torch.ops.higher_order, "run_with_rng_state", None)


def _random_kind(n: torch.fx.Node) -> tuple[bool, Any]:
    """(whether ``n`` is a random op this rewrite replaces, its :func:`_dist_of` or None for
    ``native_dropout`` in training)."""
    if n.op != "call_function" or n.kwargs.get("generator") is not None:
        return False, None
    if n.target == aten.native_dropout.default:
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train")
        return bool(train), None
    d = _dist_of(n)
    return d is not None, d


def _unwrap_rng_hops(g: torch.fx.Graph) -> dict[torch.fx.Node, tuple[str, torch.fx.Node]]:
    """Replace each ``run_and_save_rng_state(op, ...)`` / ``run_with_rng_state(state, op, ...)``
    over a random op this rewrite replaces by the plain ``op(...)`` node. Returns plain node ->
    ("save", the node that stood for the saved state) or ("replay", the state it replays): the
    caller gives the first a new state input, which also becomes the saved state (the forward
    returns it for the backward), and the second the state it was given (a card state)."""
    out: dict[torch.fx.Node, tuple[str, torch.fx.Node]] = {}
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is None or n.target not in (_SAVE_RNG, _WITH_RNG):
            continue
        save = n.target is _SAVE_RNG
        op, args = (n.args[0], n.args[1:]) if save else (n.args[1], n.args[2:])
        with g.inserting_before(n):
            plain = g.call_function(op, tuple(args), dict(n.kwargs))
        val = n.meta.get("val")
        plain.meta.update(n.meta)
        plain.meta["val"] = val[1] if save and isinstance(val, list | tuple) else val
        if not _random_kind(plain)[0]:
            g.erase_node(plain)
            continue
        if save:
            state = g.create_node("placeholder", "spyre_saved_rng_state")  # stand-in, replaced
            for u in list(n.users):  # getitem(n, 0): the state; getitem(n, 1): the result
                u.replace_all_uses_with(plain if u.args[1] == 1 else state)
                g.erase_node(u)
            out[plain] = ("save", state)
        else:
            state = n.args[0]
            if state.op == "placeholder":  # the saved state comes back as a card state
                state.meta["val"] = torch.empty(4, dtype=torch.int32)
            n.replace_all_uses_with(plain)
            out[plain] = ("replay", state)
        g.erase_node(n)
    return out


def _state_input(g: torch.fx.Graph, phs: list[torch.fx.Node], i: int) -> torch.fx.Node:
    """A new state input (int32 ``[4]``) after the graph's inputs."""
    where = g.inserting_after(phs[-1]) if phs else g.inserting_before(next(iter(g.nodes)))
    with where:
        st = g.placeholder(f"spyre_rng_state_{i}")
    phs.append(st)
    st.meta["val"] = torch.empty(4, dtype=torch.int32)
    return st


def _replace_random(g: torch.fx.Graph, n: torch.fx.Node, d: Any, st: torch.fx.Node) -> None:
    """``n`` (a random op; ``d`` its :func:`_dist_of`, None for dropout) as ``spyre_jax``'s
    random op or dropout reading state ``st``."""
    with g.inserting_before(n):
        if d is None:
            new = g.call_function(DROPOUT, (st, n.args[0], float(n.args[1])))
        elif d[0] == "normal_of":
            val = n.meta["val"]
            size = _size(g, n)
            z = g.call_function(RANDOM, (st, None, "normal", size, val.dtype, 0.0, 1.0, 0))
            z.meta.update(n.meta)
            mean, std = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("std", 1.0)
            scaled = g.call_function(aten.mul.Tensor, (z, std))
            scaled.meta.update(n.meta)
            new = g.call_function(aten.add.Tensor, (scaled, mean))
        else:
            dist, x, a, b, cnt = d
            val = n.meta["val"]
            size = _size(g, n) if dist not in ("multinomial", "randperm") else []
            new = g.call_function(
                RANDOM, (st, x, dist, size, val.dtype, float(a), float(b), int(cnt))
            )
    new.meta.update(n.meta)
    n.replace_all_uses_with(new)
    g.erase_node(n)


def rewrite_random(gm: torch.fx.GraphModule) -> int:
    """Replace ``gm``'s random ops by ``spyre_jax::random``/``dropout``, each reading its state
    from a new input placed after the graph's own; returns how many inputs were added (one per
    random op: :func:`draw_states` makes them for a call). ``native_dropout`` in training becomes
    ``spyre_jax::dropout``. A ``generator=`` in a graph is left alone (the op stays, and runs
    where an op without a rule runs).

    A random op that ``torch.utils.checkpoint`` recomputes in the backward comes wrapped in
    AOTAutograd's ``run_and_save_rng_state`` (forward) and ``run_with_rng_state`` (backward):
    the forward's draws from a new state input as any other, and returns that state where it
    returned the CPU generator's; the backward's replays it, reading that state from its input,
    so both draw the same numbers on the card."""
    g = gm.graph
    hops = _unwrap_rng_hops(g)
    todo = []
    for n in g.nodes:
        take, d = _random_kind(n)
        if take:
            todo.append((n, d))
    if not todo:
        return 0
    stand_ins = {state for kind, state in hops.values() if kind == "save"}
    phs = [n for n in g.nodes if n.op == "placeholder" and n not in stand_ins]
    added = 0
    for n, d in todo:
        kind, state = hops.get(n, ("draw", None))
        if kind == "replay":
            st = state
        else:
            st = _state_input(g, phs, added)
            added += 1
            if kind == "save":
                state.replace_all_uses_with(st)
                g.erase_node(state)
        _replace_random(g, n, d, st)
    g.lint()
    gm.recompile()
    return added


def draw_states(k: int) -> list[torch.Tensor]:
    """The states of a call of a graph :func:`rewrite_random` gave ``k`` state inputs."""
    return [next_state() for _ in range(k)]
