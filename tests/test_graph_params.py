"""The graph IR's typed op parameters: one frozen dataclass per op, checked per op by
``check_graph`` (type, fields, the graphs an op holds), built from keywords by ``Builder.emit``,
hashable and printed as ``name=value``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from device_model.card import CardSpec
from device_model.ops import InputView, MapBody, Reduce
from lowering.builder import Builder
from lowering.from_jaxpr import from_jaxpr
from lowering.graph import (
    Graph,
    GraphError,
    Node,
    Var,
    check_graph,
    format_node,
    register_op,
    unregister_op,
)
from lowering.op_params import (
    PARAMS,
    Convert,
    Elementwise,
    Fused,
    Gather,
    Matmul,
    Params,
    ReduceParams,
    Reshape,
    Slice,
    Transpose,
    make_params,
)
from lowering.pipeline import graph_passes


def _one(op: str, ins: tuple[Var, ...], out: Var, ps: Params) -> Graph:
    return Graph("g", ins, (Node(op, ins, (out,), ps),), (out,))


def test_every_op_has_a_params_class():
    assert set(PARAMS) == {
        "elementwise",
        "convert",
        "broadcast",
        "transpose",
        "slice",
        "reshape",
        "concatenate",
        "reduce",
        "matmul",
        "gather",
        "map",
        "scan",
        "while",
        "cond",
        "update_slice",
        "sort",
        "take_along",
        "conv",
    }
    assert all(issubclass(c, Params) for c in PARAMS.values())


def test_check_graph_rejects_the_wrong_params_class():
    x, y = Var((4, 8), "float32"), Var((8, 4), "float32")
    check_graph(_one("reshape", (x,), y, Reshape((8, 4))))
    with pytest.raises(GraphError, match="reshape: params are a Transpose, not a Reshape") as e:
        check_graph(_one("reshape", (x,), y, Transpose((1, 0))))
    assert "at node 0" in str(e.value) and ">> " in str(e.value)  # the usual context


@pytest.mark.parametrize(
    "op,ins,out,ps,msg",
    [
        ("convert", ((4,), "float32"), ((4,), "float16"), Convert("float64"), "not a card dtype"),
        ("transpose", ((4, 8), "float32"), ((8, 4), "float32"), Transpose((1.0, 0)), "tuple of"),
        ("reduce", ((4, 8), "float32"), ((4,), "float32"), ReduceParams("mean", (1,)), "kind"),
        ("gather", ((4, 8), "float32"), ((2, 8), "float32"), Gather("wrap"), "mode='wrap'"),
        ("gather", ((4, 8), "float32"), ((2, 8), "float32"), Gather("fill", "x"), "fill_value"),
        (
            "slice",
            ((4,), "float32"),
            ((2,), "float32"),
            Slice((0,), (2,), ("1",)),
            "strides=",
        ),
        (
            "elementwise",
            ((4,), "float32"),
            ((4,), "float32"),
            Elementwise("frobnicate", "float32"),
            "unknown elementwise fn 'frobnicate'",
        ),
        (
            "matmul",
            ((1, 2, 3), "float32"),
            ((1, 2, 5), "float32"),
            Matmul("float32", rhs_t=1),
            "rhs_t=1 is not a bool",
        ),
        (
            "matmul",
            ((1, 2, 3), "float32"),
            ((1, 2, 5), "float32"),
            Matmul("float32", epilogue=Fused("not a body")),
            "epilogue is a str, not a MapBody",
        ),
    ],
)
def test_check_graph_rejects_a_bad_field(op, ins, out, ps, msg):
    a = Var(*ins)
    extra = {"gather": (Var((2,), "int32"),), "matmul": (Var((1, 3, 5), "float32"),)}
    inputs = (a, *extra.get(op, ()))
    with pytest.raises(GraphError, match=msg) as e:
        check_graph(_one(op, inputs, Var(*out), ps))
    assert "at node 0" in str(e.value)


def test_emit_rejects_an_unknown_keyword_naming_the_op():
    b = Builder()
    x = Var((4, 8), "float32")
    y = b.emit("reduce", [x], (4,), "float32", kind="sum", axes=[1])
    assert b.nodes[-1].params == ReduceParams(Reduce.SUM, (1,)) and y.shape == (4,)
    with pytest.raises(GraphError, match="op 'reduce' has no parameter keepdims"):
        b.emit("reduce", [x], (4,), "float32", kind="sum", axes=(1,), keepdims=True)
    with pytest.raises(GraphError, match="op 'slice'.*strides"):
        b.emit("slice", [x], (4, 4), "float32", starts=(0, 0), limits=(4, 4))
    with pytest.raises(GraphError, match="unknown op 'frobnicate'"):
        make_params("frobnicate", x=1)


@dataclasses.dataclass(frozen=True, slots=True)
class _Region(Params):
    """A test op holding a graph: its outputs are its body's."""

    body: Graph

    def subgraphs(self) -> tuple[Graph, ...]:
        return (self.body,)


def _region_rule(n: Node) -> list:
    return [(v.shape, v.dtype) for v in n.params.body.outputs]


def test_check_graph_checks_the_graphs_a_node_holds():
    x, y = Var((4, 8), "float32"), Var((8, 4), "float32")
    good = _one("reshape", (x,), y, Reshape((8, 4)))
    bad = _one("reshape", (x,), Var((8, 4), "float32"), Reshape((8, 5)))
    register_op("region", _Region, _region_rule)
    try:
        with pytest.raises(GraphError, match="already registered"):
            register_op("region", _Region, _region_rule)
        u = Var((8, 4), "float32")
        check_graph(Graph("outer", (x,), (Node("region", (x,), (u,), _Region(good)),), (u,)))
        w = Var((8, 4), "float32")
        outer = Graph("outer", (x,), (Node("region", (x,), (w,), _Region(bad)),), (w,))
        with pytest.raises(GraphError, match=r"in subgraph 0 \(g\): reshape \(4, 8\)") as e:
            check_graph(outer)
        text = str(e.value)
        assert text.count("at node 0") == 2 and "region[body=" in text  # inner and outer context
    finally:
        unregister_op("region")
    assert "region" not in PARAMS
    with pytest.raises(GraphError, match="unknown op 'region'"):
        check_graph(Graph("outer", (x,), (Node("region", (x,), (y,), _Region(good)),), (y,)))


def test_params_are_frozen_hashable_and_print_as_before():
    x, y = Var((4, 8), "float32"), Var((4,), "float32")
    r = Node("reduce", (x,), (y,), ReduceParams("sum", (1,)))
    assert r.params.kind is Reduce.SUM
    assert format_node(r) == f"{y!r} = reduce[axes=(1,), kind=sum](%{x.id})"
    assert hash(r.params) == hash(ReduceParams(Reduce.SUM, [np.int64(1)]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.params.axes = (0,)  # type: ignore[misc]
    ep = MapBody(
        (1, 2, 5),
        (InputView.identity(3), InputView((2,), (0,), (1,), (False,))),
        (("add", (0, 1), None, "float32"),),
        "",
        (),
        "float32",
    )
    m = Matmul("float32", epilogue=Fused(ep, 0))
    plain = dataclasses.replace(m, epilogue=None)
    assert plain == Matmul("float32") and {m: 1, plain: 2}[m] == 1
    a, b, c, o = (Var(s, "float32") for s in ((1, 2, 3), (1, 3, 5), (5,), (1, 2, 5)))
    n = Node("matmul", (a, b, c), (o,), m)
    check_graph(Graph("g", (a, b, c), (n,), (o,)))
    assert f"matmul[acc_slot=0, dtype=float32, epilogue={ep}]" in format_node(n)
    assert "rhs_t" not in format_node(n) and "prologue" not in format_node(n)
    # elementwise nodes print all their fields, as before
    e = Node("elementwise", (y,), (Var((4,), "float32"),), Elementwise("exp", "float32"))
    assert "elementwise[dtype=float32, fn=exp, param=None, scalars=(), shape=None]" in (
        format_node(e)
    )


def test_imported_and_fused_graphs_have_typed_hashable_params():
    def f(a, w, bias):
        h = jnp.maximum(a @ w.T + bias, 0.0)
        return jnp.sum(h, axis=-1), h[:, :4].astype(jnp.float16)

    xs = (np.ones((8, 16), np.float32), np.ones((32, 16), np.float32), np.ones(32, np.float32))
    g = from_jaxpr(jax.make_jaxpr(f)(*xs))
    graphs = [g]
    for _, fn in graph_passes(CardSpec()):
        g = fn(g)
        check_graph(g)
        graphs.append(g)
    for gr in graphs:
        for n in gr.nodes:
            assert isinstance(n.params, PARAMS[n.op])
            hash(n.params)
            assert f"{n.op}[" in format_node(n)
    assert any(n.op == "matmul" and n.params.rhs_t for n in g.nodes)
