"""Classifier scores: softmax over logits and the top-k classes with their labels."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def softmax(logits) -> np.ndarray:
    """Row-wise softmax of (N, classes) logits, in float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def top_k(probs, labels: Sequence[str] = (), k: int = 5) -> list[dict]:
    """The ``k`` best classes of one probability row as ``{"index", "label", "score"}``, best first."""
    p = np.asarray(probs).reshape(-1)
    idx = np.argsort(-p, kind="stable")[: max(1, min(k, p.size))]
    return [{"index": int(i), "label": labels[i] if i < len(labels) else str(int(i)), "score": float(p[i])} for i in idx]
