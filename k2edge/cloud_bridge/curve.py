"""The escalation-rate vs accuracy curve: how much accuracy each share of traffic sent to the
cloud buys, assuming the cloud answers every escalated request correctly.

Requests escalate least confident first (by the chosen measure), which is what a confidence
threshold does; each point gives the threshold that produces it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from ..tasks.result import MEASURES, confidence

__all__ = ["CurvePoint", "DetectionCurvePoint", "detection_curve", "escalation_curve", "confidences", "image_confidence"]


@dataclass(frozen=True)
class CurvePoint:
    """One share of traffic sent to the cloud.

    Attributes:
        share: requested share of requests escalated, in [0, 1].
        escalated: how many requests that is (rounded to whole requests).
        threshold: escalate when confidence < threshold to send exactly these requests; None when
            no threshold separates them (ties at the boundary) — then ``threshold_share`` tells
            what the nearest threshold sends. For 100 % it is just above the highest confidence.
        threshold_share: the share ``confidence < threshold`` actually sends.
        accuracy: top-1 with the escalated requests counted correct.
        local_accuracy: top-1 of the requests kept on the edge (None when none are kept).
    """

    share: float
    escalated: int
    threshold: float | None
    threshold_share: float
    accuracy: float
    local_accuracy: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def confidences(logits, measure: str):
    """Per-sample confidence of a (N, classes) logits array."""
    import numpy as np

    if measure not in MEASURES:
        raise ValueError(f"confidence measure must be one of {', '.join(MEASURES)}, got {measure!r}")
    z = np.asarray(logits, dtype=np.float64)
    z = z.reshape(z.shape[0], -1)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    return np.array([confidence(row, measure, p.shape[1]) for row in p])


def escalation_curve(logits, labels: Sequence[int], measure: str = "max_softmax",
                     shares: Sequence[float] | None = None) -> list[CurvePoint]:
    """The curve for one evaluation set.

    Args:
        logits: (N, classes) model outputs.
        labels: the N true class indices.
        measure: ``max_softmax``, ``margin`` or ``entropy``.
        shares: shares of traffic to evaluate (default 0, 0.05, ..., 1).

    Raises:
        ValueError: shapes disagree, an empty set, or an unknown measure.
    """
    import numpy as np

    z = np.asarray(logits, dtype=np.float64)
    if z.ndim < 2:
        raise ValueError(f"logits must be (N, classes), got shape {z.shape}")
    z = z.reshape(z.shape[0], -1)
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    n = z.shape[0]
    if n == 0 or y.shape[0] != n:
        raise ValueError(f"{n} logits rows for {y.shape[0]} labels")
    shares = [i / 20 for i in range(21)] if shares is None else list(shares)
    conf = confidences(z, measure)
    correct = z.argmax(axis=1) == y
    order = np.argsort(conf, kind="stable")  # least confident first
    sorted_conf = conf[order]
    points = []
    for share in shares:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"shares must be within [0, 1], got {share}")
        k = int(round(share * n))
        kept = order[k:]
        acc = (k + int(correct[kept].sum())) / n
        local_acc = float(correct[kept].mean()) if kept.size else None
        if k == n:
            threshold = float(np.nextafter(sorted_conf[-1], np.inf))
        elif k == 0:
            threshold = float(sorted_conf[0])
        else:
            threshold = float(sorted_conf[k]) if sorted_conf[k] > sorted_conf[k - 1] else None
        probe = float(sorted_conf[min(k, n - 1)]) if threshold is None else threshold
        points.append(CurvePoint(share, k, threshold, float((conf < probe).sum()) / n, acc, local_acc))
    return points


@dataclass(frozen=True)
class DetectionCurvePoint:
    """One share of a detector's traffic sent to the cloud.

    Attributes:
        share: requested share of images escalated.
        escalated: how many images that is.
        threshold: for ``max_box_score``, escalate when the best box scores below it (None when
            ties leave no threshold sending exactly these images; ``uncertain_boxes`` has a band, not
            a threshold).
        map50 / map: COCO mAP@0.5 and mAP@0.5:0.95 with the escalated images' detections replaced
            by their ground truth (the cloud assumed to fix what it sees).
    """

    share: float
    escalated: int
    threshold: float | None
    map50: float
    map: float

    def to_dict(self) -> dict:
        return asdict(self)


def image_confidence(detections, measure: str, band: tuple[float, float] = (0.25, 0.6)) -> float:
    """One image's confidence for ranking escalations (lower escalates first).

    ``max_box_score``: the best box's score (0 when nothing was found). ``uncertain_boxes``:
    1 / (1 + boxes scoring within ``band``), so 1 means nothing uncertain (kept by the policy) and
    more uncertain boxes rank earlier.
    """
    scores = [float(s) for s in detections.scores] if hasattr(detections, "scores") else [float(d["score"]) for d in detections]
    if measure == "max_box_score":
        return max(scores, default=0.0)
    if measure == "uncertain_boxes":
        low, high = band
        return 1.0 / (1 + sum(1 for s in scores if low <= s < high))
    raise ValueError(f"detection measure must be max_box_score or uncertain_boxes, got {measure!r}")


def detection_curve(dataset, detections, measure: str = "max_box_score", shares: Sequence[float] | None = None,
                    band: tuple[float, float] = (0.25, 0.6), iou_type: str = "bbox",
                    sigmas: Sequence[float] | None = None) -> list[DetectionCurvePoint]:
    """Share of images sent to the cloud vs COCO mAP, least confident images first.

    Args:
        dataset: a :class:`~k2edge.model.datasets.CocoDataset` (ground truth, image and category ids).
        detections: per image, the edge's :class:`~k2edge.tasks.detection.Detections` (original
            pixels), or a segmentation or pose model's answer ``detections`` (with masks or keypoints).
        measure: ``max_box_score`` or ``uncertain_boxes`` (with ``band``).
        shares: shares to evaluate (default 0, 0.05, ..., 1).
        iou_type: what mAP measures: ``bbox``, ``segm`` (masks) or ``keypoints`` (OKS with ``sigmas``).

    Raises:
        K2EdgeError: pycocotools is missing.
    """
    import numpy as np

    from ..tasks.coco_eval import coco_answer_results, coco_map, coco_results

    n = len(detections)
    if n == 0 or n != len(dataset.image_ids):
        raise ValueError(f"{n} detection lists for {len(dataset.image_ids)} images")
    shares = [i / 20 for i in range(21)] if shares is None else list(shares)
    conf = np.array([image_confidence(d, measure, band) for d in detections])
    order = np.argsort(conf, kind="stable")
    to_results = coco_results if hasattr(detections[0], "scores") else coco_answer_results
    edge = to_results(dataset.image_ids, detections, dataset.category_ids)
    carried = {"segm": "segmentation", "keypoints": "keypoints"}.get(iou_type)  # what the truth must carry besides its box
    truth: dict[int, list[dict]] = {}
    for a in dataset.ground_truth["annotations"]:
        t = {"image_id": a["image_id"], "category_id": a["category_id"], "bbox": list(a["bbox"]), "score": 1.0}
        if carried and carried in a:
            t[carried] = a[carried]
        truth.setdefault(a["image_id"], []).append(t)
    points = []
    for share in shares:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"shares must be within [0, 1], got {share}")
        k = int(round(share * n))
        sent = {dataset.image_ids[i] for i in order[:k]}
        results = [r for r in edge if r["image_id"] not in sent] + [r for i in sent for r in truth.get(i, [])]
        scores = coco_map(dataset.ground_truth, results, iou_type, sigmas)
        sorted_conf = conf[order]
        if measure != "max_box_score":
            threshold = None
        elif k == n:
            threshold = float(np.nextafter(sorted_conf[-1], np.inf))
        elif k == 0:
            threshold = float(sorted_conf[0])
        else:
            threshold = float(sorted_conf[k]) if sorted_conf[k] > sorted_conf[k - 1] else None
        points.append(DetectionCurvePoint(share, k, threshold, scores["map50"], scores["map"]))
    return points
