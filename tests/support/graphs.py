"""Small ONNX graphs built in the tests, each shaped like something an exporter writes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def conv_chain(n_convs: int = 6, channels: int = 8, size: int = 16, opset: int = 13, gap_head: bool = True,
               seed: int = 0, he_init: bool = False) -> onnx.ModelProto:
    """Conv/Relu chain with an optional GlobalAveragePool + Flatten + Gemm head; dynamic batch.

    ``he_init`` scales each conv's weights by sqrt(2 / fan_in) so activations keep their size through any
    depth (the fixed 0.2 of the shallow chains overflows to infinity after a few dozen wide layers)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev, cin = "x", 3
    for i in range(n_convs):
        std = np.sqrt(2.0 / (cin * 9)) if he_init else 0.2
        w = numpy_helper.from_array((rng.standard_normal((channels, cin, 3, 3)) * std).astype(np.float32), f"w{i}")
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


def grid_detector(height: int = 64, width: int = 96, stride: int = 8, opset: int = 17) -> onnx.ModelProto:
    """A hand-weighted YOLOv8-layout detector of two classes, ``white`` and ``red`` squares.

    Each ``stride`` x ``stride`` cell is an anchor: a strided Conv measures its brightness and
    redness, a 1x1 Conv turns them into box and class logits, and the head (Slice, Sigmoid, grid
    Add, stride Mul, Concat, Reshape) decodes them as Ultralytics' export does: output
    ``[N, 4 + 2, cells]``, cx cy w h in input pixels (each box is its cell), sigmoid scores.
    Static H x W (the grid is a constant); dynamic batch.
    """
    gh, gw = height // stride, width // stride
    s2 = float(stride * stride)
    w1 = np.zeros((2, 3, stride, stride), np.float32)
    w1[0] = 1.0 / (3 * s2)                     # brightness in [0, 1]
    w1[1, 0], w1[1, 1] = 1.0 / s2, -1.0 / s2   # redness: R - G
    w2 = np.zeros((6, 2, 1, 1), np.float32)
    b2 = np.zeros(6, np.float32)
    b2[2:4] = np.log(1 / 3)                    # sigmoid -> 0.25; x 4 x stride = one cell
    w2[4, 0], w2[4, 1], b2[4] = 20.0, -20.0, -15.0   # white: bright, not red
    w2[5, 1], b2[5] = 20.0, -10.0                    # red
    gx, gy = np.meshgrid(np.arange(gw, dtype=np.float32), np.arange(gh, dtype=np.float32))
    inits = {
        "w1": w1, "b1": np.zeros(2, np.float32), "w2": w2, "b2": b2,
        "grid": np.stack([gx, gy])[None], "stride": np.array(stride, np.float32), "wh_scale": np.array(4.0 * stride, np.float32),
        "s0": np.array([0], np.int64), "s2": np.array([2], np.int64), "s4": np.array([4], np.int64),
        "s6": np.array([6], np.int64), "ax": np.array([1], np.int64), "shape": np.array([0, 6, gh * gw], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["f"], strides=[stride, stride], name="stem_conv"),
        helper.make_node("Relu", ["f"], ["fr"], name="stem_relu"),
        helper.make_node("Conv", ["fr", "w2", "b2"], ["raw"], name="head_conv"),
        helper.make_node("Slice", ["raw", "s0", "s2", "ax"], ["xy_raw"], name="slice_xy"),
        helper.make_node("Slice", ["raw", "s2", "s4", "ax"], ["wh_raw"], name="slice_wh"),
        helper.make_node("Slice", ["raw", "s4", "s6", "ax"], ["cls_raw"], name="slice_cls"),
        helper.make_node("Sigmoid", ["xy_raw"], ["xy_s"], name="xy_sigmoid"),
        helper.make_node("Add", ["xy_s", "grid"], ["xy_g"], name="xy_grid"),
        helper.make_node("Mul", ["xy_g", "stride"], ["xy"], name="xy_stride"),
        helper.make_node("Sigmoid", ["wh_raw"], ["wh_s"], name="wh_sigmoid"),
        helper.make_node("Mul", ["wh_s", "wh_scale"], ["wh"], name="wh_scale_mul"),
        helper.make_node("Sigmoid", ["cls_raw"], ["cls"], name="cls_sigmoid"),
        helper.make_node("Concat", ["xy", "wh", "cls"], ["cat"], axis=1, name="head_concat"),
        helper.make_node("Reshape", ["cat", "shape"], ["output0"], name="head_reshape"),
    ]
    g = helper.make_graph(nodes, "grid_detector", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, height, width])],
                          [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["N", 6, gh * gw])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def silu_net(size: int = 32, channels: int = 16, seed: int = 0, opset: int = 13) -> onnx.ModelProto:
    """A small YOLOv8-like SiLU backbone (Conv + Sigmoid*Mul, a residual Add, a MaxPool) with trained-like
    weights: He-scaled kernels and BN-folded biases, and a few wide channels as BN folding leaves them, so a
    Conv's output range is far wider than its sigmoid's 0..1. Output: a raw feature map (task ``tensor``)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def conv(name, src, cin, cout, stride=1, act=True):
        w = rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9))
        w[: max(1, cout // 8)] *= 4.0  # a few wide channels, as BatchNorm folding leaves them
        b = rng.standard_normal(cout) * 0.3
        inits.extend([numpy_helper.from_array(w.astype(np.float32), f"{name}.w"),
                      numpy_helper.from_array(b.astype(np.float32), f"{name}.b")])
        nodes.append(helper.make_node("Conv", [src, f"{name}.w", f"{name}.b"], [f"{name}/conv"], pads=[1, 1, 1, 1],
                                      strides=[stride, stride], name=f"{name}/Conv"))
        if not act:
            return f"{name}/conv"
        nodes.append(helper.make_node("Sigmoid", [f"{name}/conv"], [f"{name}/sig"], name=f"{name}/act/Sigmoid"))
        nodes.append(helper.make_node("Mul", [f"{name}/conv", f"{name}/sig"], [f"{name}/act"], name=f"{name}/act/Mul"))
        return f"{name}/act"

    a = conv("m0", "images", 3, channels, stride=2)
    b = conv("m1", a, channels, channels)
    c = conv("m2", b, channels, channels)
    nodes.append(helper.make_node("Add", [a, c], ["res"], name="m2/Add"))
    nodes.append(helper.make_node("MaxPool", ["res"], ["pool"], kernel_shape=[2, 2], strides=[2, 2], name="pool"))
    d = conv("m3", "pool", channels, channels)
    out = conv("head", d, channels, 8, act=False)
    nodes.append(helper.make_node("Identity", [out], ["output0"], name="output"))
    g = helper.make_graph(nodes, "silu", [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, size, size])],
                          [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["N", 8, size // 4, size // 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def smooth_images(n: int, size: int = 32, seed: int = 1) -> np.ndarray:
    """``n`` photo-like uint8 RGB images (smooth blobs and edges, not white noise)."""
    rng = np.random.default_rng(seed)
    low = rng.uniform(0, 255, (n, 4, 4, 3))
    up = np.kron(low, np.ones((1, size // 4, size // 4, 1)))
    yy, xx = np.mgrid[0:size, 0:size] / size
    edges = (np.sin(xx[None] * rng.uniform(2, 9, (n, 1, 1)) * np.pi) * 40)[..., None]
    return np.clip(up + edges + rng.normal(0, 6, up.shape), 0, 255).astype(np.uint8)
