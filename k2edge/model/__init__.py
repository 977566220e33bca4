"""Model layer: ONNX ingest and normalisation, per-node cost, graph cuts, datasets (preprocessing is k2edge.tasks).

Pure Python on onnx and numpy (images decode through Pillow, imported lazily).
"""

from .cost import NodeCost, model_costs, node_cost
from .graph import Graph, Node, TensorInfo
from .ingest import NormalisedModel, load_onnx, normalise

__all__ = [
    "Graph",
    "Node",
    "NodeCost",
    "NormalisedModel",
    "TensorInfo",
    "load_onnx",
    "model_costs",
    "node_cost",
    "normalise",
]
