"""The INT8 accuracy fixtures are what their READMEs say (tests/fixtures/int8, tests/fixtures/detector-silu).

Integrity only: the packaged models are the files the references were made from, the FP32 figures in
``reference.json`` reproduce through k2edge's own staging, the calibration sets are disjoint from the test
data, and the SiLU demo detector really is SiLU (Sigmoid + Mul). The INT8 behaviour itself is tested where
the quantisation is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from k2edge.config.card import load_card
from k2edge.tasks.preprocess import Preprocess

FIXTURES = Path(__file__).parent / "fixtures"
INT8 = FIXTURES / "int8"
SILU = FIXTURES / "detector-silu"
MANIFEST = json.loads((INT8 / "models.json").read_text())
REFERENCE = json.loads((INT8 / "reference.json").read_text())


def packaged_model(name: str) -> Path:
    entry = MANIFEST[name]
    spec = importlib.util.find_spec(entry["package"])  # without importing it (nudenet imports cv2)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{entry['package']} is not installed (pip install -e '.[dev]')")
    path = Path(list(spec.submodule_search_locations)[0]) / entry["resource"]
    if not path.is_file():
        pytest.skip(f"{entry['package']} has no {entry['resource']}")
    return path


def session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_packaged_model_is_the_one_the_references_were_made_from(name):
    path = packaged_model(name)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == MANIFEST[name]["sha256"], (
        f"{path} differs from {MANIFEST[name]['package']} {MANIFEST[name]['version']}'s: rebuild the fixtures")


def test_detector_fp32_top_detection_reproduces():
    path = packaged_model("nudenet-320n")
    card = load_card(INT8 / "nudenet-320n" / "card.toml")
    labels = (INT8 / "nudenet-320n" / "labels.txt").read_text().split("\n")[:-1]
    assert len(labels) == 18 and "FACE_FEMALE" in labels
    pre = Preprocess.from_card(card)
    s = session(path)
    photos = REFERENCE["nudenet-320n"]["photos"]
    assert len(photos) >= 2
    for name, ref in photos.items():
        x, geometry = pre.stage_mapped(str(INT8 / ref["file"]))
        out = s.run(None, {"images": x[None]})[0][0]
        scores = out[4:]
        c, a = np.unravel_index(int(np.argmax(scores)), scores.shape)
        cx, cy, w, h = out[:4, a]
        box = geometry.to_original(np.array([[cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]]))[0]
        assert labels[c] == ref["fp32"]["label"], name
        assert abs(float(scores[c, a]) - ref["fp32"]["score"]) < 2e-3, name
        assert np.abs(box - np.array(ref["fp32"]["box"])).max() < 1.0, name


def test_classifier_fp32_top1_reproduces():
    path = packaged_model("ppocr-cls")
    pre = Preprocess.from_card(load_card(INT8 / "ppocr-cls" / "card.toml"))
    files = sorted((INT8 / "textlines").glob("*/*.jpg"))
    x = np.stack([pre.stage(str(f)) for f in files])
    y = np.array([["0", "180"].index(f.parent.name) for f in files])
    s = session(path)
    probs = np.concatenate([s.run(None, {"x": x[i:i + 64]})[0] for i in range(0, len(x), 64)])
    assert len(files) == REFERENCE["ppocr-cls"]["samples"]
    assert abs(float((probs.argmax(1) == y).mean()) - REFERENCE["ppocr-cls"]["fp32_top1"]) < 1e-3


def test_calibration_sets_are_disjoint_from_the_test_data():
    calib = sorted((INT8 / "calib").glob("*.jpg"))
    assert len(calib) >= 32
    photos = {Path(p["file"]).stem for p in REFERENCE["nudenet-320n"]["photos"].values()}
    assert not any(p in c.stem for c in calib for p in photos)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    test_lines = {digest(p) for p in (INT8 / "textlines").glob("*/*.jpg")}
    text_calib = sorted((INT8 / "textlines-calib").glob("*.jpg"))
    assert len(text_calib) >= 32 and not test_lines & {digest(p) for p in text_calib}


def test_silu_detector_is_the_demo_detector_with_silu():
    proto = onnx.load(str(SILU / "model.onnx"))
    body = [n for n in proto.graph.node if not n.name.startswith("head/")]
    ops = [n.op_type for n in body]
    assert "Relu" not in ops and ops.count("Sigmoid") == ops.count("Mul") == 16 and ops.count("Conv") == 19
    producer = {o: n for n in body for o in n.output}
    for mul in (n for n in body if n.op_type == "Mul"):
        sig = next(producer[i] for i in mul.input if i in producer and producer[i].op_type == "Sigmoid")
        assert set(mul.input) == {sig.input[0], sig.output[0]}  # x * sigmoid(x)
    card = load_card(SILU / "card.toml")
    assert card.task == "detection" and card.input.size == (160, 160) and card.input.resize == "letterbox"
    assert (SILU / "labels.txt").read_text().split() == [str(d) for d in range(10)]
