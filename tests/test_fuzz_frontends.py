"""The net (``spyre_jax.tools.fuzz``): random programs over the shared op set, written once as
data and emitted as a JAX function and a torch function, through all four paths
(``assert_frontends_agree``).

CI runs ``SPYRE_FUZZ_EXAMPLES`` (default 40, about 1-2.7 s each on 2 cores) small-shape programs
(odd sizes 1, 3, 63, 65, 100, broadcasting, reductions with keepdims, matmuls, transposes,
reshapes) and
``SPYRE_FUZZ_REAL_EXAMPLES`` (default 3) real-size ones (vocabulary-wide rows, rows longer than a
core's scratchpad, a vocabulary's worth of rows); most real-shape draws happen outside CI, in
``spyre-jax fuzz --examples N`` (about one program in ten real-size). Failures shrink
(hypothesis) and each one found is kept below as an ``@example`` regression.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

from lowering.builder import Lit
from lowering.from_fx import RULES
from spyre_jax import CardSpec
from spyre_jax.tools import fuzz
from spyre_jax.tools.fuzz import Case, programs, run_program
from spyre_jax.tools.testing import assert_close

N_EXAMPLES = int(os.environ.get("SPYRE_FUZZ_EXAMPLES", "40"))  # more: SPYRE_FUZZ_EXAMPLES
N_REAL_EXAMPLES = int(os.environ.get("SPYRE_FUZZ_REAL_EXAMPLES", "3"))

_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "derandomize": True,
}


@settings(max_examples=N_EXAMPLES, **_SETTINGS)
@given(programs(real_shapes="off"))
@pytest.mark.slow
def test_random_programs_agree_across_frontends(case):
    run_program(case)


@settings(max_examples=N_REAL_EXAMPLES, **_SETTINGS)
@given(programs(real_shapes="only"))
# regressions found by `spyre-jax fuzz --real-shapes only`: flattening more than one row longer
# than the usable scratchpad, of a length with no divisor that makes whole sticks (419431,
# 419425, 1048575), raised TilingError on both card paths (now: through rows of a smaller common
# divisor of the two row lengths)
@example(Case(2, 419431, [("reshape", 0)], 0, 1))
@example(Case(4, 1048575, [("reshape", 0)], 0, 1))
@pytest.mark.slow
def test_random_real_shape_programs_agree_across_frontends(case):
    run_program(case)


def test_real_shapes_are_real():
    # the long rows do not fit one core's usable scratchpad; the vocabularies are real ones; "mix"
    # draws both kinds, "only" real ones, "off" small ones (the strategy alone, nothing runs)
    assert min(fuzz.LONG_COLS) * 4 > CardSpec().scratchpad_usable_bytes
    assert {50257, 128256, 32000} <= set(fuzz.VOCAB)
    drawn = {mode: [] for mode in fuzz.REAL_MODES}
    for mode in fuzz.REAL_MODES:
        seen = drawn[mode]

        @settings(max_examples=60, database=None, **_SETTINGS)
        @given(programs(real_shapes=mode))
        def draw(case):
            seen.append(fuzz.is_real_shape(case))  # noqa: B023 (draw runs in this iteration)

        draw()
    assert all(drawn["only"]) and not any(drawn["off"])
    assert 0 < sum(drawn["mix"]) < len(drawn["mix"]) / 2
    with pytest.raises(ValueError, match="small k"):
        run_program(Case(3, 50257, [("matmul", 0)], 0, k=0))  # a [50257, 50257] weight


def test_program_emitters_agree_with_each_other_on_cpu():
    # the net itself: the two emitters write the same program (checked on the CPU paths alone),
    # with a square weight and with a low-rank one ([C, k] then its transpose)
    prog = [
        ("unary", 0, "tanh"),
        ("binary", 1, "add", 0, False),
        ("reduce", 2, "max", 1),
        ("matmul", 3),
        ("unary", 4, "softmax"),
    ]
    for k in (0, 3):
        x, row, w = fuzz._inputs(Case(5, 65, prog, 0, k))
        a = np.asarray(jax.jit(fuzz._emit(prog, "jax"))(x, row, w))
        with torch.no_grad():
            b = fuzz._emit(prog, "torch")(*(torch.from_numpy(v) for v in (x, row, w))).numpy()
        assert_close(a, b)


def test_programs_with_loops_and_branches_agree_across_frontends():
    # a loop (fori_loop / while_loop) and a cond (lax.cond / torch.cond) on all four paths,
    # the cond's predicate both ways
    prog = [("loop", 0, 3, "tanh"), ("cond", 1, "square", "neg"), ("binary", 2, "add", 0, True)]
    run_program(Case(5, 65, prog, 0))
    run_program(Case(3, 7, [("unary", 0, "abs"), ("cond", 1, "scale", "relu")], 1))  # true
    neg = [("unary", 0, "abs"), ("unary", 1, "neg"), ("cond", 2, "tanh", "exp_clip")]
    run_program(Case(3, 7, neg, 2))  # the sum below zero: the false branch


@pytest.mark.slow
def test_the_net_catches_a_planted_lowering_bug(monkeypatch):
    # the torch importer's rule for aten.tanh computes 1.01 * tanh(x): the real rule, times a
    # wrong constant; the net fails the program and shrinks it to the one step that is wrong
    real = RULES[torch.ops.aten.tanh.default]

    def wrong_rule(b, node, *args, **kwargs):
        r = real(b, node, *args, **kwargs)
        return b.elementwise("mul", [r, Lit(1.01, r.dtype)], r.shape, r.dtype)

    monkeypatch.setitem(RULES, torch.ops.aten.tanh.default, wrong_rule)
    case = Case(5, 65, [("unary", 0, "tanh"), ("reduce", 1, "sum", 1)], 0)
    with pytest.raises(AssertionError, match="torch.compile spyre"):
        run_program(case)
    err = fuzz.program_error(case)
    assert fuzz._signature(err) == "torch.compile spyre (card)"
    small, small_err, _ = fuzz.shrink(case, err, max_runs=4)
    assert small.prog == [("unary", 0, "tanh")] and "torch.compile spyre" in small_err
