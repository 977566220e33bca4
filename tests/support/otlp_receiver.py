"""A real OTLP/HTTP trace receiver for tests: an ``http.server`` on a free port that decodes each
``POST /v1/traces`` body with opentelemetry-proto's generated ``ExportTraceServiceRequest`` (the
official schema, not k2edge's encoder) and keeps the spans as plain dicts."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[dict]:
    """The spans of one ``ExportTraceServiceRequest``: ids as hex, times in ns, attributes as a dict."""
    req = ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({
                    "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(), "parent_id": s.parent_span_id.hex() or None,
                    "name": s.name, "kind": KINDS.get(s.kind, str(s.kind)), "start": s.start_time_unix_nano,
                    "end": s.end_time_unix_nano, "attributes": {a.key: _value(a.value) for a in s.attributes},
                    "events": [{"name": e.name, "time": e.time_unix_nano,
                                "attributes": {a.key: _value(a.value) for a in e.attributes}} for e in s.events],
                    "links": [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()} for link in s.links],
                    "status": s.status.code, "status_message": s.status.message, "scope": ss.scope.name,
                    "resource": resource})
    return out


class OtlpReceiver:
    """``with OtlpReceiver() as r:`` … ``r.endpoint`` (the base URL for ``[tracing] endpoint``), ``r.spans``.

    ``keep=False`` (benchmarks): each body is still parsed by the official classes, but only ``count`` is kept,
    so the receiver's own CPU stays small beside the daemon it measures.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, keep: bool = True) -> None:
        self.host, self.port, self.keep = host, port, keep
        self.count = 0
        self.spans: list[dict] = []
        self.posts = 0
        self._cond = threading.Condition()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> "OtlpReceiver":
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404 if self.path != "/v1/traces" else 415)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if receiver.keep:
                    spans = decode(body)
                    n = len(spans)
                else:
                    spans, n = [], sum(len(ss.spans) for rs in ExportTraceServiceRequest.FromString(body).resource_spans
                                       for ss in rs.scope_spans)
                with receiver._cond:
                    receiver.spans.extend(spans)
                    receiver.count += n
                    receiver.posts += 1
                    receiver._cond.notify_all()
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"http://{self._server.server_address[0]}:{self._server.server_address[1]}"

    def trace(self, trace_id: str) -> list[dict]:
        with self._cond:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, predicate, timeout: float = 30.0) -> list[dict]:
        """Wait until ``predicate(spans)`` holds; the spans."""
        end = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.spans):
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.spans)} spans received: {sorted({s['name'] for s in self.spans})}")
                self._cond.wait(left)
            return list(self.spans)
