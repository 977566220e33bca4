"""The MQTT transport on its own against a real mosquitto: the read pause under backpressure, with
paho's public loop calls only."""

from __future__ import annotations

import threading
import time

import pytest

from mqtt_support import DIGITS, TOPIC, Client, write_config

pytestmark = pytest.mark.slow


class Holder:
    """A handler that keeps every request it is given until released: saturated at ``hold``."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.held: list = []
        self.received = 0
        self.most = 0  # the most requests it held at once
        self.cond = threading.Condition()

    def on_message(self, msg, token) -> None:
        with self.cond:
            self.held.append(token)
            self.received += 1
            self.most = max(self.most, len(self.held))
            self.cond.notify_all()

    def on_connected(self) -> None:
        pass

    def saturated(self) -> bool:
        with self.cond:
            return len(self.held) >= self.hold

    def wait_for(self, predicate, timeout: float = 30.0) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), f"timed out holding {len(self.held)}, {self.received} received"

    def release(self, transport) -> None:
        with self.cond:
            tokens, self.held = self.held, []
        for t in tokens:
            transport.done(t)
        transport.wake()


def _turns(transport, n: int, timeout: float = 30.0) -> None:
    """Wait until the network thread has gone round its loop ``n`` more times."""
    seen, last, end = 0, transport.heartbeat, time.monotonic() + timeout
    while seen < n:
        assert time.monotonic() < end, "the network thread stopped going round its loop"
        time.sleep(0.01)
        if transport.heartbeat != last:
            seen, last = seen + 1, transport.heartbeat


@pytest.fixture
def held(tmp_path, broker):
    """A transport subscribed to the request topic, a handler that holds 4, and a requester."""
    from k2edge.config.schema import load_config
    from k2edge.service.transport import MqttTransport

    cfg = load_config(write_config(tmp_path / "t.toml", broker.port, [DIGITS], service={"queue_size": 64}))
    holder = Holder(hold=4)
    transport = MqttTransport(cfg, "requests", [TOPIC])
    transport.start(holder)
    requester = Client(broker.port).connect()
    try:
        assert transport.subscribed.wait(30), "the transport's subscription was not acknowledged"
        yield holder, transport, requester
    finally:
        requester.close()
        transport.stop()


def test_reading_stops_at_the_bound_while_the_broker_holds_more(held):
    """Receive Maximum 64 lets the broker send 24 requests at once; a handler that holds 4 gets exactly 4
    until it lets them go, each time, although more wait in the socket."""
    holder, transport, requester = held
    n = 24
    for i in range(n):
        requester.publish(TOPIC, {"id": f"p{i}"})
    for _ in range(n // holder.hold - 1):
        holder.wait_for(lambda: len(holder.held) >= holder.hold)
        assert len(holder.held) == holder.hold, f"read {len(holder.held)} requests with room for {holder.hold}"
        # the rest of the burst has reached the socket and the network thread has looped past it, paused
        deadline = time.monotonic() + 30
        while not transport.input_pending():
            assert time.monotonic() < deadline, "the broker sent no more than the handler holds: nothing tested"
            time.sleep(0.01)
        _turns(transport, 3)
        assert len(holder.held) == holder.hold, f"read {len(holder.held)} requests with room for {holder.hold}"
        holder.release(transport)
    holder.wait_for(lambda: holder.received == n)
    assert holder.most == holder.hold, holder.most
    assert transport.pauses >= n // holder.hold - 1


def test_answers_awaiting_acknowledgement_widen_the_read_by_as_many_at_most(held):
    """8 answers published while reading is paused wait for the broker's acknowledgement: the next read
    may take up to that many requests (paho reads as many packets per call as messages in flight), never
    the whole backlog waiting in the socket."""
    holder, transport, requester = held
    n, answers = 40, 8
    for i in range(n):
        requester.publish(TOPIC, {"id": f"q{i}"})
    holder.wait_for(lambda: len(holder.held) >= holder.hold)
    delivered = threading.Semaphore(0)
    for i in range(answers):  # their acknowledgements queue up behind the requests the socket holds
        transport.publish("k2edge/t1/answers", b"{}", on_delivered=delivered.release)
    _turns(transport, 3)
    while True:
        holder.release(transport)
        holder.wait_for(lambda: len(holder.held) >= holder.hold or holder.received == n)
        if holder.received == n:
            break
    holder.release(transport)  # reading resumes: the broker's acknowledgements are read
    for _ in range(answers):
        assert delivered.acquire(timeout=30), "an answer was never acknowledged"
    assert holder.most <= holder.hold - 1 + answers, f"read {holder.most} requests at once with room for {holder.hold}"


def _dynsec_broker(tmp_path, user: str, password: str, may_subscribe: str):
    """mosquitto with its dynamic-security plugin: ``user`` may subscribe to ``may_subscribe`` and nothing else, and
    a subscription outside it is refused in the SUBACK (Not authorized) -- as EMQX or HiveMQ refuse one, where
    mosquitto's acl_file acknowledges it and then delivers nothing."""
    import base64
    import glob
    import hashlib
    import json
    import os

    from mqtt_support import Broker

    plugin = next(iter(glob.glob("/usr/lib/*/mosquitto_dynamic_security.so")), None)
    if plugin is None:
        pytest.skip("mosquitto's dynamic-security plugin is not installed")
    salt = os.urandom(12)
    state = {
        "clients": [{"username": user, "salt": base64.b64encode(salt).decode(), "iterations": 101,
                     "password": base64.b64encode(hashlib.pbkdf2_hmac("sha512", password.encode(), salt, 101, 64)).decode(),
                     "roles": [{"rolename": "device"}]}],
        "roles": [{"rolename": "device", "acls": [{"acltype": "subscribePattern", "topic": may_subscribe, "allow": True},
                                                  {"acltype": "publishClientSend", "topic": "#", "allow": True}]}],
        "defaultACLAccess": {"publishClientSend": False, "publishClientReceive": True, "subscribe": False,
                             "unsubscribe": True},
    }
    (tmp_path / "dynsec.json").write_text(json.dumps(state))
    broker = Broker(tmp_path / "dynsec", extra_conf=f"plugin {plugin}\nplugin_opt_config_file {tmp_path / 'dynsec.json'}\n")
    broker.conf.write_text(broker.conf.read_text().replace("allow_anonymous true", "allow_anonymous false"))
    return broker.start()


def test_a_subscription_the_broker_refuses_is_named_in_the_log(tmp_path, caplog):
    """The login may take its own requests but not the fleet pool's: the daemon says which subscription was refused
    and why, and serves the rest."""
    import logging

    from k2edge.config.schema import load_config
    from k2edge.service.transport import MqttTransport

    broker = _dynsec_broker(tmp_path, "t1", "device-secret", "k2edge/t1/#")
    (tmp_path / "t1.pw").write_text("device-secret\n")
    cfg = load_config(write_config(tmp_path / "t.toml", broker.port, [DIGITS],
                                   mqtt_extra={"username": "t1", "password_file": str(tmp_path / "t1.pw")}))
    transport = MqttTransport(cfg, "requests", [TOPIC, "$share/line-3/k2edge/pool/infer/+"])
    try:
        with caplog.at_level(logging.ERROR, logger="k2edge.service.transport"):
            transport.start(Holder(hold=4))
            assert transport.subscribed.wait(30), "the transport's subscriptions were not acknowledged"
        refused = [r.getMessage() for r in caplog.records if "refused the subscription" in r.getMessage()]
        assert refused == ["the broker refused the subscription to $share/line-3/k2edge/pool/infer/+ (Not authorized); "
                           "check the login's ACL"], refused
    finally:
        transport.stop()
        broker.stop()


@pytest.mark.skipif(not hasattr(__import__("socket"), "TCP_CORK"), reason="TCP_CORK is Linux's")
def test_uncorking_outside_the_interpreter_lock_sends_what_was_corked():
    """The answers written under TCP_CORK leave when the cork comes off, through libc's setsockopt
    (which lets the other threads run while the kernel sends): what was held arrives, and a closed
    socket is refused, so the transport falls back to ``socket.setsockopt``."""
    import socket

    from k2edge.service import transport

    assert transport._UNCORK is not None, "libc's setsockopt was not found"
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    with server, a, b:
        a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        a.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        a.sendall(b"x" * 100)  # less than a segment: held while corked (for at most 200 ms: not asserted)
        assert transport._UNCORK(a.fileno())
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 0
        b.settimeout(10)
        assert b.recv(100) == b"x" * 100
    assert not transport._UNCORK(a.fileno())  # closed: -1, EBADF


def test_stop_ends_a_wait_to_reconnect_at_once(tmp_path):
    """With no broker, the network thread waits between tries (here a minute): stop() ends that wait, so a
    daemon that gives up (a refusal at start) or drains with its broker down is not held by its backoff."""
    import logging

    from mqtt_support import free_port

    from k2edge.config.schema import load_config
    from k2edge.service.transport import MqttTransport, log

    class Waiting(logging.Handler):  # the line the thread logs just before it waits
        def __init__(self):
            super().__init__()
            self.seen = threading.Event()

        def emit(self, record):
            if "unreachable" in record.getMessage():
                self.seen.set()

    cfg = load_config(write_config(tmp_path / "t.toml", free_port(), [DIGITS]))
    cfg = cfg.model_copy(update={"mqtt": cfg.mqtt.model_copy(update={"reconnect_min_s": 60.0, "reconnect_max_s": 60.0})})
    waiting = Waiting()
    log.addHandler(waiting)
    try:
        transport = MqttTransport(cfg, "requests", [TOPIC])
        transport.start(Holder(hold=1))
        assert waiting.seen.wait(30), "the transport never tried the missing broker"
        ended = transport.stop()  # joins the thread for at most 10 s: a minute's wait would outlast it
    finally:
        log.removeHandler(waiting)
    assert ended, "stop() left the network thread in its wait to reconnect"
