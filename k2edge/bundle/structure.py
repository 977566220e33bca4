"""Does the ONNX model fit what its card, labels and profiles say about it? (``structure_mismatch``)

A pure check on bytes already verified against the manifest: the model's declared graph inputs and
outputs (no normalisation, no session) against the card (validated by the card schema, layered over
the model's own metadata and checked by :func:`~k2edge.config.card.resolve_card` as the engine does
at load: input name, size ``[height, width]``, colour channels), the task's output layout, the
labels' count, and each profile's batch size. Dimensions the model leaves dynamic cannot contradict
anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


from ..config.card import CardError, ModelCard, card_from_dict, resolve_card
from ..config.resolve import declared_inputs, value_dims
from ..errors import K2EdgeError
from ..model.ingest import load_onnx
from ..profile import Profile

__all__ = ["ModelIO", "model_io", "read_card", "structure_problem"]


def read_card(text: str, source: str = "card.toml") -> ModelCard:
    """Parse and validate a bundle's card with the card schema (every key checked, as at load).

    ``labels`` stays relative to the card: the structure check reads the manifest's labels file.

    Raises:
        ValueError: not TOML, or a key is invalid (the message names the file and the key).
    """
    from ..config.toml import TOMLDecodeError, loads

    try:
        data = loads(text)
    except TOMLDecodeError as exc:
        raise ValueError(f"{source}: not valid TOML ({exc})") from None
    try:
        return card_from_dict(data, source)
    except CardError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class ModelIO:
    """The model's graph inputs and outputs: name -> dims (None for a dynamic dimension)."""

    inputs: dict[str, tuple[int | None, ...]]
    outputs: dict[str, tuple[int | None, ...]]
    metadata: dict[str, str] = field(default_factory=dict)


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
    outputs = {o.name: value_dims(o) for o in model.graph.output}
    return ModelIO(declared_inputs(model), outputs, {p.key: p.value for p in model.metadata_props})


def _fmt(dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def structure_problem(io: ModelIO, card: ModelCard | None, labels: list[str] | None,
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
    if card is not None and card.input.name is not None:
        if card.input.name not in io.inputs:
            return f"the card's input.name {card.input.name!r} is not an input of {model_name} (inputs: {', '.join(io.inputs)})"
        inp = card.input.name
    elif card is not None and len(io.inputs) > 1:
        return f"{model_name} has several inputs ({', '.join(io.inputs)}): the card must name one in input.name"
    else:
        inp = next(iter(io.inputs))
    dims = io.inputs[inp]
    if card is not None and card.task != "tensor":
        if len(dims) != 4:
            return f"the card describes an image input, but {model_name}'s input {inp!r} is {_fmt(dims)}, not {card.input.layout}"
        try:  # the card layered over the model's own metadata, checked as the engine checks it at load
            resolve_card(inp, dims, io.metadata, card, input_names=tuple(io.inputs))
        except CardError as exc:
            return str(exc)
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


def _output_problem(io: ModelIO, card: ModelCard | None, labels: list[str] | None, model_name: str) -> str | None:
    task = card.task if card is not None else "classification"
    if task == "tensor" or not io.outputs:
        return None
    output_name = getattr(card, task).output_name if card is not None else None
    if output_name is not None:
        if output_name not in io.outputs:
            return (f"the card's {task}.output_name {output_name!r} is not an output of {model_name} "
                    f"(outputs: {', '.join(io.outputs)})")
        out, dims = output_name, io.outputs[output_name]
    else:
        out, dims = next(iter(io.outputs.items()))
    if task == "detection":
        fmt = card.detection.format
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
