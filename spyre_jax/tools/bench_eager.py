"""``spyre-jax bench eager``: the ``spyre`` device at serving speed.

Two figures, each measured side by side with eager CPU in the same run:

* the host cost of one small eager op (``a + b`` of two 64x64 fp32 spyre tensors, warm): what the
  Python thread spends per op, the card model's program included (it runs where it is called,
  :mod:`device_model.xla_host`; the result stays a card array, never brought to the host),
  and per op when a run of them is also waited for (``torch.spyre.synchronize()``);
* ``model.generate()`` on the device (``model.to("spyre")``, the default dynamic KV cache, greedy)
  for the 2-layer Llama of ``bench serve``: wall time cold (the first call: kernels compile) and
  warm (the second call) and steady (the median of the next three), beside eager CPU's (fp32,
  warm, the median of three), the kernels compiled by each call and the simulated card's XLA
  programs (a kernel's, or its operands' gathers fused into it), a second prompt whose whole
  generation stays inside the size buckets the first saw (``prompt - 2``) and one that grows
  past them (``prompt + 5``: 37 positions, past one int32 stick of 32), CPU fallbacks, and
  whether the tokens equal the CPU's;
* the decoding strategies on the device for the same model: greedy, sampling (``top_k`` 50,
  ``top_p`` 0.9, temperature 0.8: ``torch.sort``, ``topk``, ``scatter``, ``multinomial`` and the
  card's random numbers) and beam search (3 beams: ``topk``, ``floor_divide``): the steady wall
  per token (the median of the warm calls) beside greedy's and eager CPU's, the CPU fallbacks,
  and whether beam search's tokens equal the CPU's. The strategies run in turn, round after
  round (``reps`` rounds), so that the ratios to greedy are measured side by side.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from torch_bridge import device as dev

from .bench_models import format_table
from .bench_serve import llama_tiny

__all__ = ["bench_eager", "format_eager", "bench_against", "format_against"]


def _per_call(fn: Any, calls: int, reps: int) -> float:
    """The median over ``reps`` runs of the mean time of one of ``calls`` calls, in us."""
    for _ in range(100):
        fn()
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls)
    return statistics.median(runs) * 1e6


def _op_costs(reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    sa, sb = a.to("spyre"), b.to("spyre")
    host = _per_call(lambda: sa + sb, 1000, reps)

    def waited() -> None:
        for _ in range(100):
            sa + sb
        torch.spyre.synchronize()

    synced = _per_call(waited, 10, reps) / 100
    cpu = _per_call(lambda: a + b, 1000, reps)
    return {
        "add_host_us": host,
        "add_waited_us": synced,
        "add_cpu_us": cpu,
        "add_host_over_cpu": host / cpu,
    }


class _HostPrograms:
    """Counts the XLA programs compiled while it is active (the simulated card's programs: a
    kernel's, or a gather fused into one; ``jax.monitoring``'s backend-compile events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: str, duration: float, **_: Any) -> None:
        if event == self.EVENT:
            self.count += 1

    def __enter__(self) -> _HostPrograms:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self)

    def since(self, mark: int) -> int:
        return self.count - mark


def _generate(model: Any, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    if out.device.type == "spyre":
        out = out.cpu()
    return out[0, ids.shape[1] :], time.perf_counter() - t


def _generate_costs(prompt: int, tokens: int) -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = llama_tiny(2).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, prompt), generator=g)
    ids2 = torch.randint(0, vocab, (1, prompt + 5), generator=g)
    # a prompt whose whole generation stays inside the size buckets the first one saw
    ids3 = torch.randint(0, vocab, (1, max(prompt - 2, 1)), generator=g)
    with torch.no_grad():
        _generate(model, ids, tokens)  # warm-up: transformers' own first-call costs
        want, _ = _generate(model, ids, tokens)
        cpu_s = statistics.median(_generate(model, ids, tokens)[1] for _ in range(3))
        model.to("spyre")
        dev.reset_stats()
        with warnings.catch_warnings(), _HostPrograms() as hp:
            warnings.simplefilter("ignore")
            got, cold_s = _generate(model, ids.to("spyre"), tokens)
            cold_compiles, cold_programs = dev.compile_count(), hp.count
            got2, warm_s = _generate(model, ids.to("spyre"), tokens)
            warm_compiles = dev.compile_count() - cold_compiles
            warm_programs = hp.since(cold_programs)
            # a view geometry's gather compiles on its second use (the first is a host copy):
            # from the third call on it is the steady state (the median of three, as the CPU's)
            steady_s = statistics.median(
                _generate(model, ids.to("spyre"), tokens)[1] for _ in range(3)
            )
            mark, progs = dev.compile_count(), hp.count
            _, inside_s = _generate(model, ids3.to("spyre"), tokens)
            inside_compiles, inside_programs = dev.compile_count() - mark, hp.since(progs)
            mark, progs = dev.compile_count(), hp.count
            _, other_s = _generate(model, ids2.to("spyre"), tokens)
            other_compiles, other_programs = dev.compile_count() - mark, hp.since(progs)
    return {
        "prompt": prompt,
        "new_tokens": tokens,
        "generate_cpu_s": cpu_s,
        "generate_cold_s": cold_s,
        "generate_warm_s": warm_s,
        "warm_over_cpu": warm_s / cpu_s,
        "generate_steady_s": steady_s,
        "steady_over_cpu": steady_s / cpu_s,
        "cold_over_cpu": cold_s / cpu_s,
        "compiles_cold": cold_compiles,
        "compiles_warm": warm_compiles,
        "host_programs_cold": cold_programs,
        "host_programs_warm": warm_programs,
        "inside_prompt": int(ids3.shape[1]),
        "inside_prompt_s": inside_s,
        "compiles_inside_prompt": inside_compiles,
        "host_programs_inside_prompt": inside_programs,
        "other_prompt": int(ids2.shape[1]),
        "other_prompt_s": other_s,
        "compiles_other_prompt": other_compiles,
        "host_programs_other_prompt": other_programs,
        "fallbacks": sum(dev.fallback_stats().values()),
        "tokens_equal": int((got == want).sum()),
        "runs_agree": bool(torch.equal(got, got2)),
    }


#: the decoding strategies of :func:`_decoding_costs` (``generate()`` keywords)
STRATEGIES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "top_k": 50, "top_p": 0.9, "temperature": 0.8},
    "beam3": {"do_sample": False, "num_beams": 3},
}


def _generate_once(model: Any, ids: torch.Tensor, n: int, kw: dict[str, Any]) -> tuple[Any, float]:
    """One ``generate()`` of ``n`` tokens from the same seed: (the tokens, seconds a token)."""
    torch.manual_seed(0)
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw)
    return out.cpu(), (time.perf_counter() - t) / n


def _decoding_costs(prompt: int, tokens: int, rounds: int = 5) -> dict[str, dict[str, Any]]:
    """Each strategy warmed once (its kernels compile), then ``rounds`` rounds in which every
    strategy runs once on the CPU and once on the device, in turn: the median per token of each.
    Interleaved, a drift of the machine's speed (another process, a thermal step) reaches every
    strategy alike, so the ratios to greedy hold better than timing strategy after strategy."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cpu = llama_tiny(2).eval()
    card = llama_tiny(2).eval()
    card.load_state_dict(cpu.state_dict())
    card.to("spyre")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cpu.config.vocab_size, (1, prompt), generator=g)
    sids = ids.to("spyre")
    times: dict[str, dict[str, list[float]]] = {k: {"cpu": [], "card": []} for k in STRATEGIES}
    outs: dict[str, dict[str, Any]] = {k: {} for k in STRATEGIES}
    falls: dict[str, int] = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, kw in STRATEGIES.items():  # warm: kernels compile; fallbacks counted
            outs[name]["cpu"] = _generate_once(cpu, ids, tokens, kw)[0]
            dev.reset_stats()
            outs[name]["card"] = _generate_once(card, sids, tokens, kw)[0]
            falls[name] = sum(dev.fallback_stats().values())
        for _ in range(rounds):
            for name, kw in STRATEGIES.items():
                times[name]["cpu"].append(_generate_once(cpu, ids, tokens, kw)[1])
                times[name]["card"].append(_generate_once(card, sids, tokens, kw)[1])
    res: dict[str, dict[str, Any]] = {}
    for name in STRATEGIES:
        cpu_s = statistics.median(times[name]["cpu"])
        card_s = statistics.median(times[name]["card"])
        got, want = outs[name]["card"], outs[name]["cpu"]
        res[name] = {
            "cpu_ms_per_token": cpu_s * 1e3,
            "card_ms_per_token": card_s * 1e3,
            "card_over_cpu": card_s / cpu_s,
            "fallbacks": falls[name],
            "tokens_equal_cpu": bool(torch.equal(got, want)) if name != "sample" else None,
            "rounds": rounds,
        }
    for r in res.values():
        r["over_greedy"] = r["card_ms_per_token"] / res["greedy"]["card_ms_per_token"]
        r["cpu_over_greedy"] = r["cpu_ms_per_token"] / res["greedy"]["cpu_ms_per_token"]
    return res


#: set to 0 by :func:`bench_against` in the runs it starts: the decoding strategies are no
#: figure it compares (a tree that does not know the variable runs them anyway)
DECODING_ENV = "SPYRE_BENCH_EAGER_DECODING"


def bench_eager(
    *, reps: int = 5, prompt: int = 8, tokens: int = 24, decoding: bool | None = None
) -> dict[str, Any]:
    """The small op's host cost, ``generate()`` on the device and its decoding strategies
    (``decoding``; None: unless ``SPYRE_BENCH_EAGER_DECODING=0``), beside eager CPU."""
    if decoding is None:
        decoding = os.environ.get(DECODING_ENV, "1") != "0"
    return {
        "op": _op_costs(reps),
        "generate": _generate_costs(prompt, tokens),
        "decoding": _decoding_costs(prompt, tokens, rounds=max(reps, 1)) if decoding else {},
    }


def format_eager(res: dict[str, Any]) -> str:
    """Two small tables of :func:`bench_eager`'s result."""
    op = format_table(
        {"add 64x64": res["op"]},
        (
            ("host us", "add_host_us", "{:.1f}"),
            ("waited us", "add_waited_us", "{:.1f}"),
            ("cpu us", "add_cpu_us", "{:.2f}"),
        ),
        width=12,
    )
    g = dict(res["generate"])
    for k in ("inside", "other"):  # kernels / host programs compiled by that prompt
        g[f"{k}_counts"] = f"{g.get(f'compiles_{k}_prompt')}/{g.get(f'host_programs_{k}_prompt')}"
    gen = format_table(
        {"llama-tiny": g},
        (
            ("cpu s", "generate_cpu_s", "{:.3f}"),
            ("cold s", "generate_cold_s", "{:.1f}"),
            ("warm s", "generate_warm_s", "{:.2f}"),
            ("warm/cpu", "warm_over_cpu", "{:.1f}"),
            ("steady s", "generate_steady_s", "{:.2f}"),
            ("steady/cpu", "steady_over_cpu", "{:.1f}"),
            ("compiles", "compiles_cold", "{}"),
            ("inside s", "inside_prompt_s", "{:.2f}"),
            ("inside k/p", "inside_counts", "{}"),
            ("2nd prompt s", "other_prompt_s", "{:.2f}"),
            ("2nd k/p", "other_counts", "{}"),
            ("fallbacks", "fallbacks", "{}"),
            ("tokens equal", "tokens_equal", "{}"),
        ),
        width=13,
    )
    dec = format_table(
        res["decoding"],
        (
            ("cpu ms/tok", "cpu_ms_per_token", "{:.2f}"),
            ("card ms/tok", "card_ms_per_token", "{:.1f}"),
            ("/greedy", "over_greedy", "{:.2f}"),
            ("cpu /greedy", "cpu_over_greedy", "{:.2f}"),
            ("fallbacks", "fallbacks", "{}"),
            ("equal cpu", "tokens_equal_cpu", "{}"),
        ),
        width=12,
    )
    return op + "\n\n" + gen + ("\n\n" + dec if res["decoding"] else "")


#: the figures :func:`bench_against` compares: (section, key)
COMPARED = (
    ("op", "add_host_us"),
    ("generate", "generate_steady_s"),
    ("generate", "generate_cpu_s"),
    ("generate", "steady_over_cpu"),
    ("generate", "compiles_inside_prompt"),
    ("generate", "host_programs_inside_prompt"),
    ("generate", "inside_prompt_s"),
    ("generate", "compiles_other_prompt"),
    ("generate", "host_programs_other_prompt"),
    ("generate", "other_prompt_s"),
    ("generate", "compiles_cold"),
    ("generate", "generate_cold_s"),
)


def _run_tree(root: str, args: list[str]) -> dict[str, Any]:
    """``spyre-jax bench eager --json`` of the tree at ``root``, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu", DECODING_ENV: "0"}
    cmd = [sys.executable, "-m", "spyre_jax", "bench", "eager", "--json", *args]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"bench eager in {root} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_against(
    rev: str, *, runs: int = 3, reps: int = 3, prompt: int = 8, tokens: int = 24
) -> dict[str, Any]:
    """This tree's ``bench eager`` beside git revision ``rev``'s (checked out in a temporary
    worktree), ``runs`` times each, in turn (each in a fresh process: its cold figures are
    its own); each figure the median of the runs, and now / before."""
    root = str(Path(__file__).resolve().parents[2])
    args = ["--reps", str(reps), "--seq", str(prompt), "--tokens", str(tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, "tree")
        git = ["git", "-C", root]
        subprocess.run(
            [*git, "worktree", "add", "--detach", where, rev], check=True, capture_output=True
        )
        try:
            res: dict[str, list[dict[str, Any]]] = {"before": [], "now": []}
            for _ in range(runs):
                res["before"].append(_run_tree(where, args))
                res["now"].append(_run_tree(root, args))
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", where], capture_output=True)
    table = {}
    for sec, key in COMPARED:
        b = [r[sec][key] for r in res["before"] if key in r[sec]]
        n = [r[sec][key] for r in res["now"]]
        mb = statistics.median(b) if b else None
        mn = statistics.median(n)
        table[key] = {
            "before": mb,
            "now": mn,
            "now_over_before": (mn / mb) if mb else None,
            "before_runs": b,
            "now_runs": n,
        }
    return {"rev": rev, "runs": runs, "figures": table}


def format_against(res: dict[str, Any]) -> str:
    """:func:`bench_against`'s table."""
    lines = [f"bench eager: this tree beside {res['rev']} (median of {res['runs']} runs each)"]
    lines.append(f"{'figure':<24} {'before':>10} {'now':>10} {'now/before':>11}")
    for key, f in res["figures"].items():
        b, n, r = f["before"], f["now"], f["now_over_before"]
        lines.append(
            f"{key:<24} {'-' if b is None else f'{b:.3g}':>10} {n:>10.3g} "
            f"{'-' if r is None else f'{r:.2f}':>11}"
        )
    return "\n".join(lines)
