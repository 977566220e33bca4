"""Tracing without the daemon: the [tracing] table and the OTEL_* variables, W3C trace context, the protobuf
encoder checked against opentelemetry-proto, the bounded processor, the facade off and on, the engine's
segment spans, the K2 client's traceparent header, and trace ids on log lines."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from k2edge import tracing
from k2edge.config.schema import ConfigError, load_config
from k2edge.config.tracing import TracingSettings
from k2edge.dla.planner import Routing
from k2edge.engine.pipeline import LaneSet
from k2edge.tracing.export import BoundedBatchProcessor
from k2edge.tracing.otlp import OtlpHttpExporter, encode_spans, resolve
from k2edge.tracing.records import format_traceparent, parse_traceparent

from mqtt_support import free_port

pytest.importorskip("opentelemetry.sdk")
from otlp_receiver import OtlpReceiver, decode  # noqa: E402 (needs opentelemetry-proto)

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Memory:
    """An exporter that keeps what it is given."""

    def __init__(self, ok: bool = True) -> None:
        self.spans, self.ok, self.calls = [], ok, 0

    def export(self, spans) -> bool:
        self.calls += 1
        self.spans.extend(spans)
        return self.ok

    def close(self) -> None:
        pass


@pytest.fixture
def memory():
    exporter = Memory()
    yield tracing.configure(TracingSettings(), "dev-1", environ={}, exporter=exporter), exporter
    tracing.shutdown()


def _flushed(t, exporter) -> list[dict]:
    t.processor.force_flush(5000)
    return decode(encode_spans(exporter.spans))


class _Item:
    def __init__(self, trace):
        self.trace = trace


# -- config and variables -----------------------------------------------------------------------------------------
def test_tracing_table_is_validated_with_field_paths(tmp_path):
    """A bad endpoint or ratio names tracing.<key>; a good table loads with its defaults."""
    cfg = tmp_path / "k2edge.toml"
    base = '[[models]]\nname = "m"\nonnx = "m.onnx"\n[tracing]\n'
    for body, field in (('endpoint = "collector:4318"', "tracing.endpoint"), ("sample_ratio = 1.5", "tracing.sample_ratio"),
                        ("queue_size = 0", "tracing.queue_size"), ("sampler = 1", "tracing.sampler")):
        cfg.write_text(base + body + "\n")
        with pytest.raises(ConfigError, match=field):
            load_config(cfg)
    cfg.write_text(base + 'endpoint = "http://otel:4318/"\n')
    t = load_config(cfg).tracing
    assert t.endpoint == "http://otel:4318" and t.sample_ratio == 1.0 and t.frame_sample_rate == 0.0
    cfg.write_text('[[models]]\nname = "m"\nonnx = "m.onnx"\n')
    assert load_config(cfg).tracing is None  # off by default


def test_otel_variables_override_the_table():
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is the full URL; OTEL_EXPORTER_OTLP_ENDPOINT a base; the sampler pair."""
    s = TracingSettings(endpoint="http://a:4318", sample_ratio=0.5)
    r = resolve(s, {})
    assert (r.url, r.sampler, r.ratio) == ("http://a:4318/v1/traces", "parentbased_traceidratio", 0.5)
    r = resolve(s, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318/"})
    assert r.url == "http://b:4318/v1/traces"
    r = resolve(s, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:9/x"})
    assert r.url == "http://c:9/x"
    r = resolve(s, {"OTEL_TRACES_SAMPLER": "TraceIdRatio", "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert (r.sampler, r.ratio) == ("traceidratio", 0.25)
    for env, named in (({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER"),
                       ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
                       ({"OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
                       ({"OTEL_EXPORTER_OTLP_ENDPOINT": "b:4318"}, "endpoint")):
        with pytest.raises(tracing.TracingError, match=named):
            tracing.configure(s, environ=env, exporter=Memory())
    assert tracing.tracer() is not None and not tracing.tracer().on


def test_traceparent_parsing_follows_w3c():
    """Valid headers parse; a malformed one, version ff, or all-zero ids are ignored (a new trace starts)."""
    tp = parse_traceparent(TP)
    assert tp == (0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331, True)
    assert format_traceparent(*tp) == TP
    assert parse_traceparent(TP[:-2] + "00").sampled is False
    assert parse_traceparent("01-" + TP[3:] + "-future") is not None  # a later version may add fields
    for bad in (None, "", "00-xyz", "ff" + TP[2:], TP + "-extra", "00-" + "0" * 32 + TP[35:], TP[:36] + "0" * 16 + "-01"):
        assert parse_traceparent(bad) is None, bad


# -- the facade --------------------------------------------------------------------------------------------------
def test_off_by_default_and_opentelemetry_not_imported():
    """Without [tracing], the daemon's modules and their hooks never import OpenTelemetry."""
    code = ("import sys, k2edge.service.daemon, k2edge.cloud_bridge.client\n"
            "from k2edge import tracing\n"
            "assert not tracing.tracer().on and tracing.tracer().request('t', 'm', 'r', 1, {'traceparent': 'x'}, 0.0) is None\n"
            "with tracing.description_span('e1', 'kimi', 'http://k2:8000/v1') as s: assert s is None\n"
            "assert tracing.headers() == {}\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_request_phases_tile_the_request_span(memory):
    """Each phase ends where the next begins; the answer's traceparent names the request's span."""
    t, exporter = memory
    t0 = time.monotonic()
    r = t.request("k2edge/d/infer/m", "m", "r1", 123, {"traceparent": TP, "tracestate": "vendor=x"}, t0)
    for phase in ("queue", "stage", "infer", "decide", "publish"):
        r.mark(phase)
    r.decided("local", "confident", False)
    delivered = []
    r.delivered("ok", lambda: delivered.append(True))()
    spans = _flushed(t, exporter)
    (root,) = [s for s in spans if s["parent_id"] == "b7ad6b7169203331"]
    kids = sorted((s for s in spans if s["parent_id"] == root["span_id"]), key=lambda s: s["start"])
    assert [s["name"] for s in kids] == ["admit", "queue", "stage", "infer", "decide", "publish"]
    assert all(a["end"] == b["start"] for a, b in zip(kids, kids[1:]))
    assert kids[0]["start"] == root["start"] and kids[-1]["end"] == root["end"] and delivered
    assert kids[-1]["attributes"]["k2edge.decision"] == "local"
    assert root["kind"] == "consumer" and root["attributes"]["k2edge.status"] == "ok"
    assert root["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert r.user_properties() == (("traceparent", f"00-{root['trace_id']}-{root['span_id']}-01"),)
    assert root["resource"]["service.instance.id"] == "dev-1"


def test_sampling_follows_the_parent_then_the_ratio():
    """A sampled parent is traced; an unsampled one is not; without one the ratio (or OTEL_TRACES_SAMPLER) decides."""
    try:
        t = tracing.configure(TracingSettings(sample_ratio=0.0), environ={}, exporter=Memory())
        assert t.request("t", "m", None, 1, {"traceparent": TP}, time.monotonic()) is not None
        assert t.request("t", "m", None, 1, {"traceparent": TP[:-2] + "00"}, time.monotonic()) is None
        assert t.request("t", "m", None, 1, {}, time.monotonic()) is None
        t = tracing.configure(TracingSettings(sample_ratio=1.0), environ={}, exporter=Memory())
        assert t.request("t", "m", None, 1, {"traceparent": "garbage"}, time.monotonic()) is not None
        t = tracing.configure(TracingSettings(), environ={"OTEL_TRACES_SAMPLER": "always_off"}, exporter=Memory())
        assert t.request("t", "m", None, 1, {"traceparent": TP}, time.monotonic()) is None
    finally:
        tracing.shutdown()


def test_lanes_record_each_segment_of_a_traced_batch(memory):
    """A batch submitted to two lanes: one span per segment under the batch span, naming the lane that ran it."""
    t, exporter = memory
    r = t.request("t", "m", None, 1, {"traceparent": TP}, time.monotonic())
    lanes = LaneSet(Routing(((0, 1),), None, (0,), ("gpu", "dla0")),
                    lambda i, tensors: {("a", "y")[i]: tensors[("x", "a")[i]] + 1}, ("y",))
    lanes.start()
    try:
        untraced = lanes.submit({"x": np.zeros(2)}, None, None).result(timeout=30)
        bt = t.batch("m", [_Item(r), _Item(None)], time.monotonic())
        with bt.recording():
            out = lanes.submit({"x": np.zeros(2)}, None, None).result(timeout=30)
    finally:
        lanes.stop()
    assert out["y"].tolist() == untraced["y"].tolist() == [2.0, 2.0]

    class Runtime:
        engines = {}

    bt.end(Runtime())
    spans = _flushed(t, exporter)
    (batch,) = [s for s in spans if s["name"] == "batch m"]
    segs = sorted((s for s in spans if s["parent_id"] == batch["span_id"]), key=lambda s: s["start"])
    assert [s["attributes"]["k2edge.lane"] for s in segs] == ["k2edge-lane-gpu", "k2edge-lane-dla0"]
    assert [s["name"] for s in segs] == ["infer segment 0", "infer segment 1"] and segs[0]["end"] <= segs[1]["start"]
    assert batch["attributes"]["messaging.batch.message_count"] == 2 and len(batch["links"]) == 1


# -- the encoder and the processor ---------------------------------------------------------------------------------
def test_encoder_writes_what_opentelemetry_proto_reads(memory):
    """Every attribute type, events, links, an error status, trace state and kinds survive the official decoder."""
    t, exporter = memory
    attrs = {"s": "é", "b": True, "i": -3, "big": 2 ** 40, "f": 0.25, "l": ["a", "b"], "n": [1, 2]}
    r = t.request("t", "m", None, 1, {"traceparent": TP, "tracestate": "k=v"}, time.monotonic())
    with pytest.raises(ValueError):
        with t.span("child", r, kind="client", attributes=attrs) as span:
            span.add_event("retry", {"wait_s": 0.5})
            raise ValueError("boom")
    t.batch("m", [_Item(r)], time.monotonic()).end(None)  # an engine without lane facts: no segment spans
    r.end("ok")
    spans = {s["name"]: s for s in _flushed(t, exporter)}
    child = spans["child"]
    assert child["attributes"] == {**attrs, "s": "é"} and child["kind"] == "client"
    assert child["events"][0]["name"] == "retry" and child["events"][0]["attributes"] == {"wait_s": 0.5}
    assert child["status"] == 2 and "ValueError: boom" in child["status_message"]
    assert spans["batch m"]["links"] == [{"trace_id": r.context.trace_id.to_bytes(16, "big").hex(),
                                          "span_id": r.context.span_id.to_bytes(8, "big").hex()}]
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    raw = ExportTraceServiceRequest.FromString(encode_spans(exporter.spans))
    protos = {s.name: s for s in raw.resource_spans[0].scope_spans[0].spans}
    assert protos["process t"].trace_state == "k=v" and protos["process t"].flags & 0x300 == 0x300  # remote parent
    assert protos["child"].flags & 0x300 == 0x100


def test_processor_never_blocks_and_counts_what_it_drops():
    """While the exporter hangs, on_end still returns: the queue holds queue_size spans, the rest are counted."""
    entered, release = threading.Event(), threading.Event()

    class Hanging(Memory):
        def export(self, spans):
            entered.set()
            release.wait(30)
            return super().export(spans)

    exporter = Hanging()
    p = BoundedBatchProcessor(exporter, queue_size=16, batch_size=4, interval_s=60)
    for i in range(4):
        p.on_end(i)  # a full batch: the exporter thread takes it and hangs
    assert entered.wait(10)
    done = threading.Event()
    threading.Thread(target=lambda: ([p.on_end(i) for i in range(100)], done.set()), daemon=True).start()
    assert done.wait(10), "on_end blocked while the exporter hung"
    assert p.dropped == 100 - 16
    release.set()
    assert p.force_flush(10000)
    assert p.exported == 4 + 16 and sorted(exporter.spans) == sorted(list(range(4)) + list(range(16)))
    p.shutdown()


def test_a_collector_that_is_down_loses_spans_counted(memory):
    """Spans the collector cannot take (nothing listens) are dropped and counted, not kept or retried."""
    t, exporter = memory
    r = t.request("t", "m", None, 1, {"traceparent": TP}, time.monotonic())
    r.end()
    t.processor.force_flush(5000)
    assert len(exporter.spans) == 2  # the request's span and its one phase
    p = BoundedBatchProcessor(OtlpHttpExporter(f"http://127.0.0.1:{free_port()}/v1/traces", 1.0), 100, 10, 60)
    for s in exporter.spans:
        p.on_end(s)
    assert p.force_flush(10000) and p.dropped == 2 and p.exported == 0
    p.shutdown()


def test_spans_reach_a_real_otlp_http_receiver():
    """configure() with an endpoint: spans arrive at <endpoint>/v1/traces as protobuf, decoded by the official classes."""
    with OtlpReceiver() as otlp:
        try:
            t = tracing.configure(TracingSettings(endpoint=otlp.endpoint, export_interval_ms=20), "dev-2", environ={})
            r = t.request("t", "m", "r9", 1, {}, time.monotonic())
            r.mark("queue")
            r.end("ok")
            spans = otlp.wait_for(lambda ss: len(ss) >= 3, timeout=10)
        finally:
            tracing.shutdown()
    assert {s["name"] for s in spans} == {"process t", "admit", "queue"} and t.dropped == 0


# -- the K2 client and the logs -----------------------------------------------------------------------------------
def test_description_span_sends_its_traceparent_to_k2(memory):
    """A stream event's description call: K2 receives the traceparent of the chat span, which carries the GenAI
    attributes; outside a span no header goes."""
    from k2_server import K2StandIn, answer

    from k2edge.cloud_bridge.client import K2Client
    from k2edge.config.cloud import CloudSettings

    t, exporter = memory
    with K2StandIn() as k2:
        k2.fallback = answer("a person at the door")
        client = K2Client(CloudSettings(base_url=k2.url, model="kimi-k2.5", timeout_s=5.0, max_retries=0), "k")
        client.complete(None, None, "plain", None, 5.0)
        with tracing.description_span("ev-7", "kimi-k2.5", k2.url) as span:
            ans = client.complete(None, None, "what happens?", None, 5.0)
        plain, described = k2.chat_requests
    assert ans.text == "a person at the door" and "traceparent" not in plain.headers
    (chat,) = [s for s in _flushed(t, exporter) if s["name"] == "chat kimi-k2.5"]
    assert described.headers["traceparent"] == f"00-{chat['trace_id']}-{chat['span_id']}-01"
    a = chat["attributes"]
    assert a["k2edge.event.id"] == "ev-7" and a["gen_ai.operation.name"] == "chat" and a["server.address"] == "127.0.0.1"
    assert a["k2edge.cloud.attempts"] == 1 and a["k2edge.cloud.breaker"] == "closed" and chat["kind"] == "client"
    assert span is not None


def test_a_stream_escalation_job_is_described_under_its_event_span(memory, tmp_path):
    """The stream escalation worker's K2 call runs in description_span: its chat span is the traced event's child,
    names the event id, and K2 receives that span's traceparent."""
    from k2_server import K2StandIn, answer

    from k2edge.cloud_bridge import CloudBridge, K2Client
    from k2edge.config.cloud import CloudSettings
    from k2edge.config.stream_escalation import EscalationRule
    from k2edge.service.event_store import EventStore
    from k2edge.service.stream_escalation import EscalationJobs, StreamEscalations
    from k2edge.service.stream_path import StreamPath
    from k2edge.streams.escalation_rules import select
    from k2edge.streams.payload import event_payload

    t, exporter = memory
    now = time.monotonic()
    with K2StandIn() as k2:
        k2.fallback = answer("a person at the door")
        settings = CloudSettings(base_url=k2.url, model="kimi-k2.5", timeout_s=5.0, max_retries=0)
        bridge = CloudBridge(settings, tmp_path, client=K2Client(settings, api_key="k"))
        events = EventStore(tmp_path / "events.sqlite")

        class Publisher:  # the transport's publish, kept
            def __init__(self):
                self.sent = []

            def publish(self, topic, payload, qos=0, retain=False, **kw):
                self.sent.append((topic, payload))

        path = StreamPath([], "k2edge/t1", Publisher(), events, {})
        esc = StreamEscalations(bridge, EscalationJobs(tmp_path / "jobs.sqlite3"), events, path)
        body = event_payload("cam", {"event": "line_cross", "track_id": 1, "label": "person", "line": "door",
                                     "box": [10.0, 10.0, 50.0, 90.0]}, 2)
        t.frame("cam", 2, now - 0.03, now - 0.02, now, detections=1, events=1)
        t.event("cam", body)
        assert esc.submit("cam", body, (select([EscalationRule(on="line_cross")], body, None, "cam"), [], None))
        events.add([(body["event_id"], "k2edge/t1/streams/cam/events", json.dumps(body).encode())])
        (job,) = esc.jobs.due(time.time(), set())
        assert esc.run(job) == "described"
        (call,) = k2.chat_requests
    spans = _flushed(t, exporter)
    (event,) = [s for s in spans if s["name"] == "event line_cross"]
    (chat,) = [s for s in spans if s["name"] == "chat kimi-k2.5"]
    assert chat["parent_id"] == event["span_id"] and chat["attributes"]["k2edge.event.id"] == body["event_id"]
    assert call.headers["traceparent"] == f"00-{chat['trace_id']}-{chat['span_id']}-01"


def test_log_lines_under_a_span_carry_its_trace_id(memory, caplog):
    """A line logged while a span is current ends with its trace and span ids; others are unchanged."""
    t, _ = memory
    handler = logging.StreamHandler()
    logging.getLogger().addHandler(handler)
    try:
        tracing.logs.install()
        with caplog.at_level(logging.INFO):
            logging.getLogger("k2edge.test").info("outside")
            with t.span("work") as span:
                logging.getLogger("k2edge.test").info("request %s: cloud failed", "r1")
    finally:
        logging.getLogger().removeHandler(handler)
    ctx = span.get_span_context()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "outside"
    assert msgs[1] == f"request r1: cloud failed [trace_id={ctx.trace_id:032x} span_id={ctx.span_id:016x}]"


def test_frames_events_and_their_description_calls(memory):
    """Sampled frames and every frame with events get a span; an event's span is its frame's child, and the
    description call of that event is the event span's child (description_span finds it by the event id)."""
    t, exporter = memory
    t.frame_rate = 0.0
    now = time.monotonic()
    t.frame("cam", 1, now - 0.03, now - 0.02, now, detections=2, events=0)  # rate 0, no events: no span
    t.frame("cam", 2, now - 0.03, now - 0.02, now, detections=1, events=1)
    t.event("cam", {"event_id": "ev-1", "event": "line_cross", "frame": 2, "line": "door", "track_id": 4})
    t.event("cam", {"event_id": "ev-0", "event": "stream_down", "frame": None})  # no traced frame: no span
    with tracing.description_span("ev-1", "kimi-k2.5", "https://api.moonshot.ai/v1") as chat:
        assert tracing.headers()["traceparent"].split("-")[2] == f"{chat.get_span_context().span_id:016x}"
    t.frame_rate = 1.0
    t.frame("cam", 3, now - 0.03, now - 0.02, now, detections=0, events=0)  # sampled
    spans = _flushed(t, exporter)
    frames = {s["attributes"]["k2edge.frame"]: s for s in spans if s["name"] == "frame cam"}
    assert sorted(frames) == [2, 3]
    kids = sorted((s for s in spans if s["parent_id"] == frames[2]["span_id"]), key=lambda s: (s["start"], s["name"]))
    assert [s["name"] for s in kids] == ["event line_cross", "wait", "process"]
    event = kids[0]
    assert event["start"] == frames[2]["start"] and event["attributes"]["k2edge.line"] == "door"
    (described,) = [s for s in spans if s["name"] == "chat kimi-k2.5"]
    assert described["parent_id"] == event["span_id"] and described["trace_id"] == event["trace_id"]
    assert described["attributes"]["server.address"] == "api.moonshot.ai" and described["attributes"]["server.port"] == 443
    assert not any(s["name"] == "event stream_down" for s in spans)


def test_the_sampler_decides_as_the_sdks_samplers_do():
    """records.Sampler (the request path's, without the SDK) agrees with the SDK's samplers on every trace id."""
    import random

    from opentelemetry.sdk.trace import sampling

    from k2edge.tracing.records import Sampler, TraceParent

    rng = random.Random(7)
    ids = [rng.getrandbits(128) or 1 for _ in range(2000)]
    sdk = sampling.ParentBasedTraceIdRatio(0.3)
    ours = Sampler("parentbased_traceidratio", 0.3)
    decisions = [ours.sampled(None, t) for t in ids]
    assert decisions == [sdk.should_sample(None, t, "n").decision.is_sampled() for t in ids]
    assert 0.25 < sum(decisions) / len(ids) < 0.35
    assert ours.sampled(TraceParent(ids[0], 1, True), ids[0]) and not ours.sampled(TraceParent(ids[0], 1, False), ids[0])
    assert not Sampler("traceidratio", 0.0).sampled(TraceParent(ids[0], 1, True), ids[0])  # not parent-based
    assert Sampler("always_on").sampled(None, ids[0]) and not Sampler("parentbased_always_off").sampled(None, ids[0])


@pytest.mark.parametrize("call", ["complete", "ask"])
def test_a_retried_cloud_call_shows_its_retries_on_its_span(memory, call):
    """A 503 with Retry-After, then an answer: the chat span has a retry event with the wait, and two attempts; the
    same for a request's call (complete) and a stream event's (ask: one retry loop serves both)."""
    from k2_server import K2StandIn, answer, status

    from k2edge.cloud_bridge.client import K2Client
    from k2edge.config.cloud import CloudSettings

    t, exporter = memory
    with K2StandIn() as k2:
        k2.script(status(503, retry_after=0.05), answer("ok"))
        client = K2Client(CloudSettings(base_url=k2.url, model="kimi-k2.5", timeout_s=5.0, max_retries=2), "k")
        with tracing.description_span("ev-8", "kimi-k2.5", k2.url):
            ans = client.complete(None, None, "again?", None, 10.0) if call == "complete" else client.ask([], "again?", 10.0)
            assert ans.attempts == 2
        first, second = k2.chat_requests
    (chat,) = [s for s in _flushed(t, exporter) if s["name"] == "chat kimi-k2.5"]
    assert first.headers["traceparent"] == second.headers["traceparent"]  # one span for the call, retries inside
    (retry,) = chat["events"]
    assert retry["name"] == "retry" and retry["attributes"]["k2edge.cloud.attempt"] == 1
    assert retry["attributes"]["k2edge.cloud.wait_s"] == pytest.approx(0.05, abs=0.01)
    assert chat["attributes"]["k2edge.cloud.attempts"] == 2
