"""Tensor parallelism over several simulated cards: ``jax.shard_map`` under ``spyre_jax.jit``.

References: the same function on one card and ``jax.jit`` on the CPU (no shard_map: the
global computation), and NumPy for what each collective gives. Tolerances are the test
oracle's (``spyre_jax.tools.testing``): the dtype's, scaled by ``sqrt(k)`` for the contraction
length ``k``; the collectives, which only add a few fp32 numbers or move them, nearly exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import spyre_jax
from lowering.errors import LoweringError
from spyre_jax.multicard import collective_seconds
from spyre_jax.tools.testing import assert_close


@pytest.fixture
def cards(monkeypatch):
    def make(n: int, shape: tuple[int, ...] | None = None, names=("tp",)) -> Mesh:
        monkeypatch.setenv("SPYRE_NUM_CARDS", str(n))
        devs = np.array(spyre_jax.devices()).reshape(shape or (n,))
        return Mesh(devs, names)

    return make


def _rand(rng, shape, scale=1.0, dtype=np.float32):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _mlp_tp(mesh):
    def body(x, w1, w2):
        return jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "tp")

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P()
    )


def test_devices_follow_spyre_num_cards(monkeypatch):
    monkeypatch.delenv("SPYRE_NUM_CARDS", raising=False)
    assert [d.id for d in spyre_jax.devices()] == [0]
    monkeypatch.setenv("SPYRE_NUM_CARDS", "4")
    devs = spyre_jax.devices()
    assert [d.id for d in devs] == [0, 1, 2, 3] and devs[0] == spyre_jax.devices()[0]
    assert all(d.platform == "spyre" for d in devs)
    monkeypatch.setenv("SPYRE_NUM_CARDS", "two")
    with pytest.raises(ValueError, match="SPYRE_NUM_CARDS"):
        spyre_jax.devices()


@pytest.mark.parametrize("n", [2, 4])
def test_megatron_mlp_equals_one_card_and_the_cpu(cards, n):
    mesh = cards(n)
    rng = np.random.default_rng(n)
    x, w1 = _rand(rng, (64, 256)), _rand(rng, (256, 512), 1 / 16)
    w2 = _rand(rng, (512, 256), 1 / 22)
    f = spyre_jax.jit(_mlp_tp(mesh))
    got = np.asarray(f(x, w1, w2))

    def whole(x, w1, w2):
        return jax.nn.gelu(x @ w1) @ w2

    want = np.asarray(jax.jit(whole)(x, w1, w2))
    one = np.asarray(spyre_jax.jit(whole)(x, w1, w2))
    assert_close(got, want)
    assert_close(got, one)

    c = f.lower(x, w1, w2).compile()
    ca = c.cost_analysis()
    assert ca["cards"] == n and c.sharded_over in (1, n)
    (ar,) = ca["collectives"]
    assert ar["kind"] == "all_reduce" and ar["cards"] == n and ar["bytes"] == 64 * 256 * 4
    card = spyre_jax.CardSpec()
    assert ar["us"] == pytest.approx(collective_seconds("all_reduce", 64 * 256 * 4, n, card) * 1e6)
    # nothing to overlap: the all-reduce waits for the kernel, the result for the all-reduce
    assert ca["sim_time_us"] == pytest.approx(ca["compute_us"] + ca["collective_us"])
    assert ca["sim_time_us_without_collectives"] == pytest.approx(ca["compute_us"])
    # each card does 1/n of the flops
    whole_flops = spyre_jax.jit(whole).lower(x, w1, w2).compile().cost_analysis()["flops"]
    assert ca["flops"] == pytest.approx(whole_flops / n, rel=0.05)


def test_every_collective_computes_what_numpy_says(cards):
    mesh = cards(4)
    n = 4

    def body(x):
        y = x * 2.0
        i = jax.lax.axis_index("tp")
        return (
            jax.lax.psum(y, "tp"),
            jax.lax.pmax(y, "tp"),
            jax.lax.all_gather(y, "tp", axis=1, tiled=True),
            jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True),
            jax.lax.all_to_all(y, "tp", 0, 1, tiled=True),
            jax.lax.ppermute(y, "tp", [(j, (j + 1) % n) for j in range(n)]) + i.astype(y.dtype),
        )

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=P(None, "tp"),
        out_specs=(P(), P(), P(None, "tp"), P("tp"), P(None, "tp"), P(None, "tp")),
    )
    x = _rand(np.random.default_rng(0), (8, 64))
    got = [np.asarray(o) for o in spyre_jax.jit(f)(x)]
    shards = [2 * x[:, 16 * i : 16 * (i + 1)] for i in range(n)]
    np.testing.assert_allclose(got[0], sum(shards), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], np.max(shards, axis=0))
    gathered = np.concatenate(shards, axis=1)  # every card holds all of it
    np.testing.assert_allclose(got[2], np.concatenate([gathered] * n, axis=1))
    total = sum(shards)  # card i keeps rows 2i, 2i+1 of the sum
    np.testing.assert_allclose(got[3], total, rtol=1e-6, atol=1e-6)
    # all_to_all: card i sends its row block j to card j, which concatenates them on dim 1
    a2a = [
        np.concatenate([shards[j][2 * i : 2 * i + 2] for j in range(n)], axis=1) for i in range(n)
    ]
    np.testing.assert_allclose(got[4], np.concatenate(a2a, axis=1))
    perm = [shards[(i - 1) % n] + i for i in range(n)]
    np.testing.assert_allclose(got[5], np.concatenate(perm, axis=1))

    ca = spyre_jax.jit(f).lower(x).compile().cost_analysis()
    kinds = [c["kind"] for c in ca["collectives"]]
    assert kinds == [
        *("all_reduce", "all_reduce", "all_gather"),
        *("reduce_scatter", "all_to_all", "ppermute"),
    ]
    by_op = {c["op"]: c for c in ca["collectives"]}
    assert by_op["all_gather"]["bytes"] == 8 * 64 * 4  # the gathered buffer
    assert by_op["reduce_scatter"]["bytes"] == 8 * 16 * 4  # the buffer reduced


def test_a_two_axis_mesh(cards):
    mesh = cards(4, (2, 2), ("dp", "tp"))

    def body(x, w):
        return jax.lax.psum(x @ w, "tp")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P("dp"))
    rng = np.random.default_rng(1)
    x, w = _rand(rng, (32, 128)), _rand(rng, (128, 64), 1 / 11)
    got = np.asarray(spyre_jax.jit(f)(x, w))
    assert_close(got, x @ w)
    (ar,) = spyre_jax.jit(f).lower(x, w).compile().cost_analysis()["collectives"]
    assert ar["cards"] == 2  # over tp only


def test_a_collective_overlaps_the_compute_that_does_not_wait_for_it(cards):
    mesh = cards(4)

    def body(a, b, c, d):
        y = jax.lax.psum(a @ b, "tp")  # in flight ...
        z = c @ d  # ... while this runs
        return y + z

    spec = (P(None, "tp"), P("tp", None), P(), P())
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P())
    rng = np.random.default_rng(2)
    a, b = _rand(rng, (128, 512)), _rand(rng, (512, 256), 1 / 22)
    c, d = _rand(rng, (128, 256)), _rand(rng, (256, 256), 1 / 16)
    got = np.asarray(spyre_jax.jit(f)(a, b, c, d))
    assert_close(got, a @ b + c @ d)
    lo = spyre_jax.jit(f).lower(a, b, c, d)
    ca = lo.cost_analysis()
    assert len(ca["kernels"]) == 3  # a@b; c@d beside the all-reduce; the add after it
    assert ca["overlap_us"] > 0
    assert ca["sim_time_us"] < ca["compute_us"] + ca["collective_us"]
    (ar,) = ca["collectives"]
    second = ca["kernels"][1]
    assert second["start_us"] < ar["end_us"] and second["end_us"] > ar["start_us"]


def test_fp16_tensor_parallel_block_equals_one_card(cards):
    """A Megatron attention + MLP block in fp16 (the card's dtype) on 2 cards: heads and the
    MLP's hidden dim split, one all-reduce after each half."""
    mesh = cards(2)
    s, d, h, f_ = 32, 128, 4, 256
    hd = d // h

    def attn(x, wq, wk, wv, wo, heads):
        q = (x @ wq).reshape(s, heads, hd).transpose(1, 0, 2)
        k = (x @ wk).reshape(s, heads, hd).transpose(1, 0, 2)
        v = (x @ wv).reshape(s, heads, hd).transpose(1, 0, 2)
        p = jax.nn.softmax((q @ k.transpose(0, 2, 1)) / np.sqrt(hd).astype(x.dtype), axis=-1)
        return (p @ v).transpose(1, 0, 2).reshape(s, heads * hd) @ wo

    def block(x, wq, wk, wv, wo, w1, w2, heads):
        x = x + attn(x, wq, wk, wv, wo, heads)
        return x + jax.nn.gelu(x @ w1) @ w2

    def body(x, wq, wk, wv, wo, w1, w2):
        x = x + jax.lax.psum(attn(x, wq, wk, wv, wo, h // 2), "tp")
        return x + jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "tp")

    col, row = P(None, "tp"), P("tp", None)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), col, col, col, row, col, row), out_specs=P())
    rng = np.random.default_rng(3)
    ws = [
        _rand(rng, sh, 1 / np.sqrt(sh[0]), np.float16)
        for sh in [(d, d), (d, d), (d, d), (d, d), (d, f_), (f_, d)]
    ]
    x = _rand(rng, (s, d), 1.0, np.float16)
    got = np.asarray(spyre_jax.jit(f)(x, *ws)).astype(np.float32)
    want = np.asarray(
        jax.jit(lambda *a: block(*a, h))(*(np.asarray(v, np.float32) for v in (x, *ws)))
    )
    one = np.asarray(spyre_jax.jit(lambda *a: block(*a, h))(x, *ws)).astype(np.float32)
    # the CPU reference computes in fp32: the tolerance is fp16's
    assert_close(got, want, dtype=np.float16)
    assert_close(got, one, dtype=np.float16)
    ca = spyre_jax.jit(f).lower(x, *ws).compile().cost_analysis()
    assert [c["kind"] for c in ca["collectives"]] == ["all_reduce", "all_reduce"]


def test_timing_only_from_shapes_and_the_trace(cards, tmp_path):
    mesh = cards(8)
    sds = [
        jax.ShapeDtypeStruct(s, jnp.float16) for s in [(512, 4096), (4096, 12800), (12800, 4096)]
    ]
    lo = spyre_jax.jit(_mlp_tp(mesh)).lower(*sds)
    ca = lo.compile().cost_analysis()
    assert ca["cards"] == 8 and ca["collective_us"] > 0
    text = lo.as_text()
    assert "all_reduce (psum" in text and "8 cards" in text
    path = tmp_path / "tp.json"
    lo.compile().write_trace(path)
    ev = json.loads(path.read_text())["traceEvents"]
    rows = {(e["pid"], e["args"]["name"]) for e in ev if e.get("name") == "thread_name"}
    assert (7, "link") in rows and (0, "compute") in rows
    links = [e for e in ev if e.get("cat") == "collective"]
    assert len(links) == 8 and all(e["name"] == "all_reduce" for e in links)


def test_bad_meshes_and_functions(cards, monkeypatch):
    mesh = cards(4)
    x = np.ones((8, 64), np.float32)
    # a mesh of JAX's CPU devices, not of cards
    cpu = Mesh(np.array(jax.devices()[:1]), ("tp",))
    g = jax.shard_map(lambda v: jax.lax.psum(v, "tp"), mesh=cpu, in_specs=P(), out_specs=P())
    with pytest.raises(LoweringError, match="spyre_jax.devices"):
        spyre_jax.jit(g).lower(x)
    # more cards in the mesh than SPYRE_NUM_CARDS gives
    f = jax.shard_map(lambda v: jax.lax.psum(v, "tp"), mesh=mesh, in_specs=P(), out_specs=P())
    monkeypatch.setenv("SPYRE_NUM_CARDS", "2")
    with pytest.raises(ValueError, match="SPYRE_NUM_CARDS is 2"):
        spyre_jax.jit(f).lower(x)
    monkeypatch.setenv("SPYRE_NUM_CARDS", "4")
    # work outside the shard_map
    with pytest.raises(LoweringError, match="outside it"):
        spyre_jax.jit(lambda v: f(v * 2)).lower(x)


def test_the_cards_run_sharded_over_jax_host_devices(tmp_path):
    """With as many JAX devices as cards (here host devices), each card's simulation runs on
    its own device under ``jax.shard_map``."""
    script = textwrap.dedent(
        """
        import numpy as np, jax, spyre_jax
        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(np.array(spyre_jax.devices()), ("tp",))
        def body(x, w):
            return jax.lax.psum(x @ w, "tp"), jax.lax.all_gather(x @ w, "tp", axis=0, tiled=True)
        f = spyre_jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp")),
                                        out_specs=(P(), P()), check_vma=False))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((16, 256)).astype(np.float32)
        w = (rng.standard_normal((256, 64)) / 16).astype(np.float32)
        s, g = f(x, w)
        c = f.lower(x, w).compile()
        assert len(jax.devices()) == 4 and c.sharded_over == 4, c.sharded_over
        from spyre_jax.tools.testing import assert_close
        assert_close(s, x @ w)
        parts = [x[:, 64 * i:64 * (i + 1)] @ w[64 * i:64 * (i + 1)] for i in range(4)]
        assert_close(g, np.concatenate(parts))
        print("ok")
        """
    )
    env = dict(os.environ)
    env["SPYRE_NUM_CARDS"] = "4"
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")


@pytest.mark.slow
def test_bench_tp_shortened():
    """``spyre-jax bench tp`` at a small width, without its estimate part: the layer on 1 and
    2 cards agrees with the CPU within fp16's tolerance, and its collectives are timed."""
    from spyre_jax.tools.bench_tp import bench_tp, format_tp

    res = bench_tp(tps=(1, 2), seq=16, hidden=128, heads=4, inter=256, estimate=False)
    one, two = res["rows"]
    assert one["collective_us"] == 0 and two["collective_us"] > 0
    assert two["sim_us_without_collectives"] < one["sim_us"]
    for r in (one, two):
        assert r["max_err_vs_cpu"] < 1e-2 and r["cosine"] > 0.9999
    assert "err vs CPU" in format_tp(res)
