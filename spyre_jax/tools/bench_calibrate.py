"""``spyre-jax bench calibrate``: the timing model against every kernel time CARD.md publishes.

Each case of :mod:`spyre_jax.tools.calibration_cases` is compiled once for the card (for fewer
cores where the measurement was made on fewer), then timed by the model
(:func:`device_model.timing.kernel_cost`) with the card's parameters. Reported per case: the
model's time, the card's, their ratio, whether it lies within max(15%, 1 us), the external bound
and the unit that bounds the schedule; per family the RMS of the relative error and the error
when each point is left out of the fit of the parameters fitted on that family
(:data:`FITTED`), and the number of fitted parameters. Every other parameter is a published
figure (``device_model.card.CardSpec``'s docstring says which) and is not fitted here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from device_model.card import CardSpec
from device_model.kernel import Kernel
from device_model.timing import kernel_cost
from lowering.from_jaxpr import from_jaxpr
from lowering.pipeline import compile_graph

from .calibration_cases import CASES, EXCLUDED, F16, Case

__all__ = ["FITTED", "bench_calibrate", "format_calibrate", "run_named"]

#: parameters fitted here: name -> the families whose points fit it (each at least two points)
FITTED: dict[str, tuple[str, ...]] = {
    "reduction_read_bw": ("reduction",),
    "reduction_fixed_s": ("reduction",),
    "bmm_batch_outer_macs_per_ns_per_core": ("batched matmul",),
}


def run_named(
    what: str,
    cases: dict[str, Any],
    run: Callable[[str], dict[str, Any]],
    names: list[str] | None,
) -> dict[str, dict[str, Any]]:
    """``run`` over the cases ``names`` (default: all of ``cases``), one after another; an
    unknown name raises ValueError naming the known ones, before any case runs."""
    todo = names or list(cases)
    for name in todo:
        if name not in cases:
            raise ValueError(f"bench {what}: unknown case {name!r}; known: {', '.join(cases)}")
    return {name: run(name) for name in todo}


def _kernel(case: Case, card: CardSpec) -> Kernel:
    specs = [jax.ShapeDtypeStruct(s, F16) for s in case.shapes]
    graph = from_jaxpr(jax.make_jaxpr(case.fn)(*specs), name=case.fn.__name__.strip("_") or "k")
    return compile_graph(graph, card)


def _card(base: CardSpec, case: Case, params: dict[str, float]) -> CardSpec:
    card = base.replace(**params) if params else base
    return card.replace(num_cores=case.cores) if case.cores else card


def _within(model: float, measured: float) -> bool:
    return abs(model - measured) <= max(0.15 * measured, 1.0)


def _error(model: float, measured: float) -> float:
    """A point's error for the family statistics: relative, with the goal's 1 us floor (1 us is
    15% of 6.7 us), so a 1 us kernel's 0.7 us counts as a 6.7 us kernel's would."""
    return (model - measured) / max(measured, 1.0 / 0.15)


def _fit(
    name: str,
    points: Sequence[tuple[Kernel, Case]],
    base: CardSpec,
    params: dict[str, float],
) -> float:
    """The value of parameter ``name`` that minimizes the points' squared log error, within a
    factor of 10 either way of the card's value."""

    def loss(v: float) -> float:
        p = {**params, name: v}
        err = 0.0
        for k, case in points:
            t = kernel_cost(k, _card(base, case, p))["sim_time_us"]
            err += math.log(t / case.measured_us) ** 2
        return err

    # a grid over a factor of 10 either way (the loss has plateaus where another unit bounds
    # the kernel), then golden section between the best grid point's neighbours
    c = math.log(getattr(base, name))
    grid = [c - math.log(10) + i * math.log(100) / 40 for i in range(41)]
    vals = [loss(math.exp(x)) for x in grid]
    i = min(range(len(grid)), key=vals.__getitem__)
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(math.exp(a)), loss(math.exp(b))
    for _ in range(20):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(math.exp(b))
    return math.exp((lo + hi) / 2)


def _fit_all(kernels: dict[str, Kernel], base: CardSpec, leave_out: str | None) -> dict:
    """Every :data:`FITTED` parameter, fitted on its families' cases (those the model is held
    to, less ``leave_out``): coordinate descent, three sweeps."""
    params: dict[str, float] = {}
    for _ in range(3):
        for name, families in FITTED.items():
            pts = [
                (kernels[n], CASES[n])
                for n in kernels
                if CASES[n].family in families and n != leave_out and not CASES[n].apart
            ]
            if len(pts) >= 2:  # no parameter fitted to a single point
                params[name] = _fit(name, pts, base.replace(**params), params)
    return params


def bench_calibrate(names: list[str] | None = None, card: CardSpec | None = None) -> dict:
    """The table: ``{"cases": {name: row}, "families": {family: stats}, "fitted": {param:
    value}, "fitted_parameters": n, "excluded": [...]}`` (``names``: some cases only)."""
    base = card or CardSpec()
    todo = run_named("calibrate", CASES, lambda n: {}, names)
    kernels = {n: _kernel(CASES[n], _card(base, CASES[n], {})) for n in todo}
    params = _fit_all(kernels, base, None)
    rows: dict[str, dict[str, Any]] = {}
    for n, k in kernels.items():
        case = CASES[n]
        cost = kernel_cost(k, _card(base, case, params))
        model = float(cost["sim_time_us"])
        rows[n] = {
            "family": case.family,
            "model_us": model,
            "measured_us": case.measured_us,
            "figures": dict(case.figures),
            "cores": case.cores or base.num_cores,
            "model_over_measured": model / case.measured_us,
            "within": _within(model, case.measured_us),
            "bound_us": float(cost["bound_us"]),
            "bound_ratio": float(cost["bound_ratio"]),
            "bound_unit": cost["bound"],
            "source": case.source,
            "derived": case.derived,
            "apart": case.apart,
        }
    fams: dict[str, dict[str, Any]] = {}
    for fam in dict.fromkeys(r["family"] for r in rows.values()):
        members = [n for n in rows if rows[n]["family"] == fam and not rows[n]["apart"]]
        if not members:
            continue
        errs = [_error(rows[n]["model_us"], rows[n]["measured_us"]) for n in members]
        loo = []
        fitted_here = [p for p, fs in FITTED.items() if fam in fs]
        for n in members:
            if fitted_here and len(members) > 2:
                p = _fit_all(kernels, base, n)
                t = kernel_cost(kernels[n], _card(base, CASES[n], p))["sim_time_us"]
                loo.append(_error(t, CASES[n].measured_us))
            else:
                loo.append(errs[len(loo)])
        fams[fam] = {
            "cases": len(members),
            "rms_error": math.sqrt(sum(e * e for e in errs) / len(errs)),
            "loo_rms_error": math.sqrt(sum(e * e for e in loo) / len(loo)),
            "within": sum(rows[n]["within"] for n in members),
            "fitted": fitted_here,
        }
    return {
        "cases": rows,
        "families": fams,
        "fitted": params,
        "fitted_parameters": len(params),
        "excluded": [{"what": w, "figure": f, "why": y} for w, f, y in EXCLUDED],
    }


def format_calibrate(res: dict[str, Any]) -> str:
    """A table of :func:`bench_calibrate`'s result."""
    head = f"{'case':<26}{'family':<16}{'model us':>10}{'card us':>10}{'ratio':>7}{'ok':>4}"
    head += f"{'bound us':>10}{'sched/bound':>12}  unit"
    lines = [head]
    for name, r in res["cases"].items():
        lines.append(
            f"{name:<26}{r['family']:<16}{r['model_us']:>10.1f}{r['measured_us']:>10.1f}"
            f"{r['model_over_measured']:>7.2f}{'yes' if r['within'] else 'NO':>4}"
            f"{r['bound_us']:>10.1f}{r['bound_ratio']:>12.2f}  {r['bound_unit']}"
        )
        if r["apart"]:
            lines.append(f"{'':<26}(not held to it: {r['apart']})")
    lines.append("")
    lines.append(f"{'family':<16}{'cases':>6}{'within':>8}{'RMS err':>9}{'LOO RMS':>9}  fitted")
    for fam, f in res["families"].items():
        lines.append(
            f"{fam:<16}{f['cases']:>6}{f['within']:>8}{f['rms_error']:>9.1%}"
            f"{f['loo_rms_error']:>9.1%}  {', '.join(f['fitted']) or '-'}"
        )
    fitted = ", ".join(f"{k} = {v:.4g}" for k, v in res["fitted"].items()) or "none"
    lines.append(f"fitted parameters: {res['fitted_parameters']} ({fitted})")
    lines.append("left out (see docs/timing-and-numerics.md):")
    lines.extend(f"  {e['what']}: {e['why']}" for e in res["excluded"])
    return "\n".join(lines)
