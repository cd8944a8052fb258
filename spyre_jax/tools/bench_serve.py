"""``spyre-jax bench serve``: greedy decoding through ``torch.compile(backend="spyre")``.

For each model (a 2-layer Llama of width 128, and the Llama-3.2-1B configuration of ``bench
models``; random weights), ``model.generate()`` runs greedy decoding of ``--tokens`` new tokens
after a ``--seq``-token prompt. The KV cache is the static one by default
(``cache_implementation="static"``: one prefill kernel and one decode kernel, whatever the
position) or, with ``--cache dynamic``, transformers' default cache (decode kernels per bucket of
the KV length). Each runs three ways: fp32 eager on the CPU (the reference tokens and wall time),
and fp16 with ``model.forward`` compiled for the card, once cold (compiles included) and once
warm. Reported per model: the simulated prefill time and time per decoded token (the card
kernels' simulated times, from ``cost_analysis()``), tokens per second on the card, the
simulation's wall time per token (warm) beside eager CPU's, kernels compiled, the graphs a second
prompt of another length compiles, CPU fallbacks, how many of the new tokens equal the fp32
reference's, and the error of the logits (largest absolute error over the reference's largest
logit) of the prefill step and the worst decode step, while the tokens agree, with their ratio.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from torch_bridge import backend as tb

from .bench_models import format_table, llama_1b

__all__ = ["SERVE_MODELS", "bench_serve", "format_serve", "step_errors"]


def llama_tiny(layers: int | None) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers or 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg)


#: name -> builder(layers)
SERVE_MODELS = {
    "llama-tiny": llama_tiny,
    "llama-3.2-1b": lambda layers: llama_1b(layers, False),
}


#: the KV caches ``--cache`` takes: transformers' static cache, or its default (dynamic) one
CACHES = ("static", "dynamic")


def _generate(
    model: Any, ids: torch.Tensor, n: int, cache: str = "static"
) -> tuple[torch.Tensor, float, list]:
    """Greedy decoding of ``n`` tokens: the new tokens, the wall time, each step's logits."""
    t = time.perf_counter()
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    out = model.generate(
        ids,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        **kw,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    wall = time.perf_counter() - t
    return out.sequences[0, ids.shape[1] :], wall, [x[0].float() for x in out.logits]


def step_errors(got: list, want: list, same: int) -> list[float]:
    """Each step's logits error against the reference, scaled by the reference's largest
    logit, over the first ``same`` steps (where both decoded the same tokens so far)."""
    return [
        float((g - w).abs().max() / w.abs().max())
        for g, w in zip(got[:same], want[:same], strict=True)
    ]


def _agreeing(got: torch.Tensor, want: torch.Tensor) -> int:
    """How many steps saw the same tokens: the first step, and one more per equal token."""
    diff = (got != want[: len(got)]).nonzero()
    return len(got) if len(diff) == 0 else int(diff[0, 0]) + 1


def run_serve(
    name: str, *, layers: int | None, seq: int, tokens: int, cache: str = "static"
) -> dict[str, Any]:
    """One model: the figures :func:`bench_serve` reports."""
    if cache not in CACHES:
        raise ValueError(f"bench serve: unknown cache {cache!r}; known: {', '.join(CACHES)}")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = SERVE_MODELS[name](layers).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    res: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "layers": model.config.num_hidden_layers,
        "prompt": seq,
        "new_tokens": tokens,
        "cache": cache,
    }
    with torch.no_grad():
        want, eager_s, want_logits = _generate(model, ids, tokens, cache)
        model = model.half()
        gc.collect()
        torch._dynamo.reset()
        tb.reset_fallback_stats()
        # the dynamic cache: Dynamo's default makes the KV length symbolic once it changes
        dynamic = False if cache == "static" else None
        model.forward = torch.compile(model.forward, backend="spyre", dynamic=dynamic)
        got, cold_s, got_logits = _generate(model, ids, tokens, cache)
        got2, warm_s, _ = _generate(model, ids, tokens, cache)
        kernels = list(tb.compiled_kernels())
        # a prompt of another length: the graphs it compiles (its prefill, and with the dynamic
        # cache the KV-length buckets the first prompt did not reach)
        before = tb.compile_stats()["graphs"]
        other = torch.randint(0, vocab, (1, seq + 5), generator=torch.Generator().manual_seed(1))
        _generate(model, other, tokens, cache)
        other_compiles = tb.compile_stats()["graphs"] - before
    errs = step_errors(got_logits, want_logits, _agreeing(got, want))
    prefill, decode = [], []
    for k in kernels:
        # the prompt's kernel takes the token ids of the whole prompt; a decode step's, one
        ids_in = [v for v in k.graph.inputs if v.dtype == "int32" and v.shape == (1, seq)]
        (prefill if ids_in and seq > 1 else decode).append(k.cost_analysis()["sim_time_us"])
    decode_us = max(decode, default=float("nan"))
    res.update(
        kernels=len(prefill) + len(decode),
        sim_prefill_us=max(prefill, default=float("nan")),
        sim_decode_us_per_token=decode_us,
        card_tokens_per_s=1e6 / decode_us if decode else float("nan"),
        cold_generate_s=cold_s,
        sim_wall_s_per_token=warm_s / tokens,
        eager_cpu_s_per_token=eager_s / tokens,
        compiles_other_prompt=other_compiles,
        fallbacks=sum(tb.fallback_stats().values()),
        tokens_equal=int((got == want[: len(got)]).sum()),
        runs_agree=bool(torch.equal(got, got2)),
        prefill_logits_err=errs[0],
        decode_logits_err=max(errs[1:], default=float("nan")),
    )
    res["decode_over_prefill_err"] = res["decode_logits_err"] / res["prefill_logits_err"]
    res["sim_over_eager"] = res["sim_wall_s_per_token"] / res["eager_cpu_s_per_token"]
    return res


def bench_serve(
    names: list[str] | None = None,
    *,
    layers: int | None = None,
    seq: int = 32,
    tokens: int = 16,
    cache: str = "static",
) -> dict[str, dict[str, Any]]:
    """Every model of :data:`SERVE_MODELS` (or ``names``), one after another."""
    out: dict[str, dict[str, Any]] = {}
    for name in names or list(SERVE_MODELS):
        if name not in SERVE_MODELS:
            raise ValueError(
                f"bench serve: unknown model {name!r}; known: {', '.join(SERVE_MODELS)}"
            )
        out[name] = run_serve(name, layers=layers, seq=seq, tokens=tokens, cache=cache)
        gc.collect()
    return out


def format_serve(res: dict[str, dict[str, Any]]) -> str:
    """A table of :func:`bench_serve`'s result."""
    cols = (
        ("params", "params", "{:,.0f}"),
        ("prefill us", "sim_prefill_us", "{:.0f}"),
        ("decode us/tok", "sim_decode_us_per_token", "{:.0f}"),
        ("card tok/s", "card_tokens_per_s", "{:.1f}"),
        ("sim s/tok", "sim_wall_s_per_token", "{:.3f}"),
        ("eager s/tok", "eager_cpu_s_per_token", "{:.4f}"),
        ("ratio", "sim_over_eager", "{:.1f}"),
        ("kernels", "kernels", "{}"),
        ("2nd prompt", "compiles_other_prompt", "{}"),
        ("fallbacks", "fallbacks", "{}"),
        ("tokens equal", "tokens_equal", "{}"),
        ("decode/prefill err", "decode_over_prefill_err", "{:.2f}"),
    )
    return format_table(res, cols, width=15)
