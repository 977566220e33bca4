"""The MQTT 5 client: persistent session, jittered reconnect, in-order manual acks, TCP_NODELAY.

* ``clean_start=False`` + a session expiry + a stable client id, so requests queued at the broker
  while the daemon is down are delivered when it returns (paho's default wipes the session at a
  process's first connect).
* Manual acknowledgement: a request is PUBACKed only once its answer has been handed to the
  client, so a crash mid-request leaves it with the broker for redelivery. Acks go out in the
  order the requests arrived (MQTT 5, 4.6), and never across a reconnect (packet ids restart).
* A network thread of our own reconnects with jittered exponential backoff, reset only after the
  connection has been stable for a while (avoids reconnect storms, mosquitto#1035).
* TCP_NODELAY on the client socket: without it (and ``set_tcp_nodelay true`` on the broker), each
  MQTT round trip waits for Nagle's algorithm — 40-90 ms instead of under 1 ms on loopback.
"""

from __future__ import annotations

import logging
import random
import socket
import ssl
import threading
import time
from collections import OrderedDict
from typing import Callable

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ..config.schema import DaemonConfig, read_secret

log = logging.getLogger(__name__)

STABLE_AFTER_S = 10.0


class AckSequencer:
    """Acknowledge QoS 1 messages in arrival order, once each is done, within one connection."""

    def __init__(self, send_ack: Callable[[int], None]) -> None:
        self._send = send_ack
        self._lock = threading.Lock()
        self._generation = 0
        self._pending: OrderedDict[int, bool] = OrderedDict()

    def new_connection(self) -> None:
        with self._lock:
            self._generation += 1
            self._pending.clear()  # their packet ids mean nothing on the new connection: the broker redelivers

    def received(self, mid: int) -> tuple[int, int]:
        with self._lock:
            self._pending[mid] = False
            return (self._generation, mid)

    def done(self, token: tuple[int, int] | None) -> None:
        if token is None:
            return
        gen, mid = token
        to_ack = []
        with self._lock:
            if gen != self._generation or mid not in self._pending:
                return
            self._pending[mid] = True
            while self._pending and next(iter(self._pending.values())):
                to_ack.append(self._pending.popitem(last=False)[0])
        for m in to_ack:
            self._send(m)


def _settled(info) -> bool:
    """True once the broker acknowledged a publish, or once paho gave up on it."""
    try:
        return info.is_published()
    except (RuntimeError, ValueError):  # paho raises for a publish that failed (e.g. queued while offline)
        return info.rc != mqtt.MQTT_ERR_NO_CONN


def backoff(attempt: int, lo: float, hi: float, rng=random.random) -> float:
    """Full-jitter exponential backoff: uniform in [lo, min(hi, lo * 2**attempt)]."""
    cap = min(hi, lo * (2 ** min(attempt, 30)))
    return lo + (cap - lo) * rng()


class MqttTransport:
    """Owns the paho client and its network thread.

    Args:
        cfg: daemon config.
        subscriptions: topic filters to subscribe (QoS from the config) on every connect.
        on_message: called in the network thread for each message with the message and an ack
            token to pass to :meth:`done` once it is answered; must not block.
        on_connected: called in the network thread after each successful connect.
        will: (topic, payload) published retained by the broker if we vanish.
    """

    def __init__(self, cfg: DaemonConfig, subscriptions: list[str], on_message, on_connected, will: tuple[str, bytes]) -> None:
        self.cfg = cfg
        self.subscriptions = subscriptions
        self._on_message_cb = on_message
        self._on_connected_cb = on_connected
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._closing = False
        self.heartbeat = time.monotonic()
        self._thread: threading.Thread | None = None
        m = cfg.mqtt
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cfg.client_id, protocol=mqtt.MQTTv5, manual_ack=True)
        c.max_queued_messages_set(0)
        c.max_inflight_messages_set(100)
        c.will_set(will[0], will[1], qos=1, retain=True)
        if m.username:
            password = read_secret(m.password_file, m.password_credential, "mqtt password")
            c.username_pw_set(m.username, password)
        if m.tls_ca_file or m.tls_cert_file:
            try:
                c.tls_set(ca_certs=str(m.tls_ca_file) if m.tls_ca_file else None,
                          certfile=str(m.tls_cert_file) if m.tls_cert_file else None,
                          keyfile=str(m.tls_key_file) if m.tls_key_file else None,
                          cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
            except (OSError, ssl.SSLError, ValueError) as exc:
                from ..config.schema import ConfigError

                raise ConfigError(f"mqtt TLS files (tls_ca_file, tls_cert_file, tls_key_file): {exc}") from None
        c.on_socket_open = self._on_socket_open
        # Publishing threads only queue packets; this network thread writes them (paho's hook for an
        # external event loop). Otherwise every publish is a send() on the publishing thread.
        c.on_socket_register_write = lambda client, userdata, sock: None
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        self.client = c
        self.acks = AckSequencer(lambda mid: c.ack(mid, 1))
        self._unconfirmed: list = []  # MessageInfo of QoS>0 publishes not yet acknowledged by the broker
        self._unconfirmed_lock = threading.Lock()

    # lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="k2edge-mqtt", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Disconnect cleanly (no Last Will) and end the network thread."""
        self._closing = True
        try:
            self.client.disconnect()  # queued; the network thread writes DISCONNECT, then the loop ends
        except Exception:  # already gone
            pass
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _connect_properties(self) -> Properties:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.cfg.mqtt.session_expiry_s
        props.ReceiveMaximum = 65535  # our bounded queue, not the broker, decides when we are busy
        return props

    def _run(self) -> None:
        m = self.cfg.mqtt
        attempt, first = 0, True
        up_since: float | None = None
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            if self._closing and not self._socket_open():
                return
            if not self._socket_open():
                try:
                    if first:
                        self.client.connect(m.host, m.port, m.keepalive_s, clean_start=False,
                                            properties=self._connect_properties())
                        first = False
                    else:
                        self.client.reconnect()
                except (OSError, ssl.SSLError, mqtt.WebsocketConnectionError) as exc:
                    delay = backoff(attempt, m.reconnect_min_s, m.reconnect_max_s)
                    attempt += 1
                    log.warning("broker %s:%d unreachable (%s); retrying in %.1f s", m.host, m.port, exc, delay)
                    self._stop.wait(delay)
                    continue
            try:
                rc = self.client.loop(timeout=0.2)
            except Exception:  # a bug in a callback must not end the network thread
                log.exception("MQTT network loop failed; reconnecting")
                self.client.disconnect()
                rc = mqtt.MQTT_ERR_UNKNOWN
            if rc != mqtt.MQTT_ERR_SUCCESS:
                self.connected.clear()
                if self._closing:
                    return
                up_since = None
                delay = backoff(attempt, m.reconnect_min_s, m.reconnect_max_s)
                attempt += 1
                log.warning("connection to the broker lost (%s); reconnecting in %.1f s", mqtt.error_string(rc), delay)
                self._stop.wait(delay)
                continue
            if self.connected.is_set():
                up_since = up_since or time.monotonic()
                if attempt and time.monotonic() - up_since > STABLE_AFTER_S:
                    attempt = 0

    def _socket_open(self) -> bool:
        return self.client.socket() is not None

    # callbacks (network thread) -----------------------------------------------------------------
    @staticmethod
    def _on_socket_open(client, userdata, sock) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):  # TLS or websocket wrappers
            pass

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("broker refused the connection: %s", reason_code)
            return
        self.acks.new_connection()
        for topic in self.subscriptions:
            client.subscribe(topic, qos=self.cfg.mqtt.qos)
        self.connected.set()
        log.info("connected to %s:%d (session present: %s)", self.cfg.mqtt.host, self.cfg.mqtt.port, flags.session_present)
        try:
            self._on_connected_cb()
        except Exception:
            log.exception("on-connect handler failed")

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        if not self._closing:
            log.warning("disconnected from the broker: %s", reason_code)

    def _on_message(self, client, userdata, msg) -> None:
        token = self.acks.received(msg.mid) if msg.qos > 0 else None
        try:
            self._on_message_cb(msg, token)
        except Exception:  # never let one message kill the network thread
            log.exception("request handler failed for a message on %s", msg.topic)
            self.done(token)

    # use from any thread ------------------------------------------------------------------------
    def done(self, token) -> None:
        """Acknowledge a message once its answer has been handed to the client."""
        self.acks.done(token)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                correlation: bytes | None = None, content_type: str = "application/json"):
        props = Properties(PacketTypes.PUBLISH)
        props.ContentType = content_type
        if correlation is not None:
            props.CorrelationData = correlation
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if qos > 0:
            with self._unconfirmed_lock:
                self._unconfirmed = [i for i in self._unconfirmed if not _settled(i)]
                self._unconfirmed.append(info)
        return info

    def wait_published(self, timeout: float) -> bool:
        """Wait until the broker has acknowledged every QoS>0 publish so far (used when draining)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._unconfirmed_lock:
                self._unconfirmed = [i for i in self._unconfirmed if not _settled(i)]
                if not self._unconfirmed:
                    return True
            if not self.connected.is_set():
                return False
            time.sleep(0.02)
        return False
