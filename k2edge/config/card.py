"""The model card (``card.toml`` beside the model): what a model is and how to feed it.

The contract (every key optional; a card names only what differs from what the model says)::

    task = "detection"                 # classification | detection | segmentation | pose | obb | tensor
    labels = "labels.txt"              # one label per line, relative to the card
    [input]
    name = "images"                    # default: the model's only input
    size = [320, 320]                  # [height, width], as in NCHW
    resize = "letterbox"               # stretch | letterbox | pad-right | center-crop
    interpolation = "linear"           # linear | area | nearest (OpenCV's) | antialias (Pillow's, the default)
    jpeg_draft = false                 # Pillow's reduced-size JPEG decoding (default: true with antialias only)
    pad_value = 114                    # 0..255
    color = "RGB"                      # RGB | BGR | L
    scale = 0.00392156862745098        # x = pixel * scale, then (x - mean) / std per channel
    mean = [0.0, 0.0, 0.0]
    std = [1.0, 1.0, 1.0]
    [classification]
    output = "logits"                  # logits | probabilities
    [detection]                        # also segmentation, pose and obb (their boxes)
    format = "yolov8"                  # yolov8 (also YOLO11) | yolov5 | end2end ([N, K, 6+], already NMS'd)
    score_threshold = 0.25
    iou_threshold = 0.45
    max_detections = 100
    class_agnostic_nms = false
    [pose]
    keypoints = ["nose", ...]          # names (COCO's 17 by default for 17 keypoints)
    sigmas = [0.026, ...]              # OKS sigmas (COCO's for the 17)
    [quantization]
    keep_float = ["/model.22/dfl/conv/Conv"]   # nodes kept out of INT8 besides a detector's head
    float_head = "decoding"            # decoding (DFL, box arithmetic, final concat, sigmoid) | branches (+ the Detect module)
    method = "max"                     # auto | max | percentile | mse | search (overrides the profile's edge_runtime.calibration)
    percentile = 99.99                 # for method = "percentile"
    tolerance = { recall = 0.97 }      # the INT8 check's minimum per measure (overrides edge_runtime.int8_tolerance)

Where several sources speak the most specific wins, key by key: the daemon config's per-model
settings, then the card, then the model's own ONNX metadata (``k2edge.preprocess``, which stores
``size`` width first: :func:`metadata_layer` converts it, here and nowhere else), then defaults
derived from the model's input shape. Below k2edge's own metadata sits Ultralytics' export metadata
(``task``, ``names``, ``imgsz`` [h, w], ``stride``, ``kpt_shape``: :func:`ultralytics_layer`).
:func:`resolve_card` does the layering and checks the result against the model (a ``size``
contradicting a static input, or not a multiple of the stride, is refused).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import K2EdgeError
from ..profile.validation import describe_validation_error, model_keys

__all__ = [
    "CardError",
    "ClassificationSpec",
    "DetectionSpec",
    "InputSpec",
    "ModelCard",
    "PoseSpec",
    "BOX_TASKS",
    "card_sources",
    "metadata_size",
    "check_size",
    "QuantizationSpec",
    "CARD_NAME",
    "METADATA_KEY",
    "find_card",
    "load_card",
    "metadata_layer",
    "resolve_card",
    "card_from_dict",
    "card_keys",
]

CARD_NAME = "card.toml"
METADATA_KEY = "k2edge.preprocess"
LABELS_METADATA_KEY = "k2edge.labels"
Task = Literal["classification", "detection", "segmentation", "pose", "obb", "tensor"]
#: tasks whose answers are boxes decoded by ``[detection]`` (each adds its own part to a box)
BOX_TASKS = ("detection", "segmentation", "pose", "obb")


class CardError(K2EdgeError):
    """A model card is missing, not TOML, invalid (the message names the key), or contradicts the model."""


class _Strict(BaseModel):
    # strict: a TOML string is never coerced into a number ("320" is refused); ints still pass as floats
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _finite(v: float) -> float:
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"must be a finite number, got {v}")
    return v


def _channels(color: str | None) -> int | None:
    return None if color is None else (1 if color == "L" else 3)


class InputSpec(_Strict):
    """How an image becomes the model input.

    Attributes:
        name: the model input fed (default: the model's only input).
        size: ``[height, width]`` of the model input.
        resize: ``stretch`` (to size, ignoring the ratio), ``letterbox`` (keep the ratio, centred
            padding, as YOLO exports expect), ``pad-right`` (keep the ratio, pad right and bottom) or
            ``center-crop`` (the short side to the size, then the centre cut out: torchvision's
            ``Resize(size)`` + ``CenterCrop(size)``, as Ultralytics' classifiers).
        pad_value: the pixel value (0..255, before scale/mean/std) of the padding.
        color: ``RGB``, ``BGR`` (channels reversed) or ``L`` (one grey channel).
        scale: ``x = pixel * scale``, then ``(x - mean) / std`` per channel.
        mean / std: one value per channel (or one for all).
        layout: ``NCHW`` (default) or ``NHWC``.
        interpolation: how the image is resized: ``linear`` (OpenCV's ``INTER_LINEAR``: half-pixel
            centres, no antialiasing; what Ultralytics trains with), ``area`` (``INTER_AREA``),
            ``nearest`` (``INTER_NEAREST``) or ``antialias`` (Pillow's antialiased bilinear: the default).
        jpeg_draft: let Pillow's JPEG decoder scale down (1/2 .. 1/8) before the resize; default
            true with ``antialias``, false otherwise (an OpenCV pipeline decodes at full size).
    """

    name: str | None = None
    size: tuple[int, int] | None = None
    resize: Literal["stretch", "letterbox", "pad-right", "center-crop"] = "stretch"
    pad_value: int = Field(114, ge=0, le=255)
    color: Literal["RGB", "BGR", "L"] | None = None
    scale: float = 1 / 255
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    interpolation: Literal["linear", "area", "nearest", "antialias"] = "antialias"
    jpeg_draft: bool | None = None

    @property
    def draft(self) -> bool:
        """Whether JPEGs decode in Pillow's draft mode (``jpeg_draft``, else true only with ``antialias``)."""
        return self.interpolation == "antialias" if self.jpeg_draft is None else self.jpeg_draft

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, v):
        if v is None:
            return v
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            raise ValueError(f"must be [height, width], got {v!r}")
        if any(isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 16384 for d in v):
            raise ValueError(f"must be two whole numbers within [1, 16384] ([height, width]), got {v!r}")
        return tuple(v)

    @field_validator("scale")
    @classmethod
    def _scale(cls, v):
        _finite(v)
        if v <= 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _per_channel(cls, v, info):
        if not isinstance(v, (list, tuple)) or len(v) not in (1, 3):
            raise ValueError(f"must be a list of 1 or 3 numbers (one per channel), got {v!r}")
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v):
            raise ValueError(f"must be numbers, got {v!r}")
        for x in v:
            _finite(float(x))
        if info.field_name == "std" and any(x <= 0 for x in v):
            raise ValueError(f"every value must be > 0 (it divides), got {list(v)}")
        # checked here rather than on the card, so the error is located at input.mean / input.std
        color = info.data.get("color")  # validated before mean and std (declared above them); absent if invalid
        ch = _channels(color)
        if ch is not None and len(v) not in (1, ch):
            raise ValueError(f"color {color} has {ch} channel(s); give {'1 value' if ch == 1 else f'1 or {ch} values'}, "
                             f"got {len(v)}")
        return tuple(float(x) for x in v)

    @property
    def channels(self) -> int | None:
        return _channels(self.color)


class ClassificationSpec(_Strict):
    """How a classifier's output reads: ``logits`` (softmax applied) or ``probabilities`` (as is)."""

    output: Literal["logits", "probabilities"] = "logits"
    output_name: str | None = Field(None, description="the model output holding the scores; default the first")


class DetectionSpec(_Strict):
    """How a detector's output decodes.

    Attributes:
        format: ``yolov8`` ([N, 4 + classes (+ extra), anchors], cx cy w h in input pixels, sigmoid
            class scores, no objectness; YOLOv8 and YOLO11), ``yolov5`` ([N, anchors, 5 + classes],
            objectness x class score) or ``end2end`` ([N, K, 6 (+ extra)]: x1 y1 x2 y2 score class,
            already NMS'd; YOLOv10 and ``nms=True`` exports).
        score_threshold: a box is kept when its score reaches this.
        iou_threshold: NMS suppresses a box overlapping a better one by more than this.
        max_detections: at most this many boxes per image after NMS.
        class_agnostic_nms: one NMS over all classes instead of one per class.
        max_candidates: at most this many boxes (highest scores first) enter NMS, so a model that
            passes everything stays bounded.
        output_name: the model output holding the predictions; default the first.
    """

    format: Literal["yolov8", "yolov5", "end2end"] = "yolov8"
    score_threshold: float = Field(0.25, ge=0, le=1)
    iou_threshold: float = Field(0.45, gt=0, le=1)
    max_detections: int = Field(100, ge=1, le=100_000)
    class_agnostic_nms: bool = False
    max_candidates: int = Field(1000, ge=1, le=1_000_000)
    output_name: str | None = None


class PoseSpec(_Strict):
    """Keypoint names (their count is the model's), OKS sigmas (default 1 / count each; COCO's for COCO's 17)
    and values per keypoint (3: x, y, visibility; 2: x, y) of a pose model."""

    keypoints: tuple[str, ...] | None = None
    sigmas: tuple[float, ...] | None = None
    dims: Literal[2, 3] = Field(3, description="values per keypoint in the output: x, y (and a visibility score)")

    @field_validator("keypoints", mode="before")
    @classmethod
    def _kp_names(cls, v):
        if v is None:
            return v
        if not isinstance(v, (list, tuple)) or any(not isinstance(x, str) or not x for x in v):
            raise ValueError("must be a list of keypoint names")
        return tuple(v)

    @field_validator("sigmas", mode="before")
    @classmethod
    def _kp_sigmas(cls, v):
        if v is None:
            return v
        if not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0
                                                   for x in v):
            raise ValueError("must be a list of numbers > 0")
        return tuple(float(x) for x in v)

    @model_validator(mode="after")
    def _same_length(self):
        if self.keypoints is not None and self.sigmas is not None and len(self.keypoints) != len(self.sigmas):
            raise ValueError(f"{len(self.keypoints)} keypoint name(s) but {len(self.sigmas)} sigma(s)")
        return self


class QuantizationSpec(_Strict):
    """INT8 settings: ``keep_float`` names nodes kept in FP16/FP32 besides a detector's float head, which is its
    decoding (``float_head = "decoding"``) or that and the decoupled branches behind it (``"branches"``: the whole
    Detect module of an Ultralytics export); ``method``/``percentile`` and ``tolerance`` override the profile's
    ``edge_runtime.calibration`` and ``edge_runtime.int8_tolerance``."""

    keep_float: tuple[str, ...] = ()
    float_head: Literal["decoding", "branches"] = "decoding"
    method: Literal["auto", "max", "percentile", "mse", "search"] | None = None
    percentile: float | None = None
    tolerance: dict[str, float] | None = None

    @field_validator("percentile", mode="before")
    @classmethod
    def _pct(cls, v):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 50.0 < v <= 100.0):
            raise ValueError(f"must be a number within (50, 100], got {v!r}")
        return None if v is None else float(v)

    @field_validator("tolerance", mode="before")
    @classmethod
    def _tol(cls, v):
        from ..profile.schema import _tolerance_table

        return None if v is None else _tolerance_table(v)

    @field_validator("keep_float", mode="before")
    @classmethod
    def _names(cls, v):
        if not isinstance(v, (list, tuple)) or any(not isinstance(x, str) or not x for x in v):
            raise ValueError(f"must be a list of node names, got {v!r}")
        return tuple(v)


class ModelCard(_Strict):
    """A model card. ``labels`` is resolved against the card's directory when loaded from a file."""

    task: Task = "classification"
    labels: str | None = None
    input: InputSpec = Field(default_factory=InputSpec)
    classification: ClassificationSpec = Field(default_factory=ClassificationSpec)
    detection: DetectionSpec = Field(default_factory=DetectionSpec)
    pose: PoseSpec = Field(default_factory=PoseSpec)
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    source: str | None = Field(None, exclude=True, description="where the card came from, for messages")

    @property
    def labels_path(self) -> Path | None:
        return Path(self.labels) if self.labels else None

    def layer(self) -> dict:
        """The keys this card sets (explicitly), as nested data for layering."""
        return self.model_dump(exclude_unset=True, exclude={"source"})

    def to_toml(self) -> str:
        """The card as TOML, every key of its task spelled out (what ``k2edge card init`` writes)."""
        d = self.model_dump(mode="json", exclude={"source"})
        for table in ("classification", "detection"):  # only the task's own table
            if self.task != table and not (table == "detection" and self.task in BOX_TASKS):
                d.pop(table)
        if self.task != "pose" or (self.pose.keypoints is None and self.pose.sigmas is None):
            d.pop("pose")
        if self.quantization == QuantizationSpec():
            d.pop("quantization")
        else:
            d["quantization"] = {k: v for k, v in d["quantization"].items() if v not in (None, [], ())}
        lines = [f"task = {_toml(d.pop('task'))}"]
        if d.get("labels"):
            lines.append(f"labels = {_toml(d.pop('labels'))}")
        d.pop("labels", None)
        for table, values in d.items():
            lines.append(f"\n[{table}]")
            lines.extend(f"{k} = {_toml(v)}" for k, v in values.items() if v is not None)
        return "\n".join(lines) + "\n"


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return repr(v)


def card_keys(prefix: tuple = ()) -> dict[tuple, list[str]]:
    """The card's keys per table, for 'unknown key' hints (``source`` is not a key)."""
    keys = model_keys(ModelCard, prefix)
    keys[prefix] = [k for k in keys[prefix] if k != "source"]
    return keys


def card_from_dict(data: object, source: str = "card", base: Path | None = None) -> ModelCard:
    """Validate a decoded card; relative ``labels`` resolve against ``base``.

    Raises:
        CardError: naming the key path of every problem (``card.toml: input.resize: must be one of ...``).
    """
    if not isinstance(data, dict):
        raise CardError(f"{source}: must be a table of card keys (task, labels, [input], ...)")
    data = dict(data)
    if "source" in data:  # where a card came from is ours to record, not a key
        known = ", ".join(card_keys()[()])
        raise CardError(f"{source}: source: unknown key (known keys: {known})")
    labels = data.get("labels")
    if base is not None and isinstance(labels, str) and labels and not os.path.isabs(labels):
        data["labels"] = str(base / labels)
    try:
        card = ModelCard.model_validate(data)
    except ValidationError as exc:
        raise CardError(f"{source}: {describe_validation_error(exc, card_keys(), toml=True)}") from None
    return card.model_copy(update={"source": source})


def load_card(path: str | os.PathLike) -> ModelCard:
    """Read and validate a card file.

    Raises:
        CardError: the file is missing, not TOML, or a key is invalid (the message names it).
    """
    from .toml import read_toml

    p = Path(path)
    data = read_toml(p, CardError, f"card {str(p)!r} does not exist")
    return card_from_dict(data, str(p), p.resolve().parent)


def find_card(model_path: str | os.PathLike | None) -> Path | None:
    """The card beside a model: ``<model-stem>.card.toml`` first, then ``card.toml``; None if neither."""
    if model_path is None:
        return None
    model = Path(model_path)
    for candidate in (model.with_name(f"{model.stem}.card.toml"), model.with_name(CARD_NAME)):
        if candidate.is_file():
            return candidate
    return None


def metadata_layer(metadata: Mapping[str, str]) -> dict:
    """The card keys a model's own ``k2edge.preprocess`` metadata sets.

    The metadata stores ``size`` as [width, height] (Pillow's order); cards use [height, width].

    Raises:
        CardError: the metadata is malformed.
    """
    raw = metadata.get(METADATA_KEY)
    if not raw:
        return {}
    try:
        spec = json.loads(raw)
        if not isinstance(spec, dict):
            raise ValueError("not a JSON object")
        layer: dict = {}
        for key in ("color", "scale", "mean", "std", "layout"):
            if key in spec:
                layer[key] = spec[key]
        if "size" in spec:
            width, height = spec["size"]
            layer["size"] = [height, width]
        card = card_from_dict({"input": layer}, f"model metadata {METADATA_KEY!r}")
    except CardError:
        raise
    except (ValueError, TypeError) as exc:
        raise CardError(f"model metadata {METADATA_KEY!r} is malformed: {exc}") from None
    return card.layer()


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_card(
    input_name: str,
    input_shape: tuple,
    metadata: Mapping[str, str] | None = None,
    card: ModelCard | None = None,
    overrides: ModelCard | Mapping | None = None,
    input_names: tuple[str, ...] | None = None,
) -> ModelCard:
    """The card a model runs with: overrides > card > the model's metadata > defaults.

    Args:
        input_name: the model input fed (its only input).
        input_shape: that input's shape (dims may be ints, or None/strings when dynamic).
        metadata: the model's ``metadata_props``.
        card: the card file's card (explicit ``--card``, or the one found beside the model).
        overrides: the daemon config's per-model card table (or a card) on top.
        input_names: every model input, to check ``input.name``.

    Raises:
        CardError: the layers contradict the model (size, channels, input name), naming the source.
    """
    merged: dict = {}
    for _, layer in _layers(input_shape, metadata, card, overrides):
        merged = _merge(merged, layer)
    source = (overrides.source if isinstance(overrides, ModelCard) and overrides.source else
              "the daemon config's card table" if overrides is not None else
              card.source if card is not None and card.source else f"model metadata {METADATA_KEY!r}")
    result = card_from_dict(merged, source)
    _check_against_model(result, input_name, input_shape, input_names, source)
    _check_stride(result, metadata or {}, source)
    return result.model_copy(update={"source": card.source if card is not None else None})


def _ultralytics(metadata: Mapping[str, str] | None) -> dict:
    from .ultralytics import UltralyticsMetadataError, ultralytics_layer

    try:
        layer = ultralytics_layer(metadata)
        return card_from_dict(layer, "Ultralytics metadata").layer() if layer else {}
    except UltralyticsMetadataError as exc:
        raise CardError(str(exc)) from None


def metadata_size(metadata: Mapping[str, str] | None) -> tuple[int, int] | None:
    """``[height, width]`` the model's metadata gives (k2edge's, else Ultralytics' ``imgsz``), or None."""
    for layer in (metadata_layer(metadata or {}), _ultralytics(metadata)):
        size = (layer.get("input") or {}).get("size")
        if size:
            return tuple(size)
    return None


def _layers(input_shape, metadata, card, overrides) -> list[tuple[str, dict]]:
    """(source name, card keys) from the least to the most specific."""
    layers = [("defaults", _default_layer(input_shape)), ("Ultralytics metadata", _ultralytics(metadata)),
              (f"model metadata {METADATA_KEY!r}", metadata_layer(metadata or {}))]
    if card is not None:
        layers.append((card.source or "card", card.layer()))
    if overrides is not None:
        over = overrides if isinstance(overrides, ModelCard) else card_from_dict(dict(overrides), "model settings")
        layers.append((over.source if isinstance(overrides, ModelCard) and over.source else "daemon config", over.layer()))
    return layers


def card_sources(input_shape: tuple, metadata: Mapping[str, str] | None = None, card: ModelCard | None = None,
                 overrides: ModelCard | Mapping | None = None) -> dict[str, str]:
    """Where each card value set by someone comes from: ``{"input.size": "Ultralytics metadata", ...}``
    (keys no source sets are the card's defaults)."""
    out: dict[str, str] = {}

    def walk(d: dict, prefix: str, source: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.", source)
            else:
                out[f"{prefix}{k}"] = source

    for source, layer in _layers(input_shape, metadata, card, overrides):
        walk(layer, "", source)
    return out


_WARNED: set = set()


def _check_stride(card: ModelCard, metadata: Mapping[str, str], source: str) -> None:
    if card.input.size is not None:
        check_size(tuple(card.input.size), metadata, source)


def check_size(size: tuple[int, int], metadata: Mapping[str, str], source: str, graph_stride: int | None = None) -> None:
    """A ``[height, width]`` the model's stride (Ultralytics metadata, else ``graph_stride``: the largest
    downsampling the graph shows) does not divide is refused, naming the nearest valid sizes; one other
    than the size it was trained at (``imgsz``) is warned about.

    Raises:
        CardError: the size is not a multiple of the stride.
    """
    from .ultralytics import read_ultralytics

    try:
        meta = read_ultralytics(metadata)
    except ValueError:
        return  # reported by _ultralytics
    h, w = size
    stride = meta.stride or graph_stride
    if stride and stride > 1 and (h % stride or w % stride):
        s = stride

        def near(d: int) -> str:
            lo, hi = d // s * s, (d // s + 1) * s
            return str(d) if d % s == 0 else (f"{lo} or {hi}" if lo else str(hi))
        where = "" if meta.stride else " (the largest downsampling its graph shows)"
        raise CardError(f"{source}: input.size: {[h, w]} ([height, width]) is not a multiple of the model's "
                        f"stride {s}{where}: use height {near(h)}, width {near(w)}")
    if meta.imgsz and (h, w) != tuple(meta.imgsz) and ((h, w), meta.imgsz) not in _WARNED:
        import logging

        _WARNED.add(((h, w), meta.imgsz))  # once per process, not once per resolution
        logging.getLogger("k2edge.card").warning(
            "input.size %s differs from the size the model was trained at, %s (Ultralytics metadata 'imgsz'); "
            "accuracy may suffer", [h, w], list(meta.imgsz))


def _default_layer(shape: tuple) -> dict:
    """Defaults from the input shape: NCHW with 1 or 3 channels is an image (L / RGB) of its H x W."""
    if len(shape) == 4 and shape[1] in (1, 3) and all(isinstance(d, int) and d > 0 for d in shape[2:]):
        return {"input": {"color": "L" if shape[1] == 1 else "RGB", "size": [shape[2], shape[3]]}}
    return {}


def _check_against_model(card: ModelCard, name: str, shape: tuple, names, source: str) -> None:
    spec = card.input
    if spec.name is not None and names is not None and spec.name not in names:
        raise CardError(f"{source}: input.name: the model has no input {spec.name!r} (inputs: {', '.join(names)})")
    if spec.size is None:
        return  # tensors only
    if len(shape) != 4:
        raise CardError(f"{source}: input.size: input {name!r} of shape {list(shape)} is not an image batch "
                        f"({spec.layout}); remove [input] size or use task = \"tensor\" with .npy inputs")
    h_dim, w_dim, c_dim = (2, 3, 1) if spec.layout == "NCHW" else (1, 2, 3)
    for axis, want, what in ((h_dim, spec.size[0], "height"), (w_dim, spec.size[1], "width")):
        dim = shape[axis]
        if isinstance(dim, int) and dim > 0 and dim != want:
            raise CardError(f"{source}: input.size: {list(spec.size)} ([height, width]) contradicts the model's static "
                            f"input {name!r} {list(shape)} ({spec.layout}): {what} is {dim}, not {want}")
    ch = shape[c_dim]
    if spec.channels is not None and isinstance(ch, int) and ch > 0 and ch != spec.channels:
        raise CardError(f"{source}: input.color: {spec.color} gives {spec.channels} channel(s) but input {name!r} "
                        f"{list(shape)} has {ch}")
