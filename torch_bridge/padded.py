"""Graphs of symbolic sizes compiled once per size bucket, with the padding masked.

A graph Dynamo hands over with symbolic sizes (``SymInt`` inputs, tensors of shape
``(1, 2, s0 + 1, 16)``) runs here as a static card kernel whose symbolic dimensions are padded
up to their bucket. The rule is :func:`torch_bridge.buckets.bucket`: 64 up to 64, then the next
power of two. Each symbol's bucket fixes an upper bound for every size expression in the graph.
The static size of a dimension is that bound, for example ``s0 + 1`` with ``s0`` in bucket 128
gives 129. One kernel thus serves every size in the bucket, and the number of compiles grows
with the logarithm of the largest size, not with the number of sizes seen.

Padding must never change a result. The graph is traced again (``make_fx``) through
:class:`_Padder`, an interpreter of the symbolic graph over padded tensors. It inserts masks
wherever an op mixes positions along a padded dimension:

- reductions fill the padding with their identity (0 for sums, -inf for maxima);
- ``mean`` and ``var`` divide by the runtime count;
- softmax fills with -inf;
- matrix products contracted over a padded dimension zero both operands' padding;
- ``cat`` places each piece at its runtime offset (a gather);
- ``slice``/``select`` at an offset that depends on a size read at that runtime offset.

Runtime sizes reach the card as one small integer vector, an extra input of the kernel that the
host computes from the call's sizes. Pointwise ops, views that keep a padded dimension
outermost in its group, permutes and expands need nothing. A graph with an op that would mix
padding into results in another way (a reshape that interleaves a padded dimension, a flip, a
pad along it) raises :class:`NotBucketable`. :class:`torch_bridge.dynamic.DynamicGraph` then
compiles it per exact size, as before.

Results are cropped to the call's sizes as views. The padding's cost is counted per call:
``padding_bytes`` (the inputs' and results' padded bytes) and ``padding_flops`` (the flops of
matrix products and elementwise ops spent on padding).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Collection, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from .buckets import bucket
from .graph_passes import copy_sources, core_decompositions, fold_constants
from .pad_rules import PadKind, PadRule, fill_value, rule_of

__all__ = ["NotBucketable", "PaddedPlan"]

aten = torch.ops.aten


class NotBucketable(ValueError):
    """A graph whose padding cannot be masked (it is compiled per exact size instead)."""


def _expr(v: Any) -> Any:
    """A size as a sympy expression (symbolic) or an int."""
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        e = v.node.expr
        return int(e) if e.is_Integer else e
    return v


def _symbolic(e: Any) -> bool:
    return isinstance(e, sympy.Basic) and bool(e.free_symbols)


class _Sym:
    """A symbolic scalar of the graph (a ``SymInt`` node): its expression."""

    __slots__ = ("expr", "is_float")

    def __init__(self, expr: Any, is_float: bool = False):
        self.expr = expr
        self.is_float = is_float


#: Dynamo's guards on sizes (dropped: the bucket's sizes may differ)
_CHECKS = {aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default}


def _name(t: Any) -> str:
    """An op's schema name (``aten::sum``), or "" for a Python callable."""
    schema = getattr(t, "_schema", None)
    return schema.name if schema is not None else ""


def _dims(x: Any, dims: Any) -> list[int]:
    nd = max(len(x.shape), 1)
    if dims is None or dims == []:
        return list(range(len(x.shape)))
    if isinstance(dims, int):
        dims = [dims]
    return [d % nd for d in dims]


class PaddedPlan:
    """What padding a symbolic graph needs: how each symbol is read from a call's arguments,
    the size expressions the card needs at run time, and a bucketed kernel per bucket key
    (compiled by ``compile_static`` from the padded static graph)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        compile_static: Callable[..., Any],
        weights: Collection[int] = (),
    ):
        self.gm = gm
        self.compile_static = compile_static
        self.weights = frozenset(weights)  # the indices of gm's inputs that are weights
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.binders: dict[sympy.Symbol, tuple[int, int | None]] = {}
        for i, n in enumerate(self.placeholders):
            v = n.meta.get("val")
            if isinstance(v, torch.SymInt):
                e = _expr(v)
                if isinstance(e, sympy.Symbol):
                    self.binders.setdefault(e, (i, None))
            elif isinstance(v, torch.Tensor):
                for d, s in enumerate(v.shape):
                    e = _expr(s)
                    if isinstance(e, sympy.Symbol):
                        self.binders.setdefault(e, (i, d))
        # every symbolic size expression of the graph, in order: the runtime vector's entries
        exprs: dict[Any, int] = {}
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder" and not isinstance(v, torch.Tensor) and not n.users:
                continue  # a size Dynamo passes but nothing reads (a stride): not in the key
            vals = v if isinstance(v, list | tuple) else [v]
            for x in vals:
                if isinstance(x, torch.Tensor):
                    for s in x.shape:
                        e = _expr(s)
                        if _symbolic(e):
                            exprs.setdefault(e, len(exprs))
                elif isinstance(x, torch.SymInt | torch.SymFloat):
                    e = _expr(x)
                    if _symbolic(e):
                        exprs.setdefault(e, len(exprs))
        free = set().union(*(e.free_symbols for e in exprs)) if exprs else set()
        missing = free - set(self.binders)
        if missing:
            raise NotBucketable(
                f"symbols {sorted(map(str, missing))} are not the size of any input"
            )
        self.symbols = sorted(free, key=str)
        self.exprs = list(exprs)
        self.index = exprs
        self.kernels: dict[tuple, _BucketKernel] = {}

    # -- per call

    def bind(self, args: Sequence[Any]) -> tuple[int, ...]:
        """The symbols' values in this call."""
        out = []
        for s in self.symbols:
            i, d = self.binders[s]
            a = args[i]
            out.append(int(a) if d is None else int(a.shape[d]))
        return tuple(out)

    def key(self, args: Sequence[Any], values: tuple[int, ...]) -> tuple:
        kinds = tuple(
            (a.dtype, a.device.type) if isinstance(a, torch.Tensor) else type(a).__name__
            for a in args
        )
        return tuple(bucket(v) for v in values), kinds

    def kernel(self, args: Sequence[Any]) -> tuple[_BucketKernel, tuple[int, ...]]:
        values = self.bind(args)
        key = self.key(args, values)
        k = self.kernels.get(key)
        if k is None:
            k = _BucketKernel(self, key[0], args)
            self.kernels[key] = k
        return k, values


def _subs(e: Any, env: dict) -> Any:
    if not isinstance(e, sympy.Basic):
        return e
    v = e.xreplace(env)
    if not v.is_number:
        raise NotBucketable(f"size {e} does not evaluate to a number")
    return int(v) if v.is_integer else float(v)


class _BucketKernel:
    """The card kernel of one bucket: padded static graph, its compiled callable and how to
    pad the arguments and crop the results."""

    def __init__(self, plan: PaddedPlan, buckets: tuple[int, ...], args: Sequence[Any]):
        self.plan = plan
        self.buckets = buckets
        syms = plan.symbols
        corners = [
            {s: sympy.Integer(v) for s, v in zip(syms, c, strict=True)}
            for c in itertools.product(*[(1, b) for b in buckets])
        ] or [{}]
        self._static: dict[Any, int] = {}
        for e in plan.exprs:
            vals = [_subs(e, env) for env in corners]
            self._static[e] = max(int(math.ceil(v)) for v in vals)
        self._memo: dict[tuple[int, ...], tuple[torch.Tensor, list]] = {}
        # the padded static graph, traced over fakes of the static sizes
        phs = plan.placeholders
        self.tensor_ix = [i for i, n in enumerate(phs) if isinstance(args[i], torch.Tensor)]
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fakes = [
                torch.empty(
                    self.shape(phs[i].meta["val"]), dtype=args[i].dtype, device=args[i].device
                )
                for i in self.tensor_ix
            ]
            lens_fake = torch.empty(max(len(plan.exprs), 1), dtype=torch.int64)
        padder = _Padder(plan.gm, self)
        n_t = len(self.tensor_ix)

        def traced(*xs: torch.Tensor) -> Any:
            run_args: list[Any] = []
            it = iter(xs[:n_t])
            for i, n in enumerate(phs):
                run_args.append(
                    next(it) if i in set(self.tensor_ix) else _Sym(_expr(n.meta["val"]))
                )
            padder.lens = xs[n_t]
            return padder.run(*run_args)

        with torch.no_grad():
            static = make_fx(
                traced,
                decomposition_table=core_decompositions(),
                tracing_mode="fake",
                _allow_non_fake_inputs=True,
            )(*fakes, lens_fake)
        self.out_specs = padder.out_specs
        self.in_shapes = [self.shape(phs[i].meta["val"]) for i in self.tensor_ix]
        self.padding_flops_fn = padder.padding_flops
        copy_sources(plan.gm, static)
        fold_constants(static)
        static.recompile()
        self.static_gm = static
        weights = tuple(j for j, i in enumerate(self.tensor_ix) if i in plan.weights)
        self.run = plan.compile_static(static, weights=weights)
        self.last: dict[str, int] = {"padding_bytes": 0, "padding_flops": 0}

    def shape(self, v: torch.Tensor) -> list[int]:
        return [self.size(s) for s in v.shape]

    def size(self, s: Any) -> int:
        e = _expr(s)
        return self._static[e] if _symbolic(e) else int(e)

    def sizes(self, values: tuple[int, ...]) -> tuple[torch.Tensor, list, list, int]:
        """What the symbols' ``values`` make of the graph, evaluated once per set of values
        (sympy is slow on a decode loop's path): the runtime size vector, each result's real
        shape (None for a scalar result), each result's value where it is a size, and the
        flops spent on padding."""
        hit = self._memo.get(values)
        if hit is None:
            env = {s: sympy.Integer(v) for s, v in zip(self.plan.symbols, values, strict=True)}
            rt = [_subs(e, env) for e in self.plan.exprs]
            vec = torch.tensor([int(x) for x in rt] or [0], dtype=torch.int64)
            shapes = [
                [_subs(e, env) for e in spec[1]] if spec[0] == "tensor" else None
                for spec in self.out_specs
            ]
            scalars = [
                _subs(spec[1], env) if spec[0] == "sym" else spec[1] for spec in self.out_specs
            ]
            hit = (vec, shapes, scalars, self.padding_flops_fn(env))
            if len(self._memo) < 4096:
                self._memo[values] = hit
        return hit

    def __call__(self, args: Sequence[Any], values: tuple[int, ...]) -> Any:
        vec, shapes, scalars, flops = self.sizes(values)
        pad_bytes = 0
        ins: list[Any] = []
        for i, want in zip(self.tensor_ix, self.in_shapes, strict=True):
            a = args[i]
            if list(a.shape) != want:
                p = a.new_zeros(want)
                p[tuple(slice(0, n) for n in a.shape)] = a
                pad_bytes += (p.numel() - a.numel()) * a.element_size()
                a = p
            ins.append(a)
        ins.append(vec)
        outs = self.run(*ins)
        outs = iter(outs if isinstance(outs, list | tuple) else (outs,))
        results: list[Any] = []
        for real, scalar in zip(shapes, scalars, strict=True):
            if real is None:
                results.append(scalar)
                continue
            t = next(outs)
            if list(t.shape) != real:
                pad_bytes += (t.numel() - math.prod(real)) * t.element_size()
                for d, n in enumerate(real):
                    if t.shape[d] != n:
                        t = t.narrow(d, 0, n)
            results.append(t)
        self.last = {"padding_bytes": pad_bytes, "padding_flops": flops}
        return results

    def cost_analysis(self) -> dict[str, Any]:
        """The bucket kernel's figures and, for its last call, the padding's bytes and flops."""
        run = self.run
        base = run.cost_analysis() if hasattr(run, "cost_analysis") else {}
        return {**base, **self.last, "bucket": self.buckets}


class _Padder(torch.fx.Interpreter):
    """Runs the symbolic graph over padded tensors (under ``make_fx``), masking the padding
    where an op would mix it into results."""

    def __init__(self, gm: torch.fx.GraphModule, k: _BucketKernel):
        super().__init__(gm)
        self.k = k
        self.lens: torch.Tensor | None = None
        self.out_specs: list[tuple] = []
        self.flop_terms: list[tuple[Any, Any]] = []  # (static flops, runtime flops expr)

    # -- helpers

    def rt(self, e: Any, float_: bool = False) -> Any:
        """The runtime value of a size expression: a 0-d tensor read from the size vector."""
        if not _symbolic(e):
            return e
        assert self.lens is not None
        v = self.lens[self.k.plan.index[e]]
        return v.to(torch.float32) if float_ else v

    def static(self, a: Any) -> Any:
        if isinstance(a, _Sym):
            return self.k._static[a.expr] if _symbolic(a.expr) else a.expr
        if isinstance(a, list | tuple):
            return type(a)(self.static(x) for x in a)
        return a

    def runtime(self, a: Any) -> Any:
        if isinstance(a, _Sym):
            return self.rt(a.expr, a.is_float)
        if isinstance(a, list | tuple):
            return type(a)(self.runtime(x) for x in a)
        return a

    def mask(self, x: torch.Tensor, meta: torch.Tensor, dims: list[int], fill: Any) -> Any:
        """``x`` with positions past the runtime size of each padded dim in ``dims`` set to
        ``fill``."""
        for d in dims:
            e = _expr(meta.shape[d])
            if not _symbolic(e):
                continue
            idx = torch.arange(x.shape[d], device=x.device)
            m = idx < self.rt(e)
            m = m.reshape([-1 if i == d else 1 for i in range(x.dim())])
            x = torch.where(m, x, fill)
        return x

    def padding_flops(self, symenv: dict) -> int:
        """Flops spent on padding at the symbols' values ``symenv``: static minus real."""
        total = 0
        for st, e in self.flop_terms:
            total += int(st) - int(_subs(sympy.sympify(e), symenv))
        return max(total, 0)

    # -- the interpreter

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "placeholder":
            return super().run_node(n)
        if n.op == "output":
            return self.output_node(n)
        v = n.meta.get("val")
        if (
            n.op == "call_function"
            and isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool | int | float)
            and not isinstance(v, bool)
            and n.target is not aten.item.default
        ):
            e = _expr(v)
            return _Sym(e, isinstance(v, torch.SymFloat | float)) if _symbolic(e) else e
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out = self.call(n, args, kwargs)
        self.check(n, out)
        return out

    def output_node(self, n: torch.fx.Node) -> Any:
        outs = n.args[0]
        flat = outs if isinstance(outs, list | tuple) else [outs]
        vals: list[Any] = []
        for o in flat:
            if isinstance(o, torch.fx.Node):
                val = self.env[o]
                if isinstance(val, torch.Tensor):
                    self.out_specs.append(("tensor", [_expr(s) for s in o.meta["val"].shape]))
                    vals.append(val)
                elif isinstance(val, _Sym):
                    self.out_specs.append(("sym", val.expr))
                else:
                    self.out_specs.append(("const", val))
            else:
                self.out_specs.append(("const", o))
        return tuple(vals)

    def check(self, n: torch.fx.Node, out: Any) -> None:
        v = n.meta.get("val")
        outs = out if isinstance(out, list | tuple) else [out]
        metas = v if isinstance(v, list | tuple) else [v]
        for o, m in zip(outs, metas, strict=False):
            if isinstance(o, torch.Tensor) and isinstance(m, torch.Tensor):
                want = self.k.shape(m)
                if list(o.shape) != want:
                    raise NotBucketable(
                        f"{n.target} ({n.name}) gives {list(o.shape)} padded, not {want}"
                    )

    def call(self, n: torch.fx.Node, args: tuple, kwargs: dict) -> Any:  # noqa: C901
        t = n.target
        ins = list(torch.fx.node.map_arg(n.args, lambda a: a.meta.get("val")))
        x = args[0] if args else None
        xm = ins[0] if ins else None
        padded_in = any(
            isinstance(m, torch.Tensor) and any(_symbolic(_expr(s)) for s in m.shape)
            for m in [a.meta.get("val") for a in n.all_input_nodes]
        )
        has_sym = any(isinstance(a, _Sym) for a in _flat(args) + _flat(list(kwargs.values())))
        if not padded_in and not has_sym:
            return t(*args, **kwargs)
        if t is operator.getitem:
            return args[0][args[1]]
        if t in _CHECKS:  # Dynamo's guards on sizes: the bucket's sizes may differ
            return None
        rule = rule_of(t)
        kind = rule.kind
        if kind is PadKind.POINTWISE:
            out = t(*self.runtime(args), **self.runtime(kwargs))
            om = n.meta.get("val")
            if isinstance(om, torch.Tensor):
                self.flop_terms.append(
                    (math.prod(self.k.shape(om)), sympy.Mul(*[_expr(s) for s in om.shape]))
                )
            return out
        if kind is PadKind.CONTRACTION:
            return self.contraction(n, rule, args, kwargs, ins)
        if kind in (PadKind.REDUCTION, PadKind.MOMENTS):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            reduce_dims = _dims(x, dim)
            if kind is PadKind.MOMENTS:
                return self.moments(n, x, xm, reduce_dims, args, kwargs)
            fill = fill_value(rule.identity, x.dtype)
            return t(self.mask(x, xm, reduce_dims, fill), *args[1:], **kwargs)
        if kind is PadKind.OFFSET:
            return self.offset(n, x, xm, args, kwargs)
        if kind in (PadKind.MOVEMENT, PadKind.POSITIONAL):
            if _name(t) == "aten::full" and isinstance(args[1], _Sym):
                raise NotBucketable(f"{t} ({n.name}) fills with a size")
            return t(*self.static(args), **self.static(kwargs))
        raise NotBucketable(f"{t} ({n.name}) on a padded dimension has no masking rule")

    def contraction(
        self, n: torch.fx.Node, rule: PadRule, args: tuple, kwargs: dict, ins: list
    ) -> Any:
        """A matrix product (``mm``, ``bmm``, ``addmm``): the padding of the contracted dim
        zeroed in both operands (the last two arguments), its padded flops counted."""
        ka, kb = rule.contract
        *rest, a, b = args
        am, bm = ins[-2:]
        a = self.mask(a, am, [ka], 0)
        b = self.mask(b, bm, [kb], 0)
        om = n.meta["val"]
        self.flop_terms.append(
            (
                2 * math.prod(self.k.shape(om)) * self.k.size(am.shape[ka]),
                2 * sympy.Mul(*[_expr(s) for s in om.shape]) * _expr(am.shape[ka]),
            )
        )
        return n.target(*rest, a, b, **kwargs)

    def offset(self, n: torch.fx.Node, x: Any, xm: Any, args: tuple, kwargs: dict) -> Any:
        """The ops whose result depends on where the runtime sizes end (OFFSET in
        :mod:`torch_bridge.pad_rules`), each by its own rule."""
        t, name = n.target, _name(n.target)
        if name == "aten::cat":
            ins = list(torch.fx.node.map_arg(n.args, lambda a: a.meta.get("val")))
            return self.cat(n, args, ins)
        if name == "aten::slice":
            return self.slice(n, x, xm, args)
        if name == "aten::select":
            return self.select(n, x, xm, args)
        if name in ("aten::view", "aten::reshape", "aten::_unsafe_view"):
            self.view_ok(n, xm, n.meta["val"])
            return t(x, self.k.shape(n.meta["val"]))
        if t in (aten.arange.start, aten.arange.start_step):
            start = args[0]
            step = args[2] if len(args) > 2 else kwargs.get("step", 1)
            om = n.meta["val"]
            base = torch.arange(
                self.k.size(om.shape[0]),
                dtype=kwargs.get("dtype") or om.dtype,
                device=kwargs.get("device"),
            )
            return base * self.runtime(step) + self.runtime(start)
        if t is aten.arange.default:  # the padded length: its tail is padding
            return t(*self.static(args), **self.static(kwargs))
        if name == "aten::scalar_tensor" and isinstance(x, _Sym):
            return self.runtime(x).to(kwargs.get("dtype") or torch.float32)
        if name == "aten::native_layer_norm" and not any(
            _symbolic(_expr(d)) for d in xm.shape[xm.dim() - len(args[1]) :]
        ):  # normalized over static trailing dims: each padded row on its own
            return t(*self.static(args), **self.static(kwargs))
        if name in ("aten::split", "aten::split_with_sizes") and not _symbolic(
            _expr(xm.shape[(args[2] if len(args) > 2 else kwargs.get("dim", 0)) % xm.dim()])
        ):
            return t(*self.static(args), **self.static(kwargs))  # split along a static dim
        raise NotBucketable(f"{t} ({n.name}) on a padded dimension has no masking rule")

    def moments(
        self, n: torch.fx.Node, x: Any, xm: Any, dims: list[int], args: tuple, kwargs: dict
    ) -> Any:
        """``mean`` and ``var`` over padded dims: sums of the masked values over the runtime
        count."""
        t = n.target
        corr: Any = 0
        if t is aten.mean.dim:
            keep = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        elif t is aten.mean.default:
            keep = False
        elif t is aten.var.correction:
            keep = bool(kwargs.get("keepdim", False))
            corr = kwargs.get("correction")
            corr = 1 if corr is None else corr
        else:  # var.dim
            corr = 1 if (args[2] if len(args) > 2 else kwargs.get("unbiased", True)) else 0
            keep = bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False))
        count: Any = 1
        for d in dims:
            count = count * self.rt(_expr(xm.shape[d]))
        if isinstance(count, torch.Tensor):
            count = count.to(x.dtype)
        mean = torch.sum(self.mask(x, xm, dims, 0), dim=dims, keepdim=True) / count
        if _name(t) == "aten::mean":
            return mean if keep else mean.squeeze(dims)
        dev = self.mask(x - mean, xm, dims, 0)
        return torch.sum(dev * dev, dim=dims, keepdim=keep) / (count - corr)

    def cat(self, n: torch.fx.Node, args: tuple, ins: list) -> Any:
        pieces, metas = list(args[0]), list(ins[0])
        dim = args[1] if len(args) > 1 else 0
        dim = dim % pieces[0].dim()
        sizes = [_expr(m.shape[dim]) for m in metas]
        if not any(_symbolic(s) for s in sizes[:-1]):
            out = torch.cat(pieces, dim)
            want = self.k.size(n.meta["val"].shape[dim])
            if out.shape[dim] != want:
                raise NotBucketable(f"cat ({n.name}): padded size {out.shape[dim]} != {want}")
            return out
        om = n.meta["val"]
        shape = self.k.shape(om)
        total = shape[dim]
        pos = torch.arange(total, device=pieces[0].device)
        view = [-1 if i == dim else 1 for i in range(len(shape))]
        out: Any = None
        off: Any = 0
        for p, size in zip(pieces, sizes, strict=True):
            length = self.rt(size)
            idx = (pos - off).clamp(0, p.shape[dim] - 1)
            g = torch.index_select(p, dim, idx).expand(shape)
            inside = ((pos >= off) & (pos < off + length)).reshape(view)
            out = g if out is None else torch.where(inside, g, out)
            off = off + length
        return out

    def _start(self, v: Any, length: Any) -> Any:
        """A slice's start as torch takes it: negative counts from the runtime end, then at
        least 0."""
        if v is None:
            return 0
        if isinstance(v, _Sym):
            v = self.runtime(v)
        elif v < 0:
            v = length + v
        return torch.clamp(v, min=0) if isinstance(v, torch.Tensor) else max(v, 0)

    def slice(self, n: torch.fx.Node, x: Any, xm: Any, args: tuple) -> Any:
        dim = (args[1] if len(args) > 1 else 0) % x.dim()
        start = args[2] if len(args) > 2 else None
        step = args[4] if len(args) > 4 else 1
        if step != 1:
            raise NotBucketable(f"slice ({n.name}) with step {step} on a padded dimension")
        e = _expr(xm.shape[dim])
        out_len = self.k.size(n.meta["val"].shape[dim])
        if isinstance(start, int) and start >= 0 or start is None:
            s0 = start or 0
            if s0 + out_len <= x.shape[dim]:
                return x.narrow(dim, s0, out_len)
        length = self.rt(e)
        st = self._start(start, length)
        idx = torch.arange(out_len, device=x.device) + st
        idx = idx.clamp(0, x.shape[dim] - 1)
        return torch.index_select(x, dim, idx)

    def select(self, n: torch.fx.Node, x: Any, xm: Any, args: tuple) -> Any:
        dim = args[1] % x.dim()
        index = args[2]
        e = _expr(xm.shape[dim])
        if isinstance(index, int) and index >= 0:
            return x.select(dim, index)
        length = self.rt(e)
        i = (
            self.runtime(index)
            if isinstance(index, _Sym)
            else (length + index if index < 0 else index)
        )
        idx = torch.as_tensor(i).reshape(1).clamp(0, x.shape[dim] - 1)
        return torch.index_select(x, dim, idx).squeeze(dim)

    def view_ok(self, n: torch.fx.Node, im: torch.Tensor, om: torch.Tensor) -> None:
        """A view keeps padding at the end of each group of dims it merges or splits only if
        the padded dim is the group's outermost, on both sides."""
        a = [_expr(s) for s in im.shape]
        b = [_expr(s) for s in om.shape]
        pos = [0, 0]  # the next dim of a and of b
        dims = (a, b)

        def take(side: int, group: list, prod: Any) -> Any:
            x = dims[side][pos[side]]
            group.append(x)
            pos[side] += 1
            return prod * x

        while pos[0] < len(a) or pos[1] < len(b):
            ga: list = []
            gb: list = []
            pa = pb = sympy.Integer(1)
            if pos[0] < len(a):
                pa = take(0, ga, pa)
            if pos[1] < len(b):
                pb = take(1, gb, pb)
            guard = 0
            while sympy.expand(pa - pb) != 0:
                guard += 1
                more_a, more_b = pos[0] < len(a), pos[1] < len(b)
                if guard > 64 or not (more_a or more_b):
                    raise NotBucketable(f"view ({n.name}): cannot group {a} into {b}")
                if more_a and (not more_b or _le(pa, pb)):
                    pa = take(0, ga, pa)
                else:
                    pb = take(1, gb, pb)
            for g in (ga, gb):
                big = [s for s in g if s != 1]
                syms = [s for s in big if _symbolic(s)]
                if syms and (len(syms) > 1 or big[0] != syms[0]):
                    raise NotBucketable(
                        f"view ({n.name}) of {a} as {b} interleaves a padded dimension"
                    )


def _le(a: Any, b: Any) -> bool:
    """Whether product ``a`` is no larger than ``b`` (symbols taken at 2, a typical size)."""
    env = {
        s: sympy.Integer(1 << 20)
        for s in (getattr(a, "free_symbols", set()) | getattr(b, "free_symbols", set()))
    }
    av = sympy.sympify(a).xreplace(env)
    bv = sympy.sympify(b).xreplace(env)
    return bool(av <= bv)


def _flat(xs: Any) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if isinstance(x, list | tuple):
            out.extend(_flat(x))
        else:
            out.append(x)
    return out
