"""``k2edge eval MODEL --profile P --dataset DATA``: top-1 of a classifier, COCO mAP of a detector."""

from __future__ import annotations

import sys

COMMAND = "eval"
HELP = "measure accuracy on a labelled dataset: top-1 (classifiers), COCO mAP (detection, segmentation masks, pose keypoints)"
ORDER = 50

from .common import Progress, add_build, add_json, add_model, build_engine, count, print_json


def register(p) -> None:
    add_model(p)
    add_build(p)
    p.add_argument("--dataset", required=True, metavar="DATA",
                   help="classifiers: labelled ImageFolder directory or .npz with x and y; detectors (card task = "
                        "\"detection\"): a COCO annotation .json whose file_names are relative to its folder")
    p.add_argument("--limit", type=count(1), metavar="N",
                   help="evaluate N samples only: the first N; of an image folder, N taken from each class in turn")
    add_json(p)


def evaluate(engine, dataset, progress: Progress | None = None) -> dict:
    """Top-1 accuracy of ``engine`` on ``dataset`` (see :func:`k2edge.engine.evaluate.evaluate_classifier`)."""
    from ..engine.evaluate import evaluate_classifier

    return evaluate_classifier(engine, dataset, progress.advance if progress else None)


def run(args) -> int:
    from ..engine.evaluate import (EVAL_MAX_DETECTIONS, EVAL_SCORE_THRESHOLD, evaluate_detector, evaluate_instances,
                                   open_eval_set)

    from ..model.datasets import existing
    from ..model.ingest import model_file

    model_file(args.model)  # the model, then the dataset: a mistyped path is told before a build that may take minutes
    existing(args.dataset)
    engine = build_engine(args)
    dataset = open_eval_set(engine, args.dataset, args.limit)
    progress = Progress(len(dataset), "eval", json_output=args.json)
    task = engine.card.task
    detector = task in ("detection", "segmentation", "pose")
    with engine:
        if task == "detection":
            result = evaluate_detector(engine, dataset, progress.advance)
        elif detector:
            result = evaluate_instances(engine, dataset, progress.advance)
        else:
            result = evaluate(engine, dataset, progress)
    progress.close()
    result.pop("predictions", None)
    result.pop("per_image", None)
    result.update({"model": engine.model.source, "task": engine.card.task, "card": engine.card.source,
                   "profile": engine.profile.name, "dataset": dataset.source,
                   "lanes": [lane.label + f" [{lane.precision}]" for lane in engine.lanes()],
                   "precision_flops": engine.plan.precision_flops,  # a lane's [int8] is what it asked for; this, what runs
                   "int8_check": engine.info.int8_check.to_dict() if engine.info.int8_check is not None else None})
    if not detector:  # how far the share may be from the model's on more data of the kind
        from ..engine.check import wilson

        result["top1_ci95"] = [round(v, 4) for v in wilson(result["correct"], result["samples"])]
    if args.json:
        print_json(result)
        return 0
    if engine.plan.precision_flops and "int8" in engine.plan.precision_chain:
        from ..engine.shares import share_text

        print(share_text(engine.plan.precision_flops), file=sys.stderr)
    if detector:
        what = {"segmentation": "mask ", "pose": "keypoint "}.get(task, "")
        boxes = f"; boxes mAP@0.5 {result['box_map50']:.4f}, mAP@0.5:0.95 {result['box_map']:.4f}" if what else ""
        print(f"{what}mAP@0.5 {result['map50']:.4f}, mAP@0.5:0.95 {result['map']:.4f}{boxes} ({result['images']} images, "
              f"{result['detections']} detections scored, as COCO mAP counts them: score >= {EVAL_SCORE_THRESHOLD:g}, up to "
              f"{EVAL_MAX_DETECTIONS} an image, not the card's thresholds) with profile {result['profile']} on {', '.join(result['lanes'])}; "
              f"{result['throughput_per_s']:.0f} images/s")
    else:
        low, high = result["top1_ci95"]
        print(f"top-1 {result['top1']:.4f} ({result['correct']}/{result['samples']}, 95 % CI {low:.4f}-{high:.4f}) with "
              f"profile {result['profile']} "
              f"on {', '.join(result['lanes'])}; {result['throughput_per_s']:.0f} samples/s")
    return 0
