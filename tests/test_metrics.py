"""The daemon's Prometheus metrics: served over real HTTP, parsed by prometheus_client, counters = what was observed."""

from __future__ import annotations

import json
import re
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from k2edge.engine.check import Int8Check
from k2edge.service.metrics import STAGES, MetricsError
from k2edge.service.metrics import PrometheusMetrics as Metrics

ROOT = Path(__file__).resolve().parents[1]


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {s.name + repr(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}, text


def _sample(samples: dict, name: str, **labels) -> float | None:
    return samples.get(name + repr(sorted(labels.items())))


# a day in the life: (model, status, source, latency_ms by stage) as the daemon would report each answer
ANSWERS = [
    ("digits", "ok", "edge", {"queue": 0.2, "stage": 0.3, "infer": 0.4, "total": 1.1, "batch": 2}),
    ("digits", "ok", "edge", {"queue": 0.3, "stage": 0.2, "infer": 0.4, "total": 0.9, "batch": 2}),
    ("digits", "ok", "cloud", {"queue": 0.2, "infer": 0.4, "cloud": 850.0, "total": 851.0}),
    ("digits", "busy", None, None),
    ("detector", "deadline_exceeded", None, {"queue": 40.0, "total": 40.0}),
    ("nonsense-model-name", "unknown_model", None, None),
    ("digits", "weird_code", "edge", {"total": "n/a"}),
]


def test_metrics_endpoint_parses_and_counters_match_the_answers():
    m = Metrics()
    m.set_model("digits", "1.2.0", "c2")
    m.set_model("detector", "0.3.0", "c3")
    for model, status, source, latency in ANSWERS:
        m.observe_answer(model, status, source, latency)
    m.observe_batch("digits", 2)
    m.observe_batch("digits", 1)
    m.set_queue_depth(3)
    m.set_thermal("warm", {"CPU": 71.5, "GPU": 76.0})
    m.observe_escalation("digits", "low_confidence")
    m.observe_escalation("digits", "prompt")
    m.observe_escalation("digits", "a sentence the policy wrote")
    m.set_breaker("half_open")
    m.set_outbox_depth(5)
    host, port = m.start("127.0.0.1", 0)
    try:
        samples, text = _scrape(port)
    finally:
        m.stop()
    assert host == "127.0.0.1" and port > 0
    expected = Counter()
    for model, status, source, _ in ANSWERS:
        model = model if model in ("digits", "detector") else "(unknown)"
        status = status if status != "weird_code" else "other"
        expected[(model, status, source or "none")] += 1
    got = {k: v for k, v in samples.items() if k.startswith("k2edge_requests_total[")}
    assert len(got) == len(expected)
    for (model, status, source), n in expected.items():
        assert _sample(samples, "k2edge_requests_total", model=model, status=status, source=source) == n
    assert sum(got.values()) == len(ANSWERS)
    # latency histograms: one observation per stage reported, in seconds
    for stage in STAGES:
        want = sum(1 for a in ANSWERS if a[0] == "digits" and a[3] and isinstance(a[3].get(stage), float))
        assert (_sample(samples, "k2edge_latency_seconds_count", model="digits", stage=stage) or 0) == want, stage
    assert _sample(samples, "k2edge_latency_seconds_sum", model="digits", stage="cloud") == pytest.approx(0.85)
    assert _sample(samples, "k2edge_latency_seconds_bucket", model="digits", stage="total", le="0.002") == 2
    assert _sample(samples, "k2edge_latency_seconds_count", model="detector", stage="queue") == 1
    assert _sample(samples, "k2edge_batch_size_count", model="digits") == 2
    assert _sample(samples, "k2edge_batch_size_sum", model="digits") == 3
    assert _sample(samples, "k2edge_queue_depth") == 3 and _sample(samples, "k2edge_outbox_depth") == 5
    assert _sample(samples, "k2edge_thermal_state", k2edge_thermal_state="warm") == 1
    assert _sample(samples, "k2edge_thermal_state", k2edge_thermal_state="normal") == 0
    assert _sample(samples, "k2edge_temperature_celsius", sensor="GPU") == 76.0
    assert _sample(samples, "k2edge_escalations_total", model="digits", reason="other") == 1
    assert _sample(samples, "k2edge_escalations_total", model="digits", reason="prompt") == 1
    assert _sample(samples, "k2edge_cloud_breaker_state", k2edge_cloud_breaker_state="half_open") == 1
    assert _sample(samples, "k2edge_model_info", model="digits", version="1.2.0", profile="c2") == 1
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert all(n.startswith("k2edge_") for n in names), names


def test_model_versions_change_and_sensors_disappear():
    m = Metrics()
    m.set_model("digits", "1.2.0", "c2")
    m.set_model("digits", "1.3.0", "c2")
    m.set_thermal("normal", {"CPU": 50.0, "GPU": 51.0})
    m.set_thermal("unknown", {"CPU": 49.0})
    text = m.render().decode()
    assert 'k2edge_model_info{model="digits",profile="c2",version="1.3.0"} 1.0' in text
    assert "1.2.0" not in text
    assert 'sensor="GPU"' not in text and 'k2edge_temperature_celsius{sensor="CPU"} 49.0' in text
    m.forget_model("digits")
    m.observe_answer("digits", "ok", "edge")
    assert 'model="(unknown)"' in m.render().decode()


def test_registries_are_private_and_the_port_is_released():
    a, b = Metrics(), Metrics()
    a.set_model("x", "1.0.0", None)
    a.observe_answer("x", "ok", "edge")
    assert 'model="x"' in a.render().decode() and 'model="x"' not in b.render().decode()
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("k2edge_requests_total", {"model": "x", "status": "ok", "source": "edge"}) is None
    _, port = a.start("127.0.0.1", 0)
    with pytest.raises(MetricsError, match="already running"):
        a.start("127.0.0.1", 0)
    with pytest.raises(MetricsError, match=f"127.0.0.1:{port}"):
        b.start("127.0.0.1", port)
    a.stop()
    a.stop()
    assert b.start("127.0.0.1", port)[1] == port  # released by stop()
    b.stop()


_CHECK = Int8Check("classification", "passed", "held-out", 40, {"agreement": 0.975, "mean_abs_dp": 0.004}, {"agreement": 0.975})


def test_int8_check_gauges_follow_the_engines_a_model_runs():
    """One series per exported measure of the running engines' check; a switch replaces them; no INT8, no series."""
    m = Metrics()
    m.set_model("digits", "1.0.0", "c2", _CHECK)
    m.set_model("boxes", None, "cpu-dev", None)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(m.render().decode()) for s in f.samples if s.name == "k2edge_int8_check"}
    series = lambda measure: ("k2edge_int8_check", (("measure", measure), ("model", "digits"), ("profile", "c2")))  # noqa: E731
    assert samples == {series("agreement"): 0.975, series("verdict"): 1.0, series("judged"): 40.0}
    m.set_model("digits", "1.0.0", "c4", Int8Check("classification", "failed", "held-out", 40, {"agreement": 0.9}, {"agreement": 0.975}))
    text = m.render().decode()
    assert 'k2edge_int8_check{measure="agreement",model="digits",profile="c4"} 0.9' in text and 'profile="c2"' not in text
    assert 'k2edge_int8_check{measure="verdict",model="digits",profile="c4"} -1.0' in text
    m.set_model("digits", "1.0.0", "c2", Int8Check("classification", "inconclusive", "held-out", 40, {"agreement": 1.0}, {"agreement": 0.99}))
    assert 'k2edge_int8_check{measure="verdict",model="digits",profile="c2"} 0.0' in m.render().decode()
    m.set_model("digits", "1.1.0", "cpu-dev", None)
    assert "k2edge_int8_check{" not in m.render().decode()
    # a detector's strict measures, which a fallback can turn on, are series too
    boxes = {"recall": 0.98, "precision": 0.97, "score_ratio": 1.0, "strict_recall": 0.91, "strict_precision": 0.95}
    m.set_model("boxes", None, "c2", Int8Check("detection", "fallback", "held-out", 200, boxes, {"strict_recall": 0.93}))
    text = m.render().decode()
    assert 'k2edge_int8_check{measure="strict_recall",model="boxes",profile="c2"} 0.91' in text
    assert 'k2edge_int8_check{measure="strict_precision",model="boxes",profile="c2"} 0.95' in text


def test_grafana_dashboard_uses_only_metrics_that_exist():
    dash = json.loads((ROOT / "tools" / "grafana-k2edge.json").read_text())
    m = Metrics()
    m.set_model("digits", "1.0.0", "c2", _CHECK, memory={"host": 1 << 20})
    m.observe_answer("digits", "ok", "edge", {s: 1.0 for s in STAGES})
    m.observe_batch("digits", 1)
    m.observe_escalation("digits", "prompt")
    m.set_thermal("normal", {"CPU": 40.0})
    m.set_stream("cam", True, {"decoded": 4, "processed": 2, "dropped": 1, "shed": 1}, 1)
    m.set_stream_limit("cam", 7.5)
    m.observe_stream_escalation("cam", "described")
    m.observe_frame_age("cam", 0.02)
    m.set_media({"bytes": 10, "files": 1, "degraded": None, "removed": {"budget": 1, "age": 0}})
    m.set_trace_dropped(2)
    exposed = {s.name for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    # the device picker lists every daemon: a series every daemon exports (a camera-only one answers no request)
    (device,) = [v for v in dash["templating"]["list"] if v["name"] == "instance"]
    assert device["query"]["query"] == "label_values(k2edge_model_info, instance)"
    used = {n for e in exprs for n in re.findall(r"\bk2edge_[a-z0-9_]+", e)}
    assert len(dash["panels"]) >= 10 and used and used <= exposed, used - exposed
    families = {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                .removesuffix("_info") for n in exposed if not n.endswith("_created")}
    assert families <= {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                        .removesuffix("_info") for n in used}, "a metric no panel shows"


@pytest.mark.slow
def test_the_daemons_metrics_count_the_answers_it_sent_over_mqtt(run_daemon, broker):
    """[metrics] port: /metrics parses, and its counters equal the answers the broker carried, by status."""
    import base64
    import time

    from mqtt_support import SAMPLES, Client, free_port, image_request

    port = free_port()
    run_daemon(tables={"metrics": {"port": port}})
    client = Client(broker.port).connect()
    bad_tensor = {"id": "t-bad", "tensor": {"dtype": "float32", "shape": [1, 3, 3],
                                            "data": base64.b64encode(b"\0" * 36).decode()}}
    for i in range(7):
        client.publish("k2edge/t1/infer/digits", image_request(SAMPLES[i % len(SAMPLES)], rid=f"ok{i}"))
    client.publish("k2edge/t1/infer/digits", bad_tensor)
    client.publish("k2edge/t1/infer/digits", {"id": "junk", "image": "not base64!"})
    client.publish("k2edge/t1/infer/faces", image_request(SAMPLES[0], rid="nobody"))
    answers = client.wait_answers(10, timeout=60)
    deadline = time.monotonic() + 60  # the serving loop sets the gauges once a second: scrape until it has
    while True:
        samples, _ = _scrape(port)
        settled = (_sample(samples, "k2edge_thermal_state", k2edge_thermal_state="unknown") == 1
                   and _sample(samples, "k2edge_queue_depth") == 0)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    by_status = Counter(a["status"] if a["status"] == "ok" else a["error"]["code"] for a in answers)
    assert by_status == {"ok": 7, "bad_request": 2, "unknown_model": 1}, by_status
    assert _sample(samples, "k2edge_requests_total", model="digits", status="ok", source="edge") == 7
    assert _sample(samples, "k2edge_requests_total", model="digits", status="bad_request", source="none") == 2
    assert _sample(samples, "k2edge_requests_total", model="(unknown)", status="unknown_model", source="none") == 1
    total = sum(v for k, v in samples.items() if k.startswith("k2edge_requests_total["))
    assert total == len(answers)
    assert _sample(samples, "k2edge_latency_seconds_count", model="digits", stage="total") == 7
    batches = _sample(samples, "k2edge_batch_size_count", model="digits")
    assert 1 <= batches <= 7 and _sample(samples, "k2edge_batch_size_sum", model="digits") == 7
    assert _sample(samples, "k2edge_model_info", model="digits", version="unversioned", profile="cpu-dev") == 1
    host = _sample(samples, "k2edge_model_memory_bytes", model="digits", kind="host")
    assert host is not None and host >= 0
    assert _sample(samples, "k2edge_queue_depth") == 0
    assert _sample(samples, "k2edge_thermal_state", k2edge_thermal_state="unknown") == 1
    assert all(a.get("model_version", "missing") is None for a in answers)  # a bare onnx has no version
    client.close()


def test_a_scraper_gets_what_it_asks_for_over_ipv4_or_ipv6():
    """The endpoint negotiates as prometheus_client's own server did: the text format by default, OpenMetrics when
    asked (Prometheus asks), gzip when accepted, HEAD answered; it listens on IPv6 when the host is written so."""
    import gzip

    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    m = Metrics()
    m.set_model("digits", version="1.0.0", profile="c2")
    for host in ("127.0.0.1", "::1"):
        try:
            _, port = m.start(host, 0)
        except MetricsError as exc:
            assert host == "::1", exc
            pytest.skip(f"no IPv6 loopback here: {exc}")
        try:
            url = f"http://{'[::1]' if host == '::1' else host}:{port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                assert "k2edge_model_info" in resp.read().decode()
            req = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text; version=1.0.0",
                                                       "Accept-Encoding": "gzip"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
                assert resp.headers["Content-Encoding"] == "gzip"
                names = {f.name for f in openmetrics_families(gzip.decompress(resp.read()).decode())}
            assert {"k2edge_model", "k2edge_latency_seconds"} <= names  # OpenMetrics names an info family without _info
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10) as resp:
                assert resp.status == 200 and resp.read() == b""
        finally:
            m.stop()
