"""The MQTT 5 client: persistent session, jittered reconnect, in-order manual acks, broker backpressure.

* ``clean_start=False`` + a session expiry + a stable client id, so requests queued at the broker
  while the daemon is down are delivered when it returns (paho's default wipes the session at a
  process's first connect).
* Manual acknowledgement: a request is PUBACKed only once its answer is delivered (or its cloud
  work is in the outbox), so a crash mid-request leaves it with the broker for redelivery. Acks go
  out in the order the requests arrived (MQTT 5, 4.6), and never across a reconnect (packet ids
  restart).
* Backpressure: CONNECT asks for a Receive Maximum of the daemon's queue size, and while the
  request path says it is saturated the network thread does not call ``loop_read``, so a backlog
  waits at the broker (mosquitto 2.0.11 honours Receive Maximum only for its first burst). One
  ``loop_read`` reads at most as many packets as the client has QoS 1 messages awaiting the
  broker's acknowledgement (one when there are none), so the pause holds to within that many
  requests of the bound. Writes (answers, acks) go on; reading resumes within half the keepalive
  at the latest.
* Every publish may carry an ``on_delivered`` callback, called when the broker acknowledges it
  (``on_publish``, keyed by packet id) — including answers queued while disconnected and sent on
  reconnect, which paho's ``MessageInfo.is_published()`` never reports.
* A network thread of our own reconnects with jittered exponential backoff, reset only after the
  connection has been stable for a while (avoids reconnect storms, mosquitto#1035).
* TCP_NODELAY on the client socket: without it (and ``set_tcp_nodelay true`` on the broker), each
  MQTT round trip waits for Nagle's algorithm — 40-90 ms instead of under 1 ms on loopback. Where
  the system has TCP_CORK (Linux), the socket is corked while ``loop_write`` sends what is queued,
  so a batch's answers and acks reach the broker in full segments, not one segment per packet.

Only paho's public API is used (``loop_read`` / ``loop_write`` / ``loop_misc`` on a socket this
module selects on, ``manual_ack`` with ``ack``, the ``on_socket_*`` callbacks).
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Protocol

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers

from ..backoff import backoff
from ..config.schema import DaemonConfig, read_secret

log = logging.getLogger(__name__)

STABLE_AFTER_S = 10.0


class PublishProperties(Properties):
    """A PUBLISH's Content Type and Correlation Data, packed once, here.

    paho's ``Properties`` walks every property name on each attribute set and again in ``pack()``
    (tens of microseconds an answer); this one is a plain ``Properties`` to paho (it reads and
    prints the same) whose ``pack()`` returns the bytes computed at construction.
    """

    _template = Properties(PacketTypes.PUBLISH).__dict__  # packetType and the name tables, shared and never changed

    @classmethod
    def make(cls, content_type: str, correlation: bytes | None = None,
             user: tuple[tuple[str, str], ...] = ()) -> "PublishProperties":
        p = cls.__new__(cls)
        d = p.__dict__
        d.update(cls._template)
        d["ContentType"] = content_type
        ct = content_type.encode()
        body = b"\x03" + len(ct).to_bytes(2, "big") + ct  # 3: Content Type, a UTF-8 string
        if correlation is not None:
            d["CorrelationData"] = correlation
            body += b"\x09" + len(correlation).to_bytes(2, "big") + correlation  # 9: Correlation Data, binary
        if user:
            d["UserProperty"] = list(user)
            for key, value in user:  # 38: User Property, a UTF-8 string pair (paho packs them last, in order)
                k, v = key.encode(), value.encode()
                body += b"\x26" + len(k).to_bytes(2, "big") + k + len(v).to_bytes(2, "big") + v
        d["_packed"] = VariableByteIntegers.encode(len(body)) + body
        return p

    def pack(self) -> bytes:
        return self._packed


_PEEK_BYTES = 256
_TCP_CORK = getattr(socket, "TCP_CORK", None)  # Linux


def _libc_setsockopt():
    """libc's ``setsockopt`` called through ctypes, which lets go of the interpreter lock for the
    call; ``socket.setsockopt`` keeps it, and uncorking is the call that sends what was corked (on
    loopback the kernel hands it to the broker inside that call). None where there is no libc."""
    try:
        import ctypes

        f = ctypes.CDLL(None, use_errno=True).setsockopt
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32]
    f.restype = ctypes.c_int
    zero = ctypes.c_int(0)
    return lambda fd: f(fd, socket.IPPROTO_TCP, _TCP_CORK, ctypes.byref(zero), ctypes.sizeof(zero)) == 0


_UNCORK = _libc_setsockopt() if _TCP_CORK is not None else None


def publish_ahead(data: bytes, truncated: bool) -> bool:
    """True when the MQTT packets that start at ``data[0]`` include a PUBLISH; a packet cut off
    before its type can be seen counts as one when ``truncated`` (more bytes wait than were read)."""
    i, n = 0, len(data)
    while i < n:
        if data[i] & 0xF0 == mqtt.PUBLISH:
            return True
        length, shift, j = 0, 0, i + 1
        while j < n:
            length |= (data[j] & 0x7F) << shift
            shift += 7
            j += 1
            if not data[j - 1] & 0x80:
                break
        else:
            return truncated  # the remaining length itself is cut off
        i = j + length
    return truncated and i > n


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


class Handler(Protocol):
    """What a connection's messages go to (the request path; the deploy lifecycle)."""

    def on_message(self, msg, token) -> None:
        """One message, in the network thread; ``token`` goes to :meth:`MqttTransport.done` once it
        is answered. Must not block."""

    def on_connected(self) -> None:
        """After each successful connect, in the network thread."""

    def saturated(self) -> bool:
        """True while the handler holds all the messages it should: reading pauses."""


class MqttTransport:
    """Owns the paho client and its network thread; the broker as the daemon's objects see it:
    :meth:`publish`, :meth:`done` (acknowledge a request), :meth:`wake`, :meth:`input_pending`.

    Args:
        cfg: daemon config.
        role: what the connection carries (``requests``, ``control``), for the log.
        subscriptions: topic filters to subscribe (QoS from the config) on every connect.
        will: (topic, payload) published retained by the broker if we vanish (None: no will).
    """

    def __init__(self, cfg: DaemonConfig, role: str, subscriptions: list[str], will: tuple[str, bytes] | None = None) -> None:
        self.cfg = cfg
        self.role = role
        self.subscriptions = subscriptions
        self.handler: Handler | None = None
        self.connected = threading.Event()
        self.subscribed = threading.Event()  # the broker acknowledged every subscription of this connection
        self._awaiting_suback: dict[int, str] = {}  # mid -> topic of each subscription not yet acknowledged
        self.connections = 0  # successful connects so far (a watcher sees a reconnect it slept through)
        self._stop = threading.Event()
        self._closing = False
        self._leaving = threading.Event()  # set by stop(): a wait to reconnect ends at once
        self.heartbeat = time.monotonic()
        self._thread: threading.Thread | None = None
        self._paused_since: float | None = None
        self.pauses = 0  # times reading was paused for backpressure (status, tests)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        m = cfg.mqtt
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cfg.client_id, protocol=mqtt.MQTTv5, manual_ack=True)
        c.max_queued_messages_set(0)
        c.max_inflight_messages_set(min(20, m.max_inflight))  # mosquitto's default, until a CONNACK says how many it takes
        self._broker_receive_max: int | None = None
        if will is not None:
            c.will_set(will[0], will[1], qos=1, retain=True)
        if m.username:
            password = read_secret(m.password_file, m.password_credential, "mqtt password")
            c.username_pw_set(m.username, password)
        if m.tls_ca_file or m.tls_cert_file:
            from ..config.schema import ConfigError

            for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):  # which key, which path: not just "Errno 2"
                path = getattr(m, key)
                if path is not None and not Path(path).is_file():
                    raise ConfigError(f"{cfg.where}: mqtt.{key}: {str(path)!r} "
                                      + ("is a directory, not a file" if Path(path).is_dir() else "does not exist"))
            try:
                c.tls_set(ca_certs=str(m.tls_ca_file) if m.tls_ca_file else None,
                          certfile=str(m.tls_cert_file) if m.tls_cert_file else None,
                          keyfile=str(m.tls_key_file) if m.tls_key_file else None,
                          cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise ConfigError(f"{cfg.where}: mqtt TLS files (tls_ca_file, tls_cert_file, tls_key_file): {exc}") from None
        c.on_socket_open = self._on_socket_open
        # Publishing threads only queue packets and wake this network thread, which writes them
        # (paho's hook for an external event loop); otherwise every publish is a send() on the caller.
        c.on_socket_register_write = lambda client, userdata, sock: self.wake()
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_subscribe = self._on_subscribe
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        self.client = c
        self.acks = AckSequencer(lambda mid: c.ack(mid, 1))
        # delivery callbacks by packet id; ``_early`` holds acknowledgements that beat their registration
        self._delivery_lock = threading.Lock()
        self._on_delivered: dict[int, Callable[[], None] | None] = {}
        self._early: set[int] = set()

    # lifecycle -------------------------------------------------------------------------------
    def start(self, handler: Handler) -> None:
        """Connect and serve ``handler`` on a network thread of its own."""
        self.handler = handler
        self._thread = threading.Thread(target=self._run, name=f"k2edge-mqtt-{self.role}", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Disconnect cleanly (no Last Will) and end the network thread; False when the thread had not ended
        after 10 s (it is told to stop then, and ends at its next turn)."""
        self._closing = True
        self._leaving.set()
        try:
            self.client.disconnect()  # queued; the network thread writes DISCONNECT, then the loop ends
        except Exception:  # already gone
            pass
        self.wake()
        ended = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            ended = not self._thread.is_alive()
        self._stop.set()
        self._wake_r.close()
        self._wake_w.close()
        return ended

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        """Interrupt the network thread's wait (a packet to write, or room to read again); the network
        thread itself needs no waking."""
        if self._thread is not None and threading.get_ident() == self._thread.ident:
            return
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):  # already awake, or closed
            pass

    def _connect_properties(self) -> Properties:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.cfg.mqtt.session_expiry_s
        # ask the broker to hold what we would not hold ourselves (honoured by mosquitto 2.0.11 for
        # the first burst only; the read pause below is the bound that holds)
        props.ReceiveMaximum = min(65535, self.cfg.service.queue_size)
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
                        self._apply_receive_max()
                        self.client.reconnect()
                except (OSError, ssl.SSLError, mqtt.WebsocketConnectionError) as exc:
                    delay = backoff(attempt, m.reconnect_min_s, m.reconnect_max_s)
                    attempt += 1
                    log.warning("broker %s:%d unreachable (%s); retrying in %.1f s", m.host, m.port, exc, delay)
                    self._leaving.wait(delay)
                    continue
                if self._closing:  # stop() came while this connected: its DISCONNECT found no socket to go on
                    self.client.disconnect()
            try:
                rc = self._loop_once(0.2)
            except Exception:  # a bug in a callback must not end the network thread
                log.exception("MQTT network loop failed; reconnecting")
                self.client.disconnect()
                rc = mqtt.MQTT_ERR_UNKNOWN
            if rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_AGAIN):
                self.connected.clear()
                if self._closing:
                    return
                up_since = None
                delay = backoff(attempt, m.reconnect_min_s, m.reconnect_max_s)
                attempt += 1
                log.warning("connection to the broker lost (%s); reconnecting in %.1f s", mqtt.error_string(rc), delay)
                self._leaving.wait(delay)
                continue
            if self.connected.is_set():
                up_since = up_since or time.monotonic()
                if attempt and time.monotonic() - up_since > STABLE_AFTER_S:
                    attempt = 0

    def _apply_receive_max(self) -> None:
        if self._broker_receive_max and self.client.max_inflight_messages != self._broker_receive_max:
            try:
                self.client.max_inflight_messages_set(self._broker_receive_max)
            except RuntimeError:  # paho still counts the old connection as open
                pass

    def _reading_paused(self) -> bool:
        if self._closing or self._room():
            self._paused_since = None
            return False
        now = time.monotonic()
        if self._paused_since is None:
            self._paused_since = now
            self.pauses += 1
        # never so long that the broker's keepalive gives up on us
        return now - self._paused_since < self.cfg.mqtt.keepalive_s / 2

    def _loop_once(self, timeout: float) -> int:
        """One turn of the network loop (paho's ``loop()``, with reading paused under backpressure:
        ``loop_read`` is not called while the handler is saturated)."""
        c = self.client
        sock = c.socket()
        if sock is None:
            return mqtt.MQTT_ERR_NO_CONN
        paused = self._reading_paused()
        pending = sock.pending() if hasattr(sock, "pending") else 0  # TLS: bytes already decrypted
        rlist = [self._wake_r] if paused else [sock, self._wake_r]
        wlist = [sock] if c.want_write() else []
        wait = min(timeout, 0.05) if paused else (0.0 if pending else timeout)
        try:
            readable, _, _ = select.select(rlist, wlist, [], wait)
        except (ValueError, TypeError, OSError):  # the socket was closed under us
            return mqtt.MQTT_ERR_CONN_LOST
        if self._wake_r in readable:
            try:
                self._wake_r.recv(4096)
            except (BlockingIOError, OSError):
                pass
        if not paused and (sock in readable or pending):
            rc = c.loop_read()
            if rc or c.socket() is None:
                return rc or mqtt.MQTT_ERR_CONN_LOST
        if c.want_write():
            rc = self._write(c, sock)
            if rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_AGAIN):
                return rc
        return c.loop_misc()

    @staticmethod
    def _write(c: mqtt.Client, sock) -> int:
        """``loop_write`` with the socket corked: paho sends each queued packet on its own, and with
        TCP_NODELAY each would be a segment the broker reads on its own; uncorking sends the rest."""
        if _TCP_CORK is None:
            return c.loop_write()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 1)
        except (OSError, AttributeError, ValueError):  # a wrapper that is not a TCP socket
            return c.loop_write()
        try:
            return c.loop_write()
        finally:
            try:
                if _UNCORK is None or not _UNCORK(sock.fileno()):
                    sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 0)
            except (OSError, ValueError):  # closed while writing: nothing left to send
                pass

    def input_pending(self) -> bool:
        """True when another request (a PUBLISH) waits to be read: let requests batch.

        Called from ``on_message``, when paho has read the current packet whole and nothing beyond
        it, so the socket's next bytes start a packet: a peek at them tells a request from the
        broker's acknowledgement of an answer (which must not send a lone request to its line).
        Where it cannot peek (TLS), any bytes waiting count.
        """
        sock = self.client.socket()
        if sock is None:
            return False
        if hasattr(sock, "pending"):  # TLS: decrypted bytes, or bytes on the wire
            if sock.pending():
                return True
            try:
                return bool(select.select([sock], [], [], 0)[0])
            except (ValueError, TypeError, OSError):
                return False
        try:
            head = sock.recv(_PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError, TypeError):
            return False
        return publish_ahead(head, len(head) == _PEEK_BYTES)

    def read_allowance(self) -> int:
        """How many requests one read may bring in past the read pause: paho's ``loop_read`` reads up to as many
        packets as there are publishes awaiting the broker's acknowledgement, plus one."""
        with self._delivery_lock:
            return len(self._on_delivered) + 1

    def _room(self) -> bool:
        return self.handler is None or not self.handler.saturated()

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
        # send no more unacknowledged QoS 1 messages than the broker said it takes (MQTT 5, 3.2.2.3.3; absent: 65535)
        # nor than [mqtt] max_inflight: each in flight when the broker restarts is sent again (DUP), and a broker that
        # had taken it delivers it twice, so the window bounds a restart's repeats. paho applies a new limit only to a
        # new connection
        self._broker_receive_max = min(getattr(properties, "ReceiveMaximum", None) or 65535, self.cfg.mqtt.max_inflight)
        self.acks.new_connection()
        self.subscribed.clear()
        self._awaiting_suback = {client.subscribe(topic, qos=self.cfg.mqtt.qos)[1]: topic for topic in self.subscriptions}
        self.connections += 1
        self.connected.set()
        log.info("connected to %s:%d (%s, session present: %s)", self.cfg.mqtt.host, self.cfg.mqtt.port, self.role,
                 flags.session_present)
        if not self._awaiting_suback:
            self._on_subscribed()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        topic = self._awaiting_suback.pop(mid, None)
        refused = [rc for rc in reason_codes if rc.is_failure]
        if topic is not None and refused:  # nothing will come on it: say so, not a silent daemon
            log.error("the broker refused the subscription to %s (%s); check the login's ACL", topic, refused[0])
        if not self._awaiting_suback and not self.subscribed.is_set():
            self._on_subscribed()

    def _on_subscribed(self) -> None:
        # only now is what others publish to our topics delivered to us: the moment to say we are here
        self.subscribed.set()
        try:
            self.handler.on_connected()
        except Exception:
            log.exception("on-connect handler failed")

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        self.subscribed.clear()
        if not self._closing:
            log.warning("disconnected from the broker: %s", reason_code)

    def _on_message(self, client, userdata, msg) -> None:
        token = self.acks.received(msg.mid) if msg.qos > 0 else None
        try:
            self.handler.on_message(msg, token)
        except Exception:  # never let one message kill the network thread
            log.exception("request handler failed for a message on %s", msg.topic)
            self.done(token)

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        with self._delivery_lock:
            if mid in self._on_delivered:
                callback = self._on_delivered.pop(mid)
            else:  # acknowledged before publish() returned its packet id to us
                self._early.add(mid)
                return
        if callback is not None:
            callback()

    # use from any thread ------------------------------------------------------------------------
    def done(self, token) -> None:
        """Acknowledge a request (sent once every earlier request of this connection is done too)."""
        self.acks.done(token)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                correlation: bytes | None = None, content_type: str = "application/json",
                on_delivered: Callable[[], None] | None = None, user: tuple[tuple[str, str], ...] = ()):
        """Queue a publish; ``on_delivered()`` runs once the broker acknowledged it (QoS 1/2), or
        once it was written (QoS 0). Queued while disconnected, it goes out on reconnect. ``user``: MQTT 5
        user properties, ``(key, value)`` pairs."""
        props = PublishProperties.make(content_type, correlation, user)
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if qos == 0 and info.rc != mqtt.MQTT_ERR_SUCCESS:
            return info  # not sent (disconnected): paho calls back nothing for it, so nothing waits on its packet id
        with self._delivery_lock:
            if info.mid in self._early:
                self._early.discard(info.mid)
                early = True
            else:
                self._on_delivered[info.mid] = on_delivered
                early = False
        if early and on_delivered is not None:
            on_delivered()
        return info
