"""The detector peer: the MQTT detection loop a user writes instead of running k2edge (bench/bench_peer.py).

paho-mqtt, Pillow, an ONNX Runtime session with default options and numpy, all inside
``on_message``: decode the request's base64 JPEG, letterbox it to the model's input (centred, pad
114, as YOLO exports expect), run the model, decode its YOLOv8 output (``[1, 4 + classes, anchors]``,
cx cy w h in input pixels, sigmoid scores): best class per anchor above the score threshold, greedy
NMS per class, boxes mapped back to the image's pixels; answer to the Response Topic.

    python bench/peer_detector.py HOST PORT TOPIC MODEL.onnx LABELS.txt [SIZE] [SCORE] [IOU]
"""

import base64
import io
import sys

import numpy as np
import onnxruntime as ort
from PIL import Image

from peer_mqtt import serve

host, port, topic, model, labels_file = sys.argv[1:6]
size = int(sys.argv[6]) if len(sys.argv) > 6 else 160
score_threshold = float(sys.argv[7]) if len(sys.argv) > 7 else 0.25
iou_threshold = float(sys.argv[8]) if len(sys.argv) > 8 else 0.45
session = ort.InferenceSession(model)  # default options, as a user writes it
input_name = session.get_inputs()[0].name
labels = open(labels_file).read().split()


def letterbox(img):
    w, h = img.size
    r = min(size / w, size / h)
    nw, nh = round(w * r), round(h * r)
    canvas = Image.new("RGB", (size, size), (114, 114, 114))
    px, py = (size - nw) // 2, (size - nh) // 2
    canvas.paste(img.resize((nw, nh), Image.BILINEAR), (px, py))
    x = np.asarray(canvas, dtype=np.float32).transpose(2, 0, 1)[None] / 255.0
    return x, r, px, py


def nms(boxes, scores, iou):
    order = np.argsort(-scores)
    keep = []
    while order.size:
        i = order[0]
        keep.append(i)
        if order.size == 1:
            break
        rest = order[1:]
        x1 = np.maximum(boxes[i, 0], boxes[rest, 0])
        y1 = np.maximum(boxes[i, 1], boxes[rest, 1])
        x2 = np.minimum(boxes[i, 2], boxes[rest, 2])
        y2 = np.minimum(boxes[i, 3], boxes[rest, 3])
        inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
        area_i = (boxes[i, 2] - boxes[i, 0]) * (boxes[i, 3] - boxes[i, 1])
        area_r = (boxes[rest, 2] - boxes[rest, 0]) * (boxes[rest, 3] - boxes[rest, 1])
        order = rest[inter / (area_i + area_r - inter + 1e-9) <= iou]
    return keep


def detect(jpeg):
    img = Image.open(io.BytesIO(jpeg)).convert("RGB")
    x, r, px, py = letterbox(img)
    out = session.run(None, {input_name: x})[0][0].T  # (anchors, 4 + classes)
    scores = out[:, 4:]
    cls = scores.argmax(1)
    best = scores[np.arange(len(cls)), cls]
    keep = best > score_threshold
    xywh, cls, best = out[keep, :4], cls[keep], best[keep]
    boxes = np.stack([xywh[:, 0] - xywh[:, 2] / 2, xywh[:, 1] - xywh[:, 3] / 2,
                      xywh[:, 0] + xywh[:, 2] / 2, xywh[:, 1] + xywh[:, 3] / 2], axis=1)
    found = []
    for c in np.unique(cls):
        idx = np.flatnonzero(cls == c)
        found += [idx[k] for k in nms(boxes[idx], best[idx], iou_threshold)]
    found = sorted(found, key=lambda i: -best[i])[:100]
    w, h = img.size
    result = []
    for i in found:
        b = (boxes[i] - [px, py, px, py]) / r
        b = np.clip(b, 0, [w, h, w, h])
        result.append({"index": int(cls[i]), "label": labels[cls[i]], "score": float(best[i]),
                       "box": [round(float(v), 2) for v in b]})
    return result


def answer(req):
    return {"id": req["id"], "status": "ok", "detections": detect(base64.b64decode(req["image"]))}


serve(host, port, topic, answer)
