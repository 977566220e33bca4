"""Oriented boxes (YOLOv8-obb / YOLO11-obb): ``[N, 4 + classes + 1, anchors]``, cx cy w h in input
pixels, sigmoid class scores, then the angle in radians; rotated NMS by probabilistic IoU (the
Gaussian-distribution overlap Ultralytics' ``nms_rotated`` uses), vectorised.

A box's answer is ``rbox`` ``[cx, cy, w, h, angle]`` in original-image pixels (radians).
"""

from __future__ import annotations

import numpy as np

from ..config.card import DetectionSpec
from .detection import Detections, candidates
from .preprocess import Geometry

__all__ = ["decode_obb", "probiou", "rbox_bounds", "rotated_nms"]


def _covariance(b: np.ndarray):
    a, c = b[:, 2] ** 2 / 12, b[:, 3] ** 2 / 12
    ang = b[:, 4]
    cos, sin = np.cos(ang), np.sin(ang)
    return a * cos ** 2 + c * sin ** 2, a * sin ** 2 + c * cos ** 2, (a - c) * cos * sin


def probiou(b1: np.ndarray, b2: np.ndarray, eps: float = 1e-7) -> np.ndarray:
    """(n, m) probabilistic IoU of ``[cx, cy, w, h, angle]`` boxes (Ultralytics' ``batch_probiou``)."""
    b1 = np.asarray(b1, np.float64).reshape(-1, 5)
    b2 = np.asarray(b2, np.float64).reshape(-1, 5)
    x1, y1 = b1[:, 0:1], b1[:, 1:2]
    x2, y2 = b2[None, :, 0], b2[None, :, 1]
    a1, bb1, c1 = (v[:, None] for v in _covariance(b1))
    a2, bb2, c2 = (v[None] for v in _covariance(b2))
    den = (a1 + a2) * (bb1 + bb2) - (c1 + c2) ** 2 + eps
    t1 = ((a1 + a2) * (y1 - y2) ** 2 + (bb1 + bb2) * (x1 - x2) ** 2) / den * 0.25
    t2 = ((c1 + c2) * (x2 - x1) * (y1 - y2)) / den * 0.5
    t3 = np.log(((a1 + a2) * (bb1 + bb2) - (c1 + c2) ** 2)
                / (4 * np.sqrt(np.clip(a1 * bb1 - c1 ** 2, 0, None) * np.clip(a2 * bb2 - c2 ** 2, 0, None)) + eps)
                + eps) * 0.5
    bd = np.clip(t1 + t2 + t3, eps, 100.0)
    hd = np.sqrt(1.0 - np.exp(-bd) + eps)
    return 1 - hd


def rotated_nms(rboxes: np.ndarray, scores: np.ndarray, iou_threshold: float, classes: np.ndarray | None = None,
                max_keep: int | None = None) -> np.ndarray:
    """Indices of the kept rotated boxes, best first: as Ultralytics' ``nms_rotated``, a box is dropped
    when any better-scored box (kept or not) overlaps it by more than ``iou_threshold`` (probiou).
    ``classes``: per-class NMS (boxes of different classes never suppress each other)."""
    n = len(scores)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(-np.asarray(scores), kind="stable")
    b = np.asarray(rboxes, np.float64)[order].copy()
    if classes is not None:
        b[:, :2] += np.asarray(classes)[order, None].astype(np.float64) * 7680.0  # Ultralytics' max_wh
    iou = np.triu(probiou(b, b), k=1)
    keep = np.flatnonzero((iou > iou_threshold).sum(axis=0) == 0)
    if max_keep is not None:
        keep = keep[:max_keep]
    return order[keep]


def decode_obb(pred: np.ndarray, spec: DetectionSpec, geometry: Geometry | None = None) -> Detections:
    """One image's oriented boxes: :class:`Detections` whose ``extra`` is (k, 5) ``[cx, cy, w, h, angle]``
    in original-image pixels (``boxes`` their axis-aligned bounds)."""
    p = np.asarray(pred, dtype=np.float32)
    if spec.format == "end2end":  # [K, 7]: cx cy w h score class angle
        rows = p[p[:, 4] > spec.score_threshold][: spec.max_detections]
        rb = np.concatenate([rows[:, :4], rows[:, 6:7]], axis=1)
        scores, classes = rows[:, 4], rows[:, 5].astype(np.int64)
    else:
        cxcywh, scores, classes, angle = candidates(p, spec, extra=1)
        rb = np.concatenate([cxcywh, angle], axis=1)
        keep = rotated_nms(rb, scores, spec.iou_threshold, None if spec.class_agnostic_nms else classes,
                           spec.max_detections)
        rb, scores, classes = rb[keep], scores[keep], classes[keep].astype(np.int64)
    rb = rb.astype(np.float32)
    if geometry is not None:
        # centres through the letterbox; sizes by the scale (one ratio: the letterbox keeps it)
        rb[:, 0] = (rb[:, 0] - geometry.pad_x) / geometry.scale_x
        rb[:, 1] = (rb[:, 1] - geometry.pad_y) / geometry.scale_y
        rb[:, 2] /= geometry.scale_x
        rb[:, 3] /= geometry.scale_y
    return Detections(rbox_bounds(rb).astype(np.float32), scores.astype(np.float32), classes, rb)


def rbox_bounds(rboxes) -> np.ndarray:
    """The axis-aligned ``x1 y1 x2 y2`` around each oriented box ``[cx, cy, w, h, angle]`` (radians)."""
    rb = np.asarray(rboxes, dtype=np.float64).reshape(-1, 5)
    cos, sin = np.abs(np.cos(rb[:, 4])), np.abs(np.sin(rb[:, 4]))
    hw = (rb[:, 2] * cos + rb[:, 3] * sin) / 2
    hh = (rb[:, 2] * sin + rb[:, 3] * cos) / 2
    return np.stack([rb[:, 0] - hw, rb[:, 1] - hh, rb[:, 0] + hw, rb[:, 1] + hh], axis=1)
