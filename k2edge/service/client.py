"""A small MQTT 5 request/response client (``k2edge request``, tests, benchmarks)."""

from __future__ import annotations

import base64
import json
import math
import socket
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ..errors import InputError, K2EdgeError

_CTYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png"}


def build_payload(path: str, prompt=None, top_k=None, deadline_ms=None, allow_cloud=True, raw=False, request_id=None,
                  attempt: int = 0):
    """(payload bytes, content type, user properties) for one input file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"input file {path!r} does not exist")
    request_id = request_id or uuid.uuid4().hex[:16]
    fields = {"id": request_id}
    if attempt:
        fields["attempt"] = attempt
    if prompt:
        fields["prompt"] = prompt
    if top_k:
        fields["top_k"] = top_k
    if deadline_ms:
        fields["deadline_ms"] = deadline_ms
    if not allow_cloud:
        fields["allow_cloud"] = False
    if p.suffix.lower() == ".npy":
        import numpy as np

        arr = np.load(p, allow_pickle=False)
        fields["tensor"] = {"dtype": str(arr.dtype), "shape": list(arr.shape),
                            "data": base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode()}
        return json.dumps(fields).encode(), "application/json", {}
    data = p.read_bytes()
    if raw:
        ctype = _CTYPES.get(p.suffix.lower())
        if ctype is None:
            raise InputError(f"--raw sends JPEG or PNG only, not {p.suffix}")
        return data, ctype, {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in fields.items()}
    fields["image"] = base64.b64encode(data).decode()
    return json.dumps(fields).encode(), "application/json", {}


class RequestClient:
    """Connects once, subscribes to a private response topic, matches answers by correlation data."""

    def __init__(self, host: str, port: int, client_id: str | None = None) -> None:
        self.reply_topic = f"k2edge-client/{uuid.uuid4().hex}/reply"
        self._answers: dict[bytes, tuple[dict, float]] = {}
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or "", protocol=mqtt.MQTTv5)
        self.client.on_socket_open = lambda c, u, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.host, self.port = host, port

    def __enter__(self):
        try:
            self.client.connect(self.host, self.port, keepalive=30)
        except OSError as exc:
            raise K2EdgeError(f"cannot reach the broker at {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.client.loop_start()
        self.client.subscribe(self.reply_topic, qos=1)
        if not self._subscribed.wait(10):
            raise K2EdgeError(f"broker at {self.host}:{self.port} did not confirm the subscription")
        return self

    def __exit__(self, *exc):
        self.client.disconnect()
        self.client.loop_stop()

    def _on_message(self, client, userdata, msg):
        corr = getattr(msg.properties, "CorrelationData", None)
        try:
            body = json.loads(msg.payload)
        except ValueError:
            body = {"status": "error", "error": {"code": "bad_response", "message": msg.payload[:200].decode(errors="replace")}}
        with self._cond:
            self._answers[corr] = (body, time.perf_counter())
            self._cond.notify_all()

    def send(self, topic: str, payload: bytes, content_type: str = "application/json", user_properties: dict | None = None,
             correlation: bytes | None = None, deadline_ms: float | None = None) -> tuple[bytes, float]:
        """Publish a request; returns (correlation data, send time).

        With ``deadline_ms`` the message also expires at the broker (MQTT 5 Message Expiry, whole
        seconds rounded up), so a request that waited there past its deadline is never run.
        """
        corr = correlation or uuid.uuid4().bytes
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = corr
        props.ContentType = content_type
        if deadline_ms:
            props.MessageExpiryInterval = expiry_seconds(deadline_ms)
        if user_properties:
            props.UserProperty = list(user_properties.items())
        t0 = time.perf_counter()
        self.client.publish(topic, payload, qos=1, properties=props)
        return corr, t0

    def wait(self, corr: bytes, timeout: float) -> tuple[dict, float]:
        """The answer for ``corr`` and when it arrived."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while corr not in self._answers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise K2EdgeError(f"no answer within {timeout:g} s (is the daemon running and serving this model?)")
                self._cond.wait(left)
            return self._answers.pop(corr)

    def request(self, topic, payload, content_type="application/json", user_properties=None, timeout=10.0,
                deadline_ms: float | None = None):
        corr, t0 = self.send(topic, payload, content_type, user_properties, deadline_ms=deadline_ms)
        body, t1 = self.wait(corr, timeout)
        return body, (t1 - t0) * 1e3


def expiry_seconds(deadline_ms: float) -> int:
    """The MQTT 5 Message Expiry Interval for a deadline: whole seconds, rounded up, never 0 (0 = never)."""
    return max(1, math.ceil(deadline_ms / 1000.0))
