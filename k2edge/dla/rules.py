"""Which normalised ONNX nodes the DLA can run (TensorRT 10.3, the release JetPack 6.1/6.2 ships).

Every rule cites where it comes from:

* ``HEADER``: the DLA notes in TensorRT 10.3's ``include/NvInfer.h`` (per layer class, e.g.
  "When running this layer on DLA, only UnaryOperation::kABS is supported");
* ``DOCS``: TensorRT's "DLA Supported Layers and Restrictions" page and the operator pages' "DLA
  Support" sections;
* ``PARSER``: how the ONNX parser (onnx-tensorrt ``onnxOpImporters.cpp``; the 10.1-GA branch, the
  closest one published to the 10.3 submodule) turns the node into TensorRT layers, because the DLA
  limits apply to those layers, not to the ONNX node.

Where the 10.3 header and a later docs table disagree, the rule follows the stricter one and says
so. The table is conservative: an op that is not listed, or that k2edge cannot prove fits the
limits, stays on the GPU with a reason. That costs some offload, never a failed DLA build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..model.graph import Graph, Node

HEADER = "TensorRT 10.3 NvInfer.h"
DOCS = "TensorRT docs, DLA Supported Layers and Restrictions"
PARSER = "onnx-tensorrt onnxOpImporters.cpp"


@dataclass(frozen=True)
class Support:
    """Whether one node can run on the DLA, and if not, why."""

    ok: bool
    reason: str | None = None
    source: str | None = None


@dataclass(frozen=True)
class Rule:
    ops: tuple[str, ...]
    summary: str
    source: str
    check: Callable[[Graph, Node], str | None]


def _pair(attrs, key, default):
    value = attrs.get(key)
    return list(value) if value is not None else list(default)


def _text(value, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


def _rank4(graph: Graph, node: Node) -> str | None:
    # The docs table says "2D only" for every layer class: NCHW tensors, two spatial dimensions.
    shape = graph.shape(node.inputs[0])
    if len(shape) != 4:
        return f"input has rank {len(shape)}, DLA layers take 4-D NCHW tensors (2 spatial dims)"
    return None


def _conv(graph: Graph, node: Node) -> str | None:
    # IConvolutionLayer DLA notes [HEADER]: kernel [1,32], stride [1,8], padding [0,31] and smaller
    # than the kernel, dilation [1,32], output maps [1,8192], groups at most 8192.
    a = node.attrs
    w = graph.shape(node.inputs[1])
    if node.inputs[1] not in graph.initializers:
        return "weights are not a build-time constant"
    if len(w) != 4:
        return f"{len(w) - 2}-D convolution, DLA supports 2-D only"
    kernel = list(w[2:])
    pads = _pair(a, "pads", [0, 0, 0, 0])
    strides = _pair(a, "strides", [1, 1])
    dilations = _pair(a, "dilations", [1, 1])
    if _text(a.get("auto_pad"), "NOTSET") != "NOTSET":
        return "auto_pad is not expanded"
    if any(not 1 <= k <= 32 for k in kernel):
        return f"kernel {kernel} outside [1, 32]"
    if any(not 0 <= p <= 31 for p in pads):
        return f"padding {pads} outside [0, 31]"
    if any(p >= kernel[i % 2] for i, p in enumerate(pads)):
        return f"padding {pads} not smaller than kernel {kernel}"
    if any(not 1 <= s <= 8 for s in strides):
        return f"stride {strides} outside [1, 8]"
    if any(not 1 <= d <= 32 for d in dilations):
        return f"dilation {dilations} outside [1, 32]"
    if not 1 <= w[0] <= 8192:
        return f"{w[0]} output maps outside [1, 8192]"
    if not 1 <= a.get("group", 1) <= 8192:
        return f"group {a.get('group', 1)} outside [1, 8192]"
    return None


def _deconv_extent(values: list[int]) -> bool:
    # IDeconvolutionLayer::setKernelSizeNd / setStrideNd DLA notes [HEADER]: each in [1,32], or 64, 96
    # or 128 in one dimension with 1 in the other ([1x64] is valid, [64x64] is not).
    if all(1 <= v <= 32 for v in values):
        return True
    return sorted(values) in ([1, 64], [1, 96], [1, 128])


def _deconv(graph: Graph, node: Node) -> str | None:
    # IDeconvolutionLayer DLA notes [HEADER]: 2-D kernel and stride as above, padding 0, nbGroups 1,
    # output maps [1,8192]; the docs table adds "no grouped/dilated". Kernel and stride need not be equal.
    a = node.attrs
    if node.inputs[1] not in graph.initializers:
        return "weights are not a build-time constant"
    w = graph.shape(node.inputs[1])
    if len(w) != 4:
        return "only 2-D deconvolution"
    kernel, strides = list(w[2:]), _pair(a, "strides", [1, 1])
    if _text(a.get("auto_pad"), "NOTSET") != "NOTSET":
        return "auto_pad is not expanded"
    if any(p != 0 for p in _pair(a, "pads", [0, 0, 0, 0])) or any(p != 0 for p in _pair(a, "output_padding", [0, 0])):
        return "padding must be 0"
    if a.get("group", 1) != 1:
        return "grouped deconvolution unsupported (nbGroups must be 1)"
    if any(d != 1 for d in _pair(a, "dilations", [1, 1])):
        return "dilated deconvolution unsupported"
    if not _deconv_extent(kernel):
        return f"kernel {kernel} outside [1, 32] (or 64/96/128 x 1)"
    if not _deconv_extent(strides):
        return f"stride {strides} outside [1, 32] (or 64/96/128 x 1)"
    if not 1 <= w[1] * a.get("group", 1) <= 8192:
        return f"{w[1]} output maps outside [1, 8192]"
    return None


def _pool(graph: Graph, node: Node) -> str | None:
    # IPoolingLayer DLA notes [HEADER]: kMAX and kAVERAGE only; window [1,8], stride [1,16], padding [0,7].
    a = node.attrs
    kernel = list(a.get("kernel_shape", []))
    if len(kernel) != 2:
        return "only 2-D pooling"
    pads, strides = _pair(a, "pads", [0, 0, 0, 0]), _pair(a, "strides", [1, 1])
    if _text(a.get("auto_pad"), "NOTSET") != "NOTSET":
        return "auto_pad is not expanded"
    if any(not 1 <= k <= 8 for k in kernel):
        return f"window {kernel} outside [1, 8] (use AveragePool with a window <= 8)"
    if any(not 0 <= p <= 7 for p in pads):
        return f"padding {pads} outside [0, 7]"
    if any(not 1 <= s <= 16 for s in strides):
        return f"stride {strides} outside [1, 16]"
    if any(d != 1 for d in _pair(a, "dilations", [1, 1])):
        return "dilated pooling unsupported"
    return None


def _global_max(graph: Graph, node: Node) -> str | None:
    # The parser builds GlobalMaxPool as a Reduce MAX over the spatial axes [PARSER, globalPoolingHelper];
    # the Reduce operator page: "DLA supports MAX where any combination of the CHW is reduced".
    return _rank4(graph, node)


def _reduce_max(graph: Graph, node: Node) -> str | None:
    reason = _rank4(graph, node)
    if reason:
        return reason
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        value = graph.constant(node.inputs[1])
        if value is None:
            return "axes are not a build-time constant"
        axes = value.reshape(-1).tolist()
    if not axes:
        return "reduces the batch axis too (no axes given), the DLA reduces C, H, W only"
    if any(int(x) % 4 == 0 for x in axes):
        return "reduces the batch axis, the DLA reduces C, H, W only"
    if node.attrs.get("keepdims", 1) != 1:
        return "keepdims=0 changes the rank, DLA tensors stay 4-D"
    return None


def _activation(graph: Graph, node: Node) -> str | None:
    # IActivationLayer on the DLA: kRELU, kSIGMOID, kTANH, kCLIP [HEADER]; the docs table adds leaky ReLU
    # and says "2D only": a rank-3 Sigmoid (YOLOv8's head, SVTR text recognisers) stays on the GPU.
    reason = _rank4(graph, node)
    if reason:
        return reason
    if node.op_type == "Clip":
        # The parser's Clip without a `min` input clamps at the lowest float, not 0 [PARSER, Clip]: that is
        # no clipped ReLU. The docs' clipped ReLU takes max in [1, 127].
        lo = graph.constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
        hi = graph.constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
        if lo is None or float(lo) != 0.0 or hi is None or not 1 <= float(hi) <= 127:
            return "only Clip(0, max) with constant min 0 and max in [1, 127] maps to the DLA's clipped ReLU"
    return None


def _prelu(graph: Graph, node: Node) -> str | None:
    # IParametricReLULayer [HEADER]: "the slopes input must be a build-time constant". The parser broadcasts
    # the slope to the input's rank first [PARSER, PRelu], so torch's [C, 1, 1] slope is [1, C, 1, 1] there.
    reason = _rank4(graph, node)
    if reason:
        return reason
    slope = node.inputs[1]
    if slope not in graph.initializers:
        return "slope is not a build-time constant"
    x, s = graph.shape(node.inputs[0]), graph.shape(slope)
    if len(s) > len(x):
        return f"slope rank {len(s)} exceeds the input's"
    padded = (1,) * (len(x) - len(s)) + tuple(s)
    if any(p not in (1, d) for p, d in zip(padded, x)) or padded[0] != 1:
        return f"slope {s} does not broadcast to {x} without a batch dimension"
    return None


def _broadcast_ok(a: tuple[int, ...], b: tuple[int, ...], out: tuple[int, ...]) -> bool:
    # DLA elementwise broadcasts NCHW with NCHW, NC11 or N111 (per-tensor, per-channel, elementwise).
    for shape in (a, b):
        s = (1,) * (len(out) - len(shape)) + tuple(shape)
        if s == tuple(out):
            continue
        if s[2:] == (1, 1) and s[1] in (1, out[1]):
            continue
        return False
    return True


def _eltwise(graph: Graph, node: Node) -> str | None:
    # IElementWiseLayer [HEADER]: "DLA supports only kSUM, kPROD, kMAX, kMIN, and kSUB"; "2D only" [DOCS].
    out = graph.shape(node.outputs[0])
    if len(out) != 4:
        return f"output has rank {len(out)}, DLA elementwise needs 4-D tensors"
    if len(node.inputs) != 2:
        return "only two-input elementwise layers"
    a, b = (graph.shape(i) for i in node.inputs)
    if not _broadcast_ok(a, b, out):
        return f"broadcast {a} x {b} is not NCHW x (NCHW | NC11 | N111)"
    return None


def _concat(graph: Graph, node: Node) -> str | None:
    # IConcatenationLayer [HEADER]: the axis must be the third to last (C of NCHW); the docs table adds
    # "at least 2 inputs".
    rank = len(graph.shape(node.outputs[0]))
    axis = node.attrs.get("axis", 1)
    if rank != 4 or axis % rank != 1:
        return f"concat on axis {axis} of a rank-{rank} tensor, DLA concatenates on the channel axis only"
    if len([i for i in node.inputs if i]) < 2:
        return "concat of a single input, the DLA needs at least two"
    return None


def _split(graph: Graph, node: Node) -> str | None:
    # The parser lowers Split to one ISliceLayer per output [PARSER, Split] with constant starts and sizes
    # and stride 1. ISliceLayer on the DLA [HEADER]: build-time constant start/size/stride, kSTRICT_BOUNDS,
    # stride 1, no slicing of the first dimension, a 4-D input.
    reason = _rank4(graph, node)
    if reason:
        return reason
    axis = node.attrs.get("axis", 0) % 4
    if axis == 0:
        return "splits the batch axis, DLA slices may not slice the first dimension"
    if len(node.inputs) > 1 and node.inputs[1] and graph.constant(node.inputs[1]) is None:
        return "split sizes are not a build-time constant"
    return None


def _lrn(graph: Graph, node: Node) -> str | None:
    # ILRNLayer [HEADER]: window in 3, 5, 7, 9; ACROSS_CHANNELS only [DOCS].
    size = node.attrs.get("size")
    if size not in (3, 5, 7, 9):
        return f"window {size} not in 3, 5, 7, 9"
    return _rank4(graph, node)


# ONNX (coordinate_transformation_mode, nearest_mode) -> what the parser sets on IResizeLayer [PARSER, Resize]
# and whether IResizeLayer's DLA combinations [HEADER] include it: nearest with (kASYMMETRIC, kFORMULA, kFLOOR),
# (kHALF_PIXEL, kFORMULA, kHALF_DOWN) or (kHALF_PIXEL, kFORMULA, kHALF_UP); linear with kHALF_PIXEL and
# kFORMULA or kUPPER.
_NEAREST_OK = {("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"), ("half_pixel", "round_prefer_ceil")}
_LINEAR_OK = {"half_pixel", "pytorch_half_pixel"}


def _resize(graph: Graph, node: Node) -> str | None:
    a = node.attrs
    mode = _text(a.get("mode"), "nearest")
    if node.op_type == "Upsample":  # opset < 11: asymmetric, nearest rounds down [PARSER]
        coord, nearest = "asymmetric", "floor"
    else:
        coord = _text(a.get("coordinate_transformation_mode"), "half_pixel")
        nearest = _text(a.get("nearest_mode"), "round_prefer_floor")
        # A `sizes` input makes the parser call setOutputDimensions(), which the DLA does not support [HEADER].
        if len(node.inputs) > 3 and node.inputs[3]:
            return "output sizes given (`sizes` input): the parser uses setOutputDimensions(), unsupported on the DLA"
        if len(node.inputs) < 3 or not node.inputs[2] or graph.constant(node.inputs[2]) is None:
            return "scales are not a build-time constant"
        if a.get("exclude_outside", 0):
            return "exclude_outside is not a DLA resize option"
    x, y = graph.shape(node.inputs[0]), graph.shape(node.outputs[0])
    if len(x) != 4 or x[:2] != y[:2]:
        return "only spatial resize of 4-D tensors (N and C unchanged)"
    scales = [y[i] / x[i] for i in (2, 3)]
    if any(s != int(s) for s in scales):
        return f"non-integer scale {scales}"
    if mode == "nearest":
        if (coord, nearest) not in _NEAREST_OK:
            return f"nearest resize with ({coord}, {nearest}) is not one of the DLA's combinations"
        if not all(1 <= s <= 32 for s in scales):
            return f"nearest resize with scales {scales} outside [1, 32]"
        return None
    if mode == "linear":
        if coord not in _LINEAR_OK:
            return f"linear resize with {coord} coordinates, the DLA needs half_pixel"
        if not all(1 <= s <= 4 for s in scales):
            return f"linear resize with scales {scales} outside [1, 4]"
        return None
    return f"{mode} resize is not a DLA mode (nearest or linear only)"


def _softmax(graph: Graph, node: Node) -> str | None:
    # ISoftMaxLayer DLA notes [HEADER]: the axis is a channel or spatial axis; with every other non-batch
    # dimension 1 the axis may be 8192 long, otherwise at most 1024.
    shape = graph.shape(node.inputs[0])
    if len(shape) != 4:
        return "DLA softmax needs a 4-D input"
    axis = node.attrs.get("axis", -1) % 4
    if axis == 0:
        return "softmax over the batch axis"
    others = [d for i, d in enumerate(shape[1:], 1) if i != axis]
    limit = 8192 if all(d == 1 for d in others) else 1024
    if shape[axis] > limit:
        return f"softmax axis of {shape[axis]} exceeds {limit}"
    return None


RULES: tuple[Rule, ...] = (
    Rule(("Conv",), "2-D; kernel [1,32], padding [0,31] and < kernel, stride [1,8], dilation [1,32], "
         "output maps [1,8192], groups [1,8192]", f"{HEADER}, IConvolutionLayer", _conv),
    Rule(("ConvTranspose",), "2-D; kernel and stride [1,32] (or 64/96/128 x 1), no padding, groups or dilation",
         f"{HEADER}, IDeconvolutionLayer; {DOCS}: Deconvolution", _deconv),
    Rule(("MaxPool", "AveragePool"), "2-D; window [1,8], padding [0,7], stride [1,16]",
         f"{HEADER}, IPoolingLayer", _pool),
    Rule(("GlobalMaxPool",), "4-D; a Reduce MAX over H and W", f"{PARSER}, GlobalMaxPool; TensorRT operator docs, Reduce",
         _global_max),
    Rule(("ReduceMax",), "4-D, keepdims, any of C, H, W", "TensorRT operator docs, Reduce (DLA Support)", _reduce_max),
    Rule(("Relu", "Sigmoid", "Tanh", "Clip", "LeakyRelu"), "4-D; ReLU, Sigmoid, TanH, clipped ReLU Clip(0, [1,127]), "
         "leaky ReLU", f"{HEADER}, IActivationLayer; {DOCS}: Activation; {PARSER}, Clip", _activation),
    Rule(("PRelu",), "4-D; slope a build-time constant that broadcasts per tensor, channel or element",
         f"{HEADER}, IParametricReLULayer; {PARSER}, PRelu", _prelu),
    Rule(("BatchNormalization",), "4-D; maps to a per-channel Scale layer", f"{DOCS}: Scale", _rank4),
    Rule(("Add", "Sub", "Mul", "Max", "Min"), "4-D; SUM, SUB, PROD, MAX, MIN; broadcast NCHW | NC11 | N111",
         f"{HEADER}, IElementWiseLayer; {DOCS}: ElementWise", _eltwise),
    Rule(("Concat",), "4-D, channel axis, at least two inputs", f"{HEADER}, IConcatenationLayer; {DOCS}: Concatenation",
         _concat),
    Rule(("Split",), "4-D, not the batch axis, constant sizes (lowered to Slice)", f"{PARSER}, Split; {HEADER}, ISliceLayer",
         _split),
    Rule(("LRN",), "4-D, window 3, 5, 7 or 9", f"{HEADER}, ILRNLayer", _lrn),
    Rule(("Resize", "Upsample"), "4-D, constant scales; nearest (asymmetric, floor) or (half_pixel, round_prefer_*) "
         "with integer scales [1,32], linear half_pixel with integer scales [1,4], no `sizes` input",
         f"{HEADER}, IResizeLayer; {PARSER}, Resize", _resize),
    Rule(("Softmax",), "4-D, channel or spatial axis, axis <= 1024 (8192 when the other dims are 1)",
         f"{HEADER}, ISoftMaxLayer", _softmax),
    Rule(("Abs",), "4-D; the only unary operation the DLA runs", f"{HEADER}, IUnaryLayer", _rank4),
)

_BY_OP = {op: rule for rule in RULES for op in rule.ops}

# Ops known not to run on the DLA, with the reason shown to the user.
UNSUPPORTED: dict[str, tuple[str, str]] = {
    "GlobalAveragePool": ("GlobalAveragePool is unsupported on the DLA: the parser builds a Reduce AVG, which the DLA "
                          "does not run (replace it with an AveragePool, window <= 8)", f"{PARSER}, GlobalAveragePool; TensorRT operator docs, Reduce; "
                                                      "NVIDIA-AI-IOT/jetson_dla_tutorial"),
    "ReduceMean": ("Reduce AVG is not a DLA operation (the DLA reduces with MAX only)", "TensorRT operator docs, Reduce"),
    "Gemm": ("fully connected on a 2-D tensor: DLA layers need 4-D NCHW tensors", DOCS),
    "MatMul": ("matrix multiply is not a DLA layer", DOCS),
    "Flatten": ("reshape to a 2-D tensor: DLA tensors are 4-D", DOCS),
    "Reshape": ("Shuffle (reshape) is not offloaded by k2edge: its DLA limits depend on the format", DOCS),
    "Transpose": ("Shuffle (transpose) is not offloaded by k2edge: its DLA limits depend on the format", DOCS),
    "GroupNormalization": ("GroupNorm is unsupported on the DLA", "NVIDIA-AI-IOT/jetson_dla_tutorial"),
    "HardSigmoid": ("hard sigmoid is not a DLA activation (ReLU, Sigmoid, TanH, Clip, leaky ReLU only)",
                    f"{HEADER}, IActivationLayer"),
    # Where the 10.3 header and later docs disagree the stricter one wins. The header lists SUM, PROD, MAX, MIN
    # and SUB only; later docs tables add DIV (at most one constant input) and POW (exactly one constant input).
    "Div": ("DIV is not among the DLA's elementwise operations in TensorRT 10.3 (kSUM, kPROD, kMAX, kMIN, kSUB, "
            "later docs add it)", f"{HEADER}, IElementWiseLayer"),
    "Pow": ("POW is not among the DLA's elementwise operations in TensorRT 10.3 (kSUM, kPROD, kMAX, kMIN, kSUB, "
            "later docs add it)", f"{HEADER}, IElementWiseLayer"),
    # The header names kABS only; the docs' Unary row also lists SIN, COS and ATAN: the header wins.
    **{op: (f"{op} is a unary operation the DLA does not run in TensorRT 10.3 (only ABS, later docs add SIN, COS, "
            f"ATAN)", f"{HEADER}, IUnaryLayer") for op in ("Sin", "Cos", "Atan")},
    "Sqrt": ("SQRT is a unary operation the DLA does not run (only ABS)", f"{HEADER}, IUnaryLayer"),
}

MAX_BATCH = 4096
MAX_DIM = 8192
_FLOAT = (np.dtype(np.float32), np.dtype(np.float16))


def dla_support(graph: Graph, node: Node) -> Support:
    """Whether ``node`` can run on the DLA, with the reason and source when it cannot."""
    for tensor in [i for i in node.inputs if graph.is_activation(i)] + [o for o in node.outputs if o]:
        info = graph.tensors.get(tensor)
        if info is None:
            return Support(False, f"tensor {tensor!r} has no static shape (DLA needs static shapes)", DOCS)
        if info.dtype not in _FLOAT:
            return Support(False, f"tensor {tensor!r} is {info.dtype}; DLA runs FP16/INT8 float math only", DOCS)
        if info.shape and info.shape[0] > MAX_BATCH:
            return Support(False, f"batch {info.shape[0]} exceeds the DLA limit of {MAX_BATCH}", DOCS)
        if any(d > MAX_DIM for d in info.shape[1:]):
            return Support(False, f"a non-batch dimension of {info.shape} exceeds {MAX_DIM}", DOCS)
    rule = _BY_OP.get(node.op_type)
    if rule is None:
        reason, source = UNSUPPORTED.get(node.op_type, (f"{node.op_type} is not a DLA layer", DOCS))
        return Support(False, reason, source)
    reason = rule.check(graph, node)
    return Support(reason is None, reason, rule.source)


def support_table(graph: Graph) -> tuple[Support, ...]:
    """DLA support of every node, in topological order."""
    return tuple(dla_support(graph, n) for n in graph.nodes)
