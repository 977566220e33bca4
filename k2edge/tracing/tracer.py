"""The tracing facade the daemon calls: a no-op unless ``[tracing]`` is configured.

Every hook in the request path reads ``item.trace`` (None when tracing is off or the request is not
sampled) or ``tracer().on``: off, tracing costs the daemon one attribute test per hook, and
OpenTelemetry is never imported. On, a request gets one :class:`RequestTrace`: its span (a
messaging ``process`` span, the child of the requester's ``traceparent``) opens at admission, and
each phase — admit, queue, stage, infer, decide, cloud, publish — is a child span that starts where
the previous one ended, so the phases add up to the request's span exactly. Phases are written from
``time.monotonic()`` instants the path already takes (one offset to wall time,
:func:`~k2edge.tracing.records.wall_ns`). Spans that other code must see while they run (a cloud
call, whose ``traceparent`` goes to K2 as an HTTP header) are *current* in a context variable:
:func:`note` and :func:`headers` act on the current one.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterator, Mapping

from . import records as R
from .records import (CONSUMER, ChildSpan, Link, RootSpan, Sampler, TraceStateHeader, format_traceparent, parse_traceparent,
                      wall_ns)


__all__ = ["RequestTrace", "BatchTrace", "Tracer", "OFF", "current_span", "headers", "note", "segments"]

_current: contextvars.ContextVar = contextvars.ContextVar("k2edge_current_span", default=None)
_segments: contextvars.ContextVar = contextvars.ContextVar("k2edge_segment_records", default=None)


def current_span():
    """The live span of this thread's work (a cloud call), or None."""
    return _current.get()


def note(**attributes) -> None:
    """Set attributes on the current span, if any (attribute names with dots: pass a dict with ``**``)."""
    span = _current.get()
    if span is not None:
        span.set_attributes(attributes)


def event(name: str, **attributes) -> None:
    """Add an event (a retry, a breaker refusal) to the current span, if any."""
    span = _current.get()
    if span is not None:
        span.add_event(name, attributes)


def headers() -> dict[str, str]:
    """The HTTP headers that carry the current span's context (``traceparent``, ``tracestate``), or none."""
    span = _current.get()
    if span is None:
        return {}
    ctx = span.get_span_context()
    out = {"traceparent": format_traceparent(ctx.trace_id, ctx.span_id, ctx.trace_flags.sampled)}
    if ctx.trace_state:
        out["tracestate"] = ctx.trace_state.to_header()
    return out


def segments() -> list | None:
    """Where the engine records the segments of the batch being traced: ``(segment, lane, start, end)``
    tuples (``time.monotonic()``), or None (tracing off, or a batch without a traced item)."""
    return _segments.get()


class RequestTrace:
    """One sampled request's spans. The request path calls :meth:`mark` as the request enters each phase,
    :meth:`user_properties` for the answer, and :meth:`delivered` once the broker has the answer."""

    __slots__ = ("tracer", "span", "phase", "since", "attributes")

    def __init__(self, tracer: "Tracer", span, received: float, phase: str = "admit") -> None:
        self.tracer, self.span = tracer, span
        self.phase, self.since = phase, received
        self.attributes: dict | None = None

    @property
    def context(self):
        return self.span.get_span_context()

    def traceparent(self) -> str:
        ctx = self.context
        return format_traceparent(ctx.trace_id, ctx.span_id, True)

    def mark(self, phase: str, at: float | None = None, **attributes) -> None:
        """The request enters ``phase`` at ``at`` (``time.monotonic()``; now when None): the phase it was in is
        written as a child span ending there."""
        if phase == self.phase:
            return
        at = time.monotonic() if at is None else at
        if at < self.since:  # a phase whose instant was taken before the last mark (a shared batch time)
            at = self.since
        self.tracer._child(self, self.phase, self.since, at, self.attributes)
        self.phase, self.since, self.attributes = phase, at, attributes or None

    def decided(self, action: str, reason: str | None, escalate: bool) -> None:
        """The escalation policy's decision, on the phase the request is in (``decide``, or ``stage`` when it was
        decided before inference)."""
        self.attributes = {**(self.attributes or {}), "k2edge.decision": action, "k2edge.decision.reason": reason or "",
                           "k2edge.escalate": bool(escalate)}

    def user_properties(self) -> tuple[tuple[str, str], ...]:
        """The answer's MQTT 5 user properties: the ``traceparent`` of this request's span."""
        return (("traceparent", self.traceparent()),)

    def end(self, outcome: str | None = None, at: float | None = None, **attributes) -> None:
        at = time.monotonic() if at is None else at
        self.mark("done", at)
        if outcome is not None:
            self.span.set_attribute("k2edge.status", outcome)
        if attributes:
            self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        self.span.end(end_time=wall_ns(at))

    def delivered(self, status: str, then: Callable[[], None] | None) -> Callable[[], None]:
        """A delivery callback that ends the request's spans (the broker acknowledged its answer), then
        runs ``then``."""
        def on_delivered() -> None:
            self.end(status)
            if then is not None:
                then()
        return on_delivered


class BatchTrace:
    """One batch's span (a child of its oldest traced request, linked to every request in it) and the
    segments its engine ran."""

    __slots__ = ("tracer", "span", "records")

    def __init__(self, tracer: "Tracer", span: ChildSpan) -> None:
        self.tracer, self.span = tracer, span
        self.records: list = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """The engine records its segments here while the batch is submitted or run in this thread."""
        token = _segments.set(self.records)
        try:
            yield
        finally:
            _segments.reset(token)

    def end(self, runtime, failed: BaseException | None = None) -> None:
        """Write one span per segment run (device, lane, precision), then end the batch's span."""
        devices: dict[int, tuple[str, str]] = {}
        try:
            for lane in runtime.engines[1].lanes():
                for seg in lane.segments:
                    # a CPU lane says so: nothing may read as DLA or GPU time that was measured on a CPU
                    device = f"{lane.device} (cpu lane)" if "cpu lane" in lane.label else lane.device
                    devices[seg] = (device, lane.precision)
        except Exception:  # an engine without lane facts: the spans still say which segment and lane
            pass
        for seg, lane, start, end in list(self.records):
            device, precision = devices.get(seg, ("?", "?"))
            self.tracer.processor.on_end(ChildSpan(self.span, f"infer segment {seg}", wall_ns(start), wall_ns(end), {
                "k2edge.segment": seg, "k2edge.device": device, "k2edge.lane": lane, "k2edge.precision": precision}))
        if failed is not None:
            self.span.attributes["error.type"] = type(failed).__name__
        self.span.end_time = time.time_ns()
        self.tracer.processor.on_end(self.span)


class _Off:
    """Tracing off: every call returns at once."""

    on = False
    frame_rate = 0.0
    dropped = 0

    def request(self, *args, **kwargs) -> None:
        return None

    def operation(self, *args, **kwargs) -> None:
        return None

    def batch(self, *args, **kwargs) -> None:
        return None

    @contextlib.contextmanager
    def span(self, *args, **kwargs) -> Iterator[None]:
        yield None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass


OFF = _Off()


class Tracer:
    """Tracing on: an SDK ``TracerProvider`` with k2edge's sampler, resource and bounded processor.

    Args:
        provider: the SDK ``TracerProvider`` (its processor: a
            :class:`~k2edge.tracing.export.BoundedBatchProcessor`).
        processor: that processor (``dropped``, ``shutdown``).
        frame_rate: the share of processed stream frames that get a span.
    """

    on = True

    def __init__(self, provider, processor, frame_rate: float = 0.0, sampler: Sampler = Sampler()) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState

        self.provider, self.processor, self.frame_rate, self.sampler = provider, processor, frame_rate, sampler
        self.resource, self.scope = provider.resource, InstrumentationScope("k2edge")
        self.otel = provider.get_tracer("k2edge")
        self._trace, self.Kind = trace, SpanKind
        self._NonRecordingSpan, self._SpanContext, self._TraceFlags, self._TraceState = \
            NonRecordingSpan, SpanContext, TraceFlags, TraceState
        self._lock = threading.Lock()
        self._frames: OrderedDict = OrderedDict()  # (stream, frame index) -> (frame span, captured): events' parents
        self._events: OrderedDict = OrderedDict()  # event id -> its span's context: a description call's parent
        self._random = random.Random()

    @property
    def dropped(self) -> int:
        return self.processor.dropped

    def _in(self, span):
        """A context whose current span is ``span`` (an SDK span, or a record: as a non-recording stand-in)."""
        if isinstance(span, (RootSpan, ChildSpan)):
            c = span.context
            state = self._TraceState.from_header([c.trace_state]) if c.trace_state else None
            span = self._NonRecordingSpan(self._SpanContext(c.trace_id, c.span_id, False, self._TraceFlags(1), state))
        return self._trace.set_span_in_context(span)

    def _child(self, rt: RequestTrace, name: str, start: float, end: float, attributes: Mapping | None) -> None:
        self.processor.on_end(ChildSpan(rt.span, name, wall_ns(start), wall_ns(end), attributes))

    # requests --------------------------------------------------------------------------------------------
    def request(self, topic: str, model: str, request_id: str | None, size: int, carrier: Mapping[str, str],
                received: float) -> RequestTrace | None:
        """A request's trace, parented by its ``traceparent`` / ``tracestate`` (``carrier``), or None when the
        sampler leaves it out."""
        parent = parse_traceparent(carrier.get("traceparent"))  # absent or malformed: a new trace
        trace_id = parent.trace_id if parent is not None else (self._random.getrandbits(128) or 1)
        if not self.sampler.sampled(parent, trace_id):
            return None
        state = TraceStateHeader(carrier["tracestate"][:512]) if parent is not None and carrier.get("tracestate") else None
        attrs = {R.MESSAGING_SYSTEM: "mqtt", R.MESSAGING_OPERATION: "process", R.MESSAGING_DESTINATION: topic,
                 R.MESSAGING_BODY_SIZE: size, "k2edge.model": model}
        if request_id:
            attrs[R.MESSAGING_MESSAGE_ID] = request_id
        span = RootSpan(trace_id, parent, state, f"process {topic}", CONSUMER, wall_ns(received), attrs, self.resource,
                        self.scope, self.processor.on_end)
        return RequestTrace(self, span, received)

    def batch(self, model: str, items: list, started: float) -> BatchTrace | None:
        """One batch's trace, or None when none of its items is traced (``items``: what the batch holds;
        each may have a ``trace``)."""
        traced = [t for t in (getattr(it, "trace", None) for it in items) if t is not None]
        if not traced:
            return None
        span = ChildSpan(traced[0].span, f"batch {model}", wall_ns(started), 0,
                         {R.MESSAGING_BATCH_COUNT: len(items), "k2edge.model": model}, tuple(Link(t.context) for t in traced))
        return BatchTrace(self, span)

    # operations (a deploy, a rollback) -------------------------------------------------------------------
    def operation(self, name: str, phase: str, attributes: Mapping | None = None) -> RequestTrace | None:
        """An operation with phases (a deploy: receiving, verifying, building, swapping), a new trace; its
        phases are marked and it is ended like a request's."""
        now = time.monotonic()
        span = self.otel.start_span(name, attributes=attributes, start_time=wall_ns(now))
        return RequestTrace(self, span, now, phase) if span.is_recording() else None

    # streams --------------------------------------------------------------------------------------------------
    def frame(self, stream: str, index: int, captured: float, taken: float, done: float, detections: int,
              events: int) -> None:
        """A processed frame: a span (decoded to published: ``wait`` for the engine, then ``process``) for the
        sampled share of frames (``frame_sample_rate``) and for every frame that raised events (their parent)."""
        if not events and (self.frame_rate <= 0.0 or self._random.random() >= self.frame_rate):
            return
        span = self.otel.start_span(f"frame {stream}", start_time=wall_ns(captured), attributes={
            "k2edge.stream": stream, "k2edge.frame": index, "k2edge.detections": detections, "k2edge.events": events})
        if not span.is_recording():
            return
        self.processor.on_end(ChildSpan(span, "wait", wall_ns(captured), wall_ns(taken)))
        self.processor.on_end(ChildSpan(span, "process", wall_ns(taken), wall_ns(done)))
        span.end(end_time=wall_ns(done))
        if events:
            with self._lock:
                self._frames[(stream, index)] = (span, captured)
                while len(self._frames) > 256:
                    self._frames.popitem(last=False)

    def event(self, stream: str, body: Mapping) -> None:
        """An event is published: its span, from the frame that raised it to now, a child of that frame's span
        (an event no traced frame raised, a stream going down, gets none)."""
        with self._lock:
            found = self._frames.get((stream, body.get("frame")))
        if found is None:
            return
        span, captured = found
        attrs = {"k2edge.event.id": body["event_id"], "k2edge.event": body.get("event", ""), "k2edge.stream": stream}
        for key in ("zone", "line", "label", "track_id"):
            if body.get(key) is not None and isinstance(body[key], (str, int, float)):
                attrs[f"k2edge.{key}"] = body[key]
        record = ChildSpan(span, f"event {body.get('event', '')}", wall_ns(captured), time.time_ns(), attrs)
        self.processor.on_end(record)
        with self._lock:
            self._events[body["event_id"]] = record.context
            while len(self._events) > 1024:
                self._events.popitem(last=False)

    def event_context(self, event_id: str):
        """The context of event ``event_id``'s span (an OpenTelemetry ``Context``), or None."""
        with self._lock:
            c = self._events.get(event_id)
        if c is None:
            return None
        return self._in(self._NonRecordingSpan(self._SpanContext(c.trace_id, c.span_id, False, self._TraceFlags(1),
                                                                 c.trace_state)))

    # spans other code sees while they run ----------------------------------------------------------------
    @contextlib.contextmanager
    def span(self, name: str, parent: RequestTrace | None = None, kind: str = "internal",
             attributes: Mapping | None = None, context=None) -> Iterator[object]:
        """A live span, current while the block runs (``parent``: a request's trace; else ``context``, an
        OpenTelemetry ``Context``; else the current span, else a new trace). ``kind``: ``internal`` or
        ``client``. An exception ends it with status ERROR."""
        from opentelemetry.trace import Status, StatusCode

        if parent is not None:
            ctx = self._in(parent.span)
        elif context is not None:
            ctx = context
        else:
            cur = _current.get()
            ctx = self._in(cur) if cur is not None else None
        span = self.otel.start_span(name, context=ctx, kind=getattr(self.Kind, kind.upper()), attributes=attributes)
        token = _current.set(span)
        try:
            yield span
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))
            raise
        finally:
            _current.reset(token)
            span.end()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what waits (within ``timeout_s``) and stop."""
        self.processor.shutdown(timeout_s)
