"""Per-node cost: FLOPs, parameter bytes and activation bytes.

FLOPs count 2 x MACs for Conv, ConvTranspose, Gemm and MatMul, the window size per output element
for pooling, and the output element count for elementwise work. Pure data movement (Reshape,
Concat, Transpose, ...) costs no FLOPs but still has activation bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .graph import Graph, Node

_MOVEMENT = {
    "Reshape", "Flatten", "Transpose", "Concat", "Slice", "Split", "Squeeze", "Unsqueeze", "Gather",
    "Pad", "Cast", "Identity", "Expand", "Tile", "DepthToSpace", "SpaceToDepth", "Shape", "Size",
    "QuantizeLinear", "DequantizeLinear",
}
_REDUCE = {
    "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum",
    "ReduceProd", "ReduceL1", "ReduceL2", "ArgMax", "ArgMin",
}


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node."""

    flops: int
    param_bytes: int
    activation_bytes: int


def _prod(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def node_flops(graph: Graph, node: Node) -> int:
    """FLOPs of one node of a normalised graph (static shapes)."""
    op = node.op_type
    out = graph.shape(node.outputs[0])
    if op == "Conv":
        w = graph.shape(node.inputs[1])
        macs = _prod(out) * _prod(w[1:])
        bias = _prod(out) if len(node.inputs) > 2 and node.inputs[2] else 0
        return 2 * macs + bias
    if op == "ConvTranspose":
        x, w = graph.shape(node.inputs[0]), graph.shape(node.inputs[1])
        macs = _prod(x) * _prod(w[1:])
        bias = _prod(out) if len(node.inputs) > 2 and node.inputs[2] else 0
        return 2 * macs + bias
    if op == "Gemm":
        a = graph.shape(node.inputs[0])
        k = a[0] if node.attrs.get("transA", 0) else a[1]
        bias = _prod(out) if len(node.inputs) > 2 and node.inputs[2] else 0
        return 2 * _prod(out) * k + bias
    if op == "MatMul":
        k = graph.shape(node.inputs[0])[-1]
        return 2 * _prod(out) * k
    if op in ("MaxPool", "AveragePool", "LpPool"):
        return _prod(out) * _prod(node.attrs.get("kernel_shape", [1]))
    if op in _REDUCE:
        return _prod(graph.shape(node.inputs[0]))
    if op == "BatchNormalization":
        return 2 * _prod(out)
    if op in ("Softmax", "LogSoftmax", "LRN", "InstanceNormalization", "LayerNormalization"):
        return 5 * _prod(out)
    if op in _MOVEMENT:
        return 0
    return _prod(out)  # elementwise and everything else: one op per output element


def node_cost(graph: Graph, node: Node) -> NodeCost:
    """FLOPs, parameter bytes (initializer inputs) and activation bytes (outputs) of one node."""
    params = sum(graph.tensors[i].nbytes for i in node.inputs if i in graph.initializers)
    acts = sum(graph.tensors[o].nbytes for o in node.outputs if o in graph.tensors)
    return NodeCost(flops=node_flops(graph, node), param_bytes=params, activation_bytes=acts)


def model_costs(graph: Graph) -> tuple[NodeCost, ...]:
    """Costs of every node, in the graph's topological order."""
    return tuple(node_cost(graph, n) for n in graph.nodes)
