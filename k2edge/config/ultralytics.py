"""Ultralytics' export metadata as a source of card values.

An Ultralytics ONNX export carries, in ``metadata_props``: ``task`` (detect | segment | pose |
classify | obb), ``names`` (a Python dict literal ``{0: 'person', ...}``), ``imgsz`` (``[h, w]``),
``stride``, ``batch``, ``kpt_shape`` (pose), and from recent versions ``end2end`` / ``nms``.
Nothing here is executed: literals are read with :func:`ast.literal_eval`, under a size cap.

The card these make is what Ultralytics' own predictor does: RGB, ``LetterBox`` (centred, pad 114,
OpenCV ``INTER_LINEAR``, the image decoded at full size), ``/ 255``; for a classifier torchvision's
``Resize`` + ``CenterCrop`` on a PIL image (Pillow's bilinear) instead.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Mapping

__all__ = ["COCO_KEYPOINTS", "COCO_SIGMAS", "UltralyticsMeta", "read_ultralytics", "ultralytics_layer"]

MAX_LITERAL_CHARS = 1_000_000  # a names dict of 10,000 long labels fits; anything larger is refused

COCO_KEYPOINTS = ("nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder",
                  "left_elbow", "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee",
                  "right_knee", "left_ankle", "right_ankle")
# pycocotools' / Ultralytics' OKS sigmas for COCO's 17 keypoints
COCO_SIGMAS = (0.026, 0.025, 0.025, 0.035, 0.035, 0.079, 0.079, 0.072, 0.072, 0.062, 0.062, 0.107, 0.107, 0.087,
               0.087, 0.089, 0.089)

_TASKS = {"detect": "detection", "segment": "segmentation", "pose": "pose", "classify": "classification",
          "obb": "obb"}


class UltralyticsMetadataError(ValueError):
    """A metadata value is not what Ultralytics writes (the message names the key)."""


@dataclass(frozen=True)
class UltralyticsMeta:
    """What an export's metadata says, parsed (None where it says nothing)."""

    task: str | None = None          # k2edge's name for it
    names: tuple[str, ...] | None = None
    imgsz: tuple[int, int] | None = None  # [height, width]
    stride: int | None = None
    kpt_shape: tuple[int, int] | None = None
    end2end: bool = False

    @property
    def present(self) -> bool:
        return self.task is not None or self.names is not None or self.imgsz is not None


def _literal(metadata: Mapping[str, str], key: str):
    raw = metadata.get(key)
    if raw is None:
        return None
    if len(raw) > MAX_LITERAL_CHARS:
        raise UltralyticsMetadataError(f"model metadata {key!r}: {len(raw):,} characters, more than the "
                                       f"{MAX_LITERAL_CHARS:,} read")
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise UltralyticsMetadataError(f"model metadata {key!r} is not a Python literal") from None


def read_ultralytics(metadata: Mapping[str, str] | None) -> UltralyticsMeta:
    """Parse an export's metadata; an export without Ultralytics' keys gives an empty :class:`UltralyticsMeta`.

    Raises:
        UltralyticsMetadataError: a key is malformed (named in the message).
    """
    md = metadata or {}
    if "names" not in md and "imgsz" not in md and md.get("task") not in _TASKS:
        return UltralyticsMeta()
    task = md.get("task")
    if task is not None and task not in _TASKS:
        raise UltralyticsMetadataError(f"model metadata 'task': {task[:40]!r} is none of {', '.join(_TASKS)}")
    names = _literal(md, "names")
    if names is not None:
        if isinstance(names, (list, tuple)):
            names = dict(enumerate(names))
        if not isinstance(names, dict) or any(not isinstance(k, int) for k in names):
            raise UltralyticsMetadataError("model metadata 'names' must map class indices to names")
        if sorted(names) != list(range(len(names))):
            raise UltralyticsMetadataError("model metadata 'names': class indices are not 0..N-1")
        names = tuple(str(names[i]).replace("\n", " ") for i in range(len(names)))
    imgsz = _literal(md, "imgsz")
    if imgsz is not None:
        if isinstance(imgsz, int):
            imgsz = [imgsz, imgsz]
        if (not isinstance(imgsz, (list, tuple)) or len(imgsz) != 2
                or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in imgsz)):
            raise UltralyticsMetadataError("model metadata 'imgsz' must be [height, width]")
        imgsz = (int(imgsz[0]), int(imgsz[1]))
    stride = _literal(md, "stride")
    if stride is not None:
        if isinstance(stride, (list, tuple)) and stride:
            stride = max(stride)
        if isinstance(stride, float) and stride.is_integer():
            stride = int(stride)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise UltralyticsMetadataError("model metadata 'stride' must be a whole number")
    kpt = _literal(md, "kpt_shape")
    if kpt is not None:
        if (not isinstance(kpt, (list, tuple)) or len(kpt) != 2 or kpt[1] not in (2, 3)
                or isinstance(kpt[0], bool) or not isinstance(kpt[0], int) or kpt[0] < 1):
            raise UltralyticsMetadataError("model metadata 'kpt_shape' must be [keypoints, 2 or 3]")
        kpt = (int(kpt[0]), int(kpt[1]))
    end2end = str(md.get("end2end", "")).strip() == "True" or str(md.get("nms", "")).strip() == "True"
    return UltralyticsMeta(_TASKS.get(task) if task else None, names, imgsz, stride, kpt, end2end)


def ultralytics_layer(metadata: Mapping[str, str] | None) -> dict:
    """The card keys an Ultralytics export's metadata implies, as nested data for layering.

    Raises:
        UltralyticsMetadataError: a key is malformed.
    """
    meta = read_ultralytics(metadata)
    if not meta.present:
        return {}
    layer: dict = {}
    if meta.task:
        layer["task"] = meta.task
    if meta.task == "classification":
        # Ultralytics' classify transform: torchvision's Resize (the short side; Pillow's bilinear on a
        # PIL image, antialiased) and CenterCrop of the image decoded at full size; the head ends in a softmax
        layer["input"] = {"resize": "center-crop", "color": "RGB", "scale": 1 / 255, "mean": [0.0], "std": [1.0],
                          "interpolation": "antialias", "jpeg_draft": False}
        layer["classification"] = {"output": "probabilities"}
    else:
        layer["input"] = {"resize": "letterbox", "pad_value": 114, "color": "RGB", "scale": 1 / 255, "mean": [0.0],
                          "std": [1.0], "interpolation": "linear", "jpeg_draft": False}
        if meta.task is not None:  # Ultralytics' predict defaults: conf 0.25, iou 0.7, max_det 300
            layer["detection"] = {"format": "end2end" if meta.end2end else "yolov8", "score_threshold": 0.25,
                                  "iou_threshold": 0.7, "max_detections": 300}
    if meta.imgsz:
        layer["input"]["size"] = list(meta.imgsz)
    if meta.kpt_shape:
        k, dims = meta.kpt_shape
        if k == len(COCO_KEYPOINTS):
            layer["pose"] = {"keypoints": list(COCO_KEYPOINTS), "sigmas": list(COCO_SIGMAS), "dims": dims}
        else:  # as Ultralytics: equal sigmas when the keypoints are not COCO's
            layer["pose"] = {"keypoints": [f"kp{i}" for i in range(k)], "sigmas": [1 / k] * k, "dims": dims}
    return layer
