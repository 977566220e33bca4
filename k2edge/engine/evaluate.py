"""Accuracy of a built engine on an evaluation set, by the model card's task: top-1 for classifiers,
COCO mAP for detectors, and of masks (``segm``) or keypoints (OKS) for segmentation and pose (obb:
not evaluated yet). One place for ``k2edge eval``, the sweep and ``k2edge cloud curve``."""

from __future__ import annotations

import time
from typing import Callable, Sequence



from ..errors import InferenceError
from ..model.datasets import CocoDataset, Dataset, check_fits, is_coco, open_coco, open_labelled

__all__ = ["open_eval_set", "run_detector", "evaluate_detector", "evaluate_instances", "evaluate_classifier"]


def open_eval_set(engine, path, limit: int | None = None) -> Dataset | CocoDataset:
    """The evaluation set for ``engine``'s task: COCO annotations (``.json``) for a detector, a
    labelled ImageFolder / ``.npz`` for a classifier.

    Raises:
        DatasetError: the set is missing, malformed, or of the wrong kind for the task.
    """
    from ..errors import DatasetError

    if engine.card.task == "obb":
        raise DatasetError("evaluating oriented boxes (task obb) is not done yet: k2edge eval measures classification, "
                           "detection, segmentation and pose")
    if engine.card.task in ("detection", "segmentation", "pose"):
        if not is_coco(path):
            raise DatasetError(f"{path}: a {engine.card.task} model ({engine.card.source or 'card'}: task = "
                               f"\"{engine.card.task}\") is evaluated on a COCO annotation file (.json)")
        return open_coco(path, engine.labels, limit)
    if is_coco(path):
        raise DatasetError(f"{path}: COCO annotations evaluate detectors; this model's task is {engine.card.task!r} "
                           "(give it a card with task = \"detection\" if it is one)")
    dataset = open_labelled(path, engine.labels, limit)
    check_fits(dataset, tuple(engine.input_shape)[1:], "evaluation set")
    return dataset


EVAL_SCORE_THRESHOLD = 0.001
EVAL_MAX_DETECTIONS = 300


def _results(engine, samples: list):
    for result in engine.stream(samples):
        if result.error is not None:
            if isinstance(result.error, Exception):
                raise result.error
            raise InferenceError(str(result.error))
        yield result


def run_detector(engine, samples: list, advance: Callable[[int], None] | None = None, evaluation: bool = False) -> list:
    """The decoded detections (original-image pixels) of every sample, through the lanes: as the card
    serves them, or with ``evaluation`` as mAP is measured (see :func:`evaluate_detector`)."""
    from ..tasks.detection import decode

    spec = engine.card.detection
    if evaluation:
        spec = spec.model_copy(update={"score_threshold": EVAL_SCORE_THRESHOLD,
                                       "max_detections": max(spec.max_detections, EVAL_MAX_DETECTIONS)})
    out = []
    for result in _results(engine, samples):
        n = len(result.items)
        out.extend(decode(result.outputs[engine.decoder.output], spec, result.geometries[:n], multi_label=evaluation))
        if advance:
            advance(n)
    return out


def run_instances(engine, samples: list, advance: Callable[[int], None] | None = None) -> list[list[dict]]:
    """Segmentation or pose: every sample's answer ``detections`` (masks at the original resolution,
    keypoints in its pixels, as served), decoded as mAP is measured (scores down to 0.001, up to 300
    an image; best class per anchor)."""
    from ..tasks.decoder import TaskDecoder

    card = engine.card
    spec = card.detection.model_copy(update={"score_threshold": EVAL_SCORE_THRESHOLD,
                                              "max_detections": max(card.detection.max_detections, EVAL_MAX_DETECTIONS)})
    graph = engine.model.graph
    decoder = TaskDecoder(card.model_copy(update={"detection": spec}), engine.labels,
                          {o: graph.shape(o) for o in engine.output_names})
    answers: list[list[dict]] = []
    for result in _results(engine, samples):
        n = len(result.items)
        answers.extend(a["detections"] for a in decoder.answers(result.outputs, n, result.geometries[:n]))
        if advance:
            advance(n)
    return answers


def instance_metric(card) -> tuple[str, Sequence[float] | None]:
    """The COCO iou type a segmentation or pose model is measured by, and the keypoints' OKS sigmas."""
    if card.task == "segmentation":
        return "segm", None
    return "keypoints", card.pose.sigmas


def evaluate_instances(engine, dataset: CocoDataset, advance: Callable[[int], None] | None = None) -> dict:
    """Segmentation or pose: COCO mAP of the boxes (``box_map``, ``box_map50``) and of the masks
    (``segm``) or keypoints (``keypoints``, OKS with the card's sigmas) as ``map`` and ``map50``,
    decoded by :func:`run_instances`."""
    from ..tasks.coco_eval import coco_answer_results, coco_map

    t0 = time.perf_counter()
    answers = run_instances(engine, list(dataset.samples), advance)
    elapsed = time.perf_counter() - t0
    results = coco_answer_results(dataset.image_ids, answers, dataset.category_ids)
    iou_type, sigmas = instance_metric(engine.card)
    boxes = coco_map(dataset.ground_truth, [{k: v for k, v in r.items() if k not in ("segmentation", "keypoints")}
                                            for r in results])
    scores = coco_map(dataset.ground_truth, results, iou_type, sigmas)
    return {**scores, "box_map": boxes["map"], "box_map50": boxes["map50"], "metric": iou_type, "images": len(answers),
            "detections": int(sum(len(a) for a in answers)),
            "throughput_per_s": len(answers) / elapsed if elapsed else None}


def evaluate_detector(engine, dataset: CocoDataset, advance: Callable[[int], None] | None = None) -> dict:
    """COCO mAP of ``engine`` on ``dataset``: ``map50``, ``map`` (fractions), images, detections, throughput.

    Decoded as Ultralytics' validation decodes for mAP: scores down to 0.001, every class of an
    anchor above it (multi-label), up to 300 boxes an image — mAP integrates precision over the whole
    recall range, which the card's serving threshold would cut short. The NMS IoU is the card's.
    """
    from ..tasks.coco_eval import coco_map, coco_results

    t0 = time.perf_counter()
    detections = run_detector(engine, list(dataset.samples), advance, evaluation=True)
    elapsed = time.perf_counter() - t0
    scores = coco_map(dataset.ground_truth, coco_results(dataset.image_ids, detections, dataset.category_ids))
    return {**scores, "images": len(detections), "detections": int(sum(len(d) for d in detections)),
            "throughput_per_s": len(detections) / elapsed if elapsed else None, "per_image": detections}


def evaluate_classifier(engine, dataset: Dataset, advance: Callable[[int], None] | None = None) -> dict:
    """Top-1 of ``engine`` on a labelled ``dataset`` through the lanes (with the profile's prefetch)."""
    labels = dataset.labels
    correct = seen = 0
    predictions: list[int] = []
    t0 = time.perf_counter()
    for result in _results(engine, list(dataset.samples)):
        n = len(result.items)
        pred = engine.decoder.probabilities(result.outputs, n).argmax(axis=1)
        predictions.extend(int(p) for p in pred)
        correct += int((pred == labels[seen:seen + n]).sum())
        seen += n
        if advance:
            advance(n)
    elapsed = time.perf_counter() - t0
    return {"top1": correct / seen, "correct": correct, "samples": seen,
            "throughput_per_s": seen / elapsed if elapsed else None, "predictions": predictions}


def accuracy_key(task: str) -> str:
    """The headline accuracy of a task: ``top1`` for classifiers, ``map50`` (COCO mAP@0.5) for detectors."""
    return "map50" if task in ("detection", "segmentation", "pose") else "top1"



