"""Cut a sub-model out of a model: the nodes that compute given outputs from given inputs."""

from __future__ import annotations

import onnx
from onnx import helper

from ..errors import ModelError


def extract_submodel(model: onnx.ModelProto, inputs: tuple[str, ...], outputs: tuple[str, ...], name: str) -> onnx.ModelProto:
    """A stand-alone model computing ``outputs`` from ``inputs``.

    Works on any model whose activation names survive transformation: the normalised model and
    the Q/DQ and FP16 models derived from it keep the original names at every cut.

    Raises:
        ModelError: an output cannot be computed from the given inputs.
    """
    g = model.graph
    producer = {o: i for i, n in enumerate(g.node) for o in n.output if o}
    inits = {t.name: t for t in g.initializer}
    boundary = set(inputs)
    node_ids: set[int] = set()
    used_inits: set[str] = set()
    seen: set[str] = set()
    stack = list(outputs)
    while stack:
        t = stack.pop()
        if not t or t in seen or t in boundary:
            continue
        seen.add(t)
        if t in inits:
            used_inits.add(t)
            continue
        if t not in producer:
            raise ModelError(f"segment {name}: tensor {t!r} is neither computed inside it nor one of its inputs {list(inputs)}")
        idx = producer[t]
        if idx not in node_ids:
            node_ids.add(idx)
            stack.extend(g.node[idx].input)
    value_info = {v.name: v for v in list(g.input) + list(g.value_info) + list(g.output)}
    missing = [t for t in (*inputs, *outputs) if t not in value_info]
    if missing:
        raise ModelError(f"segment {name}: tensor {missing[0]!r} has no type information")
    inner = [v for k, v in value_info.items() if k in seen and k not in boundary and k not in outputs and k not in inits]
    sub = helper.make_graph(
        [g.node[i] for i in sorted(node_ids)],
        name,
        [value_info[t] for t in inputs],
        [value_info[t] for t in outputs],
        [inits[t] for t in sorted(used_inits)],
        value_info=inner,
    )
    return helper.make_model(sub, opset_imports=list(model.opset_import), ir_version=model.ir_version, producer_name="k2edge")
