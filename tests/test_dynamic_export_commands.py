"""Every command that takes a MODEL, and the daemon's [[models]], on the dynamic YOLOv8n export with its
card beside it and no --input-shape: each takes the input size from the card, one resolution for all
(k2edge.config.resolve)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

import zoo
from test_cli import k2edge

SIZE = [160, 192]  # [height, width]: the card's, not the export's metadata imgsz [320, 320]
SHAPE = [1, 3, *SIZE]


@pytest.fixture(scope="module")
def dyn(tmp_path_factory):
    """The export, the card `card init` writes with its size set to SIZE, one photo, a one-image COCO set, a
    three-frame video."""
    from stream_videos import make_video

    d = tmp_path_factory.mktemp("dyn")
    model = zoo.save("yolov8n-dynamic", d / "model.onnx")
    k2edge("card", "init", str(model))
    card = d / "card.toml"
    text = card.read_text()
    assert "size = [320, 320]" in text
    card.write_text(text.replace("size = [320, 320]", f"size = [{SIZE[0]}, {SIZE[1]}]"))
    photo = d / "eval" / "a.jpg"
    photo.parent.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (120, 160, 3), dtype=np.uint8)).save(photo)
    box = [20.0, 30.0, 60.0, 50.0]
    doc = {"images": [{"id": 1, "file_name": "a.jpg", "width": 160, "height": 120}],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 0, "bbox": box, "area": box[2] * box[3], "iscrowd": 0}],
           "categories": [{"id": i, "name": n} for i, n in enumerate((d / "labels.txt").read_text().split())]}
    (d / "eval" / "annotations.json").write_text(json.dumps(doc))
    make_video(d / "clip.mp4", size=(160, 120), fps=5, frames=3)
    return SimpleNamespace(model=str(model), card=card, photo=str(photo), dataset=str(d / "eval" / "annotations.json"),
                           video=str(d / "clip.mp4"), dir=d)


def test_inspect(dyn):
    data = json.loads(k2edge("inspect", dyn.model, "--json").stdout)
    assert data["inputs"][0]["shape"] == SHAPE and data["card"]["card"] == str(dyn.card)


def test_plan(dyn):
    plan = json.loads(k2edge("plan", dyn.model, "-p", "cpu-dev", "--json").stdout)
    assert plan["segments"] and plan["model"] == dyn.model


def test_build(dyn):
    data = json.loads(k2edge("build", dyn.model, "-p", "cpu-dev", "--json").stdout)
    assert data["input"]["shape"] == SHAPE and data["card"] == str(dyn.card)


def test_infer(dyn):
    answer = json.loads(k2edge("infer", dyn.model, "-p", "cpu-dev", "--json", dyn.photo).stdout.splitlines()[0])
    assert isinstance(answer["detections"], list)


def test_eval(dyn):
    result = json.loads(k2edge("eval", dyn.model, "-p", "cpu-dev", "--dataset", dyn.dataset, "--json").stdout)
    assert result["task"] == "detection" and result["images"] == 1 and 0 <= result["map50"] <= 1


def test_pareto_sweep(dyn):
    """The smallest sweep the CLI takes: one profile, one run of one request."""
    out = dyn.dir / "sweep"
    doc = json.loads(k2edge("pareto-sweep", dyn.model, "--dataset", dyn.dataset, "--profiles", "cpu-dev", "--runs", "1",
                            "--requests", "1", "--warmup", "0", "--out", str(out), "--json").stdout)
    [record] = doc["configs"]
    assert record["status"] == "ok", record["error"]
    assert record["accuracy_metric"] == "mAP@0.5" and doc["dataset"]["samples"] == 1


def test_cloud_curve(dyn):
    out = json.loads(k2edge("cloud", "curve", dyn.model, "-p", "cpu-dev", "--dataset", dyn.dataset, "--shares", "0,100",
                            "--json").stdout)
    assert [p["escalated"] for p in out["points"]] == [0, 1]


def test_card_show(dyn):
    data = json.loads(k2edge("card", "show", dyn.model, "--json").stdout)
    assert list(data["input"]["size"]) == SIZE and data["sources"]["input.size"] == str(dyn.card)


def test_watch(dyn):
    lines = [json.loads(x) for x in k2edge("watch", dyn.model, dyn.video, "--json").stdout.splitlines()]
    assert [x["frame"] for x in lines if "frame" in x] == [0, 1, 2]


def test_a_daemon_models_entry(dyn, run_daemon, broker):
    """[[models]] with only a name, the ONNX and a profile: the daemon finds the card and serves the export."""
    from pathlib import Path

    from mqtt_support import Client, image_request

    run_daemon(models=[{"name": "dyn", "onnx": dyn.model, "profile": "cpu-dev"}], service={"max_batch": 1})
    client = Client(broker.port).connect()
    client.publish("k2edge/t1/infer/dyn", image_request(Path(dyn.photo), rid="dyn"))
    [answer] = client.wait_answers(1, timeout=120)
    client.close()
    assert answer["status"] == "ok" and isinstance(answer["detections"], list), answer
