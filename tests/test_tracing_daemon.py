"""Tracing end to end: requests with a W3C traceparent through the real daemon (real broker, real engines),
spans received by a real OTLP/HTTP receiver, the cloud call to the K2 stand-in; and a collector that is down."""

from __future__ import annotations

import base64
import statistics
import time
import urllib.request
import uuid

import pytest

from k2_server import K2StandIn, answer
from mqtt_support import DIGITS, SAMPLES, TOPIC, Client, free_port
from otlp_receiver import OtlpReceiver

try:
    from test_streams_daemon import crossing  # noqa: F401 (the crossing video fixture)
except pytest.skip.Exception:  # no PyAV: the stream test skips, the others run
    @pytest.fixture
    def crossing():
        pytest.skip("PyAV is not installed (pip install 'k2edge[streams]')")

pytestmark = pytest.mark.slow

PHASES = ["admit", "queue", "stage", "infer", "decide"]


def _img(path, **extra):
    return {"id": uuid.uuid4().hex[:10], "image": base64.b64encode(path.read_bytes()).decode(), **extra}


def _parent() -> tuple[str, str, str]:
    """A requester's span: (trace id, span id, traceparent)."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _tracing(endpoint: str) -> dict:
    return {"endpoint": endpoint, "export_interval_ms": 50}


def _children(spans: list[dict], parent: dict) -> list[dict]:
    return sorted((s for s in spans if s["parent_id"] == parent["span_id"]), key=lambda s: (s["start"], s["end"]))


def test_a_traced_request_is_one_trace_from_the_requester_through_the_device_to_k2(run_daemon, broker):
    """Spans join the requester's trace; the phases tile the request's span; the answer and K2 get its context."""
    with OtlpReceiver() as otlp, K2StandIn() as k2:
        k2.fallback = answer("A handwritten three.")
        cloud = {"base_url": k2.url, "model": "kimi-k2.5", "api_key_env": "K2_TEST_KEY", "timeout_s": 5.0, "max_retries": 0}
        run_daemon(models=[{**DIGITS, "escalation": {"threshold": 0.9999999}}], env={"K2_TEST_KEY": "k"},
                   tables={"tracing": _tracing(otlp.endpoint), "cloud": cloud})
        client = Client(broker.port).connect()
        local_trace, local_parent, local_tp = _parent()
        cloud_trace, cloud_parent, cloud_tp = _parent()
        sent = time.time_ns()
        client.publish(TOPIC, _img(SAMPLES[4], id="local", allow_cloud=False), user_properties={"traceparent": local_tp})
        client.wait_answers(1)
        client.publish(TOPIC, _img(SAMPLES[3], id="cloud"), user_properties={"traceparent": cloud_tp,
                                                                             "tracestate": "vendor=1"})
        client.wait_answers(2)
        answers = {a["id"]: (a, props, wall) for (a, _), props, wall
                   in zip(client.answers, client.answer_props, client.answer_wall)}
        assert answers["local"][0]["source"] == "edge" and answers["cloud"][0]["source"] == "cloud"

        # the local request: the requester's span is the parent; the phases tile the request's span
        spans = otlp.wait_for(lambda ss: any(s["trace_id"] == local_trace and s["name"] == "publish" for s in ss))
        local = [s for s in spans if s["trace_id"] == local_trace]
        (root,) = [s for s in local if s["parent_id"] == local_parent]
        assert root["name"] == f"process {TOPIC}" and root["kind"] == "consumer"
        assert root["attributes"]["messaging.destination.name"] == TOPIC
        assert root["attributes"]["messaging.message.id"] == "local"
        phases = [s for s in _children(local, root) if s["name"] != "batch digits"]
        assert [s["name"] for s in phases] == PHASES + ["publish"]
        for a, b in zip(phases, phases[1:]):
            assert a["end"] == b["start"]  # contiguous: one clock, one instant per hand-over
        assert phases[0]["start"] == root["start"] and phases[-1]["end"] == root["end"]
        assert sum(s["end"] - s["start"] for s in phases) == root["end"] - root["start"]
        # inside the requester's round trip (one wall clock on this machine; the span ends when the broker
        # acknowledged the answer, which may be just after the requester got it)
        body, props, arrived = answers["local"]
        assert sent <= root["start"] and phases[-1]["start"] <= arrived
        assert phases[3]["attributes"] == {} and phases[4]["attributes"]["k2edge.decision"] == "local"
        # the answer names the request's span
        assert props["traceparent"] == f"00-{local_trace}-{root['span_id']}-01"
        # one batch span, linked to the request, with one span per engine segment (device, lane, precision)
        (batch,) = [s for s in local if s["name"] == "batch digits"]
        assert batch["parent_id"] == root["span_id"]
        assert {"trace_id": local_trace, "span_id": root["span_id"]} in batch["links"]
        segments = _children(local, batch)
        assert segments and all(s["name"].startswith("infer segment") for s in segments)
        assert {"k2edge.device", "k2edge.lane", "k2edge.precision"} <= set(segments[0]["attributes"])
        infer = phases[3]
        assert infer["start"] <= segments[0]["start"] and segments[-1]["end"] <= infer["end"]
        assert root["resource"]["service.name"] == "k2edge" and root["resource"]["service.instance.id"] == "t1"

        # the escalated request: a GenAI client span whose traceparent K2 received
        spans = otlp.wait_for(lambda ss: any(s["trace_id"] == cloud_trace and s["name"] == "publish" for s in ss))
        traced = [s for s in spans if s["trace_id"] == cloud_trace]
        (root,) = [s for s in traced if s["parent_id"] == cloud_parent]
        names = [s["name"] for s in _children(traced, root) if s["name"] != "batch digits"]
        assert names[:5] == PHASES and "cloud" in names and names[-1] == "publish"
        (chat,) = [s for s in traced if s["name"] == "chat kimi-k2.5"]
        assert chat["parent_id"] == root["span_id"] and chat["kind"] == "client"
        assert chat["attributes"]["gen_ai.request.model"] == "kimi-k2.5"
        assert chat["attributes"]["k2edge.cloud.attempts"] == 1
        assert chat["attributes"]["k2edge.cloud.breaker"] == "closed"
        (req,) = k2.chat_requests
        assert req.headers["traceparent"] == f"00-{cloud_trace}-{chat['span_id']}-01"
        assert answers["cloud"][1]["traceparent"] == f"00-{cloud_trace}-{root['span_id']}-01"

        # a deploy is a trace of its own: its progress states are its phases, its outcome on the span
        client.publish("k2edge/t1/models/deploy", b"not a bundle", content_type="application/octet-stream")
        (refusal,) = [a for a in client.wait_answers(3) if "id" not in a]
        spans = otlp.wait_for(lambda ss: any(s["name"] == "deploy" for s in ss))
        (deploy,) = [s for s in spans if s["name"] == "deploy"]
        assert deploy["parent_id"] is None and deploy["attributes"]["k2edge.status"] == refusal["status"] == "refused"
        assert deploy["attributes"]["k2edge.deploy.check"] == refusal["check"]
        phases = [s for s in otlp.wait_for(lambda ss: any(s["parent_id"] == deploy["span_id"] for s in ss))
                  if s["parent_id"] == deploy["span_id"]]
        assert [s["name"] for s in phases] == ["receiving"] and phases[0]["end"] == deploy["end"]
        client.close()


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_collector_that_is_down_costs_nothing_visible(run_daemon, broker):
    """Tracing to a port where nothing listens: every request answered, the spans lost counted on /metrics, and
    latency within the spread of a daemon that traces to a collector that is up (measured here, interleaved).
    What tracing itself costs is measured against tracing off by ``bench/bench_peer.py --tracing``; a test
    cannot bound it without assuming the machine's speed, but a down collector must cost no more than an up one."""
    dead, metrics = free_port(), free_port()
    with OtlpReceiver() as otlp:
        run_daemon(device="t1", tables={"tracing": _tracing(otlp.endpoint)})
        run_daemon(device="t2", tables={"tracing": _tracing(f"http://127.0.0.1:{dead}"), "metrics": {"port": metrics}})
        client = Client(broker.port).connect()
        client.settle(TOPIC, "k2edge/t2/infer/digits")  # both warm
        times: dict[str, list[float]] = {"t1": [], "t2": []}
        for i in range(120):
            device = ("t1", "t2")[i % 2]
            _, _, tp = _parent()
            n = len(client.answers)
            t0 = time.monotonic()
            client.publish(f"k2edge/{device}/infer/digits", _img(SAMPLES[i % len(SAMPLES)], allow_cloud=False),
                           user_properties={"traceparent": tp})
            client.wait_answers(n + 1)
            times[device].append(time.monotonic() - t0)
        # a raw JPEG's fields travel as user properties: the trace context beside them is not taken for a field
        n = len(client.answers)
        client.publish("k2edge/t2/infer/digits", SAMPLES[0].read_bytes(), content_type="image/jpeg",
                       user_properties={"id": "raw-1", "traceparent": _parent()[2], "tracestate": "v=1"})
        assert client.wait_answers(n + 1)[-1]["id"] == "raw-1"
        assert all(a["status"] == "ok" for a, _ in client.answers), [a for a, _ in client.answers if a["status"] != "ok"]
        # both daemons answered with the request's context, the one whose spans all got lost too
        assert sum("traceparent" in p for p in client.answer_props) == 121
        otlp.wait_for(lambda ss: sum(s["name"] == "publish" for s in ss) >= 60)  # the live collector got them
        up, down = sorted(times["t1"]), sorted(times["t2"])
        spread = up[int(0.9 * len(up))]  # the up collector's daemon's own 90th percentile, this run
        assert statistics.median(down) <= spread, (statistics.median(up), statistics.median(down), spread)
        deadline = time.monotonic() + 10
        while _metric(metrics, "k2edge_trace_spans_dropped_total") < 60 * len(PHASES) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _metric(metrics, "k2edge_trace_spans_dropped_total") >= 60 * len(PHASES)
        client.close()


def test_stream_frames_and_events_are_traced(run_daemon, broker, crossing):
    """A file stream with frame_sample_rate: sampled frames get spans; every published event has a span from the
    frame that raised it, that frame's span its parent."""
    from test_streams_daemon import BOXES, STREAMS, _messages, _stream, _wait_event

    with OtlpReceiver() as otlp:
        client = Client(broker.port).connect()
        client.subscribe(STREAMS)
        run_daemon(models=[BOXES], streams=[_stream(crossing)],
                   tables={"tracing": {**_tracing(otlp.endpoint), "frame_sample_rate": 0.5}})
        _wait_event(client, "stream_ended")
        # the zone leaves of the tracks the file's end ended are raised by no frame (like a stream going down): no span
        published = [e for e in _messages(client, "events") if e["event"] in ("zone_enter", "zone_leave", "line_cross")
                     and not e.get("reason")]
        assert published
        spans = otlp.wait_for(lambda ss: {e["event_id"] for e in published}
                              <= {s["attributes"].get("k2edge.event.id") for s in ss})
        frames = {s["span_id"]: s for s in spans if s["name"] == "frame cam"}
        processed = len(_messages(client, "detections"))
        with_events = {e["frame"] for e in published}
        sampled = [s for s in frames.values() if s["attributes"]["k2edge.frame"] not in with_events]
        assert 0 < len(sampled) < processed  # a share of the frames, not all of them, not none
        for e in published:
            (span,) = [s for s in spans if s["attributes"].get("k2edge.event.id") == e["event_id"]]
            frame = frames[span["parent_id"]]
            assert span["name"] == f"event {e['event']}" and frame["attributes"]["k2edge.frame"] == e["frame"]
            assert span["start"] == frame["start"] and span["end"] >= frame["end"]
        client.close()
