"""ONNX ingest and normalisation.

Accepts image models as common exporters write them — opset 9 to current, initializers also
listed as graph inputs, weights computed by constant subgraphs, dynamic batch dimensions — and
normalises them into what the planner and the backends need: one opset, constants folded,
Identity/Dropout removed, every tensor's shape static and inferred, every node uniquely named,
nodes in topological order.
"""

from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from ..errors import ModelError, first_line
from .graph import Graph

TARGET_OPSET = 17
"""Models below this opset are upgraded; newer ones are kept as they are."""

NORMALISER_VERSION = "1"
"""Bumped whenever normalisation output changes, so cached normalised models are rebuilt."""

_DEFAULT_DOMAINS = ("", "ai.onnx")
# Never folded: random ops differ per run, and folding Q/DQ would erase explicit quantisation.
_NEVER_FOLD = {
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
    "QuantizeLinear", "DequantizeLinear",
}
_PASS_THROUGH = {"Identity", "Dropout"}
# Lowest IR version that can carry each opset (onnx/helper.py VERSION_TABLE); initializers need not be inputs from IR 4.
_IR_FOR_OPSET = {17: 8, 18: 8, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11, 24: 11}


@dataclass(frozen=True)
class NormalisedModel:
    """A normalised model and the facts derived from it.

    Attributes:
        model: the normalised ModelProto (static shapes everywhere).
        source: where it came from (a path or '<memory>').
        original_opset: the default-domain opset of the model as given.
        batch_free_key: what identifies the model whatever batch size it was normalised for (set by the
            engine's loader; empty when unknown, and :attr:`identity` is then the model's sha256).
    """

    model: onnx.ModelProto
    source: str
    original_opset: int
    batch_free_key: str = ""

    @cached_property
    def graph(self) -> Graph:
        return Graph(self.model)

    @cached_property
    def serialized(self) -> bytes:
        return self.model.SerializeToString(deterministic=True)

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.serialized).hexdigest()

    @property
    def identity(self) -> str:
        """The same for every batch size of one model (so one INT8 calibration serves them all)."""
        return self.batch_free_key or self.sha256

    @property
    def opset(self) -> int:
        return _default_opset(self.model)

    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.graph.shape(name) for name in self.graph.inputs}

    def metadata(self) -> dict[str, str]:
        return {p.key: p.value for p in self.model.metadata_props}


def model_file(source: str | os.PathLike) -> Path:
    """``source`` as a model file's path, told before anything is built from it.

    Raises:
        ModelError: a directory, or nothing there.
    """
    path = Path(source)
    if path.is_dir():
        raise ModelError(f"{str(path)!r} is a directory; expected an ONNX model file")
    if not path.is_file():
        raise ModelError(f"model file {str(path)!r} does not exist")
    return path


def load_onnx(source: str | os.PathLike | bytes | onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """Load a model from a path, bytes or a ModelProto.

    Returns:
        (model, a description of its source for messages).

    Raises:
        ModelError: the file is missing or is not an ONNX model.
    """
    if isinstance(source, onnx.ModelProto):
        return source, "<memory>"
    if isinstance(source, (bytes, bytearray)):
        try:
            return onnx.load_from_string(bytes(source)), "<bytes>"
        except Exception as exc:  # protobuf raises DecodeError or RuntimeWarning subclasses
            raise ModelError(f"not an ONNX model: {exc}") from None
    path = model_file(source)
    try:
        model = onnx.load(str(path))
    except Exception as exc:
        raise ModelError(f"{path}: not an ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.graph.node:
        raise ModelError(f"{path}: not an ONNX model (no graph nodes)")
    return model, str(path)


def normalise(
    source: str | os.PathLike | bytes | onnx.ModelProto,
    *,
    batch_size: int = 1,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    where: str | None = None,
) -> NormalisedModel:
    """Normalise a model for planning and execution.

    Args:
        source: a path, serialized bytes or a ModelProto (not modified).
        batch_size: the static value given to a dynamic first dimension.
        input_shapes: full static shapes for inputs whose other dimensions are dynamic; a static
            dimension of the model must not be contradicted (only the batch axis may differ).
        where: how to name the model in messages (default: its path).

    Raises:
        ModelError: one message naming the node (or input) at fault and why.
    """
    model, loaded_from = load_onnx(source)
    where = where or loaded_from
    model = copy.deepcopy(model)
    original_opset = _default_opset(model)
    _check_domains(model, where)
    _toposort(model, where)
    if original_opset < TARGET_OPSET:
        # Upgrade first: the converter expects an old (IR < 4) model to list its initializers as inputs.
        model = _upgrade_opset(model, original_opset, where)
    _drop_initializer_inputs(model)
    model.ir_version = max(model.ir_version, _IR_FOR_OPSET.get(_default_opset(model), onnx.IR_VERSION))
    _constants_to_initializers(model)
    _fix_input_shapes(model, batch_size, input_shapes or {}, where)
    for _ in range(32):  # each round folds what the previous round's shape inference exposed
        model = _infer(model, where, strict=False)
        if not _fold_constants(model, where):
            break
    _remove_pass_through(model)
    _prune(model)
    _name_nodes(model)
    model = _infer(model, where, strict=True)
    _check_static(model, where)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"{where}: normalised model is invalid: {first_line(exc)}") from None
    return NormalisedModel(model=model, source=where, original_opset=original_opset)


def _default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in _DEFAULT_DOMAINS:
            return imp.version
    raise ModelError("model imports no default-domain opset")


def _check_domains(model: onnx.ModelProto, where: str) -> None:
    for node in model.graph.node:
        if node.domain not in _DEFAULT_DOMAINS:
            raise ModelError(
                f"{where}: node {node.name or node.op_type!r} ({node.domain}::{node.op_type}) uses a custom "
                f"operator domain; only standard ONNX operators can be planned for GPU/DLA"
            )
        if any(a.type == onnx.AttributeProto.GRAPH or a.type == onnx.AttributeProto.GRAPHS for a in node.attribute):
            raise ModelError(
                f"{where}: node {node.name or node.op_type!r} ({node.op_type}) holds a sub-graph (control flow); "
                f"image models for the GPU/DLA must be straight-line graphs"
            )


def _drop_initializer_inputs(model: onnx.ModelProto) -> None:
    # Old exporters (IR < 4) list every initializer as a graph input too.
    inits = {t.name for t in model.graph.initializer}
    keep = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(keep)


def _constants_to_initializers(model: onnx.ModelProto) -> None:
    g = model.graph
    keep = []
    for node in g.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            tensor = copy.deepcopy(node.attribute[0].t)
            tensor.name = node.output[0]
            g.initializer.append(tensor)
        elif node.op_type == "Constant":
            # value_float, value_ints, ...: let the reference evaluator produce the tensor.
            value = _evaluate(model, node, {})[0]
            g.initializer.append(numpy_helper.from_array(value, node.output[0]))
        else:
            keep.append(node)
    del g.node[:]
    g.node.extend(keep)


def _fix_input_shapes(model, batch_size, overrides, where) -> None:
    inputs = {i.name for i in model.graph.input}
    unknown = set(overrides) - inputs
    if unknown:
        raise ModelError(f"{where}: --input-shape names no input {sorted(unknown)}; inputs are {sorted(inputs)}")
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise ModelError(f"{where}: input {vi.name!r} is not a tensor")
        dims = list(tt.shape.dim)
        if vi.name in overrides:
            shape = tuple(int(d) for d in overrides[vi.name])
            if tt.HasField("shape") and len(dims) != len(shape):
                raise ModelError(f"{where}: input {vi.name!r} has rank {len(dims)}, --input-shape gives {len(shape)} dims")
            for axis, (d, want) in enumerate(zip(dims, shape)):
                if axis > 0 and d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != want:
                    raise ModelError(f"{where}: --input-shape gives {vi.name!r} {want} at axis {axis}, "
                                     f"but the model fixes it at {d.dim_value}")
        else:
            if not tt.HasField("shape"):
                raise ModelError(f"{where}: input {vi.name!r} has no shape; give one with --input-shape {vi.name}=1x3x224x224")
            shape = []
            for axis, d in enumerate(dims):
                if d.HasField("dim_value") and d.dim_value > 0:
                    shape.append(d.dim_value)
                elif axis == 0:
                    shape.append(batch_size)
                else:
                    label = d.dim_param or "?"
                    static = [x.HasField("dim_value") and x.dim_value > 0 for x in dims]
                    # an image's height and width, not one N: where the channels are static, the layout says which
                    names = ({2: "H", 3: "W"} if len(dims) == 4 and static[1] else
                             {1: "H", 2: "W"} if len(dims) == 4 and static[3] else {})
                    free = {i: names.get(i, f"D{i}") for i in range(1, len(dims)) if not static[i]}
                    example = "x".join(str(x.dim_value) if static[i] else "1" if i == 0 else free[i]
                                       for i, x in enumerate(dims))
                    raise ModelError(
                        f"{where}: input {vi.name!r} has a dynamic dimension {label!r} at axis {axis}; the DLA needs "
                        f"static shapes: give one with --input-shape {vi.name}={example} ({', '.join(free.values())}: "
                        "your size)"
                    )
        tt.ClearField("shape")
        for d in shape:
            tt.shape.dim.add().dim_value = d
    for out in model.graph.output:
        # Let inference compute static output shapes; exporters often label them with dim_params.
        out.type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]


def _upgrade_opset(model, original, where) -> onnx.ModelProto:
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, TARGET_OPSET)
    except Exception as exc:  # the converter raises RuntimeError/ValidationError with the op name inside
        raise ModelError(f"{where}: cannot upgrade opset {original} -> {TARGET_OPSET}: {first_line(exc)}") from None


def _infer(model, where, strict) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, check_type=strict, strict_mode=strict, data_prop=True)
    except Exception as exc:
        raise ModelError(f"{where}: shape inference failed: {first_line(exc)}") from None


def _static_shape(model) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in tt.shape.dim)
    return shapes


def _fold_constants(model, where) -> bool:
    """Replace every node computable at build time by initializers. Returns True if any was."""
    g = model.graph
    constants: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
    shapes = _static_shape(model)
    folded: list[onnx.TensorProto] = []
    keep = []
    for node in g.node:
        values = None
        if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
            values = [_shape_value(node, shapes[node.input[0]])]
        elif node.op_type not in _NEVER_FOLD and all((not i) or i in constants for i in node.input):
            values = _evaluate(model, node, constants, where)
        if values is None:
            keep.append(node)
            continue
        for name, value in zip([o for o in node.output if o], values):
            tensor = numpy_helper.from_array(np.asarray(value), name)
            folded.append(tensor)
            constants[name] = tensor
    if not folded:
        return False
    del g.node[:]
    g.node.extend(keep)
    g.initializer.extend(folded)
    constant_outputs = sorted({o.name for o in g.output} & {t.name for t in folded})
    if constant_outputs:
        raise ModelError(f"{where}: graph output(s) {constant_outputs} are constants; nothing to run")
    _prune(model)
    return True


def _shape_value(node, shape) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    rank = len(shape)
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    return np.array(shape[slice(start, end)], dtype=np.int64)


def _evaluate(model, node, constants, where="model") -> list[np.ndarray]:
    """Run one node on constant inputs with the ONNX reference evaluator, at the model's opset."""
    from onnx.reference import ReferenceEvaluator

    feeds = {name: numpy_helper.to_array(constants[name]) for name in node.input if name}
    inputs = [helper.make_tensor_value_info(name, constants[name].data_type, None) for name in feeds]
    outputs = [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o]
    tiny = helper.make_model(
        helper.make_graph([node], "fold", inputs, outputs),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
    )
    try:
        return list(ReferenceEvaluator(tiny).run(None, feeds))
    except Exception as exc:
        raise ModelError(
            f"{where}: node {node.name or node.op_type!r} ({node.op_type}) could not be folded to a constant: {exc}"
        ) from None


def _remove_pass_through(model) -> None:
    g = model.graph
    outputs = {o.name for o in g.output}
    graph_inputs = {i.name for i in g.input}
    rename: dict[str, str] = {}
    keep = []
    for node in g.node:
        if node.op_type in _PASS_THROUGH and node.input and node.output:
            src = rename.get(node.input[0], node.input[0])
            dst = node.output[0]
            extra = [o for o in node.output[1:] if o]
            if extra and any(o in outputs for o in extra):
                keep.append(node)  # a Dropout mask used as a graph output: leave it
                continue
            if dst not in outputs:
                rename[dst] = src
                continue
            if src not in graph_inputs and src not in outputs:
                # the graph output keeps its name: rename the producer's output instead
                rename[src] = dst
                for prev in keep:
                    prev.output[:] = [dst if o == src else o for o in prev.output]
                for prev in keep:
                    prev.input[:] = [dst if i == src else i for i in prev.input]
                continue
            keep.append(node)
            continue
        node.input[:] = [rename.get(i, i) for i in node.input]
        keep.append(node)
    for node in keep:
        node.input[:] = [rename.get(i, i) for i in node.input]
    del g.node[:]
    g.node.extend(keep)


def _prune(model) -> None:
    """Drop nodes and initializers that no graph output depends on."""
    g = model.graph
    needed = {o.name for o in g.output}
    live = []
    for node in reversed(g.node):
        if any(o in needed for o in node.output if o):
            live.append(node)
            needed.update(i for i in node.input if i)
    live.reverse()
    del g.node[:]
    g.node.extend(live)
    inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)
    vis = [v for v in g.value_info if v.name in needed]
    del g.value_info[:]
    g.value_info.extend(vis)


def _toposort(model, where) -> None:
    g = model.graph
    available = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    available |= {n.output[0] for n in g.node if n.op_type == "Constant"}
    pending = list(g.node)
    ordered = []
    while pending:
        progressed = False
        rest = []
        for node in pending:
            if all(i in available for i in node.input):
                ordered.append(node)
                available.update(node.output)
                progressed = True
            else:
                rest.append(node)
        if not progressed:
            node = rest[0]
            missing = [i for i in node.input if i not in available]
            raise ModelError(f"{where}: node {node.name or node.op_type!r} ({node.op_type}) reads {missing[0]!r}, which nothing produces")
        pending = rest
    del g.node[:]
    g.node.extend(ordered)


def _name_nodes(model) -> None:
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)


def _check_static(model, where) -> None:
    shapes = _static_shape(model)
    for node in model.graph.node:
        for out in node.output:
            if out and out not in shapes:
                raise ModelError(
                    f"{where}: node {node.name!r} ({node.op_type}): output {out!r} has no static shape after "
                    f"normalisation; the DLA and the planner need every shape known at build time"
                )
