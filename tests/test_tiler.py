"""The one tiler: a plan function per op kind behind one table, the tiers every plan tries in
order (first_fit), and the unfuse pass that asks the tiler before the schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowering.pipeline as pipeline
import spyre_jax
from device_model.card import CardSpec
from lowering.errors import TilingError
from lowering.from_jaxpr import from_jaxpr
from lowering.graph import Var
from lowering.schedule import PLANNERS, schedule
from lowering.tile_matmul import fits_whole
from lowering.tiling import TIERS, NoFit, Tier, TilingContext, first_fit
from lowering.unfuse import unfuse
from spyre_jax.tools.testing import assert_close


def test_every_scheduled_op_kind_has_one_plan_function():
    assert set(PLANNERS) == {
        "map",
        "matmul",
        "gather",
        "reshape",
        "concatenate",
        "sort",
        "take_along",
        "conv",
    }
    assert TIERS == (Tier.WHOLE, Tier.RAGGED, Tier.SINGLE)


def _ctx() -> TilingContext:
    ctx = TilingContext(CardSpec())
    ctx.declare(Var((64, 64), "float16"), "input", "arg0")
    return ctx


def test_first_fit_tries_the_tiers_in_order_and_rolls_back_a_tier_that_does_not_fit():
    ctx = _ctx()
    tried = []

    def build(tier: Tier) -> list:
        tried.append(tier)
        ctx.view("arg0", (4096,), "float16")  # a view the attempt declares
        ctx.decls["tmp"] = ctx.decls["arg0"]  # and a temp
        if tier is Tier.WHOLE:
            raise TilingError("no whole blocks")
        if tier is Tier.RAGGED:
            raise NoFit(5000)
        return ["stage"]

    assert first_fit(ctx, "op", "", lambda: build(Tier.WHOLE), build) == ["stage"]
    assert tried == [Tier.WHOLE, Tier.RAGGED, Tier.SINGLE]
    # the failed tiers' views and temps are forgotten; the winner's stay
    assert len(ctx.aliases) == 1 and set(ctx.decls) == {"arg0", ctx.aliases[0][0], "tmp"}


def test_first_fit_names_the_op_the_scratchpad_the_need_and_the_users_line():
    ctx = _ctx()

    def build(tier: Tier) -> list:
        ctx.view("arg0", (4096,), "float16")
        raise NoFit({Tier.WHOLE: 9000, Tier.RAGGED: 7000, Tier.SINGLE: 6000}[tier])

    with pytest.raises(TilingError) as ei:
        first_fit(ctx, "map (exp)", "model.py:12 (f)", lambda: build(Tier.WHOLE), build)
    msg = str(ei.value)
    assert msg.startswith("spyre: map (exp) cannot be tiled into the usable scratchpad")
    assert f"({ctx.cap} B per core): the smallest tiling needs 6000 B" in msg
    assert "(tried whole sticks, ragged blocks, single buffering)" in msg
    assert msg.endswith("at: model.py:12 (f)")
    assert not ctx.aliases and set(ctx.decls) == {"arg0"}


def test_a_tier_error_that_is_not_about_space_is_kept_as_the_cause():
    ctx = _ctx()

    def build(tier: Tier) -> list:
        raise TilingError(f"{tier.value}: unsupported")

    with pytest.raises(TilingError) as ei:
        first_fit(ctx, "op", "", lambda: build(Tier.WHOLE), build, (Tier.WHOLE,))
    assert "needs" not in str(ei.value) and "whole sticks: unsupported" in str(ei.value.__cause__)


def _mlp_in(x, w, b, r):
    return jax.nn.gelu(x @ w + b) + r


def _passes_until(g, card, stop):
    for name, fn in pipeline.graph_passes(card):
        if name == stop:
            return g
        g = fn(g)
    raise AssertionError(stop)


def test_the_unfuse_pass_splits_a_fused_matmul_the_tiler_cannot_fit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1000)).astype(np.float16)
    w = (rng.standard_normal((1000, 64)) / 32).astype(np.float16)
    b, r = (
        rng.standard_normal(64).astype(np.float16),
        rng.standard_normal((32, 64)).astype(np.float16),
    )
    g0 = from_jaxpr(jax.make_jaxpr(_mlp_in)(x, w, b, r), "f")
    for card, split in (
        (CardSpec(), False),
        (CardSpec().replace(scratchpad_bytes=16 * 1024), True),
    ):
        g = _passes_until(g0, card, "unfuse")
        (mm,) = [n for n in g.nodes if n.op == "matmul"]
        assert mm.params.epilogue is not None
        assert fits_whole(mm, card) is not split
        out = unfuse(g, card)
        if not split:
            assert out is g  # nothing to do: the same graph
            continue
        mms = [n for n in out.nodes if n.op == "matmul"]
        assert [n.params.epilogue for n in mms] == [None] and len(out.nodes) == len(g.nodes) + 1
        kernel = schedule(out, card)  # the tiler takes the unfused matmul (K split)
        assert [s.kind for s in kernel.stages][-2:] == ["matmul", "map"]
        # the same graph unsplit is refused by the tiler, which no longer changes graphs
        with pytest.raises(TilingError, match="fused epilogue or prologue"):
            schedule(g, card)


def test_a_map_too_long_for_whole_rows_takes_the_ragged_tier(small_card):
    card = small_card(scratchpad_bytes=16 * 1024)
    x = np.random.default_rng(1).standard_normal((8, 20000)).astype(np.float32)
    f = lambda a: jnp.sum(jnp.exp(a * 0.01), axis=-1)  # noqa: E731
    low = spyre_jax.jit(f).lower(x)
    # the reduction split across steps (a carried accumulator), within the scratchpad
    assert any(s.kind == "map" and s.step.split is not None for s in low.kernel.stages)
    assert all(s.sp_peak_bytes <= card.scratchpad_usable_bytes for s in low.kernel.stages)
    assert_close(np.asarray(spyre_jax.jit(f)(x)), jax.jit(f)(x), dtype=np.float32, k=20000)
