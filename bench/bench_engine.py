"""Engine benchmarks on the demo model, all measured in one run on this machine.

Prints, side by side:

1. bare onnxruntime vs ``Engine.infer`` at batch 1 (its bound: p50 overhead at most 5 % of bare + 0.1 ms);
2. the best split pipeline vs one lane, throughput with requests in flight;
3. prefetch on vs off, throughput on JPEG inputs (its bound: at least 1.2x with prefetch on ``c5``).

Absolute times on a shared machine are noisy, so every comparison is a ratio against a baseline
measured in the same run, A/B interleaved over several rounds (the median round is reported).
Nothing here is a DLA or Jetson number: every device is a CPU lane.

    python bench/bench_engine.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k2edge import Engine, load_profile  # noqa: E402

MODEL = ROOT / "models" / "digits" / "model.onnx"
OVERHEAD_BOUND_PCT, OVERHEAD_BOUND_MS = 5.0, 0.1  # Engine.infer's p50 over bare onnxruntime: at most 5 % + 0.1 ms
PREFETCH_BOUND = 1.2  # JPEG throughput with the prefetch ring over inline staging, single-lane c5: at least


def _profile(partition, ratio, prefetch=False, cores=None, chain=("fp16",)):
    er = {"tensorrt_partition": partition, "offload_ratio": ratio, "dma_prefetch": prefetch,
          "precision_fallback": list(chain)}
    if cores is not None:
        er["dla_cores"] = cores
    return load_profile({"name": f"{partition}@{ratio}" + (f"/{cores}dla" if cores is not None else ""), "edge_runtime": er})


def _p50_ms(fn, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_overhead(rounds: int, n: int) -> dict:
    import onnxruntime as ort

    engine = Engine.build(MODEL, "cpu-dev").activate()
    seg = engine.backend.build.segments[0].path
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = engine.backend.threads_per_lane
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    bare = ort.InferenceSession(str(seg), opts, providers=["CPUExecutionProvider"])
    x = {"input": np.random.default_rng(0).standard_normal((1, 1, 32, 32)).astype(np.float32)}
    for _ in range(200):  # warm-up both
        bare.run(None, x)
        engine.infer(x)
    bare_ms, eng_ms = [], []
    for _ in range(rounds):
        bare_ms.append(_p50_ms(lambda: bare.run(None, x), n))
        eng_ms.append(_p50_ms(lambda: engine.infer(x), n))
    engine.deactivate()
    b, e = statistics.median(bare_ms), statistics.median(eng_ms)
    return {"bare_p50_ms": b, "engine_p50_ms": e, "overhead_ms": e - b, "overhead_pct": 100 * (e - b) / b,
            "bound_ms": OVERHEAD_BOUND_PCT / 100 * b + OVERHEAD_BOUND_MS}


def _throughput(engine, batches, in_flight=8) -> float:
    t0 = time.perf_counter()
    pending = []
    for x in batches:
        pending.append(engine.submit({"input": x}))
        if len(pending) >= in_flight:
            pending.pop(0).result()
    for f in pending:
        f.result()
    return len(batches) / (time.perf_counter() - t0)


def bench_pipeline(rounds: int, n: int) -> dict:
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((1, 1, 32, 32)).astype(np.float32) for _ in range(n)]
    candidates = [_profile("layer-wise", 1.0)]  # one lane: the baseline
    for partition in ("layer-wise", "block-wise"):
        for ratio in (0.35, 0.5, 0.65):
            for cores in (1, 2):
                candidates.append(_profile(partition, ratio, cores=cores))
    candidates.append(_profile("model-wise", 0.5, cores=1))
    engines = [Engine.build(MODEL, p, precision="fp32").activate() for p in candidates]
    for e in engines:
        _throughput(e, batches[:100])
    runs = {p.name: [] for p in candidates}
    for _ in range(rounds):
        for p, e in zip(candidates, engines):
            runs[p.name].append(_throughput(e, batches))
    for e in engines:
        e.deactivate()
    med = {k: statistics.median(v) for k, v in runs.items()}
    base = med[candidates[0].name]
    best = max((k for k in med if k != candidates[0].name), key=med.get)
    lanes = {p.name: [lane.label for lane in e.lanes()] for p, e in zip(candidates, engines)}
    return {"one_lane_per_s": base, "best": best, "best_lanes": lanes[best], "best_per_s": med[best],
            "speedup": med[best] / base, "all_per_s": med}


def _jpegs(n: int, size: tuple[int, int]) -> list[bytes]:
    """Camera-like frames: demo digits scaled up to ``size`` and JPEG-encoded in memory."""
    from PIL import Image

    with np.load(ROOT / "models" / "digits" / "eval.npz") as d:
        x = d["x"]
    out = []
    for i in range(n):
        img = Image.fromarray(x[i % len(x)]).resize(size, Image.Resampling.BILINEAR).convert("RGB")
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def bench_prefetch(rounds: int, n: int, size: tuple[int, int]) -> dict:
    """The same engine streams the same JPEGs with the prefetch ring and with inline staging."""
    jpegs = _jpegs(n, size)
    rows = {}
    for name in ("c5", "c1"):
        engine = Engine.build(MODEL, name, calib=ROOT / "models" / "digits" / "calib").activate()

        def run(prefetch):
            t0 = time.perf_counter()
            count = sum(1 for r in engine.stream(jpegs, prefetch=prefetch) if r.error is None)
            assert count == len(jpegs)
            return count / (time.perf_counter() - t0)

        run(True), run(False)
        on, off = [], []
        for _ in range(rounds):
            on.append(run(True))
            off.append(run(False))
        t0 = time.perf_counter()
        for j in jpegs[:200]:
            engine.stage([j])
        stage_ms = (time.perf_counter() - t0) / 200 * 1e3
        on_m, off_m = statistics.median(on), statistics.median(off)
        rows[name] = {"lanes": [lane.label for lane in engine.lanes()], "threads_per_lane": engine.backend.threads_per_lane,
                      "stage_ms_per_image": stage_ms, "prefetch_off_per_s": off_m, "prefetch_on_per_s": on_m,
                      "speedup": on_m / off_m}
        engine.deactivate()
    return {"jpeg_size": f"{size[0]}x{size[1]}", "profiles": rows, "c5_speedup": rows["c5"]["speedup"],
            "c5_speedup_bound": PREFETCH_BOUND}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--jpeg-size", default="640x480", help="WxH of the JPEG frames for the prefetch run")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    import onnxruntime

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
          f"{platform.python_version()}, onnxruntime {onnxruntime.__version__}; every device is a CPU lane")
    o = bench_overhead(args.rounds, args.requests)
    print(f"\n1. batch-1 latency, p50   bare onnxruntime {o['bare_p50_ms']:.3f} ms | Engine.infer {o['engine_p50_ms']:.3f} ms"
          f" | overhead {o['overhead_ms']:.3f} ms ({o['overhead_pct']:.1f} %); bound: at most {o['bound_ms']:.3f} ms"
          f" ({OVERHEAD_BOUND_PCT:.0f} % of bare + {OVERHEAD_BOUND_MS} ms)")
    p = bench_pipeline(args.rounds, args.requests)
    print(f"\n2. throughput, 8 in flight   one lane {p['one_lane_per_s']:.0f}/s | best split {p['best']} "
          f"({', '.join(p['best_lanes'])}) {p['best_per_s']:.0f}/s | {p['speedup']:.2f}x")
    for name, rate in p["all_per_s"].items():
        print(f"     {name:28} {rate:8.0f}/s")
    w, h = (int(v) for v in args.jpeg_size.lower().split("x"))
    f = bench_prefetch(args.rounds, args.requests, (w, h))
    print(f"\n3. JPEG {f['jpeg_size']} frames, decode+resize+normalise per frame; same engine, prefetch ring vs inline staging")
    for name, r in f["profiles"].items():
        print(f"     {name} ({', '.join(r['lanes'])}; {r['threads_per_lane']} thread(s)/lane; staging {r['stage_ms_per_image']:.2f} ms)"
              f"   off {r['prefetch_off_per_s']:.0f}/s | on {r['prefetch_on_per_s']:.0f}/s | {r['speedup']:.2f}x")
    print(f"     single-lane profile c5: {f['c5_speedup']:.2f}x; bound: at least {f['c5_speedup_bound']}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"overhead": o, "pipeline": p, "prefetch": f}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
