"""The cloud side of a request: the escalation policy and, when ``[cloud]`` is configured, the
cloud bridge with its worker pool and durable outbox.

The request client asks :meth:`Escalation.decide` once per request — before local inference when
the thermal state is hot or critical (so no local work is spent), after it otherwise — and hands
the decision to :meth:`Escalation.carry_out`, which returns the answer body, or None when the
request went to the cloud pool. Going to the pool, a request is first put in the outbox (SQLite),
so the MQTT request can be acknowledged at once: a slow cloud call must not hold back the in-order
acknowledgements of every later request. A worker then asks the cloud within the request's
deadline and replies through :meth:`Replies.send_late <k2edge.service.replies.Replies.send_late>`;
a timer (:mod:`k2edge.service.fallback`) gives the local answer instead when the deadline, less the
reserve for that answer and its publish, comes first. Should
the daemon die first, the next start finds the row in the outbox and answers it
(``deadline_exceeded`` once its deadline has passed); deferred requests are answered from the
outbox once the cloud answers.

Every answer that carries a cloud outcome — live, resumed after a restart, delivered later from
the outbox — is built by one function, :func:`answer_from_outcome`, from the request's answer
template (the ``ok`` answer the edge would give).

Without ``[cloud]`` the policy still runs: the cloud is reported unavailable, so escalations come
back as local answers with ``degraded: true`` and the reason, and critical refuses local work.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from .. import tracing
from ..cloud_bridge import (BridgeRequest, CloudAnswer, CloudBridge, CloudError, CloudHealth, CloudRejected, Decision,
                            EscalationPolicy, EscalationRequest, LocalResult, Outcome)
from ..cloud_bridge.errors import CallNotStarted
from ..cloud_bridge.outbox import OutboxItem
from ..cloud_bridge.retry import scrub
from ..config.schema import DaemonConfig, state_dir
from ..deadline import Deadline, clock
from .answer_book import Answer, AnswerBook, AnswerKey
from .fallback import FallbackTimer, Settled
from .protocol import BUSY, CLOUD_UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, encode, error_body
from .replies import Replies, RequestItem

log = logging.getLogger(__name__)

EARLY_STATES = ("hot", "critical")  # states in which the policy is asked before any local work
DELIVERY_WAIT_S = 10.0  # how long the outbox loop waits for the broker to acknowledge one answer


def answer_from_outcome(template: dict, outcome: Outcome, thermal_state: str) -> dict:
    """The answer to a request whose decision was carried out: live, resumed or delivered later.

    Args:
        template: the ``ok`` answer the edge would give (id, attempt, model, model_version, profile,
            device, the task's fragment, confidence, latency_ms, ...).
        outcome: what became of the request.
        thermal_state: the state now.
    """
    if outcome.error_code:
        return error_body(outcome.error_code, outcome.reason, template.get("id"), template.get("attempt", 0),
                          template.get("model"), template.get("device"), template.get("model_version"))
    body = {k: v for k, v in template.items() if k not in ("text", "cloud_input", "escalation_reason", "deferred", "error")}
    cloud = outcome.source == "cloud"
    latency = dict(template.get("latency_ms") or {})
    if cloud:
        latency["cloud"] = round(outcome.latency_ms, 3)
    body.update(status="ok", source=outcome.source, latency_ms=latency, thermal_state=thermal_state,
                degraded=outcome.degraded)
    if outcome.decision is not None and outcome.decision.confidence is not None:
        body["confidence"] = outcome.decision.confidence
    if cloud and outcome.text is not None:
        body["text"] = outcome.text
    if cloud and outcome.cloud_input is not None:
        body["cloud_input"] = outcome.cloud_input
    if outcome.escalated and outcome.reason:
        body["escalation_reason"] = outcome.reason
    if outcome.deferred:
        body["deferred"] = True
    return body


def deferred_answer(item: OutboxItem, result: CloudAnswer | CloudError, thermal_state: str) -> dict:
    """A deferred request's later answer: its stored template completed with the cloud's answer or
    its final error (by :func:`answer_from_outcome`)."""
    template = {**(item.payload.get("response") or {}), "id": item.payload.get("request_id", item.id)}
    reason = item.payload.get("reason") or "deferred"
    if isinstance(result, CloudAnswer):
        outcome = Outcome("cloud", result.text, result.latency_ms, reason, deferred=True, escalated=True,
                          cloud_model=result.model, cloud_input=result.cloud_input)
    else:
        outcome = Outcome("cloud", None, 0.0, f"{reason}; cloud failed: {scrub(str(result))}", True, CLOUD_UNAVAILABLE,
                          deferred=True, escalated=True)
    return answer_from_outcome(template, outcome, thermal_state)


class Escalation:
    """Escalation policy + (optional) cloud bridge, its pool, its outbox loop and the local fallbacks' timer.

    Args:
        cfg: daemon config.
        thermal: the thermal sampler (``state``: what the policy judges by).
        replies: how a request is replied to (live cloud answers, and the templates they complete).
        book: where answers from the outbox (resumed, deferred) are recorded and published.
    """

    def __init__(self, cfg: DaemonConfig, thermal, replies: Replies, book: AnswerBook) -> None:
        self.cfg = cfg
        self.thermal = thermal
        self.replies = replies
        self.book = book
        self.policy = EscalationPolicy({m.name: m.escalation for m in cfg.models})
        self.bridge: CloudBridge | None = None
        self.pool: ThreadPoolExecutor | None = None
        # requests waiting for (or in) a cloud call are bounded like the local queue
        self._cloud_slots = threading.BoundedSemaphore(cfg.service.queue_size)
        self._waiting: dict[str, object] = {}  # outbox id -> future, for the drain
        self._lock = threading.Lock()
        self._delivered: list[str] = []  # outbox ids whose live answer the broker has, written by tick()
        self.fallbacks = FallbackTimer(self._fall_back)
        if cfg.cloud is not None:
            self.bridge = CloudBridge(cfg.cloud, state_dir(cfg), policy=self.policy, thermal_state=lambda: thermal.state)
            self.pool = ThreadPoolExecutor(max(2, 2 * cfg.cloud.concurrency), thread_name_prefix="k2edge-cloud")
        self._stop = threading.Event()
        self._outbox_thread = threading.Thread(target=self._outbox_loop, name="k2edge-outbox", daemon=True)

    # lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """With a cloud: the outbox loop and the fallbacks' timer."""
        if self.bridge is not None:
            self.fallbacks.start()
            self._outbox_thread.start()

    def stop(self) -> None:
        """Finish the cloud calls already running (each bounded by its deadline) and publish their
        answers; hand the queued ones back to the outbox for the next start; stop the outbox loop.
        The outbox stays open for the deliveries still to be acknowledged: :meth:`close`."""
        if self.pool is not None:
            self.hand_back_queued()  # again: requests handed to the cloud while the drain waited for them
            self.pool.shutdown(wait=True)
            self.fallbacks.stop()
        self._stop.set()
        if self._outbox_thread.is_alive():
            self._outbox_thread.join(timeout=10)

    def hand_back_queued(self) -> None:
        """Hand the cloud calls that have not started back to the outbox (unleased) for the next start. The
        drain does it first, so that a drain waiting for open requests never lets a queued call start; the
        outbox loop takes no row from then on (it would take these back and call the cloud while draining)."""
        if self.pool is None:
            return
        self._stop.set()
        self.bridge.closing.set()  # and a call waiting for a concurrency slot is not started: handed back by _call
        with self._lock:
            queued = [oid for oid, fut in self._waiting.items() if fut.cancel()]
            for oid in queued:
                del self._waiting[oid]
        for oid in queued:
            self.bridge.outbox.unlease(oid, "the daemon stopped before the cloud call", 0.0)

    def close(self) -> None:
        """Close the cloud client and the outbox (after every answer was acknowledged: a live answer's
        acknowledgement marks its outbox row delivered)."""
        if self.bridge is not None:
            self.tick()
            self.bridge.close()

    def tick(self) -> None:
        """Once a second (the serving loop): mark the outbox rows whose live answers the broker has. A row
        not marked yet when the daemon dies is taken up at the next start, where the answer book knows
        its answer was delivered: nothing is answered twice."""
        with self._lock:
            ids, self._delivered = self._delivered, []
        for oid in ids:
            try:
                self.bridge.outbox.mark_delivered(oid)
            except Exception:
                log.exception("the outbox could not record the delivery of %s", oid)

    def _answer_delivered(self, oid: str) -> None:
        """The broker has a live answer (the MQTT network thread: no disk here, the outbox syncs each write)."""
        with self._lock:
            self._delivered.append(oid)

    def use(self, model: str, settings) -> None:
        """Model ``model`` now runs engines whose card these escalation settings were checked against."""
        self.policy.models[model] = settings

    # state -----------------------------------------------------------------------------------------
    @property
    def cloud_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def _health(self) -> CloudHealth:
        if self.bridge is None:
            return CloudHealth(False, "no [cloud] section in the config")
        if self.cloud_waiting >= self.cfg.service.queue_size:
            return CloudHealth(False, f"{self.cfg.service.queue_size} requests already wait for the cloud")
        return self.bridge.cloud_health()

    def _budget(self) -> int | None:
        return self.bridge.budget.remaining() if self.bridge is not None else None

    # the policy, once per request ------------------------------------------------------------------
    def decide(self, model: str, prompt: str | None, allow_cloud: bool | None, deferrable: bool,
               local: LocalResult | None) -> Decision | None:
        """The policy's decision. With ``local`` None it is asked before inference, and answers only
        in the hot and critical states (None: run the model first, then ask with its result)."""
        state = self.thermal.state
        if local is None and state.state not in EARLY_STATES:
            return None
        d = self.policy.decide(EscalationRequest(model, prompt, allow_cloud, deferrable), local, state, self._health(),
                               self._budget())
        return None if d.provisional else d

    # carrying a decision out -----------------------------------------------------------------------
    def carry_out(self, w: RequestItem, d: Decision, local) -> dict | None:
        """The reply body for ``w`` under decision ``d``, or None when the request went to the cloud
        pool (safe in the outbox: acknowledged now, replied to by the pool or its fallback).

        ``local``: the edge's LocalResult, or a callable computing it (a decision made before inference).
        """
        replies = self.replies
        computed = local if isinstance(local, LocalResult) else None
        if d.action == "refuse":
            return replies.error(w, d.error_code or BUSY, d.reason)
        if self.bridge is not None and (d.action == "cloud" or d.defer):
            breq = self._bridge_request(w)
            if d.action == "cloud":
                if self._send(breq, d, local, w):
                    return None
                d = degrade(d, f"{self.cfg.service.queue_size} requests already wait for the cloud")
            else:  # answer locally now and leave the cloud's later answer to the outbox
                computed = computed or local()
                outcome = self.bridge.carry_out(breq, d, computed, 0.0)
                return answer_from_outcome(replies.template(w), outcome, self.thermal.state.state)
        if computed is None:
            if d.action != "local":
                return replies.error(w, d.error_code or BUSY, d.reason)
            computed = local()
        below = d.confidence is not None and d.threshold is not None and d.confidence < d.threshold
        wanted = d.escalate or d.degraded or below  # (below and forbidden: the reason says so)
        return replies.template(w, confidence=d.confidence, degraded=d.degraded, escalation_reason=d.reason if wanted else None)

    def _bridge_request(self, w: RequestItem) -> BridgeRequest:
        r = w.req
        mime = w.content_type if w.content_type and w.content_type.startswith("image/") else None
        return BridgeRequest(id=r.id or f"anon-{id(w):x}", model=r.model, prompt=r.prompt, image=r.image, mime=mime,
                             allow_cloud=r.allow_cloud, deferrable=r.deferrable, response_topic=w.reply_topic,
                             correlation_data=w.correlation, response=self.replies.template(w))

    def _send(self, req: BridgeRequest, d: Decision, local, w: RequestItem) -> bool:
        """Put a request the policy sends to the cloud in the outbox, acknowledge it, queue its cloud
        call and arm its local fallback. False when ``queue_size`` requests already wait for the cloud
        (answer locally)."""
        if not self._cloud_slots.acquire(blocking=False):
            return False
        c = self.cfg.cloud
        deadline = w.deadline
        budget = deadline.remaining() if deadline.set else c.timeout_s * (c.max_retries + 1) + 1.0
        oid = f"live-{uuid.uuid4().hex}"
        computed = local if isinstance(local, LocalResult) else None
        try:
            stored = self.bridge.stored_request(req, computed)
        except CloudRejected:  # an image the cloud cannot take: the row keeps the rest
            stored = self.bridge.stored_request(replace(req, image=None), computed)
        payload = {"live": True, "key": list(w.key) if w.key else None, "deadline_wall": time.time() + budget,
                   "reason": d.reason, "request_id": req.id, "response": req.response or {}, "request": stored}
        try:
            self.bridge.outbox.put(oid, req.response_topic or "", req.correlation_data, payload, claim_s=budget + 30.0)
        except Exception:
            self._cloud_slots.release()
            log.exception("request %s: the outbox refused the cloud work; answering locally", req.id)
            return False
        self.replies.handed_to_cloud(w)
        settled = Settled()
        if self._falls_back(req, d, local, deadline):
            # the local answer is ready when the cloud wait ends: due at the deadline less the reserve for
            # the publish (and for computing it, when a decision made before inference left it to do); the
            # timer fires it earlier by how late this machine delivers such replies, the cloud's wait
            # keeping at least half the budget
            reserve = min(0.5 * budget, max(c.deadline_reserve_ms / 1e3, 0.1 * budget))
            cost = 0.0 if computed is not None or w.runtime is None else min(1.0, 2 * w.runtime.batch1_s)
            ready = self._local_answer(w, d, computed, clock()) if computed is not None else None
            due = deadline.at - reserve - cost
            armed = _Fallback(w, d, local, settled, oid, clock(), due, ready)
            self.fallbacks.arm(due, armed, floor=deadline.at - 0.5 * budget - cost)
        else:
            armed = None
        with self._lock:
            self._waiting[oid] = self.pool.submit(self._call, req, d, local, deadline, budget, oid, w, settled, armed)
        return True

    @staticmethod
    def _falls_back(req: BridgeRequest, d: Decision, local, deadline: Deadline) -> bool:
        """A local answer can stand in for the cloud's at the deadline (a deferrable request's
        fallback is the bridge's: it may go to the outbox instead)."""
        return deadline.set and local is not None and d.thermal_state != "critical" and not req.deferrable

    def _local_answer(self, w: RequestItem, d: Decision, computed: LocalResult, sent: float) -> dict:
        """``w``'s degraded local answer, as the fallback gives it."""
        outcome = Outcome("edge", computed.summary, (clock() - sent) * 1e3,
                          f"{d.reason}; cloud failed: no answer from the cloud within the {w.deadline.why}: "
                          "answered locally", True, escalated=True, decision=d, local=computed)
        return answer_from_outcome(self.replies.template(w), outcome, self.thermal.state.state)

    def _fall_back(self, jobs: list[tuple[float, "_Fallback"]]) -> None:
        """The deadline came before the cloud's outcome: the local answers, degraded (the timer's thread)."""
        replies = []
        for due, job in jobs:
            if not job.settled.claim():
                continue
            job.due = due  # the timer learns how late the reply is against this
            w = job.w
            try:
                if job.body is None:  # decided before inference: computed now, in time for the deadline
                    computed = job.local if isinstance(job.local, LocalResult) else job.local()
                    body = self._local_answer(w, job.d, computed, job.sent)
                else:
                    body = job.body
                    body["latency_ms"]["total"] = round((clock() - w.received) * 1e3, 3)
                    body["thermal_state"] = self.thermal.state.state
            except Exception as exc:
                log.exception("request %s: the local fallback failed", w.req.id)
                body = self.replies.error(w, INTERNAL, f"internal error in the local fallback: {type(exc).__name__}")
            replies.append((w, body, functools.partial(self._fallback_delivered, job)))
        if replies:
            self.replies.send_late(replies)

    def _fallback_delivered(self, job: "_Fallback") -> None:
        """The broker has a fallback's reply: its outbox row is done, and the timer learns how late it was."""
        self.fallbacks.observe(clock() - job.due)
        self._answer_delivered(job.oid)

    def _call(self, req: BridgeRequest, d: Decision, local, deadline: Deadline, budget: float, oid: str,
              w: RequestItem, settled: Settled, armed: "_Fallback | None" = None) -> None:
        """A cloud worker: the cloud's outcome, replied unless the fallback replied first. Replied here, the armed
        fallback (waiting in the timer until its time, up to the longest deadline) lets go of its local answer, and
        of the engines a local answer still to compute holds through a deploy."""
        body = None
        try:
            if not settled.taken:  # the fallback replied while this waited for a worker: no call to make
                # traced: the call's span is current while it runs (its traceparent goes to K2)
                with tracing.cloud_span(w.trace, self.cfg.cloud.model, self.cfg.cloud.base_url) if w.trace is not None \
                        else contextlib.nullcontext():
                    outcome = self.bridge.carry_out(req, d, local, deadline.remaining() if deadline.set else budget)
                if not settled.taken:
                    body = answer_from_outcome(self.replies.template(w), outcome, self.thermal.state.state)
        except CallNotStarted:  # the drain began while this waited for a slot: back to the outbox, as a queued call
            # (whose local fallback, when armed, may still answer before the daemon is gone)
            if not settled.taken:
                self.bridge.outbox.unlease(oid, "the daemon stopped before the cloud call", 0.0)
        except Exception as exc:  # the bridge translates cloud failures; anything else is ours
            log.exception("request %s: cloud offload failed", req.id)
            body = self.replies.error(w, INTERNAL, f"internal error in the cloud offload: {type(exc).__name__}")
        finally:
            with self._lock:
                self._waiting.pop(oid, None)
            self._cloud_slots.release()
        if body is not None and settled.claim():
            if armed is not None:
                armed.local = armed.body = None  # settled here: the timer will find it taken and skip it
            self.replies.send_late([(w, body, functools.partial(self._answer_delivered, oid))])

    # the outbox loop: deferred answers, and cloud work an earlier run did not finish ---------------
    def _outbox_loop(self) -> None:
        self.bridge.outbox.deliver_pending(self._deliver, self._stop)

    def _deliver(self, item: OutboxItem) -> None:
        if item.payload.get("live"):
            self._resume(item)
        else:
            self.bridge.deliver_item(item, self._publish_followup, self.render)

    def _resume(self, item: OutboxItem) -> None:
        """Answer a request whose cloud work an earlier run took but did not finish."""
        p = item.payload
        key = AnswerKey(*p["key"]) if p.get("key") else None
        template = p.get("response") or {}
        if key is not None and self.book.recorded(key):
            body = b""  # answered already: the book re-publishes that answer if it was never delivered
        else:
            outcome = self._resume_outcome(item)
            if outcome is None:
                body = encode(error_body(DEADLINE_EXCEEDED, "the deadline passed while the daemon was not running",
                                         template.get("id"), template.get("attempt", 0), template.get("model"),
                                         self.cfg.device_id, template.get("model_version")))
            else:
                body = encode(answer_from_outcome(template, outcome, self.thermal.state.state))
        self._answer_and_wait(Answer(key, item.response_topic, body, item.correlation_data))

    def _resume_outcome(self, item: OutboxItem) -> Outcome | None:
        """The cloud's outcome for a row the pool had taken, or None when its deadline passed
        while the daemon was down."""
        remaining = item.payload.get("deadline_wall", 0) - time.time()
        if remaining <= 0:
            return None
        r = item.payload.get("request", {})
        image = base64.b64decode(r["image_b64"]) if r.get("image_b64") else None
        req = BridgeRequest(id=item.payload.get("request_id") or item.id, model=r.get("model"), prompt=r.get("prompt"),
                            image=image, mime=r.get("mime"), response_topic=item.response_topic,
                            correlation_data=item.correlation_data, response=item.payload.get("response"))
        local = LocalResult(tuple(r.get("top_k") or ()), detections=tuple(r["detections"]) if r.get("detections") is not None
                            else None) if r.get("top_k") or r.get("detections") is not None else None
        d = Decision("cloud", item.payload.get("reason") or "resumed after a restart", escalate=True)
        return self.bridge.carry_out(req, d, local, remaining)

    def render(self, item: OutboxItem, result: CloudAnswer | CloudError) -> dict:
        """A deferred request's later answer (see :func:`deferred_answer`), in today's thermal state."""
        return deferred_answer(item, result, self.thermal.state.state)

    def _publish_followup(self, topic: str, correlation: bytes | None, payload: dict) -> None:
        """A deferred request's later cloud answer, once per request."""
        key = AnswerKey(topic, f"deferred:{payload.get('id')}", int(payload.get("attempt") or 0))
        self._answer_and_wait(Answer(key, topic, encode(payload), correlation))

    def _answer_and_wait(self, answer: Answer) -> None:
        """Publish through the answer book and wait for the broker's acknowledgement."""
        delivered = threading.Event()
        answer.on_delivered = delivered.set
        self.book.answer([answer])
        if not delivered.wait(DELIVERY_WAIT_S):
            raise RuntimeError(f"the broker did not acknowledge the answer on {answer.topic} within {DELIVERY_WAIT_S:g} s")

    def status(self) -> dict:
        return {"cloud": self.bridge.status() if self.bridge else {"state": "not configured"},
                "cloud_waiting": self.cloud_waiting}


@dataclass(slots=True)
class _Fallback:
    """A request in the cloud pool, armed for its local answer at its deadline."""

    w: RequestItem
    d: Decision
    local: object  # its LocalResult, or a callable computing it
    settled: Settled
    oid: str
    sent: float
    due: float  # when its local answer is due (set again to when the timer fired it)
    body: dict | None  # the local answer, built when it was armed (None: computed when due)


def degrade(d: Decision, why: str) -> Decision:
    """``d`` answered locally after all (the cloud could not take it), with the reason."""
    return replace(d, action="local", degraded=True, defer=False, reason=f"{d.reason}; {why}: answered locally")
