"""The daemon's numbers: what it answered, how fast, and the state around it.

:class:`AnswerStats` is the one place an answer is counted: it keeps the counters and recent
latencies that the daemon's telemetry reports, and hands each observation on to the
:class:`PrometheusMetrics` exporter (``/metrics``) when the config has a ``[metrics]`` table.

One :class:`PrometheusMetrics` per daemon, with its own ``CollectorRegistry`` (never the process-global
one, so two daemons in one test process, or a library user's own metrics, do not collide). The
daemon calls the ``observe_*`` / ``set_*`` methods from its request path and its status loop,
and :meth:`PrometheusMetrics.start` serves ``/metrics`` when the config has a ``[metrics]`` table::

    metrics = PrometheusMetrics()
    metrics.set_model("digits", version="1.2.0", profile="c2")
    metrics.observe_answer("digits", "ok", "edge", {"queue": 0.2, "infer": 0.4, "total": 0.9})
    metrics.start("127.0.0.1", 9108)       # GET http://127.0.0.1:9108/metrics
    metrics.stop()

Every label takes values from a closed set, so a flood of requests for made-up model names cannot
grow the series without bound: a model that was never :meth:`~PrometheusMetrics.set_model`-registered is
counted as ``(unknown)``, an unknown status or reason as ``other``.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections import Counter as Tally
from collections import deque
from typing import Mapping

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import choose_encoder, gzip_accepted

from ..cloud_bridge.policy import reason_kind
from ..errors import K2EdgeError
from .protocol import ERROR_CODES

log = logging.getLogger(__name__)

__all__ = ["BREAKER_STATES", "ESCALATION_REASONS", "STAGES", "STATUSES", "THERMAL_STATES", "AnswerStats", "MetricsError",
           "PrometheusMetrics"]

STAGES = ("queue", "stage", "infer", "cloud", "total")
"""The stages of an answer's ``latency_ms`` that get a histogram; other keys are ignored."""
STATUSES = ("ok", *ERROR_CODES)
SOURCES = ("edge", "cloud", "none")
ESCALATION_REASONS = ("prompt", "low_confidence", "thermal", "no_edge_model", "other")
THERMAL_STATES = ("normal", "warm", "hot", "critical", "unknown")
BREAKER_STATES = ("closed", "open", "half_open")
UNKNOWN_MODEL = "(unknown)"
OTHER = "other"

# 0.25 ms (a CPU lane at batch 1) to 30 s (a slow cloud answer)
_LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_FRAME_AGE_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class MetricsError(K2EdgeError):
    """The metrics endpoint cannot start (address in use, bad host)."""


# exported of an INT8 check's measures: every one a tolerance can set
INT8_MEASURES = ("agreement", "recall", "precision", "score_ratio", "strict_recall", "strict_precision", "cosine")
INT8_VERDICT = {"passed": 1.0, "fallback": 1.0, "inconclusive": 0.0, "failed": -1.0}  # measure="verdict"


class PrometheusMetrics:
    """The daemon's Prometheus exporter: its metrics, in a registry of their own, served on ``/metrics``.

    Metric names (all prefixed ``k2edge_``): ``requests_total{model,status,source}``,
    ``latency_seconds{model,stage}`` (histogram), ``queue_depth``, ``batch_size{model}`` (histogram),
    ``thermal_state{k2edge_thermal_state=...}`` (one series per state, 1 for the current one),
    ``temperature_celsius{sensor}``, ``escalations_total{model,reason}``,
    ``cloud_breaker_state{k2edge_cloud_breaker_state=...}``, ``outbox_depth``,
    ``model_info{model,version,profile}``, ``int8_check{model,profile,measure}`` (the INT8 accuracy check
    of the engines a model runs: ``agreement``, ``recall``, ``precision``, ``score_ratio`` or ``cosine``
    against FP32, as its task measures; ``verdict``: 1 passed, 0 inconclusive (too few check samples), -1 failed;
    ``judged``: the samples or FP32 boxes the verdict stands on; no series for a model without INT8 layers),
    ``stream_frames_total{stream,outcome}`` (``decoded``, ``processed``, ``dropped``, ``shed`` by the thermal
    limit, ``skipped``: non-reference frames not decoded while the processing side used few), ``stream_max_fps{stream}`` (the most a stream is processed at now: 0 paused), ``stream_up{stream}``,
    ``stream_reconnects_total{stream}``, ``stream_frame_age_seconds{stream}`` (histogram, decoded to published);
    ``media_bytes``, ``media_files``, ``media_degraded``, ``media_removed_total{reason}`` (``budget``, ``age``);
    ``trace_spans_dropped_total`` (spans the tracing exporter lost).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter("k2edge_requests", "Answers sent, by model, status (ok or error code) and source",
                                 ["model", "status", "source"], registry=r)
        self._latency = Histogram("k2edge_latency_seconds", "Time an answer, or a processed stream frame, spent in each stage",
                                  ["model", "stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self._queue = Gauge("k2edge_queue_depth", "Requests accepted and not yet answered", registry=r)
        self._batch = Histogram("k2edge_batch_size", "Items (requests and stream frames) per batch run on an engine", ["model"],
                                buckets=_BATCH_BUCKETS, registry=r)
        self._thermal = Enum("k2edge_thermal_state", "The thermal governor's state", states=list(THERMAL_STATES),
                             registry=r)
        self._temperature = Gauge("k2edge_temperature_celsius", "Temperature of each watched sensor", ["sensor"],
                                  registry=r)
        self._escalations = Counter("k2edge_escalations", "Requests the policy sent (or wanted to send) to the cloud",
                                    ["model", "reason"], registry=r)
        self._breaker = Enum("k2edge_cloud_breaker_state", "The cloud circuit breaker's state",
                             states=list(BREAKER_STATES), registry=r)
        self._outbox = Gauge("k2edge_outbox_depth", "Deferred requests waiting in the cloud outbox", registry=r)
        self._model = Info("k2edge_model", "The version and profile each served model runs", ["model"], registry=r)
        self._int8 = Gauge("k2edge_int8_check", "Each served model's INT8 engines measured against FP32 at build, "
                           "by measure", ["model", "profile", "measure"], registry=r)
        self._stream_frames = Counter("k2edge_stream_frames", "Frames of each stream: decoded, processed, dropped "
                                      "(decoded and never processed, fps throttling included), shed (by the thermal "
                                      "limit) or skipped (non-reference frames not decoded while few were used)", ["stream", "outcome"], registry=r)
        self._stream_max_fps = Gauge("k2edge_stream_max_fps", "The most each stream is processed at now, by the thermal "
                                     "state (its own rate when not throttled, NaN when that is not known; 0 paused)",
                                     ["stream"], registry=r)
        self._memory = Gauge("k2edge_model_memory_bytes", "Memory each served model's engines hold, by kind: host (resident "
                             "memory their activation added) and device (TensorRT's own accounting)", ["model", "kind"],
                             registry=r)
        self._memory_series: dict[str, list[tuple[str, str]]] = {}
        self._stream_escalations = Counter("k2edge_stream_escalations", "Stream events K2 was asked about, by outcome: "
                                           "described, failed, or skipped (the job queue full)", ["stream", "outcome"],
                                           registry=r)
        self._stream_up = Gauge("k2edge_stream_up", "1 while a stream delivers frames", ["stream"], registry=r)
        self._stream_reconnects = Counter("k2edge_stream_reconnects", "Successful reopenings of each stream's source",
                                          ["stream"], registry=r)
        self._media_bytes = Gauge("k2edge_media_bytes", "Bytes the stream media (snapshots) take", registry=r)
        self._media_files = Gauge("k2edge_media_files", "Stream media files kept", registry=r)
        self._media_degraded = Gauge("k2edge_media_degraded", "1 while media cannot be written (events go out "
                                     "without them)", registry=r)
        self._media_removed = Counter("k2edge_media_removed", "Media removed: budget (to make room) or age",
                                      ["reason"], registry=r)
        self._frame_age = Histogram("k2edge_stream_frame_age_seconds", "A processed frame's age: decoded to published",
                                    ["stream"], buckets=_FRAME_AGE_BUCKETS, registry=r)
        self._trace_dropped = Counter("k2edge_trace_spans_dropped", "Trace spans lost: the export queue was full or the "
                                      "collector did not take them ([tracing])", registry=r)
        self._totals: dict[tuple, float] = {}
        self._int8_series: dict[str, list[tuple[str, str, str]]] = {}
        self._models: set[str] = set()
        self._sensors: set[str] = set()
        self._lock = threading.Lock()
        self._server = None
        self._thread = None
        self._thermal.state("unknown")
        self._breaker.state("closed")

    # -- what the daemon observes -------------------------------------------------------------

    def set_model(self, model: str, version: str | None, profile: str | None, int8_check=None,
                  memory: Mapping[str, int] | None = None) -> None:
        """Register a served model (or its new version after a deploy, a rollback or a thermal switch), with
        its engines' INT8 check (an :class:`~k2edge.engine.check.Int8Check`; None without INT8 layers) and the
        bytes its engines hold by kind (``host``, ``device``; see :attr:`ModelRuntime.memory`)."""
        with self._lock:
            self._models.add(model)
            for labels in self._memory_series.pop(model, []):
                self._memory.remove(*labels)
            self._memory_series[model] = [(model, kind) for kind in (memory or {})]
            for kind, value in (memory or {}).items():
                self._memory.labels(model, kind).set(float(value))
            for labels in self._int8_series.pop(model, []):
                self._int8.remove(*labels)
            if int8_check is not None:
                values = {m: float(int8_check.measures[m]) for m in INT8_MEASURES if m in int8_check.measures}
                values["verdict"] = INT8_VERDICT.get(int8_check.status, -1.0)
                values["judged"] = float(int8_check.power[1])
                series = [(model, profile or "", m) for m in values]
                for labels in series:
                    self._int8.labels(*labels).set(values[labels[2]])
                self._int8_series[model] = series
        self._model.labels(model=model).info({"version": version or "unversioned", "profile": profile or ""})

    def forget_model(self, model: str) -> None:
        """A model no longer served: its info series goes; its counters stay (they are history)."""
        with self._lock:
            self._models.discard(model)
            for labels in self._memory_series.pop(model, []):
                self._memory.remove(*labels)
        try:
            self._model.remove(model)
        except KeyError:
            pass

    def _model_label(self, model: str | None) -> str:
        return model if model in self._models else UNKNOWN_MODEL

    def observe_answer(self, model: str | None, status: str, source: str | None,
                       latency_ms: Mapping[str, float] | None = None) -> None:
        """Count one answer sent and its latency by stage.

        Args:
            model: the model asked for (unregistered names count as ``(unknown)``).
            status: ``ok`` or the error code.
            source: ``edge`` or ``cloud``; None for errors answered before either ran.
            latency_ms: the answer's ``latency_ms`` (milliseconds by stage, as in the response);
                keys outside :data:`STAGES` and non-numbers are ignored.
        """
        m = self._model_label(model)
        self._requests.labels(model=m, status=status if status in STATUSES else OTHER,
                              source=source if source in SOURCES else "none").inc()
        self.observe_latency(model, latency_ms)

    def observe_latency(self, model: str | None, latency_ms: Mapping[str, float] | None) -> None:
        """One answer's or processed stream frame's latency by stage (milliseconds, keys outside
        :data:`STAGES` and non-numbers ignored)."""
        m = self._model_label(model)
        for stage, ms in (latency_ms or {}).items():
            if stage in STAGES and isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms >= 0:
                self._latency.labels(model=m, stage=stage).observe(ms / 1000.0)

    def observe_batch(self, model: str, size: int) -> None:
        """One batch run on an engine (observed per batch, not per answer, so a batch of 8 counts once)."""
        self._batch.labels(model=self._model_label(model)).observe(size)

    def set_queue_depth(self, depth: int) -> None:
        self._queue.set(depth)

    def set_thermal(self, state: str, temperatures_c: Mapping[str, float] | None = None) -> None:
        """The governor's state and the latest temperature of each sensor (sensors that vanished are dropped)."""
        self._thermal.state(state if state in THERMAL_STATES else "unknown")
        temps = {k: v for k, v in (temperatures_c or {}).items() if v is not None}
        with self._lock:
            for gone in self._sensors - set(temps):
                self._temperature.remove(gone)
            self._sensors = set(temps)
        for sensor, value in temps.items():
            self._temperature.labels(sensor=sensor).set(value)

    def observe_escalation(self, model: str | None, reason: str) -> None:
        """One escalation; ``reason`` is one of :data:`ESCALATION_REASONS` (else counted as ``other``)."""
        self._escalations.labels(model=self._model_label(model),
                                 reason=reason if reason in ESCALATION_REASONS else OTHER).inc()

    def set_breaker(self, state: str) -> None:
        self._breaker.state(state if state in BREAKER_STATES else "open")

    def set_outbox_depth(self, depth: int) -> None:
        self._outbox.set(depth)

    def set_stream(self, stream: str, up: bool, counts: Mapping[str, int], reconnects: int) -> None:
        """A stream's state and its running totals (counters only ever move forward to them). Stream names come
        from the config, a closed set."""
        for outcome in ("decoded", "processed", "dropped", "shed", "skipped"):
            self._advance(self._stream_frames.labels(stream=stream, outcome=outcome), (stream, outcome), counts.get(outcome, 0))
        self._advance(self._stream_reconnects.labels(stream=stream), (stream, "reconnects"), reconnects)
        self._stream_up.labels(stream=stream).set(1 if up else 0)

    def set_stream_limit(self, stream: str, max_fps: float | None) -> None:
        """A stream's thermal limit (:class:`~k2edge.streams.throttle.StreamLimit`'s ``max_fps``)."""
        self._stream_max_fps.labels(stream=stream).set(float("nan") if max_fps is None else max_fps)

    def observe_stream_escalation(self, stream: str, outcome: str) -> None:
        """One stream escalation's outcome (``described``, ``failed`` or ``skipped``)."""
        self._stream_escalations.labels(stream=stream, outcome=outcome).inc()

    def _advance(self, counter, key: tuple, total: float) -> None:
        """Move a counter up to ``total`` (the stream keeps the count; the counter follows it)."""
        with self._lock:
            delta, self._totals[key] = total - self._totals.get(key, 0), max(total, self._totals.get(key, 0))
        if delta > 0:
            counter.inc(delta)

    def set_media(self, status: Mapping) -> None:
        """The media store's figures (:meth:`MediaStore.status <k2edge.streams.evidence.MediaStore.status>`)."""
        self._media_bytes.set(status["bytes"])
        self._media_files.set(status["files"])
        self._media_degraded.set(1 if status["degraded"] else 0)
        for reason, total in status["removed"].items():
            self._advance(self._media_removed.labels(reason=reason), ("media", reason), total)

    def set_trace_dropped(self, total: int) -> None:
        """The tracing processor's running total of dropped spans (the counter follows it)."""
        self._advance(self._trace_dropped, ("trace", "dropped"), total)

    def observe_frame_age(self, stream: str, seconds: float) -> None:
        self._frame_age.labels(stream=stream).observe(max(0.0, seconds))

    # -- exposing them ------------------------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition format (the web app's ``/metrics``)."""
        return generate_latest(self.registry)

    def exposition(self, headers) -> tuple[bytes, str, dict]:
        """(body, content type, headers) for a scrape with these request headers, negotiated as prometheus_client's
        own server does: OpenMetrics when the scraper asks for it (Prometheus does), gzip when it accepts it."""
        encoder, content_type = choose_encoder(headers.get("Accept", ""))
        body = encoder(self.registry)
        if gzip_accepted(headers.get("Accept-Encoding", "")):
            return gzip.compress(body), content_type, {"Content-Encoding": "gzip"}
        return body, content_type, {}

    def start(self, host: str = "127.0.0.1", port: int = 9108) -> tuple[str, int]:
        """Serve ``/metrics`` over HTTP on a daemon thread.

        Returns:
            (host, port) bound (the port chosen when ``port`` is 0).

        Raises:
            MetricsError: already started, or the address cannot be bound.
        """
        if self._server is not None:
            raise MetricsError("the metrics endpoint is already running")
        from .http_server import BoundedHandler, BoundedHTTPServer

        metrics = self

        class Handler(BoundedHandler):
            def do_GET(self, head: bool = False) -> None:  # noqa: N802 (http.server's name); every path, as prometheus_client's
                try:
                    self.send_body(200, *metrics.exposition(self.headers), head=head)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                except Exception:
                    log.exception("metrics: rendering /metrics failed")
                    self.send_body(500, b"internal error\n", "text/plain; charset=utf-8", head=head)

            def do_HEAD(self) -> None:  # noqa: N802
                self.do_GET(head=True)

        try:
            self._server = BoundedHTTPServer((host, port), Handler)
        except OSError as exc:
            raise MetricsError(f"metrics: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="k2edge-metrics", daemon=True)
        self._thread.start()
        return host, self._server.server_port

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()  # shutdown() alone keeps the port bound
        self._thread.join(timeout=5)
        self._server = self._thread = None

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server is not None else None


class AnswerStats:
    """What the daemon answered: counters and recent latencies for its telemetry (thread-safe); each
    observation also goes to ``metrics`` (the Prometheus exporter) when given.

    Args:
        metrics: the Prometheus exporter, or None without ``[metrics]``.
        window: how many recent latencies and batch sizes the percentiles are taken over.
    """

    def __init__(self, metrics: PrometheusMetrics | None = None, window: int = 2048) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        self._latency = deque(maxlen=window)
        self._batch = deque(maxlen=window)
        self.counts: Tally = Tally()
        self.started = time.time()

    def answer(self, model: str | None, body: dict, total_ms: float) -> None:
        """One answer sent (ok or error): its status, source, escalation and latency."""
        ok = body["status"] == "ok"
        status = "ok" if ok else body["error"]["code"]
        escalated = body.get("escalation_reason")
        with self._lock:
            self.counts[status] += 1
            if ok:
                self._latency.append(total_ms)
                self.counts[f"source_{body['source']}"] += 1
                if escalated and not body["degraded"]:
                    self.counts["escalated"] += 1
        if self.metrics is not None:
            self.metrics.observe_answer(model, status, body.get("source"), body.get("latency_ms"))
            if escalated:
                self.metrics.observe_escalation(model, reason_kind(escalated))

    def count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def batch(self, model: str, size: int) -> None:
        """One batch run on an engine."""
        with self._lock:
            self._batch.append(size)
            self.counts["batches"] += 1
        if self.metrics is not None:
            self.metrics.observe_batch(model, size)

    def snapshot(self) -> dict:
        with self._lock:
            lat = np.array(self._latency, dtype=np.float64)
            batches = list(self._batch)
            counts = dict(self.counts)
        pct = {f"p{q}": round(float(np.percentile(lat, q)), 3) for q in (50, 90, 99)} if lat.size else {}
        return {
            "uptime_s": round(time.time() - self.started, 1),
            "counts": counts,
            "latency_ms": pct,
            "mean_batch": round(sum(batches) / len(batches), 2) if batches else None,
        }
