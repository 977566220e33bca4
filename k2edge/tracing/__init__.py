"""OpenTelemetry traces: requests, batches, engine segments, cloud calls, deploys and stream events.

Off unless the daemon config has a ``[tracing]`` table (:func:`configure`); the ``tracing`` extra
(``pip install 'k2edge[tracing]'``: opentelemetry-api and -sdk) is imported only then. Spans leave
through :class:`~k2edge.tracing.export.BoundedBatchProcessor` as OTLP/HTTP protobuf
(:mod:`k2edge.tracing.otlp`): a collector that is down or slow costs the exporter thread, never a
request, and what is lost is counted (``k2edge_trace_spans_dropped_total``).

Typical use (the daemon does this)::

    from k2edge import tracing
    tracing.configure(cfg.tracing, device_id="jetson-07")
    ...
    tracing.shutdown()
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping
from urllib.parse import urlsplit

from ..errors import BackendUnavailable, K2EdgeError
from .records import Sampler, format_traceparent, parse_traceparent
from .tracer import OFF, BatchTrace, RequestTrace, Tracer, current_span, event, headers, note, segments

__all__ = ["BatchTrace", "RequestTrace", "Tracer", "TracingError", "cloud_span", "configure", "current_span", "description_span",
           "event", "format_traceparent", "headers", "note", "parse_traceparent", "segments", "shutdown", "tracer"]

_tracer = OFF


class TracingError(K2EdgeError):
    """Tracing cannot start: the ``tracing`` extra is missing or an ``OTEL_*`` variable is invalid."""


def tracer():
    """The process's tracer: :data:`~k2edge.tracing.tracer.OFF` until :func:`configure`."""
    return _tracer


def configure(settings, device_id: str | None = None, environ: Mapping[str, str] = os.environ, exporter=None) -> Tracer:
    """Start tracing with ``settings`` (a :class:`~k2edge.config.tracing.TracingSettings`).

    Args:
        settings: the ``[tracing]`` table.
        device_id: the resource's ``service.instance.id``.
        environ: where the ``OTEL_*`` variables are read.
        exporter: replaces the OTLP/HTTP exporter (``export(spans) -> bool``, ``close()``).

    Raises:
        TracingError: opentelemetry-sdk is not installed, or an ``OTEL_*`` variable is invalid.
    """
    global _tracer
    from .export import BoundedBatchProcessor
    from .otlp import OtlpHttpExporter, TracingConfigError, resolve

    try:
        target = resolve(settings, environ)
    except TracingConfigError as exc:
        raise TracingError(str(exc)) from None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace import sampling
    except ImportError as exc:
        raise BackendUnavailable("[tracing] needs opentelemetry-sdk: pip install 'k2edge[tracing]'") from exc
    from .. import __version__

    root = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
            "traceidratio": sampling.TraceIdRatioBased(target.ratio)}
    name = target.sampler.removeprefix("parentbased_")
    sampler = sampling.ParentBased(root[name]) if target.sampler.startswith("parentbased_") else root[name]
    attrs = {"service.name": settings.service_name, "service.version": __version__}
    if device_id:
        attrs["service.instance.id"] = device_id
    processor = BoundedBatchProcessor(exporter or OtlpHttpExporter(target.url, settings.export_timeout_s),
                                      settings.queue_size, settings.batch_size, settings.export_interval_ms / 1e3)
    provider = TracerProvider(sampler=sampler, resource=Resource.create(attrs), shutdown_on_exit=False)
    provider.add_span_processor(processor)
    shutdown()
    _tracer = Tracer(provider, processor, settings.frame_sample_rate, Sampler(target.sampler, target.ratio))
    from . import logs
    logs.install()
    return _tracer


def shutdown(timeout_s: float = 5.0) -> None:
    """Export what waits (within ``timeout_s``) and turn tracing off."""
    global _tracer
    if _tracer is not OFF:
        old, _tracer = _tracer, OFF
        old.shutdown(timeout_s)
        from . import logs
        logs.uninstall()


@contextlib.contextmanager
def cloud_span(parent: RequestTrace | None, model: str, base_url: str, **attributes) -> Iterator[object]:
    """A cloud call: a GenAI ``chat`` client span, current while the block runs, so the K2 client sends its
    ``traceparent`` and notes attempts, retry waits, breaker state and tokens on it. A child of ``parent`` (a
    request's trace), else of the current span, else a new trace. Yields the span, or None with tracing off."""
    t = _tracer
    if not t.on:
        yield None
        return
    parts = urlsplit(base_url)
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.system": "openai", "gen_ai.request.model": model or "",
             **attributes}
    if parts.hostname:
        attrs["server.address"] = parts.hostname
        attrs["server.port"] = parts.port or (443 if parts.scheme == "https" else 80)
    context = t.event_context(attributes["k2edge.event.id"]) if "k2edge.event.id" in attributes else None
    with t.span(f"chat {model}", parent, kind="client", attributes=attrs, context=context) as span:
        yield span


def description_span(event_id: str, model: str, base_url: str):
    """A stream event's cloud description call (a context manager): a GenAI ``chat`` client span, current
    while the block runs (its ``traceparent`` goes to K2 with the call). Its parent is the event's span when
    the event's frame was traced, else the current span, else none (a new trace). Yields the span, or None
    with tracing off."""
    return cloud_span(None, model, base_url, **{"k2edge.event.id": event_id})
