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
from PIL import Image
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
    run_daemon(models=[DIGITS, BOXES], service={"max_batch": 4})
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
    assert "building engines" not in d.output()  # told by the card, before minutes of building


def test_a_stream_on_a_classifier_is_refused_before_any_engine_builds(tmp_path, broker):
    """Streams take detection models: one on a classifier stops the start in one line naming the stream, before
    the engines build (minutes on a Jetson), as its card already tells the task."""
    from mqtt_support import DaemonProcess, write_config

    stream = {"name": "gate", "source": f"file://{tmp_path / 'gate.mp4'}", "model": "digits"}
    cfg = write_config(tmp_path / "bad.toml", broker.port, [DIGITS], streams=[stream])
    d = DaemonProcess(cfg, tmp_path / "bad.log").start()
    assert d.proc.wait(timeout=120) == 1
    out = d.output()
    assert "streams.0: model 'digits' is a classification model; streams take detection models" in out, out
    assert "building engines" not in out and "Traceback" not in out, out


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


# Ultralytics' other tasks, served beside the demo detector ------------------------------------------------
ULTRA = {"yolov8n-seg": "seg", "yolov8n-pose": "pose", "yolov8n-obb": "obb"}
ULTRA_KEYS = {"seg": {"box", "mask"}, "pose": {"box", "keypoints"}, "obb": {"rbox"}}


def _k2edge(*args) -> str:
    return subprocess.run([sys.executable, "-m", "k2edge", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout


@pytest.fixture(scope="module")
def ultra_models(tmp_path_factory):
    """Real Ultralytics exports (random weights) with the card `k2edge card init` writes, the score threshold
    lowered so that random weights answer at all (their scores are about 1e-4)."""
    import zoo

    d = tmp_path_factory.mktemp("ultra")
    photo = d / "street.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)).save(photo)
    models = {}
    for fixture, name in ULTRA.items():
        model = zoo.save(fixture, d / name / "model.onnx")
        _k2edge("card", "init", model)
        card = model.parent / "card.toml"
        card.write_text(card.read_text().replace("score_threshold = 0.25", "score_threshold = 0.0")
                        .replace("max_detections = 300", "max_detections = 3"))
        models[name] = model
    return models, photo


def _mask_iou(a: dict, b: dict) -> float:
    from pycocotools import mask as mask_utils

    rles = [{"size": m["size"], "counts": m["counts"].encode()} for m in (a, b)]
    return float(mask_utils.iou([rles[0]], [rles[1]], [0])[0][0])


def test_segmentation_pose_and_obb_served_beside_a_detector(run_daemon, broker, ultra_models):
    """Each task's answer as `k2edge infer` gives it: masks as COCO RLE at the photo's size, 17 keypoints in its
    pixels, oriented boxes; the demo detector beside them answers as before."""
    models, photo = ultra_models
    run_daemon(models=[BOXES] + [{"name": n, "onnx": p, "profile": "cpu-dev"} for n, p in models.items()],
               service={"max_batch": 1})
    client = Client(broker.port).connect()
    asked = {client.publish(f"k2edge/t1/infer/{n}", image_request(photo, rid=n)): n for n in models}
    asked[client.publish(DET_TOPIC, image_request(SCENES[0], rid="boxes"))] = "boxes"
    client.wait_answers(len(asked), timeout=120)
    answers = {asked[c]: a for a, c in client.answers}
    _same_boxes(answers["boxes"]["detections"], _infer_json(SCENES[0])["detections"])
    for name, model in models.items():
        a = answers[name]
        assert a["status"] == "ok" and a["model"] == name, a
        want = json.loads(_k2edge("infer", model, "-p", "cpu-dev", "--json", photo).splitlines()[0])["detections"]
        got = a["detections"]
        assert 1 <= len(got) == len(want) <= 3
        for g, w in zip(got, want):
            assert set(g) == {"index", "label", "score"} | ULTRA_KEYS[name], g.keys()
            assert g["label"] == w["label"] and g["score"] == pytest.approx(w["score"], rel=1e-4, abs=1e-6)
            if name == "seg":
                assert g["mask"]["size"] == [480, 640] and isinstance(g["mask"]["counts"], str)
                assert _mask_iou(g["mask"], w["mask"]) >= 0.99
            if name == "pose":
                assert len(g["keypoints"]) == 17
                assert np.allclose(g["keypoints"], w["keypoints"], atol=0.5)
            if name == "obb":
                assert np.allclose(g["rbox"], w["rbox"], atol=0.5)
        assert a["confidence"] == pytest.approx(max(x["score"] for x in got))
    client.close()


def test_an_answer_with_masks_over_max_answer_bytes_is_refused(run_daemon, broker, ultra_models, tmp_path):
    """300 masks do not fit in 1 KiB: payload_too_large, with the sizes, instead of a giant message."""
    models, photo = ultra_models
    big = tmp_path / "seg"
    big.mkdir()
    (big / "model.onnx").write_bytes(models["seg"].read_bytes())
    (big / "labels.txt").write_text((models["seg"].parent / "labels.txt").read_text())
    (big / "card.toml").write_text((models["seg"].parent / "card.toml").read_text()
                                   .replace("max_detections = 3", "max_detections = 300"))
    run_daemon(models=[{"name": "seg", "onnx": big / "model.onnx", "profile": "cpu-dev"}], service={"max_answer_bytes": 1024})
    client = Client(broker.port).connect()
    client.publish("k2edge/t1/infer/seg", image_request(photo, rid="masks"))
    a = client.wait_answers(1, timeout=120)[0]
    assert a["status"] == "error" and a["error"]["code"] == "payload_too_large", a
    assert "max_answer_bytes" in a["error"]["message"]
    client.close()


def test_an_escalation_rule_for_a_label_the_model_lacks_is_a_warning_in_the_status(run_daemon, broker, tmp_path):
    """A rule's labels are the model's: "person" on the digits detector is a rule that can never fire. Said in the
    stream's status warnings and the log (not refused: a deploy that relabels the model must not stop the next start);
    the labels it has raise no warning."""
    key = tmp_path / "k2.key"
    key.write_text("sk-test\n")
    cloud = {"base_url": "http://127.0.0.1:9/v1", "model": "kimi-k2.5", "api_key_file": str(key)}
    stream = {"name": "gate", "source": f"file://{tmp_path / 'gate.mp4'}", "model": "boxes",
              "lines": [{"name": "door", "start": [160, 0], "end": [160, 240]}],
              "escalation": [{"on": "line_cross", "line": "door", "labels": ["7"]},
                             {"on": "line_cross", "line": "door", "labels": ["7", "person"]}]}
    client = Client(broker.port).connect()
    client.subscribe("k2edge/t1/status")
    d = run_daemon(models=[BOXES], streams=[stream], tables={"cloud": cloud})
    said = ("escalation.1.labels: 'person' not among the model's 10 labels ('0', '1', '2', '3', '4', '5', '6', '7', '8', "
            "'9'): the rule can never fire for it")
    client.wait_for(lambda c: c.statuses and said in c.statuses[-1]["streams"]["gate"]["warnings"], timeout=60)
    assert client.statuses[-1]["streams"]["gate"]["warnings"] == [said]
    assert said in d.output()
    client.close()
