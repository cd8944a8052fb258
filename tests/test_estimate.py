"""``spyre-jax estimate``: a model's time and memory on one or more cards from its config alone."""

from __future__ import annotations

import json

import pytest

from device_model.card import DEFAULT_CARD
from device_model.memory import DeviceOOMError
from spyre_jax.tools import cli
from spyre_jax.tools import estimate as est
from spyre_jax.tools.bench_schedules import BLOCKS

GRANITE_8B = {
    "model_type": "granite",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 12800,
    "num_hidden_layers": 40,
    "vocab_size": 49159,
    "tie_word_embeddings": True,
}

SMALL = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "vocab_size": 1000,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 704,
        "num_hidden_layers": 2,
        "vocab_size": 1500,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "vocab_size": 800,
    },
    "gpt2": {"model_type": "gpt2", "n_embd": 256, "n_head": 4, "n_layer": 2, "vocab_size": 1000},
}


def test_granite_8b_at_batch_1_is_bound_by_reading_its_weights():
    # decode at batch 1 reads every weight once per token: the estimate sits on that floor
    # (16 GB at 150 GB/s) and cannot go under it
    r = est.estimate(GRANITE_8B, prefill=128, decode_context=128)
    assert 8.0e9 < r["params"] < 8.3e9
    assert r["weights_bytes_per_card"] == pytest.approx(2 * r["params"], rel=0.01)
    floor = r["weights_bytes_per_card"] / DEFAULT_CARD.memory_bw_one_way * 1e3
    assert floor <= r["decode_ms_per_token"] <= 1.05 * floor
    assert r["tokens_per_s"] == pytest.approx(1e3 / r["decode_ms_per_token"])
    assert r["prefill_ms"] > r["decode_ms_per_token"]
    for key in ("prefill_ms", "decode_ms_per_token", "tokens_per_s", "weights_bytes_per_card"):
        assert key in r
    assert r["wall_s"] < 60


def test_tensor_parallel_splits_weights_and_adds_collectives(tmp_path):
    r1 = est.estimate(GRANITE_8B, tp=1)
    r2 = est.estimate(GRANITE_8B, tp=2)
    r4 = est.estimate(GRANITE_8B, tp=4)
    assert r2["weights_bytes_per_card"] == pytest.approx(r1["weights_bytes_per_card"] / 2, rel=0.01)
    assert r1["phases"]["decode"]["collectives_us"] == 0
    assert 0 < r2["phases"]["decode"]["collectives_us"] < r4["phases"]["decode"]["collectives_us"]
    assert r4["decode_ms_per_token"] < r2["decode_ms_per_token"] < r1["decode_ms_per_token"]
    trace = tmp_path / "t.json"
    est.write_trace(r2, str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e["cat"] == "collective"}
    assert "all_reduce (embedding)" in names and "all_gather (logits)" in names
    assert sum(e["dur"] for e in events) == pytest.approx(
        1e3 * (r2["prefill_ms"] + r2["decode_ms_per_token"])
    )


def test_a_layer_costs_what_the_same_layer_written_elsewhere_costs():
    # the estimate's Llama layer and bench schedules' llama block are two implementations of
    # one Llama-3-8B layer at a prefill of 512: their schedules take the same time
    import spyre_jax

    fn, args = BLOCKS["llama-block-4096-seq512"]()
    block_us = spyre_jax.jit(fn).lower(*args).compile().cost_analysis()["sim_time_us"]
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
    }
    r = est.estimate(cfg, prefill=512)
    assert r["phases"]["prefill"]["layer"]["us"] == pytest.approx(block_us, rel=0.05)
    assert 8.0e9 < r["params"] < 8.1e9  # Llama-3-8B


@pytest.mark.parametrize("family", sorted(SMALL))
def test_every_family_estimates(family):
    r = est.estimate(SMALL[family], tp=2, prefill=64, decode_context=96, batch=2)
    assert r["prefill_ms"] > 0 and r["decode_ms_per_token"] > 0
    assert r["tokens_per_s"] == pytest.approx(2e3 / r["decode_ms_per_token"])
    assert r["kv_cache_bytes_per_card"] > 0


def test_bad_configs_name_the_field():
    with pytest.raises(est.ConfigError, match="'model_type'.*'t5'"):
        est.estimate({**GRANITE_8B, "model_type": "t5"})
    with pytest.raises(est.ConfigError, match="'model_type'"):
        est.estimate({k: v for k, v in GRANITE_8B.items() if k != "model_type"})
    with pytest.raises(est.ConfigError, match="'intermediate_size'"):
        est.estimate({k: v for k, v in GRANITE_8B.items() if k != "intermediate_size"})
    with pytest.raises(est.ConfigError, match="'hidden_size'.*positive"):
        est.estimate({**GRANITE_8B, "hidden_size": "4096"})
    with pytest.raises(est.ConfigError, match="--tp 3 does not divide num_attention_heads"):
        est.estimate(GRANITE_8B, tp=3)
    with pytest.raises(est.ConfigError, match="--tp 16 does not divide num_key_value_heads"):
        est.estimate(GRANITE_8B, tp=16)
    with pytest.raises(est.ConfigError, match="--dtype"):
        est.estimate(GRANITE_8B, dtype="int3")


def test_a_model_too_big_for_the_cards_says_by_how_much():
    big = {**GRANITE_8B, "num_hidden_layers": 400}  # 16 GB x 10
    with pytest.raises(DeviceOOMError, match=r"GB more than a card holds"):
        est.estimate(big)
    assert (
        est.estimate(big, tp=2)["device_bytes_per_card"] < DEFAULT_CARD.device_memory_usable_bytes
    )


def test_cli_estimate(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL["llama"]))
    assert cli.main(["estimate", str(cfg), "--tp", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tp"] == 2 and r["decode_ms_per_token"] > 0
    assert all(len(pt) == 3 for pt in r["phases"]["prefill"]["layer"]["roofline"])
    png = tmp_path / "est.png"
    assert cli.main(["estimate", str(cfg), "--plot", str(png)]) == 0
    assert "decoder layer" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # a roofline and the time per layer kind
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "bert"}))
    assert cli.main(["estimate", str(bad)]) == 2
    assert "'model_type' is 'bert'" in capsys.readouterr().err
    assert cli.main(["estimate", str(tmp_path / "missing.json")]) == 2


def _kernel_times(build, ids):
    import torch

    from torch_bridge import backend as tb

    torch._dynamo.reset()
    # the kernels before, held: one that dies meanwhile would shift an index into the list
    before = {id(k): k for k in tb.compiled_kernels()}
    with torch.no_grad():
        out = torch.compile(build(), backend="spyre", dynamic=False)(ids)
    new = [k for k in tb.compiled_kernels() if before.get(id(k)) is not k]
    return out, [k.cost_analysis()["sim_time_us"] for k in new]


@pytest.mark.parametrize("mode", ["meta", "fake"])
@pytest.mark.slow
def test_a_torch_model_without_weights_compiles_for_its_timing(fresh_card, mode):
    # a model on the meta device, or built under FakeTensorMode, compiles through the backend
    # as a real one does: its kernels' simulated times are the real model's; nothing runs, and
    # the results are shapes on the model's meta or fake device
    import contextlib

    import torch
    import transformers
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=500)
    cfg.use_cache = False
    torch.manual_seed(0)
    _, want = _kernel_times(
        lambda: transformers.GPT2LMHeadModel(cfg).eval(), torch.zeros((1, 32), dtype=torch.long)
    )
    fake = FakeTensorMode() if mode == "fake" else contextlib.nullcontext()
    with fake:
        device = "meta" if mode == "meta" else "cpu"
        with torch.device(device):
            ids = torch.zeros((1, 32), dtype=torch.long)
            out, got = _kernel_times(lambda: transformers.GPT2LMHeadModel(cfg).eval(), ids)
    assert got == pytest.approx(want) and len(got) >= 1
    logits = out.logits
    assert tuple(logits.shape) == (1, 32, 500)
    assert logits.is_meta if mode == "meta" else isinstance(logits, FakeTensor)
