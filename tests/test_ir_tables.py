"""The tables every layer reads: reductions (``device_model.ops.REDUCTIONS``) and the torch
padding rules (``torch_bridge.pad_rules``). Checked against NumPy and torch eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from device_model.ops import REDUCTIONS, Reduce, identity_value
from lowering.graph import Graph, GraphError, Node, Var, check_graph
from lowering.op_params import ReduceParams
from torch_bridge.pad_rules import RULES, PadKind, fill_value, rule_of

aten = torch.ops.aten

_NUMPY = {
    "sum": lambda x, a: np.sum(x, axis=a),
    "prod": lambda x, a: np.prod(x, axis=a),
    "max": lambda x, a: np.max(x, axis=a),
    "min": lambda x, a: np.min(x, axis=a),
    "argmax": lambda x, a: np.argmax(x, axis=a[0]),
    "argmin": lambda x, a: np.argmin(x, axis=a[0]),
    "cumsum": lambda x, a: np.cumsum(x, axis=a[0]),
    "cumsum_rev": lambda x, a: np.flip(np.cumsum(np.flip(x, a[0]), axis=a[0]), a[0]),
    "cumprod": lambda x, a: np.cumprod(x, axis=a[0]),
    "cumprod_rev": lambda x, a: np.flip(np.cumprod(np.flip(x, a[0]), axis=a[0]), a[0]),
    "cummax": lambda x, a: np.maximum.accumulate(x, axis=a[0]),
    "cummax_rev": lambda x, a: np.flip(np.maximum.accumulate(np.flip(x, a[0]), a[0]), a[0]),
    "cummin": lambda x, a: np.minimum.accumulate(x, axis=a[0]),
    "cummin_rev": lambda x, a: np.flip(np.minimum.accumulate(np.flip(x, a[0]), a[0]), a[0]),
    "cumlogsumexp": lambda x, a: np.log(np.cumsum(np.exp(x), axis=a[0])),
    "cumlogsumexp_rev": lambda x, a: np.flip(
        np.log(np.cumsum(np.exp(np.flip(x, a[0])), axis=a[0])), a[0]
    ),
}


def test_every_kind_has_one_entry():
    assert set(REDUCTIONS) == set(Reduce)
    assert set(_NUMPY) == {k.value for k in Reduce}


@pytest.mark.parametrize("kind", [k.value for k in Reduce])
def test_whole_reduction_and_identity_match_numpy(kind):
    red = REDUCTIONS[kind]
    x = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(np.float32)
    got = red.whole(np, x, (1,))
    want = _NUMPY[kind](x, (2,))  # axis 1 of the space is axis 2 with the core axis
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert str(got.dtype) == red.out_dtype("float32")
    # the identity leaves every value unchanged (an index reduction: its values')
    combine = REDUCTIONS[red.index_of] if red.index_of else red
    if combine.scan:
        return
    e = combine.identity_value(np.float32)
    y = np.concatenate([x, np.full((2, 3, 1), e, np.float32)], axis=2)
    np.testing.assert_array_equal(combine.whole(np, y, (1,)), combine.whole(np, x, (1,)))


def test_identities_by_dtype():
    assert identity_value("lowest", np.int32) == np.iinfo(np.int32).min
    assert identity_value("highest", np.bool_) is np.True_
    assert identity_value("one", np.float16) == 1
    with pytest.raises(ValueError, match="unknown identity"):
        identity_value("middle", np.float32)


def test_check_graph_rejects_an_unknown_reduction_kind():
    x = Var((4, 8), "float32")
    y = Var((4,), "float32")
    for kind, err in (("bogus", "unknown reduction kind 'bogus'"), ("argmax", None)):
        out = y if err else Var((4,), "int32")
        n = Node("reduce", (x,), (out,), ReduceParams(kind, (1,)))
        g = Graph("g", (x,), (n,), (out,))
        if err is None:
            check_graph(g)
        else:
            with pytest.raises(GraphError, match=err):
                check_graph(g)


def test_check_graph_rejects_a_one_axis_reduction_over_two():
    x = Var((4, 8), "float32")
    out = Var((), "int32")
    n = Node("reduce", (x,), (out,), ReduceParams(Reduce.ARGMAX, (0, 1)))
    with pytest.raises(GraphError, match="argmax over one axis"):
        check_graph(Graph("g", (x,), (n,), (out,)))


def test_rule_of_overloads():
    assert rule_of(aten.sum.dim_IntList).kind is PadKind.REDUCTION
    assert rule_of(aten.max.dim).kind is PadKind.REDUCTION
    assert rule_of(aten.maximum.default).kind is PadKind.POINTWISE
    assert rule_of(aten.add.Tensor).kind is PadKind.POINTWISE
    assert rule_of(aten.bmm.default).contract == (2, 1)
    assert rule_of(aten.flip.default).kind is PadKind.UNSAFE
    assert rule_of(aten.cat.default).kind is PadKind.OFFSET
    assert rule_of(lambda x: x).kind is PadKind.UNSAFE
    # the attention op registered itself as masked by its bias (leaf 3)
    import torch_bridge.attention  # noqa: F401

    masked = [r for r in RULES.values() if r.kind is PadKind.MASKED]
    assert masked and all(r.arg >= 0 for r in masked)


_REDUCING = {
    "aten::sum": lambda x: torch.sum(x, dim=-1),
    "aten::nansum": lambda x: torch.nansum(x, dim=-1),
    "aten::prod": lambda x: torch.prod(x, dim=-1),
    "aten::amax": lambda x: torch.amax(x, dim=-1),
    "aten::max": lambda x: torch.max(x, dim=-1).values,
    "aten::argmax": lambda x: torch.argmax(x, dim=-1),
    "aten::amin": lambda x: torch.amin(x, dim=-1),
    "aten::min": lambda x: torch.min(x, dim=-1).values,
    "aten::argmin": lambda x: torch.argmin(x, dim=-1),
    "aten::any": lambda x: torch.any(x, dim=-1),
    "aten::all": lambda x: torch.all(x, dim=-1),
    "aten::logsumexp": lambda x: torch.logsumexp(x, dim=-1),
    "aten::softmax": lambda x: torch.softmax(x, dim=-1),
    "aten::_softmax": lambda x: torch.softmax(x, dim=-1),
    "aten::log_softmax": lambda x: torch.log_softmax(x, dim=-1),
    "aten::_log_softmax": lambda x: torch.log_softmax(x, dim=-1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_every_reduction_rule_fill_leaves_torch_results_unchanged(dtype):
    """Padding the reduced dim with the table's fill changes no result (torch eager); the
    softmax rows are compared on the tensor's own positions."""
    reductions = {n for n, r in RULES.items() if r.kind is PadKind.REDUCTION}
    assert reductions == set(_REDUCING)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-3, 4, (3, 5), generator=g)
    x = base.to(dtype) if dtype != torch.bool else base > 0
    for name, f in _REDUCING.items():
        floats_only = "softmax" in name or "logsumexp" in name
        if floats_only and dtype != torch.float32:
            continue
        if name in ("aten::nansum", "aten::prod") and dtype == torch.bool:
            continue
        if name in ("aten::argmax", "aten::argmin", "aten::amax", "aten::amin") and (
            dtype == torch.bool
        ):
            continue
        fill = fill_value(RULES[name].identity, dtype)
        padded = torch.cat([x, torch.full((3, 2), fill, dtype=dtype)], dim=-1)
        want, got = f(x), f(padded)
        if want.shape != got.shape:  # a softmax: the own positions
            got = got[..., : x.shape[-1]]
        torch.testing.assert_close(got, want, msg=f"{name} {dtype}")
