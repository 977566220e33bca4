"""Energy per inference: the board's input power integrated over the work window, per inference."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Sequence

from .base import Sample

__all__ = ["energy_per_inference", "energy_j", "peak_temperature"]


def _power_at(ts: list[float], ps: list[float], t: float) -> float:
    """Piecewise-linear power at ``t``, held constant beyond the first and last sample."""
    if t <= ts[0]:
        return ps[0]
    if t >= ts[-1]:
        return ps[-1]
    i = bisect_right(ts, t)
    t0, t1, p0, p1 = ts[i - 1], ts[i], ps[i - 1], ps[i]
    return p0 if t1 == t0 else p0 + (p1 - p0) * (t - t0) / (t1 - t0)


def energy_j(samples: Sequence[Sample], t0: float, t1: float) -> float | None:
    """Joules drawn on the input rail (``total_power_w``) over ``[t0, t1]`` (trapezoid rule).

    Power between samples is interpolated linearly and held at the nearest sample outside them,
    so a window shorter than the sampling period still gets the power measured around it.
    Returns None when no sample carries power or the window is empty.
    """
    points = sorted((s.t, s.total_power_w) for s in samples if s.total_power_w is not None)
    if not points or t1 <= t0:
        return None
    ts = [p[0] for p in points]
    ps = [p[1] for p in points]
    knots = [t0] + ts[bisect_right(ts, t0):bisect_left(ts, t1)] + [t1]
    values = [_power_at(ts, ps, t) for t in knots]
    return sum((knots[i + 1] - knots[i]) * (values[i] + values[i + 1]) / 2.0 for i in range(len(knots) - 1))


def energy_per_inference(samples: list[Sample], t0: float, t1: float, inferences: int) -> float | None:
    """Joules per inference over the work window ``[t0, t1]`` (sample clock, e.g. ``time.monotonic()``).

    Args:
        samples: readings taken during (and ideally just around) the window.
        t0, t1: the window.
        inferences: how many inferences ran in it.

    Returns:
        J per inference, or None where no power rail exists (no sample has ``total_power_w``),
        the window is empty, or no inference ran.
    """
    if inferences <= 0:
        return None
    e = energy_j(samples, t0, t1)
    return None if e is None else e / inferences


def peak_temperature(samples: Sequence[Sample], t0: float | None = None, t1: float | None = None) -> tuple[str, float] | None:
    """``(sensor, °C)`` of the hottest reading within ``[t0, t1]`` (all samples when unbounded)."""
    best: tuple[str, float] | None = None
    for s in samples:
        if (t0 is not None and s.t < t0) or (t1 is not None and s.t > t1):
            continue
        h = s.hottest
        if h and (best is None or h[1] > best[1]):
            best = h
    return best
