"""Pure pieces of tracing: W3C trace context, clock conversion, and the attribute names used.

Nothing here imports OpenTelemetry: the request path can parse and carry a ``traceparent`` and the
tests can check the format without the SDK.
"""

from __future__ import annotations

import random
import re
import time
from typing import Mapping, NamedTuple

__all__ = ["ChildSpan", "Link", "RootSpan", "Sampler", "TraceParent", "format_traceparent", "parse_traceparent", "wall_ns"]

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\Z")

# OpenTelemetry semantic conventions (messaging 1.26+, GenAI 1.28+), and ours under k2edge.*
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_OPERATION = "messaging.operation.type"
MESSAGING_DESTINATION = "messaging.destination.name"
MESSAGING_MESSAGE_ID = "messaging.message.id"
MESSAGING_BODY_SIZE = "messaging.message.body.size"
MESSAGING_BATCH_COUNT = "messaging.batch.message_count"
GENAI_SYSTEM = "gen_ai.system"
GENAI_OPERATION = "gen_ai.operation.name"
GENAI_REQUEST_MODEL = "gen_ai.request.model"
GENAI_RESPONSE_MODEL = "gen_ai.response.model"
GENAI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GENAI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"


class TraceParent(NamedTuple):
    """A W3C ``traceparent``: 128-bit trace id, 64-bit parent span id, and the sampled flag."""

    trace_id: int
    span_id: int
    sampled: bool


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The trace context of a ``traceparent`` header, or None when it is absent or malformed (the W3C rule:
    an invalid header is ignored and a new trace starts, never an error for the request)."""
    if not value:
        return None
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "ff" or (m.group(1) == "00" and m.group(5)):
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    if not trace_id or not span_id:
        return None
    return TraceParent(trace_id, span_id, bool(int(m.group(4), 16) & 1))


def format_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    """The ``traceparent`` header naming span ``span_id`` of trace ``trace_id``."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


class WallClock:
    """Converts ``time.monotonic()`` instants (the daemon's one clock, :mod:`k2edge.deadline`) to Unix
    nanoseconds, the unit of an OTLP span, from one offset taken when tracing starts: the spans of one
    request then add up exactly, whatever NTP does to the wall clock meanwhile."""

    def __init__(self) -> None:
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, t: float) -> int:
        return int(t * 1e9) + self.offset_ns


_WALL = WallClock()


def wall_ns(t: float) -> int:
    """``time.monotonic()`` instant ``t`` as Unix nanoseconds."""
    return _WALL.ns(t)


class _Context(NamedTuple):
    trace_id: int
    span_id: int
    trace_state: object
    trace_flags: int = 1
    is_remote: bool = False


class _Unset:
    """The fields of an SDK ``Status`` (UNSET) and ``SpanKind.INTERNAL`` the encoder reads."""

    value = 0
    description = None

    @property
    def status_code(self) -> "_Unset":
        return self


_UNSET = _Unset()
_ids = random.Random()  # span ids: 64 random bits, as the SDK's generator (not for secrets)


class Link(NamedTuple):
    """A link to another span (a batch's to each of its requests): the fields of an SDK ``Link`` the encoder reads."""

    context: object
    attributes: Mapping | None = None


class ChildSpan:
    """An INTERNAL span written without the SDK: a request's phase, a batch, an engine segment. It has the
    fields of an SDK ``ReadableSpan`` that :func:`~k2edge.tracing.otlp.encode_spans` reads, and costs a
    fraction of an SDK span (no sampler, no span processor chain, no attribute copies; an SDK span with
    links cost ~200 us here): these are most of a traced request's spans, so they set what tracing costs.
    It can parent further records (``get_span_context``).

    Args:
        parent: the parent span, an SDK span or a ChildSpan (its context, resource and scope are shared).
        name: the span's name.
        start_ns / end_ns: Unix nanoseconds (``end_ns`` may be set later, before the record is handed on).
        attributes: plain values (str, bool, int, float, or sequences of them).
        links: :class:`Link` s.
    """

    __slots__ = ("context", "parent", "name", "start_time", "end_time", "attributes", "resource", "instrumentation_scope",
                 "links")
    kind = _UNSET
    status = _UNSET
    events = ()

    def __init__(self, parent, name: str, start_ns: int, end_ns: int, attributes: Mapping | None = None,
                 links: tuple = ()) -> None:
        p = parent.get_span_context()
        self.parent = p
        self.context = _Context(p.trace_id, _ids.getrandbits(64) or 1, p.trace_state)
        self.name, self.start_time, self.end_time = name, start_ns, end_ns
        self.attributes, self.links = attributes, links
        self.resource, self.instrumentation_scope = parent.resource, parent.instrumentation_scope

    def get_span_context(self):
        return self.context


class Sampler(NamedTuple):
    """Which new requests are traced: an ``OTEL_TRACES_SAMPLER`` name and its ratio, decided as the SDK's samplers
    decide (``parentbased_*``: a parent's sampled flag wins; ``traceidratio``: the trace id's low 64 bits under
    ``ratio`` of their range, so every service sampling by ratio keeps the same traces)."""

    name: str = "parentbased_traceidratio"
    ratio: float = 1.0

    def sampled(self, parent: TraceParent | None, trace_id: int) -> bool:
        if parent is not None and self.name.startswith("parentbased_"):
            return parent.sampled
        root = self.name.removeprefix("parentbased_")
        if root == "always_on":
            return True
        if root == "always_off":
            return False
        return (trace_id & 0xFFFFFFFFFFFFFFFF) < round(self.ratio * 2 ** 64)


class TraceStateHeader(str):
    """A requester's ``tracestate``, carried on unchanged (the encoder asks for ``to_header()``)."""

    def to_header(self) -> str:
        return str(self)


class _Kind(NamedTuple):
    value: int  # the API's SpanKind numbering: INTERNAL 0, SERVER 1, CLIENT 2, PRODUCER 3, CONSUMER 4


CONSUMER = _Kind(4)


class RootSpan:
    """A request's own span, written without the SDK (a span per request through the SDK's sampler and processor
    chain cost the MQTT network thread, the daemon's busiest, ~30 us a request): the :class:`Sampler` decided,
    the ids are made here, and :meth:`end` hands it to the processor. It parents :class:`ChildSpan` s like an SDK
    span (``get_span_context``, ``resource``, ``instrumentation_scope``).

    Args:
        trace_id: the trace (the requester's, or a new one).
        parent: the requester's span, or None.
        trace_state: the requester's ``tracestate`` (a :class:`TraceStateHeader`), or None.
        name / kind / start_ns / attributes: the span's.
        resource / scope: the SDK provider's resource and k2edge's instrumentation scope.
        sink: where the ended span goes (the processor's ``on_end``).
    """

    __slots__ = ("context", "parent", "name", "kind", "start_time", "end_time", "attributes", "resource",
                 "instrumentation_scope", "_sink")
    status = _UNSET
    events = ()
    links = ()

    def __init__(self, trace_id: int, parent: TraceParent | None, trace_state, name: str, kind: _Kind, start_ns: int,
                 attributes: dict, resource, scope, sink) -> None:
        self.context = _Context(trace_id, _ids.getrandbits(64) or 1, trace_state)
        self.parent = _Context(trace_id, parent.span_id, trace_state, 1, True) if parent is not None else None
        self.name, self.kind, self.start_time, self.end_time = name, kind, start_ns, None
        self.attributes, self.resource, self.instrumentation_scope, self._sink = attributes, resource, scope, sink

    def get_span_context(self):
        return self.context

    def set_attribute(self, key: str, value) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping) -> None:
        self.attributes.update(attributes)

    def end(self, end_time: int | None = None) -> None:
        self.end_time = time.time_ns() if end_time is None else end_time
        self._sink(self)
