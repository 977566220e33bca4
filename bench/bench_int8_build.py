"""A cold INT8 build with the accuracy check and the automatic fallback, for a YOLOv8n at 320 x 320.

The model is tests/fixtures/yolov8n-320 (the real YOLOv8n graph: 8.7 GFLOPs at 640, SiLU everywhere, DFL head;
its weights are refilled deterministically, so it detects nothing: the check uses the tensor task's cosine
measure). Calibration: the demo detector's 64 photos (51 calibrate, 13 check). A strict cosine tolerance makes
INT8 miss it, so the build ranks learned layers by their measured effect on the output and bisects how many move
to FP16: the whole path a real model
takes when INT8 hurts it. Each profile builds into an empty cache (calibration, check, fallback, Q/DQ models,
segment models); a second build of the same profile is timed too (everything from the cache).

Bound: the whole build with fallback at most 3 minutes on the 2-core development machine. Not in CI.

    python bench/bench_int8_build.py [--profiles gpu-int8,c4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

PROFILES = {
    "gpu-int8": {"name": "gpu-int8", "edge_runtime": {"offload_ratio": 1.0, "precision_fallback": ["int8", "fp16"]}},
    "c4": "c4",
}
CARD = """task = "tensor"
[input]
size = [320, 320]
resize = "pad-right"
pad_value = 114
scale = 0.00392156862745098
[quantization]
tolerance = { cosine = 0.99997 }
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="gpu-int8,c4")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()

    import zoo
    from k2edge import Engine

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = zoo.save("yolov8n-320", tmp / "yolov8n-320.onnx")
        card = tmp / "yolov8n-320.card.toml"
        card.write_text(CARD)
        for name in args.profiles.split(","):
            cache = tmp / f"cache-{name}"
            t0 = time.perf_counter()
            engine = Engine.build(model, PROFILES[name], calib=ROOT / "models/detector/calib", card=card,
                                  cache_dir=cache, backend="onnxruntime")
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            Engine.build(model, PROFILES[name], calib=ROOT / "models/detector/calib", card=card, cache_dir=cache,
                         backend="onnxruntime")
            warm = time.perf_counter() - t0
            check = engine.info.int8_check
            row = {"profile": name, "cold_build_s": round(cold, 1), "cached_build_s": round(warm, 2),
                   "status": check.status, "layers_to_fp16": len(check.fallback),
                   "before": check.before, "after": check.measures, "nodes": len(engine.model.graph.nodes)}
            results.append(row)
            print(f"{name}: cold build {cold:.1f} s ({check.status}, {len(check.fallback)} of {row['nodes']} layers to "
                  f"fp16; cosine {check.before and check.before['cosine']} -> {check.measures['cosine']}), "
                  f"cached build {warm:.2f} s")
    doc = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
