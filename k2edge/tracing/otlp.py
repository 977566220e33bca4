"""OTLP over HTTP/protobuf: where spans go (the config and the standard variables), and the request body.

The body is an ``ExportTraceServiceRequest`` written by a small protobuf encoder here rather than by
``opentelemetry-exporter-otlp-proto-http``: that package pulls ``requests``, ``protobuf`` and
``googleapis-common-protos`` into a daemon that needs none of them, for a message of a dozen fields
(opentelemetry-proto's ``trace.proto``, ``common.proto`` and ``resource.proto``; the tests decode
what is written here with the official generated classes). The HTTP side is the standard library's
``http.client`` on the exporter's own thread.
"""

from __future__ import annotations

import http.client
import logging
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping
from urllib.parse import urlsplit

from ..config.tracing import TracingSettings

log = logging.getLogger(__name__)

__all__ = ["Export", "OtlpHttpExporter", "encode_spans", "resolve", "SAMPLERS"]

SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")


class TracingConfigError(ValueError):
    """An ``OTEL_*`` variable names something k2edge cannot do (the message names the variable)."""


@dataclass(frozen=True)
class Export:
    """Where spans go and which requests start a trace, once the standard variables are applied."""

    url: str  # the full traces URL (…/v1/traces)
    sampler: str  # one of SAMPLERS
    ratio: float  # the traceidratio samplers' ratio


def resolve(settings: TracingSettings, environ: Mapping[str, str] = os.environ) -> Export:
    """``[tracing]`` with ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL, as the spec says),
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base; ``/v1/traces`` appended), ``OTEL_TRACES_SAMPLER`` and
    ``OTEL_TRACES_SAMPLER_ARG`` applied over it.

    Raises:
        TracingConfigError: an unknown sampler, or a ratio that is not a number within [0, 1].
    """
    url = settings.endpoint + "/v1/traces"
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        url = environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip()
    elif environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        url = environ["OTEL_EXPORTER_OTLP_ENDPOINT"].strip().rstrip("/") + "/v1/traces"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingConfigError(f"OTLP traces endpoint must be an http:// or https:// URL, got {url!r}")
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_traceidratio"
    if sampler not in SAMPLERS:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER: {sampler!r} is not one of {', '.join(SAMPLERS)}")
    ratio = settings.sample_ratio
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if arg and sampler.endswith("traceidratio"):
        try:
            ratio = float(arg)
        except ValueError:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a number within [0, 1], got {arg!r}") from None
        if not 0.0 <= ratio <= 1.0:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG must be within [0, 1], got {ratio}")
    return Export(url, sampler, ratio)


# -- the protobuf encoder -------------------------------------------------------------------------------------
_SMALL = [bytes((i,)) for i in range(128)]


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL[n]
    n &= (1 << 64) - 1  # int64 negatives: two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes(field: int, data: bytes) -> bytes:
    return _tag(field, 2) + _varint(len(data)) + data


def _str(field: int, s: str) -> bytes:
    return _bytes(field, s.encode("utf-8")) if s else b""


def _fixed64(field: int, n: int) -> bytes:
    return _tag(field, 1) + struct.pack("<Q", n)


def _any(v) -> bytes:
    """An ``AnyValue``."""
    if isinstance(v, bool):
        return _tag(2, 0) + _varint(int(v))
    if isinstance(v, int):
        return _tag(3, 0) + _varint(v)
    if isinstance(v, float):
        return _tag(4, 1) + struct.pack("<d", v)
    if isinstance(v, (bytes, bytearray)):
        return _bytes(7, bytes(v))
    if isinstance(v, (tuple, list)):
        return _bytes(5, b"".join(_bytes(1, _any(x)) for x in v))  # ArrayValue
    return _bytes(1, str(v).encode("utf-8"))


def _attributes(field: int, attrs: Mapping | None) -> bytes:
    return b"".join(_bytes(field, _str(1, k) + _bytes(2, _any(v))) for k, v in (attrs or {}).items())


_FIXED64, _FIXED32 = struct.Struct("<Q"), struct.Struct("<I")


def _span(s) -> bytes:
    ctx = s.context
    # fixed-size fields with their tags spelled out: trace_id (1), span_id (2), parent_span_id (4), kind (6),
    # start (7) and end (8) times: most of every span, written without the generic helpers
    out = [b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"), b"\x12\x08" + ctx.span_id.to_bytes(8, "big")]
    if ctx.trace_state:
        out.append(_str(3, ctx.trace_state.to_header()))
    if s.parent is not None:
        out.append(b"\x22\x08" + s.parent.span_id.to_bytes(8, "big"))
    out.append(_str(5, s.name))
    out.append(b"\x30" + _SMALL[s.kind.value + 1])  # the API's INTERNAL is 0, the proto's 1
    out.append(b"\x39" + _FIXED64.pack(s.start_time or 0))
    out.append(b"\x41" + _FIXED64.pack(s.end_time or 0))
    if s.attributes:
        out.append(_attributes(9, s.attributes))
    for e in s.events:
        out.append(_bytes(11, _fixed64(1, e.timestamp) + _str(2, e.name) + _attributes(3, e.attributes)))
    for link in s.links:
        lc = link.context
        out.append(_bytes(13, _bytes(1, lc.trace_id.to_bytes(16, "big")) + _bytes(2, lc.span_id.to_bytes(8, "big"))
                          + _attributes(4, link.attributes)))
    code = s.status.status_code.value  # UNSET 0, OK 1, ERROR 2: as the proto's
    if code or s.status.description:
        out.append(_bytes(15, _str(2, s.status.description or "") + (_tag(3, 0) + _varint(code) if code else b"")))
    remote = s.parent is not None and s.parent.is_remote  # flags bits 8, 9: whether the parent is remote
    out.append(b"\x85\x01" + _FIXED32.pack(int(ctx.trace_flags) | 0x100 | (0x200 if remote else 0)))
    return b"".join(out)


def encode_spans(spans: Iterable) -> bytes:
    """An ``ExportTraceServiceRequest`` holding ``spans`` (SDK ``ReadableSpan`` objects), grouped by resource
    and instrumentation scope."""
    groups: dict[tuple, list] = {}
    resources: dict[int, object] = {}
    for s in spans:
        scope = s.instrumentation_scope
        key = (id(s.resource), scope.name if scope else "", (scope.version if scope else "") or "")
        resources[id(s.resource)] = s.resource
        groups.setdefault(key, []).append(s)
    by_resource: dict[int, list[bytes]] = {}
    for (rid, name, version), members in groups.items():
        scope = _str(1, name) + _str(2, version or "")
        by_resource.setdefault(rid, []).append(_bytes(1, scope) + b"".join(_bytes(2, _span(s)) for s in members))
    body = []
    for rid, scopes in by_resource.items():
        resource = _attributes(1, resources[rid].attributes)
        body.append(_bytes(1, _bytes(1, resource) + b"".join(_bytes(2, sc) for sc in scopes)))
    return b"".join(body)


class OtlpHttpExporter:
    """POSTs encoded spans to the collector, on one kept-alive connection (reopened after a failure).

    Args:
        url: the traces URL (``http://HOST:4318/v1/traces``).
        timeout_s: one request's timeout.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        self.url, self.timeout_s = url, timeout_s
        self.where = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"  # logged: no userinfo
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port or (443 if self._https else 80)
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._conn: http.client.HTTPConnection | None = None

    def export(self, spans: list) -> bool:
        """True when the collector took them (2xx)."""
        body = encode_spans(spans)
        for fresh in (False, True):  # a kept-alive connection the collector closed: once more on a new one
            try:
                if self._conn is None or fresh:
                    self.close()
                    cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                    self._conn = cls(self._host, self._port, timeout=self.timeout_s)
                self._conn.request("POST", self._path, body, {"Content-Type": "application/x-protobuf"})
                r = self._conn.getresponse()
                r.read()
                if 200 <= r.status < 300:
                    return True
                log.debug("the trace collector at %s answered HTTP %d", self.where, r.status)
                return False
            except (OSError, http.client.HTTPException) as exc:
                if fresh:
                    log.debug("the trace collector at %s is unreachable (%s)", self.where, type(exc).__name__)
                self.close()
        return False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
