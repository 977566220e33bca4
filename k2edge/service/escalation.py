"""Cloud escalation as the request path uses it: the thermal governor, the escalation policy and,
when ``[cloud]`` is configured, the cloud bridge with its worker pool and durable outbox.

The request path asks the policy once per request — before local inference when the thermal
state is hot or critical (so no local work is spent), after it otherwise — and hands a request
the policy sends to the cloud to :meth:`Escalation.send`. ``send`` first puts the request in the
outbox (SQLite), so the MQTT request can be acknowledged at once: a slow cloud call must not hold
back the in-order acknowledgements of every later request. A worker then asks the cloud within
the request's deadline and returns the outcome to the request path, which answers. Should the
daemon die first, the next start finds the row in the outbox and answers it (``deadline_exceeded``
once its deadline has passed).

Without ``[cloud]`` the policy still runs: the cloud is reported unavailable, so escalations come
back as local answers with ``degraded: true`` and the reason, and critical refuses local work.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable

from ..cloud_bridge import (BridgeRequest, CloudBridge, CloudHealth, CloudRejected, Decision, EscalationPolicy,
                            EscalationRequest, LocalResult, Outcome)
from ..config.schema import DaemonConfig, state_dir
from ..deadline import Deadline
from ..telemetry import thermal_sampler

log = logging.getLogger(__name__)

EARLY_STATES = ("hot", "critical")  # states in which the policy is asked before any local work


class Escalation:
    """Thermal sampler + escalation policy + (optional) cloud bridge.

    Args:
        cfg: daemon config.
        on_thermal: called with the GovernorState on every transition.
    """

    def __init__(self, cfg: DaemonConfig, on_thermal: Callable) -> None:
        self.cfg = cfg
        self._on_thermal = on_thermal
        self.policy = EscalationPolicy({m.name: m.escalation for m in cfg.models})
        self.sampler = thermal_sampler(cfg.thermal, on_transition=self._transition)
        self.bridge: CloudBridge | None = None
        self.pool: ThreadPoolExecutor | None = None
        # requests waiting for (or in) a cloud call are bounded like the local queue
        self._cloud_slots = threading.BoundedSemaphore(cfg.service.queue_size)
        self._waiting: dict[str, object] = {}  # outbox id -> future, for the drain
        self._lock = threading.Lock()
        if cfg.cloud is not None:
            self.bridge = CloudBridge(cfg.cloud, state_dir(cfg), policy=self.policy, thermal_state=lambda: self.sampler.state)
            self.pool = ThreadPoolExecutor(max(2, 2 * cfg.cloud.concurrency), thread_name_prefix="k2edge-cloud")
        self._stop = threading.Event()
        self._outbox_thread: threading.Thread | None = None

    # lifecycle -----------------------------------------------------------------------------------
    def start(self, resume: Callable, publish_followup: Callable) -> None:
        """Start sampling, and (with a cloud) the outbox loop.

        Args:
            resume: ``resume(item)`` answers a request the cloud pool had taken when an earlier run
                stopped (a row with ``live`` set); it publishes and waits for the broker's ack.
            publish_followup: ``publish(topic, correlation, payload)`` for a deferred request's later
                cloud answer; raises when the broker did not acknowledge it.
        """
        self.sampler.start()
        if self.bridge is not None:
            self._outbox_thread = threading.Thread(target=self._outbox_loop, args=(resume, publish_followup),
                                                   name="k2edge-outbox", daemon=True)
            self._outbox_thread.start()

    def stop(self) -> None:
        """Finish the cloud calls already running (each bounded by its deadline); hand the queued ones
        back to the outbox for the next start; stop the rest."""
        if self.pool is not None:
            with self._lock:
                queued = [oid for oid, fut in self._waiting.items() if fut.cancel()]
            for oid in queued:
                self.bridge.outbox.release(oid, "the daemon stopped before the cloud call", 0.0)
            self.pool.shutdown(wait=True)
        self._stop.set()
        if self._outbox_thread is not None:
            self._outbox_thread.join(timeout=10)
        self.sampler.stop()
        if self.bridge is not None:
            self.bridge.close()

    def _transition(self, st) -> None:
        log.warning("thermal state %s: %s", st.state, st.reason)
        self._on_thermal(st)

    # state -----------------------------------------------------------------------------------------
    @property
    def thermal(self):
        return self.sampler.state

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
        state = self.thermal
        if local is None and getattr(state, "state", state) not in EARLY_STATES:
            return None
        d = self.policy.decide(EscalationRequest(model, prompt, allow_cloud, deferrable), local, state, self._health(),
                               self._budget())
        return None if d.provisional else d

    def wants_cloud(self, d: Decision) -> bool:
        """True when carrying ``d`` out needs the bridge (a cloud call, or the outbox for later)."""
        return self.bridge is not None and (d.action == "cloud" or d.defer)

    def carry_out_now(self, req: BridgeRequest, d: Decision, local: LocalResult) -> Outcome:
        """A decision that needs no cloud call now (answer locally and defer to the outbox): done inline."""
        return self.bridge.carry_out(req, d, local, 0.0)

    # handing a request to the cloud ----------------------------------------------------------------
    def send(self, req: BridgeRequest, d: Decision, local, deadline: Deadline, key: tuple | None,
             finish: Callable[[Outcome | BaseException, str], None]) -> str | None:
        """Put a request the policy sends to the cloud in the outbox and queue its cloud call.

        Args:
            req: the request as the bridge sees it (``response`` is the answer template).
            d: the policy's decision.
            local: the edge's result, or a callable computing it for a fallback, or None.
            deadline: the request's deadline (the cloud's own time budget applies when none).
            key: the request's answer key (topic, id, attempt), kept in the outbox row.
            finish: ``finish(outcome, outbox_id)`` — called from a cloud worker with the outcome.

        Returns:
            The outbox id (the request may be acknowledged now), or None when ``queue_size``
            requests already wait for the cloud (answer it locally instead).
        """
        if self.bridge is None or not self._cloud_slots.acquire(blocking=False):
            return None
        c = self.cfg.cloud
        budget = deadline.remaining() if deadline.set else c.timeout_s * (c.max_retries + 1) + 1.0
        oid = f"live-{uuid.uuid4().hex}"
        try:
            stored = self.bridge.stored_request(req, local if isinstance(local, LocalResult) else None)
        except CloudRejected:  # an image the cloud cannot take: the row keeps the rest
            stored = self.bridge.stored_request(replace(req, image=None), local if isinstance(local, LocalResult) else None)
        payload = {"live": True, "key": list(key) if key else None, "deadline_wall": time.time() + budget,
                   "reason": d.reason, "request_id": req.id, "response": req.response or {}, "request": stored}
        try:
            self.bridge.outbox.put(oid, req.response_topic or "", req.correlation_data, payload, claim_s=budget + 30.0)
        except Exception:
            self._cloud_slots.release()
            log.exception("request %s: the outbox refused the cloud work; answering locally", req.id)
            return None
        with self._lock:
            self._waiting[oid] = self.pool.submit(self._call, req, d, local, deadline, budget, oid, finish)
        return oid

    def _call(self, req: BridgeRequest, d: Decision, local, deadline: Deadline, budget: float, oid: str, finish) -> None:
        try:
            outcome = self.bridge.carry_out(req, d, local, deadline.remaining() if deadline.set else budget)
        except Exception as exc:  # the bridge translates cloud failures; anything else is ours
            log.exception("request %s: cloud offload failed", req.id)
            outcome = exc
        finally:
            with self._lock:
                self._waiting.pop(oid, None)
            self._cloud_slots.release()
        finish(outcome, oid)

    def delivered(self, oid: str) -> None:
        """The answer for outbox row ``oid`` was delivered."""
        if self.bridge is not None:
            self.bridge.outbox.mark_delivered(oid)

    # the outbox loop: deferred answers, and cloud work an earlier run did not finish ---------------
    def _outbox_loop(self, resume: Callable, publish_followup: Callable) -> None:
        def send(item) -> None:
            if item.payload.get("live"):
                resume(item)
            else:
                self.bridge.deliver_item(item, publish_followup)

        self.bridge.outbox.deliver_pending(send, self._stop)

    def resume_outcome(self, item) -> Outcome | None:
        """For an outbox row the cloud pool had taken: the cloud's outcome, or None when its
        deadline passed while the daemon was down."""
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

    def status(self) -> dict:
        return {"thermal": self.sampler.snapshot(), "cloud": self.bridge.status() if self.bridge else {"state": "not configured"},
                "cloud_waiting": self.cloud_waiting}


def degrade(d: Decision, why: str) -> Decision:
    """``d`` answered locally after all (the cloud could not take it), with the reason."""
    return replace(d, action="local", degraded=True, defer=False, reason=f"{d.reason}; {why}: answered locally")
