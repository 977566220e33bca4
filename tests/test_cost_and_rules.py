"""Per-node cost formulas and the DLA capability rules, on single-node graphs."""

import numpy as np
import pytest

import graphs
from k2edge.dla.rules import RULES, UNSUPPORTED, dla_support
from k2edge.model import model_costs, normalise


def _node(op, inputs, out, inits=None, **attrs):
    nm = normalise(graphs.single_node(op, inputs, out, inits, **attrs))
    return nm.graph, nm.graph.nodes[0]


def test_conv_flops_are_two_macs_plus_bias():
    w = np.zeros((16, 8, 3, 3), np.float32)
    g, n = _node("Conv", {"x": (1, 8, 10, 10)}, (1, 16, 10, 10), {"w": w, "b": np.zeros(16, np.float32)}, pads=[1, 1, 1, 1])
    cost = model_costs(g)[0]
    out = 16 * 10 * 10
    assert cost.flops == 2 * out * 8 * 9 + out
    assert cost.param_bytes == w.nbytes + 16 * 4
    assert cost.activation_bytes == out * 4


def test_grouped_conv_counts_per_group_channels():
    g, _ = _node("Conv", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), {"w": np.zeros((8, 1, 3, 3), np.float32)}, group=8, pads=[1, 1, 1, 1])
    assert model_costs(g)[0].flops == 2 * (8 * 16) * 9


def test_gemm_matmul_pool_elementwise_and_movement():
    g, _ = _node("Gemm", {"a": (2, 64)}, (2, 10), {"b": np.zeros((10, 64), np.float32)}, transB=1)
    assert model_costs(g)[0].flops == 2 * 2 * 10 * 64
    g, _ = _node("MatMul", {"a": (3, 4, 5)}, (3, 4, 6), {"b": np.zeros((5, 6), np.float32)})
    assert model_costs(g)[0].flops == 2 * 3 * 4 * 6 * 5
    g, _ = _node("MaxPool", {"x": (1, 4, 8, 8)}, (1, 4, 4, 4), kernel_shape=[2, 2], strides=[2, 2])
    assert model_costs(g)[0].flops == 4 * 16 * 4
    g, _ = _node("Relu", {"x": (1, 4, 8, 8)}, (1, 4, 8, 8))
    assert model_costs(g)[0].flops == 256
    g, _ = _node("Transpose", {"x": (1, 4, 8, 8)}, (1, 8, 8, 4), perm=[0, 2, 3, 1])
    assert model_costs(g)[0].flops == 0 and model_costs(g)[0].activation_bytes == 1024


@pytest.mark.parametrize("op, inputs, out, inits, attrs, ok, reason", [
    ("GlobalAveragePool", {"x": (1, 8, 7, 7)}, (1, 8, 1, 1), None, {}, False, "GlobalAveragePool is unsupported"),
    ("AveragePool", {"x": (1, 8, 8, 8)}, (1, 8, 1, 1), None, {"kernel_shape": [8, 8]}, True, None),
    ("AveragePool", {"x": (1, 8, 9, 9)}, (1, 8, 1, 1), None, {"kernel_shape": [9, 9]}, False, "window [9, 9] outside [1, 8]"),
    ("MaxPool", {"x": (1, 8, 8, 8)}, (1, 8, 4, 4), None, {"kernel_shape": [2, 2], "strides": [2, 2]}, True, None),
    ("Concat", {"a": (1, 4, 8, 8), "b": (1, 4, 8, 8)}, (1, 8, 8, 8), None, {"axis": 1}, True, None),
    ("Concat", {"a": (1, 4, 8, 8), "b": (1, 4, 8, 8)}, (1, 4, 16, 8), None, {"axis": 2}, False, "channel axis only"),
    ("Conv", {"x": (1, 3, 40, 40)}, (1, 4, 40, 40), {"w": np.zeros((4, 3, 33, 33), np.float32)}, {"pads": [16] * 4}, False, "kernel [33, 33] outside [1, 32]"),
    ("Conv", {"x": (1, 3, 40, 40)}, (1, 4, 4, 4), {"w": np.zeros((4, 3, 3, 3), np.float32)}, {"strides": [10, 10]}, False, "stride [10, 10] outside [1, 8]"),
    ("Relu", {"x": (1, 3, 8, 8)}, (1, 3, 8, 8), None, {}, True, None),
    ("Clip", {"x": (1, 3, 8, 8)}, (1, 3, 8, 8), {"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}, {}, True, None),
    ("Clip", {"x": (1, 3, 8, 8)}, (1, 3, 8, 8), {"lo": np.array(-1, np.float32), "hi": np.array(1, np.float32)}, {}, False, "clipped ReLU"),
    ("Add", {"a": (1, 3, 8, 8), "b": (1, 3, 8, 8)}, (1, 3, 8, 8), None, {}, True, None),
    ("Add", {"a": (1, 3, 8, 8), "b": (1, 1, 8, 1)}, (1, 3, 8, 8), None, {}, False, "broadcast"),
    ("Gemm", {"a": (1, 64)}, (1, 10), {"b": np.zeros((10, 64), np.float32)}, {"transB": 1}, False, "4-D NCHW"),
    ("Flatten", {"x": (1, 4, 2, 2)}, (1, 16), None, {}, False, "2-D tensor"),
    ("Softmax", {"x": (1, 10)}, (1, 10), None, {"axis": 1}, False, "4-D input"),
    ("LRN", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), None, {"size": 5}, True, None),
    ("LRN", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), None, {"size": 4}, False, "window 4"),
])
def test_dla_rules(op, inputs, out, inits, attrs, ok, reason):
    """Each rule accepts what the DLA runs and names the limit it breaks otherwise, with a source."""
    g, n = _node(op, inputs, out, inits, **attrs)
    s = dla_support(g, n)
    assert s.ok is ok
    if not ok:
        assert reason in s.reason
        assert s.source, "every refusal cites a source"


def test_batch_limit():
    """Batch above 4096 is refused (general DLA restriction)."""
    nm = normalise(graphs.single_node("Relu", {"x": ("N", 3, 4, 4)}, ("N", 3, 4, 4)), batch_size=5000)
    s = dla_support(nm.graph, nm.graph.nodes[0])
    assert not s.ok and "4096" in s.reason


def test_every_rule_has_a_source_note():
    assert all(r.source and r.summary for r in RULES)
    assert all(src for _, src in UNSUPPORTED.values())


def _graph(nodes, inputs, outputs, inits=None, opset=17):
    """A small graph from helper nodes: ``inputs``/``outputs`` map names to shapes."""
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in outputs.items()],
                          [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()])
    nm = normalise(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))
    return nm.graph, nm.graph.nodes[0]


def _resize(coord="asymmetric", nearest="floor", mode="nearest", scale=2.0, sizes=False, shape=(1, 4, 8, 8)):
    from onnx import helper

    out = (shape[0], shape[1], int(shape[2] * scale), int(shape[3] * scale))
    inits = {"scales": np.array([1, 1, scale, scale], np.float32)}
    ins = ["x", "", "scales"]
    if sizes:
        inits = {"sizes": np.array(out, np.int64)}
        ins = ["x", "", "", "sizes"]
    node = helper.make_node("Resize", ins, ["y"], name="rs", mode=mode, coordinate_transformation_mode=coord,
                            nearest_mode=nearest)
    return _graph([node], {"x": shape}, {"y": out}, inits)


@pytest.mark.parametrize("kwargs, ok, reason", [
    (dict(), True, None),                                                        # torch nn.Upsample(nearest)
    (dict(coord="half_pixel", nearest="round_prefer_floor"), True, None),
    (dict(coord="half_pixel", nearest="round_prefer_ceil"), True, None),
    (dict(coord="half_pixel", nearest="floor"), False, "not one of the DLA's combinations"),
    (dict(coord="align_corners", nearest="floor"), False, "not one of the DLA's combinations"),
    (dict(coord="asymmetric", nearest="round_prefer_floor"), False, "not one of the DLA's combinations"),
    (dict(sizes=True), False, "setOutputDimensions"),
    (dict(mode="linear", coord="half_pixel", scale=2.0), True, None),
    (dict(mode="linear", coord="pytorch_half_pixel", scale=4.0), True, None),
    (dict(mode="linear", coord="half_pixel", scale=8.0), False, "outside [1, 4]"),
    (dict(mode="linear", coord="asymmetric", scale=2.0), False, "needs half_pixel"),
    (dict(mode="cubic", coord="half_pixel", scale=2.0), False, "cubic resize is not a DLA mode"),
    (dict(scale=1.5), False, "non-integer scale"),
])
def test_resize_rule_follows_the_header_combinations(kwargs, ok, reason):
    """IResizeLayer's DLA combinations as the ONNX parser sets them; a `sizes` input is refused."""
    s = dla_support(*_resize(**kwargs))
    assert s.ok is ok, s
    if not ok:
        assert reason in s.reason and "IResizeLayer" in s.source


def test_clip_without_min_is_not_a_clipped_relu():
    """Clip(max=6) without `min`: the parser clamps at the lowest float, so it is no clipped ReLU."""
    from onnx import helper

    node = helper.make_node("Clip", ["x", "", "hi"], ["y"], name="clip")
    g, n = _graph([node], {"x": (1, 3, 8, 8)}, {"y": (1, 3, 8, 8)}, {"hi": np.array(6, np.float32)})
    s = dla_support(g, n)
    assert not s.ok and "constant min 0" in s.reason and "Clip" in s.source
    node = helper.make_node("Clip", ["x", "lo", "hi"], ["y"], name="clip")
    g, n = _graph([node], {"x": (1, 3, 8, 8)}, {"y": (1, 3, 8, 8)},
                  {"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)})
    assert dla_support(g, n).ok


@pytest.mark.parametrize("op, inputs, out, inits, attrs, ok, reason", [
    # activations only on 4-D tensors (YOLOv8's head and SVTR recognisers have rank-3 Sigmoids)
    ("Sigmoid", {"x": (1, 80, 2100)}, (1, 80, 2100), None, {}, False, "rank 3"),
    ("Sigmoid", {"x": (1, 64, 8, 8)}, (1, 64, 8, 8), None, {}, True, None),
    ("Relu", {"x": (1, 64)}, (1, 64), None, {}, False, "rank 2"),
    ("HardSigmoid", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), None, {}, False, "hard sigmoid"),
    # unary: ABS only in the 10.3 header
    ("Abs", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), None, {}, True, None),
    ("Sin", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), None, {}, False, "only ABS"),
    ("Cos", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), None, {}, False, "only ABS"),
    ("Atan", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), None, {}, False, "only ABS"),
    ("Sqrt", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), None, {}, False, "only ABS"),
    # elementwise: SUM, PROD, MAX, MIN, SUB in the 10.3 header; DIV and POW are not
    ("Sub", {"a": (1, 3, 8, 8), "b": (1, 3, 8, 8)}, (1, 3, 8, 8), None, {}, True, None),
    ("Div", {"a": (1, 3, 8, 8)}, (1, 3, 8, 8), {"b": np.full((1, 3, 1, 1), 2, np.float32)}, {}, False, "kSUB"),
    ("Pow", {"a": (1, 3, 8, 8)}, (1, 3, 8, 8), {"b": np.array(2, np.float32)}, {}, False, "kSUB"),
    # reductions: MAX over C/H/W runs (GlobalMaxPool is one), AVG does not
    ("GlobalMaxPool", {"x": (1, 8, 7, 7)}, (1, 8, 1, 1), None, {}, True, None),
    ("ReduceMax", {"x": (1, 8, 7, 7)}, (1, 8, 1, 1), None, {"axes": [2, 3]}, True, None),
    ("ReduceMax", {"x": (1, 8, 7, 7)}, (1, 1, 1, 1), None, {"axes": [0, 1, 2, 3]}, False, "batch axis"),
    ("ReduceMean", {"x": (1, 8, 7, 7)}, (1, 8, 1, 1), None, {"axes": [2, 3]}, False, "Reduce AVG"),
    # deconvolution: kernel and stride within [1, 32] each, need not be equal; padding 0, one group
    ("ConvTranspose", {"x": (1, 8, 8, 8)}, (1, 4, 17, 17), {"w": np.zeros((8, 4, 3, 3), np.float32)},
     {"strides": [2, 2]}, True, None),
    ("ConvTranspose", {"x": (1, 8, 8, 8)}, (1, 4, 16, 16), {"w": np.zeros((8, 4, 2, 2), np.float32)},
     {"strides": [2, 2]}, True, None),
    ("ConvTranspose", {"x": (1, 8, 8, 8)}, (1, 4, 15, 15), {"w": np.zeros((8, 4, 3, 3), np.float32)},
     {"strides": [2, 2], "pads": [1, 1, 1, 1]}, False, "padding must be 0"),
    ("ConvTranspose", {"x": (1, 8, 8, 8)}, (1, 8, 16, 16), {"w": np.zeros((8, 2, 2, 2), np.float32)},
     {"strides": [2, 2], "group": 4}, False, "nbGroups must be 1"),
    ("ConvTranspose", {"x": (1, 8, 2, 2)}, (1, 4, 66, 66), {"w": np.zeros((8, 4, 33, 33), np.float32)},
     {"strides": [33, 33]}, False, "outside [1, 32]"),
    # PRelu: torch's [C, 1, 1] slope broadcasts per channel
    ("PRelu", {"x": (1, 8, 4, 4)}, (1, 8, 4, 4), {"s": np.full((8, 1, 1), 0.1, np.float32)}, {}, True, None),
    ("PRelu", {"x": (1, 8, 4, 4), "s": (8, 1, 1)}, (1, 8, 4, 4), None, {}, False, "build-time constant"),
    # Split is lowered to slices: fine on the channel axis of a 4-D tensor, not on the batch
    ("Split", {"x": (1, 8, 4, 4)}, (1, 4, 4, 4), {"sp": np.array([4, 4], np.int64)}, {"axis": 1}, True, None),
    ("Split", {"x": (2, 8, 4, 4)}, (1, 8, 4, 4), {"sp": np.array([1, 1], np.int64)}, {"axis": 0}, False, "batch axis"),
])
def test_dla_rules_from_the_10_3_header(op, inputs, out, inits, attrs, ok, reason):
    """The rules that changed after checking TensorRT 10.3's header, the docs and the ONNX parser."""
    if op == "Split":
        from onnx import helper

        node = helper.make_node("Split", ["x", "sp"], ["o1", "o2"], name="split", **attrs)
        g, n = _graph([node], inputs, {"o1": out, "o2": out}, inits)
    else:
        g, n = _node(op, inputs, out, inits, **attrs)
    s = dla_support(g, n)
    assert s.ok is ok, (s, op)
    if not ok:
        assert reason in s.reason, s
        assert s.source
