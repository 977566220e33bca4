"""The escalation-rate vs accuracy curve: how much accuracy each share of traffic sent to the
cloud buys, assuming the cloud answers every escalated request correctly.

Requests escalate least confident first (by the chosen measure), which is what a confidence
threshold does; each point gives the threshold that produces it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from .policy import MEASURES, confidence

__all__ = ["CurvePoint", "escalation_curve", "confidences"]


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
