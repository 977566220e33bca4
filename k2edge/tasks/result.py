"""What a model found for one sample, as the escalation policy judges it: :class:`LocalResult`
(the engine's result: top-k or detections), and the confidence measures read from it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["DETECTION_MEASURES", "MEASURES", "LocalResult", "confidence"]

MEASURES = ("max_softmax", "margin", "entropy")
DETECTION_MEASURES = ("max_box_score", "uncertain_boxes")

def confidence(probs: Sequence[float], measure: str, num_classes: int | None = None) -> float:
    """Confidence in [0, 1] (higher is surer) of a probability vector, best first or not.

    ``probs`` may be the full softmax or only its top-k; for ``entropy`` on a top-k the missing
    mass is spread evenly over the ``num_classes - k`` classes not shown (the most uncertain
    reading, so a top-k never looks surer than the full vector would).
    """
    if measure not in MEASURES:
        raise ValueError(f"confidence measure must be one of {', '.join(MEASURES)}, got {measure!r}")
    p = sorted((max(0.0, float(x)) for x in probs), reverse=True)
    if not p:
        return 0.0
    if measure == "max_softmax":
        return min(1.0, p[0])
    if measure == "margin":
        return max(0.0, min(1.0, p[0] - (p[1] if len(p) > 1 else 1.0 - p[0])))
    total_classes = max(num_classes or len(p), len(p))
    rest = max(0.0, 1.0 - sum(p))
    unseen = total_classes - len(p)
    if rest > 1e-12 and unseen == 0:
        unseen, total_classes = 1, total_classes + 1
    if total_classes <= 1:
        return 1.0
    h = -sum(x * math.log(x) for x in p if x > 0)
    if unseen and rest > 0:
        q = rest / unseen
        h -= unseen * q * math.log(q)
    return max(0.0, min(1.0, 1.0 - h / math.log(total_classes)))


def _box_only(d: dict) -> dict:
    box = d.get("box")
    if box is None:  # an oriented box: the rectangle around its corners
        from .obb import rbox_bounds

        box = rbox_bounds(d["rbox"])[0].tolist()
    return {k: d[k] for k in ("index", "label", "score") if k in d} | {"box": box}


@dataclass(frozen=True)
class LocalResult:
    """What the edge model answered.

    Attributes:
        top_k: best first, ``{"index", "label", "score"}`` with softmax scores (``Engine.top_k``'s rows);
            empty for a detector.
        probs: the full softmax, when available (exact confidence for every measure).
        num_classes: the model's class count (for entropy on a top-k).
        latency_ms: local inference time, when measured.
        detections: a detector's boxes, ``{"index", "label", "score", "box"}`` in original-image
            pixels (the answer's ``detections``); None for a classifier.
        image_size: (width, height) of the image the boxes refer to, when known.
    """

    top_k: tuple[dict, ...]
    probs: tuple[float, ...] | None = None
    num_classes: int | None = None
    latency_ms: float | None = None
    detections: tuple[dict, ...] | None = None
    image_size: tuple[int, int] | None = None

    @classmethod
    def from_logits(cls, logits, labels: Sequence[str] = (), k: int = 5, latency_ms: float | None = None) -> "LocalResult":
        """From one sample's logits (any shape that flattens to the classes)."""
        import numpy as np

        from .classification import softmax, top_k

        p = softmax(np.asarray(logits).reshape(-1))
        return cls(tuple(top_k(p, labels, k)), tuple(float(x) for x in p), int(p.size), latency_ms)

    @classmethod
    def from_detections(cls, detections, latency_ms: float | None = None,
                        image_size: tuple[int, int] | None = None) -> "LocalResult":
        """From one image's detections (the answer fragment's ``detections`` list, of any box task).

        Each is kept as ``{"index", "label", "score", "box"}``: the escalation measures and the cloud's
        context read boxes only, so an oriented box stands as its axis-aligned bounds, and masks and
        keypoints (large, and no use to either) are left out.
        """
        return cls((), latency_ms=latency_ms, detections=tuple(_box_only(d) for d in detections), image_size=image_size)

    @property
    def summary(self) -> str | None:
        """The top-1 label; for a detector, the boxes found in words."""
        if self.detections is not None:
            found = ", ".join(f"{d['label']} ({float(d['score']):.2f})" for d in self.detections[:10])
            return f"{len(self.detections)} detection(s)" + (f": {found}" if found else "")
        return str(self.top_k[0]["label"]) if self.top_k else None

    def box_scores(self) -> list[float]:
        return [float(d["score"]) for d in self.detections or ()]

    def confidence(self, measure: str) -> float:
        """Confidence in [0, 1] by ``measure``; ``max_box_score`` for a detector (0 when nothing was found).

        Raises:
            ValueError: a classifier measure on a detector's result, or the other way round.
        """
        if (measure in DETECTION_MEASURES) != (self.detections is not None):
            kind = "detector" if self.detections is not None else "classifier"
            raise ValueError(f"confidence measure {measure!r} does not fit a {kind} "
                             f"(detectors: {', '.join(DETECTION_MEASURES)}; classifiers: {', '.join(MEASURES)})")
        if measure == "max_box_score":
            return max(self.box_scores(), default=0.0)
        if measure == "uncertain_boxes":
            raise ValueError("uncertain_boxes is a band, not a confidence: use EscalationSettings.band")
        probs = self.probs if self.probs is not None else [float(r["score"]) for r in self.top_k]
        return confidence(probs, measure, self.num_classes)
