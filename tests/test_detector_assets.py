"""The demo detector's files (models/detector/): model layout, card, labels, COCO eval set, samples, size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from PIL import Image

if sys.version_info >= (3, 11):
    import tomllib
else:  # a runtime dependency below 3.11
    import tomli as tomllib

DETECTOR = Path(__file__).resolve().parents[1] / "models" / "detector"
LABELS = [str(d) for d in range(10)]
ANCHORS = 20 * 20 + 10 * 10 + 5 * 5  # strides 8, 16, 32 on a 160 x 160 input
# what the DLA runs (Conv with BN folded, ReLU, MaxPool, nearest Resize, channel Concat)
BACKBONE_OPS = {"Conv", "Relu", "MaxPool", "Resize", "Concat"}


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return onnx.load(str(DETECTOR / "model.onnx"))


def test_everything_fits_in_5_mb():
    total = sum(p.stat().st_size for p in DETECTOR.rglob("*") if p.is_file())
    assert total < 5 * 2**20, total


def test_card_is_the_issue_format_for_a_letterboxed_yolov8_detector():
    card = tomllib.loads((DETECTOR / "card.toml").read_text())
    assert card == {
        "task": "detection",
        "labels": "labels.txt",
        "input": {"name": "images", "size": [160, 160], "resize": "letterbox", "pad_value": 114, "color": "RGB",
                  "scale": 1 / 255, "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]},
        "detection": {"format": "yolov8", "score_threshold": 0.25, "iou_threshold": 0.45, "max_detections": 100,
                      "class_agnostic_nms": False},
    }
    assert (DETECTOR / "labels.txt").read_text().split("\n") == LABELS + [""]


def test_model_has_the_yolov8_output_layout(model):
    """images [N, 3, 160, 160] -> output0 [N, 4 + 10, 525]; boxes in input pixels, scores in [0, 1]."""
    dims = lambda vi: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]  # noqa: E731
    assert [(i.name, dims(i)) for i in model.graph.input] == [("images", ["N", 3, 160, 160])]
    assert [(o.name, dims(o)) for o in model.graph.output] == [("output0", ["N", 14, ANCHORS])]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = session.run(["output0"], {"images": np.random.default_rng(0).random((2, 3, 160, 160), dtype=np.float32)})[0]
    assert out.shape == (2, 14, ANCHORS)
    assert out[:, 4:].min() >= 0 and out[:, 4:].max() <= 1
    assert (out[:, 2:4] > 0).all()  # w, h


def test_head_is_named_and_the_backbone_is_dla_friendly(model):
    """Decoding nodes are under head/ and end the graph; everything before them is DLA-runnable ops."""
    head = [n for n in model.graph.node if n.name.startswith("head/")]
    rest = [n for n in model.graph.node if not n.name.startswith("head/")]
    assert head and model.graph.node[-1] in head and model.graph.node[-1].op_type == "Concat"
    assert {n.op_type for n in head} >= {"Sigmoid", "Concat"}
    assert not {n.op_type for n in head} & {"Conv", "Gemm", "MatMul"}  # no learned layers in the head
    assert {n.op_type for n in rest} <= BACKBONE_OPS
    for n in rest:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "Resize":
            assert attrs["mode"] == b"nearest" and attrs["coordinate_transformation_mode"] == b"asymmetric"
        if n.op_type == "Concat":
            assert attrs["axis"] == 1


def test_eval_set_is_coco_with_relative_files_and_label_categories():
    folder = DETECTOR / "eval"
    coco = json.loads((folder / "annotations.json").read_text())
    assert [c["name"] for c in coco["categories"]] == LABELS
    assert len({c["id"] for c in coco["categories"]}) == len(LABELS)
    ids = {c["id"] for c in coco["categories"]}
    images = {im["id"]: im for im in coco["images"]}
    assert len(images) >= 150 and len(coco["annotations"]) >= 3 * len(images)
    shapes = set()
    for im in images.values():
        path = folder / im["file_name"]
        assert not Path(im["file_name"]).is_absolute() and path.is_file()
        with Image.open(path) as pil:
            assert pil.size == (im["width"], im["height"])
        shapes.add(np.sign(im["width"] - im["height"]))
    assert shapes == {-1, 0, 1}  # portrait, square and landscape scenes: the letterbox matters
    for a in coco["annotations"]:
        x, y, w, h = a["bbox"]
        im = images[a["image_id"]]
        assert a["category_id"] in ids and a["iscrowd"] == 0
        assert w > 0 and h > 0 and x >= 0 and y >= 0 and x + w <= im["width"] and y + h <= im["height"]


def test_calibration_set_and_samples():
    calib = sorted((DETECTOR / "calib").glob("*.jpg"))
    assert len(calib) >= 32
    samples = sorted((DETECTOR / "samples").glob("*.jpg"))
    sizes = [Image.open(p).size for p in samples]
    assert any(w > h for w, h in sizes) and any(w < h for w, h in sizes)
