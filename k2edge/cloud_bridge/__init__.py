"""Cloud offload to the full Kimi K2 server: escalation policy, K2 client, circuit breaker,
request budget, durable outbox, and the :class:`CloudBridge` facade the daemon calls.

How the daemon uses it (from a worker thread, never the MQTT network thread)::

    from k2edge.cloud_bridge import (BridgeRequest, CloudBridge, CloudSettings, EscalationPolicy,
                                     EscalationSettings, LocalResult)

    bridge = CloudBridge(CloudSettings(base_url=..., model="kimi-k2.5", api_key_credential="k2"),
                         state_dir="/var/lib/k2edge",
                         policy=EscalationPolicy({"digits": EscalationSettings(threshold=0.9, warm_profile="c4")}),
                         thermal_state=lambda: sampler.state)          # a ThermalSampler's GovernorState
    # per request (local may be a LocalResult, a zero-arg callable computing it, or None = no edge model):
    outcome = bridge.handle(
        BridgeRequest(id=rid, model="digits", prompt=text, image=jpeg, allow_cloud=True, deferrable=False,
                      response_topic=topic, correlation_data=corr, response=partial_response),
        lambda: LocalResult.from_logits(engine.infer(feeds)["logits"][0], engine.labels, k=top_k),
        deadline_s=deadline_ms / 1000)
    # outcome.source "edge" | "cloud", .text, .latency_ms, .reason, .degraded, .error_code,
    # .deferred, .decision.confidence, .local (the LocalResult, for top-k)

    # deferred rows: the outbox's loop, each row delivered by the bridge and rendered by the caller
    threading.Thread(target=bridge.outbox.deliver_pending, daemon=True,
                     args=(lambda item: bridge.deliver_item(item, publish, render), stop_event)).start()
    status["cloud"] = bridge.status()      # breaker, budget, outbox depth, last error, counters

What the outcomes mean:

* escalated and answered: ``source="cloud"``, the cloud's text, its latency and the reason;
* cloud wanted but down, rate-limited, out of budget, or too slow for the deadline: the local
  answer (top-1 label) with ``degraded=True`` and the reason;
* ``error_code`` set when there is nothing to answer with: ``busy`` (thermal critical and the
  cloud not possible), ``unknown_model`` (no edge model, cloud forbidden), ``cloud_unavailable``
  or ``deadline_exceeded`` (no edge model and the cloud failed);
* ``deferred=True``: a deferrable request whose cloud answer could not be had now waits in the
  outbox (``state_dir/outbox.sqlite3``); ``deliver_item`` asks the cloud later and publishes
  the answer once to the request's response topic with its correlation data (the payload is
  what the caller's ``render`` builds from the row and the cloud's answer; the daemon's is
  :meth:`k2edge.service.escalation.Escalation.render`). The immediate outcome still carries the
  local answer when there is one (``degraded``), so the daemon may publish it as an interim
  ``status: "deferred"`` response.

Pure pieces, usable alone: :func:`decide` / :class:`EscalationPolicy` (rules in
:mod:`k2edge.cloud_bridge.policy`), :func:`escalation_curve`, :class:`CircuitBreaker`,
:class:`RequestBudget`, :class:`Outbox`. Heavy dependencies (``openai``, ``httpx2``, Pillow, numpy)
are imported only when used.
"""

from __future__ import annotations

from .breaker import CircuitBreaker
from .bridge import BridgeRequest, CloudBridge, Outcome
from .budget import RequestBudget
from .client import CloudAnswer, K2Client, build_text
from .curve import CurvePoint, escalation_curve
from .errors import (
    BreakerOpen,
    CloudAuthError,
    CloudConfigError,
    CloudError,
    CloudQuotaError,
    CloudRateLimited,
    CloudRejected,
    CloudTimeout,
    CloudUnavailable,
    OutboxError,
)
from .image import PreparedImage, prepare_image
from .outbox import Outbox, OutboxItem, Postpone
from .policy import CloudHealth, Decision, EscalationPolicy, EscalationRequest, decide
from ..tasks.result import LocalResult, confidence
from ..config.cloud import CloudSettings, EscalationSettings
from .apikey import resolve_api_key

__all__ = [
    "CloudBridge", "BridgeRequest", "Outcome",
    "CloudSettings", "EscalationSettings", "resolve_api_key",
    "EscalationPolicy", "EscalationRequest", "LocalResult", "CloudHealth", "Decision", "decide", "confidence",
    "K2Client", "CloudAnswer", "build_text", "prepare_image", "PreparedImage",
    "CircuitBreaker", "RequestBudget", "Outbox", "OutboxItem", "Postpone",
    "escalation_curve", "CurvePoint",
    "CloudError", "CloudConfigError", "CloudUnavailable", "CloudTimeout", "CloudRateLimited", "CloudQuotaError",
    "CloudAuthError", "CloudRejected", "BreakerOpen", "OutboxError",
]
