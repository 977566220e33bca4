"""K2's verdict on a stream event, parsed strictly: a verdict or a reason why not, never a guess.

With ``verify = true`` K2 is asked for exactly ``{"verdict": "confirmed" | "rejected" | "relabelled",
"label": str, "description": str}``. An answer that is not that object (not JSON, prose around it,
another verdict, a missing or mistyped key, ``relabelled`` without a label) is a :class:`VerdictError`
naming what is wrong; the caller reports it as a failed escalation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["Verdict", "VerdictError", "VERDICTS", "VERDICT_INSTRUCTIONS", "parse_verdict"]

VERDICTS = ("confirmed", "rejected", "relabelled")
VERDICT_INSTRUCTIONS = (
    'Answer with one JSON object only: {"verdict": "confirmed" | "rejected" | "relabelled", "label": "<the object\'s '
    'label>", "description": "<one short sentence>"}. "confirmed": the detector\'s label is right; "rejected": there is '
    'no such object (a false detection); "relabelled": it is an object of another label, given in "label".')


class VerdictError(ValueError):
    """The answer is not a verdict object; the message says why."""


@dataclass(frozen=True, slots=True)
class Verdict:
    verdict: str
    label: str | None
    description: str


def parse_verdict(text: str) -> Verdict:
    """Parse K2's answer as a verdict object.

    Raises:
        VerdictError: not JSON, not an object, unknown keys or verdict, wrong types, or ``relabelled``
            without a label.
    """
    try:
        data = json.loads(text)
    except (TypeError, ValueError) as exc:
        snippet = (text or "")[:80]
        raise VerdictError(f"the answer is not JSON ({exc.__class__.__name__} at {getattr(exc, 'pos', '?')}): "
                           f"{snippet!r}") from None
    if not isinstance(data, dict):
        raise VerdictError(f"the answer is JSON but not an object: {type(data).__name__}")
    extra = sorted(set(data) - {"verdict", "label", "description"})
    if extra:
        raise VerdictError(f"unexpected key(s) {extra}; a verdict has verdict, label, description")
    verdict = data.get("verdict")
    if verdict not in VERDICTS:
        raise VerdictError(f"verdict must be one of {list(VERDICTS)}, got {verdict!r}")
    label = data.get("label")
    if label is not None and not isinstance(label, str):
        raise VerdictError(f"label must be a string, got {type(label).__name__}")
    if verdict == "relabelled" and not (label or "").strip():
        raise VerdictError("verdict relabelled needs the new label")
    description = data.get("description")
    if not isinstance(description, str):
        raise VerdictError(f"description must be a string, got {type(description).__name__}")
    return Verdict(verdict, label, description)
