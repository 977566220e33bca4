"""Why the broker needs ``set_tcp_nodelay true``: MQTT 5 echo round trips over loopback mosquitto.

Measures the p50 round trip of a request/response echo (one paho client publishes with a Response
Topic, another answers it) with TCP_NODELAY on both the broker and the clients, on the broker only,
and on neither. Without it, Nagle's algorithm holds small packets back until the previous one is
acknowledged (delayed ACKs: tens of milliseconds).

    python bench/bench_mqtt_nodelay.py [--requests 200]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from mqtt_support import Broker  # noqa: E402  (the tests' real mosquitto helper)


def _client(port: int, nodelay: bool) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    if nodelay:
        c.on_socket_open = lambda cl, u, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def echo_p50(port: int, client_nodelay: bool, n: int) -> float:
    responder, requester = _client(port, client_nodelay), _client(port, client_nodelay)
    got = threading.Event()

    def answer(cl, u, msg):
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = msg.properties.CorrelationData
        cl.publish(msg.properties.ResponseTopic, msg.payload, qos=1, properties=props)

    responder.on_message = answer
    responder.subscribe("echo/req", qos=1)
    requester.on_message = lambda *a: got.set()
    requester.subscribe("echo/resp", qos=1)
    time.sleep(0.5)
    times = []
    for i in range(n):
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic, props.CorrelationData = "echo/resp", str(i).encode()
        got.clear()
        t0 = time.perf_counter()
        requester.publish("echo/req", b"x" * 64, qos=1, properties=props)
        if not got.wait(5):
            raise TimeoutError("no echo")
        times.append(time.perf_counter() - t0)
    for c in (responder, requester):
        c.disconnect()
        c.loop_stop()
    return statistics.median(times[10:]) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for broker_nodelay in (True, False):
            b = Broker(Path(tmp) / f"b{int(broker_nodelay)}")
            if not broker_nodelay:
                b.conf.write_text(b.conf.read_text().replace("set_tcp_nodelay true\n", ""))
            b.start()
            try:
                for client_nodelay in ((True, False) if broker_nodelay else (False,)):
                    rows.append((broker_nodelay, client_nodelay, echo_p50(b.port, client_nodelay, args.requests)))
            finally:
                b.stop()
    for broker_nodelay, client_nodelay, p50 in rows:
        where = "broker and clients" if broker_nodelay and client_nodelay else "broker only" if broker_nodelay else "neither"
        print(f"TCP_NODELAY on {where:18}  MQTT 5 echo p50 {p50:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
