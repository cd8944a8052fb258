"""``spyre-jax bench jax-decode``: a Llama-style model written in plain JAX, generating greedily
and by sampling in one ``spyre_jax.jit`` call each.

The model is ``bench serve``'s 2-layer Llama of width 128 (``transformers``' ``LlamaForCausalLM``,
seeded random weights) with its weights taken into JAX: layers stacked and scanned over
(``lax.scan``), new tokens a ``lax.fori_loop`` whose carry holds the KV cache (each step writes
its position with ``lax.dynamic_update_slice``), RoPE tables indexed by the traced position,
attention over the cache masked past the position. One call runs the prompt and every new token.

Reported, measured side by side in one run: the new tokens of the card (fp32) against
``jax.jit`` on the CPU (fp32) and torch eager (fp32); in fp16, how many steps agree, and whether
the first that does not had a top-2 logit gap (in the fp32 reference) within fp16's tolerance;
the simulated time per new token (the decode loop's iteration in ``cost_analysis()``, with the
host's waits between launches, and its kernels' time alone) beside the torch path's kernel time
for the same model (``bench serve``, static cache: its figure has no host time); the
simulation's wall time per token (a warm call) beside ``jax.jit`` on the CPU. The sampled
variant (top-k 20, temperature 0.8, ``jax.random`` on the card, its key carried by the loop):
its tokens against ``jax.jit`` on the CPU from the same key, and its simulated and wall time
per token over greedy decoding's.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

import spyre_jax

from .bench_serve import llama_tiny, run_serve

__all__ = ["bench_jax_decode", "format_jax_decode", "llama_params", "generate"]


def llama_params(model: Any, dtype: Any = np.float32) -> dict[str, Any]:
    """A ``transformers`` Llama's weights as arrays: per-layer weights stacked on a first axis,
    matrices as ``x @ w`` takes them."""

    def a(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().numpy().astype(dtype)

    layers = model.model.layers
    stack = lambda f: np.stack([f(layer) for layer in layers])  # noqa: E731
    cfg = model.config
    return {
        "embed": a(model.model.embed_tokens.weight),
        "lm_head": a(model.lm_head.weight).T.copy(),
        "norm": a(model.model.norm.weight),
        "attn_norm": stack(lambda m: a(m.input_layernorm.weight)),
        "mlp_norm": stack(lambda m: a(m.post_attention_layernorm.weight)),
        "wq": stack(lambda m: a(m.self_attn.q_proj.weight).T),
        "wk": stack(lambda m: a(m.self_attn.k_proj.weight).T),
        "wv": stack(lambda m: a(m.self_attn.v_proj.weight).T),
        "wo": stack(lambda m: a(m.self_attn.o_proj.weight).T),
        "w_gate": stack(lambda m: a(m.mlp.gate_proj.weight).T),
        "w_up": stack(lambda m: a(m.mlp.up_proj.weight).T),
        "w_down": stack(lambda m: a(m.mlp.down_proj.weight).T),
        "rope": _rope_tables(cfg, dtype),
    }


def _rope_tables(cfg: Any, dtype: Any) -> np.ndarray:
    hd = cfg.hidden_size // cfg.num_attention_heads
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters.get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    ang = np.arange(cfg.max_position_embeddings)[:, None] * inv[None, :]
    emb = np.concatenate([ang, ang], -1)
    return np.stack([np.cos(emb), np.sin(emb)]).astype(dtype)  # [2, positions, head_dim]


def _rms(x: Any, w: Any, eps: float) -> Any:
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    h = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


def generate(
    params: dict[str, Any],
    prompt: Any,
    *,
    new: int,
    cfg: Any,
    key: Any = None,
    top_k: int = 0,
    temperature: float = 1.0,
) -> tuple[Any, Any]:
    """Greedy decoding (``key`` None): the ``new`` token ids after ``prompt`` (``[P]`` int32),
    and each step's gap between its two largest logits. With a ``key``: sampled decoding, each
    step drawing from the softmax of the logits over ``temperature`` (among the ``top_k``
    largest when ``top_k`` > 0) with a key split off the carried one."""
    H, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size
    hd, eps = D // H, cfg.rms_norm_eps
    P = prompt.shape[0]
    S = P + new
    dt = params["embed"].dtype
    rope = params["rope"]

    def layer(h: Any, lw: Any, pos: Any, n: int, kc: Any, vc: Any) -> tuple[Any, Any, Any]:
        """One layer over ``n`` positions from ``pos``; the layer's caches ``[S, Hk, hd]``."""
        x = _rms(h, lw["attn_norm"], eps)
        q = (x @ lw["wq"]).reshape(n, H, hd)
        k = (x @ lw["wk"]).reshape(n, Hk, hd)
        v = (x @ lw["wv"]).reshape(n, Hk, hd)
        cos = lax.dynamic_slice(rope[0], (pos, 0), (n, hd))[:, None, :]
        sin = lax.dynamic_slice(rope[1], (pos, 0), (n, hd))[:, None, :]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        kc = lax.dynamic_update_slice(kc, k.astype(kc.dtype), (pos, 0, 0))
        vc = lax.dynamic_update_slice(vc, v.astype(vc.dtype), (pos, 0, 0))
        kk = jnp.repeat(kc, H // Hk, axis=1)  # [S, H, hd]
        vv = jnp.repeat(vc, H // Hk, axis=1)
        s = jnp.einsum("nhd,shd->hns", q, kk) / np.sqrt(hd)
        qpos = pos + jnp.arange(n)[:, None]
        s = jnp.where(jnp.arange(S)[None, :] <= qpos, s, -jnp.inf)
        o = jnp.einsum("hns,shd->nhd", jax.nn.softmax(s.astype(jnp.float32), -1).astype(dt), vv)
        h = h + o.reshape(n, D) @ lw["wo"]
        x = _rms(h, lw["mlp_norm"], eps)
        h = h + (jax.nn.silu(x @ lw["w_gate"]) * (x @ lw["w_up"])) @ lw["w_down"]
        return h, kc, vc

    names = ("attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    stacked = {k: params[k] for k in names}

    def forward(h: Any, pos: Any, n: int, caches: tuple[Any, Any]) -> tuple[Any, Any]:
        def body(h: Any, xs: Any) -> tuple[Any, Any]:
            lw, kc, vc = xs
            h, kc, vc = layer(h, lw, pos, n, kc, vc)
            return h, (kc, vc)

        h, caches = lax.scan(body, h, (stacked, *caches))
        logits = _rms(h[-1:], params["norm"], eps) @ params["lm_head"]
        return logits[0].astype(jnp.float32), caches

    L = params["wq"].shape[0]
    caches = (jnp.zeros((L, S, Hk, hd), dt), jnp.zeros((L, S, Hk, hd), dt))
    logits, caches = forward(params["embed"][prompt], 0, P, caches)

    def pick(logits: Any, k: Any) -> tuple[Any, Any, Any]:
        best = jnp.argmax(logits).astype(jnp.int32)
        second = jnp.max(jnp.where(jnp.arange(logits.shape[0]) == best, -jnp.inf, logits))
        if k is None:
            return best, logits[best] - second, k
        k, sub = jax.random.split(k)
        if top_k:
            vals, idx = lax.top_k(logits, top_k)
            tok = idx[jax.random.categorical(sub, vals / temperature)]
        else:
            tok = jax.random.categorical(sub, logits / temperature)
        return tok.astype(jnp.int32), logits[best] - second, k

    def step(i: Any, c: Any) -> Any:
        logits, caches, toks, gaps, k = c
        tok, gap, k = pick(logits, k)
        toks = lax.dynamic_update_slice(toks, tok[None], (i,))
        gaps = lax.dynamic_update_slice(gaps, gap[None], (i,))
        h = lax.dynamic_slice(params["embed"], (tok, 0), (1, D))
        logits, caches = forward(h, P + i, 1, caches)
        return logits, caches, toks, gaps, k

    init = (logits, caches, jnp.zeros(new, jnp.int32), jnp.zeros(new, jnp.float32), key)
    _, _, toks, gaps, _ = lax.fori_loop(0, new, step, init)
    return toks, gaps


def _timed(f: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = f(*args)
    toks = np.asarray(out[0])
    return (toks, np.asarray(out[1])), time.perf_counter() - t0


def _sampled(p32: Any, ids: Any, cfg: Any, tokens: int, greedy: dict[str, Any]) -> dict:
    """The sampled variant (top-k 20 at temperature 0.8, a key carried through the loop): its
    tokens against ``jax.jit`` on the CPU from the same key, and its simulated and wall time
    per token beside greedy decoding's (``greedy``: the greedy run's figures)."""

    def fn(p: Any, ids: Any, key: Any) -> Any:
        return generate(p, ids, new=tokens, cfg=cfg, key=key, top_k=20, temperature=0.8)

    key = jax.random.key(0)
    (want, _), _ = _timed(jax.jit(fn), p32, ids, key)
    card = spyre_jax.jit(fn)
    (got, _), _ = _timed(card, p32, ids, key)
    _, warm_s = _timed(card, p32, ids, key)
    compiled = next(iter(card._cache.values()))
    decode = [r for r in compiled.cost_analysis().get("control", []) if r["iterations"] == tokens]
    us = decode[0]["iteration_us"] if decode else float("nan")
    kus = decode[0]["kernel_us"] if decode else float("nan")
    wall = warm_s / tokens
    return {
        "sampled_tokens_equal_cpu": int((got == want).sum()),
        "sampled_sim_us_per_token": us,
        "sampled_sim_kernel_us_per_token": kus,
        "sampled_over_greedy_sim": us / greedy["sim_us_per_token"],
        "sampled_wall_s_per_token": wall,
        "sampled_over_greedy_wall": wall / greedy["sim_wall_s_per_token"],
    }


def bench_jax_decode(
    *, layers: int | None = None, seq: int = 16, tokens: int = 8, torch_path: bool = True
) -> dict[str, Any]:
    """The figures of the module's docstring (``torch_path``: also ``bench serve``'s run of the
    same model for its simulated time per token)."""
    torch.manual_seed(0)
    model = llama_tiny(layers).eval()
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    torch_toks = ref[0, seq:].numpy().astype(np.int32)
    ids = prompt[0].numpy().astype(np.int32)
    fn = lambda p, ids: generate(p, ids, new=tokens, cfg=cfg)  # noqa: E731
    res: dict[str, Any] = {"layers": cfg.num_hidden_layers, "prompt": seq, "new_tokens": tokens}
    p32 = llama_params(model)
    cpu = jax.jit(fn)
    (want, gaps), _ = _timed(cpu, p32, ids)
    _, cpu_s = _timed(cpu, p32, ids)
    card = spyre_jax.jit(fn)
    (got, _), cold_s = _timed(card, p32, ids)
    (got2, _), warm_s = _timed(card, p32, ids)
    compiled = next(iter(card._cache.values()))
    cost = compiled.cost_analysis()
    decode = [r for r in cost.get("control", []) if r["iterations"] == tokens]
    p16 = llama_params(model, np.float16)
    (got16, _), _ = _timed(spyre_jax.jit(fn), p16, ids)
    agree16 = int(np.argmin(np.append(got16 == want, False)))
    tol16 = 2e-2 * float(np.max(np.abs(gaps))) if len(gaps) else 0.0
    res.update(
        tokens_equal_cpu=int((got == want).sum()),
        tokens_equal_torch=int((want == torch_toks).sum()),
        runs_agree=bool(np.array_equal(got, got2)),
        fp16_steps_agree=agree16,
        fp16_first_mismatch_gap=float(gaps[agree16]) if agree16 < tokens else None,
        fp16_mismatch_within_tolerance=bool(agree16 == tokens or gaps[agree16] <= tol16),
        sim_us_per_token=decode[0]["iteration_us"] if decode else float("nan"),
        sim_kernel_us_per_token=decode[0]["kernel_us"] if decode else float("nan"),
        sim_total_us=cost["sim_time_us"],
        kernels=len(compiled.program.kernels()) if compiled.program else 1,
        cold_s=cold_s,
        sim_wall_s_per_token=warm_s / tokens,
        cpu_wall_s_per_token=cpu_s / tokens,
    )
    res["sim_over_cpu"] = res["sim_wall_s_per_token"] / res["cpu_wall_s_per_token"]
    res.update(_sampled(p32, ids, cfg, tokens, res))
    if torch_path:
        serve = run_serve("llama-tiny", layers=layers, seq=seq, tokens=tokens)
        res["torch_sim_us_per_token"] = serve["sim_decode_us_per_token"]
        res["jax_over_torch_kernel"] = (
            res["sim_kernel_us_per_token"] / serve["sim_decode_us_per_token"]
        )
    return res


def format_jax_decode(r: dict[str, Any]) -> str:
    lines = [
        f"Llama {r['layers']} layers, prompt {r['prompt']}, {r['new_tokens']} new tokens, one "
        "spyre_jax.jit call",
        f"tokens equal to jax.jit (CPU, fp32): {r['tokens_equal_cpu']}/{r['new_tokens']}; "
        f"jax.jit equal to torch eager: {r['tokens_equal_torch']}/{r['new_tokens']}",
        f"fp16: {r['fp16_steps_agree']} steps agree (a mismatch within tolerance: "
        f"{r['fp16_mismatch_within_tolerance']})",
        f"simulated {r['sim_us_per_token']:.1f} us per token with the host's waits, "
        f"{r['sim_kernel_us_per_token']:.1f} us of kernels ({r['kernels']} kernels)",
        f"wall per token {r['sim_wall_s_per_token'] * 1e3:.1f} ms vs jax.jit CPU "
        f"{r['cpu_wall_s_per_token'] * 1e3:.2f} ms ({r['sim_over_cpu']:.0f}x); "
        f"cold {r['cold_s']:.1f} s",
    ]
    lines.append(
        f"sampled (top-k 20, temperature 0.8): tokens equal to jax.jit "
        f"{r['sampled_tokens_equal_cpu']}/{r['new_tokens']}; simulated "
        f"{r['sampled_sim_us_per_token']:.1f} us per token "
        f"({r['sampled_over_greedy_sim']:.2f}x greedy; kernels "
        f"{r['sampled_sim_kernel_us_per_token']:.1f} us); wall "
        f"{r['sampled_wall_s_per_token'] * 1e3:.1f} ms "
        f"({r['sampled_over_greedy_wall']:.2f}x greedy)"
    )
    if "torch_sim_us_per_token" in r:
        lines.append(
            f"torch path (bench serve, static cache): {r['torch_sim_us_per_token']:.1f} us of "
            f"kernels per token; JAX/torch {r['jax_over_torch_kernel']:.2f}"
        )
    return "\n".join(lines)
