"""Serving loops through ``torch.compile(backend="spyre")``: greedy decoding's numerics.

On the real stack the logits of one-token decode steps drift 10-100x further from the fp32
reference than the prefill's, and tokens drift. Here a decode step is the same fp16 computation
as a prefill row (activations rounded to fp16 where they are stored, fp32 accumulation, the KV
cache stored in fp16 once per token as the prefill stores it), so its error is of the same size.
"""

from __future__ import annotations

import json

import pytest

from spyre_jax.tools import cli

pytest.importorskip("transformers")


def test_decode_logits_stay_as_close_as_the_prefill_over_64_steps(capsys):
    # `spyre-jax bench serve` (static KV cache): one prefill kernel, one decode kernel reused for
    # every step, no CPU fallback (the cache update is an index_put), eager's tokens
    argv = ["bench", "serve", "--models", "llama-tiny", "--layers", "1", "--seq", "8"]
    assert cli.main([*argv, "--tokens", "64", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["llama-tiny"]
    assert r["tokens_equal"] == 64 and r["fallbacks"] == 0 and r["kernels"] == 2
    assert r["runs_agree"] and r["compiles_other_prompt"] <= 2
    assert 0 < r["sim_decode_us_per_token"] < r["sim_prefill_us"]
    assert r["card_tokens_per_s"] > 0 and r["sim_wall_s_per_token"] > 0
    assert r["prefill_logits_err"] < 4e-3  # fp16's 2^-11 rounding, a few roundings deep
    # the worst of 63 decode steps against the one prefill step: the same size, allowing for
    # the maximum over more samples (the real stack: 10-100x)
    assert r["decode_over_prefill_err"] < 3.0, r
    with pytest.raises(ValueError, match="llama-tiny"):
        cli.main(["bench", "serve", "--models", "nope"])
