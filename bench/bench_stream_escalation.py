"""Stream escalation must not cost a stream anything: frame age and processed frames per second with
escalation on against a hanging K2 vs off, A/B interleaved in the same run.

Each run is ``k2edge serve`` (profile ``cpu-dev``, the demo detector ``models/detector``) with one ``file://``
stream (the crossing video of ``tests/support/stream_videos.py``, 320 x 240 at 30 fps, ``loop = true``: the file
at its own rate) and a ``[cloud]`` pointing at the K2 stand-in of ``tests/support/k2_server.py``, which hangs every
call (``timeout_s`` 2, no retries). "on": every ``line_cross``, ``zone_enter`` and ``zone_leave`` is escalated with
the whole frame (the heaviest images); "off": the same stream without rules. A subscriber stamps each detections
message as it arrives: frame age = arrival - the frame's ``captured_at``; fps = messages per second after a
warm-up. Runs alternate (off, on, off, on, ...); the table gives each system's median over its runs.

    python bench/bench_stream_escalation.py [--rounds 2] [--seconds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from k2_server import K2StandIn, hang  # noqa: E402  (the tests' K2 stand-in)
from mqtt_support import Broker, DaemonProcess, write_config  # noqa: E402
from stream_videos import scenario_crossing  # noqa: E402

DETECTOR = ROOT / "models" / "detector"
WARMUP_S = 4.0
EVERY = [{"on": kind, "images": "frame"} for kind in ("line_cross", "zone_enter", "zone_leave")]


def one_run(work: Path, broker: Broker, k2: K2StandIn, video, escalate: bool, seconds: float, tag: str) -> dict:
    import paho.mqtt.client as mqtt

    (x0, y0), (x1, y1) = video.line
    stream = {"name": "cam", "source": video.path.as_uri(), "model": "boxes", "loop": True,
              "lines": [{"name": "door", "start": [x0, y0], "end": [x1, y1]}],
              "zones": [{"name": "right", "points": [[x0, 0], [320, 0], [320, 240], [x0, 240]]}],
              **({"escalation": EVERY} if escalate else {})}
    cfg = write_config(work / f"{tag}.toml", broker.port, [{"name": "boxes", "onnx": DETECTOR / "model.onnx",
                                                           "profile": "cpu-dev"}], device="bench",
                       service={"state_dir": str(work / f"state-{tag}")}, streams=[stream],
                       tables={"cloud": {"base_url": k2.url, "model": "kimi-k2.5", "timeout_s": 2.0, "max_retries": 0,
                                         "breaker_failures": 1000, "requests_per_minute": 100000}})
    arrivals: list[tuple[float, float]] = []  # (arrival unix, captured_at)
    events = [0]
    lock = threading.Lock()

    def on_message(c, u, msg):
        now = time.time()
        body = json.loads(msg.payload)
        with lock:
            if msg.topic.endswith("/detections"):
                arrivals.append((now, body["captured_at"]))
            elif body.get("escalation"):
                events[0] += 1

    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    sub.on_message = on_message
    sub.connect("127.0.0.1", broker.port)
    sub.subscribe([("k2edge/bench/streams/cam/detections", 0), ("k2edge/bench/streams/cam/events", 0)])
    sub.loop_start()
    calls0 = len(k2.chat_requests)
    d = DaemonProcess(cfg, work / f"{tag}.log").start()
    try:
        end = time.time() + 120
        while time.time() < end:
            with lock:
                if arrivals:
                    break
            time.sleep(0.1)
        start = time.time() + WARMUP_S
        time.sleep(WARMUP_S + seconds)
        stop = time.time()
    finally:
        d.terminate(60)
        sub.loop_stop()
        sub.disconnect()
    window = [(a, c) for a, c in arrivals if start <= a < stop]
    ages = sorted((a - c) * 1e3 for a, c in window)
    q = statistics.quantiles(ages, n=100) if len(ages) > 2 else [float("nan")] * 99
    return {"escalate": escalate, "fps": len(window) / (stop - start), "age_p50_ms": statistics.median(ages),
            "age_p99_ms": q[98], "frames": len(window), "escalated_events": events[0],
            "cloud_calls": len(k2.chat_requests) - calls0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-esc-") as tmp, K2StandIn() as k2:
        work = Path(tmp)
        k2.fallback = hang(3600)
        video = scenario_crossing(work / "crossing.mp4", fps=30)
        broker = Broker(work / "broker").start()
        runs = []
        try:
            for r in range(args.rounds):
                for escalate in (False, True):
                    tag = f"r{r}-{'on' if escalate else 'off'}"
                    res = one_run(work, broker, k2, video, escalate, args.seconds, tag)
                    print(f"{tag}: {res['fps']:.2f} fps, frame age p50 {res['age_p50_ms']:.1f} ms, p99 "
                          f"{res['age_p99_ms']:.1f} ms; {res['escalated_events']} events escalated, "
                          f"{res['cloud_calls']} cloud calls (all hanging)", flush=True)
                    runs.append(res)
        finally:
            broker.stop()
    table = {}
    for name, on in (("off", False), ("on (hanging cloud)", True)):
        rs = [x for x in runs if x["escalate"] == on]
        table[name] = {k: statistics.median(x[k] for x in rs) for k in ("fps", "age_p50_ms", "age_p99_ms")}
    off, on = table["off"], table["on (hanging cloud)"]
    print(f"\n{'escalation':<20} {'fps':>8} {'age p50 ms':>11} {'age p99 ms':>11}")
    for name, row in table.items():
        print(f"{name:<20} {row['fps']:>8.2f} {row['age_p50_ms']:>11.1f} {row['age_p99_ms']:>11.1f}")
    print(f"on/off: {on['fps'] / off['fps']:.3f}x fps; frame age p50 {on['age_p50_ms'] - off['age_p50_ms']:+.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
