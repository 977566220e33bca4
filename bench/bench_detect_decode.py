"""Detection decoding speed: a YOLOv8-layout output of 8,400 anchors x 80 classes (640 x 640 input).

Cases, each timed over many repetitions in one run (median = p50, and p90):

1. typical: about 300 candidates above the 0.25 threshold, around 30 objects (its bound: p50 at most 1 ms);
2. all anchors pass (a poorly trained model): bounded by ``max_candidates`` (default 1,000);
3. a batch of 8 typical images, per image.

For scale, the same run times one pass of ``max`` over the class scores (the least any decoder
must read) and, on the typical case, a straightforward loop decode (tests/support/detect_reference.py).

    python bench/bench_detect_decode.py [--repeat 300] [--json out.json]
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
sys.path.insert(0, str(ROOT / "tests" / "support"))

from k2edge.config.card import DetectionSpec  # noqa: E402
from k2edge.tasks.detection import decode, decode_one  # noqa: E402

TYPICAL_P50_BOUND_MS = 1.0  # the typical case's p50 decode time: at most


def scene(rng, n_obj=30, per_obj=10, anchors=8400, classes=80, size=640) -> np.ndarray:
    """``per_obj`` jittered candidates above the threshold around each of ``n_obj`` objects; the rest below."""
    pred = np.empty((4 + classes, anchors), np.float32)
    pred[:2] = rng.uniform(0, size, (2, anchors))
    pred[2:4] = rng.uniform(8, 120, (2, anchors))
    pred[4:] = rng.uniform(0, 0.2, (classes, anchors))
    slots = rng.choice(anchors, n_obj * per_obj, replace=False)
    for k in range(n_obj):
        cx, cy, w, h = rng.uniform(40, size - 40, 2).tolist() + rng.uniform(20, 120, 2).tolist()
        c = rng.integers(classes)
        for j in slots[k * per_obj:(k + 1) * per_obj]:
            pred[:4, j] = (cx + rng.normal(0, 3), cy + rng.normal(0, 3), w * rng.uniform(0.9, 1.1), h * rng.uniform(0.9, 1.1))
            pred[4 + c, j] = rng.uniform(0.3, 0.95)
    return pred


def timed(fn, repeat: int) -> dict:
    fn()  # warm
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"p50_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))], "repeat": repeat}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    spec = DetectionSpec()
    typical = scene(rng)
    candidates = int((typical[4:].max(axis=0) > spec.score_threshold).sum())
    everything = typical.copy()
    everything[4:] = rng.uniform(0.3, 1.0, everything[4:].shape).astype(np.float32)
    batch = np.stack([scene(rng) for _ in range(8)])

    results = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "numpy": np.__version__,
        "typical": {"candidates": candidates, "kept": len(decode_one(typical, spec)), **timed(lambda: decode_one(typical, spec), args.repeat),
                    "p50_bound": f"at most {TYPICAL_P50_BOUND_MS} ms"},
        "all_pass": {"candidates": everything.shape[1], "entering_nms": spec.max_candidates,
                     "kept": len(decode_one(everything, spec)), **timed(lambda: decode_one(everything, spec), max(20, args.repeat // 10))},
        "batch8": timed(lambda: decode(batch, spec), max(20, args.repeat // 8)),
        "max_pass": timed(lambda: typical[4:].max(axis=0), args.repeat),
    }
    results["batch8"]["per_image_p50_ms"] = results["batch8"]["p50_ms"] / 8
    from detect_reference import reference_decode

    results["loop_reference"] = timed(lambda: reference_decode(typical), 3)
    t, a = results["typical"], results["all_pass"]
    print(f"YOLOv8 layout [1, 84, 8400], threshold {spec.score_threshold}, IoU {spec.iou_threshold}, on {results['machine']}")
    print(f"typical   {t['candidates']} candidates -> {t['kept']} boxes: p50 {t['p50_ms']:.3f} ms, p90 {t['p90_ms']:.3f} ms "
          f"(bound: p50 at most {TYPICAL_P50_BOUND_MS} ms)")
    print(f"all pass  {a['candidates']} candidates, {a['entering_nms']} enter NMS -> {a['kept']} boxes: "
          f"p50 {a['p50_ms']:.3f} ms, p90 {a['p90_ms']:.3f} ms")
    print(f"batch 8   p50 {results['batch8']['p50_ms']:.3f} ms ({results['batch8']['per_image_p50_ms']:.3f} ms per image)")
    print(f"for scale: one max over the class scores {results['max_pass']['p50_ms']:.3f} ms; loop reference decode "
          f"{results['loop_reference']['p50_ms']:.1f} ms ({results['loop_reference']['p50_ms'] / t['p50_ms']:.0f}x slower)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
