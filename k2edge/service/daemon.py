"""``k2edge serve``: the daemon, built in one place in dependency order, then started, served and drained.

:meth:`Daemon.run` reads as the architecture:

* the edges: the thermal sampler, the request and control connections, the metrics, the answer book,
  the replies and the cloud side (secrets, TLS files and the cloud key are checked before the
  possibly long engine builds);
* the engines of each model, at the version the trusted store says (:mod:`k2edge.service.deploy`);
* per model, one :class:`~k2edge.service.batcher.Batcher` over its two clients: MQTT requests
  (:mod:`k2edge.service.request_path`) first, then stream frames (:mod:`k2edge.service.stream_path`);
* admission on the request connection, deploys on the control connection;
* start -> READY=1 -> serve, sending WATCHDOG=1 only while every serving thread is looping -> on
  SIGTERM/SIGINT drain in :attr:`Daemon.DRAIN` order: status ``draining``, STOPPING=1, stop taking new
  requests (left un-acknowledged, so the broker keeps them for the next start), answer everything
  accepted, wait for the broker to acknowledge every answer, status ``offline``, exit 0.
"""

from __future__ import annotations

import gc
import json
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import __version__, tracing
from ..config.resolve import card_task
from ..config.schema import ConfigError, DaemonConfig, check_profiles, read_secret, state_dir
from ..durable import make_dir
from ..engine.check import refusal, refused
from ..errors import Int8CheckRefused
from ..streams.evidence import MediaStore
from ..telemetry import thermal_sampler
from . import topics
from .answer_book import AnswerBook
from .batcher import Batcher, slots_for
from .deploy import MAX_WAITING, AuditTrail, ModelLifecycle, Versions, control_subscriptions
from .escalation import Escalation
from .event_store import EventStore
from .metrics import AnswerStats, PrometheusMetrics
from .replies import Replies
from .request_path import Backlog, RequestPath, RequestQueue
from .runtime import ModelRuntime
from .sdnotify import Notifier
from .live_view import LiveView
from .stream_path import StreamPath
from .transport import MqttTransport

log = logging.getLogger(__name__)

RESTART_STATUS = 75
"""The exit status after a SIGHUP's drain (EX_TEMPFAIL): the systemd unit's ``RestartForceExitStatus`` starts the
daemon again, which is how ``systemctl reload k2edge`` applies a changed config."""


class Daemon:
    """The serving process. ``run()`` builds, starts and serves it, and blocks until drained; returns
    the exit code.

    It is the thermal sampler's listener (a profile switch of each model's engines, between two
    batches) and the deploy lifecycle's host (it builds runtimes and announces deploys), and keeps the
    retained status, the telemetry and the watchdog.
    """

    DRAIN = (  # the order matters: each step needs what the ones after it still provide
        "_stop_admitting",            # new requests stay with the broker for the next start
        "_stop_streams",              # no new frames; the readers stop within the drain time
        "_stop_deploys",              # a deploy not committed is dropped unanswered: redelivered at the next start
        "_hand_back_cloud_queue",     # cloud calls not started go back to the outbox now, not after the wait below
        "_finish_requests",           # every admitted request answered or handed to the cloud
        "_finish_cloud_work",         # running cloud calls answered; queued ones back in the outbox
        "_stop_thermal",              # no profile switch from here on
        "_wait_answers_delivered",    # so every request can be acknowledged before we go
        "_say_offline",               # the retained status (the cloud's figures still readable), acknowledged
        "_close_cloud",               # after the deliveries: each marks its outbox row delivered
        "_disconnect",
        "_stop_batchers",
        "_close_answer_book",
        "_close_event_store",
        "_stop_tracing",              # what waits is exported (a few seconds at most)
        "_stop_metrics",
        "_stop_http",
        "_deactivate_engines",
    )

    def __init__(self, cfg: DaemonConfig, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.notify = notifier or Notifier()
        self._draining = threading.Event()  # shared with admission: a signal stops it at once
        self._restart = False  # SIGHUP: the drain ends in RESTART_STATUS
        self._control_ready = threading.Event()  # the control connection had its subscriptions once
        self._status_lock = threading.Lock()
        self._built = threading.Event()  # everything run() builds exists: status may be published

    # run: build, start, serve, drain -----------------------------------------------------------------
    def run(self) -> int:
        cfg, state = self.cfg, _usable_state_dir(state_dir(self.cfg))
        # the edges, checked before the (possibly long) engine builds: profiles, secrets, TLS files, the cloud key
        check_profiles(cfg)
        self.thermal = thermal_sampler(cfg.thermal, on_transition=self.on_thermal)
        # the state the status tells: set once the models and streams follow it (on_thermal), so that no status says
        # a new state beside the limits and profiles of the old one
        self._thermal_told = self.thermal.state.state
        self.transport = MqttTransport(cfg, "requests", self._request_filters(), self._will())
        self.control = MqttTransport(self._control_config(), "control", control_subscriptions(cfg))
        self.metrics = self._start_metrics()
        if cfg.tracing is not None:
            tracing.configure(cfg.tracing, cfg.device_id)
        http_secrets, stream_passwords = self._http_secrets(), self._stream_passwords()
        self.stats = AnswerStats(self.metrics)
        self.book = AnswerBook(state, self.transport, retention_s=cfg.mqtt.session_expiry_s)
        self.replies = Replies(cfg, self.book, self.stats, self.thermal)
        self.escalation = Escalation(cfg, self.thermal, self.replies, self.book)
        versions = Versions(cfg, state, AuditTrail(cfg, state, self.control))
        self.http = self._bind_http(*http_secrets)  # a port in use is told before the builds, as the metrics' is
        # the engines, then per model a batcher over its clients: requests first (deadlines), then frames
        try:
            runtimes = self._build_models(versions)
        except BaseException as exc:
            if isinstance(exc, ConfigError):  # a version refused at start: the fleet's audit topic hears it too
                versions.trail.leave()
            self._stop_http()
            raise
        wakeups = {name: threading.Condition() for name in runtimes}
        self.streams = self._stream_path(runtimes, wakeups, stream_passwords)
        if self.http is not None:
            self.http.streams = self.streams
            self.http.start()
        s = cfg.service
        backlog = Backlog(s.queue_size, 2 * s.queue_size + 64, self.transport)
        decoders = ThreadPoolExecutor(s.staging_threads, thread_name_prefix="k2edge-decode") if s.staging_threads > 1 else None
        queues = {name: RequestQueue(wakeups[name], backlog, self.replies, self.escalation, decoders, s.max_image_pixels)
                  for name in runtimes}
        self.batchers = {name: Batcher(name, rt, self.thermal,
                                       [queues[name], *([self.streams.frames(name)] if self.streams else [])],
                                       wakeups[name], s.batch_timeout_ms / 1e3, on_batch=self.stats.batch)
                         for name, rt in runtimes.items()}
        self.path = RequestPath(cfg, queues, self.batchers, self.book, self.replies, backlog, self.transport,
                                self._draining)
        self.lifecycle = ModelLifecycle(cfg, versions, self.control, self.batchers, self)
        self._decoders = decoders
        self._built.set()
        # what was built lives as long as the daemon: out of the collector's sight, a full collection (which
        # stops every thread, a request's fallback timer included) stays short on a loaded CPU
        gc.freeze()
        # start, readers of each stage before its writers
        for b in self.batchers.values():
            b.start()
        self.transport.start(self.path)
        self.control.start(self.lifecycle)
        if self.streams is not None:
            self.streams.start()
        self.lifecycle.start()
        self.escalation.start()
        self.thermal.start()
        self._serve()
        status = self._drain()
        return RESTART_STATUS if self._restart and status == 0 else status

    # building -------------------------------------------------------------------------------------------
    def _request_filters(self) -> list[str]:
        subs = [topics.request_filter(self.cfg.prefix)]
        if self.cfg.fleet.group:
            subs.append(topics.shared_filter(self.cfg.fleet.group))
        return subs

    def _will(self) -> tuple[str, bytes]:
        return topics.status_topic(self.cfg.prefix), json.dumps({"state": "offline", "device": self.cfg.device_id}).encode()

    def _control_config(self) -> DaemonConfig:
        """Deploys and rollbacks go on a connection of their own: QoS 1 acknowledgements go in arrival
        order per connection, so a deploy building engines for minutes would hold back every request's."""
        cfg = self.cfg
        return cfg.model_copy(update={"mqtt": cfg.mqtt.model_copy(update={"client_id": f"{cfg.client_id}-control"}),
                                      "service": cfg.service.model_copy(update={"queue_size": MAX_WAITING})})

    def _start_metrics(self) -> PrometheusMetrics | None:
        if self.cfg.metrics is None:
            return None
        metrics = PrometheusMetrics()
        metrics.start(self.cfg.metrics.host, self.cfg.metrics.port)
        return metrics

    def _http_secrets(self) -> tuple[str | None, str | None]:
        """The web app's token and password (read before the engine builds: a missing file fails at once)."""
        h = self.cfg.http
        if h is None:
            return None, None
        where = self.cfg.where
        token = read_secret(h.token_file, what=f"{where}: http.token_file") if h.token_file else None
        password = read_secret(h.password_file, what=f"{where}: http.password_file") if h.password_file else None
        return token, password

    def _stream_passwords(self) -> dict[str, str]:
        """Each enabled stream's password_file, read before the engines build (a missing file fails at once)."""
        where = self.cfg.where
        return {s.name: read_secret(s.password_file, what=f"{where}: streams.{i}.password_file")
                for i, s in enumerate(self.cfg.streams) if s.enabled and s.password_file}

    def _bind_http(self, token: str | None, password: str | None) -> LiveView | None:
        """The live view, its address taken (served once the streams exist)."""
        if self.cfg.http is None:
            return None
        view = LiveView(None, self.metrics, token=token, password=password,
                        disabled=tuple(s.name for s in self.cfg.streams if not s.enabled))
        view.bind(self.cfg.http.host, self.cfg.http.port)
        return view

    def _build_models(self, versions: Versions) -> dict[str, ModelRuntime]:
        from ..dla.boards import DEFAULT_BOARD, detect_board

        detected = detect_board()
        self._board = self.cfg.board or (detected.key if detected else DEFAULT_BOARD)
        runtimes = {}
        for m in self.cfg.models:
            plan = versions.initial(m)
            task = card_task(plan.config.onnx, plan.config.card)
            if task is not None:  # a misfit refused now, not after minutes of building (else once it is built)
                self._fits(plan.config, task)
            self.notify.notify(f"STATUS=building engines for {m.name}")
            rt = runtimes[m.name] = self.build_runtime(plan.config, plan.version)
            self.escalation.use(m.name, self._escalation_for(rt))
            versions.started(plan)
            if self.metrics is not None:
                self.metrics.set_model(m.name, plan.version, rt.profile_name, rt.int8_check, rt.memory)
        return runtimes

    def _escalation_for(self, rt: ModelRuntime):
        """The model's escalation settings, checked against what its card says the model is."""
        return self._fits(rt.cfg, rt.task)

    def _fits(self, m, task: str):
        """``m``'s escalation settings for a model of ``task`` (see :meth:`EscalationSettings.for_task`), once its
        settings and every enabled stream on it are found to fit the task (streams take detection models).

        Raises:
            ConfigError: naming the setting or the stream, and the card's task.
        """
        where = self.cfg.where
        i = next(i for i, c in enumerate(self.cfg.models) if c.name == m.name)
        try:
            settings = m.escalation.for_task(task, f"models.{i}.escalation")
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc} (card task {task!r})") from None
        for j, s in enumerate(self.cfg.streams):
            if s.enabled and s.model == m.name and task != "detection":
                raise ConfigError(f"{where}: streams.{j}: model {s.model!r} is a {task} model; "
                                  "streams take detection models (tracking needs boxes)")
        return settings

    def _stream_path(self, runtimes: dict[str, ModelRuntime], wakeups: dict, passwords: dict[str, str]) -> StreamPath | None:
        """The enabled ``[[streams]]``, each checked against its model's task; None without any (and without
        events of an earlier run still waiting in the event store to be delivered)."""
        enabled = [s for s in self.cfg.streams if s.enabled]
        store = state_dir(self.cfg) / "events.sqlite"
        if not enabled and not store.exists():
            return None
        path = StreamPath(enabled, self.cfg.prefix, self.transport, EventStore(store), wakeups, self.metrics,
                          on_change=self.publish_status, passwords=passwords,
                          media=MediaStore(store.parent / "media", self.cfg.storage.max_bytes,
                                           self.cfg.storage.max_age_days * 86400), cloud=self.escalation.bridge)
        for name, rt in runtimes.items():
            path.follow_labels(name, rt.labels)
        return path

    # the deploy lifecycle's host -------------------------------------------------------------------
    def build_runtime(self, m, version: str | None) -> ModelRuntime:
        """An activated runtime of one model version, its engines built through the cache (at start, and
        on the deploy lifecycle's worker thread); its batcher runs it in the profile the thermal state asks for."""
        log.info("model %s%s: building engines (profile %s, board %s)", m.name, f" {version}" if version else "",
                 m.profile, self._board)
        s = self.cfg.service
        rt = ModelRuntime(m, s.max_batch, self._board, s.cache_dir, version=version, threads_per_lane=s.threads_per_lane)
        self._escalation_for(rt)
        if self.cfg.trust is not None and self.cfg.trust.require_int8_check:
            bad = refused([e.info.int8_check for e in (rt.normal[1], *((rt.warm[1],) if rt.warm else ()))])
            if bad is not None:
                raise Int8CheckRefused(f"model {m.name}{f' {version}' if version else ''}: {refusal(bad)}", bad)
        rt.activate()
        return rt

    def deployed(self, name: str) -> None:
        """A deploy or rollback swapped new engines in: policy, metrics, status."""
        rt = self.batchers[name].next_runtime()
        self.escalation.use(name, self._escalation_for(rt))
        if self.streams is not None:
            self.streams.follow_labels(name, rt.labels)
        if self.metrics is not None:
            self.metrics.set_model(name, rt.version, rt.profile_name, rt.int8_check, rt.memory)
        self.publish_status()

    # the thermal sampler's listener ----------------------------------------------------------------
    def on_thermal(self, st) -> None:
        """A thermal transition (the sampler's thread): each model's engines switch profile between
        two batches, without waiting here; each stream's rate limit changes at once (so the status tells it)."""
        log.warning("thermal state %s: %s", st.state, st.reason)
        if self.streams is not None:
            self.streams.on_thermal(st.state, st.reason)
        for name, batcher in self.batchers.items():
            rt = batcher.follow_thermal()
            if self.metrics is not None:
                self.metrics.set_model(name, rt.version, rt.profile_name, rt.int8_check, rt.memory)
        self._thermal_told = st.state
        self.publish_status()

    # status and telemetry --------------------------------------------------------------------------
    def publish_status(self) -> None:
        """The retained status, now (from any thread: a deploy's progress, a thermal transition). The first
        "online" waits until the control connection, too, has its subscriptions: whoever waits for it can deploy."""
        if not self._built.is_set():
            return
        if self.control.subscribed.is_set():
            self._control_ready.set()
        if self.transport.connected.is_set() and self._control_ready.is_set():
            state = "draining" if self._draining.is_set() else "online"
            with self._status_lock:  # retained: the last one published must be the newest
                self.transport.publish(topics.status_topic(self.cfg.prefix), self.status_payload(state), qos=1, retain=True)

    def status_payload(self, state: str) -> bytes:
        cloud = self.escalation.bridge.status() if self.escalation.bridge else None
        trust = self.cfg.trust
        return json.dumps({
            "state": state,
            "device": self.cfg.device_id,
            "version": __version__,
            # what the next batch runs on: a thermal switch just asked for is what the status tells
            "models": [{"name": name, "model_version": rt.version, "task": rt.task, "profile": rt.profile_name,
                        "lanes": rt.lanes(), "precision_flops": rt.precision_flops(), "batch_sizes": sorted(rt.engines),
                        "slots": slots_for(rt), "memory": rt.memory,
                        "warm_profile": rt.warm_profile, "cache": rt.cache,
                        "int8_check": rt.int8_check.to_dict() if rt.int8_check is not None else None}
                       for name, rt in self._running().items()],
            "topics": {"requests": topics.request_filter(self.cfg.prefix),
                       "pool": topics.shared_filter(self.cfg.fleet.group) if self.cfg.fleet.group else None},
            "thermal": self._thermal_told,
            "cloud": {"breaker": cloud["breaker"], "budget": cloud["budget"], "outbox": cloud["outbox"]} if cloud else None,
            "trust": {"keys": len(trust.keys), "allow_unsigned": trust.allow_unsigned} if trust is not None else None,
            "deploy": self.lifecycle.status(),
            "streams": {**(self.streams.status() if self.streams is not None else {}), **self._disabled_streams()},
            "storage": self.streams.media.status() if self.streams is not None else None,
            "metrics": f"{self.cfg.metrics.host}:{self.metrics.port}" if self.metrics is not None and self.metrics.port else None,
            "http": f"{self.cfg.http.host}:{self.http.port}" if self.http is not None and self.http.port else None,
            "time": time.time(),
        }).encode()

    def _disabled_streams(self) -> dict:
        """The configured streams with ``enabled = false``, each named in the status as such (they were absent, so a
        camera switched off in the config looked like one never configured)."""
        from ..streams.source import redact

        return {s.name: {"state": "disabled", "source": redact(s.source), "model": s.model}
                for s in self.cfg.streams if not s.enabled}

    def telemetry_payload(self) -> bytes:
        snap = self.stats.snapshot()
        esc = self.escalation.status()
        counts = snap["counts"]
        answered = counts.get("ok", 0)
        snap.update({"device": self.cfg.device_id, "state": "draining" if self._draining.is_set() else "online",
                     "queue_depth": self.path.backlog.waiting + esc["cloud_waiting"],
                     "unacknowledged_answers": self.book.undelivered,
                     "read_pauses": self.transport.pauses,
                     "thermal": self.thermal.snapshot(), "cloud": esc["cloud"],
                     "escalation_rate": counts.get("escalated", 0) / answered if answered else 0.0, "time": time.time()})
        return json.dumps(snap).encode()

    def _status_summary(self) -> tuple:
        """What the retained status says that can change while serving."""
        bridge = self.escalation.bridge
        # the budget left too: it was stale in the retained status between other changes (the telemetry had it)
        cloud = (bridge.breaker.state, bridge.outbox.depth(), bridge.budget.remaining()) if bridge else None
        return (self._thermal_told, tuple((rt.profile_name, slots_for(rt)) for rt in self._running().values()), cloud)

    def _running(self) -> dict[str, ModelRuntime]:
        """Each model's engines, as its next batch runs them."""
        return {name: b.next_runtime() for name, b in self.batchers.items()}

    def _observe(self) -> None:
        """The gauges of /metrics (serving loop, once a second)."""
        m, esc = self.metrics, self.escalation
        m.set_queue_depth(self.path.backlog.waiting + esc.cloud_waiting)
        sample = self.thermal.latest_sample
        m.set_thermal(self.thermal.state.state, sample.temperatures_c if sample is not None else None)
        if esc.bridge is not None:
            m.set_breaker(esc.bridge.breaker.state)
            m.set_outbox_depth(esc.bridge.outbox.depth())
        m.set_trace_dropped(tracing.tracer().dropped)

    def alive(self) -> bool:
        """Every serving thread loops (the watchdog)."""
        return self.transport.alive and all(b.alive(max_age=5.0) for b in self.batchers.values())

    # serving --------------------------------------------------------------------------------------------
    def request_drain(self, *_):
        if not self._draining.is_set():
            log.info("drain requested: finishing accepted requests")
        self._draining.set()  # admission stops at once, not at the serving loop's next turn

    def request_restart(self, *_):
        """SIGHUP: there is no reload in place; a drain, then exit status :data:`RESTART_STATUS`, which the systemd
        unit restarts (``RestartForceExitStatus``), so the config is read again and nothing accepted is lost."""
        if not self._restart:
            log.info("SIGHUP: k2edge has no reload in place: draining, then exiting with status %d for systemd to "
                     "start it again with the config as it is now", RESTART_STATUS)
        self._restart = True
        self.request_drain()

    def _serve(self) -> None:
        """Until a drain is requested: READY=1 once connected, the watchdog, the status, the telemetry."""
        cfg = self.cfg
        ready = False
        announced = (0, False)  # (request connections, control subscribed once) when the status was last published
        watchdog = self.notify.watchdog_interval()
        last_dog = last_telemetry = last_flush = 0.0
        last_purge = time.monotonic()
        last_status = ""
        last_summary = self._status_summary()
        failures: dict[str, int] = {}  # what made a turn fail, and how often
        while not self._draining.is_set():
            try:
                now = time.monotonic()
                connected = self.transport.connected.is_set()
                # (re)connected: the will may have said offline; or the control connection can take deploys now
                seen = (self.transport.connections, self._control_ready.is_set() or self.control.subscribed.is_set())
                if seen != announced:
                    announced = seen
                    self.publish_status()
                if connected and not ready:
                    ready = True
                    self.notify.notify("READY=1", f"STATUS=serving {', '.join(self.batchers)} on {cfg.mqtt.host}:{cfg.mqtt.port}")
                    last_status = "serving"
                    log.info("serving %s on %s (prefix %s)", ", ".join(self.batchers), f"{cfg.mqtt.host}:{cfg.mqtt.port}", cfg.prefix)
                status = "serving" if connected else "waiting for the broker"
                if ready and status != last_status:
                    self.notify.notify(f"STATUS={status}")
                    last_status = status
                # systemd arms the watchdog at READY=1; before that the engine builds own the time
                if watchdog and ready and now - last_dog >= watchdog and self.alive():
                    self.notify.notify("WATCHDOG=1")
                    last_dog = now
                if now - last_flush >= 1.0:
                    self.book.flush()
                    if self.escalation.bridge is not None:
                        self.escalation.tick()
                    if self.streams is not None:
                        self.streams.tick()
                    if self.metrics is not None:
                        self._observe()
                    last_flush = now
                if connected and now - last_telemetry >= cfg.service.telemetry_interval_s:
                    self.transport.publish(topics.telemetry_topic(cfg.prefix), self.telemetry_payload(), qos=0)
                    last_telemetry = now
                    summary = self._status_summary()
                    # keep the retained status true: breaker, outbox, thermal; a stream's live figures
                    if summary != last_summary or (self.streams is not None and self.streams.any_up()):
                        self.publish_status()
                        last_summary = summary
                    if self.escalation.bridge is not None and now - last_purge > 3600:
                        self.escalation.bridge.outbox.purge_delivered()
                        last_purge = now
            except Exception as exc:  # a bug in one turn (a status, a tick) must not end serving: log it, go on
                failed = f"{type(exc).__name__}: {exc}"[:300]
                if len(failures) >= 100:  # failures whose text varies: the counts start again
                    failures.clear()
                if failed not in failures:  # each distinct failure with its traceback once; then counted
                    log.exception("serving loop: %s (serving goes on)", failed)
                failures[failed] = failures.get(failed, 0) + 1
                if failures[failed] in (10, 100, 1000):
                    log.error("serving loop: %s, %d times", failed, failures[failed])
            self._draining.wait(0.2)

    # drain, in DRAIN order -------------------------------------------------------------------------
    def _drain(self) -> int:
        for step in self.DRAIN:
            getattr(self, step)()
        log.info("drained; offline")
        return 0

    def _stop_admitting(self) -> None:
        self._draining.set()
        self.notify.notify("STOPPING=1", "STATUS=draining")
        self.publish_status()  # draining

    def _stop_streams(self) -> None:
        if self.streams is not None:
            self.streams.stop(min(5.0, self.cfg.service.drain_timeout_s))

    def _stop_deploys(self) -> None:
        self.lifecycle.stop(5.0)

    def _hand_back_cloud_queue(self) -> None:
        self.escalation.hand_back_queued()

    def _finish_requests(self) -> None:
        timeout = self.cfg.service.drain_timeout_s
        if not self.replies.wait_idle(timeout):
            log.warning("drain timed out after %.0f s; unanswered requests stay with the broker", timeout)

    def _finish_cloud_work(self) -> None:
        self.escalation.stop()  # running cloud calls finish; their answers are published

    def _stop_thermal(self) -> None:
        self.thermal.stop()

    def _wait_answers_delivered(self) -> None:
        if not self.book.wait_delivered(self.cfg.service.drain_timeout_s):
            log.warning("%d answer(s) not acknowledged by the broker before exit; their requests stay with the broker",
                        self.book.undelivered)

    def _say_offline(self) -> None:
        delivered = threading.Event()
        self.transport.publish(topics.status_topic(self.cfg.prefix), self.status_payload("offline"), qos=1, retain=True,
                               on_delivered=delivered.set)
        delivered.wait(2.0 if self.transport.connected.is_set() else 0.0)

    def _close_cloud(self) -> None:
        self.escalation.close()

    def _disconnect(self) -> None:
        self.transport.stop()
        self.control.stop()

    def _stop_batchers(self) -> None:
        for b in self.batchers.values():
            b.stop()
        if self._decoders is not None:
            self._decoders.shutdown(wait=False)

    def _close_answer_book(self) -> None:
        self.book.close()

    def _close_event_store(self) -> None:
        if self.streams is not None:
            self.streams.close()

    def _stop_tracing(self) -> None:
        tracing.shutdown(min(5.0, self.cfg.service.drain_timeout_s))

    def _stop_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()

    def _stop_http(self) -> None:
        if self.http is not None:
            self.http.stop()

    def _deactivate_engines(self) -> None:
        for b in self.batchers.values():
            b.runtime.deactivate()


def serve(cfg: DaemonConfig) -> int:
    """Run the daemon with SIGTERM/SIGINT draining it, SIGHUP draining it for a restart, and SIGUSR1 writing every thread's stack to stderr (the
    journal): where a daemon that does not answer, or does not stop, is waiting."""
    import faulthandler

    daemon = Daemon(cfg)
    signal.signal(signal.SIGTERM, daemon.request_drain)
    signal.signal(signal.SIGINT, daemon.request_drain)
    signal.signal(signal.SIGHUP, daemon.request_restart)  # its default, a death without a drain, lost the backlog
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    return daemon.run()


def _usable_state_dir(state: Path) -> Path:
    """``state``, created if need be; one clear error when it cannot hold the daemon's state.

    Raises:
        ConfigError: a file is there, or the system refuses the folder (permission, a read-only mount).
    """
    problem = make_dir(state)
    if problem:
        raise ConfigError(f"service.state_dir {str(state)!r} {problem}")
    return state
