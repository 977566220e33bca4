"""Bare ONNX Runtime on one model under the thread settings the daemon and the peer use (docs/performance.md,
"What the 1.3x and +0.3 ms bounds ask of two cores").

* ``threads``: median wall time of a run at batch 1 and 8, runs spaced ``--gap-ms`` apart (a request at a time):
  one intra-op thread (a daemon lane), two threads that spin between runs (ONNX Runtime's default, the peer's
  session), two threads that stop spinning after each run (``session.force_spinning_stop``, the daemon's setting).
* ``axis``: thread CPU ms a sample at ``--batch`` on one thread, the model's dynamic batch axis against the same
  model with the batch fixed, and the dynamic one without ONNX Runtime's memory pattern (the daemon's session).

Settings are interleaved round by round; read them against each other, not as absolute times.

    python bench/bench_ort_threads.py {threads,axis} [--model models/digits/model.onnx] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent


def session(model: bytes, threads: int, config: dict[str, str] | None = None, mem_pattern: bool = True):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.enable_mem_pattern = mem_pattern
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def feed(sess, batch: int) -> dict:
    spec = sess.get_inputs()[0]
    shape = [batch] + [d if isinstance(d, int) else 1 for d in spec.shape[1:]]
    return {spec.name: np.random.default_rng(0).random(shape, dtype=np.float32)}


def fixed_batch(model: onnx.ModelProto, batch: int) -> bytes:
    """The model with its first axis (inputs and outputs) fixed to ``batch``."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in (*fixed.graph.input, *fixed.graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        dim.ClearField("dim_param")
        dim.dim_value = batch
    return fixed.SerializeToString()


def threads(model: bytes, rounds: int, gap_s: float, runs: int = 30) -> None:
    sessions = {"1 thread": session(model, 1), "2 threads, spinning": session(model, 2),
                "2 threads, spinning stops": session(model, 2, {"session.force_spinning_stop": "1"})}
    for batch in (1, 8):
        medians: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(rounds):
            for name, sess in sessions.items():
                x, walls = feed(sess, batch), []
                for _ in range(runs):
                    t = time.perf_counter()
                    sess.run(None, x)
                    walls.append(time.perf_counter() - t)
                    time.sleep(gap_s)
                medians[name].append(statistics.median(walls) * 1e3)
        row = ", ".join(f"{name} {statistics.median(v):.3f} ms" for name, v in medians.items())
        print(f"batch {batch}, median wall a run ({rounds} rounds x {runs} runs, {gap_s * 1e3:g} ms apart): {row}")


def axis(model: onnx.ModelProto, rounds: int, batch: int, runs: int = 50) -> None:
    raw = model.SerializeToString()
    sessions = {"dynamic axis": session(raw, 1), "dynamic, no memory pattern": session(raw, 1, mem_pattern=False),
                f"fixed batch {batch}": session(fixed_batch(model, batch), 1)}
    per_sample: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, sess in sessions.items():
            x = feed(sess, batch)
            t = time.thread_time()
            for _ in range(runs):
                sess.run(None, x)
            per_sample[name].append((time.thread_time() - t) / runs / batch * 1e3)
    row = ", ".join(f"{name} {statistics.median(v):.3f}" for name, v in per_sample.items())
    print(f"batch {batch}, thread CPU ms a sample, one thread ({rounds} rounds x {runs} runs): {row}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["threads", "axis"])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "digits" / "model.onnx")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=0.5, help="threads: pause between runs")
    ap.add_argument("--batch", type=int, default=8, help="axis: the batch size")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.batch < 1 or args.gap_ms < 0:
        print("bench_ort_threads: --rounds and --batch must be >= 1, --gap-ms >= 0", file=sys.stderr)
        return 1
    try:
        model = onnx.load(str(args.model))
    except Exception as exc:  # noqa: BLE001 (a missing or broken file: one line, no traceback)
        print(f"bench_ort_threads: cannot read {args.model}: {exc}", file=sys.stderr)
        return 1
    print(f"{args.model}, onnxruntime {ort.__version__}")
    if args.what == "threads":
        threads(model.SerializeToString(), args.rounds, args.gap_ms / 1e3)
    else:
        axis(model, args.rounds, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
