"""Both importers report a failing lowering rule the same way: a ``LoweringRuleError`` with the
frontend, the op, the equation (or FX node), the user's source line and the rule's exception.

Bugs are planted by patching each importer's one registry (``lowering.from_jaxpr.RULES``,
``lowering.from_fx.RULES``); the real failures are rules refusing what they are given.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax
from torch._decomp import core_aten_decompositions
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

import lowering.from_fx as from_fx_mod
import lowering.from_jaxpr as from_jaxpr_mod
import spyre_jax
from lowering.errors import (
    LoweringError,
    LoweringRuleError,
    TilingError,
    UnsupportedPrimitiveError,
    rule_error,
)
from lowering.from_fx import from_fx, node_source
from lowering.from_jaxpr import from_jaxpr

THIS_FILE = os.path.abspath(__file__)
aten = torch.ops.aten


def _body_line(fn: Any, offset: int = 1) -> int:
    """The line of ``fn``'s body that uses the op (``offset`` lines below its ``def``)."""
    return fn.__code__.co_firstlineno + offset


def _assert_where(err: LoweringRuleError, fn: Any, offset: int = 1) -> None:
    m = re.fullmatch(r"(.+):(\d+) \((.+)\)", err.where)
    assert m, err.where
    assert os.path.samefile(m[1], THIS_FILE), err.where
    assert int(m[2]) == _body_line(fn, offset), err.where
    assert m[3] == fn.__name__, err.where


def _assert_structured(
    err: BaseException, frontend: str, op: str, cause_type: type, fn: Any, offset: int = 1
) -> LoweringRuleError:
    assert isinstance(err, LoweringRuleError), repr(err)
    assert err.frontend == frontend
    assert err.op == op
    assert op.split(".")[-2 if op.startswith("aten.") else -1] in err.equation, err.equation
    _assert_where(err, fn, offset)
    assert type(err.cause) is cause_type and err.__cause__ is err.cause
    assert not isinstance(err.cause, LoweringRuleError)  # wrapped once
    assert isinstance(err, cause_type)  # handlers of the rule's exception still catch it
    msg = str(err)
    for part in (f"'{op}'", err.equation, err.where, str(err.cause).splitlines()[0]):
        assert part in msg, (part, msg)
    return err


# ---------------------------------------------------------------------------------------------
# frontends


def _jax_graph(fn: Any, *xs: Any) -> Any:
    return from_jaxpr(jax.make_jaxpr(fn)(*xs))


def _aten_module(fn: Any, *xs: torch.Tensor) -> torch.fx.GraphModule:
    """The core-ATen forward graph of ``fn`` as the spyre torch backend receives it (with the
    stack traces Dynamo records)."""
    graphs: list[torch.fx.GraphModule] = []

    def fw(gm: torch.fx.GraphModule, _example: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        return aot_module_simplified(
            gm, example, fw_compiler=fw, decompositions=core_aten_decompositions()
        )

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, dynamic=False)(*xs)
    torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0]


def _boom(*_a: Any, **_k: Any) -> Any:
    raise ValueError("boom")


# ---------------------------------------------------------------------------------------------
# a planted failing rule


def _jax_tanh(x):
    return jnp.tanh(x) + 1.0


def _torch_tanh(x):
    return torch.tanh(x) + 1.0


def test_planted_rule_error_jax(monkeypatch):
    monkeypatch.setitem(from_jaxpr_mod.RULES, "tanh", _boom)
    with pytest.raises(LoweringRuleError) as ei:
        _jax_graph(_jax_tanh, np.ones((4, 8), np.float32))
    err = _assert_structured(ei.value, "JAX", "tanh", ValueError, _jax_tanh)
    assert str(err.cause) == "boom" and "tanh" in err.equation
    assert str(err).startswith("spyre: ValueError: boom\n")


def test_planted_rule_error_aten(monkeypatch):
    gm = _aten_module(_torch_tanh, torch.ones(4, 8))
    monkeypatch.setitem(from_fx_mod.RULES, aten.tanh.default, _boom)
    with pytest.raises(LoweringRuleError) as ei:
        from_fx(gm)
    err = _assert_structured(ei.value, "ATen", "aten.tanh.default", ValueError, _torch_tanh)
    assert str(err.cause) == "boom" and "aten.tanh.default" in err.equation
    assert str(err).startswith("spyre: ValueError: boom\n")


@pytest.mark.parametrize("frontend", ["jax", "aten"])
def test_planted_errors_that_say_enough_pass_through(monkeypatch, frontend):
    """A rule's TilingError, UnsupportedPrimitiveError or already structured error is not
    wrapped again."""
    for exc in (
        TilingError("spyre: too big"),
        UnsupportedPrimitiveError("JAX", "p", "eq", "here"),
        rule_error("JAX", "p", "eq", "here", ValueError("inner")),
    ):

        def raiser(*_a: Any, exc: BaseException = exc, **_k: Any) -> Any:
            raise exc

        if frontend == "jax":
            monkeypatch.setitem(from_jaxpr_mod.RULES, "tanh", raiser)
            run = lambda: _jax_graph(_jax_tanh, np.ones((4, 8), np.float32))  # noqa: E731
        else:
            gm = _aten_module(_torch_tanh, torch.ones(4, 8))
            monkeypatch.setitem(from_fx_mod.RULES, aten.tanh.default, raiser)
            run = lambda gm=gm: from_fx(gm)  # noqa: E731
        with pytest.raises(type(exc)) as ei:
            run()
        assert ei.value is exc


# ---------------------------------------------------------------------------------------------
# real failing rules


def _jax_dilated_window(x):  # a base-dilated window sum: no rule takes it
    return lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 1), "VALID", base_dilation=(1, 2)) * 2.0


def _jax_column_gather(x, i):  # windows of three columns from each row: not a lookup
    return lax.gather(x, i[:, None], _WINDOWS, slice_sizes=(1, 3)) + 1.0


_WINDOWS = lax.GatherDimensionNumbers(
    offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
)


def _jax_inner(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 1), "VALID", base_dilation=(1, 2))


def _jax_nested(x):
    return jax.jit(_jax_inner)(x) * 2.0


def _torch_float64(x):
    return (x.double() * 2).float()


def test_real_failure_jax_reduce_window_base_dilation():
    with pytest.raises(LoweringError) as ei:
        _jax_graph(_jax_dilated_window, np.ones((4, 8), np.float32))
    err = _assert_structured(
        ei.value, "JAX", "reduce_window_sum", LoweringError, _jax_dilated_window
    )
    assert "base_dilation" in str(err).splitlines()[0]
    assert "base_dilation=" in err.equation


def test_real_failure_jax_gather():
    with pytest.raises(LoweringError) as ei:
        _jax_graph(_jax_column_gather, np.ones((4, 8), np.float32), np.arange(3, dtype=np.int32))
    _assert_structured(ei.value, "JAX", "gather", LoweringError, _jax_column_gather)


def test_real_failure_inside_nested_jit_is_wrapped_once():
    """The rule that failed is the inner ``reduce_window_sum``, at the inner function's line;
    the ``pjit`` that inlined it adds nothing."""
    with pytest.raises(LoweringRuleError) as ei:
        _jax_graph(_jax_nested, np.ones((4, 8), np.float32))
    _assert_structured(ei.value, "JAX", "reduce_window_sum", LoweringError, _jax_inner)


def test_real_failure_aten_dtype():
    """A float64 result reaching a rule: the rule's TypeError, structured, still a TypeError."""
    gm = _aten_module(_torch_float64, torch.ones(4, 8))
    with pytest.raises(TypeError) as ei:
        from_fx(gm)
    err = _assert_structured(ei.value, "ATen", "aten._to_copy.default", TypeError, _torch_float64)
    assert "float64" in str(err).splitlines()[0]


# ---------------------------------------------------------------------------------------------
# the record itself


def test_node_source_format_matches_jax():
    gm = _aten_module(_torch_tanh, torch.ones(4, 8))
    tanh = next(n for n in gm.graph.nodes if n.target is aten.tanh.default)
    where = node_source(tanh)
    assert where.endswith(f":{_body_line(_torch_tanh)} (_torch_tanh)"), where
    assert os.path.samefile(where.rsplit(":", 1)[0], THIS_FILE)


def test_rule_error_kinds_and_pickling():
    for cause, kinds in (
        (LoweringError("spyre: no"), (LoweringError, ValueError)),
        (ValueError("v"), (ValueError,)),
        (TypeError("t"), (TypeError,)),
        (NotImplementedError("n"), (NotImplementedError,)),
        (IndexError("i"), ()),
    ):
        err = rule_error("ATen", "aten.add.Tensor", "%add = ...", "f.py:3 (g)", cause)
        assert isinstance(err, LoweringRuleError) and type(err).__name__ == "LoweringRuleError"
        assert all(isinstance(err, k) for k in kinds)
        assert isinstance(err, LoweringError) == isinstance(cause, LoweringError)
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert (back.frontend, back.op, back.equation, back.where) == (
            "ATen",
            "aten.add.Tensor",
            "%add = ...",
            "f.py:3 (g)",
        )
        assert type(back.cause) is type(cause) and str(back.cause) == str(cause)


def test_pipeline_logs_every_pass(caplog):
    # the IR after each pass goes to the ``lowering`` logger (no bare prints)
    with caplog.at_level(logging.DEBUG, logger="lowering"):
        spyre_jax.jit(lambda x: jnp.tanh(x) + 1).lower(np.ones((4, 8), np.float32))
    text = caplog.text
    for stage in ("imported", "after to_maps", "after fuse_maps", "after dce", "schedule"):
        assert stage in text, stage
