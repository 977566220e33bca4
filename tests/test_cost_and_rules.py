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
