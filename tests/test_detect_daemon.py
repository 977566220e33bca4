"""The demo detector (models/detector) and the digits classifier served side by side over MQTT, against a
real mosquitto and the K2 stand-in: detection answers carry ``detections`` (the boxes `k2edge infer` gives),
classifier answers ``top_k``; batching, deadlines and escalation work for both; a raw-tensor model answers
``outputs`` and an answer over ``max_answer_bytes`` is refused."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from graphs import grid_detector
from k2_server import K2StandIn, answer
from mqtt_support import DIGITS, ROOT, SAMPLES, TOPIC, Client, image_request, tensor_request

pytestmark = pytest.mark.slow
H, W = 64, 96
DET_TOPIC = "k2edge/t1/infer/boxes"
DETECTOR = ROOT / "models" / "detector"
BOXES = {"name": "boxes", "onnx": DETECTOR / "model.onnx", "profile": "cpu-dev"}  # its card.toml lies beside it
SCENES = sorted((DETECTOR / "samples").glob("*.jpg"))


@pytest.fixture(scope="module")
def det_dir(tmp_path_factory):
    """A small hand-weighted YOLOv8-layout graph, served as raw tensors."""
    d = tmp_path_factory.mktemp("detd")
    onnx.save(grid_detector(H, W), str(d / "boxes.onnx"))
    return d


def _infer_json(image) -> dict:
    out = subprocess.run([sys.executable, "-m", "k2edge", "infer", str(DETECTOR / "model.onnx"), "-p", "cpu-dev", "--json",
                          str(image)], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return json.loads(out.splitlines()[0])


def _same_boxes(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(sorted(got, key=lambda d: d["box"]), sorted(want, key=lambda d: d["box"])):
        assert g["label"] == w["label"] and np.allclose(g["box"], w["box"], atol=1e-3) and g["score"] == pytest.approx(w["score"])


def test_detector_and_classifier_side_by_side(run_daemon, broker):
    """Detections equal `k2edge infer`'s; classifier answers are unchanged; both batch; both honour deadlines."""
    d = run_daemon(models=[DIGITS, BOXES], service={"max_batch": 4})
    client = Client(broker.port).connect()
    scenes = SCENES
    det = {client.publish(DET_TOPIC, image_request(p, rid=f"det-{i}")): p for i, p in enumerate(scenes * 3)}
    cls = {client.publish(TOPIC, image_request(p, rid=f"cls-{i}")): p for i, p in enumerate(SAMPLES * 2)}
    late = client.publish(DET_TOPIC, image_request(scenes[0], rid="det-late", deadline_ms=1))
    client.wait_answers(len(det) + len(cls) + 1, timeout=60)
    answers = {c: a for a, c in client.answers}
    want = {p: _infer_json(p)["detections"] for p in scenes}
    for corr, p in det.items():
        a = answers[corr]
        assert a["status"] == "ok" and "top_k" not in a and a["model"] == "boxes", a
        _same_boxes(a["detections"], want[p])
        assert a["confidence"] == max(x["score"] for x in a["detections"])
    for corr, p in cls.items():
        a = answers[corr]
        assert a["status"] == "ok" and "detections" not in a and a["top_k"][0]["label"] == p.stem.split("-")[1]
    assert max(a["latency_ms"]["batch"] for c, a in answers.items() if c in det) > 1  # detections batch too
    assert answers[late]["error"]["code"] == "deadline_exceeded"
    client.close()


def test_a_detector_escalates_when_nothing_is_found_confidently(run_daemon, broker, tmp_path):
    """max_box_score below the threshold: K2 gets the image and the edge's boxes; the answer keeps the boxes."""
    with K2StandIn() as k2:
        k2.fallback = answer("two white squares and a red one")
        boxes = {**BOXES, "escalation": {"measure": "max_box_score", "threshold": 0.999999}}
        run_daemon(models=[boxes], env={"K2_TEST_KEY": "k"},
                   tables={"cloud": {"base_url": k2.url, "model": "kimi-k2.5", "api_key_env": "K2_TEST_KEY",
                                     "timeout_s": 5.0, "max_retries": 0}})
        client = Client(broker.port).connect()
        client.publish(DET_TOPIC, image_request(SCENES[0], rid="esc"))
        a = client.wait_answers(1, timeout=30)[0]
        assert a["status"] == "ok" and a["source"] == "cloud" and a["text"] == "two white squares and a red one", a
        assert a["detections"] and a["cloud_input"] == "image"
        assert "max_box_score" in a["escalation_reason"]
        parts = k2.chat_requests[0].body["messages"][-1]["content"]
        text = " ".join(p["text"] for p in parts if p["type"] == "text")
        assert '"box"' in text and '"label"' in text  # the edge's detections went along
        client.close()


def test_a_classifier_measure_on_a_detector_is_refused_at_start(tmp_path, broker):
    from mqtt_support import DaemonProcess, write_config

    boxes = {**BOXES, "escalation": {"measure": "margin"}}
    cfg = write_config(tmp_path / "bad.toml", broker.port, [boxes])
    d = DaemonProcess(cfg, tmp_path / "bad.log").start()
    assert d.proc.wait(timeout=120) == 1
    assert "models.0.escalation.measure: margin judges a classifier" in d.output()


def test_tensor_task_answers_outputs_and_large_answers_are_refused(run_daemon, broker, det_dir, tmp_path):
    """task = "tensor": the raw outputs, base64; above max_answer_bytes, payload_too_large."""
    import onnxruntime as ort

    (tmp_path / "raw.card.toml").write_text('task = "tensor"\n')
    raw = {"name": "raw", "onnx": det_dir / "boxes.onnx", "profile": "cpu-dev", "card": str(tmp_path / "raw.card.toml")}
    run_daemon(models=[raw], device="t1")
    run_daemon(models=[raw], device="t2", service={"max_answer_bytes": 2048})
    client = Client(broker.port).connect()
    x = np.random.default_rng(0).random((3, H, W), dtype=np.float32)
    client.publish("k2edge/t1/infer/raw", tensor_request(x, rid="raw"))
    client.publish("k2edge/t2/infer/raw", tensor_request(x, rid="too-big"))
    answers = {a["id"]: a for a in client.wait_answers(2)}
    out = answers["raw"]["outputs"]
    want = ort.InferenceSession(str(det_dir / "boxes.onnx")).run(None, {"x": x[None]})[0]
    (name, spec), = out.items()
    got = np.frombuffer(base64.b64decode(spec["data"]), dtype=spec["dtype"]).reshape(spec["shape"])
    assert np.allclose(got, want[0], atol=1e-5)
    err = answers["too-big"]["error"]
    assert err["code"] == "payload_too_large" and "max_answer_bytes" in err["message"]
    client.close()
