"""The latency / accuracy / energy Pareto front and the recommendation, as pure functions.

Objectives: latency (p50 ms, lower is better), top-1 accuracy (higher is better) and energy per
inference (J, lower is better). Any objective may be unknown (``None``): energy is unknown wherever
no power rail was read.

Dominance. ``a`` dominates ``b`` when, on every objective known for *both* points, ``a`` is at least
as good, and on at least one of them strictly better. An objective missing on either side is left
out of that comparison: a point without an energy reading is compared with the others on latency
and accuracy only (it is neither penalised nor favoured for the missing reading). Two points with
no objective known for both never dominate each other.

Consequences, tested in ``tests/test_sweep.py``:

* duplicates (equal on every known objective) do not dominate each other: both are on the front;
* a tie in one objective is broken by the others (same latency, higher accuracy dominates);
* a single point is the front; points that trade one objective for another are all on it.

With missing values dominance is not transitive, so the front is defined directly: the points that
no other point dominates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

GOALS = ("latency", "accuracy", "energy", "balanced")

# (attribute, sense): +1 higher is better, -1 lower is better.
OBJECTIVES: tuple[tuple[str, int], ...] = (("latency_ms", -1), ("top1", +1), ("energy_j", -1))


@dataclass(frozen=True)
class Point:
    """One measured configuration as the frontier sees it.

    Attributes:
        name: the configuration's name (unique within a sweep).
        latency_ms: p50 latency of one request.
        top1: top-1 accuracy in [0, 1].
        energy_j: energy per inference, None when unknown.
        latency_p99_ms: p99 latency, the value ``max_latency_ms`` constrains (p50 when None).
    """

    name: str
    latency_ms: float | None
    top1: float | None
    energy_j: float | None = None
    latency_p99_ms: float | None = None

    def value(self, objective: str) -> float | None:
        v = getattr(self, objective)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def dominates(a: Point, b: Point) -> bool:
    """True when ``a`` is at least as good as ``b`` on every objective known for both, and better on one."""
    strictly = False
    compared = 0
    for attr, sense in OBJECTIVES:
        va, vb = a.value(attr), b.value(attr)
        if va is None or vb is None:
            continue
        compared += 1
        if sense * va < sense * vb:
            return False
        if sense * va > sense * vb:
            strictly = True
    return compared > 0 and strictly


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """The points no other point dominates, in input order."""
    return [p for i, p in enumerate(points) if not any(dominates(q, p) for j, q in enumerate(points) if j != i)]


@dataclass(frozen=True)
class Recommendation:
    """The configuration chosen for a goal and constraints, or ``name=None`` with the reason.

    Attributes:
        name: the chosen configuration, or None when no configuration qualifies.
        goal: the goal it was chosen for.
        reason: one sentence a person can read: why this one, or why none.
        candidates: the configurations that met the constraints.
        costs: balanced costs of the candidates on the front, in points of accuracy (goal ``balanced`` only).
    """

    name: str | None
    goal: str
    reason: str
    candidates: tuple[str, ...] = ()
    costs: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "goal": self.goal, "reason": self.reason,
                "candidates": list(self.candidates), "costs": dict(self.costs)}


def meets(point: Point, max_latency_ms: float | None = None, min_accuracy: float | None = None) -> bool:
    """Whether ``point`` satisfies the constraints (p99 latency at most ``max_latency_ms``, top-1 at least ``min_accuracy``)."""
    if max_latency_ms is not None:
        tail = point.value("latency_p99_ms")
        tail = point.value("latency_ms") if tail is None else tail
        if tail is None or tail > max_latency_ms:
            return False
    if min_accuracy is not None:
        top1 = point.value("top1")
        if top1 is None or top1 < min_accuracy:
            return False
    return True


LATENCY_PER_POINT = 0.10  # balanced: a point of accuracy given up weighs as much as being 10 % slower


def _counted(points: Sequence[Point], attr: str) -> list[float] | None:
    """The points' values of ``attr`` where the balanced cost counts it: known for every point, and for latency and
    energy (counted as overheads over the least) above 0; else None."""
    values = [p.value(attr) for p in points]
    if any(v is None for v in values) or (attr != "top1" and min(values) <= 0):
        return None
    return values


def balanced_costs(points: Sequence[Point]) -> dict[str, float]:
    """Each point's cost, in points of accuracy (lower is better): the points of accuracy (top-1, or mAP@0.5,
    times 100) it gives up against the most accurate point, plus how much slower it is than the fastest, each
    :data:`LATENCY_PER_POINT` (10 %) slower counting as one point. Where energy is known for every point, its
    overhead over the most frugal point is averaged with latency's. An objective unknown for any point is left out
    for all.

    The exchange rate is explicit so that sizes count: giving up 19 points of accuracy to be 1 % faster costs 19,
    being 1 % slower for them costs 0.1; an even split of the objectives' ranges (min-max rescaling) scored two
    front points 0.5 each whatever their differences.
    """
    if not points:
        return {}
    cost = {p.name: 0.0 for p in points}
    acc = _counted(points, "top1")
    if acc is not None:
        for p, v in zip(points, acc):
            cost[p.name] += 100.0 * (max(acc) - v)
    overheads = []
    for attr in ("latency_ms", "energy_j"):
        values = _counted(points, attr)
        if values is not None:
            overheads.append([v / min(values) - 1.0 for v in values])
    if overheads:
        for i, p in enumerate(points):
            cost[p.name] += sum(o[i] for o in overheads) / len(overheads) / LATENCY_PER_POINT
    return cost


def _fmt_ms(v: float | None) -> str:
    return "unknown" if v is None else f"{v:.3f} ms"


def _fmt_acc(v: float | None) -> str:
    return "unknown" if v is None else f"{100 * v:.2f} %"


def _constraint_text(max_latency_ms: float | None, min_accuracy: float | None, metric: str = "top-1") -> str:
    parts = []
    if max_latency_ms is not None:
        parts.append(f"p99 latency <= {max_latency_ms:g} ms")
    if min_accuracy is not None:
        parts.append(f"{metric} >= {100 * min_accuracy:.2f} %")
    return " and ".join(parts)


def recommend(points: Iterable[Point], goal: str = "balanced", *, max_latency_ms: float | None = None,
              min_accuracy: float | None = None, energy_unknown_reason: str | None = None,
              metric: str = "top-1") -> Recommendation:
    """Pick the configuration for ``goal`` among the points that meet the constraints.

    Goals (ties broken by lower p50 latency, then higher top-1, then name):

    * ``latency``: the lowest p50 latency;
    * ``accuracy``: the highest top-1, then the lowest p50 latency;
    * ``energy``: the lowest energy per inference among the points where it is known; none when it
      is known for no point (``energy_unknown_reason`` says why);
    * ``balanced``: the lowest :func:`balanced_costs` among the candidates on their Pareto front.

    Args:
        points: measured configurations (failed ones left out by the caller).
        goal: one of :data:`GOALS`.
        max_latency_ms: keep points whose p99 latency is at most this.
        min_accuracy: keep points whose top-1 is at least this (a fraction).
        energy_unknown_reason: why energy is unknown, for the message.
        metric: the accuracy axis's name in the messages (``top-1``; ``mAP@0.5`` for detectors).

    Returns:
        A :class:`Recommendation`; ``name`` is None when nothing qualifies.

    Raises:
        ValueError: an unknown goal.
    """
    if goal not in GOALS:
        raise ValueError(f"goal must be one of {', '.join(GOALS)}, got {goal!r}")
    points = list(points)
    constraints = _constraint_text(max_latency_ms, min_accuracy, metric)
    candidates = [p for p in points if meets(p, max_latency_ms, min_accuracy)]
    names = tuple(p.name for p in candidates)
    if not points:
        return Recommendation(None, goal, "no configuration was measured successfully")
    if not candidates:
        return Recommendation(None, goal, f"no configuration meets {constraints}")
    within = f" among the {len(candidates)} meeting {constraints}" if constraints else ""

    def tie_key(p: Point):
        lat, acc = p.value("latency_ms"), p.value("top1")
        return (math.inf if lat is None else lat, -(acc if acc is not None else -math.inf), p.name)

    if goal == "latency":
        known = [p for p in candidates if p.value("latency_ms") is not None]
        if not known:
            return Recommendation(None, goal, "latency is unknown for every candidate", names)
        best = min(known, key=tie_key)
        why = f"lowest p50 latency{within}: {_fmt_ms(best.latency_ms)} ({metric} {_fmt_acc(best.top1)})"
        return Recommendation(best.name, goal, why, names)
    if goal == "accuracy":
        known = [p for p in candidates if p.value("top1") is not None]
        if not known:
            return Recommendation(None, goal, "accuracy is unknown for every candidate", names)
        best = min(known, key=lambda p: (-p.value("top1"),) + tie_key(p))
        why = f"highest {metric}{within}: {_fmt_acc(best.top1)}, the fastest at that accuracy ({_fmt_ms(best.latency_ms)} p50)"
        return Recommendation(best.name, goal, why, names)
    if goal == "energy":
        known = [p for p in candidates if p.value("energy_j") is not None]
        if not known:
            cause = f" ({energy_unknown_reason})" if energy_unknown_reason else ""
            return Recommendation(None, goal, f"energy per inference is unknown for every configuration{cause}; "
                                              "choose --goal latency, accuracy or balanced", names)
        best = min(known, key=lambda p: (p.value("energy_j"),) + tie_key(p))
        unknown = len(candidates) - len(known)
        note = f"; {unknown} configuration(s) without an energy reading were not considered" if unknown else ""
        why = f"lowest energy per inference{within}: {best.energy_j:.4g} J ({_fmt_ms(best.latency_ms)} p50, {metric} {_fmt_acc(best.top1)}){note}"
        return Recommendation(best.name, goal, why, names)
    front = pareto_front(candidates)
    costs = balanced_costs(front)
    best = min(front, key=lambda p: (costs[p.name],) + tie_key(p))
    if len(front) == 1:
        why = (f"the only configuration on the Pareto front{within}, so the balanced choice: "
               f"{_fmt_ms(best.latency_ms)} p50, {metric} {_fmt_acc(best.top1)}")
    else:
        why = f"the lowest balanced cost of the {len(front)} front points{within}: {_balance_text(best, front, metric)}"
    return Recommendation(best.name, goal, why, names, {k: round(v, 4) for k, v in costs.items()})


def _balance_text(best: Point, front: Sequence[Point], metric: str) -> str:
    """What ``best`` gives up on each side, and the exchange rate that weighed them (the objectives
    :func:`balanced_costs` counted, :func:`_counted`)."""
    def used(attr: str) -> bool:
        return _counted(front, attr) is not None

    def overhead(attr: str, unit: str, fmt) -> str:
        low = min(front, key=lambda p: p.value(attr))
        over = 100.0 * (best.value(attr) / low.value(attr) - 1.0)
        least, word = {"latency_ms": ("the fastest", "slower"), "energy_j": ("the most frugal", "more energy")}[attr]
        return fmt(best) + (f" {unit}, {least}" if low is best or over <= 0 else
                            f" {unit}, {over:.1f} % {word} than {low.name}'s {fmt(low)}")

    parts = []
    if used("top1"):
        top = max(front, key=lambda p: p.value("top1"))
        lost = 100.0 * (top.value("top1") - best.value("top1"))
        parts.append(f"{metric} {_fmt_acc(best.top1)}, " + ("the highest" if top is best or lost <= 0 else
                     f"{lost:.2f} point(s) below {top.name}'s {_fmt_acc(top.top1)}"))
    if used("latency_ms"):
        parts.append(overhead("latency_ms", "p50", lambda p: _fmt_ms(p.latency_ms)))
    if used("energy_j"):
        parts.append(overhead("energy_j", "per inference", lambda p: f"{p.energy_j:.4g} J"))
    if not parts:
        return "no objective is known for every front point, so the faster and more accurate tie-break decided"
    rate = f"a point of {metric} weighs as much as {100 * LATENCY_PER_POINT:.0f} % of latency"
    return "; ".join(parts) + (f" ({rate} and energy, averaged)" if used("energy_j") and used("latency_ms") else f" ({rate})")
