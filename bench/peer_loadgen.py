"""The load generator of bench/bench_peer.py, in its own process so that its CPU can be counted.

One MQTT 5 client (TCP_NODELAY, a private reply topic, QoS 1 both ways) takes one JSON command per
line on stdin and answers one JSON line on stdout:

- ``{"cmd": "probe", "topic": T, "timeout": S}``: one request; ``{"ok": true|false}``.
- ``{"cmd": "run", "topic": T, "n": N, "window": W}``: N requests, W in flight (each answer sends
  the next request from the network thread: a closed loop); round-trip latencies, throughput and
  the count of answers that were not ``ok`` for their request's id.
- ``{"cmd": "quit"}``.

Every request is the same JSON a user sends (``id``, and ``tensor`` with dtype, shape and base64
float32 bytes, 1x32x32 — or, with ``--images DIR``, ``image``: a base64 JPEG of DIR, in name
order); every id is new, so the daemon's exactly-once book never takes one for a redelivery. Both
targets get the same inputs in the same order. An answer counts as ``ok`` when it is ``ok`` for its
id and carries a ``top_k`` (classifiers) or a ``detections`` list (detectors).

    python bench/peer_loadgen.py PORT [--tensors 256] [--seed 0] [--images DIR]
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


class LoadGenerator:
    """Sends the benchmark's requests and matches answers by correlation data (run tag + index)."""

    def __init__(self, port: int, tensors: int, seed: int, images: Path | None = None) -> None:
        if images is not None:  # the request's "image": a base64 JPEG (a JSON string)
            self.field = b"image"
            self.bodies = [json.dumps(base64.b64encode(p.read_bytes()).decode()).encode()
                           for p in sorted(images.glob("*.jpg"))]
            if not self.bodies:
                raise RuntimeError(f"no .jpg images in {images}")
        else:  # the request's "tensor": dtype, shape, base64 data
            rng = np.random.default_rng(seed)
            self.field = b"tensor"
            self.bodies = [json.dumps({"dtype": "float32", "shape": [1, 32, 32], "data": base64.b64encode(
                rng.standard_normal((1, 32, 32)).astype(np.float32).tobytes()).decode()}).encode() for _ in range(tensors)]
        self.prefix = uuid.uuid4().hex[:8]
        self.reply_topic = f"bench-peer/{self.prefix}/reply"
        self.lock = threading.Lock()
        self.run_tag = 0
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_socket_open = lambda c, u, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        self.client.subscribe(self.reply_topic, qos=1)
        if not subscribed.wait(10):
            raise RuntimeError("the broker did not confirm the load generator's subscription")
        self._begin("", 0, 0)

    def _begin(self, topic: str, n: int, window: int) -> None:
        with self.lock:
            self.run_tag += 1
            self.topic, self.n, self.window = topic, n, window
            self.next = 0
            self.done = 0
            self.sent_at = [0.0] * n
            self.got_at: list[float | None] = [None] * n
            self.answers: list[bytes | None] = [None] * n
            self.stale = 0
            self.finished = threading.Event()
            if n == 0:
                self.finished.set()

    def _rid(self, i: int) -> str:
        return f"{self.prefix}-{self.run_tag}-{i}"

    def _send_next(self) -> None:
        with self.lock:
            if self.next >= self.n:
                return
            i, tag, topic = self.next, self.run_tag, self.topic
            self.next += 1
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = tag.to_bytes(4, "big") + i.to_bytes(4, "big")
        payload = b'{"id": "' + self._rid(i).encode() + b'", "' + self.field + b'": ' + self.bodies[i % len(self.bodies)] + b"}"
        self.sent_at[i] = time.perf_counter()
        self.client.publish(topic, payload, qos=1, properties=props)

    def _on_message(self, client, userdata, msg) -> None:
        t = time.perf_counter()
        corr = getattr(msg.properties, "CorrelationData", None) or b""
        tag, i = int.from_bytes(corr[:4], "big"), int.from_bytes(corr[4:8], "big")
        with self.lock:
            if tag != self.run_tag or i >= self.n or self.got_at[i] is not None:
                self.stale += 1  # an answer to an earlier run (a probe that timed out) or a second answer
                return
            self.got_at[i] = t
            self.answers[i] = msg.payload
            self.done += 1
            complete = self.done == self.n
        if complete:
            self.finished.set()
        else:
            self._send_next()

    def run(self, topic: str, n: int, window: int, timeout: float) -> dict:
        """N requests with ``window`` in flight; what came back, checked after the clock stopped."""
        self._begin(topic, n, window)
        cpu0 = time.process_time()
        for _ in range(min(window, n)):
            self._send_next()
        self.finished.wait(timeout)
        cpu = time.process_time() - cpu0
        with self.lock:
            got, sent, answers, stale = list(self.got_at), list(self.sent_at), list(self.answers), self.stale
        lat = [(g - s) * 1e3 for g, s in zip(got, sent) if g is not None]
        errors: dict[str, int] = {}
        reported: dict[str, list[float]] = {}  # k2edge's own latency breakdown (queue, stage, infer, batch, total)
        for i, raw in enumerate(answers):
            code, body = ("no_answer", {}) if raw is None else _check(raw, self._rid(i))
            if code:
                errors[code] = errors.get(code, 0) + 1
            elif isinstance(body.get("latency_ms"), dict):
                for k, v in body["latency_ms"].items():
                    if isinstance(v, (int, float)):
                        reported.setdefault(k, []).append(v)
        arrived = [g for g in got if g is not None]
        elapsed = max(arrived) - sent[0] if arrived else 0.0  # request 0 goes first
        return {"n": n, "window": window, "answered": len(lat), "failures": sum(errors.values()), "errors": errors,
                "stale": stale, "elapsed_s": elapsed, "throughput_per_s": len(lat) / elapsed if elapsed > 0 else 0.0,
                **{f"p{q}_ms": float(np.percentile(lat, q)) if lat else None for q in (50, 90, 99)},
                "mean_batch": float(np.mean(reported["batch"])) if "batch" in reported else None,
                "reported_p50_ms": {k: float(np.median(v)) for k, v in reported.items() if k != "batch"},
                "loadgen_cpu_s": cpu}

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _check(raw: bytes, rid: str) -> tuple[str | None, dict]:
    """(None, body) for an ``ok`` answer to ``rid`` with a top-k or a list of detections; else (what was wrong, body)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return "not_json", {}
    if not isinstance(body, dict):
        return "not_an_object", {}
    if body.get("status") != "ok":
        return str((body.get("error") or {}).get("code") or body.get("status")), body
    if body.get("id") != rid:
        return "wrong_id", body
    return (None if body.get("top_k") or isinstance(body.get("detections"), list) else "no_result"), body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", type=int)
    ap.add_argument("--tensors", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images", type=Path, help="send these JPEGs (a folder) instead of tensors")
    args = ap.parse_args()
    gen = LoadGenerator(args.port, args.tensors, args.seed, args.images)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "probe":
            r = gen.run(cmd["topic"], 1, 1, cmd.get("timeout", 1.0))
            out = {"ok": r["failures"] == 0, "errors": r["errors"]}
        else:
            out = gen.run(cmd["topic"], cmd["n"], cmd["window"], cmd.get("timeout", 120.0))
        print(json.dumps(out), flush=True)
    gen.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
