"""The escalation policy: a pure function of (request, local result, thermal state, cloud health,
budget) -> :class:`Decision`. Nothing here does I/O; the bridge carries decisions out.

Rules, in order (first match wins):

1. **No edge model** for the request -> cloud.
2. **critical** -> cloud when offloadable; otherwise refused (``busy``): no new local work.
3. **hot** -> every offloadable request goes to the cloud.
4. **A text prompt** (with ``prompts = "cloud"``, the default) needs language understanding the
   edge has no model for -> cloud, with the edge's top-k as context.
5. **Confidence** (``max_softmax`` | ``margin`` | ``entropy``, per model) below the model's
   threshold -> cloud. In **warm** the bar is ``warm_threshold`` (default halfway from the
   threshold to 1), so low-confidence requests escalate sooner; otherwise -> local.
   Detectors: ``max_box_score`` (the best box's score, 0 when nothing was found) below the
   threshold -> cloud; ``uncertain_boxes``: any box scoring within [low, high) -> cloud, the band
   widened in **warm** (low halfway to 0, high halfway to 1).

Then the guards: ``allow_cloud: false`` is always respected (the request is answered locally,
or refused when there is nothing local to answer with); when the cloud is unavailable (breaker
open, no budget left this minute) the local answer goes back with ``degraded: true`` and the
reason, and a deferrable request is also marked for the outbox. (Switching a model to its
DLA-heavier ``warm_profile`` in warm and hot is the thermal governor's transition, not a decision.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, Mapping

from ..config.cloud import EscalationSettings
from ..tasks.result import LocalResult

__all__ = [
    "EscalationPolicy",
    "EscalationRequest",
    "CloudHealth",
    "Decision",
    "decide",
    "reason_kind",
]

Action = Literal["local", "cloud", "refuse"]


@dataclass(frozen=True)
class EscalationRequest:
    """The parts of a request the policy looks at.

    Attributes:
        model: the edge model asked for.
        prompt: the user's text, if any.
        allow_cloud: the request's say; None takes the model's default.
        deferrable: the requester accepts a late answer (outbox) when the cloud is down.
        has_local_model: False when the edge has no model for it.
    """

    model: str | None = None
    prompt: str | None = None
    allow_cloud: bool | None = None
    deferrable: bool = False
    has_local_model: bool = True


@dataclass(frozen=True)
class CloudHealth:
    """Whether a cloud call can be made now (breaker closed or probing, endpoint configured)."""

    available: bool = True
    reason: str = ""


@dataclass(frozen=True)
class Decision:
    """What to do with one request, and why.

    Attributes:
        action: ``local`` (answer on the edge), ``cloud`` (ask K2), ``refuse`` (answer an error).
        reason: one sentence for the response's escalation reason and the logs.
        degraded: the answer is worse than the policy wanted (it wanted the cloud and cannot have it).
        escalate: the policy wanted the cloud (counted in the escalation rate).
        defer: wanted the cloud, cannot have it now, and the request is deferrable: the bridge
            puts it in the outbox for a later cloud answer.
        provisional: made without the local result (not computed yet); run locally, then decide again.
        confidence / threshold / measure: the numbers judged, when confidence decided.
        thermal_state: the governor's state used.
        error_code: for ``refuse``: ``busy`` (thermal critical), ``unknown_model``, ``cloud_unavailable``.
    """

    action: Action
    reason: str
    degraded: bool = False
    escalate: bool = False
    defer: bool = False
    provisional: bool = False
    confidence: float | None = None
    threshold: float | None = None
    measure: str | None = None
    thermal_state: str = "unknown"
    error_code: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def decide(request: EscalationRequest, local: LocalResult | None, thermal_state, cloud_health: CloudHealth | None = None,
           budget_left: int | None = None, settings: EscalationSettings | None = None) -> Decision:
    """The policy (see the module docstring for the rules).

    Args:
        request: what was asked.
        local: the edge's answer, or None when not computed (yet) or there is no edge model.
        thermal_state: a state name or a ``GovernorState``.
        cloud_health: whether a call can be made now; None = available.
        budget_left: cloud requests left in this minute; None = unlimited.
        settings: the model's escalation settings.
    """
    s = settings or EscalationSettings()
    health = cloud_health or CloudHealth()
    state = getattr(thermal_state, "state", thermal_state) or "unknown"
    thermal_reason = getattr(thermal_state, "reason", "")
    allow = s.allow_cloud if request.allow_cloud is None else request.allow_cloud
    if not health.available:
        cloud_ok, cloud_why = False, health.reason or "the cloud is unavailable"
    elif budget_left is not None and budget_left <= 0:
        cloud_ok, cloud_why = False, "the cloud request budget for this minute is spent"
    else:
        cloud_ok, cloud_why = True, ""
    base = {"thermal_state": state}
    thermal_note = f" ({thermal_reason})" if thermal_reason else ""

    conf = thr = None
    measure = None
    asked = False  # a prompt only the cloud can answer
    if not request.has_local_model:
        why = f"no edge model for this request{f' ({request.model})' if request.model else ''}"
    elif state == "critical":
        why = f"thermal state critical{thermal_note}: no new local work"
    elif state == "hot":
        why = f"thermal state hot{thermal_note}: every offloadable request goes to the cloud"
    elif request.prompt and request.prompt.strip() and s.prompts == "cloud":
        why = "the prompt needs language understanding the edge has no model for"
        asked = True
    elif local is None:
        return Decision("local", "run the edge model, then judge its confidence", provisional=True, **base)
    elif s.measure == "uncertain_boxes":
        measure = s.measure
        warm = state == "warm"
        low, high = s.band(warm)
        band = f"{'warm ' if warm else ''}band [{low:.3f}, {high:.3f})"
        local.confidence("max_box_score")  # refuses a classifier's result with a clear message
        unsure = [x for x in local.box_scores() if low <= x < high]
        conf = max(local.box_scores(), default=0.0)
        if not unsure:
            return Decision("local", f"no box scores within the {band}", confidence=conf, measure=measure, **base)
        why = f"{len(unsure)} box(es) score within the {band}"
    else:
        measure = s.measure
        conf = local.confidence(measure)
        thr = s.effective_warm_threshold if state == "warm" else s.threshold
        shown_conf, shown_thr = _shown(conf, thr)
        bar = f"{'warm ' if state == 'warm' else ''}threshold {shown_thr}"
        numbers = {"confidence": conf, "threshold": thr, "measure": measure}
        if conf >= thr:
            return Decision("local", f"confidence {shown_conf} ({measure}) >= {bar}", **numbers, **base)
        why = f"confidence {shown_conf} ({measure}) < {bar}"
    numbers = {"confidence": conf, "threshold": thr, "measure": measure}
    no_local_work = not request.has_local_model or state == "critical"

    if not allow:
        if not request.has_local_model:
            return Decision("refuse", f"{why}, and the request forbids the cloud (allow_cloud false)", escalate=True,
                            error_code="unknown_model", **numbers, **base)
        if state == "critical":
            return Decision("refuse", f"{why}, and the request forbids the cloud (allow_cloud false); "
                            "retry when the device has cooled", escalate=True, error_code="busy", **numbers, **base)
        # a prompt forbidden the cloud goes unanswered: degraded, so the answer says so (and is not an escalation)
        return Decision("local", f"{why}, but the request forbids the cloud (allow_cloud false)", degraded=asked,
                        escalate=asked, **numbers, **base)
    if cloud_ok:
        return Decision("cloud", why, escalate=True, **numbers, **base)
    if request.deferrable:
        return Decision("local" if not no_local_work else "cloud", f"{why}; {cloud_why}: deferred to the outbox",
                        degraded=True, escalate=True, defer=True, **numbers, **base)
    if no_local_work:
        code = "cloud_unavailable" if not request.has_local_model else "busy"
        return Decision("refuse", f"{why}, and {cloud_why}", escalate=True, error_code=code, **numbers, **base)
    return Decision("local", f"{why}; {cloud_why}: answered locally", degraded=True, escalate=True, **numbers, **base)


def _shown(confidence: float, threshold: float) -> tuple[str, str]:
    """A confidence and its threshold as a reason prints them: three decimals, more where the threshold has more
    (0.9999, not 1.000) or where the two would otherwise read the same (up to six)."""
    for places in range(3, 7):
        c, t = f"{confidence:.{places}f}", f"{threshold:.{places}f}"
        if abs(float(t) - threshold) < 1e-12 and (c != t or confidence == threshold):
            break
    return c, t


def reason_kind(reason: str | None) -> str:
    """What an escalation reason written by :func:`decide` is about, as a closed set for metrics
    labels: ``no_edge_model``, ``thermal``, ``prompt``, ``low_confidence`` or ``other``."""
    text = reason or ""
    if text.startswith("no edge model"):
        return "no_edge_model"
    if text.startswith("thermal state"):
        return "thermal"
    if text.startswith("the prompt"):
        return "prompt"
    if text.startswith("confidence") or " score within the " in text:
        return "low_confidence"
    return "other"


@dataclass
class EscalationPolicy:
    """Per-model escalation settings and :func:`decide` bound to them.

    Args:
        models: model name -> settings.
        default: for models not listed.
    """

    models: Mapping[str, EscalationSettings] = field(default_factory=dict)
    default: EscalationSettings = field(default_factory=EscalationSettings)

    def settings_for(self, model: str | None) -> EscalationSettings:
        return self.models.get(model, self.default) if model is not None else self.default

    def decide(self, request: EscalationRequest, local: LocalResult | None, thermal_state,
               cloud_health: CloudHealth | None = None, budget_left: int | None = None) -> Decision:
        return decide(request, local, thermal_state, cloud_health, budget_left, self.settings_for(request.model))
