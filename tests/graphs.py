"""Small ONNX graphs built in the tests, each shaped like something an exporter writes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def conv_chain(n_convs: int = 6, channels: int = 8, size: int = 16, opset: int = 13, gap_head: bool = True,
               seed: int = 0) -> onnx.ModelProto:
    """Conv/Relu chain with an optional GlobalAveragePool + Flatten + Gemm head; dynamic batch."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev, cin = "x", 3
    for i in range(n_convs):
        w = numpy_helper.from_array((rng.standard_normal((channels, cin, 3, 3)) * 0.2).astype(np.float32), f"w{i}")
        b = numpy_helper.from_array(np.zeros(channels, np.float32), f"b{i}")
        inits += [w, b]
        nodes.append(helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"))
        prev, cin = f"r{i}", channels
    out_shape = ["N", channels, size, size]
    if gap_head:
        inits.append(numpy_helper.from_array((rng.standard_normal((10, channels)) * 0.2).astype(np.float32), "fc_w"))
        nodes += [helper.make_node("GlobalAveragePool", [prev], ["gap"], name="gap"),
                  helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
                  helper.make_node("Gemm", ["flat", "fc_w"], ["y"], transB=1, name="fc")]
        out_shape = ["N", 10]
    else:
        nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def constant_subgraph_weights(opset: int = 11) -> onnx.ModelProto:
    """Weights computed at run time from constants: ConstantOfShape -> Mul -> Conv weight, as some exporters write."""
    shape = numpy_helper.from_array(np.array([4, 3, 3, 3], dtype=np.int64), "wshape")
    scale = numpy_helper.from_array(np.array(0.05, dtype=np.float32), "wscale")
    nodes = [
        helper.make_node("ConstantOfShape", ["wshape"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
        helper.make_node("Mul", ["ones", "wscale"], ["w"]),
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    g = helper.make_graph(nodes, "cos", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])], [shape, scale])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def single_node(op: str, inputs: dict[str, tuple], output_shape: tuple, inits: dict[str, np.ndarray] | None = None,
                **attrs) -> onnx.ModelProto:
    """One node with the given activation input shapes and constant inputs, for rule and cost tests."""
    inits = inits or {}
    names = list(inputs) + list(inits)
    node = helper.make_node(op, names, ["out"], name=f"the_{op.lower()}", **attrs)
    g = helper.make_graph([node], op, [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, list(output_shape))],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
