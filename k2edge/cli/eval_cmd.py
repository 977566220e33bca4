"""``k2edge eval MODEL --profile P --dataset DATA``: top-1 accuracy on a labelled dataset."""

from __future__ import annotations

COMMAND = "eval"
HELP = "measure top-1 accuracy on a labelled dataset"
ORDER = 50

import time

from .common import Progress, add_build, add_json, add_model, build_engine, print_json


def register(p) -> None:
    add_model(p)
    add_build(p)
    p.add_argument("--dataset", required=True, metavar="DATA", help="labelled ImageFolder directory or .npz with x and y")
    p.add_argument("--limit", type=int, metavar="N", help="evaluate the first N samples only")
    add_json(p)


def evaluate(engine, dataset, progress: Progress | None = None) -> dict:
    """Top-1 accuracy of ``engine`` on ``dataset`` through the lanes (with the profile's prefetch)."""
    import numpy as np

    labels = dataset.labels
    correct = 0
    seen = 0
    predictions = []
    t0 = time.perf_counter()
    for result in engine.stream(list(dataset.samples)):
        if result.error is not None:
            raise result.error
        logits = result.outputs[engine.output_names[0]][: len(result.items)]
        pred = np.asarray(logits).reshape(len(result.items), -1).argmax(axis=1)
        predictions.extend(int(p) for p in pred)
        correct += int((pred == labels[seen:seen + len(pred)]).sum())
        seen += len(pred)
        if progress:
            progress.advance(len(pred))
    elapsed = time.perf_counter() - t0
    return {"top1": correct / seen, "correct": correct, "samples": seen,
            "throughput_per_s": seen / elapsed if elapsed else None, "predictions": predictions}


def run(args) -> int:
    from ..model.datasets import open_labelled

    engine = build_engine(args)
    dataset = open_labelled(args.dataset, engine.labels, args.limit)
    progress = Progress(len(dataset), "eval")
    with engine:
        result = evaluate(engine, dataset, progress)
    progress.close()
    result.pop("predictions")
    result.update({"model": engine.model.source, "profile": engine.profile.name, "dataset": dataset.source,
                   "lanes": [lane.label + f" [{lane.precision}]" for lane in engine.lanes()]})
    if args.json:
        print_json(result)
    else:
        print(f"top-1 {result['top1']:.4f} ({result['correct']}/{result['samples']}) with profile {result['profile']} "
              f"on {', '.join(result['lanes'])}; {result['throughput_per_s']:.0f} samples/s")
    return 0
