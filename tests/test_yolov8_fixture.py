"""The YOLOv8n export fixtures (tests/fixtures/yolov8/): layout, dynamic axes, onnxruntime runs them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import zoo

STRIDES = (8, 16, 32)
REG_MAX = 16  # YOLOv8's DFL bins: each box side is an expectation over 0..15 strides
NUM_CLASSES = 80


def _dims(value_info: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _anchor_centres(height: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Anchor centres (x, y) in input pixels and their stride, in YOLOv8's order (stride 8 first, x fastest)."""
    xs, ys, ss = [], [], []
    for s in STRIDES:
        gy, gx = np.meshgrid(np.arange(height // s), np.arange(width // s), indexing="ij")
        xs.append((gx.ravel() + 0.5) * s)
        ys.append((gy.ravel() + 0.5) * s)
        ss.append(np.full(gx.size, s, dtype=np.float64))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ss)


@pytest.fixture(scope="module")
def sessions() -> dict[str, ort.InferenceSession]:
    return {name: ort.InferenceSession(zoo.load(name).SerializeToString(), providers=["CPUExecutionProvider"])
            for name in zoo.YOLOV8_NAMES}


def test_both_exports_are_committed_small_and_kept_apart_from_the_classifiers():
    """A static and a dynamic export, each under 1 MB, not among the classifier fixtures."""
    assert zoo.YOLOV8_NAMES == ("yolov8n-320", "yolov8n-dynamic")
    assert not set(zoo.YOLOV8_NAMES) & set(zoo.NAMES)
    for name in zoo.YOLOV8_NAMES:
        assert zoo.fixture_path(name).stat().st_size < 1 << 20


@pytest.mark.parametrize("name", ["yolov8n-320", "yolov8n-dynamic"])
def test_regenerated_export_is_valid_deterministic_and_keeps_the_head_constants(name):
    """Weights refill the same every time; the anchor grid and the DFL arange stay as exported."""
    stripped = onnx.load(str(zoo.fixture_path(name)))
    marked = [t.name for t in stripped.graph.initializer if t.doc_string]
    conv_weights = {n.input[1] for n in stripped.graph.node if n.op_type == "Conv"}
    assert marked and set(marked) <= conv_weights  # only Conv weights were stripped

    model = zoo.load(name)
    onnx.checker.check_model(model, full_check=True)
    assert model.SerializeToString() == zoo.load(name).SerializeToString()
    assert model.SerializeToString() != zoo.load(name, seed=1).SerializeToString()
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert {p.key: p.value for p in model.metadata_props}["task"] == "detect"  # ultralytics' own metadata
    dfl = next(n for n in model.graph.node if n.op_type == "Conv" and "dfl" in n.name)
    weight = next(t for t in model.graph.initializer if t.name == dfl.input[1])
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(weight).ravel(), np.arange(REG_MAX))


def test_static_export_layout():
    """images [1, 3, 320, 320] -> output0 [1, 84, 2100]: 4 box rows, 80 class rows, 40*40 + 20*20 + 10*10 anchors."""
    model = zoo.load("yolov8n-320")
    assert [i.name for i in model.graph.input] == ["images"]
    assert _dims(model.graph.input[0]) == [1, 3, 320, 320]
    assert [(o.name, _dims(o)) for o in model.graph.output] == [("output0", [1, 4 + NUM_CLASSES, 2100])]


def test_dynamic_export_axes():
    """Batch, height and width are symbolic on the input; batch and anchors on the output."""
    model = zoo.load("yolov8n-dynamic")
    assert _dims(model.graph.input[0]) == ["batch", 3, "height", "width"]
    assert [(o.name, _dims(o)) for o in model.graph.output] == [("output0", ["batch", 4 + NUM_CLASSES, "anchors"])]


@pytest.mark.parametrize("name, batch, height, width", [
    ("yolov8n-320", 1, 320, 320),
    ("yolov8n-dynamic", 1, 320, 320),
    ("yolov8n-dynamic", 2, 320, 320),
    ("yolov8n-dynamic", 1, 256, 416),   # landscape
    ("yolov8n-dynamic", 1, 448, 192),   # portrait
])
def test_onnxruntime_runs_the_export_in_the_yolov8_layout(sessions, name, batch, height, width):
    """cx cy w h in input pixels around each anchor (stride 8 first, x fastest), then 80 sigmoid scores."""
    x = np.random.default_rng(7).random((batch, 3, height, width), dtype=np.float32)
    out = sessions[name].run(["output0"], {"images": x})[0]
    ax, ay, stride = _anchor_centres(height, width)
    assert out.shape == (batch, 4 + NUM_CLASSES, ax.size)
    assert np.isfinite(out).all()
    scores = out[:, 4:]
    assert scores.min() >= 0.0 and scores.max() <= 1.0
    # Each side distance is a softmax expectation over 0..15 bins times the stride, whatever the
    # weights: the centre lies within 7.5 strides of its anchor and w, h within [0, 30] strides.
    slack = 1e-3
    for b in range(batch):
        cx, cy, w, h = out[b, :4]
        assert (np.abs(cx - ax) <= 7.5 * stride + slack).all()
        assert (np.abs(cy - ay) <= 7.5 * stride + slack).all()
        assert ((w >= -slack) & (w <= 30 * stride + slack)).all()
        assert ((h >= -slack) & (h <= 30 * stride + slack)).all()
        # and the centres follow the anchor grid in the order above (a transposed or
        # wrongly ordered grid would decorrelate them)
        assert np.corrcoef(cx, ax)[0, 1] > 0.9
        assert np.corrcoef(cy, ay)[0, 1] > 0.9
