"""A small MQTT 5 request/response client (``k2edge request``, tests, benchmarks)."""

from __future__ import annotations

import base64
import json
import math
import socket
import threading
import time
import uuid

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ..errors import InputError, K2EdgeError
from .common import input_file

_CTYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png"}


def build_payload(path: str, prompt=None, top_k=None, deadline_ms=None, allow_cloud=True, raw=False, request_id=None,
                  attempt: int = 0):
    """(payload bytes, content type, user properties) for one input file."""
    p = input_file(path)
    request_id = request_id or uuid.uuid4().hex[:16]
    fields = {"id": request_id}
    if attempt:
        fields["attempt"] = attempt
    # every value given is sent, 0 and "" too: the daemon's checks answer for them (bad_request, naming the field)
    for name, value in (("prompt", prompt), ("top_k", top_k), ("deadline_ms", deadline_ms)):
        if value is not None:
            fields[name] = value
    if not allow_cloud:
        fields["allow_cloud"] = False
    if p.suffix.lower() == ".npy":
        if raw:
            raise InputError("--raw sends a JPEG or PNG as it is; a .npy tensor goes as JSON (leave out --raw)")
        import numpy as np

        from ..readfile import load_numpy

        try:
            arr = load_numpy(p)
        except (OSError, ValueError) as exc:  # unreadable, not NumPy's, pickled objects, a damaged header, a short file
            raise InputError(f"input file {path!r} is not a numeric .npy array ({exc}); save one with numpy.save") from None
        if not isinstance(arr, np.ndarray):
            arr.close()
            raise InputError(f"input file {path!r} is an .npz archive, not a .npy array; save one with numpy.save")
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
    """Connects once, subscribes to a private response topic, matches answers by correlation data.

    Args:
        host / port: the broker.
        client_id: default: one the broker assigns.
        username / password: broker login.
        tls_ca: a CA file: connect over TLS, verifying the broker's certificate against it.
        reply_prefix: the private response topic's first levels (an ACL may grant operators only
            their own, e.g. ``fleet-ops/replies``).
    """

    def __init__(self, host: str, port: int, client_id: str | None = None, *, username: str | None = None,
                 password: str | None = None, tls_ca: str | None = None, reply_prefix: str = "k2edge-client") -> None:
        self.reply_topic = f"{reply_prefix}/{uuid.uuid4().hex}/reply"
        self._answers: dict[bytes, list[tuple[dict, float]]] = {}
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or "", protocol=mqtt.MQTTv5)
        if username:
            self.client.username_pw_set(username, password)
        if tls_ca:
            import ssl

            try:
                self.client.tls_set(ca_certs=tls_ca, cert_reqs=ssl.CERT_REQUIRED)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise K2EdgeError(f"TLS CA file {tls_ca!r}: {exc}") from None
        self.client.on_socket_open = lambda c, u, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_publish
        self._connected = threading.Event()
        self._connack: str | None = None
        self._refused: str | None = None
        self._mids_lock = threading.Lock()  # never held while calling paho (whose locks call back into us)
        self._refused_mids: dict[int, str] = {}  # packet id -> the broker's reason for refusing it (an ACL, say)
        self._corr_mid: dict[bytes, int] = {}
        self.host, self.port = host, port

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        self._connack = str(reason_code) if reason_code.is_failure else None
        self._connected.set()

    def _on_publish(self, client, userdata, mid, reason_code, properties):
        if reason_code.is_failure:
            with self._mids_lock:
                self._refused_mids[mid] = str(reason_code)
            with self._cond:
                self._cond.notify_all()

    def _publish_refusal(self, corr: bytes) -> str | None:
        with self._mids_lock:
            mid = self._corr_mid.get(corr)
            return self._refused_mids.get(mid) if mid is not None else None

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties):
        failed = [rc for rc in reason_codes if rc.is_failure]
        if failed:
            self._refused = str(failed[0])
        self._subscribed.set()

    def __enter__(self):
        try:
            self.client.connect(self.host, self.port, keepalive=30)
        except OSError as exc:
            raise K2EdgeError(f"cannot reach the broker at {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.client.loop_start()
        if not self._connected.wait(10) or self._connack:
            self.client.loop_stop()
            raise K2EdgeError(f"broker at {self.host}:{self.port} refused the connection ({self._connack or 'no CONNACK'})")
        self.client.subscribe(self.reply_topic, qos=1)
        if not self._subscribed.wait(10):
            raise K2EdgeError(f"broker at {self.host}:{self.port} did not confirm the subscription")
        if self._refused:
            raise K2EdgeError(f"broker at {self.host}:{self.port} refused the subscription to {self.reply_topic} "
                              f"({self._refused}); check the login and its ACL")
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
            self._answers.setdefault(corr, []).append((body, time.perf_counter()))
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
        info = self.client.publish(topic, payload, qos=1, properties=props)
        with self._mids_lock:
            self._corr_mid[corr] = info.mid
        return corr, t0

    def wait(self, corr: bytes, timeout: float, topic: str | None = None) -> tuple[dict, float]:
        """The answer for ``corr`` and when it arrived; ``topic``: where the request went (named when none comes)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._answers.get(corr):
                left = deadline - time.monotonic()
                if left <= 0:
                    sent = f" to {topic}" if topic else ""
                    raise K2EdgeError(f"no answer{sent} within {timeout:g} s (is the daemon running and serving this model?)")
                self._cond.wait(left)
            return self._answers[corr].pop(0)

    def collect(self, corr: bytes, timeout: float, expect: int | None = None, on_answer=None) -> list[dict]:
        """Every answer for ``corr`` (one per device, for a fleet group) until ``timeout`` passes or
        ``expect`` answers came; ``on_answer(body)`` is called for each as it arrives."""
        deadline = time.monotonic() + timeout
        got: list[dict] = []
        with self._cond:
            while expect is None or len(got) < expect:
                refusal = self._publish_refusal(corr)
                if refusal:
                    raise K2EdgeError(f"the broker refused the message ({refusal}); check the login's ACL")
                while self._answers.get(corr):
                    body, _ = self._answers[corr].pop(0)
                    got.append(body)
                    if on_answer is not None:
                        on_answer(body)
                if expect is not None and len(got) >= expect:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return got

    def request(self, topic, payload, content_type="application/json", user_properties=None, timeout=10.0,
                deadline_ms: float | None = None):
        corr, t0 = self.send(topic, payload, content_type, user_properties, deadline_ms=deadline_ms)
        body, t1 = self.wait(corr, timeout, topic)
        return body, (t1 - t0) * 1e3


def expiry_seconds(deadline_ms: float) -> int:
    """The MQTT 5 Message Expiry Interval for a deadline: whole seconds, rounded up, never 0 (0 = never)."""
    return max(1, math.ceil(deadline_ms / 1000.0))
