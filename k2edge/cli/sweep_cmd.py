"""``k2edge pareto-sweep MODEL --dataset EVAL``: measure configurations, find the Pareto front, recommend a profile."""

from __future__ import annotations

COMMAND = "pareto-sweep"
HELP = "measure every configuration, find the latency/accuracy/energy Pareto front, recommend a profile"
ORDER = 60

import argparse

from .common import BOARD_CHOICES, add_json, add_model, board_of, count, positive_float, print_json

GOAL_CHOICES = ("latency", "accuracy", "energy", "balanced")


def accuracy_fraction(text: str) -> float:
    """``0.99`` or ``99%`` -> 0.99."""
    raw = text.strip()
    try:
        value = float(raw.rstrip("%")) / (100 if raw.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction (0.99) or a percentage (99%), got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction within [0, 1] (0.99) or a percentage (99%), got {text!r}")
    return value


def register(p) -> None:
    add_model(p)
    p.add_argument("--dataset", required=True, metavar="EVAL",
                   help="labelled evaluation set: ImageFolder directory or .npz with x and y; for a detector (card task = "
                        "\"detection\") a COCO annotation .json, and the accuracy axis is COCO mAP@0.5")
    p.add_argument("--calib", metavar="DATA", help="calibration set for INT8 configurations (default: calib/ or calib.npz beside the model)")
    p.add_argument("--check", metavar="DATA", help="INT8 configurations: run the accuracy check on this set instead of "
                   "every fifth calibration sample")
    p.add_argument("--profiles", nargs="+", metavar="P", help="profile files or names to sweep (default: c1 ... c6)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="sweep every combination of values (repeatable); keys: offload_ratio, partition (layer-wise, "
                        "block-wise, model-wise), prefetch (on/off), precision (fp16, int8+fp16, ...), batch_size. "
                        "Applied over each --profiles entry, else over the schema defaults")
    p.add_argument("--runs", type=count(1), default=5, metavar="N",
                   help="runs per configuration, interleaved round by round across the configurations, each on a "
                        "freshly activated engine; the spread is taken between them (default 5)")
    p.add_argument("--warmup", type=count(0), default=50, metavar="N", help="untimed warm-up requests before each run (default 50)")
    p.add_argument("--requests", type=count(1), default=500, metavar="N",
                   help="timed requests per run, for latency and again for throughput (default 500)")
    p.add_argument("--limit", type=count(1), metavar="N", help="measure accuracy on N samples of EVAL only: the first N; of an image folder, N taken from each class in turn")
    p.add_argument("--goal", choices=GOAL_CHOICES, default="balanced",
                   help="what the recommendation optimises: lowest p50 latency, highest top-1, lowest energy per "
                        "inference, or balanced over the front: the least accuracy given up plus latency paid, a point of accuracy "
                        "weighing as much as 10 %% of latency (default)")
    p.add_argument("--max-latency-ms", type=positive_float, metavar="X", help="recommend only configurations whose p99 latency is at most X ms")
    p.add_argument("--min-accuracy", type=accuracy_fraction, metavar="Y", help="recommend only configurations with top-1 at least Y (0.99 or 99%%)")
    p.add_argument("--out", default="pareto-sweep", metavar="DIR",
                   help="output directory: results.json, results.csv, pareto.png, recommended.json (default ./pareto-sweep)")
    p.add_argument("--resume", action="store_true", help="continue the sweep in --out: keep what was measured there, run only what is missing")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results.json already in --out (without it, or --resume, an existing one is refused)")
    p.add_argument("--board", choices=BOARD_CHOICES, help="board to plan for (default: this board, else orin-agx)")
    p.add_argument("--cache", metavar="DIR", help="engine cache directory (default: ~/.cache/k2edge)")
    p.add_argument("--backend", choices=("auto", "onnxruntime", "tensorrt"), default="auto",
                   help="auto: TensorRT where it exists, else ONNX Runtime (default)")
    add_json(p)


def _resume_command() -> str:
    import shlex
    import sys

    argv = sys.argv[1:]
    if COMMAND not in argv:
        return f"the same k2edge {COMMAND} command with --resume"
    argv = argv[argv.index(COMMAND):]
    return "k2edge " + shlex.join(argv + ([] if "--resume" in argv else ["--resume"]))


def run(args) -> int:
    import sys
    from pathlib import Path

    from ..sweep import MeasureSettings, NoRecommendation, SweepSpec, run_sweep, sweep_configs
    from ..sweep.progress import default_progress
    from ..sweep.report import print_table

    configs, notes = sweep_configs(args.profiles, args.grid)
    settings = MeasureSettings(runs=args.runs, warmup=args.warmup, requests=args.requests, limit=args.limit)
    out = Path(args.out)  # created by the sweep once every input is checked: a refused sweep leaves nothing behind
    spec = SweepSpec(model=Path(args.model), dataset=Path(args.dataset), out=out, calib=args.calib, check=args.check, board=board_of(args),
                     backend=args.backend, cache_dir=args.cache, input_shapes=dict(args.input_shape) or None,
                     settings=settings, goal=args.goal, max_latency_ms=args.max_latency_ms, min_accuracy=args.min_accuracy,
                     card=args.card)
    progress = default_progress(args.json)
    for note in notes:
        progress.note(f"note: {note}")
    outcome = run_sweep(spec, configs, resume=args.resume, overwrite=args.overwrite, progress=progress)
    doc = outcome.doc
    if args.json:
        print_json(doc)
    else:
        print_table(doc)
    if outcome.interrupted:
        done = sum(1 for r in doc["configs"] if r["status"] == "ok")
        runs = sum(len(r["runs"]) for r in doc["configs"] if r["status"] in ("ok", "partial"))
        print(f"k2edge {COMMAND}: interrupted with {done} of {len(configs)} configuration(s) measured in full "
              f"({runs} run(s) finished); every finished run is kept in {out / 'results.json'}. Continue with: "
              f"{_resume_command()}", file=sys.stderr)
        return 130
    rec = doc["recommendation"]
    if not rec or not rec.get("name"):
        raise NoRecommendation(f"no recommended profile: {rec.get('reason') if rec else 'nothing measured'} "
                               f"(measurements are in {out}/)")
    written = ["results.json", "results.csv", "pareto.png", "recommended.json"]
    print(f"wrote {', '.join(written)} to {out}/; use the recommendation with: --profile {out / 'recommended.json'}",
          file=sys.stderr if args.json else sys.stdout)
    return 0
