"""Instance segmentation (YOLOv8-seg / YOLO11-seg): boxes as detection, plus one mask each.

The export has two outputs: ``output0`` ``[N, 4 + classes + M, anchors]`` (M mask coefficients
after the class scores; ``[N, K, 6 + M]`` for an end2end export) and ``output1`` ``[N, M, mh, mw]``
prototypes at a quarter of the input size. A box's mask is ``coefficients @ prototypes``, upsampled
to the original image as Ultralytics' ``process_mask_native`` does (upsampled so the letterbox
padding crops on whole pixels, cropped, bilinear with half-pixel centres, cropped to the box,
``> 0``), the two resizes composed into one matrix per axis and applied only inside the box: the cost is the boxes' area, not the image's times the boxes.

Masks leave as COCO RLE (``{"size": [h, w], "counts": "..."}``, pycocotools' compressed string,
column-major), built from the box's pixels alone.
"""

from __future__ import annotations

import math

import numpy as np

from .preprocess import Geometry

__all__ = ["box_masks", "rle_area", "rle_encode", "rle_decode", "rle_from_box_mask"]


def _taps(n_src: int, n_dst: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear taps of an ``n_src`` -> ``n_dst`` resize as ``F.interpolate(align_corners=False)``:
    per destination index, (low source index, high source index, weight of the high one)."""
    pos = np.maximum((np.arange(n_dst, dtype=np.float64) + 0.5) * (n_src / n_dst) - 0.5, 0.0)
    lo = np.minimum(np.floor(pos).astype(np.int64), n_src - 1)
    return lo, np.minimum(lo + 1, n_src - 1), pos - lo


def _axis_taps(m: int, f: int, top: int, bottom: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per image pixel along one axis, the 4 prototype pixels it reads and their weights ((n, 4) each):
    upsampled ``f`` times, cropped to ``[top, bottom)``, resized to ``n`` (Ultralytics' two steps, composed)."""
    lo1, hi1, w1 = _taps(m, m * f)
    lo2, hi2, w2 = _taps(bottom - top, n)
    lo2, hi2 = lo2 + top, hi2 + top
    if f == 1:  # no first step: two taps
        return np.stack([lo2, hi2], axis=1), np.stack([1 - w2, w2], axis=1).astype(np.float32)
    idx = np.stack([lo1[lo2], hi1[lo2], lo1[hi2], hi1[hi2]], axis=1)
    wts = np.stack([(1 - w2) * (1 - w1[lo2]), (1 - w2) * w1[lo2], w2 * (1 - w1[hi2]), w2 * w1[hi2]], axis=1)
    return idx, wts.astype(np.float32)


def _upsampling(mh: int, mw: int, height: int, width: int):
    """Row and column taps taking prototypes to a ``height`` x ``width`` image, as Ultralytics'
    ``process_mask_native`` (protos at 1/4 of the input; upsample 1, 2 or 4 times so the letterbox
    padding crops on whole pixels; ``scale_masks`` crops it off and resizes bilinearly)."""
    gain = min(4 * mh / height, 4 * mw / width)
    pad = (4 * mh - max(round(height * gain), 1)) | (4 * mw - max(round(width * gain), 1))
    f = 4 // math.gcd(4, pad | pad // 2)
    h1, w1 = mh * f, mw * f
    if (h1, w1) == (height, width):
        return _axis_taps(mh, f, 0, h1, height), _axis_taps(mw, f, 0, w1, width)
    g = min(h1 / height, w1 / width)
    pad_w, pad_h = (w1 - max(round(width * g), 1)) / 2, (h1 - max(round(height * g), 1)) / 2
    top, left = round(pad_h - 0.1), round(pad_w - 0.1)
    bottom, right = top + max(round(height * g), 1), left + max(round(width * g), 1)
    return _axis_taps(mh, f, top, bottom, height), _axis_taps(mw, f, left, right, width)


def box_masks(protos: np.ndarray, coefficients: np.ndarray, boxes: np.ndarray,
              geometry: Geometry | None, input_size: tuple[int, int]) -> list[tuple[np.ndarray, tuple[int, int]]]:
    """Each box's binary mask inside the box, in original-image pixels.

    Args:
        protos: (M, mh, mw) one image's prototypes (at a quarter of the input size).
        coefficients: (k, M) per box.
        boxes: (k, 4) ``x1 y1 x2 y2`` in original-image pixels (input pixels when ``geometry`` is None).
        geometry: where the image landed in the input (None: the mask is at the input's size).
        input_size: (height, width) of the model input.

    Returns:
        per box: (bool mask (rows, columns), (x0, y0)): the pixels ``x1 <= x < x2``, ``y1 <= y < y2``
        (Ultralytics' ``crop_mask``) and where they start.
    """
    m, mh, mw = protos.shape
    H, W = (geometry.height, geometry.width) if geometry is not None else input_size
    out = []
    if len(boxes) == 0:
        return out
    (iy, wy), (ix, wx) = _upsampling(mh, mw, H, W)
    protos = np.asarray(protos, np.float32)
    # Elementwise work on the taps, not matrix products: BLAS threads cost more than these small
    # products on a busy 2-core board.
    for coef, (x1, y1, x2, y2) in zip(np.asarray(coefficients, np.float32), np.asarray(boxes, np.float64)):
        x0, xe = max(0, int(np.ceil(x1))), min(W, int(np.ceil(x2)))
        y0, ye = max(0, int(np.ceil(y1))), min(H, int(np.ceil(y2)))
        if xe <= x0 or ye <= y0:
            out.append((np.zeros((0, 0), bool), (0, 0)))
            continue
        ry, rwy, rx, rwx = iy[y0:ye], wy[y0:ye], ix[x0:xe], wx[x0:xe]
        r0, r1, c0, c1 = int(ry.min()), int(ry.max()) + 1, int(rx.min()), int(rx.max()) + 1
        # the mask logits only on the prototype pixels this box reads
        logits = np.einsum("m,mij->ij", coef, protos[:, r0:r1, c0:c1])
        rows = np.einsum("ytc,yt->yc", logits[ry - r0], rwy)          # (ny, columns read)
        full = np.einsum("yxt,xt->yx", rows[:, rx - c0], rwx)         # (ny, nx)
        out.append((full > 0, (x0, y0)))
    return out


_LIMITS = 16 * 32 ** np.arange(12, dtype=np.int64)  # one more 5-bit group past each (counts < 2 ** 59)


def _counts_string(counts: np.ndarray) -> str:
    """pycocotools' ``rleToString``, vectorised: each count (after the second, minus the count two
    before) in 5-bit groups, low first, 0x20 marking "more", plus 48."""
    x = np.asarray(counts, dtype=np.int64).copy()
    if len(x) > 3:
        x[3:] -= np.asarray(counts, dtype=np.int64)[1:-2]
    groups = 1 + ((x[:, None] >= _LIMITS) | (x[:, None] < -_LIMITS)).sum(axis=1)
    k = np.arange(int(groups.max()), dtype=np.int64)
    chars = ((x[:, None] >> (5 * k)) & 0x1F) | ((k < groups[:, None] - 1).astype(np.int64) << 5)
    return (chars[k < groups[:, None]] + 48).astype(np.uint8).tobytes().decode("ascii")


def rle_from_box_mask(mask: np.ndarray, origin: tuple[int, int], height: int, width: int) -> dict:
    """COCO compressed RLE of a ``height`` x ``width`` mask that is zero outside ``mask`` at ``origin`` (x, y)."""
    x0, y0 = origin
    bh, bw = mask.shape
    if mask.size == 0 or not mask.any():
        return {"size": [height, width], "counts": _counts_string(np.array([height * width]))}
    padded = np.zeros((bw, bh + 2), dtype=np.int8)  # column-major: one row per image column
    padded[:, 1:-1] = mask.T
    j, i = np.nonzero(padded[:, 1:] != padded[:, :-1])  # j: column, i: row in the box where a run starts
    starts = (x0 + j).astype(np.int64) * height + y0 + i
    # a box as tall as the image: a run that goes on into the next column ends and restarts at the
    # same place; drop both, as pycocotools counts it as one run
    same = np.flatnonzero(starts[1:] == starts[:-1])
    if same.size:
        keep = np.ones(len(starts), dtype=bool)
        keep[same] = keep[same + 1] = False
        starts = starts[keep]
    if len(starts) and starts[-1] == height * width:  # the last run ends with the image: no empty run after it
        starts = starts[:-1]
    counts = np.diff(np.concatenate([[0], starts, [height * width]]))
    return {"size": [height, width], "counts": _counts_string(counts)}


def rle_encode(mask: np.ndarray) -> dict:
    """COCO compressed RLE of a full (h, w) binary mask."""
    h, w = mask.shape
    return rle_from_box_mask(np.asarray(mask, bool), (0, 0), h, w)


def _counts(s: str) -> list[int]:
    counts: list[int] = []
    p = 0
    while p < len(s):
        x, k, more = 0, 0, True
        while more:
            c = ord(s[p]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and (c & 0x10):
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def rle_area(rle: dict) -> int:
    """Pixels in a compressed RLE mask."""
    return int(sum(_counts(rle["counts"])[1::2]))


def rle_decode(rle: dict) -> np.ndarray:
    """The (h, w) bool mask of a compressed RLE (for tests, annotation and evaluation without pycocotools)."""
    h, w = rle["size"]
    counts = _counts(rle["counts"])
    flat = np.zeros(h * w, dtype=bool)
    pos, val = 0, False
    for c in counts:
        if val:
            flat[pos:pos + c] = True
        pos += c
        val = not val
    return flat.reshape(w, h).T
