"""The facade the daemon calls from a worker thread: policy + budget + breaker + client + outbox."""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Union

from .breaker import CircuitBreaker
from .budget import RequestBudget, Spend
from .client import NOTHING_TO_ASK, CloudAnswer, K2Client
from .errors import BreakerOpen, CallNotStarted, CloudError, CloudRejected, CloudTimeout
from .image import prepare_image
from .outbox import Outbox, OutboxItem, Postpone
from .policy import CloudHealth, Decision, EscalationPolicy, EscalationRequest
from ..tasks.result import LocalResult
from .retry import scrub
from ..config.cloud import CloudSettings

log = logging.getLogger(__name__)

__all__ = ["CloudBridge", "BridgeRequest", "Outcome", "LocalSource", "Publish", "Render", "outbox_key"]

LocalSource = Union[LocalResult, Callable[[], LocalResult], None]
Publish = Callable[[str, Union[bytes, None], dict], None]
Render = Callable[[OutboxItem, Union[CloudAnswer, CloudError]], dict]
# a cloud whose median round trip is longer than a request has left is not asked -- except once this often, so that
# a cloud quick again is found (its quick answer then clears the record of the slow ones)
LATENCY_PROBE_S = 10.0
SLOT_POLL_S = 0.1  # a request waiting for a concurrency slot looks this often whether the daemon began to stop


@dataclass(frozen=True)
class BridgeRequest:
    """One request as the bridge sees it.

    Attributes:
        id: the request id (the outbox's key).
        model: the edge model asked for.
        prompt: the user's text.
        image: the raw image bytes (JPEG/PNG/...), if the input is an image.
        mime: its declared content type (the bytes are sniffed anyway).
        allow_cloud: the request's say (None: the model's default).
        deferrable: a late answer is acceptable: when the cloud is down it waits in the outbox.
        response_topic / correlation_data: where a deferred answer goes (MQTT 5 request/response).
        response: the response the daemon would publish for it (id, model, top-k, ...); on deferred
            delivery the default renderer completes it with the cloud's fields.
    """

    id: str
    model: str | None = None
    prompt: str | None = None
    image: bytes | None = None
    mime: str | None = None
    allow_cloud: bool | None = None
    deferrable: bool = False
    response_topic: str | None = None
    correlation_data: bytes | None = None
    response: dict | None = None


@dataclass(frozen=True)
class Outcome:
    """What became of a request.

    Attributes:
        source: ``cloud`` when K2 answered (or will, when deferred with no local answer), else ``edge``.
        text: the cloud's answer, or the local top-1 label; None on refusal.
        latency_ms: the cloud's round trip when it answered; otherwise the time spent in the bridge.
        reason: the escalation reason (why it went where it went, and what failed).
        degraded: the policy wanted the cloud and the answer is local (or missing) instead.
        error_code: set when no answer can be given: ``busy`` (thermal critical),
            ``unknown_model``, ``cloud_unavailable``, ``deadline_exceeded``.
        deferred: the request waits in the outbox; its cloud answer is delivered later to its response topic.
        escalated: the policy wanted the cloud.
        cloud_model / attempts: who answered, HTTP attempts made.
        cloud_input: what K2 was given with the text: ``image``, or ``text`` (the edge's findings
            only: ``[cloud] vision = "off"``, or the server refused image content); None when not asked.
        decision: the policy's decision (confidence, threshold, thermal state).
        local: the local result used (computed here when the daemon passed a callable).
    """

    source: Literal["edge", "cloud"]
    text: str | None
    latency_ms: float
    reason: str
    degraded: bool = False
    error_code: str | None = None
    deferred: bool = False
    escalated: bool = False
    cloud_model: str | None = None
    attempts: int = 0
    cloud_input: str | None = None
    decision: Decision | None = None
    local: LocalResult | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.error_code is None

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("source", "text", "latency_ms", "reason", "degraded", "error_code", "deferred",
                                          "escalated", "cloud_model", "attempts", "cloud_input")}
        d["decision"] = self.decision.to_dict() if self.decision else None
        return d


class CloudBridge:
    """Escalation to the K2 server for the daemon's worker threads.

    Args:
        settings: the K2 endpoint.
        state_dir: where the outbox database lives (``outbox.sqlite3``) unless ``settings.outbox_path`` says.
        policy: per-model escalation settings.
        thermal_state: a callable returning the governor's current state (``lambda: sampler.state``);
            None = ``unknown`` (behaves like normal).
        client / outbox: injected for tests; built from ``settings`` otherwise.
        clock: monotonic seconds.

    Raises:
        CloudConfigError: the API key source is missing or empty.
        OutboxError: the outbox cannot be opened.
    """

    def __init__(self, settings: CloudSettings, state_dir: str | os.PathLike, *, policy: EscalationPolicy | None = None,
                 thermal_state: Callable[[], object] | None = None, client: K2Client | None = None,
                 outbox: Outbox | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.policy = policy or EscalationPolicy()
        self._thermal = thermal_state
        self._clock = clock
        self.client = client or K2Client(settings, breaker=CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown_s, clock))
        self.breaker = self.client.breaker
        self.budget = RequestBudget(settings.requests_per_minute, clock)
        self.outbox = outbox or Outbox(settings.outbox_path or Path(state_dir))
        self._slots = threading.BoundedSemaphore(settings.concurrency)
        self.slots = self._slots  # the concurrency slots, shared with the streams' escalations
        self.closing = threading.Event()  # set as the daemon stops: a call not started by then is not started
        self._lock = threading.Lock()
        self._counts = {k: 0 for k in ("requests", "escalated", "cloud_answers", "cloud_unanswered", "degraded", "deferred",
                                       "refused", "delivered")}
        self._latencies: deque[float] = deque(maxlen=500)
        self._probed: float | None = None  # when a cloud judged too slow for a request was last asked anyway
        self.last_error: str | None = None

    # the request path --------------------------------------------------------------------------
    def cloud_health(self) -> CloudHealth:
        if not self.settings.model:
            return CloudHealth(False, "no cloud model is configured")
        if self.breaker.state == "open":
            return CloudHealth(False, f"the cloud circuit breaker is open (last error: {self.breaker.last_error or 'unknown'}; "
                                      f"next probe in {self.breaker.retry_in_s():.0f} s)")
        return CloudHealth(True)

    def handle(self, req: BridgeRequest, local: LocalSource, deadline_s: float, thermal_state=None) -> Outcome:
        """Decide and carry out one request. Call from a worker thread (it may block up to ``deadline_s``).

        Args:
            req: the request.
            local: the edge's result; a zero-argument callable that computes it (run only if
                needed, so hot/critical states skip local work); None when the edge has no model.
            deadline_s: seconds from now by which the answer must be ready.
            thermal_state: overrides the ``thermal_state`` provider for this call.
        """
        start = self._clock()
        end = start + deadline_s
        state = thermal_state if thermal_state is not None else (self._thermal() if self._thermal else "unknown")
        lazy = local is not None and not isinstance(local, LocalResult)
        computed = None if lazy else local
        ereq = EscalationRequest(req.model, req.prompt, req.allow_cloud, req.deferrable, has_local_model=local is not None)
        d = self.policy.decide(ereq, computed, state, self.cloud_health(), self.budget.remaining())
        if d.provisional:
            computed = local()
            d = self.policy.decide(ereq, computed, state, self.cloud_health(), self.budget.remaining())
        self._count("requests")
        if d.escalate:
            self._count("escalated")
        outcome = self._carry_out(req, d, computed, local if lazy else None, start, end)
        for flag, name in ((outcome.degraded, "degraded"), (outcome.deferred, "deferred"), (outcome.error_code, "refused")):
            if flag:
                self._count(name)
        return outcome

    def carry_out(self, req: BridgeRequest, decision: Decision, local: LocalSource, deadline_s: float) -> Outcome:
        """Carry out a decision made by the caller's own call of the policy (the daemon decides once,
        in its request path). Blocks up to ``deadline_s`` when the decision asks the cloud.

        ``local``: the edge's result, a callable computing it (run only for a local fallback), or None.
        """
        start = self._clock()
        self._count("requests")
        if decision.escalate:
            self._count("escalated")
        lazy = local is not None and not isinstance(local, LocalResult)
        outcome = self._carry_out(req, decision, None if lazy else local, local if lazy else None, start,
                                  start + max(0.0, deadline_s))
        for flag, name in ((outcome.degraded, "degraded"), (outcome.deferred, "deferred"), (outcome.error_code, "refused")):
            if flag:
                self._count(name)
        return outcome

    def _carry_out(self, req: BridgeRequest, d: Decision, computed: LocalResult | None,
                   thunk: Callable[[], LocalResult] | None, start: float, end: float) -> Outcome:
        elapsed = lambda: (self._clock() - start) * 1e3  # noqa: E731
        if d.action == "refuse":
            return Outcome("edge", None, elapsed(), d.reason, d.degraded, d.error_code, escalated=d.escalate, decision=d,
                           local=computed)
        if d.action == "local":
            computed = computed if computed is not None else thunk()
            deferred = d.defer and self._defer(req, d, computed)
            reason = d.reason if deferred or not d.defer else d.reason.replace("deferred to the outbox", "answered locally")
            return Outcome("edge", computed.summary, elapsed(), reason, d.degraded, deferred=deferred, escalated=d.escalate,
                           decision=d, local=computed)
        if d.defer:  # wants the cloud, none now, and no local work allowed
            if self._defer(req, d, computed):
                return Outcome("cloud", None, elapsed(), d.reason, True, deferred=True, escalated=True, decision=d)
            return Outcome("edge", None, elapsed(), d.reason, True, self._no_local_code(d, None), escalated=True, decision=d)

        if computed is None and self.client.nothing_to_ask(req.image, req.prompt):
            return self._nothing_to_ask(req, d, thunk, elapsed)
        # the one margin between a request's deadline and its cloud call: room for the local fallback
        # and the publish, at least deadline_reserve_ms and a tenth of the time there is
        reserve = max(self.settings.deadline_reserve_ms / 1000.0, 0.1 * (end - start))
        failure: CloudError | None = None
        left_ms = (end - reserve - self._clock()) * 1e3
        typical = self._typical_latency_ms()
        probing = typical is not None and left_ms < typical  # too slow by its record: asked once in a while anyway
        if probing and (self._probed is None or self._clock() - self._probed < LATENCY_PROBE_S):
            if self._probed is None:
                self._probed = self._clock()  # the first turned away starts the clock of the first probe
            failure = CloudTimeout(f"the cloud's median latency ({typical:.0f} ms) exceeds the {max(0.0, left_ms):.0f} ms "
                                   "left before the deadline")
        elif (spend := self.budget.try_acquire()) is None:
            failure = CloudError(f"the cloud request budget ({self.settings.requests_per_minute}/min) is spent")
        elif not self._slot_or_refund(max(0.0, end - reserve - self._clock()), spend):
            failure = CloudError(f"{self.settings.concurrency} cloud calls are already in flight")
        else:
            if probing:
                self._probed = self._clock()
            try:
                top_k = list(computed.top_k) if computed is not None else None
                detections = list(computed.detections) if computed is not None and computed.detections is not None else None
                answer = self.client.complete(req.image, req.mime, req.prompt, top_k, end - reserve - self._clock(),
                                              detections=detections)
            except CloudError as exc:
                if not exc.attempts:  # no HTTP attempt (the breaker, no time left, a body not built): nothing spent
                    self.budget.refund(spend)
                failure = exc
            else:
                self._count("cloud_answers")
                with self._lock:
                    if probing:  # quick enough this time: the record of a slower cloud no longer holds
                        self._latencies.clear()
                    self._latencies.append(answer.latency_ms)
                return Outcome("cloud", answer.text, answer.latency_ms, d.reason, escalated=True, cloud_model=answer.model,
                               attempts=answer.attempts, cloud_input=answer.cloud_input, decision=d, local=computed)
            finally:
                self._slots.release()
        return self._fallback(req, d, computed, thunk, failure, elapsed)

    def _slot_or_refund(self, wait_s: float, spend: Spend) -> bool:
        """:meth:`_slot`, giving the budget back ``spend`` when no call will be made."""
        try:
            if self._slot(wait_s):
                return True
        except CallNotStarted:
            self.budget.refund(spend)
            raise
        self.budget.refund(spend)
        return False

    def _slot(self, wait_s: float) -> bool:
        """A concurrency slot within ``wait_s`` seconds, or False.

        Raises:
            CallNotStarted: the daemon began to stop (:attr:`closing`) while this waited: the call is not made.
        """
        until = time.monotonic() + wait_s
        while not self.closing.is_set():
            left = until - time.monotonic()
            if self._slots.acquire(timeout=max(0.0, min(SLOT_POLL_S, left))):
                return True
            if left <= SLOT_POLL_S:
                return False
        raise CallNotStarted("the daemon is stopping: the cloud call was not started")

    def _nothing_to_ask(self, req: BridgeRequest, d: Decision, thunk, elapsed) -> Outcome:
        """No prompt, no image the cloud takes, no local findings yet (a decision made before inference, in the hot
        state): the cloud would be asked a question about an image it cannot see, and its answer (e.g. "I cannot see
        any image") would stand for the request's. The local answer instead, where local work is allowed."""
        why = NOTHING_TO_ASK
        if thunk is not None and d.thermal_state != "critical":
            computed = thunk()
            return Outcome("edge", computed.summary, elapsed(), f"{d.reason}; {why}: answered locally", True, escalated=True,
                           decision=d, local=computed)
        return Outcome("edge", None, elapsed(), f"{d.reason}; {why}", True, self._no_local_code(d, None), escalated=True,
                       decision=d)

    def _fallback(self, req, d: Decision, computed, thunk, failure: CloudError, elapsed) -> Outcome:
        self._count("cloud_unanswered")
        message = scrub(str(failure))
        self.last_error = message
        log.info("request %s: cloud failed (%s)", req.id, message)
        reason = f"{d.reason}; cloud failed: {message}"
        local_allowed = thunk is not None or computed is not None
        local_allowed = local_allowed and d.thermal_state != "critical"
        deferred = req.deferrable and failure.retryable and self._defer(req, d, computed)
        if local_allowed:
            computed = computed if computed is not None else thunk()
            tail = "deferred to the outbox" if deferred else "answered locally"
            return Outcome("edge", computed.summary, elapsed(), f"{reason}: {tail}", True, deferred=deferred, escalated=True,
                           attempts=failure.attempts, decision=d, local=computed)
        if deferred:
            return Outcome("cloud", None, elapsed(), f"{reason}: deferred to the outbox", True, deferred=True, escalated=True,
                           attempts=failure.attempts, decision=d)
        return Outcome("edge", None, elapsed(), reason, True, self._no_local_code(d, failure), escalated=True,
                       attempts=failure.attempts, decision=d)

    @staticmethod
    def _no_local_code(d: Decision, failure: CloudError | None) -> str:
        if d.thermal_state == "critical":
            return "busy"
        return "deadline_exceeded" if isinstance(failure, CloudTimeout) else "cloud_unavailable"

    def stored_request(self, req: BridgeRequest, computed: LocalResult | None) -> dict:
        """What the outbox keeps of a request to ask the cloud later: prompt, the image downscaled as it
        will be sent, and the edge's findings (boxes in that image's pixels).

        Raises:
            CloudRejected: an image the cloud cannot take.
        """
        image = mime = None
        detections = list(computed.detections) if computed is not None and computed.detections is not None else None
        if req.image:
            prepared = prepare_image(req.image, self.settings.image_max_side)
            image, mime = prepared.base64, prepared.mime
            if detections:  # the stored image is the downscaled one: keep the boxes in its pixels
                detections = [{**d, "box": b} for d, b in zip(detections, prepared.scale_boxes([d["box"] for d in detections]))]
        return {"model": req.model, "prompt": req.prompt, "image_b64": image, "mime": mime,
                "top_k": list(computed.top_k) if computed is not None else None, "detections": detections}

    def _defer(self, req: BridgeRequest, d: Decision, computed: LocalResult | None) -> bool:
        if not req.response_topic:
            log.warning("request %s is deferrable but has no response topic; not deferred", req.id)
            return False
        try:
            stored = self.stored_request(req, computed)
        except CloudRejected:
            return False
        payload = {"request": stored, "response": req.response or {}, "reason": d.reason, "request_id": req.id}
        # two requesters may use the same id: the outbox keys on where the answer goes as well
        if not self.outbox.put(outbox_key(req), req.response_topic, req.correlation_data, payload):
            log.info("request %s is already in the outbox (a redelivery); not stored twice", req.id)
        return True

    def _typical_latency_ms(self, min_calls: int = 5) -> float | None:
        """The median of recent cloud round trips, once there are enough to judge by."""
        with self._lock:
            if len(self._latencies) < min_calls:
                return None
            recent = sorted(list(self._latencies)[-50:])
        return recent[len(recent) // 2]

    # deferred delivery -------------------------------------------------------------------------
    def deliver_item(self, item: OutboxItem, publish: Publish, render: Render) -> None:
        """Deliver one claimed outbox row (``Outbox.deliver_once`` / ``deliver_pending`` call it):
        ask the cloud (unless its answer is stored), store the rendered answer, publish it.

        Args:
            item: the claimed row.
            publish: ``publish(response_topic, correlation_data, payload)``; must raise when the
                message was not accepted (QoS 1 not acknowledged), so it is retried.
            render: builds the payload from the row and the cloud's answer or final error.

        Raises:
            Postpone, CloudError, or what ``publish`` raises: the row stays pending.
        """
        self._deliver(item, publish, render)
        self._count("delivered")

    def _deliver(self, item: OutboxItem, publish: Publish, render: Render) -> None:
        result = item.result
        if result is None:
            result = self._resolve(item, render)
            self.outbox.set_result(item.id, result)
        if not self.outbox.holds(item.id):
            raise Postpone("the outbox lease expired before publishing", 0.0)
        publish(item.response_topic, item.correlation_data, result)

    def _resolve(self, item: OutboxItem, render: Render) -> dict:
        age = self.outbox.now() - item.created_at
        if age > self.settings.outbox_ttl_s:
            return render(item, CloudError(f"the cloud did not answer within outbox_ttl_s ({self.settings.outbox_ttl_s:g} s)"))
        if self.breaker.state == "open":
            raise Postpone("the cloud circuit breaker is open", max(1.0, self.breaker.retry_in_s()))
        spend = self.budget.try_acquire()
        if spend is None:
            raise Postpone("the cloud request budget is spent", max(1.0, self.budget.resets_in_s()))
        r = item.payload.get("request", {})
        image = base64.b64decode(r["image_b64"]) if r.get("image_b64") else None
        deadline = self.settings.timeout_s * (self.settings.max_retries + 1) + 1.0
        try:
            answer = self.client.complete(image, r.get("mime"), r.get("prompt"), r.get("top_k"), deadline,
                                          detections=r.get("detections"))
        except CloudError as exc:
            if not exc.attempts:  # no HTTP attempt (the breaker, a body not built): nothing spent
                self.budget.refund(spend)
            if isinstance(exc, BreakerOpen):
                raise Postpone(str(exc), max(1.0, self.breaker.retry_in_s())) from None
            self.last_error = scrub(str(exc))
            if exc.retryable:
                raise
            return render(item, exc)
        with self._lock:
            self._latencies.append(answer.latency_ms)
        self._count("cloud_answers")
        return render(item, answer)

    # status ------------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def status(self) -> dict:
        """Breaker, budget, outbox depth, last error and counters, for ``{prefix}/status`` and telemetry."""
        with self._lock:
            counts = dict(self._counts)
            lat = sorted(self._latencies)
        pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 1)) if lat else (lambda q: None)
        rate = counts["escalated"] / counts["requests"] if counts["requests"] else None
        return {"endpoint": self.settings.base_url, "model": self.settings.model, "mode": self.settings.mode,
                "breaker": self.breaker.snapshot(), "budget": self.budget.snapshot(), "outbox": self.outbox.snapshot(),
                "last_error": self.last_error, "counts": counts, "escalation_rate": rate,
                "cloud_latency_ms": {"p50": pct(0.5), "p95": pct(0.95), "n": len(lat)}}

    def close(self) -> None:
        self.client.close()
        self.outbox.close()


def outbox_key(req: BridgeRequest) -> str:
    """The outbox id of a deferred request: its id plus a digest of where its answer goes."""
    import hashlib

    where = hashlib.sha256((req.response_topic or "").encode() + b"\0" + (req.correlation_data or b"")).hexdigest()[:16]
    return f"{req.id}@{where}"
