"""``k2edge serve``: wires config, engines, the scheduler, the MQTT transport, health and sd_notify.

Lifecycle: build (or load from the cache) every model's engines -> connect -> READY=1 -> serve,
sending WATCHDOG=1 only while every serving thread is looping -> on SIGTERM/SIGINT drain: status
``draining``, STOPPING=1, stop taking new requests (left un-acknowledged, so the broker keeps them
for the next start), finish and publish everything accepted, status ``offline``, exit 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import signal
import threading
import time
from collections import OrderedDict
from .. import __version__
from ..config.schema import DaemonConfig
from . import topics
from .protocol import BUSY, INTERNAL, PAYLOAD_TOO_LARGE, UNKNOWN_MODEL, RequestError, encode, error_response, ok_response
from .runtime import ModelRuntime
from .scheduler import Scheduler, Work
from .sdnotify import Notifier
from .stats import ServiceStats
from .transport import MqttTransport

log = logging.getLogger(__name__)
_PEEK_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')


class _Seen:
    """Requests answered or in flight (bounded), so a redelivered request is answered once.

    Keys are digests: response topics and correlation data are the client's, of any size.
    """

    def __init__(self, size: int = 65536) -> None:
        self._keys: OrderedDict = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    @staticmethod
    def digest(*parts) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for p in parts:
            data = p if isinstance(p, bytes) else str(p).encode()
            h.update(len(data).to_bytes(4, "little") + data)
        return h.digest()

    def add(self, key: bytes) -> bool:
        """Record ``key``; False when it was already there."""
        with self._lock:
            if key in self._keys:
                return False
            self._keys[key] = True
            if len(self._keys) > self._size:
                self._keys.popitem(last=False)
            return True

    def discard(self, key: bytes) -> None:
        """Forget ``key`` (its request was refused: a corrected resend deserves an answer)."""
        with self._lock:
            self._keys.pop(key, None)


class Daemon:
    """The serving process. ``run()`` blocks until drained; returns the exit code."""

    def __init__(self, cfg: DaemonConfig, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.notify = notifier or Notifier()
        self.stats = ServiceStats()
        self.models: dict[str, ModelRuntime] = {}
        self._draining = threading.Event()
        self._stop = threading.Event()
        self._seen = _Seen()
        self.transport: MqttTransport | None = None
        self.scheduler: Scheduler | None = None
        self.offload = None

    # setup ---------------------------------------------------------------------------------------
    def _build_models(self) -> None:
        from ..dla.boards import DEFAULT_BOARD, detect_board

        detected = detect_board()
        board = self.cfg.board or (detected.key if detected else DEFAULT_BOARD)
        for m in self.cfg.models:
            self.notify.notify(f"STATUS=building engines for {m.name}")
            log.info("model %s: building engines (profile %s, board %s)", m.name, m.profile, board)
            rt = ModelRuntime(m, self.cfg.service.max_batch, board, self.cfg.service.cache_dir)
            rt.activate()
            self.models[m.name] = rt

    @property
    def thermal_state(self) -> str:
        return self.offload.thermal.state if self.offload else "unknown"

    def status_payload(self, state: str) -> bytes:
        cloud = self.offload.bridge.status() if self.offload and self.offload.bridge else None
        return json.dumps({
            "state": state,
            "device": self.cfg.device_id,
            "version": __version__,
            "models": [{"name": name, "profile": rt.profile_name, "lanes": rt.lanes(), "batch_sizes": sorted(rt.engines),
                        "warm_profile": rt.warm_profile} for name, rt in self.models.items()],
            "topics": {"requests": topics.request_filter(self.cfg.prefix),
                       "pool": topics.shared_filter(self.cfg.fleet.group) if self.cfg.fleet.group else None},
            "thermal": self.thermal_state,
            "cloud": {"breaker": cloud["breaker"], "budget": cloud["budget"], "outbox": cloud["outbox"]} if cloud else None,
            "time": time.time(),
        }).encode()

    def telemetry_payload(self) -> bytes:
        snap = self.stats.snapshot()
        offload = self.offload.status() if self.offload else {"thermal": {"state": "unknown"}, "cloud": {"state": "not configured"}}
        counts = snap["counts"]
        answered = counts.get("ok", 0)
        snap.update({"device": self.cfg.device_id, "state": "draining" if self._draining.is_set() else "online",
                     "queue_depth": (self.scheduler.queue_depth() if self.scheduler else 0)
                                    + (self.offload.cloud_waiting if self.offload else 0),
                     "thermal": offload["thermal"], "cloud": offload["cloud"],
                     "escalation_rate": counts.get("escalated", 0) / answered if answered else 0.0, "time": time.time()})
        return json.dumps(snap).encode()

    # request path (network thread) ---------------------------------------------------------------
    def _on_message(self, msg, token) -> None:
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) or None
        correlation = getattr(props, "CorrelationData", None)
        content_type = getattr(props, "ContentType", None)
        user_props = {str(k): str(v) for k, v in (getattr(props, "UserProperty", None) or [])}
        model = topics.model_of(msg.topic) or ""
        work = Work(msg.topic, model, msg.payload, content_type, user_props, response_topic, correlation,
                    time.monotonic(), token)
        if self._draining.is_set():
            # not acknowledged: the broker keeps it in our session for the next start
            return
        if response_topic is not None and (not response_topic or any(c in response_topic for c in "+#")):
            work.response_topic = None  # answer on the fallback topic instead
            self._reply_now(work, "bad_request", f"Response Topic {response_topic[:80]!r} is not a topic one can publish to")
            return
        if len(msg.payload) > self.cfg.service.max_payload_bytes:
            self._reply_now(work, PAYLOAD_TOO_LARGE, f"payload of {len(msg.payload)} bytes exceeds the limit of "
                            f"{self.cfg.service.max_payload_bytes}")
            return
        if model not in self.models:
            self._reply_now(work, UNKNOWN_MODEL, f"no model {model!r} here; served: {sorted(self.models)}")
            return
        if not self.scheduler.offer(work):
            self._reply_now(work, BUSY, f"queue full ({self.cfg.service.queue_size} requests waiting); retry later")

    def _reply_now(self, work: Work, code: str, message: str) -> None:
        # routing only: the payload is not parsed here (network thread), its id is peeked
        rid = work.user_properties.get("id")
        if rid is None:
            m = _PEEK_ID.search(work.payload[:4096])
            rid = m.group(1).decode(errors="replace") if m else None
        self._respond(work, RequestError(code, message, rid))

    def _is_duplicate(self, work: Work) -> bool:
        req = work.request
        if req.id is None and work.correlation is None:
            return False
        work.dedupe_key = self._seen.digest(req.id or "", work.response_topic or "", work.correlation or b"", work.model)
        return not self._seen.add(work.dedupe_key)

    def _reply_topic(self, work: Work, rid: str | None) -> str:
        if work.response_topic:
            return work.response_topic
        return topics.result_topic(self.cfg.prefix, rid) if rid and topics.valid_level(rid) else topics.errors_topic(self.cfg.prefix)

    def _route(self, work: Work):
        """Before staging: let the thermal state / policy take a request off the local path."""
        rt = self.models[work.model]
        req = work.request
        work.reply_topic = self._reply_topic(work, req.id)
        work.template = {"id": req.id, "model": req.model, "profile": rt.profile_name, "device": self.cfg.device_id}
        k = req.top_k or rt.cfg.top_k
        routed = self.offload.before_inference(work, lambda: rt.run_one(req.image, req.tensor, k))
        if routed is None or routed is True:
            return bool(routed)
        return RequestError(routed.error_code or BUSY, routed.reason, req.id)

    def _latency(self, work: Work, **extra) -> tuple[dict, float]:
        total = (time.monotonic() - work.received) * 1e3
        latency = {k: round(v, 3) if isinstance(v, float) else v for k, v in work.timings.items()}
        latency.update({k: round(v, 3) for k, v in extra.items() if v is not None})
        latency["total"] = round(total, 3)
        return latency, total

    def _respond(self, work: Work, result) -> bool:
        """Publish the answer (or error) for ``work`` and acknowledge its request.

        Returns False when the request was handed to the cloud pool instead (it comes back later).
        """
        from ..cloud_bridge import LocalResult, Outcome

        handed_on = False
        try:
            if result is None:  # a duplicate delivery: answered already
                return True
            req = work.request
            rid = req.id if req else (result.request_id if isinstance(result, RequestError) else None)
            rt = self.models.get(work.model)
            if isinstance(result, Exception) and not isinstance(result, RequestError):
                result = RequestError(INTERNAL, f"internal error: {type(result).__name__}", rid)
            if isinstance(result, Outcome) and result.error_code:
                result = RequestError(result.error_code, result.reason, rid)
            if isinstance(result, RequestError):
                body = error_response(result.code, result.message, rid or result.request_id, work.model or None, self.cfg.device_id)
                self.stats.failed(result.code)
            elif isinstance(result, Outcome):
                top = list(result.local.top_k) if result.local else []
                cloud_ms = result.latency_ms if result.source == "cloud" else None
                latency, total = self._latency(work, cloud=cloud_ms)
                body = ok_response(req, self.cfg.device_id, rt.profile_name, top, latency, self.thermal_state,
                                   confidence=result.decision.confidence if result.decision else None, source=result.source,
                                   text=result.text if result.source == "cloud" else None,
                                   escalation_reason=result.reason if result.escalated else None,
                                   degraded=result.degraded, deferred=result.deferred)
                self.stats.answered(total)
                self.stats.count("escalated")
                self.stats.count(f"source_{result.source}")
            else:
                local = LocalResult.from_logits(result[0], rt.labels, req.top_k or rt.cfg.top_k)
                latency, total = self._latency(work)
                work.template = ok_response(req, self.cfg.device_id, rt.profile_name, list(local.top_k), latency, self.thermal_state)
                decision = self.offload.after_inference(work, local)
                if decision is None:
                    handed_on = True
                    return False
                if decision.action == "refuse":
                    body = error_response(decision.error_code or BUSY, decision.reason, rid, work.model, self.cfg.device_id)
                    self.stats.failed(decision.error_code or BUSY)
                else:
                    below = decision.confidence is not None and decision.threshold is not None and decision.confidence < decision.threshold
                    wanted_cloud = decision.escalate or decision.degraded or below
                    body = ok_response(req, self.cfg.device_id, rt.profile_name, list(local.top_k), latency, self.thermal_state,
                                       confidence=decision.confidence, degraded=decision.degraded,
                                       escalation_reason=decision.reason if wanted_cloud else None)
                    self.stats.answered(total)
                    if decision.escalate:
                        self.stats.count("escalated")
            if body["status"] == "ok" and req.deadline is not None and time.monotonic() > req.deadline:
                body = error_response("deadline_exceeded", f"answer ready after the {req.deadline_ms:g} ms deadline",
                                      rid, work.model, self.cfg.device_id)
                self.stats.failed("deadline_exceeded")
            if body["status"] == "error" and work.dedupe_key is not None:
                self._seen.discard(work.dedupe_key)
            topic = work.reply_topic or self._reply_topic(work, rid)
            self.transport.publish(topic, encode(body), qos=self.cfg.mqtt.qos, correlation=work.correlation)
            return True
        finally:
            if not handed_on:
                self.transport.done(work.ack_token)

    def _publish_deferred(self, topic: str, correlation: bytes | None, payload: dict) -> None:
        """Publish an outbox answer and wait for the broker's acknowledgement (raises if none)."""
        info = self.transport.publish(topic, encode(payload), qos=1, correlation=correlation)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if info.is_published():
                    return
            except (RuntimeError, ValueError):
                break
            time.sleep(0.02)
        raise RuntimeError(f"the broker did not acknowledge the deferred answer on {topic}")

    def _status_summary(self) -> tuple:
        """What the retained status says that can change while serving."""
        bridge = self.offload.bridge if self.offload else None
        cloud = (bridge.breaker.state, bridge.outbox.depth()) if bridge else None
        return (self.thermal_state, tuple(rt.profile_name for rt in self.models.values()), cloud)

    def _on_thermal(self, st) -> None:
        for rt in self.models.values():
            rt.prefer_warm(st.prefer_dla)
        if self.transport is not None and self.transport.connected.is_set():
            self.transport.publish(topics.status_topic(self.cfg.prefix), self.status_payload("online"), qos=1, retain=True)

    # run -----------------------------------------------------------------------------------------
    def _on_connected(self) -> None:
        self.transport.publish(topics.status_topic(self.cfg.prefix), self.status_payload("online"), qos=1, retain=True)

    def request_drain(self, *_):
        if not self._draining.is_set():
            log.info("drain requested: finishing accepted requests")
        self._draining.set()

    def run(self) -> int:
        cfg = self.cfg
        from .offload import Offload

        # secrets, TLS files and the cloud key are checked before the (possibly long) engine builds
        self.offload = Offload(cfg, answer=lambda w, outcome: self.scheduler.answer(w, outcome),
                               publish=self._publish_deferred, on_thermal=self._on_thermal)
        subs = [topics.request_filter(cfg.prefix)]
        if cfg.fleet.group:
            subs.append(topics.shared_filter(cfg.fleet.group))
        will = (topics.status_topic(cfg.prefix), json.dumps({"state": "offline", "device": cfg.device_id}).encode())
        self.transport = MqttTransport(cfg, subs, self._on_message, self._on_connected, will)
        self._build_models()
        self.scheduler = Scheduler(self.models, queue_size=cfg.service.queue_size, max_batch=cfg.service.max_batch,
                                   batch_timeout_ms=cfg.service.batch_timeout_ms, staging_threads=cfg.service.staging_threads,
                                   default_deadline_ms=cfg.service.default_deadline_ms, respond=self._respond,
                                   is_duplicate=self._is_duplicate, route=self._route, on_batch=self.stats.batch)
        self.scheduler.start()
        self.transport.start()
        self.offload.start()
        ready = False
        watchdog = self.notify.watchdog_interval()
        last_dog = last_telemetry = 0.0
        last_purge = time.monotonic()
        last_status = ""
        last_summary = self._status_summary()
        while not self._draining.is_set():
            now = time.monotonic()
            connected = self.transport.connected.is_set()
            if connected and not ready:
                ready = True
                self.notify.notify("READY=1", f"STATUS=serving {', '.join(self.models)} on {cfg.mqtt.host}:{cfg.mqtt.port}")
                last_status = "serving"
                log.info("serving %s on %s (prefix %s)", ", ".join(self.models), f"{cfg.mqtt.host}:{cfg.mqtt.port}", cfg.prefix)
            status = "serving" if connected else "waiting for the broker"
            if ready and status != last_status:
                self.notify.notify(f"STATUS={status}")
                last_status = status
            healthy = self.transport.alive and self.scheduler.alive(max_age=5.0)
            # systemd arms the watchdog at READY=1; before that the engine builds own the time
            if watchdog and ready and healthy and now - last_dog >= watchdog:
                self.notify.notify("WATCHDOG=1")
                last_dog = now
            if connected and now - last_telemetry >= cfg.service.telemetry_interval_s:
                self.transport.publish(topics.telemetry_topic(cfg.prefix), self.telemetry_payload(), qos=0)
                last_telemetry = now
                summary = self._status_summary()
                if summary != last_summary:  # keep the retained status true: breaker, outbox, thermal
                    self.transport.publish(topics.status_topic(cfg.prefix), self.status_payload("online"), qos=1, retain=True)
                    last_summary = summary
                if self.offload.bridge is not None and now - last_purge > 3600:
                    self.offload.bridge.outbox.purge_delivered()
                    last_purge = now
            self._draining.wait(0.2)
        return self._drain()

    def _drain(self) -> int:
        cfg = self.cfg
        self.notify.notify("STOPPING=1", "STATUS=draining")
        if self.transport.connected.is_set():
            self.transport.publish(topics.status_topic(cfg.prefix), self.status_payload("draining"), qos=1, retain=True)
        finished = self.scheduler.wait_idle(cfg.service.drain_timeout_s)
        if not finished:
            log.warning("drain timed out after %.0f s; unanswered requests stay with the broker", cfg.service.drain_timeout_s)
        offline = self.status_payload("offline")  # before the bridge closes its outbox
        self.offload.stop()
        self.transport.publish(topics.status_topic(cfg.prefix), offline, qos=1, retain=True)
        if not self.transport.wait_published(timeout=10):
            log.warning("some answers were not acknowledged by the broker before exit")
        self.transport.stop()
        self.scheduler.stop()
        for rt in self.models.values():
            rt.deactivate()
        log.info("drained; offline")
        return 0


def serve(cfg: DaemonConfig) -> int:
    """Run the daemon with SIGTERM/SIGINT draining it."""
    daemon = Daemon(cfg)
    signal.signal(signal.SIGTERM, daemon.request_drain)
    signal.signal(signal.SIGINT, daemon.request_drain)
    return daemon.run()
