"""Where the daemon's CPU goes on the overload streams, by thread, against bare ONNX Runtime in the same minutes.

``k2edge serve`` runs alone on ``bench_streams.py overload``'s streams (YOLOv8n at 640, four 640 x 480 streams at
15 fps, the bench's rig). Per round, over ``--seconds``: the CPU of each of the daemon's threads (``/proc/<pid>/task``,
names from ``py-spy dump``) per published frame, and the thread CPU of every ``Session.run`` the lanes made (timed
around the run inside the daemon, through a ``sitecustomize`` this script writes; the daemon's code is unchanged).
Then the daemon is stopped (SIGSTOP) for ``--bare-seconds`` and bare ONNX Runtime runs the daemon's own segment model
(its session options, two single-threaded workers, frames of the bench's video staged by the card) in the same
process' stead: the two inference figures are then measured with the same other work on the cores, a minute apart at
most. ``--root`` runs another checkout's daemon (an A/B against an earlier commit).

    python bench/bench_stream_threads.py [--rounds 3] [--seconds 15] [--root ../main]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests" / "support"))

import bench_streams as bs  # noqa: E402

TCK = os.sysconf("SC_CLK_TCK")
SITE = '''import json, os, threading, time
from k2edge.engine import onnxruntime_backend as _ob
from k2edge.service import stream_path as _sp
_acc = {}
def _timed(what, fn):
    def timed(*args):
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            cpu, calls = _acc.get(what, (0.0, 0))
            _acc[what] = (cpu + time.thread_time() - t0, calls + 1)
    return timed
_where = "_run_on" if hasattr(_ob.OnnxRuntimeBackend, "_run_on") else "_run_segment"  # the lanes' run (before: one session)
setattr(_ob.OnnxRuntimeBackend, _where, _timed("run", getattr(_ob.OnnxRuntimeBackend, _where)))
_sp.StreamPath.stage = _timed("stage", _sp.StreamPath.stage)
def _dump(path=os.environ["K2EDGE_BENCH_RUNS"]):
    while True:
        time.sleep(0.5)
        with open(path + ".tmp", "w") as f:
            json.dump(_acc, f)
        os.replace(path + ".tmp", path)
threading.Thread(target=_dump, daemon=True, name="bench-runs").start()
'''


def thread_cpu(pid: int) -> dict[int, float]:
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            f = (t / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(t.name)] = (int(f[11]) + int(f[12])) / TCK
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name (py-spy prints the native id on Linux); a dump that misses is retried."""
    spy = Path(sys.executable).with_name("py-spy")
    for _ in range(5):
        text = subprocess.run([str(spy if spy.exists() else "py-spy"), "dump", "--pid", str(pid), "--nonblocking"],
                              capture_output=True, text=True).stdout
        names = {int(m.group(1), 0): m.group(2) for m in re.finditer(r'Thread (\S+) \([^)]*\): "([^"]+)"', text)}
        if any(n.startswith("k2edge-lane") for n in names.values()):
            return names
        time.sleep(1)
    raise bs.BenchError("py-spy dump did not name the daemon's threads (pip install py-spy)")


def group(name: str | None) -> str:
    if name is None:
        return "native threads (FFmpeg's decoders)"
    if name.startswith("k2edge-lane"):
        return "lanes"
    if name.startswith("k2edge-stream"):
        return "readers"
    if name.startswith("k2edge-batch"):
        return "batcher (RGB, letterbox, submit)"
    if name.startswith("k2edge-mqtt"):
        return "transport"
    if name == "bench-runs":
        return "the bench's own dump (not counted)"
    return "other"


def daemon_segment(cache: Path, model: Path, card: Path) -> Path:
    """The segment model the daemon runs (the engine cache's, as ``k2edge serve`` builds it under cpu-dev)."""
    from k2edge.engine.engine import Engine

    engine = Engine.build(str(model), "cpu-dev", cache_dir=str(cache / "engines"), spinning=False, threads_per_lane=0,
                          max_batch=8, card=str(card))
    return engine.backend.build.segments[0].path


def bare_inference(segment: Path, card: Path, video: Path, seconds: float) -> tuple[float, float]:
    """Two single-threaded workers on one session of ``segment`` with the daemon's options: thread CPU ms a run, runs/s."""
    import av

    from bench_inference_candidates import session, workers
    from k2edge.config.card import load_card
    from k2edge.tasks import Preprocess

    pre = Preprocess.from_card(load_card(card))
    frames = []
    with av.open(str(video)) as c:
        for i, f in enumerate(c.decode(video=0)):
            if i % 30 == 0:
                frames.append(pre.stage(f.to_ndarray(format="rgb24"))[None].copy())
            if len(frames) == 4:
                break
    return workers([session(segment)] * 2, frames, seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15.0, help="daemon window per round")
    ap.add_argument("--bare-seconds", type=float, default=10.0, help="bare ONNX Runtime per round, the daemon stopped")
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--root", type=Path, default=BENCH.parent, help="the checkout whose daemon runs")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k2edge-bench")
    args = ap.parse_args(argv)
    rig_args = argparse.Namespace(cache=args.cache_dir, video_seconds=30.0, threads_per_lane=None, profile="cpu-dev",
                                  peer_threads=1, evidence=False)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site, runs_file = Path(tmp) / "site", Path(tmp) / "runs.json"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITE)
        daemon_process = bs.DaemonProcess
        bs.DaemonProcess = lambda cfg, log, env=None, **kw: daemon_process(cfg, log, env={
            **(env or {}), "PYTHONPATH": f"{site}{os.pathsep}{args.root.resolve()}", "K2EDGE_BENCH_RUNS": str(runs_file)}, **kw)
        rig = bs.Rig(Path(tmp), rig_args, "yolov8n", 4)
        print(f"daemon from {args.root.resolve()}; load average {os.getloadavg()[0]:.2f}", flush=True)
        try:
            mark = rig.sub.mark()
            with rig.k2edge() as (procs, _log):
                pid = procs[0].pid
                rig.sub.wait_for(lambda: {r[1] for r in rig.sub.since(mark) if r[0] == "k2edge"} >= set(rig.stream_names()),
                                 bs.READY_TIMEOUT_S, "k2edge did not publish every stream")
                time.sleep(args.warmup)
                names = thread_names(pid)
                segment = daemon_segment(args.cache_dir, Path(rig.onnx), Path(rig.card))
                for rnd in range(args.rounds):
                    timed = lambda: json.loads(runs_file.read_text())  # noqa: E731
                    a0, c0, t0, m0 = timed(), thread_cpu(pid), time.time(), rig.sub.mark()
                    time.sleep(args.seconds)
                    a1, c1, t1 = timed(), thread_cpu(pid), time.time()
                    r0, r1 = a0["run"], a1["run"]
                    stage_ms = (a1["stage"][0] - a0["stage"][0]) * 1e3
                    frames = max(1, sum(1 for r in rig.sub.since(m0) if r[0] == "k2edge" and t0 <= r[2] < t1))
                    by = collections.Counter()
                    for tid, cpu in c1.items():
                        by[group(names.get(tid))] += cpu - c0.get(tid, 0.0)
                    del by["the bench's own dump (not counted)"]
                    load = os.getloadavg()[0]
                    os.kill(pid, signal.SIGSTOP)
                    try:
                        bare_ms, bare_rate = bare_inference(segment, rig.card, rig.videos[0], args.bare_seconds)
                    finally:
                        os.kill(pid, signal.SIGCONT)
                    run_ms = (r1[0] - r0[0]) * 1e3 / max(r1[1] - r0[1], 1)
                    print(f"round {rnd + 1}: {frames / (t1 - t0):.2f} frames/s, load {load:.2f}, RSS {bs.rss_mib(pid):.0f} MiB; CPU ms a frame: "
                          + ", ".join(f"{k} {v * 1e3 / frames:.2f}" for k, v in by.most_common())
                          + f", all {sum(by.values()) * 1e3 / frames:.2f}; the batcher's staging {stage_ms / frames:.2f}; "
                          f"the lanes' Session.run {run_ms:.2f} ms a run, "
                          f"their other work {by['lanes'] * 1e3 / frames - run_ms:.2f} ms a frame (a run a frame: batches of one); bare ONNX Runtime, two workers on one session, "
                          f"{bare_ms:.2f} ms a run ({bare_rate:.1f} runs/s; daemon {run_ms / bare_ms:.3f}x)", flush=True)
                    time.sleep(3)
        finally:
            rig.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
