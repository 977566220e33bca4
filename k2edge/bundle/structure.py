"""Does the ONNX model fit what its card, labels and profiles say about it? (``structure_mismatch``)

A pure check on bytes already verified against the manifest: the model's declared graph inputs and
outputs (no normalisation, no session) against the card's input name, size ``[height, width]``,
colour channels and task layout, the labels' count, and each profile's batch size. Dimensions the
model leaves dynamic cannot contradict anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnx

from ..errors import K2EdgeError
from ..model.ingest import load_onnx
from ..profile import Profile

__all__ = ["CardFacts", "ModelIO", "card_facts", "model_io", "structure_problem"]


@dataclass(frozen=True)
class CardFacts:
    """What the structure check needs from a model card.

    Attributes:
        task: ``classification``, ``detection`` or ``tensor``.
        input_name: the input the card feeds (None: the model's only input).
        size: ``(height, width)`` of the model input.
        channels: 1 for ``color = "L"``, 3 for RGB/BGR, None when the card does not say.
        detection_format: ``yolov8`` or ``yolov5`` for detection cards.
        layout: ``NCHW`` or ``NHWC``.
        output_name: the output the task reads (None: the model's first).
    """

    task: str = "classification"
    input_name: str | None = None
    size: tuple[int, int] | None = None
    channels: int | None = None
    detection_format: str | None = None
    layout: str = "NCHW"
    output_name: str | None = None


def card_facts(text: str) -> CardFacts:
    """Read the structure-relevant keys of a card (the fixed card contract of issue 11).

    Interim: parses the TOML directly until ``k2edge.config.card.load_card`` lands on main; then
    this becomes a thin mapping from its ``ModelCard`` (and the card's full validation applies).

    Raises:
        ValueError: not TOML, or one of these keys has the wrong type or value (the message names it).
    """
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not valid TOML ({exc})") from None
    task = data.get("task", "classification")
    if task not in ("classification", "detection", "tensor"):
        raise ValueError(f"task: must be classification, detection or tensor, got {task!r}")
    inp = data.get("input", {})
    if not isinstance(inp, dict):
        raise ValueError("input: must be a table")
    name = inp.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"input.name: must be a string, got {name!r}")
    size = inp.get("size")
    if size is not None:
        if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
            raise ValueError(f"input.size: must be [height, width] in pixels, got {size!r}")
        size = (size[0], size[1])
    color = inp.get("color")
    channels = {"L": 1, "RGB": 3, "BGR": 3, None: None}.get(color, -1)
    if channels == -1:
        raise ValueError(f"input.color: must be RGB, BGR or L, got {color!r}")
    layout = inp.get("layout", "NCHW")
    if layout not in ("NCHW", "NHWC"):
        raise ValueError(f"input.layout: must be NCHW or NHWC, got {layout!r}")
    fmt = None
    table = data.get(task, {}) if task in ("classification", "detection") else {}
    if not isinstance(table, dict):
        raise ValueError(f"{task}: must be a table")
    if task == "detection":
        fmt = table.get("format", "yolov8")
        if fmt not in ("yolov8", "yolov5"):
            raise ValueError(f"detection.format: must be yolov8 or yolov5, got {fmt!r}")
    output = table.get("output_name")
    if output is not None and not isinstance(output, str):
        raise ValueError(f"{task}.output_name: must be a string, got {output!r}")
    return CardFacts(task, name, size, channels, fmt, layout, output)


@dataclass(frozen=True)
class ModelIO:
    """The model's graph inputs and outputs: name -> dims (None for a dynamic dimension)."""

    inputs: dict[str, tuple[int | None, ...]]
    outputs: dict[str, tuple[int | None, ...]]


def _dims(value_info: onnx.ValueInfoProto) -> tuple[int | None, ...]:
    shape = value_info.type.tensor_type.shape
    return tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in shape.dim)


def model_io(model_bytes: bytes) -> ModelIO:
    """Parse the model and list its declared inputs (initializers excluded) and outputs.

    Raises:
        ValueError: not an ONNX model.
    """
    try:
        model, _ = load_onnx(model_bytes)
    except K2EdgeError as exc:
        raise ValueError(str(exc)) from None
    if not model.graph.node:
        raise ValueError("not an ONNX model (no graph nodes)")
    initializers = {t.name for t in model.graph.initializer}
    inputs = {i.name: _dims(i) for i in model.graph.input if i.name not in initializers}
    outputs = {o.name: _dims(o) for o in model.graph.output}
    return ModelIO(inputs, outputs)


def _fmt(dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def structure_problem(io: ModelIO, card: CardFacts | None, labels: list[str] | None,
                      profiles: dict[str, Profile], model_name: str = "the model") -> str | None:
    """The first contradiction between the model's inputs/outputs and what the bundle says, or None.

    Args:
        io: from :func:`model_io`.
        card: the card's facts, when the bundle has a card.
        labels: the labels file's lines, when the bundle has one.
        profiles: profile path -> validated profile.
        model_name: the model file's name, for messages.
    """
    if not io.inputs:
        return f"{model_name} has no inputs"
    if card is not None and card.input_name is not None:
        if card.input_name not in io.inputs:
            return f"the card's input.name {card.input_name!r} is not an input of {model_name} (inputs: {', '.join(io.inputs)})"
        inp = card.input_name
    elif card is not None and len(io.inputs) > 1:
        return f"{model_name} has several inputs ({', '.join(io.inputs)}): the card must name one in input.name"
    else:
        inp = next(iter(io.inputs))
    dims = io.inputs[inp]
    image = card is None or card.task != "tensor"
    if card is not None and image:
        if len(dims) != 4:
            return f"the card describes an image input, but {model_name}'s input {inp!r} is {_fmt(dims)}, not {card.layout}"
        h_axis, w_axis, c_axis = (2, 3, 1) if card.layout == "NCHW" else (1, 2, 3)
        if card.size is not None:
            for axis, want, what in ((h_axis, card.size[0], "height"), (w_axis, card.size[1], "width")):
                if dims[axis] is not None and dims[axis] != want:
                    return (f"the card's input.size {list(card.size)} (height, width) contradicts {model_name}'s input "
                            f"{inp!r} {_fmt(dims)}: {what} {want} != {dims[axis]}")
        if card.channels is not None and dims[c_axis] is not None and dims[c_axis] != card.channels:
            return (f"the card's input.color needs {card.channels} channel(s), but {model_name}'s input {inp!r} "
                    f"{_fmt(dims)} has {dims[c_axis]}")
    problem = _output_problem(io, card, labels, model_name)
    if problem:
        return problem
    batch = dims[0] if dims else None
    for path, profile in profiles.items():
        want = profile.edge_runtime.batch_size
        if batch is not None and batch != want:
            return (f"profile {path} builds for batch_size {want}, but {model_name}'s input {inp!r} {_fmt(dims)} "
                    f"has a fixed batch of {batch}")
    return None


def _output_problem(io: ModelIO, card: CardFacts | None, labels: list[str] | None, model_name: str) -> str | None:
    task = card.task if card is not None else "classification"
    if task == "tensor" or not io.outputs:
        return None
    if card is not None and card.output_name is not None:
        if card.output_name not in io.outputs:
            return (f"the card's {task}.output_name {card.output_name!r} is not an output of {model_name} "
                    f"(outputs: {', '.join(io.outputs)})")
        out, dims = card.output_name, io.outputs[card.output_name]
    else:
        out, dims = next(iter(io.outputs.items()))
    if task == "detection":
        fmt = card.detection_format
        if len(dims) != 3:
            return f"a {fmt} detector's output is [N, ...] of rank 3; {model_name}'s output {out!r} is {_fmt(dims)}"
        axis, extra = (1, 4) if fmt == "yolov8" else (2, 5)
        if labels and dims[axis] is not None and dims[axis] - extra != len(labels):
            return (f"{model_name}'s output {out!r} {_fmt(dims)} holds {dims[axis] - extra} classes in the {fmt} layout, "
                    f"but the labels list {len(labels)}")
        return None
    # classification: [N, classes]; a card-less model with another layout is left to the daemon's own checks
    if len(dims) == 2 and labels and dims[1] is not None and dims[1] != len(labels):
        return f"{model_name}'s output {out!r} {_fmt(dims)} has {dims[1]} classes, but the labels list {len(labels)}"
    if card is not None and len(dims) != 2:
        return f"a classifier's output is [N, classes]; {model_name}'s output {out!r} is {_fmt(dims)}"
    return None


def parse_profile(data: bytes, path: str) -> Profile:
    """A profile file from a bundle.

    Raises:
        ValueError: not JSON or not a valid profile (the message names the field).
    """
    from ..errors import ProfileError

    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile {path} is not JSON ({exc})") from None
    try:
        profile = Profile.from_dict(body, source=f"profile {path}")
    except ProfileError as exc:
        raise ValueError(str(exc)) from None
    return profile


def parse_labels(data: bytes) -> list[str]:
    """Labels, one per line, blank lines skipped (as the engine reads them)."""
    return [line.strip() for line in data.decode("utf-8", errors="replace").splitlines() if line.strip()]
