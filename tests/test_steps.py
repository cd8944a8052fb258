"""The schedule IR's typed steps (device_model.steps): one frozen class per stage kind, the
stage's kind from its step's class, per-kind checks in the kernel checker, and both executors
dispatching on the step's class."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from device_model import execute, reference, steps
from device_model.kernel import (
    Kernel,
    ScheduleError,
    Stage,
    check_kernel,
    format_kernel,
    step_reads,
)
from lowering.from_jaxpr import from_jaxpr
from lowering.pipeline import compile_graph
from spyre_jax import CardSpec


def _kernel(f, *xs) -> Kernel:
    k = compile_graph(from_jaxpr(jax.make_jaxpr(f)(*xs)), CardSpec(), check=True)
    check_kernel(k)
    return k


def _with_stage(k: Kernel, i: int, **changes) -> Kernel:
    stages = list(k.stages)
    stages[i] = dataclasses.replace(stages[i], **changes)
    return dataclasses.replace(k, stages=tuple(stages))


def _stage(k: Kernel, kind: str) -> tuple[int, Stage]:
    return next((i, s) for i, s in enumerate(k.stages) if s.kind == kind)


X = np.ones((64, 256), np.float16)
W = np.ones((256, 128), np.float16)


def test_every_kind_has_a_step_class_that_both_executors_and_the_checker_know():
    assert set(steps.STEP_KINDS) == {
        "map",
        "matmul",
        "gather",
        "reshape",
        "concat",
        "sort",
        "take",
    }
    for kind, cls in steps.STEP_KINDS.items():
        assert cls.kind == kind and cls.unit in ("PE", "SFU", "LSU")
        assert cls in reference._COMPUTE
        assert cls in execute._PLAIN or cls in execute._ACC
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


def test_steps_and_stages_are_built_with_keywords():
    with pytest.raises(TypeError):
        steps.ReshapeStep(8, 4)  # type: ignore[misc]
    k = _kernel(lambda a, b: a @ b, X, W)
    s = k.stages[0]
    with pytest.raises(TypeError):
        Stage(*[getattr(s, f.name) for f in dataclasses.fields(s)])  # type: ignore[misc]
    assert hash(s.step) == hash(dataclasses.replace(s.step))


def test_a_stages_kind_and_unit_follow_from_its_step():
    k = _kernel(lambda a, b: jnp.tanh(a @ b).sum(axis=1), X, W)
    kinds = {(s.kind, s.unit, type(s.step)) for s in k.stages}
    assert ("matmul", "PE", steps.MatmulStep) in kinds
    assert any(kind == "map" and unit == "SFU" for kind, unit, _ in kinds)
    text = format_kernel(k)
    assert "PE  matmul acc += lhs @ rhs" in text


def test_map_step_combine_mode():
    _, m = _stage(_kernel(lambda a: jnp.exp(a), X), "map")
    assert isinstance(m.step, steps.MapStep) and m.step.split is None and m.step.combine == "plain"
    split = steps.SplitReduce(axis=1, block=64, extent=256, nk=4)
    _, r = _stage(_kernel(lambda a: a.sum(axis=1), X), "map")
    assert dataclasses.replace(r.step, split=split).combine == "acc"
    _, c = _stage(_kernel(lambda a: jnp.cumsum(a, axis=1), X), "map")
    assert dataclasses.replace(c.step, split=split).combine == "carry"
    assert steps.MatmulStep.combine == "acc" and steps.GatherStep.combine == "plain"


def test_checker_rejects_a_map_reading_other_operands_than_its_body():
    k = _kernel(lambda a, b: a + b, X, X)
    i, s = _stage(k, "map")
    bad = _with_stage(k, i, inputs=s.inputs[:1])
    with pytest.raises(ScheduleError, match="map body reads 2 inputs, the stage 1"):
        check_kernel(bad)


def test_checker_rejects_a_split_that_the_stage_does_not_run_in_sequence():
    k = _kernel(lambda a: jnp.exp(a), X)
    i, s = _stage(k, "map")
    split = steps.SplitReduce(axis=0, block=4, extent=8, nk=2)
    with pytest.raises(ScheduleError, match="reduce_axis"):
        check_kernel(_with_stage(k, i, step=dataclasses.replace(s.step, split=split)))
    block = (*s.step.space_block, 1)
    with pytest.raises(ScheduleError, match="space block"):
        check_kernel(_with_stage(k, i, step=dataclasses.replace(s.step, space_block=block)))


def test_checker_rejects_a_matmul_with_missing_epilogue_operands_or_no_k_loop():
    k = _kernel(lambda a, b, c: a @ b + c, X, W, np.ones((64, 128), np.float16))
    i, s = _stage(k, "matmul")
    assert s.step.epilogue is not None and len(s.inputs) == 3
    with pytest.raises(ScheduleError, match="reads 3 operands, the stage 2"):
        check_kernel(_with_stage(k, i, inputs=s.inputs[:2]))
    with pytest.raises(ScheduleError, match="reduce_axis"):
        check_kernel(_with_stage(k, i, reduce_axis=-1))


def test_checker_rejects_a_gather_of_an_unknown_table_or_the_wrong_row_count():
    table = np.ones((50, 128), np.float32)
    idx = np.arange(8, dtype=np.int32)
    k = _kernel(lambda t, i: t[i], table, idx)
    i, s = _stage(k, "gather")
    assert step_reads(s.step) == (s.step.table,)
    with pytest.raises(ScheduleError, match="unknown table"):
        check_kernel(_with_stage(k, i, step=dataclasses.replace(s.step, table="nope")))
    with pytest.raises(ScheduleError, match="gather of 49 rows"):
        check_kernel(_with_stage(k, i, step=dataclasses.replace(s.step, num_rows=49)))


def test_checker_rejects_a_concat_whose_operands_are_not_its_inputs():
    k = _kernel(lambda a, b: jnp.concatenate([a, b], axis=0), X, X)
    i, s = _stage(k, "concat")
    assert isinstance(s.step, steps.ConcatStep)
    with pytest.raises(ScheduleError, match="a concat of 2 inputs has 1 operands"):
        check_kernel(_with_stage(k, i, inputs=s.inputs[:1]))


def test_checker_rejects_a_step_of_no_known_kind():
    @dataclasses.dataclass(frozen=True)
    class Bogus:
        kind = "bogus"
        unit = "SFU"
        combine = "plain"

    k = _kernel(lambda a: jnp.exp(a), X)
    with pytest.raises(ScheduleError, match="Bogus is none of the stage kinds"):
        check_kernel(_with_stage(k, 0, step=Bogus()))
    # the executor too refuses it (without the checker in front)
    stage = dataclasses.replace(k.stages[0], step=Bogus())
    decls = {t.name: t for t in k.tensors}
    mem = {k.inputs[0]: np.zeros(decls[k.inputs[0]].layout.device_shape, np.float16)}
    with pytest.raises(ValueError, match="unknown step Bogus"):
        reference.run_stage_reference(stage, mem, decls, k.num_cores)
