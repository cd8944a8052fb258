"""``spyre-jax estimate CONFIG.json``: how fast a language model runs on one or more cards, from
its shapes alone.

A Hugging Face ``config.json`` (Llama, Granite, Mistral, Qwen2 and GPT-2 families) is read into
a :class:`ModelShape`. Each kind of layer (the embedding, one decoder layer, the final norm and
the vocabulary projection) is written as a JAX function and compiled with
``spyre_jax.jit(f).lower(*jax.ShapeDtypeStruct(...)).compile()``: no weight is materialized and
nothing runs on the simulated card; the schedule's simulated time comes from the timing model
(``cost_analysis()``). The model's identical decoder layers are compiled once and counted
``num_hidden_layers`` times, so 40 layers cost about one.

Tensor parallelism (``tp`` cards, Megatron-style): the attention heads and KV heads, the MLP's
intermediate dim and the vocabulary are split over the cards (column-parallel q/k/v, gate and up
projections; row-parallel output and down projections), each card runs its share, and the cards
exchange partial sums: one all-reduce of the activations after the attention block and one after
the MLP block of every layer, one after the (vocabulary-parallel) embedding, and an all-gather of
the logits. Collectives run on the card-to-card link (:attr:`CardSpec.link_bw`,
:attr:`CardSpec.link_latency_s`) as ring algorithms and do not overlap compute.

Decode (one new token per sequence) is modelled with the KV cache already holding the context
(``decode_context`` positions, the new one included); the step's new keys and values are its
outputs (a store of one position). The cache keeps the keys sticked on positions
(``[.., head_dim, positions]``): the card's PE takes a product's second operand sticked on its
output columns, so q @ K^T reads such a cache as it is, where keys sticked on head_dim would be
restickified on every step (``MatmulStep.nt_form``). Prefill computes the logits of the last
position only (what greedy decoding needs).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp

import spyre_jax
from device_model.card import DEFAULT_CARD, CardSpec
from device_model.memory import DeviceOOMError
from spyre_jax.multicard import collective_seconds

from .plots import plot_estimate

__all__ = [
    "ConfigError",
    "DeviceOOMError",
    "ModelShape",
    "read_config",
    "estimate",
    "format_estimate",
    "plot_estimate",
    "FAMILIES",
]

#: the ``model_type`` values read, by family of layer
FAMILIES = {
    "llama": "llama",
    "granite": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "gpt2": "gpt2",
}

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}


class ConfigError(ValueError):
    """A ``config.json`` this estimator cannot read, or a tensor-parallel degree that does not
    split the model; the message names the field."""


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a decoder-only language model, as its ``config.json`` gives them."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    max_positions: int | None = None

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    def params(self) -> int:
        """Parameter count (norms and biases included)."""
        w, hd = self.hidden, self.head_dim
        attn = w * hd * (self.heads + 2 * self.kv_heads) + self.heads * hd * w
        if self.family == "gpt2":
            mlp = 2 * w * self.intermediate + self.intermediate + w
            attn += 3 * w + w  # qkv and output biases
            norms = 4 * w
        else:
            mlp = 3 * w * self.intermediate
            norms = 2 * w
            if self.qkv_bias:
                attn += hd * (self.heads + 2 * self.kv_heads)
        embed = self.vocab * w * (1 if self.tied else 2)
        pos = (self.max_positions or 0) * w if self.family == "gpt2" else 0
        return (
            self.layers * (attn + mlp + norms)
            + embed
            + pos
            + (2 if self.family == "gpt2" else 1) * w
        )


def _field(cfg: dict[str, Any], *names: str, default: Any = None, required: bool = True) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            v = cfg[n]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"config.json: field {n!r} must be a positive integer, got {v!r}")
            return v
    if required and default is None:
        raise ConfigError(
            f"config.json ({cfg.get('model_type')}): no field {names[0]!r}"
            + (f" (nor {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else "")
        )
    return default


def read_config(cfg: dict[str, Any] | str | os.PathLike[str]) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` (a path or its parsed dict).

    Raises :class:`ConfigError` naming the field it could not read: ``model_type`` for an
    architecture outside :data:`FAMILIES`, or the missing size."""
    if not isinstance(cfg, dict):
        with open(cfg) as fh:
            cfg = json.load(fh)
        if not isinstance(cfg, dict):
            raise ConfigError("config.json: not a JSON object")
    mt = cfg.get("model_type")
    if mt is None:
        raise ConfigError("config.json: no field 'model_type' (the architecture)")
    if mt not in FAMILIES:
        raise ConfigError(
            f"config.json: field 'model_type' is {mt!r}, an architecture this estimator does "
            f"not read; it reads {', '.join(sorted(FAMILIES))}"
        )
    if FAMILIES[mt] == "gpt2":
        hidden = _field(cfg, "n_embd", "hidden_size")
        heads = _field(cfg, "n_head", "num_attention_heads")
        return ModelShape(
            model_type=mt,
            layers=_field(cfg, "n_layer", "num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=heads,
            head_dim=hidden // heads,
            intermediate=_field(cfg, "n_inner", default=4 * hidden),
            vocab=_field(cfg, "vocab_size"),
            tied=True,
            qkv_bias=True,
            max_positions=_field(cfg, "n_positions", default=1024),
        )
    hidden = _field(cfg, "hidden_size")
    heads = _field(cfg, "num_attention_heads")
    return ModelShape(
        model_type=mt,
        layers=_field(cfg, "num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=_field(cfg, "num_key_value_heads", default=heads),
        head_dim=_field(cfg, "head_dim", default=hidden // heads),
        intermediate=_field(cfg, "intermediate_size"),
        vocab=_field(cfg, "vocab_size"),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2",
    )


def check_tp(m: ModelShape, tp: int) -> None:
    """Refuse a tensor-parallel degree that does not split the model evenly (naming which)."""
    if tp < 1:
        raise ConfigError(f"--tp must be at least 1, got {tp}")
    for name, v in (
        ("num_attention_heads", m.heads),
        ("num_key_value_heads", m.kv_heads),
        ("intermediate_size", m.intermediate),
        ("hidden_size", m.hidden),
    ):
        if v % tp:
            raise ConfigError(
                f"--tp {tp} does not divide {name} ({v}): each card needs an equal share"
            )


# ---------------------------------------------------------------------------------------------
# the layers, as JAX functions of one card's share


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` as the card computes it: fp32 products, stored in ``a``'s dtype."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def _norm(m: ModelShape, x: jax.Array, p: dict[str, jax.Array], name: str) -> jax.Array:
    x32 = x.astype(jnp.float32)
    if m.family == "gpt2":
        mu = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean((x32 - mu) ** 2, axis=-1, keepdims=True)
        y = (x32 - mu) * jax.lax.rsqrt(var + 1e-5)
        return y.astype(x.dtype) * p[name] + p[name + "_b"]
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (x32 * r).astype(x.dtype) * p[name]


def _rope(t: jax.Array, start: int) -> jax.Array:
    """Rotary embedding of ``t`` ([..., seq, hd]) at positions ``start, start + 1, ...``."""
    seq, hd = t.shape[-2], t.shape[-1]
    pos = jnp.arange(start, start + seq, dtype=jnp.float32)[:, None]
    inv = 1.0 / (10000.0 ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = pos * inv[None, :]
    cos, sin = jnp.cos(ang).astype(t.dtype), jnp.sin(ang).astype(t.dtype)
    t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
    return jnp.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1)


def _attention(
    q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, kt: bool = False
) -> jax.Array:
    """Grouped-query attention without copying the keys per head: ``q`` [B, kv, rep, S, hd],
    ``k``/``v`` [B, kv, T, hd] -> [B, kv, rep, S, hd]. ``kt``: ``k`` is [B, kv, hd, T] (a
    cache that keeps the keys sticked on positions: the scores are then an NN product, which
    the card's PE takes as is; keys sticked on hd need a restickify on every step)."""
    b, kv, rep, s, hd = q.shape
    t = k.shape[3] if kt else k.shape[2]
    qg = q.reshape(b * kv, rep * s, hd)
    vg = v.reshape(b * kv, t, hd)
    if kt:
        kg = k.reshape(b * kv, hd, t)
        sc = jnp.einsum("gqd,gdk->gqk", qg, kg, preferred_element_type=jnp.float32)
    else:
        kg = k.reshape(b * kv, t, hd)
        sc = jnp.einsum("gqd,gkd->gqk", qg, kg, preferred_element_type=jnp.float32)
    sc = sc * (hd**-0.5)
    if causal:
        mask = jnp.tile(jnp.tril(jnp.ones((s, t), bool), k=t - s), (rep, 1))
        sc = jnp.where(mask[None], sc, -jnp.inf)
    pr = jax.nn.softmax(sc, axis=-1).astype(q.dtype)
    o = jnp.einsum("gqk,gkd->gqd", pr, vg, preferred_element_type=jnp.float32).astype(q.dtype)
    return o.reshape(b, kv, rep, s, hd)


def _layer(m: ModelShape, tp: int, cache_len: int) -> Callable[..., Any]:
    """One decoder layer on one card: ``f(p, x[, k_cache, v_cache]) -> (x, k_new, v_new)``.

    ``cache_len == 0``: prefill (causal attention over ``x``'s own positions); otherwise a
    decode step whose keys and values come from a cache of ``cache_len`` positions."""
    heads, kvh, hd = m.heads // tp, m.kv_heads // tp, m.head_dim
    rep = heads // kvh

    def f(p: dict[str, jax.Array], x: jax.Array, *cache: jax.Array) -> tuple[jax.Array, ...]:
        b, s, w = x.shape
        h = _norm(m, x, p, "ln1").reshape(b * s, w)
        if m.family == "gpt2":
            qkv = _mm(h, p["wqkv"]) + p["bqkv"]
            q, k, v = jnp.split(qkv, 3, axis=-1)
        else:
            q, k, v = _mm(h, p["wq"]), _mm(h, p["wk"]), _mm(h, p["wv"])
            if m.qkv_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q = q.reshape(b, s, kvh, rep, hd).transpose(0, 2, 3, 1, 4)  # [B, kv, rep, S, hd]
        k = k.reshape(b, s, kvh, hd).transpose(0, 2, 1, 3)  # [B, kv, S, hd]
        v = v.reshape(b, s, kvh, hd).transpose(0, 2, 1, 3)
        if m.family != "gpt2":
            start = cache_len - 1 if cache_len else 0
            q, k = _rope(q, start), _rope(k, start)
        if cache_len:
            a = _attention(q, cache[0], cache[1], causal=False, kt=True)
        else:
            a = _attention(q, k, v, causal=True)
        a = a.transpose(0, 3, 1, 2, 4).reshape(b * s, heads * hd)
        o = _mm(a, p["wo"])
        if m.family == "gpt2":
            o = o + p["bo"]
        x = x + o.reshape(b, s, w)  # after the all-reduce of the cards' partial sums
        h = _norm(m, x, p, "ln2").reshape(b * s, w)
        if m.family == "gpt2":
            u = jax.nn.gelu(_mm(h, p["wfc"]) + p["bfc"], approximate=True)
            d = _mm(u, p["wproj"]) + p["bproj"]
        else:
            d = _mm(jax.nn.silu(_mm(h, p["wg"])) * _mm(h, p["wu"]), p["wd"])
        return x + d.reshape(b, s, w), k, v

    return f


def _layer_params(m: ModelShape, tp: int, dt: Any) -> dict[str, jax.ShapeDtypeStruct]:
    w, hd = m.hidden, m.head_dim
    q, kv, inter = m.heads // tp * hd, m.kv_heads // tp * hd, m.intermediate // tp
    if m.family == "gpt2":
        shapes = {
            "ln1": (w,), "ln1_b": (w,), "ln2": (w,), "ln2_b": (w,),
            "wqkv": (w, 3 * q), "bqkv": (3 * q,), "wo": (q, w), "bo": (w,),
            "wfc": (w, inter), "bfc": (inter,), "wproj": (inter, w), "bproj": (w,),
        }  # fmt: skip
    else:
        shapes = {
            "ln1": (w,), "ln2": (w,), "wq": (w, q), "wk": (w, kv), "wv": (w, kv), "wo": (q, w),
            "wg": (w, inter), "wu": (w, inter), "wd": (inter, w),
        }  # fmt: skip
        if m.qkv_bias:
            shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    return {k: jax.ShapeDtypeStruct(s, dt) for k, s in shapes.items()}


def _vocab_shard(m: ModelShape, tp: int) -> int:
    """Each card's rows of the vocabulary: the vocabulary padded to a multiple of ``tp`` sticks
    of 64 (as Megatron pads it), split evenly."""
    unit = 64 * tp
    return -(-m.vocab // unit) * unit // tp


def _embed(m: ModelShape) -> Callable[..., Any]:
    def f(table: jax.Array, ids: jax.Array, *pos: jax.Array) -> jax.Array:
        # a vocabulary-parallel embedding: rows outside this card's share read as zeros
        # (masked), the cards' results summed by an all-reduce
        n = table.shape[0]
        x = jnp.take(table, jnp.clip(ids, 0, n - 1), axis=0)
        x = jnp.where((ids < n)[..., None], x, jnp.zeros((), table.dtype))
        if pos:
            x = x + pos[0][None, : ids.shape[1]]
        return x

    return f


def _head(m: ModelShape) -> Callable[..., Any]:
    def f(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        b, s, w = x.shape
        h = _norm(m, x[:, -1:], p, "lnf").reshape(b, w)
        return jnp.einsum("bw,vw->bv", h, p["lm"], preferred_element_type=jnp.float32).astype(
            x.dtype
        )

    return f


# ---------------------------------------------------------------------------------------------
# the estimate


def _cost(f: Callable[..., Any], args: tuple[Any, ...]) -> dict[str, Any]:
    c = spyre_jax.jit(f).lower(*args).compile().cost_analysis()
    return {
        "us": float(c["sim_time_us"]),
        "unit": c.get("bound", "-"),
        "stages": len(c["stages"]),
        # per stage: its flops, device bytes and time (the points of a roofline: --plot)
        "roofline": [
            [float(st["flops"]), float(st["load_bytes"] + st["store_bytes"]), st["time_s"] * 1e6]
            for st in c["stages"]
        ],
    }


def estimate(
    config: dict[str, Any] | str | os.PathLike[str],
    *,
    tp: int = 1,
    prefill: int = 128,
    decode_context: int = 128,
    batch: int = 1,
    dtype: str = "float16",
    card: CardSpec = DEFAULT_CARD,
) -> dict[str, Any]:
    """Simulated prefill time, time per decoded token and the memory a model needs, per card of
    ``tp``, from its ``config.json`` alone (see the module docstring). Keys include
    ``prefill_ms``, ``decode_ms_per_token``, ``tokens_per_s``, ``weights_bytes_per_card`` and
    ``device_bytes_per_card``; ``layers`` breaks the times down per layer kind.

    Raises :class:`ConfigError` for a config it cannot read or a ``tp`` that does not split the
    model, and :class:`~device_model.memory.DeviceOOMError` (saying by how much) when the
    weights and the KV cache do not fit one card's device memory."""
    t0 = time.perf_counter()
    m = read_config(config)
    check_tp(m, tp)
    for name, v in (
        ("--prefill", prefill),
        ("--decode-context", decode_context),
        ("--batch", batch),
    ):
        if v < 1:
            raise ConfigError(f"{name} must be at least 1, got {v}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    dt = DTYPES[dtype]
    isz = jnp.dtype(dt).itemsize
    w, hd = m.hidden, m.head_dim
    vshard = _vocab_shard(m, tp)
    kvh = m.kv_heads // tp

    # memory per card, before compiling anything: weights and the KV cache
    layer_p = _layer_params(m, tp, dt)
    layer_bytes = sum(math.prod(s.shape) for s in layer_p.values()) * isz
    embed_bytes = vshard * w * isz
    head_bytes = (0 if m.tied else vshard * w * isz) + w * isz * (2 if m.family == "gpt2" else 1)
    pos_bytes = (m.max_positions or 0) * w * isz if m.family == "gpt2" else 0
    weights = m.layers * layer_bytes + embed_bytes + head_bytes + pos_bytes
    ctx = max(prefill, decode_context)
    kv_bytes = 2 * m.layers * batch * kvh * ctx * hd * isz
    # the activations live at once in a layer, roughly: the residual stream, a normed copy and
    # the MLP's two intermediate tensors, over the whole prompt (an allowance, not a plan)
    act_bytes = 4 * batch * prefill * max(w, m.intermediate // tp) * isz
    need = weights + kv_bytes + act_bytes
    limit = card.device_memory_usable_bytes
    if need > limit:
        raise DeviceOOMError(
            need,
            0,
            limit,
            limit,
            f"{m.model_type} at tp {tp} (weights {weights / 1e9:.1f} GB, KV cache "
            f"{kv_bytes / 1e9:.1f} GB, activations {act_bytes / 1e9:.1f} GB per card): "
            f"{(need - limit) / 1e9:.1f} GB more than a card holds",
        )

    sds = jax.ShapeDtypeStruct
    ids = {s: sds((batch, s), jnp.int32) for s in (prefill, 1)}
    table = sds((vshard, w), dt)
    pos = (sds((m.max_positions or 1024, w), dt),) if m.family == "gpt2" else ()
    head_p = {"lnf": sds((w,), dt), "lm": sds((vshard, w), dt)}
    if m.family == "gpt2":
        head_p["lnf_b"] = sds((w,), dt)
    # the key cache sticked on positions ([.., hd, T]), the values as they come ([.., T, hd])
    cache = (sds((batch, kvh, hd, decode_context), dt), sds((batch, kvh, decode_context, hd), dt))
    parts: dict[str, dict[str, Any]] = {}
    for phase, s, extra in (("prefill", prefill, ()), ("decode", 1, cache)):
        x = sds((batch, s, w), dt)
        layer = _cost(_layer(m, tp, decode_context if extra else 0), (layer_p, x, *extra))
        embed = _cost(_embed(m), (table, ids[s], *pos))
        head = _cost(_head(m), (head_p, x))
        act = batch * s * w * isz
        layer_coll = 1e6 * 2 * collective_seconds("all_reduce", act, tp, card)
        embed_coll = 1e6 * collective_seconds("all_reduce", act, tp, card)
        gather = 1e6 * collective_seconds("all_gather", batch * vshard * tp * isz, tp, card)
        coll_us = m.layers * layer_coll + embed_coll + gather
        parts[phase] = {
            "embed": embed,
            "layer": layer,
            "head": head,
            "collectives_us": coll_us,
            "layer_all_reduce_us": layer_coll,
            "embed_all_reduce_us": embed_coll,
            "logits_all_gather_us": gather,
            "total_us": embed["us"] + m.layers * layer["us"] + head["us"] + coll_us,
        }
    pre, dec = parts["prefill"], parts["decode"]
    return {
        "model_type": m.model_type,
        "shape": asdict(m),
        "params": m.params(),
        "tp": tp,
        "batch": batch,
        "prefill": prefill,
        "decode_context": decode_context,
        "dtype": dtype,
        "prefill_ms": pre["total_us"] / 1e3,
        "decode_ms_per_token": dec["total_us"] / 1e3,
        "tokens_per_s": batch / (dec["total_us"] / 1e6),
        "weights_bytes_per_card": weights,
        "kv_cache_bytes_per_card": kv_bytes,
        "device_bytes_per_card": need,
        "device_bytes_limit": limit,
        "decode_floor_ms": 1e3
        * (weights + kv_bytes * decode_context / ctx)
        / card.memory_bw_one_way,
        "link": {"bw": card.link_bw, "latency_s": card.link_latency_s},
        "phases": parts,
        "wall_s": time.perf_counter() - t0,
    }


def format_estimate(r: dict[str, Any]) -> str:
    """The estimate as a table: per layer kind and for the whole model."""
    s = r["shape"]
    lines = [
        f"{r['model_type']}: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads "
        f"({s['kv_heads']} KV), intermediate {s['intermediate']}, vocab {s['vocab']}; "
        f"{r['params'] / 1e9:.2f} B parameters, {r['dtype']}",
        f"tp {r['tp']}, batch {r['batch']}, prefill {r['prefill']} tokens, decode with "
        f"{r['decode_context']} positions of context",
        "",
        f"{'layer kind':<22}{'count':>6}{'prefill us':>14}{'decode us':>12}"
        "  bound (prefill/decode)",
    ]
    pre, dec = r["phases"]["prefill"], r["phases"]["decode"]
    for kind, n in (("embedding", 1), ("decoder layer", s["layers"]), ("norm + lm_head", 1)):
        key = {"embedding": "embed", "decoder layer": "layer", "norm + lm_head": "head"}[kind]
        a, b = pre[key], dec[key]
        lines.append(f"{kind:<22}{n:>6}{a['us']:>14.1f}{b['us']:>12.1f}  {a['unit']} / {b['unit']}")
    lines.append(
        f"{'collectives (link)':<22}{'':>6}{pre['collectives_us']:>14.1f}"
        f"{dec['collectives_us']:>12.1f}  link"
    )
    lines += [
        "",
        f"prefill: {r['prefill_ms']:.2f} ms   decode: {r['decode_ms_per_token']:.2f} ms per token"
        f"   {r['tokens_per_s']:.1f} tokens/s",
        f"per card: weights {r['weights_bytes_per_card'] / 1e9:.2f} GB, KV cache "
        f"{r['kv_cache_bytes_per_card'] / 1e9:.2f} GB, device memory needed "
        f"{r['device_bytes_per_card'] / 1e9:.2f} GB of {r['device_bytes_limit'] / 1e9:.0f} GB",
        f"decode floor (weights and cache read once at {DEFAULT_CARD.memory_bw_one_way / 1e9:.0f}"
        f" GB/s): {r['decode_floor_ms']:.2f} ms per token; estimated in {r['wall_s']:.1f} s",
    ]
    return "\n".join(lines)


def trace_events(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Chrome trace events of one prefill and one decode step: the card's kernels on one row,
    the link's collectives on another (times in microseconds)."""
    ev: list[dict[str, Any]] = []
    t = 0.0
    layers = r["shape"]["layers"]
    for phase in ("prefill", "decode"):
        p = r["phases"][phase]

        def add(name: str, dur: float, tid: int, cat: str, _phase: str = phase) -> None:
            nonlocal t
            if dur > 0:
                ev.append(
                    {"name": name, "cat": cat, "ph": "X", "ts": t, "dur": dur, "pid": 0,
                     "tid": tid, "args": {"phase": _phase}}
                )  # fmt: skip
                t += dur

        add(f"{phase} embedding", p["embed"]["us"], 0, "kernel")
        add("all_reduce (embedding)", p["embed_all_reduce_us"], 1, "collective")
        for i in range(layers):
            add(f"{phase} layer {i}", p["layer"]["us"], 0, "kernel")
            add(f"layer {i}: all_reduce x2", p["layer_all_reduce_us"], 1, "collective")
        add(f"{phase} norm + lm_head", p["head"]["us"], 0, "kernel")
        add("all_gather (logits)", p["logits_all_gather_us"], 1, "collective")
    return ev


def write_trace(r: dict[str, Any], path: str) -> None:
    with open(path, "w") as fh:
        json.dump({"traceEvents": trace_events(r), "displayTimeUnit": "ms"}, fh)
