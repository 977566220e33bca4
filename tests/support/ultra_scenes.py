"""Synthetic raw outputs of Ultralytics heads with planted objects, numpy only.

``tools/make_ultralytics_fixtures.py`` runs Ultralytics' post-processing on exactly these arrays
and stores what it finds (tests/fixtures/ultralytics/ultralytics_golden.npz); the parity tests
decode the same arrays with k2edge. Everything is arithmetic on constants (no random generator),
so both sides build the same values; :func:`checksum` guards that.

The scene: a 320 x 320 letterboxed input of an original of 640 x 480 or 600 x 400; three classes;
each object planted on four neighbouring anchors with slightly shifted boxes and lower scores
(NMS keeps one), some objects overlapping objects of another class (per-class NMS keeps both),
one below the score threshold; everything else scores 0.
"""

from __future__ import annotations

import hashlib

import numpy as np

INPUT = (320, 320)                       # [h, w] of the model input
ORIGINALS = ((480, 640), (400, 600))     # [h, w] of the original images
NC = 3
KPTS = 17
MASKS = 32
ANCHORS = 2100                           # 40x40 + 20x20 + 10x10 at 320
CONF, IOU, MAX_DET = 0.25, 0.7, 300      # Ultralytics' predict defaults

# cx, cy, w, h (input pixels), class, score, angle (obb)
OBJECTS = (
    (60.0, 100.0, 50.0, 70.0, 0, 0.92, 0.3),
    (75.0, 110.0, 46.0, 60.0, 1, 0.81, -0.5),    # overlaps the first, another class
    (160.0, 160.0, 90.0, 60.0, 2, 0.77, 1.2),
    (250.0, 120.0, 40.0, 40.0, 0, 0.66, 0.0),
    (262.0, 126.0, 42.0, 38.0, 0, 0.58, 0.1),    # same class, IoU about 0.5 with the one before: kept
    (120.0, 230.0, 120.0, 50.0, 1, 0.49, -1.0),
    (240.0, 220.0, 60.0, 70.0, 2, 0.36, 0.7),
    (40.0, 240.0, 30.0, 30.0, 1, 0.20, 0.0),     # below the threshold
)
COPIES = 4


def _copies():
    """(anchor, cx, cy, w, h, class, score, angle, object index) for every planted box."""
    rows = []
    for k, (cx, cy, w, h, c, s, a) in enumerate(OBJECTS):
        for j in range(COPIES):
            anchor = 37 + k * 211 + j * 7
            rows.append((anchor, cx + 1.5 * j, cy - 1.0 * j, w * (1 - 0.03 * j), h * (1 + 0.02 * j), c,
                         s * (1 - 0.05 * j), a + 0.02 * j, k))
    return rows


def _head(extra: int) -> np.ndarray:
    p = np.zeros((1, 4 + NC + extra, ANCHORS), dtype=np.float32)
    for anchor, cx, cy, w, h, c, s, _, _ in _copies():
        p[0, :4, anchor] = cx, cy, w, h
        p[0, 4 + c, anchor] = s
        p[0, 4 + (c + 1) % NC, anchor] = s * 0.3  # a weaker second class
    return p


def detect_pred() -> np.ndarray:
    """[1, 4 + NC, anchors]: YOLOv8 / YOLO11 detection."""
    return _head(0)


def end2end_pred() -> np.ndarray:
    """[1, 300, 6]: x1 y1 x2 y2 score class, best first, as an end2end export gives them."""
    p = np.zeros((1, 300, 6), dtype=np.float32)
    for i, (cx, cy, w, h, c, s, _) in enumerate(OBJECTS):
        p[0, i] = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2, s, c
    return p


def _blob(cx: float, cy: float, w: float, h: float) -> np.ndarray:
    """A prototype at 1/4 of the input: positive inside an ellipse about the box, negative outside."""
    mh, mw = INPUT[0] // 4, INPUT[1] // 4
    y, x = np.mgrid[0:mh, 0:mw].astype(np.float64)
    d = ((x + 0.5 - cx / 4) / (w / 8)) ** 2 + ((y + 0.5 - cy / 4) / (h / 8)) ** 2
    return np.exp(-0.5 * d) - 0.5


def seg_pred() -> tuple[np.ndarray, np.ndarray]:
    """([1, 4 + NC + 32, anchors], protos [1, 32, 80, 80]): YOLOv8-seg."""
    p = _head(MASKS)
    protos = np.zeros((1, MASKS, INPUT[0] // 4, INPUT[1] // 4), dtype=np.float32)
    for k, (cx, cy, w, h, *_rest) in enumerate(OBJECTS):
        protos[0, k] = _blob(cx, cy, w, h)
    protos[0, len(OBJECTS)] = 0.05  # a constant prototype every mask mixes in a little
    for anchor, *_mid, k in _copies():
        p[0, 4 + NC + k, anchor] = 2.0
        p[0, 4 + NC + (k + 1) % len(OBJECTS), anchor] = 0.15
        p[0, 4 + NC + len(OBJECTS), anchor] = -1.0
    return p, protos


def pose_pred() -> np.ndarray:
    """[1, 4 + NC + 17 * 3, anchors]: YOLOv8-pose (x, y in input pixels, visibility after sigmoid)."""
    p = _head(KPTS * 3)
    for anchor, cx, cy, w, h, *_rest in _copies():
        for i in range(KPTS):
            x = cx - w / 2 + w * ((i * 7) % 17) / 16
            y = cy - h / 2 + h * ((i * 5) % 17) / 16
            p[0, 4 + NC + 3 * i: 4 + NC + 3 * i + 3, anchor] = x, y, ((i * 0.37) % 1.0)
    return p


def obb_pred() -> np.ndarray:
    """[1, 4 + NC + 1, anchors]: YOLOv8-obb (cx cy w h, class scores, angle in radians)."""
    p = _head(1)
    for anchor, *_mid, angle, _k in _copies():
        p[0, -1, anchor] = angle
    return p


def checksum() -> str:
    """A digest of every array above: the golden file stores it, a test compares it."""
    h = hashlib.sha256()
    for a in (detect_pred(), end2end_pred(), *seg_pred(), pose_pred(), obb_pred()):
        h.update(np.ascontiguousarray(a, dtype=np.float32).tobytes())
    return h.hexdigest()
