"""Which rule of a stream's ``[[streams.escalation]]`` an event falls under (pure; first match wins).

An event (``{"event", "label", "zone" | "line", "direction", ...}``, as :class:`~k2edge.streams.stream.Stream`
raises it) and its track's figures (:class:`TrackStats`) in, the matching rule's index out, with the
prompt it renders. Decisions as data: tests and ``k2edge watch`` read the same :class:`Selection`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..config.stream_escalation import EscalationRule

__all__ = ["Selection", "TrackStats", "label_warnings", "render_prompt", "select"]


@dataclass(frozen=True, slots=True)
class TrackStats:
    """A track's detection scores so far: how many, their mean, the best and the frame it was seen in."""

    frames: int
    mean: float
    best: float
    best_frame: int | None = None

    def measure(self, which: str) -> float:
        return self.best if which == "best" else self.mean


@dataclass(frozen=True, slots=True)
class Selection:
    """The rule an event falls under: its index in the stream's rules, the rule, the prompt, and why."""

    index: int
    rule: EscalationRule
    prompt: str
    reason: str


def label_warnings(rules: Sequence[EscalationRule], labels: Sequence[str]) -> list[str]:
    """One line per rule that names a label the model lacks (such a rule can never fire); none without labels."""
    known = set(labels)
    if not known:
        return []
    shown = ", ".join(repr(x) for x in labels[:12]) + (", ..." if len(labels) > 12 else "")
    out = []
    for i, rule in enumerate(rules):
        unknown = [x for x in rule.labels if x not in known]
        if unknown:
            out.append(f"escalation.{i}.labels: {', '.join(repr(x) for x in unknown)} not among the model's "
                       f"{len(labels)} labels ({shown}): the rule can never fire for {'it' if len(unknown) == 1 else 'them'}")
    return out


def render_prompt(template: str, event: dict, stream: str) -> str:
    """The template with the event's values (a placeholder the event lacks becomes ``-``)."""
    values = {k: ("-" if event.get(k) is None else str(event.get(k))) for k in ("label", "zone", "line", "direction")}
    return template.format(stream=stream, **values)


def _matches(rule: EscalationRule, event: dict, stats: TrackStats | None) -> str | None:
    if event.get("event") != rule.on:
        return None
    if rule.zone is not None and event.get("zone") != rule.zone:
        return None
    if rule.line is not None and event.get("line") != rule.line:
        return None
    if rule.labels and event.get("label") not in rule.labels:
        return None
    if rule.when == "always":
        return "always"
    if stats is None:  # low confidence needs the track's scores; without them nothing is judged low
        return None
    score = stats.measure(rule.measure)
    if score < rule.threshold:
        return f"low_confidence: {rule.measure} score {score:.3f} below {rule.threshold:g}"
    return None


def select(rules: Sequence[EscalationRule], event: dict, stats: TrackStats | None, stream: str = "") -> Selection | None:
    """The first rule of ``rules`` that ``event`` matches, or None.

    Args:
        rules: the stream's rules, in order.
        event: the event as raised (its ``event`` kind, ``label``, ``zone`` / ``line``, ``direction``).
        stats: the event's track's scores up to the event; None when unknown (a ``low_confidence`` rule
            then does not match).
        stream: the stream's name, for the prompt's ``{stream}``.
    """
    for i, rule in enumerate(rules):
        why = _matches(rule, event, stats)
        if why is not None:
            return Selection(i, rule, render_prompt(rule.prompt, event, stream), why)
    return None
