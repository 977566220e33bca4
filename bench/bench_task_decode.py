"""Decode speed per Ultralytics task, on a 640 x 640 input of a 640 x 480 image (8,400 anchors):

1. detection: YOLOv8 layout, 80 classes, 30 objects with 10 candidates each (the rest below 0.25);
2. end2end: ``[300, 6]`` already NMS'd (YOLOv10, ``nms=True``), 30 above the threshold;
3. segmentation: the detection scene plus 32 mask coefficients, prototypes 32 x 160 x 160; each
   kept object's mask at 640 x 480 computed inside its box, as COCO RLE (its bound: p50 at most 5 ms);
4. pose: 1 class, 17 keypoints x 3, 30 people;
5. obb: 15 classes, 30 rotated objects, rotated NMS by probiou.

Each case is the whole answer as ``k2edge infer --json`` builds it (``TaskDecoder.answers``),
timed many times in one run (median = p50, and p90).

    python bench/bench_task_decode.py [--repeat 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k2edge.config.card import DetectionSpec, InputSpec, ModelCard, PoseSpec  # noqa: E402
from k2edge.config.ultralytics import COCO_KEYPOINTS  # noqa: E402
from k2edge.tasks import Preprocess, TaskDecoder  # noqa: E402

SIZE, ANCHORS, N_OBJ, PER_OBJ = 640, 8400, 30, 10


def _scene(rng, classes: int, extra: int) -> tuple[np.ndarray, list]:
    pred = np.zeros((1, 4 + classes + extra, ANCHORS), np.float32)
    pred[0, :2] = rng.uniform(0, SIZE, (2, ANCHORS))
    pred[0, 2:4] = rng.uniform(8, 120, (2, ANCHORS))
    pred[0, 4:4 + classes] = rng.uniform(0, 0.2, (classes, ANCHORS))
    slots = rng.choice(ANCHORS, N_OBJ * PER_OBJ, replace=False)
    objects = []
    for k in range(N_OBJ):
        cx, cy = rng.uniform(60, SIZE - 60), rng.uniform(140, SIZE - 140)  # inside the 640x480 image (pad 80)
        w, h = rng.uniform(30, 140, 2)
        c = int(rng.integers(classes))
        objects.append((cx, cy, w, h))
        for j in slots[k * PER_OBJ:(k + 1) * PER_OBJ]:
            pred[0, :4, j] = cx + rng.normal(0, 3), cy + rng.normal(0, 3), w * rng.uniform(0.9, 1.1), h * rng.uniform(0.9, 1.1)
            pred[0, 4 + c, j] = rng.uniform(0.3, 0.95)
            if extra:
                pred[0, 4 + classes:, j] = rng.normal(0, 1, extra)
    return pred, objects


def _card(task: str, fmt: str = "yolov8") -> ModelCard:
    return ModelCard(task=task, input=InputSpec(size=(SIZE, SIZE), resize="letterbox", color="RGB"),
                     detection=DetectionSpec(format=fmt, iou_threshold=0.7, max_detections=300),
                     pose=PoseSpec(keypoints=COCO_KEYPOINTS) if task == "pose" else PoseSpec())


def timed(fn, repeat: int) -> dict:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"p50_ms": round(statistics.median(times), 3), "p90_ms": round(times[int(0.9 * (len(times) - 1))], 3),
            "repeat": repeat}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    geometry = [Preprocess(_card("detection").input).geometry(640, 480)]
    cases = {}

    det, _ = _scene(rng, 80, 0)
    cases["detection"] = (_card("detection"), {"output0": det})
    e2e = np.zeros((1, 300, 6), np.float32)
    e2e[0, :, 4] = np.linspace(0.9, 0.01, 300)
    e2e[0, :, :2] = rng.uniform(0, 500, (300, 2))
    e2e[0, :, 2:4] = e2e[0, :, :2] + rng.uniform(20, 100, (300, 2))
    cases["end2end"] = (_card("detection", "end2end"), {"output0": e2e})
    seg, objects = _scene(rng, 80, 32)
    protos = np.zeros((1, 32, 160, 160), np.float32)
    yy, xx = np.mgrid[0:160, 0:160].astype(np.float32)
    for k in range(32):  # smooth blobs, so masks have real edges
        cx, cy, w, h = objects[k % len(objects)]
        protos[0, k] = np.exp(-0.5 * (((xx - cx / 4) / (w / 8)) ** 2 + ((yy - cy / 4) / (h / 8)) ** 2)) - 0.5
    cases["segmentation"] = (_card("segmentation"), {"output0": seg, "output1": protos})
    pose, _ = _scene(rng, 1, 51)
    cases["pose"] = (_card("pose"), {"output0": pose})
    obb, _ = _scene(rng, 15, 1)
    cases["obb"] = (_card("obb"), {"output0": obb})

    results = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "numpy": np.__version__}
    for name, (card, outputs) in cases.items():
        labels = [str(i) for i in range(80 if name in ("detection", "end2end", "segmentation") else 1 if name == "pose" else 15)]
        dec = TaskDecoder(card, labels, {k: v.shape for k, v in outputs.items()})
        kept = len(dec.answers(outputs, 1, geometry)[0]["detections"])
        results[name] = {"kept": kept, **timed(lambda: dec.answers(outputs, 1, geometry), args.repeat)}
        print(f"{name:13} {kept:3} kept  p50 {results[name]['p50_ms']:7.3f} ms  p90 {results[name]['p90_ms']:7.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
