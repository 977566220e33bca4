"""A straightforward reference decoder for YOLO outputs (loops, no vectorisation), written from the
layout descriptions, to check k2edge.tasks.detection against."""

from __future__ import annotations

import numpy as np


def iou(a, b) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def reference_decode(pred, fmt="yolov8", conf=0.25, iou_thr=0.45, max_det=100, agnostic=False):
    """One image: [(x1, y1, x2, y2, score, cls)] in input pixels, best first."""
    p = np.asarray(pred, dtype=np.float64)
    rows = p.T if fmt == "yolov8" else p
    cands = []
    for r in rows:
        if fmt == "yolov8":
            cls_scores = r[4:]
        else:
            if r[4] <= conf:
                continue
            cls_scores = r[5:] * r[4]
        c = int(np.argmax(cls_scores))
        s = float(cls_scores[c])
        if s > conf:
            cx, cy, w, h = r[:4]
            cands.append((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2, s, c))
    cands.sort(key=lambda t: -t[4])
    kept = []
    for c in cands:
        if all(iou(c, k) <= iou_thr for k in kept if agnostic or k[5] == c[5]):
            kept.append(c)
        if len(kept) == max_det:
            break
    return kept


def letterbox_back(boxes, orig_w, orig_h, in_w, in_h, mode="letterbox"):
    """Map input-pixel boxes back to the original image the way a user would, by hand."""
    out = []
    if mode == "stretch":
        sx, sy, px, py = in_w / orig_w, in_h / orig_h, 0, 0
    else:
        r = min(in_w / orig_w, in_h / orig_h)
        nw, nh = round(orig_w * r), round(orig_h * r)
        sx, sy = nw / orig_w, nh / orig_h
        px, py = ((in_w - nw) // 2, (in_h - nh) // 2) if mode == "letterbox" else (0, 0)
    for x1, y1, x2, y2, *rest in boxes:
        b = [(x1 - px) / sx, (y1 - py) / sy, (x2 - px) / sx, (y2 - py) / sy]
        b = [min(max(b[0], 0), orig_w), min(max(b[1], 0), orig_h), min(max(b[2], 0), orig_w), min(max(b[3], 0), orig_h)]
        out.append((*b, *rest))
    return out


def reference_pipeline(model_path, image, card, resize: str | None = None):
    """The whole path written out by hand for one image file: Pillow resize and padding as the card
    says, (pixel * scale - mean) / std, onnxruntime on the ONNX file, the loop decode, boxes mapped
    back to the original image. Returns [(x1, y1, x2, y2, score, cls)]."""
    import onnxruntime as ort
    from PIL import Image

    spec, det = card.input, card.detection
    resize = resize or spec.resize
    h, w = spec.size
    img = Image.open(image).convert("L" if spec.color == "L" else "RGB")
    ow, oh = img.size
    pad = (spec.pad_value,) * (1 if spec.color == "L" else 3)
    if resize == "stretch":
        canvas = img.resize((w, h), Image.Resampling.BILINEAR)
    else:
        r = min(w / ow, h / oh)
        nw, nh = round(ow * r), round(oh * r)
        canvas = Image.new(img.mode, (w, h), pad if len(pad) > 1 else pad[0])
        canvas.paste(img.resize((nw, nh), Image.Resampling.BILINEAR),
                     ((w - nw) // 2, (h - nh) // 2) if resize == "letterbox" else (0, 0))
    x = np.asarray(canvas, np.float32).reshape(h, w, -1)
    if spec.color == "BGR":
        x = x[..., ::-1]
    x = (x * spec.scale - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    x = np.ascontiguousarray(x.transpose(2, 0, 1)[None], dtype=np.float32)
    session = ort.InferenceSession(str(model_path))
    out = session.run(None, {session.get_inputs()[0].name: x})[0][0]
    boxes = reference_decode(out, det.format, det.score_threshold, det.iou_threshold, det.max_detections,
                             det.class_agnostic_nms)
    return letterbox_back(boxes, ow, oh, w, h, resize)
