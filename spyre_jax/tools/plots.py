"""Pictures of the timing model: ``spyre-jax bench calibrate --plot FILE`` (the model against
the card's measurements) and ``spyre-jax estimate ... --plot FILE`` (a roofline of the model's
kernels and the time per layer kind). matplotlib is an optional extra (``pip install
'spyre-jax[plot]'``, also in ``[test]``); without it the commands say so.
"""

from __future__ import annotations

from typing import Any

from device_model.card import CardSpec

__all__ = ["plot_calibrate", "plot_estimate"]

_MARKERS = "osD^vP*Xh<>"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - the extra is part of [test]
        raise RuntimeError(
            "spyre-jax: --plot needs matplotlib: pip install 'spyre-jax[plot]'"
        ) from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_calibrate(res: dict[str, Any], path: str) -> None:
    """``bench calibrate``'s result as a log-log picture: the card's time (x) against the
    model's (y), one marker per op family, the line of equality and the 15% band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 6))
    fams = list(dict.fromkeys(r["family"] for r in res["cases"].values()))
    xs = [r["measured_us"] for r in res["cases"].values()]
    lo, hi = min(xs) / 2, max(xs) * 2
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="model = card")
    ax.fill_between(
        [lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.85", label="within 15%"
    )
    for i, fam in enumerate(fams):
        pts = [r for r in res["cases"].values() if r["family"] == fam]
        ax.scatter(
            [r["measured_us"] for r in pts],
            [r["model_us"] for r in pts],
            marker=_MARKERS[i % len(_MARKERS)],
            s=45,
            label=fam,
            zorder=3,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("kernel time on the card (us, CARD.md)")
    ax.set_ylabel("kernel time in the model (us)")
    ax.set_title("spyre-jax timing model against the card's measurements")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_estimate(r: dict[str, Any], path: str, card: CardSpec | None = None) -> None:
    """``spyre-jax estimate``'s result: left, a roofline of its kernels' stages (achieved
    flop/s against flops per byte of device memory, with the card's two roofs: the read rate
    times the intensity, and the sustained PE rate); right, the time per layer kind in
    prefill and in a decode step."""
    plt = _pyplot()
    card = card or CardSpec()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5))
    kinds = ("embed", "layer", "head")
    for pi, phase in enumerate(("prefill", "decode")):
        for ki, kind in enumerate(kinds):
            pts = [
                (f / b, f / (us * 1e-6))
                for f, b, us in r["phases"][phase][kind].get("roofline", [])
                if f > 0 and b > 0 and us > 0
            ]
            if pts:
                ax.scatter(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    s=25,
                    marker=_MARKERS[ki],
                    color=f"C{pi}",
                    alpha=0.7,
                    label=f"{phase} {kind}",
                )
    ai = [10 ** (i / 10) for i in range(-50, 41)]
    roof_pe = card.bound_flops
    ax.plot(
        ai,
        [min(a * card.memory_bw_one_way, roof_pe) for a in ai],
        color="black",
        lw=1.2,
        label="roof: read rate x intensity, sustained PE rate",
    )
    ax.axhline(card.peak_flops, color="0.5", ls="--", lw=0.8, label="peak fp16 (datasheet)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (flop per byte of device memory)")
    ax.set_ylabel("achieved flop/s")
    ax.set_title(f"{r['model_type']}, tp {r['tp']}: the model's kernel stages")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", lw=0.3)
    width = 0.38
    for pi, phase in enumerate(("prefill", "decode")):
        ph = r["phases"][phase]
        layers = r["shape"].get("layers", 1)
        ms = [
            ph["embed"]["us"] / 1e3,
            layers * ph["layer"]["us"] / 1e3,
            ph["head"]["us"] / 1e3,
            ph["collectives_us"] / 1e3,
        ]
        bx.bar([i + (pi - 0.5) * width for i in range(4)], ms, width, label=phase)
    bx.set_xticks(range(4))
    bx.set_xticklabels(["embedding", "decoder layers", "norm + head", "collectives"])
    bx.set_ylabel("ms")
    bx.set_title(f"time per layer kind (prefill {r['prefill']}, decode at {r['decode_context']})")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
