"""``[[streams.escalation]]``: which of a stream's events K2 is asked about, with what, and how.

Rules are tried in order and the first that matches an event wins (:func:`k2edge.streams.escalation_rules.select`).
A rule names the event kind (``on``), optionally the zone or line and the labels it applies to, and
``when``: ``always``, or ``low_confidence`` when the track's score by ``measure`` (``mean``, the
default: the mean score of the track's detections so far; ``best``: its best one) is below
``threshold``. What goes to K2 is the ``prompt`` (a template over ``{label}``, ``{zone}``, ``{line}``,
``{direction}``, ``{stream}``) with ``images``: ``crop`` (the event's box, cut from its frame),
``frame`` (the whole frame), or ``track`` (up to ``count`` crops of the track: its best, then its
most recent). Every image is downscaled to ``[cloud] image_max_side`` before it is sent.
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .tables import Strict as _Strict

__all__ = ["EscalationRule", "PLACEHOLDERS", "MAX_TRACK_IMAGES"]

PLACEHOLDERS = ("label", "zone", "line", "direction", "stream")
MAX_TRACK_IMAGES = 8  # images = "track": the most crops of one track sent in one request
DEFAULT_PROMPT = "The on-device detector saw a {label} ({stream}). Describe it in one short sentence."


class EscalationRule(_Strict):
    """One rule of ``[[streams.escalation]]`` (see the module docstring)."""

    on: Literal["line_cross", "zone_enter", "zone_leave", "track_end"]
    zone: str | None = Field(None, description="zone_enter / zone_leave: only this zone")
    line: str | None = Field(None, description="line_cross: only this line")
    labels: tuple[str, ...] = Field((), description="only tracks with these labels (the model's: one it lacks is "
                                                    "a warning in the stream's status); empty: every label")
    when: Literal["always", "low_confidence"] = "always"
    threshold: float | None = Field(None, gt=0, le=1, description="low_confidence: escalate when the track's score "
                                    "by measure is below this")
    measure: Literal["mean", "best"] = Field("mean", description="low_confidence: the track's mean detection score so "
                                             "far, or its best")
    prompt: str = DEFAULT_PROMPT
    images: Literal["crop", "frame", "track"] = Field("crop", description="crop: the event's box; frame: the whole "
                                                      "frame; track: up to count crops of the track")
    count: int = Field(1, ge=1, le=MAX_TRACK_IMAGES, description="images = \"track\": how many crops at most")
    verify: bool = Field(False, description="ask K2 for a verdict JSON (confirmed | rejected | relabelled) instead of "
                         "a free-text description")

    @field_validator("prompt")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            names = [name for _, name, spec, conv in string.Formatter().parse(v) if name is not None]
        except ValueError as exc:
            raise ValueError(f"not a valid template ({exc}); write a literal brace as {{{{ or }}}}") from None
        unknown = sorted({n for n in names if n not in PLACEHOLDERS})
        if unknown or "" in names:
            bad = unknown or ["{}"]
            raise ValueError(f"unknown placeholder(s) {bad}; a prompt may use {{{'}, {'.join(PLACEHOLDERS)}}}")
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.zone is not None and self.on not in ("zone_enter", "zone_leave"):
            raise ValueError(f"zone is for zone_enter / zone_leave rules, not on = {self.on!r}")
        if self.line is not None and self.on != "line_cross":
            raise ValueError(f"line is for line_cross rules, not on = {self.on!r}")
        if self.when == "low_confidence" and self.threshold is None:
            raise ValueError("when = \"low_confidence\" needs a threshold")
        if self.when == "always" and self.threshold is not None:
            raise ValueError("threshold is for when = \"low_confidence\"")
        if self.images == "frame" and self.on == "track_end":
            raise ValueError("a track_end has no frame of its own (the track is gone): use images = \"crop\" (its best "
                             "crop) or \"track\"")
        if self.count > 1 and self.images != "track":
            raise ValueError("count is for images = \"track\"")
        return self

    @property
    def keeps_crops(self) -> int:
        """How many crops of each track this rule needs kept while the track lives (0: none)."""
        if self.images == "track":
            return self.count
        return 1 if self.on in ("track_end", "zone_leave") else 0  # the track may be gone: its best crop stands in
