"""Real infrastructure for the daemon tests: a mosquitto broker on a free loopback port, the
daemon as a subprocess, and an MQTT 5 test client that records every answer."""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

ROOT = Path(__file__).resolve().parents[2]
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
DEMO = ROOT / "models" / "digits"
SAMPLES = sorted((DEMO / "samples").glob("*.jpg"))
DIGITS = {"name": "digits", "onnx": DEMO / "model.onnx", "profile": "cpu-dev", "top_k": 3}
TOPIC = "k2edge/t1/infer/digits"


def image_request(path: Path, rid: str | None = None, **extra) -> dict:
    """A JSON request carrying a base64 image file."""
    body = {"id": rid or uuid.uuid4().hex[:12], "image": base64.b64encode(path.read_bytes()).decode()}
    body.update(extra)
    return body


def tensor_request(arr, rid: str | None = None, **extra) -> dict:
    """A JSON request carrying a tensor."""
    body = {"id": rid or uuid.uuid4().hex[:12],
            "tensor": {"dtype": str(arr.dtype), "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode()}}
    body.update(extra)
    return body


def _ephemeral_ports() -> range:
    """The kernel's range for the local ports of outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A loopback port nothing listens on now, outside the kernel's ephemeral range.

    A port the kernel handed out (bind to 0) is free only until it hands it out again, and it does, as the local
    port of the next outgoing connection: with the suite's two workers connecting to brokers all the time, a daemon
    given such a port for its metrics found it taken ("Address already in use"). Ports below the ephemeral range are
    never given to outgoing connections, so only another free_port could pick the same one (chosen at random).
    """
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(20000, 32768) if p not in ephemeral] or list(range(20000, 30000))
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


class Broker:
    """mosquitto with persistence (sessions and queued messages survive a restart) and TCP_NODELAY."""

    def __init__(self, workdir: Path, extra_conf: str = "") -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.conf = self.dir / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "set_tcp_nodelay true\n"
            "persistence true\n"
            f"persistence_location {self.dir}/\n"
            "autosave_interval 1\n"
            "max_queued_messages 10000\n"
            # as root mosquitto drops to the 'mosquitto' user, which cannot read pytest's private
            # temporary directories (persistence, password files); no effect for other users
            "user root\n" + extra_conf
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Broker":
        self.log = open(self.dir / "mosquitto.log", "ab")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=self.log, stderr=subprocess.STDOUT)
        wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: mosquitto writes its persistence file on the way out
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


def write_config(path: Path, port: int, models: list[dict], device: str = "t1", service: dict | None = None,
                 fleet: str | None = None, mqtt_extra: dict | None = None, tables: dict[str, dict] | None = None,
                 streams: list[dict] = ()) -> Path:
    """A daemon config; ``tables`` adds top-level tables ([cloud], [thermal]); a dict value inside a
    model entry becomes its sub-table ([models.escalation]); each of ``streams`` a [[streams]] entry, whose
    ``zones``, ``lines`` and ``escalation`` lists become [[streams.zones]], [[streams.lines]], [[streams.escalation]]."""
    def val(v):
        return json.dumps(str(v)) if isinstance(v, (str, Path)) else json.dumps(v)

    lines = [f'device_id = "{device}"', "[mqtt]", 'host = "127.0.0.1"', f"port = {port}", "reconnect_min_s = 0.2",
             "reconnect_max_s = 1.0"]
    for k, v in (mqtt_extra or {}).items():
        lines.append(f"{k} = {val(v)}")
    service = dict(service or {})
    service.setdefault("state_dir", str(path.parent / f"state-{device}"))  # answers and outbox: per device, never ~/.local
    lines += ["[service]", "telemetry_interval_s = 1"]
    for k, v in service.items():
        lines.append(f"{k} = {val(v)}")
    if fleet:
        lines += ["[fleet]", f'group = "{fleet}"']
    for name, table in (tables or {}).items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {val(v)}" for k, v in table.items()]
    for m in models:
        lines.append("[[models]]")
        lines += [f"{k} = {val(v)}" for k, v in m.items() if not isinstance(v, dict)]
        for sub, table in ((k, v) for k, v in m.items() if isinstance(v, dict)):
            lines.append(f"[models.{sub}]")
            lines += [f"{k} = {val(v)}" for k, v in table.items()]
    for st in streams:
        lines.append("[[streams]]")
        lines += [f"{k} = {val(v)}" for k, v in st.items() if k not in ("zones", "lines", "escalation")]
        for sub in ("zones", "lines", "escalation"):
            for table in st.get(sub, ()):
                lines.append(f"[[streams.{sub}]]")
                lines += [f"{k} = {val(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class DaemonProcess:
    """``k2edge serve`` in a subprocess, its log captured."""

    def __init__(self, config: Path, log: Path, env: dict | None = None, verbose: bool = False) -> None:
        self.config, self.log_path = config, log
        self.verbose = verbose
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> "DaemonProcess":
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "k2edge", *(["-v"] if self.verbose else []), "serve",
                                      "--config", str(self.config)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        return self

    def terminate(self, timeout: float = 60, sig: int = signal.SIGTERM) -> int:
        """SIGTERM (or ``sig``), and the exit status once the daemon has drained. A daemon still running after
        ``timeout`` has its threads' stacks written to its log (SIGUSR1), is killed, and fails the test with the log's end."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)  # the stacks written before the kill
            self.kill()
            raise AssertionError(f"the daemon did not stop within {timeout:g} s of {signal.Signals(sig).name}; its log ends:\n"
                                 + self.output()[-20000:]) from None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


class Client:
    """An MQTT 5 requester: private reply topic, correlation data, every answer recorded in order."""

    def __init__(self, port: int, client_id: str | None = None, persistent: bool = False) -> None:
        self.port = port
        self.reply_topic = f"test/{uuid.uuid4().hex[:8]}/reply"
        self.answers: list[tuple[dict, object]] = []
        self.statuses: list[dict] = []
        self.status_times: list[float] = []  # when each status arrived (time.monotonic)
        self.other: list[tuple[str, dict]] = []
        self.binary: list[tuple[str, bytes, str | None, dict]] = []  # (topic, payload, content type, user properties)
        self.dups: list[bool] = []  # MQTT DUP flag of each answer: a broker retransmission, not a second answer
        self.raw: list[tuple[bytes, float]] = []  # each answer's exact bytes and when it arrived (time.monotonic)
        self.answer_props: list[dict] = []  # each answer's MQTT 5 user properties (traceparent)
        self.answer_wall: list[int] = []  # when each answer arrived (time.time_ns: comparable with span times)
        self._cond = threading.Condition()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or f"test-{uuid.uuid4().hex[:8]}",
                             protocol=mqtt.MQTTv5)
        self.c.on_message = self._on_message
        self.c.on_socket_open = lambda c, u, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.c.reconnect_delay_set(0.1, 0.5)
        self.persistent = persistent
        self._subscribed = threading.Event()  # the SUBACK of the subscriptions made at connect has come
        self._subacks: set[int] = set()
        self._awaited_subacks: set[int] = set()
        self.c.on_connect = self._on_connect
        self.c.on_subscribe = self._on_subscribe

    def _on_connect(self, client, userdata, flags, rc, props):
        _, mid = client.subscribe([(self.reply_topic, 1), ("k2edge/+/status", 1), ("k2edge/+/result/#", 1),
                                   ("k2edge/+/errors", 1)])
        with self._cond:
            self._awaited_subacks.add(mid)

    def _on_subscribe(self, client, userdata, mid, reason_codes, props):
        with self._cond:
            self._subacks.add(mid)
            if mid in self._awaited_subacks:
                self._subscribed.set()
            self._cond.notify_all()

    def subscribe(self, topic: str, qos: int = 1, timeout: float = 30.0) -> None:
        """Subscribe and wait for the broker's SUBACK: what is published after this returns reaches us."""
        _, mid = self.c.subscribe(topic, qos=qos)
        self.wait_for(lambda c: mid in c._subacks, timeout)

    def connect(self) -> "Client":
        props = Properties(PacketTypes.CONNECT)
        if self.persistent:
            props.SessionExpiryInterval = 3600
        self.c.connect("127.0.0.1", self.port, keepalive=10, clean_start=not self.persistent, properties=props)
        self.c.loop_start()
        assert self._subscribed.wait(30), "no SUBACK from the broker"
        return self

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()

    def _on_message(self, client, userdata, msg):
        try:
            body = json.loads(msg.payload)
        except ValueError:
            body = {"raw": msg.payload.decode(errors="replace")}
            props = msg.properties
            with self._cond:  # a binary payload (a snapshot): its exact bytes, content type and user properties
                self.binary.append((msg.topic, bytes(msg.payload), getattr(props, "ContentType", None),
                                    dict(getattr(props, "UserProperty", []) or [])))
        with self._cond:
            if msg.topic.endswith("/status"):
                self.statuses.append(body)
                self.status_times.append(time.monotonic())
            elif msg.topic == self.reply_topic:
                self.answers.append((body, getattr(msg.properties, "CorrelationData", None)))
                self.dups.append(bool(msg.dup))
                self.raw.append((msg.payload, time.monotonic()))
                self.answer_props.append(dict(getattr(msg.properties, "UserProperty", []) or []))
                self.answer_wall.append(time.time_ns())
            else:
                self.other.append((msg.topic, body))
            self._cond.notify_all()

    def publish(self, topic: str, payload, *, content_type: str = "application/json", user_properties: dict | None = None,
                reply: bool = True, correlation: bytes | None = None, expiry_s: int | None = None):
        props = Properties(PacketTypes.PUBLISH)
        if expiry_s is not None:
            props.MessageExpiryInterval = expiry_s
        if reply:
            props.ResponseTopic = self.reply_topic
            props.CorrelationData = correlation or uuid.uuid4().bytes
        props.ContentType = content_type
        if user_properties:
            props.UserProperty = list(user_properties.items())
        if isinstance(payload, dict):
            payload = json.dumps(payload).encode()
        self.c.publish(topic, payload, qos=1, properties=props)
        return props.CorrelationData if reply else None

    def wait_for(self, predicate, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out; {len(self.answers)} answers, statuses {[s.get('state') for s in self.statuses]}")
                self._cond.wait(min(left, 0.5))  # a predicate may watch more than messages (a process's exit)

    def wait_answers(self, n: int, timeout: float = 30.0) -> list[dict]:
        self.wait_for(lambda c: len(c.answers) >= n, timeout)
        return [a for a, _ in self.answers]

    def settle(self, *topics: str, timeout: float = 60.0) -> None:
        """Send a marker request (a digits image, run like any other) to each request topic and wait for its
        answer: anything the daemon behind it was still going to send (a second copy, a late answer) would
        have come before it. Marker answers are removed again, so what a test counts is its own."""
        marks = {self.publish(topic, image_request(SAMPLES[0], rid=f"settle-{uuid.uuid4().hex[:8]}")) for topic in topics}
        self.wait_for(lambda c: marks <= {corr for _, corr in c.answers}, timeout)
        with self._cond:
            keep = [i for i, (_, corr) in enumerate(self.answers) if corr not in marks]
            self.answers[:] = [self.answers[i] for i in keep]
            self.dups[:] = [self.dups[i] for i in keep]
            self.raw[:] = [self.raw[i] for i in keep]
            self.answer_props[:] = [self.answer_props[i] for i in keep]
            self.answer_wall[:] = [self.answer_wall[i] for i in keep]

    def wait_state(self, state: str, device: str = "t1", timeout: float = 60.0) -> None:
        self.wait_for(lambda c: any(s.get("state") == state and s.get("device") == device for s in c.statuses), timeout)
