"""Cards on a real YOLOv8 architecture: the YOLOv8n exports of tests/fixtures/yolov8 (random weights,
made by tools/make_yolov8_fixture.py). Layout and the suggested card, dynamic axes
fixed by the card's size, letterbox staging equal to ultralytics' preprocessing written out by
hand, and the INT8 head: everything after the detection convs, DFL included. Their random weights
score every anchor alike, so box-for-box comparisons run on trained models (tests/test_detect_pipeline.py,
tests/test_demo_detector.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

import zoo
from test_cli import k2edge

if "yolov8n-320" not in getattr(zoo, "YOLOV8_NAMES", ()):
    pytest.skip("the YOLOv8n export fixtures (tests/fixtures/yolov8, made by tools/make_yolov8_fixture.py) are missing", allow_module_level=True)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    d = tmp_path_factory.mktemp("yolov8")
    return {name: zoo.save(name, d / f"{name}.onnx") for name in zoo.YOLOV8_NAMES}


def _letterbox_by_hand(img: Image.Image, h: int, w: int) -> np.ndarray:
    """Ultralytics' preprocessing: keep the ratio, centre, pad with 114, RGB / 255, NCHW."""
    r = min(w / img.width, h / img.height)
    nw, nh = round(img.width * r), round(img.height * r)
    canvas = Image.new("RGB", (w, h), (114, 114, 114))
    canvas.paste(img.convert("RGB").resize((nw, nh), Image.Resampling.BILINEAR), ((w - nw) // 2, (h - nh) // 2))
    return (np.asarray(canvas, np.float32) / 255).transpose(2, 0, 1)


def test_inspect_and_card_init_recognise_yolov8(exports, tmp_path):
    data = json.loads(k2edge("inspect", str(exports["yolov8n-320"]), "--json").stdout)
    assert data["outputs"][0]["shape"] == [1, 84, 2100]
    assert data["card"]["suggested"]["task"] == "detection"
    assert "Ultralytics export metadata: task detection, 80 class name(s), imgsz [320, 320]" in data["card"]["why"]
    out = tmp_path / "card.toml"
    k2edge("card", "init", str(exports["yolov8n-320"]), "--out", str(out))
    text = out.read_text()
    for line in ('task = "detection"', "size = [320, 320]", 'resize = "letterbox"', "pad_value = 114", 'color = "RGB"',
                 'format = "yolov8"'):
        assert line in text


@pytest.mark.parametrize("size", [(240, 320), (320, 200)])  # landscape, portrait (w, h)
def test_letterbox_staging_matches_ultralytics_and_boxes_round_trip(exports, tmp_path, size):
    """The card's letterbox equals the hand-written one; boxes map back inside the original image."""
    from k2edge import Engine

    card = tmp_path / "card.toml"
    k2edge("card", "init", str(exports["yolov8n-320"]), "--out", str(card))
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    with Engine.build(exports["yolov8n-320"], "cpu-dev", card=card) as engine:
        batch, geoms = engine.stage_mapped([img])
        np.testing.assert_allclose(batch[0], _letterbox_by_hand(img, 320, 320), atol=1e-6)
        g = geoms[0]
        box = np.array([[0, 0, size[0], size[1]]], np.float32)
        inside = box.copy()
        inside[:, 0::2] = inside[:, 0::2] * g.scale_x + g.pad_x
        inside[:, 1::2] = inside[:, 1::2] * g.scale_y + g.pad_y
        np.testing.assert_allclose(g.to_original(inside), box, atol=1e-3)
        dets = engine.answers(engine.infer({engine.input_name: batch}), 1, geoms)[0]["detections"]
        assert len(dets) <= engine.card.detection.max_detections
        assert all(0 <= d["box"][0] <= d["box"][2] <= size[0] and 0 <= d["box"][1] <= d["box"][3] <= size[1] for d in dets)


def test_dynamic_export_takes_its_size_from_the_card(exports, tmp_path):
    """[batch, 3, height, width] needs no --input-shape when the card gives size: [256, 384] -> 2016 anchors."""
    from k2edge import Engine

    card = tmp_path / "card.toml"
    card.write_text('task = "detection"\n[input]\nsize = [256, 384]\nresize = "letterbox"\ncolor = "RGB"\n')
    engine = Engine.build(exports["yolov8n-dynamic"], "cpu-dev", card=card)
    assert engine.input_shape == (1, 3, 256, 384)
    assert engine.decoder.classes == 80
    with engine:
        out = engine.infer({engine.input_name: engine.stage([Image.new("RGB", (640, 360), (30, 90, 160))])})
    assert out[engine.output_names[0]].shape == (1, 84, 32 * 48 + 16 * 24 + 8 * 12)


def test_int8_head_is_everything_after_the_detection_convs(exports):
    """The head: DFL (its fixed Conv included), anchor decoding, the sigmoid and the final Concat; no learned Conv."""
    from k2edge.engine.quantize import detection_head
    from k2edge.model import normalise

    nm = normalise(str(exports["yolov8n-320"]))
    g = nm.graph
    head = detection_head(g, g.outputs[0])
    ops = {n.name: n.op_type for n in g.nodes}
    convs = [n for n in head if ops[n] == "Conv"]
    assert len(convs) == 1 and "dfl" in convs[0]
    assert {"Sigmoid", "Softmax", "Concat"} <= {ops[n] for n in head}
    assert g.nodes[g.producer[g.outputs[0]]].name in head
    learned = [n.name for n in g.nodes if n.op_type == "Conv" and n.name not in head]
    assert len(learned) > 50  # the backbone and the cv2/cv3 branch convs are not decoding (detect_branches adds those)
