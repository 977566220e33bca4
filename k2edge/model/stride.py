"""The largest downsampling an image model's graph applies, read from its operators' attributes (no
shapes needed, so it works on an export with dynamic height and width before it is fixed to a size).

Each tensor's stride is the largest of its inputs' times the node's own (``strides`` of Conv,
MaxPool, AveragePool), divided by an upsampling Resize's constant ``scales``. A YOLOv8 backbone
reaches 32: a size that 32 does not divide breaks its Concat of upsampled and skip features.
"""

from __future__ import annotations

import onnx
from onnx import numpy_helper

__all__ = ["graph_stride"]

_STRIDED = {"Conv", "MaxPool", "AveragePool", "ConvTranspose"}


def _constants(model: onnx.ModelProto) -> dict:
    values = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    values[node.output[0]] = a.t
    return values


def graph_stride(model: onnx.ModelProto) -> int:
    """The largest spatial stride any tensor of ``model`` reaches from its inputs (1 when none)."""
    consts = _constants(model)
    stride: dict[str, float] = {i.name: 1.0 for i in model.graph.input if i.name not in consts}
    best = 1.0
    for node in model.graph.node:  # ONNX nodes are topologically sorted
        ins = [stride[i] for i in node.input if i in stride]
        if not ins:
            continue
        s = max(ins)
        if node.op_type in _STRIDED:
            attrs = {a.name: a for a in node.attribute}
            steps = list(attrs["strides"].ints) if "strides" in attrs else []
            if steps:
                s = s / max(steps) if node.op_type == "ConvTranspose" else s * max(steps)
        elif node.op_type == "Resize" and len(node.input) >= 3 and node.input[2] in consts:
            scales = numpy_helper.to_array(consts[node.input[2]]).ravel()
            if scales.size >= 2 and scales[-1] > 0:
                s = s / float(scales[-1])
        for out in node.output:
            stride[out] = s
        best = max(best, s)
    return max(1, int(round(best)))
