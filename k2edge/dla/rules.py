"""Which normalised ONNX nodes the DLA can run.

Each rule cites TensorRT's "DLA Supported Layers and Restrictions" (TensorRT 10.x, the releases
JetPack 6 ships for Orin) or another named source. The table is deliberately conservative: an op
that is not listed, or that k2edge cannot prove fits the limits, stays on the GPU with a reason.
That costs some offload, never a failed DLA build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..model.graph import Graph, Node

DOCS = "TensorRT docs, DLA Supported Layers and Restrictions"


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


def _spatial(graph: Graph, node: Node) -> str | None:
    shape = graph.shape(node.inputs[0])
    if len(shape) != 4:
        return f"input has rank {len(shape)}; DLA layers take 4-D NCHW tensors (2 spatial dims)"
    return None


def _conv(graph: Graph, node: Node) -> str | None:
    a = node.attrs
    w = graph.shape(node.inputs[1])
    if node.inputs[1] not in graph.initializers:
        return "weights are not a build-time constant"
    if len(w) != 4:
        return f"{len(w) - 2}-D convolution; DLA supports 2-D only"
    kernel = list(w[2:])
    pads = _pair(a, "pads", [0, 0, 0, 0])
    strides = _pair(a, "strides", [1, 1])
    dilations = _pair(a, "dilations", [1, 1])
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
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


def _deconv(graph: Graph, node: Node) -> str | None:
    a = node.attrs
    w = graph.shape(node.inputs[1])
    if len(w) != 4:
        return "only 2-D deconvolution"
    kernel, strides = list(w[2:]), _pair(a, "strides", [1, 1])
    if any(p != 0 for p in _pair(a, "pads", [0, 0, 0, 0])):
        return "padding must be 0"
    if a.get("group", 1) != 1:
        return "grouped deconvolution unsupported"
    if any(d != 1 for d in _pair(a, "dilations", [1, 1])):
        return "dilated deconvolution unsupported"
    if any(not 1 <= k <= 32 for k in kernel) or kernel != strides:
        return f"kernel {kernel} must equal stride {strides} within [1, 32]"
    return None


def _pool(graph: Graph, node: Node) -> str | None:
    a = node.attrs
    kernel = list(a.get("kernel_shape", []))
    if len(kernel) != 2:
        return "only 2-D pooling"
    pads, strides = _pair(a, "pads", [0, 0, 0, 0]), _pair(a, "strides", [1, 1])
    if any(not 1 <= k <= 8 for k in kernel):
        return f"window {kernel} outside [1, 8] (use AveragePool with a window <= 8)"
    if any(not 0 <= p <= 7 for p in pads):
        return f"padding {pads} outside [0, 7]"
    if any(not 1 <= s <= 16 for s in strides):
        return f"stride {strides} outside [1, 16]"
    if any(d != 1 for d in _pair(a, "dilations", [1, 1])):
        return "dilated pooling unsupported"
    return None


def _activation(graph: Graph, node: Node) -> str | None:
    if node.op_type == "Clip":
        lo = graph.constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else np.array(0.0)
        hi = graph.constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
        if lo is None or float(lo) != 0.0 or hi is None or not 1 <= float(hi) <= 127:
            return "only Clip(0, max) with max in [1, 127] maps to the DLA's clipped ReLU"
    return None


def _prelu(graph: Graph, node: Node) -> str | None:
    slope = node.inputs[1]
    if slope not in graph.initializers:
        return "slope is not a build-time constant"
    if len(graph.shape(slope)) != len(graph.shape(node.inputs[0])):
        return "slope rank differs from input rank"
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
    out = graph.shape(node.outputs[0])
    if len(out) != 4:
        return f"output has rank {len(out)}; DLA elementwise needs 4-D tensors"
    if len(node.inputs) != 2:
        return "only two-input elementwise layers"
    a, b = (graph.shape(i) for i in node.inputs)
    if not _broadcast_ok(a, b, out):
        return f"broadcast {a} x {b} is not NCHW x (NCHW | NC11 | N111)"
    return None


def _concat(graph: Graph, node: Node) -> str | None:
    rank = len(graph.shape(node.outputs[0]))
    axis = node.attrs.get("axis", 1)
    if rank != 4 or axis % rank != 1:
        return f"concat on axis {axis} of a rank-{rank} tensor; DLA concatenates on the channel axis only"
    return None


def _lrn(graph: Graph, node: Node) -> str | None:
    size = node.attrs.get("size")
    if size not in (3, 5, 7, 9):
        return f"window {size} not in 3, 5, 7, 9"
    return None


def _resize(graph: Graph, node: Node) -> str | None:
    mode = node.attrs.get("mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    x, y = graph.shape(node.inputs[0]), graph.shape(node.outputs[0])
    if len(x) != 4 or x[:2] != y[:2]:
        return "only spatial resize of 4-D tensors"
    scales = [y[i] / x[i] for i in (2, 3)]
    if any(s != int(s) for s in scales):
        return f"non-integer scale {scales}"
    if mode == "nearest" and all(1 <= s <= 32 for s in scales):
        return None
    if mode == "linear" and all(s in (2, 4) for s in scales):
        return None
    return f"{mode} resize with scales {scales} unsupported (nearest 1..32, linear 2 or 4)"


def _softmax(graph: Graph, node: Node) -> str | None:
    shape = graph.shape(node.inputs[0])
    axis = node.attrs.get("axis", -1) % max(len(shape), 1)
    if len(shape) != 4 or axis != 1:
        return "Orin DLA softmax needs a 4-D input and the channel axis"
    return None


RULES: tuple[Rule, ...] = (
    Rule(("Conv",), "2-D; kernel [1,32], padding [0,31] and < kernel, stride [1,8], dilation [1,32], "
         "output maps [1,8192], groups [1,8192]", f"{DOCS}: Convolution and Fully Connected layers", _conv),
    Rule(("ConvTranspose",), "2-D; kernel = stride in [1,32], no padding, groups or dilation",
         f"{DOCS}: Deconvolution layer", _deconv),
    Rule(("MaxPool", "AveragePool"), "2-D; window [1,8], padding [0,7], stride [1,16]",
         f"{DOCS}: Pooling layer", _pool),
    Rule(("Relu", "Sigmoid", "Tanh", "Clip", "LeakyRelu"), "ReLU, Sigmoid, TanH, clipped ReLU (max [1,127]), "
         "leaky ReLU", f"{DOCS}: Activation layer", _activation),
    Rule(("PRelu",), "slope a build-time constant with the input's rank", f"{DOCS}: Parametric ReLU layer", _prelu),
    Rule(("BatchNormalization",), "maps to a per-channel Scale layer", f"{DOCS}: Scale layer", lambda g, n: _spatial(g, n)),
    Rule(("Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"), "two 4-D inputs, broadcast NCHW | NC11 | N111",
         f"{DOCS}: ElementWise layer", _eltwise),
    Rule(("Concat",), "channel axis only, 4-D", f"{DOCS}: Concatenation layer", _concat),
    Rule(("LRN",), "across channels, window 3, 5, 7 or 9", f"{DOCS}: LRN layer", _lrn),
    Rule(("Resize", "Upsample"), "nearest with integer scales [1,32]; linear x2 or x4", f"{DOCS}: Resize layer", _resize),
    Rule(("Softmax",), "Orin only; 4-D, channel axis", f"{DOCS}: SoftMax layer", _softmax),
    Rule(("Abs", "Sin", "Cos", "Atan"), "unary ABS, SIN, COS, ATAN", f"{DOCS}: Unary layer", lambda g, n: _spatial(g, n)),
)

_BY_OP = {op: rule for rule in RULES for op in rule.ops}

# Ops known not to run on the DLA, with the reason shown to the user.
UNSUPPORTED: dict[str, tuple[str, str]] = {
    "GlobalAveragePool": ("GlobalAveragePool is unsupported on the DLA (replace with AveragePool, window <= 8)",
                          "NVIDIA-AI-IOT/jetson_dla_tutorial; " + DOCS),
    "GlobalMaxPool": ("global pooling is unsupported on the DLA", DOCS),
    "Gemm": ("fully connected on a 2-D tensor: DLA layers need 4-D NCHW tensors", DOCS),
    "MatMul": ("matrix multiply is not a DLA layer", DOCS),
    "Flatten": ("reshape to a 2-D tensor: DLA tensors are 4-D", DOCS),
    "Reshape": ("Shuffle (reshape) is not offloaded by k2edge: its DLA limits depend on the format", DOCS),
    "Transpose": ("Shuffle (transpose) is not offloaded by k2edge: its DLA limits depend on the format", DOCS),
    "GroupNormalization": ("GroupNorm is unsupported on the DLA", "NVIDIA-AI-IOT/jetson_dla_tutorial"),
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
