"""Candidates for the daemon's inference costing more than bare ONNX Runtime, each measured on bare ONNX Runtime.

The model is ``bench_streams.py overload``'s YOLOv8n at 640, as the daemon builds it (``Engine.build``, profile
``cpu-dev``, a batch axis, the engine cache under ``--cache-dir``); the inputs are frames of the bench's video staged
by the card. Figures are thread CPU ms a run (``time.thread_time``), variants interleaved round by round; the
machine is shared, so read the variants of one command against each other.

* ``options``: one thread; the daemon's session against the peer's (the raw export, ONNX Runtime's defaults, one
  intra-op thread) and the daemon's with denormals flushed to zero; each on a real frame, uniform noise and zeros.
* ``sessions``: two workers on one session (the daemon) against a session each, and the engine's own ``submit`` path
  (its lanes; the batch array built as ``ModelRuntime`` did before a lone sample became its own batch).
* ``outputs``: ``run()`` against IOBinding into preallocated outputs (whether the output copy costs).
* ``readers``: two workers alone, with four PyAV readers decoding the bench's videos in the same process (15 fps,
  non-reference frames skipped, as the daemon's readers do while it is overloaded), and those with each worker
  pinned to a core.
* ``staging``: ``Preprocess.stage_mapped`` of a 640 x 480 frame into the letterbox, and PyAV's RGB conversion
  with its default threads against one (process CPU).

    python bench/bench_inference_candidates.py {options,sessions,outputs,readers,staging} [--rounds N] [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests" / "support"))


def assets(cache: Path):
    """(engine, its segment model, the raw export, the card's Preprocess, 4 staged frames, the videos)."""
    import av

    import bench_streams as bs
    from k2edge.config.card import load_card
    from k2edge.engine.engine import Engine
    from k2edge.tasks import Preprocess

    model, card = bs.yolov8n_640(cache)
    videos = bs.make_videos(cache, 4, 30.0)
    engine = Engine.build(str(model), "cpu-dev", cache_dir=str(cache / "engines"), spinning=False, threads_per_lane=0,
                          max_batch=8, card=str(card))
    pre = Preprocess.from_card(load_card(card))
    frames = []
    with av.open(str(videos[0])) as c:
        for i, f in enumerate(c.decode(video=0)):
            if i % 30 == 0:
                frames.append(pre.stage(f.to_ndarray(format="rgb24"))[None].copy())
            if len(frames) == 4:
                break
    return engine, engine.backend.build.segments[0].path, model, pre, frames, videos


def session(path: Path, daemon: bool = True, denormals_zero: bool = False):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.log_severity_level = 4
    if daemon:  # OnnxRuntimeBackend.activate_impl's options
        o.inter_op_num_threads = 1
        o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        o.enable_mem_pattern = False
        o.add_session_config_entry("session.disable_quant_qdq", "1")
        o.add_session_config_entry("session.force_spinning_stop", "1")
    if denormals_zero:
        o.add_session_config_entry("session.set_denormal_as_zero", "1")
    return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])


def workers(sessions: list, frames: list, seconds: float, pin: bool = False) -> tuple[float, float]:
    """One thread per session in ``sessions`` (the same one twice: two workers on it) for ``seconds``: (thread CPU ms
    a run, runs a second)."""
    stop, cpu, runs = threading.Event(), [0.0] * len(sessions), [0] * len(sessions)

    def loop(i: int) -> None:
        if pin:
            os.sched_setaffinity(threading.get_native_id(), {sorted(os.sched_getaffinity(0))[i % len(os.sched_getaffinity(0))]})
        s = sessions[i]
        name = s.get_inputs()[0].name
        s.run(None, {name: frames[0]})
        t0, k = time.thread_time(), 0
        while not stop.is_set():
            s.run(None, {name: frames[k % len(frames)]})
            k += 1
        cpu[i], runs[i] = time.thread_time() - t0, k

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(cpu) * 1e3 / max(sum(runs), 1), sum(runs) / seconds


def report(results: dict[str, list[float]], base: str | None = None) -> None:
    for name, values in results.items():
        ratio = ""
        if base is not None and name != base:
            ratio = f"; paired ratio to {base} {statistics.median(v / b for v, b in zip(values, results[base])):.3f}"
        print(f"{name:48s} median {statistics.median(values):7.2f} ms (rounds {', '.join(f'{v:.1f}' for v in values)}){ratio}")
    print(f"load average {os.getloadavg()[0]:.2f}")


def cmd_options(a, engine, segment, model, pre, frames, videos) -> None:
    rng = np.random.default_rng(0)
    inputs = {"real frame": frames, "noise": [rng.random(frames[0].shape, dtype=np.float32)],
              "zeros": [np.zeros_like(frames[0])]}
    variants = {"daemon": session(segment), "daemon, denormals zero": session(segment, denormals_zero=True),
                "peer (raw export, defaults)": session(model, daemon=False)}
    results: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for vn, s in variants.items():
            for inn, xs in inputs.items():
                name = s.get_inputs()[0].name
                s.run(None, {name: xs[0]})
                took = []
                for k in range(4):
                    t0 = time.thread_time()
                    s.run(None, {name: xs[k % len(xs)]})
                    took.append(time.thread_time() - t0)
                results.setdefault(f"{vn}, {inn}", []).append(statistics.median(took) * 1e3)
    report(results, "daemon, real frame")


def cmd_sessions(a, engine, segment, model, pre, frames, videos) -> None:
    one, two = session(segment), [session(segment), session(segment)]
    engine.activate()
    lanes = [t for t in threading.enumerate() if t.name.startswith("k2edge-lane")]

    def lane_cpu() -> float:
        return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in lanes)

    def engine_path() -> float:
        name, done, inflight, k = engine.input_name, 0, [], 0
        engine.infer({name: frames[0]})
        c0, end = lane_cpu(), time.perf_counter() + a.seconds
        while time.perf_counter() < end:
            while len(inflight) < len(lanes) + 1:  # the batcher's slots: one per lane plus one
                batch = np.empty(frames[0].shape, np.float32)
                batch[0] = frames[k % len(frames)][0]
                inflight.append(engine.submit({name: batch}))
                k += 1
            inflight.pop(0).result()
            done += 1
        for f in inflight:
            f.result()
            done += 1
        return (lane_cpu() - c0) * 1e3 / done

    results: dict[str, list[float]] = {}
    variants = [("one session, two workers", lambda: workers([one, one], frames, a.seconds)[0]),
                ("a session each", lambda: workers(two, frames, a.seconds)[0]), ("Engine.submit on its lanes", engine_path)]
    for r in range(a.rounds):
        for label, run in variants if r % 2 == 0 else variants[::-1]:  # ABC CBA: no variant always runs first
            results.setdefault(label, []).append(run())
    engine.deactivate()
    report(results, "one session, two workers")


def cmd_outputs(a, engine, segment, model, pre, frames, videos) -> None:
    s = session(segment)
    name, outs = s.get_inputs()[0].name, [o.name for o in s.get_outputs()]
    buffers = [np.empty_like(r) for r in s.run(outs, {name: frames[0]})]
    binding = s.io_binding()

    def bound(x):
        binding.bind_cpu_input(name, x)
        for n, b in zip(outs, buffers):
            binding.bind_output(n, "cpu", 0, b.dtype, b.shape, b.ctypes.data)
        s.run_with_iobinding(binding)
        return buffers

    plain = lambda x: s.run(outs, {name: x})  # noqa: E731
    assert all(np.array_equal(p, b) for p, b in zip(plain(frames[1]), bound(frames[1])))
    results: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for label, f in (("run()", plain), ("IOBinding, preallocated outputs", bound)):
            t0 = time.thread_time()
            for k in range(4):
                f(frames[k % len(frames)])
            results.setdefault(label, []).append((time.thread_time() - t0) / 4 * 1e3)
    report(results, "run()")


def cmd_readers(a, engine, segment, model, pre, frames, videos) -> None:
    import av

    s = session(segment)
    decoding = threading.Event()

    def reader(video: Path) -> None:
        while True:
            with av.open(str(video)) as c:
                vs = c.streams.video[0]
                vs.thread_type = "AUTO"
                vs.codec_context.skip_frame = "NONREF"
                t0, n = time.monotonic(), 0
                for _ in c.decode(vs):
                    decoding.wait()
                    n += 1
                    time.sleep(max(0.0, t0 + n / 15 * 450 / 241 - time.monotonic()))  # 241 of the 450 frames are references

    for v in videos:
        threading.Thread(target=reader, args=(v,), daemon=True).start()
    results: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for label, dec, pin in (("alone", False, False), ("with four readers", True, False), ("with four readers, pinned", True, True)):
            (decoding.set if dec else decoding.clear)()
            time.sleep(0.5)
            results.setdefault(label, []).append(workers([s, s], frames, a.seconds, pin)[0])
    report(results, "alone")


def cmd_staging(a, engine, segment, model, pre, frames, videos) -> None:
    import av

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for _ in range(8)]
    pictures = []
    with av.open(str(videos[0])) as c:
        for f in c.decode(video=0):
            pictures.append(f)
            if len(pictures) == 120:
                break
    results: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        t0 = time.thread_time()
        for i in range(40):
            pre.stage_mapped(images[i % len(images)])
        results.setdefault("stage_mapped, 640x480 into the 640 letterbox", []).append((time.thread_time() - t0) / 40 * 1e3)
        for label, kw in (("RGB conversion, PyAV's default threads (process CPU)", {}), ("RGB conversion, one thread (process CPU)", {"threads": 1})):
            t0 = time.process_time()
            for p in pictures:
                p.to_ndarray(format="rgb24", **kw)
            results.setdefault(label, []).append((time.process_time() - t0) / len(pictures) * 1e3)
    report(results)


COMMANDS = {"options": cmd_options, "sessions": cmd_sessions, "outputs": cmd_outputs, "readers": cmd_readers,
            "staging": cmd_staging}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=COMMANDS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=6.0, help="sessions, readers: seconds per variant and round")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k2edge-bench")
    a = ap.parse_args(argv)
    a.cache_dir.mkdir(parents=True, exist_ok=True)
    COMMANDS[a.command](a, *assets(a.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
