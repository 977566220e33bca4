"""A dynamic batch axis for a model normalised at static shapes.

Normalisation fixes every shape, so the batch size ends up baked into the graph: in its inputs and
outputs, and in the shape constants folded from ``Shape`` subgraphs (a YOLO head's ``Reshape`` to
``[batch, 64, -1]``). Given the same (sub-)model normalised at two batch sizes, :func:`with_batch_axis`
finds what differs between them and gives back one model that runs at any batch size: dimensions that
follow the batch become symbolic, and every integer constant that follows it is computed at run time
from the batch of an input (``a + c * batch`` per element, as fitted on the two sizes).

Anything else that differs (the nodes, their attributes, a float constant) means the model's
computation depends on the batch in a way this cannot express: :class:`~k2edge.errors.ModelError`
says so and the caller keeps static engines per batch size.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import ModelError

BATCH_DIM = "batch"
"""The symbolic name of the batch dimension in a model's inputs and outputs."""

_BATCH_TENSOR = "k2edge_batch"


def with_batch_axis(small: onnx.ModelProto, large: onnx.ModelProto, sizes: tuple[int, int], where: str) -> onnx.ModelProto:
    """One model for every batch size, from the same model normalised at the two batch ``sizes``.

    Args:
        small / large: the model at ``sizes[0]`` and at ``sizes[1]`` (``sizes[0] < sizes[1]``, both above 1 so a
            batch of 1 cannot pass for a constant 1).
        where: how to name the model in messages.

    Returns:
        ``small`` with a symbolic batch axis; unchanged (but for its value_info) when nothing follows the
        batch (a model exported with a fixed batch).

    Raises:
        ModelError: the two differ in something other than batch-proportional shapes and integer constants.
    """
    b1, b2 = sizes
    if not 1 < b1 < b2:
        raise ValueError(f"sizes must be two batch sizes above 1, in order; got {sizes}")
    g1, g2 = small.graph, large.graph
    _same_structure(g1, g2, where)
    out = onnx.ModelProto()
    out.CopyFrom(small)
    g = out.graph
    del g.value_info[:]  # static shapes of intermediates would contradict other batch sizes
    source = _batch_source(g1, g2, sizes)
    for vi1, vi2, vi in zip([*g1.input, *g1.output], [*g2.input, *g2.output], [*g.input, *g.output]):
        _symbolic_dims(vi1, vi2, vi, sizes, where)
    inits2 = {t.name: t for t in g2.initializer}
    computed: list[onnx.NodeProto] = []
    keep: list[onnx.TensorProto] = []
    for t1 in g1.initializer:
        v1, v2 = numpy_helper.to_array(t1), numpy_helper.to_array(inits2[t1.name])
        if v1.shape == v2.shape and np.array_equal(v1, v2):
            keep.append(t1)
            continue
        if v1.dtype != np.int64 or v1.ndim != 1 or v1.shape != v2.shape:
            raise ModelError(f"{where}: constant {t1.name!r} ({v1.dtype}, shape {list(v1.shape)} at batch {b1}, "
                             f"{list(v2.shape)} at batch {b2}) changes with the batch size and is no shape vector")
        if source is None:
            raise ModelError(f"{where}: constant {t1.name!r} changes with the batch size, but no input carries the batch")
        computed.extend(_computed_constant(t1.name, v1, v2, sizes, where))
    if computed:
        head = [helper.make_node("Shape", [source], [_BATCH_TENSOR], name="k2edge_batch_shape", start=0, end=1)]
        nodes = head + computed + list(g.node)
        del g.node[:]
        g.node.extend(nodes)
        del g.initializer[:]
        g.initializer.extend(keep)
    return out


def profile_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes an engine that needs a shape per size is built for: powers of two below ``max_batch``, and
    ``max_batch`` (a batch is padded up to the next; padding wastes less than 2x)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return tuple(sizes)


def has_batch_axis(model: onnx.ModelProto) -> bool:
    """True when the model's first input has a symbolic batch dimension (made by :func:`with_batch_axis`)."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    return bool(dims) and dims[0].dim_param == BATCH_DIM


def _same_structure(g1: onnx.GraphProto, g2: onnx.GraphProto, where: str) -> None:
    if len(g1.node) != len(g2.node):
        raise ModelError(f"{where}: the graph has {len(g1.node)} nodes at one batch size and {len(g2.node)} at another")
    for n1, n2 in zip(g1.node, g2.node):
        if (n1.op_type, list(n1.input), list(n1.output)) != (n2.op_type, list(n2.input), list(n2.output)):
            raise ModelError(f"{where}: node {n1.name!r} differs between batch sizes")
        if list(n1.attribute) != list(n2.attribute):
            raise ModelError(f"{where}: node {n1.name!r} has attributes that change with the batch size")
    if {t.name for t in g1.initializer} != {t.name for t in g2.initializer}:
        raise ModelError(f"{where}: the constants differ between batch sizes")
    if [i.name for i in g1.input] != [i.name for i in g2.input] or [o.name for o in g1.output] != [o.name for o in g2.output]:
        raise ModelError(f"{where}: the inputs or outputs differ between batch sizes")


def _dims(vi: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value for d in vi.type.tensor_type.shape.dim]


def _batch_source(g1: onnx.GraphProto, g2: onnx.GraphProto, sizes: tuple[int, int]) -> str | None:
    """The first input whose first dimension is the batch (and nothing else changes)."""
    for i1, i2 in zip(g1.input, g2.input):
        d1, d2 = _dims(i1), _dims(i2)
        if d1 and d2 and (d1[0], d2[0]) == sizes and d1[1:] == d2[1:]:
            return i1.name
    return None


def _symbolic_dims(vi1, vi2, vi, sizes: tuple[int, int], where: str) -> None:
    d1, d2 = _dims(vi1), _dims(vi2)
    if len(d1) != len(d2):
        raise ModelError(f"{where}: tensor {vi1.name!r} changes rank with the batch size")
    for axis, (a, b) in enumerate(zip(d1, d2)):
        if a == b:
            continue
        dim = vi.type.tensor_type.shape.dim[axis]
        dim.Clear()
        # the batch itself where it is the batch; another symbol where it grows with it (a batch * k reshape)
        dim.dim_param = BATCH_DIM if (a, b) == sizes else f"{BATCH_DIM}_{axis}"


def _computed_constant(name: str, v1: np.ndarray, v2: np.ndarray, sizes: tuple[int, int], where: str) -> list:
    """Nodes computing ``name`` = base + step * batch, elementwise (step 0 where it does not change)."""
    b1, b2 = sizes
    diff = v2 - v1
    if np.any(diff % (b2 - b1)):
        raise ModelError(f"{where}: constant {name!r} ({v1.tolist()} at batch {b1}, {v2.tolist()} at batch {b2}) "
                         f"does not grow in whole steps with the batch")
    step = diff // (b2 - b1)
    base = v1 - step * b1
    base_name, step_name, scaled = f"{name}__base", f"{name}__step", f"{name}__scaled"
    return [
        helper.make_node("Constant", [], [base_name], name=f"{name}__base_const",
                         value=numpy_helper.from_array(base.astype(np.int64), base_name)),
        helper.make_node("Constant", [], [step_name], name=f"{name}__step_const",
                         value=numpy_helper.from_array(step.astype(np.int64), step_name)),
        helper.make_node("Mul", [step_name, _BATCH_TENSOR], [scaled], name=f"{name}__mul"),
        helper.make_node("Add", [base_name, scaled], [name], name=f"{name}__add"),
    ]
