"""The INT8 bounds on three public pretrained models (docs/int8.md, "Public models: INT8 share and accuracy"),
with calibration and evaluation sets made from what the installed packages ship (tests/public_sets.py).

* NudeNet's YOLOv8n at 320: >= 80 % of learned-layer FLOPs in INT8, recall and precision of the INT8 boxes
  against FP32's (IoU 0.5, same label) >= 0.90 on >= 100 held-out images;
* PP-OCR's text-direction classifier: >= 90 % INT8, top-1 within 0.5 point of FP32 on >= 400 lines;
* PP-OCRv4's DBNet at 480 x 480: >= 50 % INT8, the probability map's mean cosine to FP32 >= 0.99;
* a calibration set whose held-out part has too few FP32 boxes gives an inconclusive check.

On GPU-only ``["int8", "fp16"]`` and on ``c4``; each model's calibration statistics are shared by its profiles.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from k2edge import Engine
from k2edge.engine.check import compare_outputs
from public_sets import detector_set, page_set, textline_set
from test_int8_fixtures import INT8, packaged_model

GPU_CHAIN = {"name": "gpu-int8-fp16", "edge_runtime": {"offload_ratio": 1.0, "precision_fallback": ["int8", "fp16"]}}
PROFILES = [GPU_CHAIN, "c4"]
IDS = ["gpu-int8-fp16", "c4"]
DBNET_CARD = ('task = "tensor"\n[input]\nname = "x"\nsize = [480, 480]\nresize = "stretch"\ncolor = "BGR"\n'
              'scale = 0.00392156862745098\nmean = [0.485, 0.456, 0.406]\nstd = [0.229, 0.224, 0.225]\n')


def _outputs(engine, paths) -> list[dict]:
    out = []
    with engine:
        for p in paths:
            batch, _ = engine.stage_mapped([str(p)])
            got = engine.infer({engine.input_name: batch})
            out.append({k: np.asarray(v)[:1] for k, v in got.items()})
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tmp_path_factory.mktemp("int8-public")


@pytest.mark.slow
@pytest.mark.parametrize("profile", PROFILES, ids=IDS)
def test_yolov8n_runs_mostly_int8_at_fp32_recall_and_precision(profile, data):
    """>= 80 % of YOLOv8n's learned FLOPs in INT8; recall and precision against FP32 >= 0.90 on 100 other images."""
    model, card = packaged_model("nudenet-320n"), INT8 / "nudenet-320n" / "card.toml"
    calib = data / "det-calib"
    if not calib.exists():
        detector_set(calib, 500, 11)
        detector_set(data / "det-eval", 100, 12)
    engine = Engine.build(model, profile, calib=calib, card=card, cache_dir=data / "cache")
    fp32 = Engine.build(model, "cpu-dev", card=card, cache_dir=data / "cache")
    shares, check = engine.plan.precision_flops, engine.info.int8_check
    assert shares["measured"] and shares["model"]["int8"] >= 0.80, (shares, check.line())
    assert check.status in ("passed", "fallback") and check.samples == 100, check.line()
    paths = sorted((data / "det-eval").glob("*.jpg"))
    d = fp32.decoder
    m = compare_outputs("detection", _outputs(fp32, paths), _outputs(engine, paths), detections=lambda o: d.detections(o, [None]))
    assert len(paths) >= 100 and m["reference_boxes"] >= 50
    assert m["recall"] >= 0.90 and m["precision"] >= 0.90, (m, check.line())


@pytest.mark.slow
def test_a_held_out_part_with_too_few_boxes_is_inconclusive(tmp_path):
    """The fixture's 48 scene crops hold out 9 images with about one face: the check is inconclusive, moves nothing,
    and says what data to give."""
    engine = Engine.build(packaged_model("nudenet-320n"), GPU_CHAIN, calib=INT8 / "calib",
                          card=INT8 / "nudenet-320n" / "card.toml", cache_dir=tmp_path)
    check = engine.info.int8_check
    assert check.status == "inconclusive" and check.power[1] < 50 and check.fallback == (), check.line()
    assert "at least 50 FP32 boxes" in check.line() and not check.passed


@pytest.mark.slow
@pytest.mark.parametrize("profile", PROFILES, ids=IDS)
def test_classifier_runs_mostly_int8_within_half_a_point(profile, data):
    """>= 90 % of the PP-OCR classifier's learned FLOPs in INT8; top-1 within 0.5 point of FP32 on 400 lines."""
    from k2edge.engine.evaluate import evaluate_classifier
    from k2edge.model.datasets import open_dataset

    model, card = packaged_model("ppocr-cls"), INT8 / "ppocr-cls" / "card.toml"
    calib, evaluation = data / "cls-calib", data / "cls-eval"
    if not calib.exists():
        textline_set(calib, 1280, 21)
        textline_set(evaluation, 400, 22)
    engine = Engine.build(model, profile, calib=calib, card=card, cache_dir=data / "cache")
    fp32 = Engine.build(model, "cpu-dev", card=card, cache_dir=data / "cache")
    shares, check = engine.plan.precision_flops, engine.info.int8_check
    assert shares["model"]["int8"] >= 0.90, (shares, check.line())
    assert check.status in ("passed", "fallback") and check.samples == 256, check.line()
    dataset = open_dataset(evaluation, ["0", "180"])
    with fp32:
        want = evaluate_classifier(fp32, dataset)["top1"]
    with engine:
        got = evaluate_classifier(engine, dataset)["top1"]
    assert len(dataset) >= 400 and abs(got - want) <= 0.005, (got, want, check.line())


def _dbnet() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None:
        pytest.skip("rapidocr_onnxruntime is not installed (pip install -e '.[dev]')")
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / "ch_PP-OCRv4_det_infer.onnx"
    if not path.is_file():
        pytest.skip(f"rapidocr_onnxruntime has no {path.name}")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("profile", PROFILES, ids=IDS)
def test_dbnet_runs_half_int8_with_its_map_at_cosine_099(profile, data):
    """>= 50 % of PP-OCRv4 DBNet's learned FLOPs in INT8; its probability map's mean cosine to FP32 >= 0.99."""
    model = _dbnet()
    card = data / "dbnet.card.toml"
    calib = data / "pages-calib"
    if not calib.exists():
        card.write_text(DBNET_CARD)
        page_set(calib, 150, 31)
        page_set(data / "pages-eval", 40, 32)
    engine = Engine.build(model, profile, calib=calib, card=card, cache_dir=data / "cache")
    fp32 = Engine.build(model, "cpu-dev", card=card, cache_dir=data / "cache")
    shares, check = engine.plan.precision_flops, engine.info.int8_check
    assert shares["model"]["int8"] >= 0.50, (shares, check.line())
    assert check.status in ("passed", "fallback") and check.samples == 30, check.line()
    paths = sorted((data / "pages-eval").glob("*.jpg"))
    m = compare_outputs("tensor", _outputs(fp32, paths), _outputs(engine, paths))
    assert m["cosine"] >= 0.99, (m, check.line())
