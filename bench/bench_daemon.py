"""The daemon's cost over a bare engine, measured in one run on this machine.

Prints, side by side:

1. batch-1 latency: MQTT 5 round trip through the daemon (loopback mosquitto with TCP_NODELAY)
   vs a bare ``Engine.infer`` call (its bound: p50 added latency at most 1.5 ms);
2. throughput with 16 requests in flight: the daemon vs the engine's best (no bound: on two
   shared cores the load generator and the broker take the CPU the bare engine has to itself; the
   daemon is compared with what a user would write instead in bench/bench_peer.py).

Requests carry pre-staged tensors so both sides do the same work. Broker, daemon and this client
all share this machine's cores; every device is a CPU lane.

    python bench/bench_daemon.py [--requests 1000] [--profile cpu-dev] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from mqtt_support import Broker, DaemonProcess, write_config  # noqa: E402  (the tests' real broker and daemon helpers)

from k2edge import Engine  # noqa: E402
from k2edge.cli.client import RequestClient  # noqa: E402

MODEL = ROOT / "models" / "digits" / "model.onnx"
ADDED_P50_BOUND_MS = 1.5  # the daemon's batch-1 p50 round trip minus Engine.infer's: at most


def _tensor_body(x: np.ndarray) -> bytes:
    """The request without its id: ``b'"tensor": {...}}'``, encoded once per input."""
    return json.dumps({"tensor": {"dtype": "float32", "shape": list(x.shape),
                       "data": base64.b64encode(x.tobytes()).decode()}}).encode()[1:]


def _with_id(body: bytes) -> bytes:
    """A request with a new id: the daemon answers an id it has seen as a duplicate, not as new work."""
    return b'{"id": "' + uuid.uuid4().hex[:12].encode() + b'", ' + body


def _tensor_payload(x: np.ndarray) -> bytes:
    return _with_id(_tensor_body(x))


def engine_side(profile: str, inputs: list[np.ndarray], rounds: int) -> dict:
    lat, thr = [], []
    with Engine.build(MODEL, profile) as e:
        for x in inputs[:200]:
            e.infer({"input": x[None]})
        for _ in range(rounds):
            times = []
            for x in inputs:
                t0 = time.perf_counter()
                e.infer({"input": x[None]})
                times.append(time.perf_counter() - t0)
            lat.append(statistics.median(times) * 1e3)
            t0 = time.perf_counter()
            pending = []
            for x in inputs:
                pending.append(e.submit({"input": x[None]}))
                if len(pending) >= 16:
                    pending.pop(0).result()
            for f in pending:
                f.result()
            thr.append(len(inputs) / (time.perf_counter() - t0))
    return {"p50_ms": statistics.median(lat), "throughput_per_s": statistics.median(thr)}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_side(port: int, inputs: list[np.ndarray], rounds: int, pids: dict) -> dict:
    bodies = [_tensor_body(x) for x in inputs]
    topic = "k2edge/bench/infer/digits"
    lat, thr, batches = [], [], []
    with RequestClient("127.0.0.1", port) as client:
        for b in bodies[:200]:
            client.request(topic, _with_id(b), timeout=30)
        for _ in range(rounds):
            times = []
            for b in bodies:
                _, ms = client.request(topic, _with_id(b), timeout=30)
                times.append(ms)
            lat.append(statistics.median(times))
            payloads = [_with_id(b) for b in bodies]
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            own0 = time.process_time()
            t0 = time.perf_counter()
            pending = []
            for p in payloads:
                pending.append(client.send(topic, p)[0])
                if len(pending) >= 16:
                    body, _ = client.wait(pending.pop(0), 30)
                    batches.append(body["latency_ms"]["batch"])
            for corr in pending:
                client.wait(corr, 30)
            thr.append(len(bodies) / (time.perf_counter() - t0))
            cpu = {k: (cpu_seconds(p) - cpu0[k]) / len(bodies) * 1e3 for k, p in pids.items()}
            cpu["client"] = (time.process_time() - own0) / len(bodies) * 1e3
    return {"p50_ms": statistics.median(lat), "throughput_per_s": statistics.median(thr),
            "mean_batch_16_in_flight": sum(batches) / len(batches), "cpu_ms_per_request": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default="cpu-dev")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, 32, 32)).astype(np.float32) for _ in range(args.requests)]
    eng = engine_side(args.profile, inputs, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        broker = Broker(tmp / "broker").start()
        cfg = write_config(tmp / "bench.toml", broker.port, [{"name": "digits", "onnx": MODEL, "profile": args.profile}],
                           device="bench", service={"max_batch": args.max_batch, "queue_size": 256})
        daemon = DaemonProcess(cfg, tmp / "daemon.log").start()
        try:
            time.sleep(1.0)
            for _ in range(120):  # wait until it answers
                try:
                    with RequestClient("127.0.0.1", broker.port) as c:
                        c.request("k2edge/bench/infer/digits", _tensor_payload(inputs[0]), timeout=1)
                    break
                except Exception:
                    time.sleep(0.5)
            dmn = daemon_side(broker.port, inputs, args.rounds, {"daemon": daemon.proc.pid, "broker": broker.proc.pid})
        finally:
            daemon.terminate()
            broker.stop()
    added = dmn["p50_ms"] - eng["p50_ms"]
    ratio = dmn["throughput_per_s"] / eng["throughput_per_s"]
    print(f"profile {args.profile}, {args.requests} requests x {args.rounds} rounds, mosquitto with set_tcp_nodelay, "
          f"daemon max_batch {args.max_batch}; every device a CPU lane")
    print(f"1. batch-1 p50   Engine.infer {eng['p50_ms']:.3f} ms | MQTT round trip via the daemon {dmn['p50_ms']:.3f} ms"
          f" | added {added:.3f} ms; bound: at most {ADDED_P50_BOUND_MS} ms")
    print(f"2. 16 in flight  engine {eng['throughput_per_s']:.0f}/s | daemon {dmn['throughput_per_s']:.0f}/s "
          f"(mean batch {dmn['mean_batch_16_in_flight']:.1f}) | {ratio:.2f}x (no bound here; bench/bench_peer.py compares the daemon with a peer)")
    cpu = dmn["cpu_ms_per_request"]
    print(f"   CPU per request at 16 in flight: daemon {cpu['daemon']:.2f} ms, broker {cpu['broker']:.2f} ms, "
          f"load-generating client {cpu['client']:.2f} ms, on {os.cpu_count()} cores shared by all three")
    if args.json:
        Path(args.json).write_text(json.dumps({"engine": eng, "daemon": dmn, "added_ms": added,
                                               "added_ms_bound": f"at most {ADDED_P50_BOUND_MS} ms", "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
