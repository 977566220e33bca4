"""Pose (YOLOv8-pose / YOLO11-pose): boxes as detection, plus keypoints each.

``output0`` is ``[N, 4 + classes + K * D, anchors]`` (``[N, boxes, 6 + K * D]`` end2end): after the
class scores, K keypoints of D values (x, y in input pixels, then a visibility score already through
a sigmoid when D is 3), decoded in the graph. Keypoints map back to the original image as
Ultralytics' ``scale_coords`` does (the letterbox padding removed, divided by the scale, clipped).
"""

from __future__ import annotations

import numpy as np

from .preprocess import Geometry

__all__ = ["keypoints_to_original"]


def keypoints_to_original(kpts: np.ndarray, dims: int, geometry: Geometry | None) -> np.ndarray:
    """(k, K, 3) ``x, y, score`` in original-image pixels from (k, K * dims) head values.

    With ``dims == 2`` the score is 1. Points are clipped to the image.
    """
    kpts = np.asarray(kpts, np.float32)
    k = len(kpts)
    pts = kpts.reshape(k, kpts.shape[-1] // dims, dims)
    out = np.ones((k, pts.shape[1], 3), dtype=np.float32)
    out[..., :dims] = pts
    if geometry is not None:
        out[..., 0] = np.clip((out[..., 0] - geometry.pad_x) / geometry.scale_x, 0, geometry.width)
        out[..., 1] = np.clip((out[..., 1] - geometry.pad_y) / geometry.scale_y, 0, geometry.height)
    return out
