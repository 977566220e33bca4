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


def _axis_matrix(m: int, f: int, top: int, bottom: int, n: int) -> np.ndarray:
    """(n, m) weights of prototype pixels in each of ``n`` image pixels along one axis: upsampled
    ``f`` times, cropped to ``[top, bottom)``, resized to ``n`` (Ultralytics' two steps, composed)."""
    lo1, hi1, w1 = _taps(m, m * f)
    lo2, hi2, w2 = _taps(bottom - top, n)
    lo2, hi2 = lo2 + top, hi2 + top
    a = np.zeros((n, m), dtype=np.float64)
    rows = np.arange(n)
    for idx2, wt2 in ((lo2, 1 - w2), (hi2, w2)):
        np.add.at(a, (rows, lo1[idx2]), wt2 * (1 - w1[idx2]))
        np.add.at(a, (rows, hi1[idx2]), wt2 * w1[idx2])
    return a.astype(np.float32)


def _upsampling(mh: int, mw: int, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column matrices taking prototypes to a ``height`` x ``width`` image, as Ultralytics'
    ``process_mask_native`` (protos at 1/4 of the input; upsample 1, 2 or 4 times so the letterbox
    padding crops on whole pixels; ``scale_masks`` crops it off and resizes bilinearly)."""
    gain = min(4 * mh / height, 4 * mw / width)
    pad = (4 * mh - max(round(height * gain), 1)) | (4 * mw - max(round(width * gain), 1))
    f = 4 // math.gcd(4, pad | pad // 2)
    h1, w1 = mh * f, mw * f
    if (h1, w1) == (height, width):
        return _axis_matrix(mh, f, 0, h1, height), _axis_matrix(mw, f, 0, w1, width)
    g = min(h1 / height, w1 / width)
    pad_w, pad_h = (w1 - max(round(width * g), 1)) / 2, (h1 - max(round(height * g), 1)) / 2
    top, left = round(pad_h - 0.1), round(pad_w - 0.1)
    bottom, right = top + max(round(height * g), 1), left + max(round(width * g), 1)
    return _axis_matrix(mh, f, top, bottom, height), _axis_matrix(mw, f, left, right, width)


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
    ay, ax = _upsampling(mh, mw, H, W)
    protos = np.asarray(protos, np.float32)
    for coef, (x1, y1, x2, y2) in zip(np.asarray(coefficients, np.float32), np.asarray(boxes, np.float64)):
        x0, xe = max(0, int(np.ceil(x1))), min(W, int(np.ceil(x2)))
        y0, ye = max(0, int(np.ceil(y1))), min(H, int(np.ceil(y2)))
        if xe <= x0 or ye <= y0:
            out.append((np.zeros((0, 0), bool), (0, 0)))
            continue
        wy, wx = ay[y0:ye], ax[x0:xe]
        ry = np.flatnonzero(wy.any(axis=0))
        rx = np.flatnonzero(wx.any(axis=0))
        r0, r1, c0, c1 = ry[0], ry[-1] + 1, rx[0], rx[-1] + 1
        # the mask logits only on the prototype pixels this box reads
        logits = np.tensordot(coef, protos[:, r0:r1, c0:c1], axes=1)
        full = wy[:, r0:r1] @ logits @ wx[:, c0:c1].T
        out.append((full > 0, (x0, y0)))
    return out


def _counts_string(counts: np.ndarray) -> str:
    """pycocotools' ``rleToString``: LEB128-like, 5 bits a character, deltas from two runs back."""
    chars = []
    cnts = [int(c) for c in counts]
    for i, c in enumerate(cnts):
        x = c - cnts[i - 2] if i > 2 else c
        more = True
        while more:
            ch = x & 0x1F
            x >>= 5
            more = (x != -1) if (ch & 0x10) else (x != 0)
            if more:
                ch |= 0x20
            chars.append(chr(ch + 48))
    return "".join(chars)


def rle_from_box_mask(mask: np.ndarray, origin: tuple[int, int], height: int, width: int) -> dict:
    """COCO compressed RLE of a ``height`` x ``width`` mask that is zero outside ``mask`` at ``origin`` (x, y)."""
    x0, y0 = origin
    bh, bw = mask.shape
    if mask.size == 0 or not mask.any():
        return {"size": [height, width], "counts": _counts_string(np.array([height * width]))}
    padded = np.zeros((bh + 2, bw), dtype=np.int8)
    padded[1:-1] = mask
    i, j = np.nonzero(np.diff(padded, axis=0))  # i: row in the box where a run starts, j: column
    order = np.lexsort((i, j))  # column-major: by column, then row
    starts = (x0 + j[order]).astype(np.int64) * height + y0 + i[order]
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
