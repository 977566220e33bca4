"""What a model runs with, resolved one way for every command and the daemon: its card, its input
shape, its labels and the calibration set beside it.

``inspect``, ``plan``, ``build``, ``infer``, ``eval``, ``pareto-sweep``, ``cloud curve``, ``card show``,
``watch`` and the daemon's ``[[models]]`` all go through these functions, so a dynamic export that one
of them takes without ``--input-shape`` every one of them takes.

The card layers, least specific first: defaults < Ultralytics metadata < k2edge's ``k2edge.preprocess``
metadata < the card file (``--card``, else ``<stem>.card.toml`` or ``card.toml`` beside the model) < the
daemon config's card table (see :func:`~k2edge.config.card.resolve_card`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from ..errors import BuildError
from ..readfile import MIB, read_small
from .card import BOX_TASKS, LABELS_METADATA_KEY, ModelCard, card_sources, check_size, find_card, load_card, resolve_card

if TYPE_CHECKING:
    import onnx

    from ..model.ingest import NormalisedModel

__all__ = ["card_file", "card_task", "declared_inputs", "find_calibration", "input_shapes", "load_labels", "model_card",
           "value_dims"]

log = logging.getLogger(__name__)

InputShapes = dict[str, tuple[int, ...]]


def card_file(model_path: Path | None, card: str | os.PathLike | ModelCard | None = None) -> ModelCard | None:
    """The card given (a file or a card), else the one beside the model (``<stem>.card.toml``, ``card.toml``), else None."""
    if isinstance(card, ModelCard):
        return card
    if card is not None:
        return load_card(card)
    found = find_card(model_path)
    if found is not None:
        if str(found) not in _announced:  # once a process: the daemon loads a model for each of its profiles
            _announced.add(str(found))
            log.info("using the model card beside the model: %s", found)
        return load_card(found)
    return None


_announced: set[str] = set()


def value_dims(value: "onnx.ValueInfoProto") -> tuple[int | None, ...]:
    """A graph value's dims: None for a dynamic one."""
    return tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in value.type.tensor_type.shape.dim)


def declared_inputs(model: "onnx.ModelProto") -> dict[str, tuple[int | None, ...]]:
    """The model's declared inputs (initializers listed as inputs left out), in order: name -> :func:`value_dims`."""
    inits = {t.name for t in model.graph.initializer}
    return {i.name: value_dims(i) for i in model.graph.input if i.name not in inits}


def input_shapes(model: "onnx.ModelProto", card: ModelCard | None, batch_size: int, given: InputShapes | None = None,
                 overrides: ModelCard | Mapping | None = None) -> InputShapes | None:
    """The static input shapes a model is normalised with.

    ``given`` (``--input-shape``) when there is one; else, for a single image input whose height or width
    is dynamic (an export with dynamic axes), ``[batch_size, C, H, W]`` (or NHWC) with the size of the card
    the model runs with: the card table, the card file, then the model's metadata (k2edge's, then
    Ultralytics' ``imgsz``). None when nothing is dynamic or no size is known (normalising then says
    which input needs ``--input-shape``).

    Raises:
        CardError: the size is off the model's stride (Ultralytics' ``stride``, else the largest
            downsampling a detector's graph shows), or the card contradicts the model.
    """
    if given:
        return {name: tuple(shape) for name, shape in dict(given).items()}
    inputs = declared_inputs(model)
    if len(inputs) != 1 or len(dims := next(iter(inputs.values()))) != 4:
        return None
    if all(dims[1:]):
        return None  # only the batch can be dynamic: normalising gives it batch_size
    name = next(iter(inputs))
    metadata = {p.key: p.value for p in model.metadata_props}
    resolved = resolve_card(name, dims, metadata, card, overrides, (name,))
    size = resolved.input.size
    if size is None:
        return None
    h_ax, w_ax, c_ax = (2, 3, 1) if resolved.input.layout == "NCHW" else (1, 2, 3)
    if dims[h_ax] and dims[w_ax]:
        return None
    if resolved.task in BOX_TASKS:
        # before the graph is fixed to this size: a size off the stride fails deep in shape inference.
        # Only detectors' feature pyramids need it (a classifier's global pooling takes any size).
        from ..model.stride import graph_stride

        source = card_sources(dims, metadata, card, overrides).get("input.size", "model metadata")
        check_size(tuple(size), metadata, source, graph_stride(model))
    shape = [batch_size] * 4
    shape[h_ax], shape[w_ax] = size
    shape[c_ax] = dims[c_ax] or resolved.input.channels or 3
    return {name: tuple(shape)}


def card_task(model_path: Path, card: str | os.PathLike | ModelCard | None = None) -> str | None:
    """The task the model's card gives (as :func:`model_card` layers it), read from the file without
    building anything: for refusing a misused model before its engines take minutes to build. None
    when it cannot be told here (an unreadable model or card): the build then says why.

    Args:
        model_path: the ONNX file.
        card: a ``[[models]]`` entry's ``card``: a card file (replacing the one beside the model), or a
            card table (layered over it).
    """
    import onnx

    overrides = card if isinstance(card, ModelCard) else None
    card = None if overrides is not None else card
    try:
        model = onnx.load(str(model_path), load_external_data=False)
        inputs = declared_inputs(model)
        the_card = card_file(model_path, card)
        name = the_card.input.name if the_card is not None and the_card.input.name else next(iter(inputs))
        metadata = {p.key: p.value for p in model.metadata_props}
        return resolve_card(name, inputs[name], metadata, the_card, overrides, tuple(inputs)).task
    except Exception as exc:  # whatever it is (protobuf's DecodeError, a bad card), the build reports it properly
        log.debug("cannot tell %s's task before building it: %s", model_path, exc)
        return None


def model_card(model_path: Path | None, normalised: "NormalisedModel", card: str | os.PathLike | ModelCard | None = None,
               overrides: ModelCard | dict | None = None) -> ModelCard:
    """The card a model runs with: ``overrides`` > ``card`` (a file or a card; default the one found
    beside the model) > the model's metadata > defaults, checked against the normalised model's input."""
    card = card_file(model_path, card)
    graph = normalised.graph
    name = graph.inputs[0]
    return resolve_card(name, graph.shape(name), normalised.metadata(), card, overrides, tuple(graph.inputs))


MAX_LABELS_BYTES = 16 * MIB  # 1,000 ImageNet labels are 30 KiB


def load_labels(model_path: Path | None, model: "NormalisedModel", override: str | os.PathLike | None = None,
                card: ModelCard | None = None) -> tuple[str, ...]:
    """Labels from ``override``, else the card's ``labels``, else the file the model's metadata names,
    else ``labels.txt`` beside the model, else an Ultralytics export's own class names."""
    candidates = []
    if override:
        candidates.append(Path(override))
    elif card is not None and card.labels:
        candidates.append(Path(card.labels))
    elif model_path is not None:
        named = model.metadata().get(LABELS_METADATA_KEY)
        if named:
            candidates.append(model_path.parent / named)
        candidates.append(model_path.parent / "labels.txt")
    for c in candidates:
        if c.is_file():
            try:
                text = read_small(c, MAX_LABELS_BYTES).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BuildError(f"labels file {str(c)!r} is not UTF-8 text (byte {exc.start}): one label a line") from None
            except OSError as exc:
                raise BuildError(f"labels file {str(c)!r} cannot be read ({exc.strerror})") from None
            labels = tuple(line.strip() for line in text.splitlines() if line.strip())
            if not labels:
                raise BuildError(f"labels file {str(c)!r} is empty: one label a line, in the model's class order")
            return labels
    missing = "is a directory" if candidates and candidates[0].is_dir() else "does not exist"
    if override:
        raise BuildError(f"labels file {str(override)!r} {missing}")
    if card is not None and card.labels:
        raise BuildError(f"{card.source or 'card'}: labels: file {card.labels!r} {missing}")
    from .ultralytics import UltralyticsMetadataError, read_ultralytics

    try:  # an Ultralytics export names its classes itself
        return read_ultralytics(model.metadata()).names or ()
    except UltralyticsMetadataError:
        return ()


def find_calibration(model_path: Path | None) -> Path | None:
    """A calibration set shipped beside the model (``calib/`` or ``calib.npz``), if any."""
    if model_path is None:
        return None
    for name in ("calib", "calib.npz"):
        if (model_path.parent / name).exists():
            return model_path.parent / name
    return None
