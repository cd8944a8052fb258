"""``spyre-jax`` / ``python -m spyre_jax``: the demo, the benchmarks and the fuzzer."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main", "main_coverage", "COVERAGE_DESCRIPTION"]

#: the ``coverage`` command's description: the first line of
#: :mod:`spyre_jax.tools.coverage_common`'s docstring (kept here so ``--help`` loads nothing)
COVERAGE_DESCRIPTION = (
    "``spyre-jax coverage``: how much of PyTorch and JAX runs on the simulated card, and right."
)


def main_coverage(argv: list[str]) -> int:
    """``spyre-jax coverage torch [--json] [--limit N] [--ops a,b] [--samples K]`` and
    ``spyre-jax coverage jax [--json] [--limit N] [--ops a,b] [--paths jit,grad,vmap]``: print
    the table, or one JSON object."""
    p = argparse.ArgumentParser(prog="spyre-jax coverage", description=COVERAGE_DESCRIPTION)
    sub = p.add_subparsers(dest="frontend", required=True)
    pt = sub.add_parser("torch", help="PyTorch's OpInfo database (backend and spyre device)")
    pt.add_argument("--ops", default=None, help="comma-separated OpInfo names (default: all)")
    pt.add_argument("--samples", type=int, default=3, help="samples per dtype and op")
    pt.add_argument("--paths", default="backend,device", help="backend and/or device")
    pj = sub.add_parser("jax", help="our table of jax.numpy / jax.lax / jax.nn functions")
    pj.add_argument("--ops", default=None, help="comma-separated table entries (default: all)")
    pj.add_argument(
        "--paths",
        default="jit,grad,vmap",
        help="some of jit (the sample), grad (its gradient), vmap (batched); default all",
    )
    for q in (pt, pj):
        q.add_argument("--json", action="store_true", help="print one JSON object")
        q.add_argument("--limit", type=int, default=None, help="at most N ops / entries")
        q.add_argument("--time-limit", type=float, default=None, help="stop after S seconds")
        q.add_argument("--notes", action="store_true", help="show why samples did not pass")
    args = p.parse_args(argv)
    paths = tuple(x for x in args.paths.split(",") if x)
    allowed = ("jit", "grad", "vmap")
    if args.frontend == "jax" and (not paths or not set(paths) <= set(allowed)):
        p.error(f"coverage jax --paths: some of {','.join(allowed)}, got {args.paths!r}")
    # imported here, not at the top: the CLI must start (--help, errors) without torch/JAX
    from . import coverage_run

    if args.frontend == "torch":
        ops = [o for o in args.ops.split(",") if o] if args.ops else None
        kw = {"ops": ops, "samples": args.samples, "paths": paths}
    else:
        try:
            ops = coverage_run.jax_entries(args.ops) if args.ops else None
        except ValueError as e:
            p.error(f"coverage jax --ops: {e}")
        kw = {"ops": ops, "paths": paths}
    out = coverage_run.report(
        args.frontend,
        as_json=args.json,
        notes=args.notes,
        limit=args.limit,
        time_limit_s=args.time_limit,
        **kw,
    )
    print(out)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    demo.run_demo(trace=demo.DEFAULT_TRACE if args.trace is None else args.trace)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench  # JAX, torch and the models load here, not when the CLI starts

    return bench.main(args)


def _fuzz(args: argparse.Namespace) -> int:
    try:
        from . import fuzz
    except ImportError as e:  # hypothesis is a test dependency
        print(f"spyre-jax fuzz needs {e.name}: pip install 'spyre-jax[test]'", file=sys.stderr)
        return 2

    def progress(done: int, failed: int, seconds: float) -> None:
        if done % 100 == 0:
            print(f"  {done} programs, {failed} disagree, {seconds:.0f} s", file=sys.stderr)

    rep = fuzz.fuzz(args.examples, seed=args.seed, real_shapes=args.real_shapes, progress=progress)
    print(json.dumps(rep) if args.json else fuzz.format_report(rep))
    return 1 if rep["failed"] else 0


def _estimate(args: argparse.Namespace) -> int:
    from . import estimate as est

    try:
        opts = ("tp", "prefill", "decode_context", "batch", "dtype")
        r = est.estimate(args.config, **{k: getattr(args, k) for k in opts})
    except (est.ConfigError, est.DeviceOOMError, OSError, json.JSONDecodeError) as e:
        print(f"spyre-jax estimate: {e}", file=sys.stderr)
        return 2
    if args.trace:
        est.write_trace(r, args.trace)
    print(json.dumps(r) if args.json else est.format_estimate(r))
    if args.plot:
        est.plot_estimate(r, args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "coverage":
        return main_coverage(argv[1:])
    p = argparse.ArgumentParser(prog="spyre-jax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("coverage", help="op coverage: coverage torch|jax [--json] [--limit N]")
    pd = sub.add_parser("demo", help="run the transformer-block demo on the simulated card")
    pd.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="where to write the Chrome trace (default: spyre-demo-trace.json in the system's "
        "temporary directory)",
    )
    pb = sub.add_parser("bench", help="benchmarks")
    pb.add_argument(
        "which",
        choices=[
            "sim",
            "launch",
            "softmax",
            "torch",
            "models",
            "serve",
            "eager",
            "calibrate",
            "schedules",
            "tp",
            "train",
            "loops",
            "jax-decode",
        ],
    )
    pb.add_argument("--json", action="store_true", help="print one JSON object")
    pb.add_argument(
        "--plot", default=None, metavar="FILE", help="calibrate: draw the model against the card"
    )
    pb.add_argument(
        "--reps", type=int, default=None, help="repetitions (default 5; models 1, sim 15)"
    )
    pb.add_argument(
        "--models",
        default="",
        help="models, serve, calibrate, schedules: comma-separated names (default all)",
    )
    pb.add_argument(
        "--layers", type=int, default=None, help="models, serve, jax-decode: shorten to N layers"
    )
    pb.add_argument(
        "--tiny", action="store_true", help="models: tiny widths too; train: a small layer (tests)"
    )
    pb.add_argument(
        "--seq",
        type=int,
        default=None,
        help="prompt length (models 128; serve 32; eager 8; jax-decode 16)",
    )
    pb.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="serve, eager, jax-decode: new tokens (16; eager 24)",
    )
    pb.add_argument("--against", metavar="REV", help="eager: beside git revision REV, 3 runs")
    pb.add_argument(
        "--cache",
        choices=["static", "dynamic"],
        default="static",
        help="serve: transformers' KV cache (static, or the default dynamic one)",
    )
    pf = sub.add_parser(
        "fuzz", help="random programs through JAX, torch and the card: fuzz --examples N"
    )
    pf.add_argument("--examples", type=int, default=200, help="programs to run (default 200)")
    pf.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    pf.add_argument(
        "--real-shapes",
        choices=["mix", "only", "off"],
        default="mix",
        help="real-size shapes: about one program in ten (mix), all (only), none (off)",
    )
    pf.add_argument("--json", action="store_true", help="print one JSON object")
    pe = sub.add_parser(
        "estimate", help="time and memory of a model on 1-8 cards from its config.json alone"
    )
    pe.add_argument(
        "config", help="a Hugging Face config.json (llama, granite, mistral, qwen2, gpt2)"
    )
    pe.add_argument("--tp", type=int, default=1, help="tensor-parallel cards (default 1)")
    pe.add_argument("--prefill", type=int, default=128, help="prompt tokens (default 128)")
    pe.add_argument(
        "--decode-context", type=int, default=128, help="context of a decode step (default 128)"
    )
    pe.add_argument("--batch", type=int, default=1, help="sequences at once (default 1)")
    pe.add_argument("--dtype", default="float16", help="float16 (default), bfloat16, float32")
    pe.add_argument("--json", action="store_true", help="print one JSON object")
    pe.add_argument(
        "--trace", default=None, help="write a Chrome trace of prefill and a decode step"
    )
    pe.add_argument("--plot", default=None, metavar="FILE", help="roofline, time per layer kind")
    args = p.parse_args(argv)
    if getattr(args, "reps", 0) is None:
        args.reps = {"models": 1, "sim": 15, "train": 3}.get(args.which, 5)
    if getattr(args, "seq", 0) is None:
        args.seq = {"serve": 32, "eager": 8, "jax-decode": 16}.get(args.which, 128)
    if getattr(args, "tokens", 0) is None:
        args.tokens = 24 if args.which == "eager" else 16
    if args.cmd == "demo":
        return _demo(args)
    if args.cmd == "bench":
        return _bench(args)
    if args.cmd == "fuzz":
        return _fuzz(args)
    if args.cmd == "estimate":
        return _estimate(args)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
