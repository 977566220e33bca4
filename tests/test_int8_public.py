"""INT8 on public pretrained models (docs/int8.md, "Public models: INT8 share and accuracy").

A calibration set whose held-out part has too few FP32 boxes gives an inconclusive check; the classifier meets its
bound GPU-only and under c4; YOLOv8n and DBNet meet theirs, judged by ``bench/bench_int8_public.py``'s own code on
its own sets (1,000 calibration scenes and 100 evaluation images; 150 and 40 pages), without its cold-build bound,
which is the machine's speed; DBNet's FP16 engine matches FP32 (its BatchNorm variance beyond FP16's range is folded
before converting). These four builds take 60-130 s each on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from k2edge import Engine
from k2edge.engine.evaluate import evaluate_classifier
from k2edge.model.datasets import open_dataset
from int8_support import GPU_CHAIN
from public_sets import textline_set
from test_int8_fixtures import INT8, packaged_model

EVAL_LINES = 2000  # the bench's evaluation set (bench/bench_int8_public.py SIZES)


@pytest.mark.slow
def test_a_held_out_part_with_too_few_boxes_is_inconclusive(tmp_path):
    """The fixture's 48 scene crops hold out 9 images with about one face: whatever the fallback moved on so few
    items, the check is inconclusive, never passed, and says what data to give; and since it cannot vouch for the
    Detect module's box and class branches in INT8 (the default float head is the decoding alone), they fall back
    first, with that reason. (The session's cache: the decision is test_int8_models' YOLOv8n GPU build's, when that
    ran first; the cached check is the one built.)"""
    from k2edge.engine.int8 import HEAD_REASON
    from k2edge.engine.quantize import head_branches

    engine = Engine.build(packaged_model("nudenet-320n"), GPU_CHAIN, calib=INT8 / "calib",
                          card=INT8 / "nudenet-320n" / "card.toml")
    check = engine.info.int8_check
    assert check.status == "inconclusive" and check.power[1] < 50, check.line()
    assert "at least 50 FP32 boxes" in check.line() and not check.passed
    held = {f["node"] for f in check.fallback if f["reason"] == HEAD_REASON}
    assert held == head_branches(engine.model.graph, engine.card) and len(held) > 40, sorted(held)[:5]
    assert any("too few to vouch" in n for n in check.notes), check.notes
    shares = engine.plan.precision_flops  # the decoding and the branches (the Detect module) float: at most about 63 % INT8
    assert shares["measured"] and shares["model"]["int8"] < 0.70 and shares["model"]["fp32"] == 0, shares


@pytest.mark.slow
@pytest.mark.parametrize("profile", [GPU_CHAIN, "c4"], ids=["gpu", "c4"])
def test_public_classifier_runs_mostly_int8_within_half_a_point(tmp_path, profile):
    """PP-OCR's text-direction classifier, GPU-only ["int8", "fp16"] and c4, 1,280 rendered lines to calibrate (256
    held out for the check): at least 90 % of its learned-layer FLOPs in INT8 and top-1 within 0.5 point of FP32 on
    2,000 other lines (about a minute a profile on 2 cores). On 400 lines the difference's 95 % interval is about 3
    points wide, and c4's +0.75 point there is -0.15 on 2,000 (docs/int8.md)."""
    model, card = packaged_model("ppocr-cls"), INT8 / "ppocr-cls" / "card.toml"
    calib, held = textline_set(tmp_path / "calib", 1280, 21), textline_set(tmp_path / "eval", EVAL_LINES, 22)
    data = open_dataset(held, ["0", "180"])
    assert len(data) == EVAL_LINES
    engine = Engine.build(model, profile, calib=calib, card=card, cache_dir=tmp_path / "cache")
    fp32 = Engine.build(model, "cpu-dev", card=card, cache_dir=tmp_path / "cache")
    with engine:
        top1 = evaluate_classifier(engine, data)["top1"]
    with fp32:
        ref = evaluate_classifier(fp32, data)["top1"]
    share = engine.plan.precision_flops["model"]["int8"]
    line = engine.info.int8_check.line()
    assert engine.plan.precision_flops["measured"] and share >= 0.90, (share, line)
    assert round(abs(top1 - ref) * EVAL_LINES) <= 0.005 * EVAL_LINES, (top1, ref, line)  # in lines: no float edge


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["gpu", "c4"])
@pytest.mark.parametrize("model", ["yolov8n", "dbnet"])
def test_public_detector_and_text_detector_meet_their_bounds(model, profile, tmp_path):
    """NudeNet's YOLOv8n: at least 80 % of its learned-layer FLOPs in INT8, recall and precision at the card's
    threshold against FP32 at least 0.90 on 100 images; PP-OCRv4's DBNet: at least 50 % in INT8, the probability
    map's mean cosine to FP32 at least 0.99 on 40 pages. Each GPU-only ["int8", "fp16"] and under c4, built cold
    from the bench's calibration sets (a miss names its figure: ``misses``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_int8_public as bench

    spec = bench.models(tmp_path)[model]
    if spec["model"] is None:
        pytest.skip("rapidocr_onnxruntime is not installed (pip install -e '.[dev]')")
    paths = bench.make_sets(spec, tmp_path / model, *bench.SIZES[model])
    row = bench.run_one(model, spec, profile, tmp_path, paths)
    assert not bench.misses(row, build_time=False), (bench.misses(row, build_time=False), row["check_line"])


@pytest.mark.slow
def test_public_text_detector_fp16_engine_matches_fp32(tmp_path):
    """PP-OCRv4's DBNet has a BatchNorm running variance of 9.8e7, above FP16's range: the ONNX Runtime backend's FP16
    engine folds it before converting (map cosine 0.38-0.81 to FP32 before), so its map matches FP32's on 4 pages."""
    import numpy as np

    from k2edge.engine.check import compare_outputs
    from public_sets import DBNET_CARD, dbnet_model, page_set

    model = dbnet_model()
    if model is None:
        pytest.skip("rapidocr_onnxruntime is not installed (pip install -e '.[dev]')")
    pages = sorted(page_set(tmp_path / "pages", 4, 32).glob("*.jpg"))
    fp16 = Engine.build(model, {"edge_runtime": {"offload_ratio": 1.0, "precision_fallback": ["fp16"]}}, card=DBNET_CARD,
                        cache_dir=tmp_path / "cache")
    fp32 = Engine.build(model, "cpu-dev", card=DBNET_CARD, cache_dir=tmp_path / "cache")
    assert {a.executed_precision for a in fp16.backend.build.segments} == {"fp16"}

    def maps(engine):
        with engine:
            return [{k: np.asarray(v) for k, v in engine.infer({engine.input_name: engine.stage_mapped([str(p)])[0]}).items()}
                    for p in pages]

    measures = compare_outputs("tensor", maps(fp32), maps(fp16))
    assert measures["cosine"] >= 0.999, measures
