"""The daemon's side of thermal governance and cloud offload.

Wires the thermal sampler (governor), the escalation policy and, when ``[cloud]`` is configured,
the cloud bridge into the request path:

* before local inference (``before_inference``): in the hot and critical states, or for a
  prompt the edge cannot answer, the policy may take a request off the local path entirely — it
  goes to the cloud (hot: every offloadable request; critical: no new local work);
* after local inference (``after_inference``): the policy judges the local confidence; a request
  it wants answered by the cloud goes to a worker pool that calls the bridge (which may block up
  to the request's deadline — never on the MQTT network thread or the responder);
* thermal transitions switch models with a ``warm_profile`` to it (warm/hot) and back.

Without ``[cloud]`` the policy still runs: the cloud is reported unavailable, so escalations come
back as local answers with ``degraded: true`` and the reason, and critical refuses local work.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..cloud_bridge import BridgeRequest, CloudBridge, CloudHealth, EscalationPolicy, EscalationRequest, LocalResult
from ..config.schema import DaemonConfig, state_dir
from ..telemetry import thermal_sampler

log = logging.getLogger(__name__)


class Offload:
    """Thermal sampler + escalation policy + (optional) cloud bridge.

    Args:
        cfg: daemon config.
        answer: ``answer(work, outcome)`` hands a finished cloud outcome back to the scheduler.
        publish: ``publish(topic, correlation, payload_dict)`` for deferred answers; must raise when
            the broker did not acknowledge, so the outbox retries.
        on_thermal: called with the GovernorState on every transition.
    """

    def __init__(self, cfg: DaemonConfig, answer: Callable, publish: Callable, on_thermal: Callable) -> None:
        self.cfg = cfg
        self._answer = answer
        self._publish = publish
        self._on_thermal = on_thermal
        self.policy = EscalationPolicy({m.name: m.escalation for m in cfg.models})
        self.sampler = thermal_sampler(cfg.thermal, on_transition=self._transition)
        self.bridge: CloudBridge | None = None
        self.pool: ThreadPoolExecutor | None = None
        # requests waiting for (or in) a cloud call count against the same bound as the local queue
        self._cloud_slots = threading.BoundedSemaphore(cfg.service.queue_size)
        self._cloud_waiting = 0
        self._lock = threading.Lock()
        if cfg.cloud is not None:
            self.bridge = CloudBridge(cfg.cloud, state_dir(cfg), policy=self.policy, thermal_state=lambda: self.sampler.state)
            self.pool = ThreadPoolExecutor(max(2, 2 * cfg.cloud.concurrency), thread_name_prefix="k2edge-cloud")
        self._stop = threading.Event()
        self._outbox_thread: threading.Thread | None = None

    # lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.sampler.start()
        if self.bridge is not None:
            self._outbox_thread = threading.Thread(target=self.bridge.deliver_pending, args=(self._publish, self._stop),
                                                   name="k2edge-outbox", daemon=True)
            self._outbox_thread.start()

    @property
    def cloud_waiting(self) -> int:
        with self._lock:
            return self._cloud_waiting

    def stop(self) -> None:
        """Finish the cloud calls already running (each bounded by its deadline), drop the queued ones
        (their requests stay un-acknowledged with the broker for the next start), stop the rest."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
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

    def _health(self) -> CloudHealth:
        if self.bridge is None:
            return CloudHealth(False, "no [cloud] section in the config")
        return self.bridge.cloud_health()

    def _budget(self) -> int | None:
        return self.bridge.budget.remaining() if self.bridge is not None else None

    @staticmethod
    def escalation_request(work) -> EscalationRequest:
        r = work.request
        return EscalationRequest(r.model, r.prompt, r.allow_cloud, r.deferrable, has_local_model=True)

    def _deadline_s(self, work) -> float:
        """Time the bridge may use: to the request's deadline (or the cloud's own budget, from arrival),
        less a margin for the local fallback and the publish, so even a degraded answer is in time."""
        c = self.cfg.cloud
        end = work.request.deadline if work.request.deadline is not None else \
            work.received + c.timeout_s * (c.max_retries + 1) + 1.0
        left = end - time.monotonic()
        return max(0.0, left - max(0.05, 0.15 * left))

    def _submit(self, work, local) -> bool:
        """Queue a cloud call; False when ``queue_size`` requests already wait for the cloud."""
        if not self._cloud_slots.acquire(blocking=False):
            return False
        with self._lock:
            self._cloud_waiting += 1
        self.pool.submit(self._handle, work, local)
        return True

    # the request path ------------------------------------------------------------------------------
    def before_inference(self, work, run_local: Callable[[], LocalResult]):
        """Take a request off the local path when the policy says so without local work.

        Returns:
            None when the request takes the local path; else a Decision that refuses it (answer it
            with its error) or True when it went to the cloud pool (answered via ``answer``).
        """
        d = self.policy.decide(self.escalation_request(work), None, self.thermal, self._health(), self._budget())
        if d.provisional or (d.action == "local" and not d.defer):
            return None
        if self.bridge is None:
            return d if d.action == "refuse" else None
        if not self._submit(work, run_local):
            log.warning("request %s: %d requests already wait for the cloud; taking the local path", work.request.id,
                        self.cfg.service.queue_size)
            return d if d.action == "refuse" else None
        return True

    def after_inference(self, work, local: LocalResult):
        """The decision for a computed local result, or None when the request went to the cloud pool."""
        health = self._health()
        if self.bridge is not None and self.cloud_waiting >= self.cfg.service.queue_size:
            health = CloudHealth(False, f"{self.cfg.service.queue_size} requests already wait for the cloud")
        d = self.policy.decide(self.escalation_request(work), local, self.thermal, health, self._budget())
        if self.bridge is not None and (d.action != "local" or d.defer) and self._submit(work, local):
            return None
        return d

    def _handle(self, work, local) -> None:
        r = work.request
        try:
            outcome = self.bridge.handle(
                BridgeRequest(id=r.id or f"anon-{uuid.uuid4().hex}", model=r.model, prompt=r.prompt, image=r.image,
                              mime=work.content_type if work.content_type and work.content_type.startswith("image/") else None,
                              allow_cloud=r.allow_cloud, deferrable=r.deferrable,
                              response_topic=work.reply_topic, correlation_data=work.correlation,
                              response=work.template),
                local, self._deadline_s(work))
        except Exception as exc:  # the bridge translates cloud failures; anything else is ours
            log.exception("request %s: cloud offload failed", r.id)
            outcome = exc
        finally:
            with self._lock:
                self._cloud_waiting -= 1
            self._cloud_slots.release()
        self._answer(work, outcome)

    def status(self) -> dict:
        return {"thermal": self.sampler.snapshot(), "cloud": self.bridge.status() if self.bridge else {"state": "not configured"}}
