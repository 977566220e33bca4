"""Instance segmentation (YOLOv8-seg / YOLO11-seg): boxes as detection, plus one mask each.

The export has two outputs: ``output0`` ``[N, 4 + classes + M, anchors]`` (M mask coefficients
after the class scores; ``[N, K, 6 + M]`` for an end2end export) and ``output1`` ``[N, M, mh, mw]``
prototypes at a quarter of the input size. A box's mask is ``coefficients @ prototypes``, upsampled
to the original image as Ultralytics' ``process_mask_native`` does (the letterbox padding cropped
off the prototypes, bilinear with half-pixel centres, cropped to the box, ``> 0``), computed only
inside the box: the cost is the boxes' area, not the image's times the boxes.

Masks leave as COCO RLE (``{"size": [h, w], "counts": "..."}``, pycocotools' compressed string,
column-major), built from the box's pixels alone.
"""

from __future__ import annotations

import numpy as np

from .preprocess import Geometry

__all__ = ["box_masks", "rle_encode", "rle_decode", "rle_from_box_mask"]


def _interp_taps(n_src: int, n_dst: int, dst: np.ndarray, offset: float = 0.0):
    """Bilinear taps (align_corners=False, as ``F.interpolate``) for destination indices ``dst`` of an
    ``n_src`` -> ``n_dst`` resize; ``offset`` is where the source crop starts (its index 0)."""
    pos = (dst.astype(np.float64) + 0.5) * (n_src / n_dst) - 0.5
    pos = np.maximum(pos, 0.0)  # PyTorch clamps negative source positions to 0
    lo = np.floor(pos).astype(np.int64)
    w = pos - lo
    lo = np.minimum(lo, n_src - 1)
    hi = np.minimum(lo + 1, n_src - 1)
    return lo + int(offset), hi + int(offset), w.astype(np.float32)


def _proto_window(mh: int, mw: int, geometry: Geometry | None) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of the prototypes that cover the original image (the letterbox
    padding cropped off), as Ultralytics' ``scale_masks``: ``gain = min(mh / h, mw / w)``."""
    if geometry is None:
        return 0, 0, mh, mw
    h, w = geometry.height, geometry.width
    gain = min(mh / h, mw / w)
    pad_w, pad_h = (mw - w * gain) / 2, (mh - h * gain) / 2
    top, left = int(round(pad_h - 0.1)), int(round(pad_w - 0.1))
    bottom, right = mh - int(round(pad_h + 0.1)), mw - int(round(pad_w + 0.1))
    return top, left, bottom, right


def box_masks(protos: np.ndarray, coefficients: np.ndarray, boxes: np.ndarray,
              geometry: Geometry | None, input_size: tuple[int, int]) -> list[tuple[np.ndarray, tuple[int, int]]]:
    """Each box's binary mask inside the box, in original-image pixels.

    Args:
        protos: (M, mh, mw) one image's prototypes.
        coefficients: (k, M) per box.
        boxes: (k, 4) ``x1 y1 x2 y2`` in original-image pixels (input pixels when ``geometry`` is None).
        geometry: where the image landed in the input (None: the mask is at the input's size).
        input_size: (height, width) of the model input (the frame when ``geometry`` is None).

    Returns:
        per box: (bool mask (y2 - y1, x2 - x1), (x1, y1)) with integer bounds of the pixels whose
        centres the box covers (Ultralytics' ``crop_mask``: ``x1 <= x < x2``).
    """
    m, mh, mw = protos.shape
    H, W = (geometry.height, geometry.width) if geometry is not None else input_size
    top, left, bottom, right = _proto_window(mh, mw, geometry)
    ch, cw = bottom - top, right - left
    flat = protos.reshape(m, -1).astype(np.float32)
    out = []
    for coef, (x1, y1, x2, y2) in zip(np.asarray(coefficients, np.float32), np.asarray(boxes, np.float64)):
        # pixels x with x1 <= x < x2 (x the integer index, as crop_mask compares aranges with the box)
        xs = np.arange(max(0, int(np.ceil(x1))), min(W, int(np.ceil(x2))))
        ys = np.arange(max(0, int(np.ceil(y1))), min(H, int(np.ceil(y2))))
        if xs.size == 0 or ys.size == 0:
            out.append((np.zeros((0, 0), bool), (0, 0)))
            continue
        ylo, yhi, wy = _interp_taps(ch, H, ys, top)
        xlo, xhi, wx = _interp_taps(cw, W, xs, left)
        rows = np.unique(np.concatenate([ylo, yhi]))
        cols = np.unique(np.concatenate([xlo, xhi]))
        # the mask logits only on the prototype pixels the box's interpolation reads
        sub = (coef @ flat.reshape(m, mh, mw)[:, rows][:, :, cols].reshape(m, -1)).reshape(len(rows), len(cols))
        ry = np.searchsorted(rows, ylo), np.searchsorted(rows, yhi)
        rx = np.searchsorted(cols, xlo), np.searchsorted(cols, xhi)
        vert = sub[ry[0]] * (1 - wy)[:, None] + sub[ry[1]] * wy[:, None]
        full = vert[:, rx[0]] * (1 - wx) + vert[:, rx[1]] * wx
        out.append((full > 0, (int(xs[0]), int(ys[0]))))
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


def rle_decode(rle: dict) -> np.ndarray:
    """The (h, w) bool mask of a compressed RLE (for tests, annotation and evaluation without pycocotools)."""
    h, w = rle["size"]
    s = rle["counts"]
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
    flat = np.zeros(h * w, dtype=bool)
    pos, val = 0, False
    for c in counts:
        if val:
            flat[pos:pos + c] = True
        pos += c
        val = not val
    return flat.reshape(w, h).T
