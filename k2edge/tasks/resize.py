"""OpenCV's resize interpolations in numpy, for inputs staged as the model was trained.

Ultralytics (and most training pipelines) resize with OpenCV; a pip OpenCV breaks a Jetson's
GStreamer/CSI cameras, so it is never a dependency: these reproduce ``cv2.resize`` on uint8 images.

* ``linear``: ``INTER_LINEAR``: half-pixel centres (``src = (dst + 0.5) * in / out - 0.5``, clamped
  to the edge), two taps per axis, no antialiasing; OpenCV computes in 11-bit fixed point and
  rounds, so values here may differ from it by 1 of 255;
* ``area``: ``INTER_AREA``: the mean of the source pixels a destination pixel covers (fractional
  at the edges) when no axis grows; otherwise OpenCV's own two taps per axis
  (``sx = floor(dx * in / out)``, weight the fractional part of ``(dx + 1) - (sx + 1) * out / in``);
* ``nearest``: ``INTER_NEAREST``: ``src = floor(dst * in / out)``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["resize"]


def _linear_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output index: left source index, right source index and the right weight."""
    pos = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
    left = np.floor(pos)
    w = pos - left
    left = left.astype(np.int64)
    w = np.where(left < 0, 0.0, w)
    left = np.clip(left, 0, n_in - 1)
    right = np.clip(left + 1, 0, n_in - 1)
    return left, right, w.astype(np.float32)


def _area_enlarge_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OpenCV's INTER_AREA taps where it does not shrink both axes: ``sx = floor(dx * in / out)``,
    weight ``(dx + 1) - (sx + 1) * out / in`` when positive (its fractional part), else 0."""
    dx = np.arange(n_out, dtype=np.float64)
    sx = np.floor(dx * (n_in / n_out))
    fx = (dx + 1) - (sx + 1) * (n_out / n_in)
    fx = np.where(fx <= 0, 0.0, fx - np.floor(fx))
    left = sx.astype(np.int64)
    fx = np.where(left + 1 >= n_in, 0.0, fx)
    left = np.clip(left, 0, n_in - 1)
    return left, np.clip(left + 1, 0, n_in - 1), fx.astype(np.float32)


def _area_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) weights: each row the share of every source pixel in that destination pixel."""
    scale = n_in / n_out
    start = np.arange(n_out, dtype=np.float64) * scale
    end = start + scale
    src = np.arange(n_in, dtype=np.float64)
    overlap = np.clip(np.minimum(end[:, None], src + 1) - np.maximum(start[:, None], src), 0, None)
    return (overlap / scale).astype(np.float32)


def _axis(img: np.ndarray, n_out: int, axis: int, method: str) -> np.ndarray:
    n_in = img.shape[axis]
    if n_in == n_out and method != "area-enlarge":
        return img
    if method == "nearest":
        idx = np.minimum((np.arange(n_out) * (n_in / n_out)).astype(np.int64), n_in - 1)
        return np.take(img, idx, axis=axis)
    if method == "area":  # both axes shrink (or stay)
        m = _area_matrix(n_in, n_out)
        moved = np.moveaxis(img, axis, 0)
        out = np.tensordot(m, moved, axes=([1], [0]))
        return np.moveaxis(out, 0, axis)
    left, right, w = _area_enlarge_taps(n_in, n_out) if method == "area-enlarge" else _linear_taps(n_in, n_out)
    shape = [1] * img.ndim
    shape[axis] = n_out
    w = w.reshape(shape)
    a = np.take(img, left, axis=axis)
    b = np.take(img, right, axis=axis)
    return a + (b - a) * w


def resize(img: np.ndarray, width: int, height: int, method: str = "linear") -> np.ndarray:
    """Resize a uint8 image (H, W) or (H, W, C) to ``width`` x ``height`` as ``cv2.resize`` would.

    Args:
        img: the image.
        width / height: the output size in pixels.
        method: ``linear``, ``area`` or ``nearest``.

    Returns:
        uint8 (height, width[, C]).
    """
    if method not in ("linear", "area", "nearest"):
        raise ValueError(f"unknown interpolation {method!r}")
    if img.shape[0] == height and img.shape[1] == width:
        return img
    if method == "nearest":
        return _axis(_axis(img, height, 0, method), width, 1, method)
    x = img.astype(np.float32)
    if method == "area" and (height > img.shape[0] or width > img.shape[1]):
        method = "area-enlarge"  # OpenCV averages areas only when no axis grows; else its own 2-tap weights
    x = _axis(x, height, 0, method)
    x = _axis(x, width, 1, method)
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)
