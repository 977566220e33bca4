"""Classifier scores: probabilities from logits (softmax) or as the model gives them, and the top-k
classes with their labels."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["softmax", "probabilities", "top_k"]


def softmax(logits) -> np.ndarray:
    """Row-wise softmax of (N, classes) logits, in float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def probabilities(output, kind: str = "logits") -> np.ndarray:
    """(N, classes) probabilities from a classifier output of N rows.

    Args:
        output: the model output; each row flattens to the classes.
        kind: ``logits`` (softmax applied) or ``probabilities`` (taken as they are, card
            ``[classification] output``).
    """
    rows = np.asarray(output)
    rows = rows.reshape(len(rows), -1) if rows.ndim > 1 else rows.reshape(1, -1)
    if kind == "probabilities":
        return rows.astype(np.float64)
    if kind != "logits":
        raise ValueError(f"classifier output must be 'logits' or 'probabilities', got {kind!r}")
    return softmax(rows)


def top_k(probs, labels: Sequence[str] = (), k: int = 5) -> list[dict]:
    """The ``k`` best classes of one probability row as ``{"index", "label", "score"}``, best first."""
    p = np.asarray(probs).reshape(-1)
    idx = np.argsort(-p, kind="stable")[: max(1, min(k, p.size))]
    return [{"index": int(i), "label": labels[i] if i < len(labels) else str(int(i)), "score": float(p[i])} for i in idx]
