"""INT8 calibration (Q/DQ model + TensorRT calibration cache) and FP16: accuracy on the demo set."""

import numpy as np
import onnx
import pytest

from k2edge import Engine, load_profile
from k2edge.engine.cache import EngineCache
from k2edge.engine.quantize import calibrate_int8, read_trt_calibration_cache, write_trt_calibration_cache
from k2edge.model.datasets import open_dataset
from k2edge.model.ingest import normalise
from k2edge.tasks.preprocess import Preprocess


def _accuracy(engine, dataset) -> float:
    from k2edge.cli.eval_cmd import evaluate

    with engine:
        return evaluate(engine, dataset)["top1"]


@pytest.fixture(scope="module")
def fp32_top1(demo_model, demo_eval):
    return _accuracy(Engine.build(demo_model, "cpu-dev"), demo_eval)


def test_int8_within_one_point_of_fp32(demo_model, demo_eval, fp32_top1):
    p = load_profile({"edge_runtime": {"tensorrt_partition": "layer-wise", "offload_ratio": 0.35, "precision_fallback": ["int8"]}})
    top1 = _accuracy(Engine.build(demo_model, p, calib=demo_model.parent / "calib"), demo_eval)
    assert fp32_top1 - top1 <= 0.010, (fp32_top1, top1)


def test_fp16_within_03_points_of_fp32(demo_model, demo_eval, fp32_top1):
    top1 = _accuracy(Engine.build(demo_model, "c5"), demo_eval)
    assert fp32_top1 - top1 <= 0.003, (fp32_top1, top1)


def test_qdq_model_and_trt_cache(demo_model, cache_dir):
    """Calibration writes a symmetric Q/DQ model and a TensorRT cache with one scale per tensor; cached."""
    nm = normalise(demo_model)
    pre = Preprocess.for_model(nm.metadata(), nm.graph.shape("input"))
    ds = open_dataset(demo_model.parent / "calib.npz")
    cache = EngineCache(cache_dir)
    q = calibrate_int8(nm, ds, pre, cache)
    assert not q.cached and q.samples == 200
    qdq = onnx.load(str(q.qdq_model))
    ops = [n.op_type for n in qdq.graph.node]
    assert ops.count("QuantizeLinear") > 10 and ops.count("DequantizeLinear") > 10
    zero_points = [i for i in qdq.graph.initializer if i.name.endswith("zero_point")]
    assert zero_points and all(not np.any(onnx.numpy_helper.to_array(z)) for z in zero_points), "TensorRT needs symmetric INT8"
    lines = q.trt_calibration_cache.read_text().splitlines()
    assert lines[0].startswith("TRT-") and lines[0].endswith("-EntropyCalibration2")
    back = read_trt_calibration_cache(q.trt_calibration_cache)
    assert "input" in back and set(back) == set(q.dynamic_ranges)
    for name, amax in q.dynamic_ranges.items():
        assert back[name] == pytest.approx(amax, rel=1e-6)
    again = calibrate_int8(nm, ds, pre, cache)
    assert again.cached and again.key == q.key


def test_calibration_cache_roundtrip(tmp_path):
    f = tmp_path / "calib.cache"
    write_trt_calibration_cache(f, {"a": 127.0, "b": 2.54})
    assert f.read_text().splitlines()[1] == "a: 3f800000"  # scale 1.0 as big-endian float32
    assert read_trt_calibration_cache(f) == pytest.approx({"a": 127.0, "b": 2.54})


def test_imagefolder_and_npz_calibration_agree(demo_model, cache_dir):
    """The PNG directory and calib.npz hold the same images, so they give the same ranges."""
    nm = normalise(demo_model)
    pre = Preprocess.for_model(nm.metadata(), nm.graph.shape("input"))
    cache = EngineCache(cache_dir)
    a = calibrate_int8(nm, open_dataset(demo_model.parent / "calib"), pre, cache)
    b = calibrate_int8(nm, open_dataset(demo_model.parent / "calib.npz"), pre, cache)
    for name in a.dynamic_ranges:
        assert a.dynamic_ranges[name] == pytest.approx(b.dynamic_ranges[name], rel=1e-5)


def test_ranges_the_dla_ties_are_equal_in_the_cache_and_the_qdq_model(demo_model, tmp_path):
    """Pooling in/out and elementwise inputs share one INT8 range (the largest), in TensorRT's calibration cache
    and in the Q/DQ model's scales, so the CPU measures what the DLA will run."""
    import onnx

    from k2edge.engine.cache import EngineCache
    from k2edge.engine.quantize import tied_tensors
    from k2edge.model.datasets import open_dataset
    from k2edge.model.ingest import normalise

    nm = normalise(demo_model)
    pre = Preprocess.for_model(nm.metadata(), nm.graph.shape("input"))
    quant = calibrate_int8(nm, open_dataset(demo_model.parent / "calib.npz"), pre, EngineCache(tmp_path))
    groups = tied_tensors(nm.graph)
    adds = [n for n in nm.graph.nodes if n.op_type == "Add"]
    assert adds and all(any(set(n.inputs) <= g for g in groups) for n in adds)
    cache = read_trt_calibration_cache(quant.trt_calibration_cache)
    qdq = onnx.load(str(quant.qdq_model))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in qdq.graph.initializer}
    scale = {n.input[0]: float(inits[n.input[1]]) for n in qdq.graph.node if n.op_type == "QuantizeLinear"}
    for group in groups:
        amax = {round(cache[t], 4) for t in group}
        assert len(amax) == 1, group
        assert len({round(scale[t], 7) for t in group if t in scale}) == 1, group
        assert max(quant.dynamic_ranges[t] for t in group) == pytest.approx(cache[next(iter(group))], rel=1e-5)
