"""Reconnect delays: one jittered exponential backoff for the broker connection and the video sources."""

from __future__ import annotations

import random

__all__ = ["backoff"]


def backoff(attempt: int, lo: float, hi: float, rng=random.random) -> float:
    """Full-jitter exponential backoff: uniform in [lo, min(hi, lo * 2**attempt)]."""
    cap = min(hi, lo * (2 ** min(attempt, 30)))
    return lo + (cap - lo) * rng()
