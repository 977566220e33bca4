"""DLA placement on graphs nobody here wrote: the model-zoo fixtures (torchvision exports) and real pretrained
PaddleOCR models shipped inside the ``rapidocr_onnxruntime`` wheel (DBNet text detector, SVTR recogniser,
text-direction classifier; a dev dependency, skipped with the reason when absent).

What must hold on each: no layer on a non-4-D tensor is placed on the DLA; Conv, ConvTranspose, BatchNorm,
ReLU, Clip(0, 6), nearest asymmetric Resize and MaxPool within limits are; HardSigmoid, GlobalAveragePool,
MatMul, ReduceMean and Sqrt are not.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import zoo
from k2edge import load_profile
from k2edge.dla import plan_partition
from k2edge.dla.rules import support_table
from k2edge.model import normalise

NEVER = {"HardSigmoid", "GlobalAveragePool", "MatMul", "ReduceMean", "Sqrt"}
ALWAYS = {"Conv", "ConvTranspose", "BatchNormalization", "Relu", "MaxPool"}
OCR = {  # file in rapidocr_onnxruntime/models -> the static input shape it is planned for
    "ch_PP-OCRv4_det_infer.onnx": (1, 3, 640, 640),
    "ch_PP-OCRv4_rec_infer.onnx": (1, 3, 48, 320),
    "ch_ppocr_mobile_v2.0_cls_infer.onnx": (1, 3, 48, 192),
}


def _ocr_model(name: str) -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")  # finds the package without importing it (cv2)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("rapidocr_onnxruntime is not installed (pip install -e '.[dev]'): no pretrained PaddleOCR models")
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / name
    if not path.is_file():
        pytest.skip(f"rapidocr_onnxruntime has no {name}")
    return path


def _on_dla(nm):
    plan = plan_partition(nm, load_profile({"edge_runtime": {"tensorrt_partition": "layer-wise", "offload_ratio": 0.0,
                                                             "precision_fallback": ["fp16"]}}))
    dla = {n for s in plan.segments if s.kind == "dla" for n in s.nodes}
    return plan, dla


def _check(nm):
    """The placement rules every model must satisfy; returns the op types placed on the DLA."""
    g = nm.graph
    plan, dla = _on_dla(nm)
    placed_ops = set()
    for node, support in zip(g.nodes, support_table(g)):
        if node.name in dla:
            placed_ops.add(node.op_type)
            for t in [*node.inputs, *node.outputs]:
                if g.is_activation(t):
                    assert len(g.shape(t)) == 4, (node.name, node.op_type, t, g.shape(t))
        if node.op_type in NEVER:
            assert node.name not in dla, (node.name, support.reason)
        four_d = all(len(g.shape(t)) == 4 for t in [node.inputs[0], *node.outputs] if t)
        if node.op_type in ALWAYS and four_d and _within_limits(node):
            assert support.ok, (node.name, support.reason)
        if node.op_type == "Clip" and four_d:
            lo = g.constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
            hi = g.constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
            if lo is not None and hi is not None and float(lo) == 0 and float(hi) == 6:
                assert support.ok, (node.name, support.reason)
        if node.op_type == "Resize" and four_d and _nearest_asymmetric(node):
            assert support.ok, (node.name, support.reason)
    # placing everything the rules allow (offload ratio 0): the DLA gets most of the model's FLOPs
    assert plan.gpu_flop_share < 0.5 or not dla, plan.notes
    return placed_ops, plan


def _within_limits(node) -> bool:
    a = node.attrs
    if node.op_type == "MaxPool":
        return all(k <= 8 for k in a.get("kernel_shape", [])) and all(s <= 16 for s in a.get("strides", [1, 1]))
    return True


def _nearest_asymmetric(node) -> bool:
    text = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in node.attrs.items()}
    return (text.get("mode", "nearest") == "nearest" and text.get("coordinate_transformation_mode") == "asymmetric"
            and text.get("nearest_mode") == "floor" and not (len(node.inputs) > 3 and node.inputs[3]))


@pytest.mark.parametrize("name", zoo.NAMES)
def test_zoo_placement(name):
    placed, plan = _check(normalise(zoo.load(name)))
    assert {"Conv", "Relu"} & placed or {"Conv", "Clip"} & placed
    assert "GlobalAveragePool" not in placed


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OCR))
def test_pretrained_paddleocr_placement(name):
    """DBNet has ConvTranspose, nearest Resize and HardSigmoid; SVTR has rank-3 attention (MatMul, Softmax,
    ReduceMean, Sqrt, Sigmoid); the classifier has Clip(0, 6) and squeeze-excite HardSigmoids."""
    nm = normalise(_ocr_model(name), input_shapes={"x": OCR[name]})
    placed, plan = _check(nm)
    ops = {n.op_type for n in nm.graph.nodes}
    assert "Conv" in placed and (ops & NEVER)
    if "ConvTranspose" in ops:
        assert "ConvTranspose" in placed
    if "Resize" in ops:
        assert "Resize" in placed
    # every node the DLA cannot run is named in the notes, with the count of its kind
    note = next(n for n in plan.notes if "stay on the GPU" in n)
    assert int(note.split(" node(s)")[0]) == sum(1 for s in support_table(nm.graph) if not s.ok)


def test_yolov8n_export_placement():
    """A real Ultralytics YOLOv8n export (random weights): SiLU = Sigmoid x Mul on 4-D maps, nearest Resize in the
    neck, a rank-3 head (DFL Softmax, box decoding, sigmoid scores) that must stay on the GPU."""
    nm = normalise(zoo.load("yolov8n-320"))
    placed, plan = _check(nm)
    assert {"Conv", "Sigmoid", "Mul", "Resize", "MaxPool", "Concat"} <= placed
    rank3 = [n for n in nm.graph.nodes if n.op_type == "Sigmoid" and len(nm.graph.shape(n.outputs[0])) != 4]
    assert rank3, "the head's class scores are a rank-3 Sigmoid"
    _, dla = _on_dla(nm)
    assert not {n.name for n in rank3} & dla
