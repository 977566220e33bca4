"""``k2edge serve``: wires config, engines, the request path, the MQTT transport, health and sd_notify.

Lifecycle: decide which version of each model runs and build (or load from the cache) its engines
(:mod:`k2edge.service.deploy`) -> connect -> READY=1 -> serve,
sending WATCHDOG=1 only while every serving thread is looping -> on SIGTERM/SIGINT drain: status
``draining``, STOPPING=1, stop taking new requests (left un-acknowledged, so the broker keeps them
for the next start), answer everything accepted, wait for the broker to acknowledge every answer,
status ``offline``, exit 0. A request's own path is in :mod:`k2edge.service.request_path`; deploys,
rollbacks and the audit trail in :mod:`k2edge.service.deploy`, on a second MQTT connection.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time

from .. import __version__
from ..config.schema import ConfigError, DaemonConfig, state_dir
from ..engine.check import refusal
from ..errors import BuildError
from . import topics
from .answer_book import AnswerBook
from .deploy import MAX_WAITING, ModelLifecycle
from .escalation import Escalation
from .request_path import RequestPath
from .runtime import ModelRuntime
from .event_store import EventStore
from .sdnotify import Notifier
from .stream_path import StreamPath
from .metrics import Metrics, ServiceStats
from .transport import MqttTransport

log = logging.getLogger(__name__)


class Daemon:
    """The serving process. ``run()`` blocks until drained; returns the exit code.

    It wires the objects (the request connection serves the request path; the control connection
    the deploy lifecycle; the answer book publishes through the request connection), builds the
    engines, keeps status, telemetry and the watchdog, and drains in :attr:`DRAIN` order. It is the
    thermal governor's listener (a profile switch is a swap of each model's engines) and the
    deploy lifecycle's host (it builds runtimes and announces deploys).
    """

    DRAIN = (  # the order matters: each step needs what the ones after it still provide
        "_stop_admitting",            # new requests stay with the broker for the next start
        "_stop_streams",              # no new frames; the readers stop within the drain time
        "_stop_deploys",              # a deploy not committed is dropped unanswered: redelivered at the next start
        "_finish_requests",           # every admitted request answered or handed to the cloud
        "_finish_cloud_work",         # running cloud calls answered; queued ones back in the outbox
        "_wait_answers_delivered",    # so every request can be acknowledged before we go
        "_close_cloud",               # after the deliveries: each marks its outbox row delivered
        "_say_offline",               # the retained status, acknowledged by the broker
        "_disconnect",
        "_stop_lines",
        "_close_answer_book",
        "_close_event_store",
        "_stop_metrics",
        "_release_engines",
    )

    def __init__(self, cfg: DaemonConfig, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.notify = notifier or Notifier()
        self.stats: ServiceStats | None = None
        self.models: dict[str, ModelRuntime] = {}
        self._draining = threading.Event()
        self.transport: MqttTransport | None = None
        self.answers: AnswerBook | None = None
        self.escalation: Escalation | None = None
        self.path: RequestPath | None = None
        self.streams: StreamPath | None = None
        self.lifecycle: ModelLifecycle | None = None
        self.control: MqttTransport | None = None
        self._control_ready = threading.Event()  # the control connection had its subscriptions once
        self.metrics = None
        self._board: str | None = None
        self._status_lock = threading.Lock()

    # setup ---------------------------------------------------------------------------------------
    def _build_models(self) -> None:
        from ..dla.boards import DEFAULT_BOARD, detect_board

        detected = detect_board()
        self._board = self.cfg.board or (detected.key if detected else DEFAULT_BOARD)
        for m in self.cfg.models:
            plan = self.lifecycle.initial(m)
            self.notify.notify(f"STATUS=building engines for {m.name}")
            self.models[m.name] = self.build_runtime(plan.config, plan.version)
            self.escalation.policy.models[m.name] = self._escalation_for(self.models[m.name])
            self.lifecycle.started(plan)
            if self.metrics is not None:
                self.metrics.set_model(m.name, plan.version, self.models[m.name].profile_name, self.models[m.name].int8_check)

    def _escalation_for(self, rt: ModelRuntime):
        """The model's escalation settings, checked against what its card says the model is."""
        i = next(i for i, m in enumerate(self.cfg.models) if m.name == rt.name)
        try:
            return rt.cfg.escalation.for_task(rt.task, f"models.{i}.escalation")
        except ValueError as exc:
            raise ConfigError(f"{self.cfg.source or 'config'}: {exc} (card task {rt.task!r})") from None

    def _stream_path(self) -> StreamPath | None:
        """The enabled ``[[streams]]``, each checked against its model's task; None without any (and without
        events of an earlier run still waiting in the event store to be delivered)."""
        enabled = [s for s in self.cfg.streams if s.enabled]
        store = state_dir(self.cfg) / "events.sqlite"
        if not enabled and not store.exists():
            return None
        for i, s in enumerate(self.cfg.streams):
            task = self.models[s.model].task
            if s.enabled and task != "detection":
                raise ConfigError(f"{self.cfg.source or 'config'}: streams.{i}: model {s.model!r} is a {task} model; "
                                  "streams take detection models (tracking needs boxes)")
        return StreamPath(enabled, self.cfg.prefix, self.transport, EventStore(store),
                          self.metrics, on_change=self.publish_status)

    # the deploy lifecycle's host -------------------------------------------------------------------
    def build_runtime(self, m, version: str | None) -> ModelRuntime:
        """An activated runtime of one model version, its engines built through the cache, on the
        profile the thermal state asks for (at start, and on the deploy lifecycle's worker thread)."""
        log.info("model %s%s: building engines (profile %s, board %s)", m.name, f" {version}" if version else "",
                 m.profile, self._board)
        s = self.cfg.service
        rt = ModelRuntime(m, s.max_batch, self._board, s.cache_dir, version=version, threads_per_lane=s.threads_per_lane or None)
        self._escalation_for(rt)
        if self.cfg.trust is not None and self.cfg.trust.require_int8_check:
            why = refusal([e.info.int8_check for e in (rt.normal[1], *((rt.warm[1],) if rt.warm else ()))])
            if why:
                raise BuildError(f"model {m.name}{f' {version}' if version else ''}: {why}")
        rt.activate()
        return rt.with_profile(self.escalation.prefer_dla)

    def deployed(self, name: str, rt: ModelRuntime) -> None:
        """A deploy or rollback swapped ``rt`` in: policy, metrics, status."""
        self._thermal_profile(name)  # a transition during the build
        self.escalation.policy.models[name] = self._escalation_for(rt)
        if self.metrics is not None:
            self.metrics.set_model(name, rt.version, rt.profile_name, rt.int8_check)
        self.publish_status()

    # the thermal governor's listener ---------------------------------------------------------------
    def on_thermal(self, st) -> None:
        """A thermal transition (the sampler's thread): each model's engines switch profile between
        two batches, without waiting here."""
        for name in self.models:
            rt = self._thermal_profile(name)
            if self.metrics is not None:
                self.metrics.set_model(name, rt.version, rt.profile_name, rt.int8_check)
        self.publish_status()

    def _thermal_profile(self, name: str) -> ModelRuntime:
        """Ask model ``name``'s line for the profile the thermal state prefers; the runtime it will run."""
        rt = self.path.running(name).with_profile(self.escalation.prefer_dla)
        self.path.swap(name, rt, None)
        return rt

    def publish_status(self) -> None:
        """The retained status, now (from any thread: a deploy's progress, a thermal transition). The first
        "online" waits until the control connection, too, has its subscriptions: whoever waits for it can deploy."""
        if self.control is not None and self.control.subscribed.is_set():
            self._control_ready.set()
        if self.transport is not None and self.transport.connected.is_set() and self._control_ready.is_set():
            state = "draining" if self._draining.is_set() else "online"
            with self._status_lock:  # retained: the last one published must be the newest
                self.transport.publish(topics.status_topic(self.cfg.prefix), self.status_payload(state), qos=1, retain=True)

    @property
    def thermal_state(self) -> str:
        return self.escalation.thermal.state if self.escalation else "unknown"

    def status_payload(self, state: str) -> bytes:
        cloud = self.escalation.bridge.status() if self.escalation and self.escalation.bridge else None
        trust = self.cfg.trust
        return json.dumps({
            "state": state,
            "device": self.cfg.device_id,
            "version": __version__,
            "models": [{"name": name, "model_version": rt.version, "task": rt.task, "profile": rt.profile_name,
                        "lanes": rt.lanes(), "batch_sizes": sorted(rt.engines), "slots": self._slots(name),
                        "warm_profile": rt.warm_profile, "cache": rt.cache,
                        "int8_check": rt.int8_check.to_dict() if rt.int8_check is not None else None}
                       for name, rt in self.models.items()],
            "topics": {"requests": topics.request_filter(self.cfg.prefix),
                       "pool": topics.shared_filter(self.cfg.fleet.group) if self.cfg.fleet.group else None},
            "thermal": self.thermal_state,
            "cloud": {"breaker": cloud["breaker"], "budget": cloud["budget"], "outbox": cloud["outbox"]} if cloud else None,
            "trust": {"keys": len(trust.keys), "allow_unsigned": trust.allow_unsigned} if trust is not None else None,
            "deploy": self.lifecycle.status() if self.lifecycle else None,
            "streams": self.streams.status() if self.streams is not None else {},
            "metrics": f"{self.cfg.metrics.host}:{self.metrics.port}" if self.metrics is not None and self.metrics.port else None,
            "time": time.time(),
        }).encode()

    def _slots(self, name: str) -> int | None:
        """Batches the model's line keeps in flight at once (1: run inline)."""
        return self.path.lines[name].slots if self.path is not None else None

    def telemetry_payload(self) -> bytes:
        snap = self.stats.snapshot()
        esc = self.escalation.status() if self.escalation else {"thermal": {"state": "unknown"}, "cloud": {"state": "not configured"},
                                                                 "cloud_waiting": 0}
        counts = snap["counts"]
        answered = counts.get("ok", 0)
        snap.update({"device": self.cfg.device_id, "state": "draining" if self._draining.is_set() else "online",
                     "queue_depth": (self.path.waiting() if self.path else 0) + esc["cloud_waiting"],
                     "unacknowledged_answers": self.answers.undelivered if self.answers else 0,
                     "read_pauses": self.transport.pauses if self.transport else 0,
                     "thermal": esc["thermal"], "cloud": esc["cloud"],
                     "escalation_rate": counts.get("escalated", 0) / answered if answered else 0.0, "time": time.time()})
        return json.dumps(snap).encode()

    def _status_summary(self) -> tuple:
        """What the retained status says that can change while serving."""
        bridge = self.escalation.bridge if self.escalation else None
        cloud = (bridge.breaker.state, bridge.outbox.depth()) if bridge else None
        return (self.thermal_state, tuple((rt.profile_name, self._slots(name)) for name, rt in self.models.items()), cloud)

    def _observe(self) -> None:
        """The gauges of /metrics (serving loop, once a second)."""
        m, esc = self.metrics, self.escalation
        m.set_queue_depth(self.path.waiting() + esc.cloud_waiting)
        sample = esc.sampler.latest_sample
        m.set_thermal(self.thermal_state, sample.temperatures_c if sample is not None else None)
        if esc.bridge is not None:
            m.set_breaker(esc.bridge.breaker.state)
            m.set_outbox_depth(esc.bridge.outbox.depth())

    # run -----------------------------------------------------------------------------------------
    def _control_config(self) -> DaemonConfig:
        """Deploys and rollbacks go on a connection of their own: QoS 1 acknowledgements go in arrival
        order per connection, so a deploy building engines for minutes would hold back every request's."""
        cfg = self.cfg
        return cfg.model_copy(update={"mqtt": cfg.mqtt.model_copy(update={"client_id": f"{cfg.client_id}-control"}),
                                      "service": cfg.service.model_copy(update={"queue_size": MAX_WAITING})})

    def request_drain(self, *_):
        if not self._draining.is_set():
            log.info("drain requested: finishing accepted requests")
        if self.path is not None:
            self.path.draining.set()  # stop admitting at once, not at the serving loop's next turn
        self._draining.set()

    def run(self) -> int:
        cfg = self.cfg
        # secrets, TLS files and the cloud key are checked before the (possibly long) engine builds
        self.escalation = Escalation(cfg, self)
        subs = [topics.request_filter(cfg.prefix)]
        if cfg.fleet.group:
            subs.append(topics.shared_filter(cfg.fleet.group))
        will = (topics.status_topic(cfg.prefix), json.dumps({"state": "offline", "device": cfg.device_id}).encode())
        self.transport = MqttTransport(cfg, "requests", subs, will)
        self.answers = AnswerBook(state_dir(cfg), self.transport, retention_s=cfg.mqtt.session_expiry_s)
        self.lifecycle = ModelLifecycle(cfg, state_dir(cfg))
        self.control = MqttTransport(self._control_config(), "control", self.lifecycle.subscriptions())
        if cfg.metrics is not None:
            self.metrics = Metrics()
            self.metrics.start(cfg.metrics.host, cfg.metrics.port)
        self.stats = ServiceStats(self.metrics)
        self._build_models()
        self.streams = self._stream_path()
        self.path = RequestPath(cfg, self.models, self.answers, self.escalation, self.stats, self.transport, self.streams)
        self.lifecycle.attach(self.control, self.path, self)
        self.path.start()
        self.transport.start(self.path)
        self.control.start(self.lifecycle)
        if self.streams is not None:
            self.streams.start(self.path.lines)
        self.lifecycle.start()
        self.escalation.start()
        ready = False
        announced = (0, False)  # (request connections, control subscribed once) when the status was last published
        watchdog = self.notify.watchdog_interval()
        last_dog = last_telemetry = last_flush = 0.0
        last_purge = time.monotonic()
        last_status = ""
        last_summary = self._status_summary()
        while not self._draining.is_set():
            now = time.monotonic()
            connected = self.transport.connected.is_set()
            # (re)connected: the will may have said offline; or the control connection can take deploys now
            seen = (self.transport.connections, self._control_ready.is_set() or self.control.subscribed.is_set())
            if seen != announced:
                announced = seen
                self.publish_status()
            if connected and not ready:
                ready = True
                self.notify.notify("READY=1", f"STATUS=serving {', '.join(self.models)} on {cfg.mqtt.host}:{cfg.mqtt.port}")
                last_status = "serving"
                log.info("serving %s on %s (prefix %s)", ", ".join(self.models), f"{cfg.mqtt.host}:{cfg.mqtt.port}", cfg.prefix)
            status = "serving" if connected else "waiting for the broker"
            if ready and status != last_status:
                self.notify.notify(f"STATUS={status}")
                last_status = status
            healthy = self.transport.alive and self.path.alive(max_age=5.0)
            # systemd arms the watchdog at READY=1; before that the engine builds own the time
            if watchdog and ready and healthy and now - last_dog >= watchdog:
                self.notify.notify("WATCHDOG=1")
                last_dog = now
            if now - last_flush >= 1.0:
                self.answers.flush()
                if self.streams is not None:
                    self.streams.tick()
                if self.metrics is not None:
                    self._observe()
                last_flush = now
            if connected and now - last_telemetry >= cfg.service.telemetry_interval_s:
                self.transport.publish(topics.telemetry_topic(cfg.prefix), self.telemetry_payload(), qos=0)
                last_telemetry = now
                summary = self._status_summary()
                if summary != last_summary:  # keep the retained status true: breaker, outbox, thermal
                    self.publish_status()
                    last_summary = summary
                if self.escalation.bridge is not None and now - last_purge > 3600:
                    self.escalation.bridge.outbox.purge_delivered()
                    last_purge = now
            self._draining.wait(0.2)
        return self._drain()

    # drain, in DRAIN order -------------------------------------------------------------------------
    def _drain(self) -> int:
        for step in self.DRAIN:
            getattr(self, step)()
        log.info("drained; offline")
        return 0

    def _stop_admitting(self) -> None:
        self.path.draining.set()
        self.notify.notify("STOPPING=1", "STATUS=draining")
        self.publish_status()  # draining

    def _stop_streams(self) -> None:
        if self.streams is not None:
            self.streams.stop(min(5.0, self.cfg.service.drain_timeout_s))

    def _stop_deploys(self) -> None:
        self.lifecycle.stop(5.0)

    def _finish_requests(self) -> None:
        timeout = self.cfg.service.drain_timeout_s
        if not self.path.wait_idle(timeout):
            log.warning("drain timed out after %.0f s; unanswered requests stay with the broker", timeout)

    def _finish_cloud_work(self) -> None:
        self._offline = self.status_payload("offline")
        self.escalation.stop()  # running cloud calls finish; their answers are published

    def _wait_answers_delivered(self) -> None:
        if not self.answers.wait_delivered(self.cfg.service.drain_timeout_s):
            log.warning("%d answer(s) not acknowledged by the broker before exit; their requests stay with the broker",
                        self.answers.undelivered)

    def _close_cloud(self) -> None:
        self.escalation.close()

    def _say_offline(self) -> None:
        delivered = threading.Event()
        self.transport.publish(topics.status_topic(self.cfg.prefix), self._offline, qos=1, retain=True,
                               on_delivered=delivered.set)
        delivered.wait(2.0 if self.transport.connected.is_set() else 0.0)

    def _disconnect(self) -> None:
        self.transport.stop()
        self.control.stop()

    def _stop_lines(self) -> None:
        self.path.stop()

    def _close_answer_book(self) -> None:
        self.answers.close()

    def _close_event_store(self) -> None:
        if self.streams is not None:
            self.streams.close()

    def _stop_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()

    def _release_engines(self) -> None:
        for rt in self.models.values():
            rt.deactivate()


def serve(cfg: DaemonConfig) -> int:
    """Run the daemon with SIGTERM/SIGINT draining it."""
    daemon = Daemon(cfg)
    signal.signal(signal.SIGTERM, daemon.request_drain)
    signal.signal(signal.SIGINT, daemon.request_drain)
    return daemon.run()
