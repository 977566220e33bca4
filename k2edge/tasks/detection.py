"""Detection decoding: YOLOv8 / YOLOv5 output layouts -> boxes, scores and classes after NMS, mapped
back to the original image's pixels. Pure numpy, vectorised; each image of a batch decodes on its own.

Layouts (card ``[detection] format``):

* ``yolov8``: ``[N, 4 + classes, anchors]``; rows 0..3 are cx, cy, w, h in input pixels, the rest
  class scores already through a sigmoid; no objectness (Ultralytics' YOLOv8/YOLO11 ONNX export).
* ``yolov5``: ``[N, anchors, 5 + classes]``; cx, cy, w, h, objectness, class scores; a box's score
  is objectness x class score.
* ``end2end``: ``[N, K, 6 + extra]``; x1, y1, x2, y2, score, class, already through NMS in the
  graph (YOLOv10, ``nms=True`` exports): kept when the score reaches the threshold, in order.

Segmentation, pose and obb heads add ``extra`` values per anchor after the class scores (mask
coefficients, keypoints, an angle): they ride along with each box as :attr:`Detections.extra`.

Each anchor keeps its best class (as Ultralytics' NMS does by default); anchors whose score
exceeds ``score_threshold`` are candidates; at most ``max_candidates`` of them (best first) enter
NMS, so a poorly trained model that passes every anchor costs a bounded time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..config.card import DetectionSpec
from .preprocess import Geometry

__all__ = ["Detections", "candidates", "decode", "decode_one", "layout_classes", "layout_text", "nms"]

# Above this many candidates NMS works box by box instead of building the n x n IoU matrix
# (measured: the matrix wins at a few hundred candidates, loses 5x at 1,000).
_MATRIX_NMS_MAX = 512


@dataclass(frozen=True)
class Detections:
    """One image's detections, best first.

    Attributes:
        boxes: (k, 4) float32 ``x1 y1 x2 y2`` in original-image pixels (input pixels for a tensor).
        scores: (k,) float32.
        classes: (k,) int64 class indices.
    """

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray
    extra: np.ndarray | None = None  # (k, extra) the head's values after the class scores, in input units

    def __len__(self) -> int:
        return len(self.scores)

    def to_list(self, labels: Sequence[str] = ()) -> list[dict]:
        """``[{"index", "label", "score", "box": [x1, y1, x2, y2]}]``, JSON-ready."""
        return [{"index": int(c), "label": labels[c] if c < len(labels) else str(int(c)), "score": round(float(s), 5),
                 "box": [round(float(v), 2) for v in b]}
                for b, s, c in zip(self.boxes, self.scores, self.classes)]


def layout_text(fmt: str, extra: int = 0) -> str:
    """The output shape ``fmt`` expects, as messages write it: ``[N, 4 + classes + 32, anchors]`` (yolov8, 32
    mask coefficients); yolov5 carries no extra values."""
    plus = f" + {extra}" if extra else ""
    return {"yolov8": f"[N, 4 + classes{plus}, anchors]", "yolov5": "[N, anchors, 5 + classes]",
            "end2end": f"[N, boxes, 6{plus}]"}[fmt]


def layout_classes(shape: Sequence, fmt: str, extra: int = 0) -> int:
    """The class count an output of ``shape`` holds in layout ``fmt`` with ``extra`` values per box
    after the class scores (mask coefficients, keypoints, an angle).

    Raises:
        ValueError: the shape does not fit the layout (the message says what would).
    """
    dims = tuple(shape)
    if len(dims) == 2:
        dims = (1, *dims)
    if len(dims) != 3 or not all(isinstance(d, int) and d > 0 for d in dims[1:]):
        raise ValueError(f"a {fmt} output is 3-D [N, ...], got shape {list(shape)}")
    plus = f" + {extra}" if extra else ""
    if fmt == "end2end":
        if dims[2] != 6 + extra:
            raise ValueError(f"end2end layout is {layout_text(fmt, extra)} (x1 y1 x2 y2 score class{plus and ' ...'}); "
                             f"shape {list(shape)} has {dims[2]} columns")
        return 0  # the class count is not in the shape
    if fmt == "yolov8":
        classes = dims[1] - 4 - extra
        if classes < 1:
            raise ValueError(f"yolov8 layout is {layout_text(fmt, extra)}; shape {list(shape)} has {dims[1]} rows")
        if dims[1] > dims[2]:
            raise ValueError(f"yolov8 layout is [N, 4 + classes, anchors] (anchors last, usually thousands); shape "
                             f"{list(shape)} has more rows than anchors: is it [N, anchors, 5 + classes] (format = \"yolov5\")?")
        return classes
    if fmt == "yolov5":
        classes = dims[2] - 5
        if classes < 1:
            raise ValueError(f"yolov5 layout is {layout_text(fmt)}; shape {list(shape)} has {dims[2]} columns")
        return classes
    raise ValueError(f"unknown detection format {fmt!r}")


def _candidates(p: np.ndarray, fmt: str, threshold: float, multi_label: bool = False, extra: int = 0):
    """(boxes cx cy w h (k, 4), scores (k,), classes (k,), extras (k, extra)) of the anchors above
    ``threshold``: each anchor's best class, or with ``multi_label`` every class of it above the threshold."""
    if fmt == "yolov8":
        cls_scores = p[4:len(p) - extra]
        if multi_label:
            classes, idx = np.nonzero(cls_scores > threshold)
            return p[:4, idx].T, cls_scores[classes, idx], classes, p[len(p) - extra:, idx].T
        best = cls_scores.max(axis=0)
        idx = np.flatnonzero(best > threshold)
        return p[:4, idx].T, best[idx], cls_scores[:, idx].argmax(axis=0), p[len(p) - extra:, idx].T
    obj = p[:, 4]
    idx = np.flatnonzero(obj > threshold)
    scores = p[idx, 5:] * obj[idx, None]
    if multi_label:
        rows, classes = np.nonzero(scores > threshold)
        return p[idx[rows], :4], scores[rows, classes], classes, np.zeros((len(rows), 0), p.dtype)
    classes = scores.argmax(axis=1)
    best = scores[np.arange(len(idx)), classes]
    keep = best > threshold
    return p[idx[keep], :4], best[keep], classes[keep], np.zeros((int(keep.sum()), 0), p.dtype)


def candidates(p: np.ndarray, spec: DetectionSpec, multi_label: bool = False, extra: int = 0):
    """One image's candidates above the score threshold, at most ``max_candidates`` (best first):
    (cx cy w h (k, 4), scores (k,), classes (k,), extras (k, extra)); for the segmentation, pose and
    obb decoders, which run their own NMS."""
    cxcywh, scores, classes, extras = _candidates(p, spec.format, spec.score_threshold, multi_label, extra)
    if len(scores) > spec.max_candidates:
        top = np.argpartition(-scores, spec.max_candidates - 1)[: spec.max_candidates]
        cxcywh, scores, classes, extras = cxcywh[top], scores[top], classes[top], extras[top]
    return cxcywh, scores, classes, extras


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, classes: np.ndarray | None = None,
        max_keep: int | None = None) -> np.ndarray:
    """Greedy non-maximum suppression; indices of the kept boxes, best first.

    Args:
        boxes: (n, 4) ``x1 y1 x2 y2``.
        scores: (n,).
        iou_threshold: a box overlapping a kept one by more than this is dropped.
        classes: per-box classes for per-class NMS (boxes of different classes never suppress
            each other); None for class-agnostic NMS.
        max_keep: stop after this many.
    """
    n = len(scores)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(-scores, kind="stable")
    b = np.asarray(boxes, dtype=np.float32)[order]
    if classes is not None:
        # shift each class to its own region of the plane: one NMS then never mixes classes
        b = b + (np.asarray(classes)[order].astype(np.float32) * (float(np.abs(b).max()) + 1.0))[:, None]
    x1, y1, x2, y2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    area = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    limit = max_keep or n
    keep: list[int] = []
    if n <= _MATRIX_NMS_MAX:
        w = np.clip(np.minimum(x2[:, None], x2) - np.maximum(x1[:, None], x1), 0, None)
        h = np.clip(np.minimum(y2[:, None], y2) - np.maximum(y1[:, None], y1), 0, None)
        inter = w * h
        over = inter > iou_threshold * (area[:, None] + area - inter + 1e-9)
        suppressed = np.zeros(n, dtype=bool)
        for i in range(n):
            if suppressed[i]:
                continue
            keep.append(i)
            if len(keep) == limit:
                break
            suppressed |= over[i]
    else:
        alive = np.arange(n)
        while alive.size and len(keep) < limit:
            i = alive[0]
            keep.append(int(i))
            rest = alive[1:]
            w = np.clip(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), 0, None)
            h = np.clip(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), 0, None)
            inter = w * h
            alive = rest[inter <= iou_threshold * (area[i] + area[rest] - inter + 1e-9)]
    return order[np.asarray(keep, dtype=np.int64)]


def decode_one(pred: np.ndarray, spec: DetectionSpec, geometry: Geometry | None = None,
               multi_label: bool = False, extra: int = 0) -> Detections:
    """Decode one image's prediction (``[4 + C, anchors]`` or ``[anchors, 5 + C]``).

    Boxes come back in the original image's pixels through ``geometry`` (clipped to it), or in
    input pixels when ``geometry`` is None. ``multi_label``: an anchor may give a box for each class
    above the threshold (evaluation), not only for its best.
    """
    p = np.asarray(pred)
    if p.dtype != np.float32:
        p = p.astype(np.float32)
    if spec.format == "end2end":
        # already through NMS in the graph: keep what reaches the threshold, in the model's order
        rows = p[p[:, 4] > spec.score_threshold][: spec.max_detections]
        boxes, scores, classes, extras = rows[:, :4], rows[:, 4], rows[:, 5].astype(np.int64), rows[:, 6:]
    else:
        cxcywh, scores, classes, extras = candidates(p, spec, multi_label, extra)
        half = cxcywh[:, 2:4] / 2
        boxes = np.concatenate([cxcywh[:, 0:2] - half, cxcywh[:, 0:2] + half], axis=1)
        keep = nms(boxes, scores, spec.iou_threshold, None if spec.class_agnostic_nms else classes, spec.max_detections)
        boxes, scores, classes, extras = boxes[keep], scores[keep], classes[keep].astype(np.int64), extras[keep]
    if geometry is not None:
        boxes = geometry.to_original(boxes)
    return Detections(boxes.astype(np.float32), scores.astype(np.float32), classes, extras if extra else None)


def decode(pred: np.ndarray, spec: DetectionSpec, geometries: Sequence[Geometry | None] | None = None,
           multi_label: bool = False, extra: int = 0) -> list[Detections]:
    """Decode a batch: one :class:`Detections` per image, each independent of the others.

    Args:
        pred: the model output, ``[N, 4 + C, anchors]`` (yolov8) or ``[N, anchors, 5 + C]`` (yolov5).
        spec: the card's ``[detection]``.
        geometries: per image, where it landed in the input (None: boxes in input pixels).
    """
    p = np.asarray(pred)
    if p.ndim == 2:
        p = p[None]
    layout_classes(p.shape, spec.format, extra)
    n = len(p) if geometries is None else min(len(p), len(geometries))
    return [decode_one(p[i], spec, None if geometries is None else geometries[i], multi_label, extra)
            for i in range(n)]
