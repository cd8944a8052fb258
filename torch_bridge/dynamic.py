"""Graphs with symbolic sizes: one card kernel per size bucket, else per concrete size.

Dynamo marks a size dynamic when it sees it change (a serving loop's sequence length, a growing
KV cache) or when asked (``dynamic=True``, ``torch._dynamo.mark_dynamic``); AOTAutograd then
hands the backend a graph whose inputs include ``SymInt`` sizes and tensors of symbolic shape.
The card's schedules are static. :class:`DynamicGraph` first pads the graph to size buckets
(``torch_bridge.padded``: one kernel per bucket, the padding masked). A graph whose padding
cannot be masked is specialized at call time instead: the sizes of the call's arguments bind
the symbols, ``make_fx`` traces the graph again over fake tensors of those sizes (every
symbolic expression folds to a number), and the static graph compiles as any other
(``compile_static``). Kernels are cached by the arguments' sizes and dtypes: a size seen before
launches its kernel at once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from lowering.errors import LoweringError, TilingError, UnsupportedPrimitiveError

from .graph_passes import copy_sources, core_decompositions, fold_constants
from .padded import NotBucketable, PaddedPlan

_log = logging.getLogger(__name__)

__all__ = ["DynamicGraph", "is_dynamic", "SPECIALIZATIONS"]

#: the most kernels one dynamic graph keeps (least recently used go first)
SPECIALIZATIONS = 64


def _symbolic(v: Any) -> bool:
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(v, torch.Tensor):
        return any(not isinstance(d, int) for d in v.shape)
    return False


def is_dynamic(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph takes symbolic sizes (a ``SymInt`` input or a tensor of symbolic shape)."""
    return any(_symbolic(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder")


def _key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((tuple(a.shape), a.dtype, a.device.type))
        elif isinstance(a, int | float | bool):
            out.append((type(a).__name__, a))
        else:
            out.append(type(a).__name__)
    return tuple(out)


class DynamicGraph:
    """A graph of symbolic sizes: a static card kernel per concrete size (see the module
    docstring). ``compile_static(gm)`` turns a static graph into its callable (the backend's
    whole-graph kernel, or its partition with CPU fallbacks); it takes ``weights=``, the
    indices of the static graph's inputs that are the model's weights, from ``weights`` (this
    graph's, AOTAutograd's static inputs)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        compile_static: Callable[..., Any],
        weights: Sequence[int] = (),
    ):
        self.gm = gm
        self.compile_static = compile_static
        self.weights = frozenset(weights)
        self.kernels: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self.compiles = 0
        self._lock = threading.Lock()
        #: whether calls run padded to size buckets (None until the first call decides)
        self.bucketed: bool | None = None
        #: why the graph runs per exact size, when it does
        self.reason = ""
        self.plan: PaddedPlan | None = None
        self.padded_calls = 0
        self.padding_bytes = 0
        self.padding_flops = 0
        self._last: Any = None

    def cost_analysis(self) -> dict[str, Any]:
        """The figures of the kernel of the last call; for a bucketed graph with the padding
        that call carried (``padding_bytes``, ``padding_flops``) and its ``bucket``."""
        k = self._last
        if k is None:
            return {}
        if hasattr(k, "cost_analysis"):
            return k.cost_analysis()
        run = getattr(k, "run", None)
        return run.cost_analysis() if hasattr(run, "cost_analysis") else {}

    def _padded(self, args: tuple[Any, ...]) -> tuple[bool, Any]:
        """Run the call on its bucket's kernel: (True, results), or (False, None) where the
        graph cannot be padded (it then runs per exact size from here on)."""
        try:
            with self._lock:
                if self.plan is None:
                    self.plan = PaddedPlan(self.gm, self.compile_static, self.weights)
                plan = self.plan
            values = plan.bind(args)
            key = plan.key(args, values)
            k = plan.kernels.get(key)
            if k is None:
                k = plan.kernel(args)[0]
                with self._lock:
                    self.compiles += 1
        except (NotBucketable, LoweringError, TilingError, UnsupportedPrimitiveError) as e:
            self.bucketed = False
            self.reason = f"{type(e).__name__}: {e}"
            _log.info("spyre: a dynamic graph runs per exact size: %s", self.reason)
            return False, None
        self.bucketed = True
        out = k(args, values)
        with self._lock:
            self._last = k
            self.padded_calls += 1
            self.padding_bytes += k.last["padding_bytes"]
            self.padding_flops += k.last["padding_flops"]
        return True, out

    def specialize(self, args: tuple[Any, ...]) -> torch.fx.GraphModule:
        """The graph traced again at the sizes of ``args``: a static graph of core ATen ops."""
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:  # fakes of the arguments' sizes, on their devices (nothing allocated)
            fakes = [
                torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                if isinstance(a, torch.Tensor)
                else a
                for a in args
            ]
        with torch.no_grad():
            static = make_fx(
                self.gm,
                decomposition_table=core_decompositions(),
                tracing_mode="fake",
                _allow_non_fake_inputs=True,
            )(*fakes)
        copy_sources(self.gm, static)
        # the sizes are numbers in the traced graph now: their inputs have no users; drop them
        for n in list(static.graph.nodes):
            if (
                n.op == "placeholder"
                and not n.users
                and not isinstance(n.meta.get("val"), torch.Tensor)
            ):
                static.graph.erase_node(n)
        fold_constants(static)
        static.recompile()
        return static

    def __call__(self, *args: Any) -> Any:
        if self.bucketed is not False:
            done, out = self._padded(args)
            if done:
                return out
        key = _key(args)
        with self._lock:
            run = self.kernels.get(key)
            if run is not None:
                self.kernels.move_to_end(key)
        if run is None:
            keep = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            weights = tuple(j for j, i in enumerate(keep) if i in self.weights)
            run = _Specialized(self.compile_static(self.specialize(args), weights=weights), args)
            with self._lock:
                self.kernels[key] = run
                self.compiles += 1
                while len(self.kernels) > SPECIALIZATIONS:
                    self.kernels.popitem(last=False)
        self._last = run
        return run(*args)


class _Specialized:
    """A static kernel of a dynamic graph: called with the graph's arguments, it takes the
    tensors (the sizes are numbers inside it)."""

    def __init__(self, run: Any, args: tuple[Any, ...]):
        self.run = run
        self.keep = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def __call__(self, *args: Any) -> Any:
        return self.run(*[args[i] for i in self.keep])
