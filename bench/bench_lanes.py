"""How a one-device engine should use the cores: several single-threaded workers on one session, or one run
with as many intra-op threads, measured on bare ONNX Runtime (no daemon), A/B interleaved.

For each model and batch size, two layouts of one InferenceSession over the process's cores (its CPU
affinity, ``N``):

* ``workers``: ``N`` threads each calling ``run`` concurrently, ``intra_op_num_threads = 1`` (what
  ``threads_per_lane = 0`` chooses for a one-device profile: ``k2edge.engine.pipeline.lane_layout``);
* ``threads``: one thread calling ``run``, ``intra_op_num_threads = N`` (spinning stopped between runs, as the
  daemon sets it).

Per layout: samples per second and process CPU ms per sample, over ``--seconds`` per run, ``--rounds``
rounds; the median round is reported with the load average beside it. The machine is shared: the ratio
of the two layouts, measured in the same rounds, is the figure to read. :func:`inference_limit` (the
``workers`` layout at batch 1) is also what ``bench_streams.py overload`` reports as the machine's
inference-only limit.

With ``--memory`` it compares instead, for the ``workers`` layout on one session, ONNX Runtime's CPU memory
arena and memory pattern (its defaults), the arena without the pattern, and neither: each in a process of its
own running the batch sizes 1..4 on every worker, the process's RSS after, and CPU ms per sample, interleaved.

    python bench/bench_lanes.py [--rounds 3] [--seconds 8] [--json out.json]
    python bench/bench_lanes.py --memory [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

MIN_RUNS = 20  # per layout and round: fewer runs than this is not enough data for a rate


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


MEMORY_KINDS = {"default": (True, True), "no pattern": (True, False), "neither": (False, False)}  # (arena, pattern)


def _session(path: Path, threads: int, memory: str = "default"):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.enable_cpu_mem_arena, opts.enable_mem_pattern = MEMORY_KINDS[memory]
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def measure(session, feeds: dict, batch: int, workers: int, seconds: float) -> dict:
    """``workers`` threads running ``session`` concurrently for ``seconds``: samples/s and CPU ms per sample."""
    done = [0] * workers
    stop = threading.Event()

    def loop(i: int) -> None:
        while not stop.is_set():
            session.run(None, feeds)
            done[i] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(workers)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    runs = sum(done)
    return {"runs": runs, "samples_per_s": runs * batch / wall, "cpu_ms_per_sample": cpu * 1e3 / max(runs * batch, 1),
            "enough": runs >= MIN_RUNS}


def inference_limit(model_path: Path, shape: tuple[int, ...], seconds: float) -> dict:
    """Bare ONNX Runtime at batch 1 with one single-threaded run per core: what the machine can infer, and nothing else."""
    n = cores()
    session = _session(model_path, 1)
    x = {session.get_inputs()[0].name: np.random.default_rng(0).random((1, *shape[1:]), dtype=np.float32)}
    session.run(None, x)
    out = measure(session, x, 1, n, seconds)
    out.update(cores=n, load=os.getloadavg())
    return out


def _models(cache: Path) -> list[tuple[str, Path, tuple[int, ...]]]:
    """(name, normalised ONNX file at a dynamic batch, input shape) for the models the daemon benches use."""
    import onnx

    from k2edge.engine.engine import BATCH_AXIS_SIZES, load_normalised
    from k2edge.engine.cache import EngineCache
    from k2edge.model.batch_axis import with_batch_axis
    import bench_streams

    out = []
    yolo, _ = bench_streams.yolov8n_640(cache)
    for name, path, shape in (("digits", ROOT / "models" / "digits" / "model.onnx", None),
                              ("demo detector", ROOT / "models" / "detector" / "model.onnx", None),
                              ("yolov8n 640", yolo, (3, 640, 640))):
        ec = EngineCache(cache / "engines")
        pair = [load_normalised(path, ec, b, {"images": (b, *shape)} if shape else None).model for b in BATCH_AXIS_SIZES]
        model = with_batch_axis(*pair, BATCH_AXIS_SIZES, name)
        f = cache / f"lanes-{name.replace(' ', '-')}.onnx"
        onnx.save(model, str(f))
        dims = [d.dim_value for d in pair[0].graph.input[0].type.tensor_type.shape.dim]
        out.append((name, f, tuple(dims)))
    return out


def memory_run(path: Path, shape: tuple[int, ...], memory: str, runs: int) -> dict:
    """In this process: ``cores()`` workers each running batch sizes 1..4 ``runs`` times on one session; RSS after."""
    session = _session(path, 1, memory)
    name = session.get_inputs()[0].name
    feeds = {b: {name: np.random.default_rng(b).random((b, *shape[1:]), dtype=np.float32)} for b in (1, 2, 3, 4)}
    cpu0 = time.process_time()

    def loop(order):
        for _ in range(runs):
            for b in order:
                session.run(None, feeds[b])

    threads = [threading.Thread(target=loop, args=((1, 2, 3, 4) if i % 2 == 0 else (4, 3, 2, 1),)) for i in range(cores())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = runs * 10 * cores()
    statm = Path("/proc/self/statm").read_text().split()
    return {"rss_mib": int(statm[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20,
            "cpu_ms_per_sample": (time.process_time() - cpu0) * 1e3 / samples, "samples": samples}


def main_memory(args) -> int:
    import subprocess

    results = []
    for name, path, shape in _models(args.cache):
        runs = {k: [] for k in MEMORY_KINDS}
        for _ in range(args.rounds):
            for kind in MEMORY_KINDS:
                out = subprocess.run([sys.executable, __file__, "--memory-child", str(path), ",".join(map(str, shape)), kind],
                                     capture_output=True, text=True, check=True)
                runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("rss_mib", "cpu_ms_per_sample")} for k, v in runs.items()}
        results.append({"model": name, **med, "load_avg": os.getloadavg()[0]})
        base = med["default"]["cpu_ms_per_sample"]
        print(f"{name:14s} " + "; ".join(f"{k}: RSS {m['rss_mib']:.0f} MiB, {m['cpu_ms_per_sample']:.2f} CPU ms a sample "
                                          f"({m['cpu_ms_per_sample'] / base:.2f}x)" for k, m in med.items())
              + f"; load {os.getloadavg()[0]:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--memory-child"]:
        path, shape, memory = argv[1], tuple(int(x) for x in argv[2].split(",")), argv[3]
        big = shape[-1] >= 320
        print(json.dumps(memory_run(Path(path), shape, memory, 3 if big else 50)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0, help="per layout, model, batch and round")
    ap.add_argument("--batches", default="1,4", help="batch sizes, comma-separated")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k2edge-bench")
    ap.add_argument("--memory", action="store_true", help="compare ONNX Runtime's arena and memory pattern with neither")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    args.cache = args.cache_dir
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.memory:
        return main_memory(args)
    n = cores()
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    print(f"{n} cores in this process's affinity; {args.rounds} rounds x {args.seconds:.0f} s per layout, A/B interleaved; "
          f"load average at the start {os.getloadavg()[0]:.2f}", flush=True)
    for name, path, shape in _models(args.cache):
        by_layout = {"workers": _session(path, 1), "threads": _session(path, n)}
        for batch in batches:
            x = {by_layout["workers"].get_inputs()[0].name: np.random.default_rng(0).random((batch, *shape[1:]), dtype=np.float32)}
            for s in by_layout.values():
                s.run(None, x)
            rounds = {"workers": [], "threads": []}
            loads = []
            for _ in range(args.rounds):
                for layout in ("workers", "threads"):
                    rounds[layout].append(measure(by_layout[layout], x, batch, n if layout == "workers" else 1, args.seconds))
                    loads.append(os.getloadavg()[0])
            med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in rounds.items()}
            cpu = {k: statistics.median(r["cpu_ms_per_sample"] for r in v) for k, v in rounds.items()}
            enough = all(r["enough"] for v in rounds.values() for r in v)
            row = {"model": name, "batch": batch, "samples_per_s": med, "cpu_ms_per_sample": cpu,
                   "ratio_workers_over_threads": med["workers"] / med["threads"], "load_avg": [min(loads), max(loads)],
                   "runs": {k: [r["runs"] for r in v] for k, v in rounds.items()}, "enough_data": enough}
            results.append(row)
            print(f"{name:14s} batch {batch}: {n} workers x 1 thread {med['workers']:7.1f}/s ({cpu['workers']:.2f} CPU ms each), "
                  f"1 run x {n} threads {med['threads']:7.1f}/s ({cpu['threads']:.2f} CPU ms each): "
                  f"{row['ratio_workers_over_threads']:.2f}x; load {min(loads):.2f}-{max(loads):.2f}"
                  + ("" if enough else f"; not enough data (fewer than {MIN_RUNS} runs in a round)"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
