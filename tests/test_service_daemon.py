"""The daemon against a real mosquitto: answers, persistence across restarts, malformed input,
backpressure, deadlines, draining, sd_notify, a fleet on a shared subscription, TLS and passwords.
(Exactly-once under faults: test_exactly_once_daemon.py; hostile input: test_hostile_input.py.)"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mqtt_support import DEMO, DIGITS, ROOT, SAMPLES, TOPIC, Broker, Client, DaemonProcess, image_request, tensor_request, \
    write_config

pytestmark = pytest.mark.slow

_image_request = image_request
_tensor_request = tensor_request


def _cli_infer(*inputs) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "k2edge", "infer", str(DEMO / "model.onnx"), "-p", "cpu-dev", "--json",
                          "--top-k", "3", *map(str, inputs)], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_answers_equal_k2edge_infer(run_daemon, broker, tmp_path):
    """JSON images, raw JPEG payloads and tensors are answered as `k2edge infer` answers them."""
    run_daemon()
    client = Client(broker.port).connect()
    tensor = np.random.default_rng(0).standard_normal((1, 32, 32)).astype(np.float32)
    np.save(tmp_path / "t.npy", tensor)
    want = _cli_infer(*SAMPLES[:4], tmp_path / "t.npy")
    corr = [client.publish(TOPIC, _image_request(p)) for p in SAMPLES[:2]]
    corr += [client.publish(TOPIC, p.read_bytes(), content_type="image/jpeg", user_properties={"id": f"raw{i}", "top_k": "3"})
             for i, p in enumerate(SAMPLES[2:4])]
    corr.append(client.publish(TOPIC, _tensor_request(tensor)))
    client.wait_answers(5)
    by_corr = {c: a for a, c in client.answers}
    for c, w in zip(corr, want):
        got = by_corr[c]
        assert got["status"] == "ok" and got["source"] == "edge" and got["model"] == "digits", got
        assert [t["index"] for t in got["top_k"]] == [t["index"] for t in w["top_k"]]
        for a, b in zip(got["top_k"], w["top_k"]):
            assert a["score"] == pytest.approx(b["score"], rel=1e-4, abs=1e-6)
        assert set(got["latency_ms"]) >= {"queue", "stage", "infer", "total"}
    client.close()


def test_fallback_result_topic_without_response_topic(run_daemon, broker):
    run_daemon()
    client = Client(broker.port).connect()
    client.publish(TOPIC, _image_request(SAMPLES[5], rid="plain-1"), reply=False)
    client.wait_for(lambda c: any(t == "k2edge/t1/result/plain-1" for t, _ in c.other))
    body = next(b for t, b in client.other if t == "k2edge/t1/result/plain-1")
    assert body["status"] == "ok" and body["top_k"][0]["label"] == "5"
    client.close()


def test_sigusr1_writes_every_threads_stack_to_the_log_and_serving_goes_on(run_daemon, broker):
    """kill -USR1: where each of the daemon's threads is, in its log (the journal under systemd), for a daemon that
    does not answer or does not stop; it keeps serving, and SIGTERM still drains it."""
    import signal

    d = run_daemon()
    d.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while "k2edge/service/daemon.py" not in d.output():
        assert time.monotonic() < deadline, d.output()[-3000:]
        time.sleep(0.05)
    assert d.output().count("(most recent call first)") >= 3  # the main thread, the transport's, a batcher's, ...
    client = Client(broker.port).connect()
    corr = client.publish(TOPIC, _image_request(SAMPLES[0]))
    client.wait_answers(1)
    assert client.answers[0][1] == corr and client.answers[0][0]["status"] == "ok"
    client.close()
    assert d.terminate() == 0


def test_requests_sent_while_down_are_answered_after_start(run_daemon, broker):
    """The persistent session keeps requests at the broker while the daemon is stopped."""
    d = run_daemon()
    assert d.terminate() == 0
    client = Client(broker.port).connect()
    corr = [client.publish(TOPIC, _image_request(p, rid=f"queued-{i}")) for i, p in enumerate(SAMPLES[:5])]
    run_daemon(wait=False)
    answers = client.wait_answers(5, timeout=120)
    assert sorted(a["id"] for a in answers) == [f"queued-{i}" for i in range(5)]
    assert {c for _, c in client.answers} == set(corr)
    client.settle(TOPIC)
    assert len(client.answers) == 5, "answered twice"
    client.close()


MALFORMED = [
    (b"not json at all", {}, "bad_request", "not valid JSON"),
    (b"[1, 2, 3]", {}, "bad_request", "expected a JSON object, got an array"),
    (json.dumps({"id": "x1", "image": 42}).encode(), {}, "bad_request", "image: expected a base64 string"),
    (json.dumps({"id": "x2", "image": "%%%not-base64%%%"}).encode(), {}, "bad_request", "image: invalid base64"),
    (json.dumps({"id": "x3", "image": base64.b64encode(b"GIF89a garbage").decode()}).encode(), {}, "bad_request", "cannot decode image"),
    (json.dumps({"id": "x4", "tensor": {"dtype": "float32", "shape": [3, 28, 28],
                                         "data": base64.b64encode(np.zeros((3, 28, 28), np.float32).tobytes()).decode()}}).encode(),
     {}, "bad_request", "tensor shape [3, 28, 28]"),
    (json.dumps({"id": "x5", "tensor": {"dtype": "float64", "shape": [1, 32, 32],
                                         "data": base64.b64encode(np.zeros((1, 32, 32)).tobytes()).decode()}}).encode(),
     {}, "bad_request", "tensor dtype float64"),
    (json.dumps({"id": "x6", "tensor": {"dtype": "float32", "shape": [1, 32, 32], "data": "AAAA"}}).encode(), {}, "bad_request", "needs 4096"),
    (json.dumps({"id": "x7", "image": "AAAA", "top_k": "five"}).encode(), {}, "bad_request", "top_k: expected an integer"),
    (json.dumps({"id": "bad/+#", "image": "AAAA"}).encode(), {}, "bad_request", "cannot be a topic level"),
    (json.dumps({"id": "x8", "image": "AAAA", "colour": "red"}).encode(), {}, "bad_request", "unknown field 'colour'"),
    (json.dumps({"id": "x9"}).encode(), {}, "bad_request", "exactly one of 'image'"),
    (json.dumps({"id": "x10", "image": "AAAA", "deadline_ms": -5}).encode(), {}, "bad_request", "deadline_ms: expected a number >= 1"),
    (b"\xff\xd8 not a real jpeg", {"content_type": "image/jpeg"}, "bad_request", "cannot decode image"),
    (SAMPLES[3].read_bytes()[:200], {"content_type": "image/jpeg"}, "bad_request", "cannot decode image"),  # truncated
    (b"<xml/>", {"content_type": "application/xml"}, "bad_request", "content type 'application/xml'"),
    (json.dumps({"id": "x11", "tensor": {"dtype": "float32", "shape": [1, 32, 32],
                                          "data": base64.b64encode(np.full((1, 32, 32), np.nan, np.float32).tobytes()).decode()}}).encode(),
     {}, "bad_request", "NaN or infinite"),
    (b"[" * 30000 + b"]" * 30000, {}, "bad_request", "expected a JSON object"),
]


def test_malformed_requests_get_precise_errors_and_the_daemon_keeps_serving(run_daemon, broker):
    run_daemon(service={"max_payload_bytes": 65536})
    client = Client(broker.port).connect()
    corr = {}
    for i, (payload, opts, code, fragment) in enumerate(MALFORMED):
        corr[client.publish(TOPIC, payload, **opts)] = (code, fragment)
    corr[client.publish(TOPIC, b"{" + b" " * 70000 + b"}")] = ("payload_too_large", "exceeds the limit of 65536")
    corr[client.publish("k2edge/t1/infer/nosuchmodel", _image_request(SAMPLES[0], rid="m1"))] = ("unknown_model", "no model 'nosuchmodel'")
    good = client.publish(TOPIC, _image_request(SAMPLES[8], rid="still-alive"))
    client.wait_answers(len(corr) + 1)
    answers = {c: a for a, c in client.answers}
    for c, (code, fragment) in corr.items():
        a = answers[c]
        assert a["status"] == "error" and a["error"]["code"] == code, (fragment, a)
        assert fragment in a["error"]["message"], (fragment, a)
        assert " object at 0x" not in a["error"]["message"], a  # no Python object's repr reaches a requester
    assert answers[good]["status"] == "ok" and answers[good]["top_k"][0]["label"] == "8"
    unknown = next(a for c, a in answers.items() if corr.get(c, ("",))[0] == "unknown_model")
    assert unknown["id"] == "m1"
    client.close()


def test_a_failing_turn_of_the_serving_loop_is_logged_and_serving_goes_on(run_daemon, broker, tmp_path):
    """A bug in one turn of the serving loop (here: building the telemetry fails, injected into the real daemon
    process through sitecustomize) is logged once with its traceback; requests are still answered and the
    telemetry comes back once it builds again. Before, the exception ended the serving loop and the process."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "from k2edge.service import daemon\n"
        "_real, _calls = daemon.Daemon.telemetry_payload, [0]\n"
        "def telemetry_payload(self):\n"
        "    _calls[0] += 1\n"
        "    if _calls[0] <= 3:\n"
        "        raise RuntimeError('injected telemetry failure')\n"
        "    return _real(self)\n"
        "daemon.Daemon.telemetry_payload = telemetry_payload\n")
    d = run_daemon(env={"PYTHONPATH": f"{inject}{os.pathsep}{ROOT}"})
    client = Client(broker.port).connect()
    client.subscribe("k2edge/t1/telemetry")
    client.publish(TOPIC, _image_request(SAMPLES[3], rid="after-the-failure"))
    client.wait_answers(1)
    assert client.answers[0][0]["status"] == "ok"
    client.wait_for(lambda c: any(t.endswith("/telemetry") for t, _ in c.other), 60)
    client.close()
    assert d.proc.poll() is None
    log = d.output()
    assert log.count("serving loop: RuntimeError: injected telemetry failure (serving goes on)") == 1, log
    assert "Traceback" in log


def test_a_burst_beyond_the_queue_waits_at_the_broker_instead_of_busy(run_daemon, broker, slow_model):
    """queue_size 2, 30 requests at once: the daemon stops reading, the broker holds the rest, all are answered ok."""
    run_daemon(models=[slow_model.model()], service={"queue_size": 2, "max_batch": 1})
    client = Client(broker.port).connect()
    x = np.zeros(slow_model.input_shape, np.float32)
    n = 30  # published in far less than one request's run (>= 100 ms), so more than queue_size wait at once
    for i in range(n):
        client.publish("k2edge/t1/infer/slow", _tensor_request(x, rid=f"b{i}"))
    answers = client.wait_answers(n, timeout=60 + n * slow_model.seconds * 4)
    assert Counter(a["status"] for a in answers) == {"ok": n}, [a for a in answers if a["status"] != "ok"][:2]
    assert Counter(a["id"] for a in answers) == Counter(f"b{i}" for i in range(n))
    client.subscribe("k2edge/t1/telemetry", qos=0)
    client.wait_for(lambda c: any(t == "k2edge/t1/telemetry" for t, _ in c.other), 15)
    telemetry = next(b for t, b in client.other if t == "k2edge/t1/telemetry")
    assert telemetry["read_pauses"] >= 1  # backpressure really happened
    client.close()


def test_deadlines_are_never_answered_late(run_daemon, broker, slow_model):
    """Deadlines a third of one request's measured run: the first may make it, every one queued behind it cannot."""
    run_daemon(models=[slow_model.model()], service={"max_batch": 1})
    client = Client(broker.port).connect()
    x = np.zeros(slow_model.input_shape, np.float32)
    deadline_ms = max(1, int(slow_model.seconds * 1000 / 3))
    for i in range(6):
        body = _tensor_request(x, rid=f"d{i}")
        body["deadline_ms"] = deadline_ms
        client.publish("k2edge/t1/infer/slow", body)
    generous = _tensor_request(x, rid="patient")
    generous["deadline_ms"] = 60000
    client.publish("k2edge/t1/infer/slow", generous)
    answers = {a["id"]: a for a in client.wait_answers(7, timeout=120)}
    late = [a for rid, a in answers.items() if rid.startswith("d")]
    assert all(a["status"] == "error" and a["error"]["code"] == "deadline_exceeded" for a in late[1:]), late
    for a in late:
        if a["status"] == "ok":  # only possible when answered within its deadline
            assert a["latency_ms"]["total"] <= deadline_ms
    assert answers["patient"]["status"] == "ok"
    client.close()


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 0), (signal.SIGHUP, 75)])
def test_sigterm_drains_in_flight_work_then_goes_offline(run_daemon, broker, slow_model, sig, status):
    """SIGTERM with about two seconds of measured work left: all of it is answered, then the status says offline.
    SIGHUP (systemctl reload) drains the same way and exits 75, which the unit restarts; it used to kill the
    daemon on the spot, its backlog unanswered and systemd, seeing a clean signal death, not restarting it."""
    d = run_daemon(models=[slow_model.model()], service={"max_batch": 1})
    client = Client(broker.port).connect()
    x = np.zeros(slow_model.input_shape, np.float32)
    n = slow_model.requests_for(2.0) + 1
    for i in range(n):
        client.publish("k2edge/t1/infer/slow", _tensor_request(x, rid=f"s{i}"))
    client.wait_answers(1, timeout=60)  # the daemon is working through them
    signalled = time.monotonic()
    assert d.terminate(timeout=60 + n * slow_model.seconds * 4, sig=sig) == status
    if sig == signal.SIGHUP:
        assert "SIGHUP: k2edge has no reload in place: draining, then exiting with status 75" in d.output()
    answers = client.wait_answers(n, timeout=30)
    assert sorted(a["id"] for a in answers) == sorted(f"s{i}" for i in range(n))
    assert all(a["status"] == "ok" for a in answers)
    after = sum(arrived > signalled for _, arrived in client.raw)
    assert after >= 1, "every answer came before SIGTERM: the drain was not exercised"
    client.wait_state("offline", timeout=30)  # acknowledged by the broker before the exit, received here a moment later
    states = [s["state"] for s in client.statuses if s.get("device") == "t1"]
    assert states[-2:] == ["draining", "offline"], states
    client.close()
    # the retained status says offline to anyone who looks later
    late = Client(broker.port).connect()
    late.wait_state("offline")
    late.close()


def test_sd_notify_ready_watchdog_stopping(run_daemon, broker, tmp_path):
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(0.5)
    messages: list[str] = []

    def listen():
        while not stop.is_set():
            try:
                messages.append(sock.recv(4096).decode())
            except socket.timeout:
                continue

    stop = threading.Event()
    t = threading.Thread(target=listen, daemon=True)
    t.start()
    d = run_daemon(env={"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "1000000"})
    deadline = time.monotonic() + 60  # the pings come every half second; wait for three, however long they take
    while sum(m.count("WATCHDOG=1") for m in list(messages)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.terminate() == 0
    deadline = time.monotonic() + 10  # STOPPING=1 was sent before the process exited; let the reader take it
    while not any("STOPPING=1" in m for m in list(messages)) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    t.join()
    sock.close()
    flat = [line for m in messages for line in m.splitlines()]
    assert "READY=1" in flat
    assert any(line.startswith("STATUS=serving") for line in flat)
    assert flat.count("WATCHDOG=1") >= 3
    assert "STOPPING=1" in flat
    assert flat.index("READY=1") < flat.index("WATCHDOG=1") < flat.index("STOPPING=1")


def test_two_daemons_share_the_pool_each_request_answered_once(run_daemon, broker):
    run_daemon(device="fa", fleet="line3")
    run_daemon(device="fb", fleet="line3")
    client = Client(broker.port).connect()
    n = 40
    for i in range(n):
        client.publish("k2edge/pool/infer/digits", _image_request(SAMPLES[i % 10], rid=f"p{i}"))
    client.wait_answers(n, timeout=60)
    client.settle("k2edge/fa/infer/digits", "k2edge/fb/infer/digits")
    ids = Counter(a["id"] for a, _ in client.answers)
    assert ids == Counter(f"p{i}" for i in range(n))
    devices = Counter(a["device"] for a, _ in client.answers)
    assert set(devices) == {"fa", "fb"} and min(devices.values()) >= n // 4, devices
    client.close()


def test_password_from_file_never_reaches_logs_or_status(tmp_path, run_daemon):
    """Username/password auth against a broker that requires it; the secret appears nowhere. `k2edge request` logs in
    too, and reaches a daemon whose topics start elsewhere (it had no --username, --password-file nor
    --topic-prefix: refused, or published where no daemon listens)."""
    secret = "s3cr3t-" + uuid.uuid4().hex
    pw = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(pw), "k2edge", secret], check=True, capture_output=True)
    pw.chmod(0o600)
    secured = Broker(tmp_path / "secured", extra_conf="")
    secured.conf.write_text(secured.conf.read_text().replace("allow_anonymous true", f"allow_anonymous false\npassword_file {pw}"))
    secured.start()
    try:
        (tmp_path / "mqtt-password").write_text(secret + "\n")
        cfg = write_config(tmp_path / "auth.toml", secured.port, [DIGITS], device="auth",
                           mqtt_extra={"username": "k2edge", "password_file": str(tmp_path / "mqtt-password"),
                                       "topic_prefix": "site-3/auth"})
        d = DaemonProcess(cfg, tmp_path / "auth.log", verbose=True).start()
        import paho.mqtt.client as mqtt

        seen = []
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        c.username_pw_set("k2edge", secret)
        c.on_message = lambda cl, u, m: seen.append(m.payload)
        c.connect("127.0.0.1", secured.port)
        c.subscribe("site-3/auth/status", qos=1)
        c.loop_start()
        deadline = time.monotonic() + 120
        while not any(b'"online"' in p for p in seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(b'"online"' in p for p in seen), d.output()
        sample = ROOT / "models/digits/samples/digit-3-21.jpg"
        ask = [sys.executable, "-m", "k2edge", "request", "--broker", f"127.0.0.1:{secured.port}", "--model", "digits",
               "--topic-prefix", "site-3/auth", "--username", "k2edge", "--timeout", "60", str(sample)]
        asked = subprocess.run([*ask, "--password-file", str(tmp_path / "mqtt-password")], capture_output=True, text=True,
                               timeout=120, cwd=ROOT)
        assert asked.returncode == 0 and f"{sample}: 3 1.000" in asked.stdout, asked.stdout + asked.stderr
        refused = subprocess.run(ask, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr and secret not in refused.stderr, refused.stderr
        assert d.terminate() == 0
        c.loop_stop()
        assert secret not in d.output()
        assert all(secret.encode() not in p for p in seen)
    finally:
        secured.stop()


def test_a_corrected_resend_needs_a_new_attempt_and_a_bad_response_topic_is_reported(run_daemon, broker):
    """The same (id, attempt) again is taken for a redelivery; attempt + 1 is a new request."""
    run_daemon()
    client = Client(broker.port).connect()
    client.publish(TOPIC, {"id": "retry-1", "image": "%%%"})
    client.wait_answers(1)
    client.publish(TOPIC, _image_request(SAMPLES[1], rid="retry-1"))  # same key: acknowledged, not answered
    client.publish(TOPIC, _image_request(SAMPLES[1], rid="retry-1", attempt=1))
    answers = client.wait_answers(2)
    assert [(a["status"], a["attempt"]) for a in answers] == [("error", 0), ("ok", 1)]
    assert answers[1]["top_k"][0]["label"] == "1"
    props_topic = "bad/+/reply"
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = props_topic
    client.c.publish(TOPIC, json.dumps(_image_request(SAMPLES[2], rid="wild")).encode(), qos=1, properties=props)
    # the contract's fallback: {prefix}/result/{id}
    client.wait_for(lambda c: any(t == "k2edge/t1/result/wild" for t, b in c.other))
    err = next(b for t, b in client.other if t == "k2edge/t1/result/wild")
    assert err["error"]["code"] == "bad_request" and "Response Topic" in err["error"]["message"]
    assert len(client.answers) == 2, "the resend with the same key was answered"
    client.close()


def test_systemd_unit_verifies_and_the_installer_dry_runs(tmp_path):
    unit = (ROOT / "systemd" / "k2edge.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "User=k2edge", "StateDirectory=k2edge",
                 "CacheDirectory=k2edge", "LoadCredential=", "ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes"):
        assert line in unit, line
    import shutil

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    exe = Path(sys.executable).with_name("k2edge")
    local = tmp_path / "k2edge.service"
    local.write_text(unit.replace("/opt/k2edge/venv/bin/k2edge", str(exe)))
    proc = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    dry = subprocess.run(["bash", str(ROOT / "tools" / "install-systemd.sh"), "--dry-run", "--prefix", str(tmp_path / "opt")],
                         capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "useradd --system" in dry.stdout or "id k2edge" in dry.stdout or "k2edge.service" in dry.stdout


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def test_tls_with_client_certificate(tmp_path, run_daemon):
    """The daemon connects over TLS with a client certificate to a broker that requires one."""
    pki = tmp_path / "pki"
    pki.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=k2edge-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=pki)
    for name, cn in (("server", "localhost"), ("client", "k2edge-daemon")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=pki)
        ext = pki / f"{name}.ext"
        ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n" if name == "server" else "extendedKeyUsage=clientAuth\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
                 "-extfile", ext.name, "-out", f"{name}.crt", cwd=pki)
    tls = Broker(tmp_path / "tls")
    tls.conf.write_text(tls.conf.read_text() + f"cafile {pki / 'ca.crt'}\ncertfile {pki / 'server.crt'}\n"
                        f"keyfile {pki / 'server.key'}\nrequire_certificate true\n")
    tls.start()
    try:
        cfg = write_config(tmp_path / "tls.toml", tls.port, [DIGITS], device="tls",
                           mqtt_extra={"tls_ca_file": pki / "ca.crt", "tls_cert_file": pki / "client.crt",
                                       "tls_key_file": pki / "client.key"})
        d = DaemonProcess(cfg, tmp_path / "tls.log").start()
        deadline = time.monotonic() + 120
        while "serving digits" not in d.output() and time.monotonic() < deadline and d.proc.poll() is None:
            time.sleep(0.2)
        assert "serving digits" in d.output(), d.output()
        assert d.terminate() == 0
        # and a client without a certificate is refused by that broker, so TLS really was in use
        import ssl

        import paho.mqtt.client as mqtt

        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        c.tls_set(ca_certs=str(pki / "ca.crt"), cert_reqs=ssl.CERT_REQUIRED)
        connected = []
        c.on_connect = lambda *a: connected.append(a[3])
        refused = False
        try:
            c.connect("127.0.0.1", tls.port)
            for _ in range(20):
                if c.loop(0.1) != mqtt.MQTT_ERR_SUCCESS:
                    refused = True
                    break
        except (ssl.SSLError, OSError):
            refused = True
        assert refused and not connected
        # a TLS file that is not there is one line naming its key and path (it was "[Errno 2] No such file or
        # directory", neither key nor path)
        missing = write_config(tmp_path / "missing.toml", tls.port, [DIGITS], device="tls",
                               mqtt_extra={"tls_ca_file": pki / "ca.pem"})
        proc = subprocess.run([sys.executable, "-m", "k2edge", "serve", "--config", str(missing)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert last == f"k2edge serve: error: {missing}: mqtt.tls_ca_file: '{pki / 'ca.pem'}' does not exist", last
    finally:
        tls.stop()
