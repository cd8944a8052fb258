"""Loops and branches (issue 30): lax.scan, fori_loop, while_loop, cond and switch inside
spyre_jax.jit against jax.jit on the CPU; the host program they lower to, its figures, its
timeline and its guard."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import spyre_jax
from device_model.hostprog import Branch, LoopLimitError, ScanLoop, WhileLoop
from lowering import control
from spyre_jax.tools.testing import assert_tree_close


def _rand(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.fixture(params=["looped", "compiler_choice"])
def unroll_mode(request, monkeypatch):
    """Each scan test twice: the loop kept (never unrolled by choice) and as the compiler
    chooses (short cheap scans unrolled)."""
    if request.param == "looped":
        monkeypatch.setattr(control, "UNROLL_MAX_NODES", 0)
    return request.param


def _check(f, *args, k=1, **kw):
    got = spyre_jax.jit(f, **kw)(*args)
    want = jax.jit(f, **kw)(*args)
    assert_tree_close(got, want, k=k)
    return got


# ---------------------------------------------------------------------------------------------
# scan


def test_scan_carries_a_pytree_and_stacks_outputs(unroll_mode):
    def f(h, xs, w):
        def step(c, x):
            h, n = c
            h = jnp.tanh(h @ w + x)
            return (h, n + 1), {"h": h, "s": h.sum()}

        return lax.scan(step, (h, jnp.int32(0)), xs)

    h, xs, w = _rand((2, 64)), _rand((5, 2, 64), 1), _rand((64, 64), 2) / 8
    _check(f, h, xs, w, k=64)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_reverse_and_scalar_slices(unroll_mode, reverse):
    def f(xs):
        return lax.scan(lambda c, x: (c * 0.5 + x, c), jnp.float32(0), xs, reverse=reverse)

    _check(f, _rand((7,), 3))


def test_scan_with_length_only_and_no_inputs(unroll_mode):
    def f(x):
        return lax.scan(lambda c, _: (c * 2 + 1, c.sum()), x, None, length=6)

    _check(f, _rand((3, 40), 4))


def test_scan_of_length_zero():
    f = lambda x, xs: lax.scan(lambda c, x: (c + x, c * x), x, xs)  # noqa: E731
    _check(f, _rand((4,), 5), np.zeros((0, 4), np.float32))


def test_scan_over_stacked_layers_compiles_the_body_once(monkeypatch):
    # a loop kept as a loop: one body program whatever the number of layers
    monkeypatch.setattr(control, "UNROLL_MAX_NODES", 0)

    def model(x, ws, bs):
        def layer(h, wb):
            w, b = wb
            return jax.nn.gelu(h @ w + b), None

        return lax.scan(layer, x, (ws, bs))[0]

    kernels = []
    for n in (2, 8):
        x, ws, bs = _rand((4, 64)), _rand((n, 64, 64), 1) / 8, _rand((n, 64), 2)
        low = spyre_jax.jit(model).lower(x, ws, bs)
        (loop,) = [s for s in low.program.steps if isinstance(s, ScanLoop)]
        assert loop.length == n
        kernels.append(len(low.program.kernels()))
        _check(model, x, ws, bs, k=64)
    assert kernels[0] == kernels[1]


def test_user_unroll_inlines_the_scan():
    f = lambda xs: lax.scan(lambda c, x: (c + x, c), jnp.zeros(8), xs, unroll=True)  # noqa: E731
    low = spyre_jax.jit(f).lower(_rand((3, 8)))
    assert low.program is None and low.kernel is not None
    _check(f, _rand((3, 8)))


# ---------------------------------------------------------------------------------------------
# fori_loop and while_loop


def test_fori_loop_with_static_and_traced_bounds():
    body = lambda i, c: c * 1.5 + i.astype(jnp.float32)  # noqa: E731
    _check(lambda x: lax.fori_loop(0, 4, body, x), _rand((3, 5)))
    f = lambda x, lo, hi: lax.fori_loop(lo, hi, body, x)  # noqa: E731
    for lo, hi in ((1, 5), (3, 3), (4, 2)):
        _check(f, _rand((3, 5)), np.int32(lo), np.int32(hi))


def test_while_loop_with_a_data_dependent_predicate():
    def newton_sqrt(a):
        def cond(c):
            x, n = c
            return (jnp.max(jnp.abs(x * x - a)) > 1e-3) & (n < 50)

        def body(c):
            x, n = c
            return (0.5 * (x + a / x), n + 1)

        return lax.while_loop(cond, body, (a, jnp.int32(0)))

    a = np.abs(_rand((4, 64))) + 1
    jf = spyre_jax.jit(newton_sqrt)
    x, n = jf(a)
    wx, wn = jax.jit(newton_sqrt)(a)
    n = int(np.asarray(n))
    assert n == int(wn) > 0
    assert_tree_close(x, wx)
    (row,) = [r for r in jf.lower(a).cost_analysis()["control"] if r["kind"] == "while"]
    assert row["iterations"] == "unknown"  # before a run: the trip count is data
    row = [r for r in jf.lower(a).compile().cost_analysis()["control"] if r["kind"] == "while"][0]
    assert row["iterations"] == n and row["host_round_trips"] == n + 1


def test_a_runaway_loop_stops_with_a_clear_error_and_frees_its_memory(monkeypatch):
    monkeypatch.setenv("SPYRE_MAX_ITERATIONS", "20")
    f = spyre_jax.jit(lambda x: lax.while_loop(lambda c: c[0] > -1, lambda c: c + 1, x))
    x = np.zeros(4, np.float32)
    f(np.full(4, -5, np.float32))  # compiles; ends after a few iterations
    gc.collect()
    before = spyre_jax.memory_stats()["bytes_in_use"]
    with pytest.raises(LoopLimitError, match=r"while loop at .*test_control.py:\d+.*20"):
        f(x)
    gc.collect()
    assert spyre_jax.memory_stats()["bytes_in_use"] == before
    assert np.asarray(spyre_jax.jit(lambda x: x + 1)(x)).tolist() == [1.0] * 4  # still usable


# ---------------------------------------------------------------------------------------------
# cond and switch


def test_cond_takes_the_branch_the_predicate_names(unroll_mode):
    f = lambda p, x: lax.cond(p, lambda x: jnp.sin(x) * 2, lambda x: x - 1, x)  # noqa: E731
    x = _rand((3, 70))
    for p in (True, False):
        _check(f, np.bool_(p), x)
    low = spyre_jax.jit(f).lower(np.bool_(True), x)
    if unroll_mode == "looped":  # read back: a branch of the host program
        assert any(isinstance(s, Branch) for s in low.program.steps)
        assert "inlined" not in low.cost_analysis()
    else:  # two tiny branches: both computed and selected beats a round trip
        assert low.program is None
        (row,) = low.cost_analysis()["inlined"]
        assert row["kind"] == "cond" and "selected" in row["decision"]
        assert sum(row["branches_us"]) < max(row["branches_us"]) + row["round_trip_us"]


def test_switch_clamps_an_index_out_of_range(unroll_mode):
    branches = [lambda x: x, lambda x: x + 1, lambda x: jnp.exp(x)]
    f = lambda i, x: lax.switch(i, branches, x)  # noqa: E731
    x = _rand((5,))
    for i in (-3, 0, 1, 2, 7):
        _check(f, np.int32(i), x)


def test_a_costly_branch_is_read_back_not_computed_both_ways():
    # each branch takes longer than the round trip: computing both would cost more
    def f(p, x, w):
        heavy = lambda x: jnp.tanh(x @ w) @ w  # noqa: E731
        return lax.cond(p, heavy, lambda x: jnp.tanh(heavy(x) @ w), x)

    spec = jax.ShapeDtypeStruct((2048, 2048), jnp.float16)
    low = spyre_jax.jit(f).lower(jax.ShapeDtypeStruct((), jnp.bool_), spec, spec)
    assert low.program is not None and "inlined" not in low.cost_analysis()
    (row,) = low.cost_analysis()["control"]
    assert row["kind"] == "branch" and min(row["branches_us"]) > row["iteration_us"] - max(
        row["branches_us"]
    )


def test_control_flow_nests():
    def f(xs, p):
        def step(c, x):
            c = lax.cond(p, lambda c: c + x, lambda c: c * x, c)
            c = lax.while_loop(lambda c: c.sum() > 100, lambda c: c / 2, c)
            return c, c.sum()

        return lax.scan(step, jnp.ones(16), xs)

    xs = np.abs(_rand((6, 16), 7)) + 0.5
    for p in (True, False):
        _check(f, xs, np.bool_(p))


# ---------------------------------------------------------------------------------------------
# what the program shows


def test_program_text_figures_and_timeline(monkeypatch):
    monkeypatch.setattr(control, "UNROLL_MAX_NODES", 0)

    def f(x, n):
        y, _ = lax.scan(lambda c, _: (jnp.tanh(c) + 1, None), x, None, length=3)
        return lax.fori_loop(0, n, lambda i, c: c * 2, y)

    x = _rand((2, 64))
    jf = spyre_jax.jit(f)
    low = jf.lower(x, np.int32(2))
    text = low.as_text()
    assert "scan[length=3]" in text and "while(" in text and "launch" in text
    assert "graph scan_body" in low.as_text("graph")
    kinds = [type(s) for s in low.program.steps]
    assert ScanLoop in kinds and WhileLoop in kinds
    with spyre_jax.profile() as prof:
        out = jf(x, np.int32(2))
        np.asarray(out)
    syncs = [s for s in prof.records if s.kind == "host_sync"]
    reads = [s for s in syncs if "predicate" in s.name]
    assert len(reads) == 3  # the predicate read back three times
    assert all(s.end - s.start > 0 for s in syncs)
    # the scan's body kernel is shorter than the host's launch: the stream waits between
    assert len(syncs) - len(reads) == 2
    cost = jf._cache[next(iter(jf._cache))].cost_analysis()
    scan_row = [r for r in cost["control"] if r["kind"] == "scan"][0]
    assert scan_row["iterations"] == 3 and scan_row["launches"] == 3
    gap = spyre_jax.CardSpec().host_launch_s * 1e6 - scan_row["kernel_us"]
    assert scan_row["iteration_us"] == pytest.approx(scan_row["kernel_us"] + gap)
    assert scan_row["total_us"] == pytest.approx(3 * scan_row["iteration_us"] - gap)
    assert cost["host_round_trips"] == 3


def test_the_docs_example_runs(capsys):
    import pathlib
    import re

    page = pathlib.Path(__file__).parent.parent / "docs" / "control-flow.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) == 2  # JAX's, then PyTorch's
    for code in blocks:
        exec(compile(code, str(page), "exec"), {})
    out = capsys.readouterr().out
    assert "(4, 64)" in out and "scan" in out and "1.414" in out


def test_the_checker_checks_control_nodes_and_their_bodies():
    from lowering.graph import Graph, GraphError, Node, Var, check_graph
    from lowering.op_params import Cond, Convert, Elementwise, Scan

    c, xs = Var((4,), "float32"), Var((3, 4), "float32")
    a, x = Var((4,), "float32"), Var((4,), "float32")
    s = Var((4,), "float32")
    body = Graph(
        "body", (a, x), (Node("elementwise", (a, x), (s,), Elementwise("add", "float32")),), (s, s)
    )
    outs = (Var((4,), "float32"), Var((3, 4), "float32"))
    good = Node("scan", (c, xs), outs, Scan(body, 3, 0, 1))
    check_graph(Graph("g", (c, xs), (good,), outs))
    bad = Node("scan", (c, xs), outs, Scan(body, 5, 0, 1))  # stacked inputs of length 3
    with pytest.raises(GraphError, match="not of length 5"):
        check_graph(Graph("g", (c, xs), (bad,), outs))
    wrong = Graph("body", (a, x), body.nodes, (Var((2,), "float32"), s))  # undefined output
    with pytest.raises(GraphError, match="in subgraph 0"):
        check_graph(Graph("g", (c, xs), (Node("scan", (c, xs), outs, Scan(wrong, 3, 0, 1)),), outs))
    i = Var((), "int32")
    y = Var((4,), "float32")
    br = Graph("b", (a,), (), (a,))
    ai = Var((4,), "int32")
    other = Graph("b2", (a,), (Node("convert", (a,), (ai,), Convert("int32")),), (ai,))
    with pytest.raises(GraphError, match="branch 1 returns"):
        check_graph(Graph("g", (i, c), (Node("cond", (i, c), (y,), Cond((br, other))),), (y,)))


def test_a_long_loop_keeps_its_first_iterations_in_the_trace_and_summarises_the_rest():
    from device_model.hostprog import TRACE_ITERATIONS

    f = spyre_jax.jit(
        lambda x: lax.while_loop(lambda c: c[0] < 200, lambda c: (c[0] + 1, c[1] * 2), (0, x))
    )
    x = np.ones(4, np.float32)
    f(x)
    with spyre_jax.profile(print_summary=False) as prof:
        np.asarray(f(x)[1])
    reads = [r for r in prof.records if r.kind == "copy_out" and r.name.startswith("copy out bool")]
    assert len(reads) == TRACE_ITERATIONS
    (summary,) = [r for r in prof.records if r.kind == "loop_summary"]
    assert (
        f"iterations {TRACE_ITERATIONS}-200" in summary.name and "test_control.py" in summary.name
    )
    assert summary.end > summary.start
    # the unrecorded steps still took their time: the summary ends where the timeline does
    assert summary.end == pytest.approx(max(r.end for r in prof.records))


def test_a_loop_inside_a_shard_map_body_is_unrolled_or_refused_clearly(monkeypatch):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from lowering.errors import LoweringError

    monkeypatch.setenv("SPYRE_NUM_CARDS", "2")
    mesh = Mesh(np.array(spyre_jax.devices()), ("x",))
    x = _rand((4, 8))

    # a short loop the compiler unrolls runs on both cards
    body3 = lambda a: lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c) * 0.5, a)  # noqa: E731
    f = spyre_jax.jit(jax.shard_map(body3, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    np.testing.assert_allclose(np.asarray(f(x)), jax.jit(body3)(x), rtol=1e-5, atol=1e-6)
    # a loop kept a loop is refused, naming the loop's line
    monkeypatch.setattr(control, "UNROLL_MAX_NODES", 0)
    f = spyre_jax.jit(jax.shard_map(body3, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(LoweringError, match=r"scan inside a shard_map body .*test_control.py"):
        f(x)


def test_a_carry_that_changes_type_is_jaxs_own_error():
    f = spyre_jax.jit(lambda x: lax.fori_loop(0, 3, lambda i, c: c.astype(jnp.float16), x))
    with pytest.raises(TypeError, match="carry"):
        f(np.ones(4, np.float32))
