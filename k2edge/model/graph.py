"""A read-only view of a normalised ONNX graph: nodes in topological order, tensor shapes, cuts.

Everything the planner needs to know about a graph is computed here once, from the ModelProto,
so the planner itself works on plain Python data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import ModelError


@dataclass(frozen=True)
class TensorInfo:
    """Static shape and element type of one tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class Node:
    """One ONNX node after normalisation, with what the planner needs to know about it."""

    index: int
    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict = field(hash=False, compare=False)


class Graph:
    """Topologically ordered nodes of a normalised model with tensor metadata.

    Args:
        model: a normalised model (static shapes, every tensor's shape inferred, unique node names).
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.initializers: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        self.inputs: tuple[str, ...] = tuple(i.name for i in g.input if i.name not in self.initializers)
        self.outputs: tuple[str, ...] = tuple(o.name for o in g.output)
        self.tensors: dict[str, TensorInfo] = {}
        for vi in list(g.input) + list(g.value_info) + list(g.output):
            info = _tensor_info(vi)
            if info is not None:
                self.tensors[vi.name] = info
        for name, init in self.initializers.items():
            self.tensors[name] = TensorInfo(name, tuple(init.dims), helper.tensor_dtype_to_np_dtype(init.data_type))
        self.nodes: tuple[Node, ...] = tuple(
            Node(i, n.name, n.op_type, tuple(n.input), tuple(n.output), {a.name: helper.get_attribute_value(a) for a in n.attribute})
            for i, n in enumerate(g.node)
        )
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for node in self.nodes:
            for out in node.outputs:
                if out:
                    self.producer[out] = node.index
            for inp in node.inputs:
                if inp:
                    self.consumers.setdefault(inp, []).append(node.index)
        self.by_name = {n.name: n for n in self.nodes}

    def __len__(self) -> int:
        return len(self.nodes)

    def shape(self, tensor: str) -> tuple[int, ...]:
        try:
            return self.tensors[tensor].shape
        except KeyError:
            raise ModelError(f"tensor {tensor!r} has no inferred shape") from None

    def constant(self, tensor: str) -> np.ndarray | None:
        """The value of ``tensor`` when it is an initializer, else None."""
        init = self.initializers.get(tensor)
        return None if init is None else numpy_helper.to_array(init)

    def is_activation(self, tensor: str) -> bool:
        """True for tensors that flow between nodes (not initializers, not empty optional inputs)."""
        return bool(tensor) and tensor not in self.initializers

    @cached_property
    def last_use(self) -> dict[str, int]:
        """For each activation, the index of its last consumer (len(nodes) for graph outputs)."""
        last: dict[str, int] = {}
        for node in self.nodes:
            for inp in node.inputs:
                if self.is_activation(inp):
                    last[inp] = max(last.get(inp, -1), node.index)
        for out in self.outputs:
            last[out] = len(self.nodes)
        return last

    def crossing(self, position: int) -> tuple[str, ...]:
        """Activations that cross a cut placed before node ``position``.

        A tensor crosses when it is produced before the cut (or is a graph input) and used at or
        after it (a graph output produced before the cut crosses too: the later part must pass it on).
        """
        out = []
        for name, last in self.last_use.items():
            born = self.producer.get(name, -1)
            if born < position <= last:
                out.append(name)
        return tuple(sorted(out, key=lambda t: (self.producer.get(t, -1), t)))

    @cached_property
    def crossing_counts(self) -> tuple[int, ...]:
        """Number of tensors crossing each cut position 0..len(nodes), computed in one sweep."""
        n = len(self.nodes)
        delta = [0] * (n + 2)
        for name, last in self.last_use.items():
            born = self.producer.get(name, -1)
            # crosses every position p with born < p <= last
            delta[born + 1] += 1
            delta[last + 1] -= 1
        counts, running = [], 0
        for p in range(n + 1):
            running += delta[p]
            counts.append(running)
        return tuple(counts)

    def segment_io(self, start: int, stop: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Inputs and outputs of the node range [start, stop) as a stand-alone sub-graph."""
        produced = set()
        inputs: list[str] = []
        for node in self.nodes[start:stop]:
            for inp in node.inputs:
                if self.is_activation(inp) and inp not in produced and inp not in inputs:
                    inputs.append(inp)
            produced.update(o for o in node.outputs if o)
        outputs = [t for t in self.crossing(stop) if t in produced]
        return tuple(inputs), tuple(outputs)


def _tensor_info(vi: onnx.ValueInfoProto) -> TensorInfo | None:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
        return None
    dims = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(d.dim_value)
    return TensorInfo(vi.name, tuple(dims), helper.tensor_dtype_to_np_dtype(tt.elem_type))
