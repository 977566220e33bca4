"""k2edge against the peer — the loop a user would write instead of it — in one run on this machine.

Two models, one after the other (``--models``):

* ``digits``: the peer (``bench/peer_loop.py``) is paho-mqtt with an ONNX Runtime session created
  with default options, run inside ``on_message``; the requests are JSON with a base64 float32
  1x32x32 tensor.
* ``detector`` (the demo detector, ``models/detector``): the peer (``bench/peer_detector.py``) is
  paho-mqtt, Pillow, ONNX Runtime and numpy inside ``on_message`` (JPEG decode, letterbox, the
  model, YOLOv8 decode and per-class NMS); the requests are JSON with a base64 JPEG of the
  detector's evaluation scenes.

Both peers answer to the request's Response Topic. k2edge is ``k2edge serve`` (profile ``cpu-dev``,
``max_batch`` 8, ``queue_size`` 256). Both serve the model behind one mosquitto (``set_tcp_nodelay
true``) and get the same requests (a new id each) from one load generator (``bench/peer_loadgen.py``,
its own process so that its CPU is counted too). Over several rounds, A/B interleaved (the first
target alternates):

1. throughput with 16 requests in flight (its bound: k2edge at least 1.3x the peer's);
2. round-trip latency with one request in flight, p50 and p90 (its bound: k2edge's p50 at most the
   peer's + 0.3 ms);

each after a warm-up that is not counted. It prints medians over rounds with their spread
[min-max], the CPU milliseconds per request of every process (k2edge, peer, broker, load
generator), and the count of answers that were not ``ok``. ``--profile DIR`` then samples each
server with py-spy during one more (unmeasured) 16-in-flight run and prints where its time goes.

    python bench/bench_peer.py [--models digits,detector] [--requests 2000] [--rounds 5] [--json out.json]
                               [--profile-dir DIR] [--service KEY=VALUE ...]

``--service`` sets one of k2edge's ``[service]`` settings (``staging_threads=2``, ``threads_per_lane=2``), to try
a layout against the same peer (or with ``--tracing``, against itself); the report's first line names it.

``--tracing`` measures tracing's cost instead of the peer: the same phases against k2edge with tracing
off and k2edge with ``[tracing]`` on (every request sampled, spans exported over OTLP/HTTP to a real
receiver in this process, which decodes them), A/B interleaved; ``--baseline-src DIR`` adds a third
target, ``k2edge serve`` from another checkout (e.g. the commit before tracing), so that "tracing
off" can be compared with what was there before in the same run.

    python bench/bench_peer.py --tracing [--baseline-src /path/to/other/checkout] --models digits
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from bench_daemon import cpu_seconds  # noqa: E402  (one /proc reader for the bench scripts)
from mqtt_support import Broker, DaemonProcess, write_config  # noqa: E402  (the tests' real broker and daemon helpers)

DETECTOR = ROOT / "models" / "detector"
SCENARIOS = {  # model -> what k2edge serves, what the peer runs, what the load generator sends
    "digits": {"onnx": ROOT / "models" / "digits" / "model.onnx", "labels": ROOT / "models" / "digits" / "labels.txt",
               "peer": ["peer_loop.py"], "loadgen": []},
    "detector": {"onnx": DETECTOR / "model.onnx", "labels": DETECTOR / "labels.txt",
                 "peer": ["peer_detector.py"], "loadgen": ["--images", str(DETECTOR / "eval" / "images")]},
}
TOPICS = {"k2edge": "k2edge/bench/infer/{model}", "peer": "bench-peer/infer/{model}"}
THROUGHPUT_RATIO_BOUND = 1.3  # k2edge's answers/s at 16 in flight over the peer's: at least
P50_ADDED_BOUND_MS = 0.3  # k2edge's p50 at one in flight minus the peer's: at most
PHASES = (("throughput", 16), ("latency", 1))
QUEUE_SIZE = 256  # k2edge's [service] queue_size
# [service] settings the bench sets itself: --service may not change them (the report states the bench's values)
OWN_SERVICE_KEYS = {"max_batch": ": use --max-batch", "queue_size": f" ({QUEUE_SIZE})", "state_dir": " (a temporary one)"}
READY_TIMEOUT_S = 120.0
# --nonblocking: sampling does not pause the daemon (pausing it 250 times a second cut its rate by
# a third); no --native: with it py-spy counts threads blocked in futex waits as busy
PY_SPY_FLAGS = ("--threads", "--rate", "250", "--nonblocking")


class BenchError(Exception):
    """Something the bench cannot go on without; its message is the one line printed."""


class LoadGenerator:
    """``bench/peer_loadgen.py`` as a subprocess, driven one JSON command per line."""

    def __init__(self, port: int, log: Path, model: str, topics: dict[str, str] = TOPICS) -> None:
        self._log = open(log, "ab")
        self.topics = {target: t.format(model=model) for target, t in topics.items()}
        self.proc = subprocess.Popen([sys.executable, str(BENCH / "peer_loadgen.py"), str(port), *SCENARIOS[model]["loadgen"]],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=ROOT)
        if not self._read().get("ready"):
            raise BenchError("the load generator did not start")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise BenchError(f"the load generator stopped (exit {self.proc.poll()}); see {self._log.name}")
        return json.loads(line)

    def command(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def wait_until_answering(gen: LoadGenerator, name: str, proc: subprocess.Popen, log: Path) -> float:
    """Probe ``name`` until it answers ``ok``; when it did (time.monotonic). Raises BenchError if it never does."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise BenchError(f"{name} exited with {proc.returncode} before answering; its log ends:\n{_tail(log)}")
        if gen.command(cmd="probe", topic=gen.topics[name], timeout=1.0)["ok"]:
            return time.monotonic()
    raise BenchError(f"{name} did not answer within {READY_TIMEOUT_S:.0f} s; its log ends:\n{_tail(log)}")


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def measure(gen: LoadGenerator, target: str, n: int, window: int, warmup: int, pids: dict[str, int]) -> dict:
    """One phase against one target: a warm-up, then ``n`` requests with ``window`` in flight, with
    the CPU each process used during the measured part."""
    failures = 0
    if warmup:
        failures += gen.command(cmd="run", topic=gen.topics[target], n=warmup, window=window)["failures"]
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    r = gen.command(cmd="run", topic=gen.topics[target], n=n, window=window)
    if not r["answered"]:
        raise BenchError(f"{target} answered none of {n} requests at {window} in flight: {r['errors']}")
    cpu = {name: (cpu_seconds(pid) - cpu0[name]) * 1e3 / n for name, pid in pids.items()}
    cpu["loadgen"] = r.pop("loadgen_cpu_s") * 1e3 / n  # its own clock over the timed part only
    r["cpu_ms_per_request"] = cpu
    r["warmup"], r["warmup_failures"] = warmup, failures
    return r


def interleaved_rounds(gen: LoadGenerator, model: str, targets: list[str], args, pids: dict[str, int]) -> list[dict]:
    """``args.rounds`` rounds, each measuring every phase of every target, the targets' order rotated a place each
    round (A/B interleaved: no target always runs first or on a warmer machine); each round printed as it ends."""
    rounds = []
    for i in range(args.rounds):
        order = targets[i % len(targets):] + targets[:i % len(targets)]
        rnd: dict = {"round": i + 1, "order": order, **{t: {} for t in targets}}
        for phase, window in PHASES:
            for target in order:
                rnd[target][phase] = measure(gen, target, args.requests, window, args.warmup, pids)
        rounds.append(rnd)
        print(f"{model} round {i + 1}/{args.rounds}: " + ", ".join(
            f"{t} {rnd[t]['throughput']['throughput_per_s']:,.0f}/s p50 {rnd[t]['latency']['p50_ms']:.3f} ms"
            for t in order), flush=True)
    return rounds


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rounds: list[dict]) -> dict:
    """Medians over rounds with their spread, per target and phase, and the paired comparisons."""
    out: dict = {}
    for target in TOPICS:
        t = out[target] = {}
        for phase, _ in PHASES:
            runs = [r[target][phase] for r in rounds]
            t[phase] = {m: _spread([x[m] for x in runs]) for m in ("throughput_per_s", "p50_ms", "p90_ms", "p99_ms")}
            t[phase]["cpu_ms_per_request"] = {p: statistics.median([x["cpu_ms_per_request"][p] for x in runs])
                                              for p in runs[0]["cpu_ms_per_request"]}
            batches = [x["mean_batch"] for x in runs if x.get("mean_batch") is not None]
            t[phase]["mean_batch"] = statistics.median(batches) if batches else None
            t[phase]["reported_p50_ms"] = {key: statistics.median([x["reported_p50_ms"][key] for x in runs])
                                           for key in runs[0]["reported_p50_ms"]}
        t["requests"] = sum(x["n"] + x["warmup"] for r in rounds for x in r[target].values())  # every answer checked
        t["failures"] = sum(x["failures"] + x["warmup_failures"] for r in rounds for x in r[target].values())
        t["errors"] = dict(sum((Counter(x["errors"]) for r in rounds for x in r[target].values()), Counter()))
    ratio = [r["k2edge"]["throughput"]["throughput_per_s"] / r["peer"]["throughput"]["throughput_per_s"] for r in rounds]
    added = [r["k2edge"]["latency"]["p50_ms"] - r["peer"]["latency"]["p50_ms"] for r in rounds]
    med_ratio = out["k2edge"]["throughput"]["throughput_per_s"]["median"] / out["peer"]["throughput"]["throughput_per_s"]["median"]
    med_added = out["k2edge"]["latency"]["p50_ms"]["median"] - out["peer"]["latency"]["p50_ms"]["median"]
    # the figures count only with every answer ok ("answers not ok" in the report)
    out["versus_peer"] = {
        "throughput_ratio": {"value": med_ratio, "per_round": _spread(ratio), "bound": f"at least {THROUGHPUT_RATIO_BOUND}x"},
        "p50_added_ms": {"value": med_added, "per_round": _spread(added), "bound": f"at most +{P50_ADDED_BOUND_MS} ms"},
    }
    return out


# py-spy ---------------------------------------------------------------------------------------------
def py_spy() -> str | None:
    """The py-spy executable: beside this interpreter (a venv) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def profile_run(gen: LoadGenerator, target: str, pid: int, n: int, window: int, out: Path, spy: str) -> dict:
    """Sample ``pid`` with py-spy (per thread) during one unmeasured run with ``window`` in flight."""
    raw = out / f"{target}-{window}.raw.txt"
    log = open(out / f"{target}-{window}.py-spy.log", "wb")
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", *PY_SPY_FLAGS,
                             "-o", str(raw)], stdout=log, stderr=subprocess.STDOUT)
    time.sleep(1.0)  # attached before the load starts
    r = gen.command(cmd="run", topic=gen.topics[target], n=n, window=window)
    proc.send_signal(signal.SIGINT)  # py-spy writes its samples on Ctrl-C
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    if not raw.exists():
        raise BenchError(f"py-spy wrote no samples for {target}; see {log.name} in {out}")
    prof = collapse(raw.read_text())
    prof.update(target=target, window=window, throughput_per_s=r["throughput_per_s"], p50_ms=r["p50_ms"],
                failures=r["failures"], raw=str(raw))
    return prof


def collapse(raw: str, top: int = 15) -> dict:
    """Own and inclusive time by function from py-spy's raw (collapsed) stacks.

    ``own``: the innermost frame of each sample (time in a C extension is charged to the Python
    function that called it: ``Session.run`` holds ONNX Runtime's time); ``own_lines``: the same
    per source line; ``inclusive``: every function on the stack, once per sample; ``threads``:
    samples per thread. Shares are of all samples of busy threads.
    """
    own, lines, inclusive, threads, total = Counter(), Counter(), Counter(), Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        thread, *frames = stack.split(";")
        total += n
        threads[thread.split(": ", 1)[-1]] += n
        if not frames:
            continue
        own[_function(frames[-1])] += n
        lines[frames[-1]] += n
        for f in {_function(f) for f in frames}:
            inclusive[f] += n

    def rows(c: Counter, key: str = "function") -> list[dict]:
        return [{key: f, "samples": k, "share": k / total} for f, k in c.most_common(top)]
    return {"samples": total, "own": rows(own), "own_lines": rows(lines, "line"), "inclusive": rows(inclusive),
            "threads": rows(threads, "thread")}


def _function(frame: str) -> str:
    """``name (file:line)`` -> ``name (file)``: time per function, not per line."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rstrip(')')})" if where else name


# report ---------------------------------------------------------------------------------------------
def _spread_text(s: dict, fmt: str, unit: str = "") -> str:
    return f"{fmt.format(s['median'])}{unit} [{fmt.format(s['min'])}..{fmt.format(s['max'])}]"


def _serving(args) -> str:
    """How k2edge serves in this run: its profile and [service] settings."""
    return (f"profile {args.profile}, max_batch {args.max_batch}, queue_size {QUEUE_SIZE}"
            + "".join(f", {k} {v}" for k, v in args.service.items()))


def _row(*cells: str, widths: tuple[int, ...] = (30, 28, 28, 28)) -> str:
    """Cells padded to their column (at least two spaces apart); the last one as it is."""
    return "".join(c.ljust(w - 2) + "  " for c, w in zip(cells, widths)) + "".join(cells[len(widths):])


def report(args, model: str, summary: dict, startup: dict) -> str:
    """The comparison table and the CPU table."""
    k, p, g = summary["k2edge"], summary["peer"], summary["versus_peer"]
    tr, pa = g["throughput_ratio"], g["p50_added_ms"]
    batch = k["throughput"]["mean_batch"]

    def both(phase: str, metric: str, fmt: str, unit: str) -> tuple[str, str]:
        return _spread_text(p[phase][metric], fmt, unit), _spread_text(k[phase][metric], fmt, unit)

    errors = k["errors"] | p["errors"] if k["failures"] or p["failures"] else {}
    lines = [
        f"k2edge serve vs the peer (bench/{SCENARIOS[model]['peer'][0]}): {model}, {_serving(args)}",
        f"{args.rounds} round(s) x {args.requests} requests per phase (warm-up {args.warmup} not counted), A/B interleaved; "
        f"one mosquitto (set_tcp_nodelay), one load generator; {os.cpu_count()} cores shared by all",
        f"answering {startup['k2edge']:.1f} s (k2edge) and {startup['peer']:.1f} s (peer) after their start; "
        "figures: median over rounds [min..max]",
        "",
        _row("measurement", "peer", "k2edge", "k2edge vs peer", "bound"),
        _row("throughput, 16 in flight", *both("throughput", "throughput_per_s", "{:,.0f}", "/s"),
             f"{tr['value']:.2f}x [{tr['per_round']['min']:.2f}..{tr['per_round']['max']:.2f}]",
             tr["bound"]),
        _row("p50 round trip, 1 in flight", *both("latency", "p50_ms", "{:.3f}", " ms"),
             f"{pa['value']:+.3f} ms [{pa['per_round']['min']:+.3f}..{pa['per_round']['max']:+.3f}]",
             pa["bound"]),
        _row("p90 round trip, 1 in flight", *both("latency", "p90_ms", "{:.3f}", " ms")),
        _row("p50 round trip, 16 in flight", *both("throughput", "p50_ms", "{:.3f}", " ms"),
             f"k2edge mean batch {batch:.1f}" if batch is not None else ""),
        _row("answers not ok", f"{p['failures']:,} of {p['requests']:,}", f"{k['failures']:,} of {k['requests']:,}",
             str(errors) if errors else ""),
        "",
        f"{'CPU ms per request (median)':<30}{'k2edge':>9}{'peer':>9}{'broker':>9}{'loadgen':>9}{'all':>9}",
    ]
    for target in ("peer", "k2edge"):
        for phase, window in PHASES:
            cpu = summary[target][phase]["cpu_ms_per_request"]
            lines.append(f"{f'{target} at {window} in flight':<30}"
                         + "".join(f"{cpu[x]:>9.3f}" for x in ("k2edge", "peer", "broker", "loadgen"))
                         + f"{sum(cpu.values()):>9.3f}")
    own = k["latency"]["reported_p50_ms"]
    if own:
        lines += ["", "k2edge's own account at 1 in flight (latency_ms in its answers, p50): "
                  + ", ".join(f"{key} {v:.3f}" for key, v in own.items()) + " ms; the rest of its "
                  f"{k['latency']['p50_ms']['median']:.3f} ms round trip is MQTT (both ways), the broker, recording and publishing"]
    return "\n".join(line.rstrip() for line in lines)


def report_profile(prof: dict) -> str:
    lines = []
    for target, p in prof.items():
        lines += ["", f"py-spy, {target}: {p['samples']:,} samples of busy Python threads; "
                      f"{p['throughput_per_s']:,.0f}/s, p50 {p['p50_ms']:.3f} ms while sampled; threads "
                      + ", ".join(f"{t['thread']} {t['share']:.0%}" for t in p["threads"][:6]),
                  f"  {'own time by function':<72}{'share':>6}   own time by line"]
        for a, b in zip(p["own"], p["own_lines"] + [None] * len(p["own"])):
            right = f"{b['share']:>6.1%}  {b['line'][:80]}" if b else ""
            lines.append(f"  {a['function'][:70]:<72}{a['share']:>6.1%}   {right}")
    lines.append("(py-spy samples Python threads only: ONNX Runtime's own pool threads, which the peer's default "
                 "session has, are not in these tables; their CPU is in the CPU table above)")
    return "\n".join(lines)


# main -----------------------------------------------------------------------------------------------
def run(args) -> dict:
    results: dict = {"config": {k: v for k, v in vars(args).items()}, "machine": {"cpus": os.cpu_count(),
                     "python": platform.python_version(), "platform": platform.platform()}, "models": {}}
    for model in args.models:
        results["models"][model] = run_tracing(args, model) if args.tracing else run_model(args, model)
    return results


# --tracing: k2edge with tracing off, on, and (--baseline-src) another checkout -----------------------
TRACING_TARGETS = {"off": "k2edge/off/infer/{model}", "on": "k2edge/on/infer/{model}",
                   "baseline": "k2edge/baseline/infer/{model}"}


class CheckoutDaemon(DaemonProcess):
    """``k2edge serve`` from another checkout: its directory first on the path, and its cwd (``python -m``
    puts the cwd before PYTHONPATH)."""

    def __init__(self, src: Path, config: Path, log: Path, env: dict) -> None:
        super().__init__(config, log, {**env, "PYTHONPATH": str(src)})
        self.src = src

    def start(self) -> "CheckoutDaemon":
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "k2edge", "serve", "--config", str(self.config)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=self.src)
        return self


def run_tracing(args, model: str) -> dict:
    """Every round against one model: k2edge with tracing off and on (and the baseline checkout)."""
    from otlp_receiver import OtlpReceiver

    scenario = SCENARIOS[model]
    targets = ["off", "on"] + (["baseline"] if args.baseline_src else [])
    results: dict = {"rounds": [], "targets": targets}
    with tempfile.TemporaryDirectory(prefix="bench-trace-") as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        broker = Broker(tmp / "broker").start()
        stack.callback(broker.stop)
        otlp = stack.enter_context(OtlpReceiver(keep=False))  # parses, counts, keeps nothing
        daemons = {}
        for target in targets:
            tables = {"tracing": {"endpoint": otlp.endpoint, "sample_ratio": 1.0}} if target == "on" else {}
            cfg = write_config(tmp / f"{target}.toml", broker.port, [{"name": model, "onnx": scenario["onnx"],
                               "profile": args.profile}], device=target, tables=tables,
                               service={"max_batch": args.max_batch, "queue_size": QUEUE_SIZE,
                                        "state_dir": str(tmp / f"state-{target}"), **args.service})
            env = {"K2EDGE_CACHE_DIR": str(tmp / "cache")}
            d = (CheckoutDaemon(Path(args.baseline_src).resolve(), cfg, tmp / f"{target}.log", env) if target == "baseline"
                 else DaemonProcess(cfg, tmp / f"{target}.log", env=env)).start()
            stack.callback(_stop_daemon, d)
            daemons[target] = d
        gen = LoadGenerator(broker.port, tmp / "loadgen.log", model, {t: TRACING_TARGETS[t] for t in targets})
        stack.callback(gen.close)
        for target, d in daemons.items():
            wait_until_answering(gen, target, d.proc, tmp / f"{target}.log")
        pids = {t: d.proc.pid for t, d in daemons.items()} | {"broker": broker.proc.pid}
        results["rounds"] += interleaved_rounds(gen, model, targets, args, pids)
        answered = sum(x["n"] + x["warmup"] for r in results["rounds"] for x in r["on"].values())
        time.sleep(1.0)  # the exporter's last batch
        results["spans_received"], results["traced_answers"] = otlp.count, answered
    results["summary"] = {t: {phase: {m: _spread([r[t][phase][m] for r in results["rounds"]])
                                      for m in ("throughput_per_s", "p50_ms", "p90_ms")}
                              | {"daemon_cpu_ms": _spread([r[t][phase]["cpu_ms_per_request"][t] for r in results["rounds"]])}
                              for phase, _ in PHASES} for t in targets}
    results["summary"]["failures"] = {t: sum(x["failures"] + x["warmup_failures"] for r in results["rounds"]
                                            for x in r[t].values()) for t in targets}
    results["summary"]["versus_off"] = {t: {
        "throughput_ratio": _spread([r[t]["throughput"]["throughput_per_s"] / r["off"]["throughput"]["throughput_per_s"]
                                     for r in results["rounds"]]),
        "p50_added_ms": _spread([r[t]["latency"]["p50_ms"] - r["off"]["latency"]["p50_ms"] for r in results["rounds"]])}
        for t in targets if t != "off"}
    return results


def report_tracing(args, model: str, r: dict) -> str:
    s = r["summary"]
    names = {"off": "tracing off", "on": "tracing on (all sampled)", "baseline": f"baseline ({args.baseline_src})"}
    lines = [f"k2edge serve, tracing off vs on: {model}, {_serving(args)}; "
             f"{args.rounds} round(s) x {args.requests} requests per phase (warm-up {args.warmup}), A/B interleaved; "
             f"{os.cpu_count()} cores shared by all; figures: median over rounds [min..max]", "",
             _row("target", "throughput, 16 in flight", "p50, 1 in flight", "p90, 1 in flight", "daemon CPU/request",
                  "vs off (paired per round)", widths=(34, 26, 26, 26, 24))]
    for t in r["targets"]:
        vs = s["versus_off"].get(t)
        cmp = (f"{vs['throughput_ratio']['median']:.2f}x [{vs['throughput_ratio']['min']:.2f}..{vs['throughput_ratio']['max']:.2f}]"
               f", p50 {vs['p50_added_ms']['median']:+.3f} ms [{vs['p50_added_ms']['min']:+.3f}..{vs['p50_added_ms']['max']:+.3f}]"
               if vs else "")
        lines.append(_row(names[t], _spread_text(s[t]["throughput"]["throughput_per_s"], "{:,.0f}", "/s"),
                          _spread_text(s[t]["latency"]["p50_ms"], "{:.3f}", " ms"),
                          _spread_text(s[t]["latency"]["p90_ms"], "{:.3f}", " ms"),
                          _spread_text(s[t]["throughput"]["daemon_cpu_ms"], "{:.3f}", " ms"), cmp, widths=(34, 26, 26, 26, 24)))
    lines += ["", f"answers not ok: {s['failures']}; spans received by the OTLP receiver: {r['spans_received']:,} for "
              f"{r['traced_answers']:,} traced answers ({r['spans_received'] / max(1, r['traced_answers']):.1f} a request)"]
    return "\n".join(lines)


def run_model(args, model: str) -> dict:
    """Every round against one model: a broker, k2edge, the peer and the load generator of their own."""
    scenario = SCENARIOS[model]
    results: dict = {"rounds": []}
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        broker = Broker(tmp / "broker").start()
        stack.callback(broker.stop)
        cfg = write_config(tmp / "bench.toml", broker.port, [{"name": model, "onnx": scenario["onnx"], "profile": args.profile}],
                           device="bench", service={"max_batch": args.max_batch, "queue_size": QUEUE_SIZE,
                                                    "state_dir": str(tmp / "state"), **args.service})
        # engines cached in the temporary dir: nothing lands in ~/.cache or ~/.local/state
        t_start = time.monotonic()
        daemon = DaemonProcess(cfg, tmp / "daemon.log", env={"K2EDGE_CACHE_DIR": str(tmp / "cache")}).start()
        stack.callback(_stop_daemon, daemon)
        peer_log = open(tmp / "peer.log", "wb")
        stack.callback(peer_log.close)
        gen = LoadGenerator(broker.port, tmp / "loadgen.log", model)
        stack.callback(gen.close)
        peer = subprocess.Popen([sys.executable, str(BENCH / scenario["peer"][0]), "127.0.0.1", str(broker.port),
                                 gen.topics["peer"], str(scenario["onnx"]), str(scenario["labels"]), *scenario["peer"][1:]],
                                stdout=peer_log, stderr=subprocess.STDOUT, cwd=ROOT)
        stack.callback(_kill, peer)

        startup = {"k2edge": wait_until_answering(gen, "k2edge", daemon.proc, tmp / "daemon.log") - t_start,
                   "peer": wait_until_answering(gen, "peer", peer, tmp / "peer.log") - t_start}
        pids = {"k2edge": daemon.proc.pid, "peer": peer.pid, "broker": broker.proc.pid}
        results["rounds"] += interleaved_rounds(gen, model, ["k2edge", "peer"], args, pids)
        results["startup_s"] = startup
        results["summary"] = summarise(results["rounds"])
        if args.profile_dir:
            out = Path(args.profile_dir) / model
            out.mkdir(parents=True, exist_ok=True)
            results["profile"] = {f"{t} at {w} in flight": profile_run(gen, t, pids[t], args.profile_requests, w, out, args.py_spy)
                                  for w in (16, 1) for t in ("k2edge", "peer")}
        if args.keep_logs:
            for name in ("daemon.log", "peer.log", "loadgen.log"):
                shutil.copy(tmp / name, Path(args.keep_logs) / f"{model}-{name}")
    return results


def _service_setting(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--service``: the value as the daemon's config reads it (TOML), a bare word as a string."""
    from k2edge.config import toml

    key, sep, value = (part.strip() for part in text.partition("="))
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if key in OWN_SERVICE_KEYS:
        raise argparse.ArgumentTypeError(f"{key} is the bench's own{OWN_SERVICE_KEYS[key]}")
    try:
        return key, toml.loads(f"v = {value}")["v"]
    except toml.TOMLDecodeError:
        return key, value


def _stop_daemon(daemon: DaemonProcess) -> None:
    try:
        daemon.terminate(timeout=30)  # SIGTERM: the daemon drains and says offline
    except subprocess.TimeoutExpired:
        daemon.kill()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits,detector", help="comma-separated: " + ", ".join(SCENARIOS))
    ap.add_argument("--requests", type=int, default=2000, help="measured requests per phase, target and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=200, help="requests before each measured phase, not counted")
    ap.add_argument("--profile", default="cpu-dev", help="k2edge's profile")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--service", metavar="KEY=VALUE", action="append", default=[], type=_service_setting,
                    help="a [service] setting for k2edge (repeatable), e.g. staging_threads=2 or threads_per_lane=2")
    ap.add_argument("--json", metavar="FILE", help="write every figure (each round, the summary, the profile) here")
    ap.add_argument("--profile-dir", metavar="DIR", help="after the rounds, sample each server with py-spy into DIR")
    ap.add_argument("--profile-requests", type=int, default=5000, help="requests in each py-spy run")
    ap.add_argument("--keep-logs", metavar="DIR", help="copy the daemon's, the peer's and the load generator's logs here")
    ap.add_argument("--tracing", action="store_true", help="measure tracing off vs on instead of the peer")
    ap.add_argument("--baseline-src", metavar="DIR", help="with --tracing: also k2edge serve from this checkout")
    args = ap.parse_args(argv)
    args.service = dict(args.service)
    if args.service:
        import pydantic

        from k2edge.config.schema import ServiceConfig

        try:
            ServiceConfig(**args.service)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            print(f"bench_peer: --service {'.'.join(map(str, err['loc']))}: {err['msg']}", file=sys.stderr)
            return 1
    if args.baseline_src and not (Path(args.baseline_src) / "k2edge" / "__main__.py").is_file():
        print(f"bench_peer: --baseline-src {args.baseline_src!r} is not a k2edge checkout", file=sys.stderr)
        return 1
    if args.baseline_src and not args.tracing:
        print("bench_peer: --baseline-src goes with --tracing", file=sys.stderr)
        return 1
    for name in ("requests", "rounds", "max_batch", "profile_requests"):
        if getattr(args, name) < 1:
            print(f"bench_peer: --{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}", file=sys.stderr)
            return 1
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in SCENARIOS]
    if unknown or not args.models:
        print(f"bench_peer: --models takes {', '.join(SCENARIOS)}, got {unknown or 'none'}", file=sys.stderr)
        return 1
    if args.warmup < 0:
        print(f"bench_peer: --warmup must be 0 or more, got {args.warmup}", file=sys.stderr)
        return 1
    args.py_spy = py_spy() if args.profile_dir else None
    if args.profile_dir and args.py_spy is None:
        print("bench_peer: --profile-dir needs py-spy: pip install py-spy", file=sys.stderr)
        return 1
    if args.keep_logs and not Path(args.keep_logs).is_dir():
        print(f"bench_peer: --keep-logs {args.keep_logs!r} is not a directory", file=sys.stderr)
        return 1
    try:
        results = run(args)
    except BenchError as exc:
        print(f"bench_peer: {exc}", file=sys.stderr)
        return 1
    for model, r in results["models"].items():
        print(f"\n== {model} ==")
        if args.tracing:
            print(report_tracing(args, model, r))
            continue
        print(report(args, model, r["summary"], r["startup_s"]))
        if r.get("profile"):
            print(report_profile(r["profile"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
