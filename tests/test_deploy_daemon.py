"""Over-the-air model lifecycle against a real mosquitto: verified loading, deploy under load, hot
swap, refusals, rollback, group deploys, HTTPS URLs, restarts, audit and /metrics."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bundles import flip_byte, rebuild, replace_data, small_model_dir
from k2edge.bundle import create_bundle, generate_keys
from mqtt_support import ROOT, SAMPLES, Broker, Client, DaemonProcess, free_port, image_request, write_config

pytestmark = pytest.mark.slow
LIMIT = 64 << 20


@pytest.fixture
def broker(tmp_path):
    """mosquitto carrying messages as large as the daemons' max_bundle_bytes (overrides conftest's)."""
    b = Broker(tmp_path / "broker", extra_conf=f"message_size_limit {LIMIT + 65536}\n").start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    base = tmp_path_factory.mktemp("keys")
    ops, rogue = generate_keys(base / "ops"), generate_keys(base / "rogue")
    return {"key": ops[0], "pub": ops[1], "rogue_key": rogue[0], "rogue_pub": rogue[1]}


@pytest.fixture(scope="module")
def releases(keys, tmp_path_factory) -> dict[str, Path]:
    """digits 1.0.0 (cpu-dev, labels 0..9), 1.1.0 (c2, INT8 on three lanes, labels d0..d9), 1.2.0 tampered
    (a flipped byte in model.onnx after signing), 1.3.0 signed by a key nobody trusts."""
    base = tmp_path_factory.mktemp("releases")
    plain = small_model_dir(base / "plain" / "digits")
    renamed = small_model_dir(base / "renamed" / "digits", labels="".join(f"d{i}\n" for i in range(10)))
    out = {v: base / f"digits-{v}.k2b" for v in ("1.0.0", "1.1.0", "1.2.0", "1.3.0")}
    create_bundle(plain, out["1.0.0"], version="1.0.0", profiles=["cpu-dev"], key=keys["key"])
    create_bundle(renamed, out["1.1.0"], version="1.1.0", profiles=["c2"], key=keys["key"])
    create_bundle(plain, base / "good-1.2.0.k2b", version="1.2.0", profiles=["cpu-dev"], key=keys["key"])
    rebuild(base / "good-1.2.0.k2b", out["1.2.0"], lambda m: replace_data(m, "model.onnx", flip_byte))
    create_bundle(plain, out["1.3.0"], version="1.3.0", profiles=["cpu-dev"], key=keys["rogue_key"])
    return out


def _config(tmp_path, broker, keys, first: Path | None, device="t1", metrics_port=None, fleet=None, cache=None,
            extra_tables=None, model=None, trust=None):
    tables = {"trust": trust or {"keys": [str(keys["pub"])]}}
    if metrics_port is not None:
        tables["metrics"] = {"port": metrics_port}
    tables.update(extra_tables or {})
    service = {"max_batch": 4}
    if cache is not None:
        service["cache_dir"] = str(cache)
    entry = model or {"name": "digits", "bundle": first, "top_k": 1}
    return write_config(tmp_path / f"{device}.toml", broker.port, [entry], device=device, service=service, fleet=fleet,
                        tables=tables)


_STARTED: list[DaemonProcess] = []


@pytest.fixture(autouse=True)
def _no_daemon_outlives_its_test():
    """Whatever a test asserted, the daemons it started are gone when it ends."""
    yield
    while _STARTED:
        _STARTED.pop().kill()


def _daemon(cfg: Path, tmp_path, broker, device="t1") -> DaemonProcess:
    """``k2edge serve`` with ``cfg``, once its status says online."""
    since = time.time()
    d = DaemonProcess(cfg, tmp_path / f"{device}.log").start()
    _STARTED.append(d)
    watcher = Client(broker.port).connect()
    try:
        watcher.wait_for(lambda c: any(s.get("state") == "online" and s.get("device") == device and s.get("time", 0) >= since
                                       for s in c.statuses), 180)
    except TimeoutError:
        raise AssertionError(d.output()) from None
    finally:
        watcher.close()
    return d


def _k2edge(*args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "k2edge", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def _status(port: int, device="t1") -> dict:
    c = Client(port).connect()
    try:
        c.wait_for(lambda c: any(s.get("device") == device for s in c.statuses), 10)
        return [s for s in c.statuses if s.get("device") == device][-1]
    finally:
        c.close()


def _ask(client: Client, rid: str, timeout=30) -> dict:
    corr = client.publish("k2edge/t1/infer/digits", image_request(SAMPLES[0], rid=rid))
    client.wait_for(lambda c: any(k == corr for _, k in c.answers), timeout)
    return next(a for a, k in client.answers if k == corr)


def _audit_watcher(port: int, device="t1") -> Client:
    c = Client(port).connect()
    c.subscribe(f"k2edge/{device}/audit", qos=1)
    return c


def _audits(c: Client) -> list[dict]:
    return [body for topic, body in c.other if topic.endswith("/audit")]


def _scrape(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_deploy_under_load_swaps_once_and_a_restart_serves_it_from_the_cache(tmp_path, broker, keys, releases):
    """A steady stream of requests while 1.1.0 is deployed over 1.0.0 (its INT8 engines built from a cold cache):
    0 lost, 0 answered twice, model_version switches once and never goes back, the answers show the new profile
    and labels; requests keep being answered while the engines build; /metrics counts what was answered; after a
    restart 1.1.0 serves from the cache without a rebuild."""
    metrics_port = free_port()
    cfg = _config(tmp_path, broker, keys, releases["1.0.0"], metrics_port=metrics_port, cache=tmp_path / "cache")
    daemon = _daemon(cfg, tmp_path, broker)
    audit = _audit_watcher(broker.port)
    client = Client(broker.port).connect()
    stop, sent, sent_at = threading.Event(), [], []

    def stream():
        i = 0
        while not stop.is_set():
            rid = f"s{i}"
            client.publish("k2edge/t1/infer/digits", image_request(SAMPLES[i % len(SAMPLES)], rid=rid))
            sent.append(rid)
            sent_at.append(time.monotonic())
            i += 1
            time.sleep(0.02)

    sender = threading.Thread(target=stream)
    sender.start()
    try:
        client.wait_answers(10, timeout=60)
        proc = _k2edge("deploy", "--broker", f"127.0.0.1:{broker.port}", "--device", "t1", str(releases["1.1.0"]),
                       "--timeout", "240")
        client.wait_for(lambda c: sum(a.get("model_version") == "1.1.0" for a, _ in c.answers) >= 12, 60)
    finally:
        stop.set()
        sender.join()
    assert proc.returncode == 0, proc.stdout + proc.stderr + daemon.output()
    assert proc.stdout.strip() == "t1: deployed digits 1.1.0 (was 1.0.0)"
    client.wait_answers(len(sent), timeout=60)
    client.settle("k2edge/t1/infer/digits")
    answers = [a for a, _ in client.answers]
    assert Counter(a["id"] for a in answers) == Counter(sent)  # none lost, none twice
    assert all(a["status"] == "ok" for a in answers), [a for a in answers if a["status"] != "ok"][:3]
    versions = [a["model_version"] for a in answers]
    switch = versions.index("1.1.0")
    assert set(versions[:switch]) == {"1.0.0"} and set(versions[switch:]) == {"1.1.0"}  # once, never back
    assert 0 < switch < len(versions) - 10
    before, after = answers[switch - 1], answers[switch]
    assert (before["profile"], after["profile"]) == ("cpu-dev", "c2")
    assert before["top_k"][0]["label"] in "0123456789" and after["top_k"][0]["label"].startswith("d")
    # requests kept being answered while the engines were built: between the status saying "building" and the
    # one saying "swapping", answers arrived for at least half as many requests as were sent meanwhile
    deploy_states = [((s.get("deploy") or {}).get("state"), t) for s, t in zip(client.statuses, client.status_times)
                     if (s.get("deploy") or {}).get("version") == "1.1.0"]
    building = next(t for state, t in deploy_states if state == "building")
    swapping = next(t for state, t in deploy_states if state == "swapping")
    sent_during = sum(building <= t <= swapping for t in sent_at)
    during = sum(building <= t <= swapping for _, t in client.raw)
    assert sent_during >= 2, f"the build took {swapping - building:.3f} s: too short to show anything"
    assert during >= sent_during // 2, \
        f"{during} answers for {sent_during} requests while the engines were built: requests were held back"

    samples = _scrape(metrics_port)
    ok = sum(1 for a in answers) + 1  # and the settle marker
    assert samples[("k2edge_requests_total", (("model", "digits"), ("source", "edge"), ("status", "ok")))] == ok
    assert samples[("k2edge_model_info", (("model", "digits"), ("profile", "c2"), ("version", "1.1.0")))] == 1
    int8_series = {k: v for k, v in samples.items() if k[0] == "k2edge_int8_check"}
    assert set(int8_series) == {("k2edge_int8_check", (("measure", m), ("model", "digits"), ("profile", "c2")))
                                for m in ("agreement", "verdict", "judged")}
    assert samples[("k2edge_batch_size_count", (("model", "digits"),))] >= 1

    progress = [(s.get("deploy") or {}).get("state") for s in client.statuses if (s.get("deploy") or {}).get("version") == "1.1.0"]
    assert "building" in progress and "swapping" in progress, progress  # the build's progress, in the retained status
    status = _status(broker.port)
    model = status["models"][0]
    assert model["model_version"] == "1.1.0" and model["profile"] == "c2" and status["deploy"]["state"] == "idle"
    # its INT8 engines were checked against FP32 at build: in the status and as a gauge
    # 40 held-out samples: fewer than a verdict needs, so inconclusive (and served: [trust] does not require it)
    assert model["int8_check"]["status"] == "inconclusive" and model["int8_check"]["task"] == "classification"
    assert model["precision_flops"]["int8"] > 0.9 and set(model["precision_flops"]) == {"int8", "fp16", "fp32"}, model
    agreement = next(v for k, v in int8_series.items() if ("measure", "agreement") in k[1])
    assert agreement == pytest.approx(model["int8_check"]["measures"]["agreement"], abs=1e-4)
    assert next(v for k, v in int8_series.items() if ("measure", "verdict") in k[1]) == 0.0
    assert status["trust"] == {"keys": 1, "allow_unsigned": False}
    records = _audits(audit)
    assert [(r["action"], r["status"], r["version"]) for r in records] == [("install", "installed", "1.1.0"),
                                                                            ("activate", "activated", "1.1.0")]
    log = [json.loads(line) for line in (tmp_path / "state-t1" / "audit.log").read_text().splitlines()]
    assert [(r["action"], r["status"], r["version"]) for r in log] == [
        ("install", "installed", "1.0.0"), ("activate", "activated", "1.0.0"),
        ("install", "installed", "1.1.0"), ("activate", "activated", "1.1.0")]
    pointer = json.loads((tmp_path / "state-t1" / "models" / "digits" / "state.json").read_text())
    assert pointer == {"current": "1.1.0", "previous": "1.0.0"}

    assert daemon.terminate() == 0
    restarted = _daemon(cfg, tmp_path, broker)
    model = _status(broker.port)["models"][0]
    # one engine for every batch size up to max_batch 4, from the cache
    assert model["model_version"] == "1.1.0" and model["cache"]["cached"] == model["cache"]["engines"] == 1, model
    assert model["batch_sizes"] == [1, 2, 3, 4] and set(model["memory"]) == {"host"}, model
    answer = _ask(client, "after-restart")
    assert answer["model_version"] == "1.1.0" and answer["profile"] == "c2"
    load = json.loads((tmp_path / "state-t1" / "audit.log").read_text().splitlines()[-1])
    assert (load["action"], load["status"], load["version"]) == ("load", "loaded", "1.1.0")
    assert restarted.terminate() == 0
    client.close()
    audit.close()


def test_a_thermal_switch_while_requests_flow_keeps_the_version_and_loses_nothing(tmp_path, broker, keys, releases):
    """Requests stream while the die warms past soft_c: the model switches to its warm profile (c2, three lanes)
    between two batches; every request is answered once, model_version stays 1.0.0, the profile switches once
    and never back, and the line runs the new engines' way (several batches in flight, not one inline)."""
    zone = tmp_path / "sysfs" / "sys/class/thermal/thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("tj-thermal\n")
    (zone / "temp").write_text("40000\n")
    model = {"name": "digits", "bundle": releases["1.0.0"], "top_k": 1, "escalation": {"warm_profile": "c2"}}
    cfg = _config(tmp_path, broker, keys, None, model=model, extra_tables={
        "thermal": {"source": "sysfs", "sysfs_root": str(tmp_path / "sysfs"), "sample_interval_ms": 50}})
    _daemon(cfg, tmp_path, broker)
    before = _status(broker.port)["models"][0]
    # cpu-dev: a single-threaded worker per core (threads_per_lane 0); digits answers a lone request in well under
    # 5 ms, so its batches run inline (one slot) unless the machine was too busy at activation to measure it so
    cores = len(os.sched_getaffinity(0))
    assert before["profile"] == "cpu-dev" and before["slots"] in (1, cores + 1), before
    client = Client(broker.port).connect()
    stop, sent = threading.Event(), []

    def stream():  # at most 16 in flight, as fast as they are answered
        i = 0
        while not stop.is_set():
            if len(sent) - len(client.answers) >= 16:
                client.wait_for(lambda c: len(sent) - len(c.answers) < 16 or stop.is_set(), timeout=30)
                continue
            rid = f"t{i}"
            sent.append(rid)
            client.publish("k2edge/t1/infer/digits", image_request(SAMPLES[i % len(SAMPLES)], rid=rid))
            i += 1

    sender = threading.Thread(target=stream)
    sender.start()
    try:
        client.wait_for(lambda c: len(c.answers) >= 40, timeout=60)
        (zone / "temp").write_text("80000\n")  # above soft_c 75: warm
        client.wait_for(lambda c: sum(a.get("profile") == "c2" for a, _ in c.answers) >= 40, timeout=60)
    finally:
        stop.set()
        sender.join()
    client.wait_answers(len(sent), timeout=60)
    answers = [a for a, _ in client.answers]
    assert Counter(a["id"] for a in answers) == Counter(sent)  # none lost, none twice
    assert all(a["status"] == "ok" for a in answers), [a for a in answers if a["status"] != "ok"][:3]
    assert {a["model_version"] for a in answers} == {"1.0.0"}
    profiles = [a["profile"] for a in answers]
    switch = profiles.index("c2")
    assert set(profiles[:switch]) == {"cpu-dev"} and set(profiles[switch:]) == {"c2"}  # once, never back
    assert all(a["thermal_state"] == "warm" for a in answers[switch:])
    # the retained status follows the line: its warm engines, three lanes, four batches in flight
    watcher = Client(broker.port).connect()
    watcher.wait_for(lambda c: any(s.get("thermal") == "warm" and s["models"][0]["slots"] == 4 for s in c.statuses), 30)
    m = next(s for s in watcher.statuses if s.get("thermal") == "warm" and s["models"][0]["slots"] == 4)["models"][0]
    assert (m["profile"], m["model_version"], len(m["lanes"])) == ("c2", "1.0.0", 3)
    watcher.close()
    client.close()


def test_refused_deploys_are_audited_and_the_running_version_keeps_serving(tmp_path, broker, keys, releases):
    """Tampered, untrusted and older bundles are refused with their check, audited (file and MQTT), and change
    nothing; the same bundle again is already current; allow_downgrade and rollback move the version; a
    rollback message seen again (a redelivery) changes nothing."""
    cfg = _config(tmp_path, broker, keys, releases["1.1.0"])
    daemon = _daemon(cfg, tmp_path, broker)
    audit = _audit_watcher(broker.port)
    client = Client(broker.port).connect()
    target = ["--broker", f"127.0.0.1:{broker.port}", "--device", "t1", "--timeout", "120"]

    for version, check in (("1.2.0", "hash_mismatch"), ("1.3.0", "untrusted_key"), ("1.0.0", "not_newer")):
        proc = _k2edge("deploy", *target, str(releases[version]))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        line = proc.stdout.strip()
        assert line.startswith("t1: refused ") and f"{check}: " in line and line.endswith("[running: digits 1.1.0]"), line
        assert _ask(client, f"after-{version}")["model_version"] == "1.1.0"
    # the daemon's log names each connection, and what was refused: the file sent, the check, the signer's key id
    log = daemon.output()
    for role in ("requests", "control"):
        assert f"connected to 127.0.0.1:{broker.port} ({role}, session present: " in log, log
    refused = [line for line in log.splitlines() if "deploy: refused " in line]
    assert len(refused) == 3 and not any("None" in line for line in refused), refused
    untrusted = next(line for line in refused if "untrusted_key" in line)
    assert f"deploy: refused {releases['1.3.0'].name}: untrusted_key: " in untrusted and "(key id " in untrusted, untrusted
    same = _k2edge("deploy", *target, str(releases["1.1.0"]))
    assert same.returncode == 0 and "runs already" in same.stdout, same.stdout
    refusals = [(r["status"], r["action"]) for r in _audits(audit)]
    assert refusals == [("hash_mismatch", "install"), ("untrusted_key", "install"), ("not_newer", "install"),
                        ("current", "install")]
    tampered = next(r for r in _audits(audit) if r["status"] == "hash_mismatch")
    assert "model.onnx" in tampered["detail"] and tampered["ok"] is False and tampered["device"] == "t1"
    assert sorted(p.name for p in (tmp_path / "state-t1" / "models" / "digits").iterdir()) == ["1.1.0", "state.json"]

    down = _k2edge("deploy", *target, str(releases["1.0.0"]), "--allow-downgrade")
    assert down.returncode == 0 and down.stdout.strip() == "t1: deployed digits 1.0.0 (was 1.1.0)", down.stdout
    assert _ask(client, "downgraded")["model_version"] == "1.0.0"

    # a rollback message, then the very same message again (what the broker redelivers after a crash)
    corr = b"rollback-1"
    for _ in range(2):
        client.publish("k2edge/t1/models/rollback", {"model": "digits"}, correlation=corr)
    client.wait_for(lambda c: sum(k == corr for _, k in c.answers) == 2, 120)
    first, again = [a for a, k in client.answers if k == corr]
    assert (first["status"], first["version"], first["previous"]) == ("rolled_back", "1.1.0", "1.0.0")
    assert again["status"] == "rolled_back" and "by this request already" in again["reason"]
    assert _ask(client, "rolled-back")["model_version"] == "1.1.0"
    back = _k2edge("rollback", *target, "--model", "digits")  # a new request rolls back again
    assert back.returncode == 0 and back.stdout.strip() == "t1: rolled_back digits 1.0.0 (was 1.1.0)", back.stdout
    unknown = _k2edge("rollback", *target, "--model", "faces")
    assert unknown.returncode == 1 and "unknown_model" in unknown.stdout
    assert daemon.terminate() == 0
    client.close()
    audit.close()


def test_a_group_deploy_reaches_every_member(tmp_path, broker, keys, releases):
    """k2edge/group/{group}/models/deploy is a plain subscription: both members deploy, each answers; with one member
    down, --expect 2 is not met and the command says so and fails."""
    daemons = [_daemon(_config(tmp_path, broker, keys, releases["1.0.0"], device=d, fleet="line3"), tmp_path, broker, d)
               for d in ("g1", "g2")]
    proc = _k2edge("deploy", "--broker", f"127.0.0.1:{broker.port}", "--group", "line3", "--expect", "2",
                   "--timeout", "240", str(releases["1.1.0"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["g1: deployed digits 1.1.0 (was 1.0.0)",
                                                "g2: deployed digits 1.1.0 (was 1.0.0)"]
    for d in ("g1", "g2"):
        assert _status(broker.port, d)["models"][0]["model_version"] == "1.1.0"
    back = _k2edge("rollback", "--broker", f"127.0.0.1:{broker.port}", "--group", "line3", "--expect", "2",
                   "--model", "digits", "--json", "--timeout", "120")
    assert back.returncode == 0, back.stdout + back.stderr
    assert sorted((a["device"], a["status"], a["version"]) for a in map(json.loads, back.stdout.splitlines())) == [
        ("g1", "rolled_back", "1.0.0"), ("g2", "rolled_back", "1.0.0")]
    # a member that does not answer fails the command, though every answer that came was a success
    assert daemons[1].terminate() == 0
    short = _k2edge("deploy", "--broker", f"127.0.0.1:{broker.port}", "--group", "line3", "--expect", "2",
                    "--timeout", "20", str(releases["1.1.0"]))
    assert short.stdout.strip() == "g1: deployed digits 1.1.0 (was 1.0.0)", short.stdout + short.stderr
    assert short.returncode == 1 and "1 of the 2 devices expected answered within 20 s" in short.stderr, short.stderr
    assert daemons[0].terminate() == 0


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def test_a_bundle_fetched_over_https_from_a_private_ca(tmp_path, broker, keys, releases):
    """{"url", "sha256"}: fetched with httpx trusting [deploy] ca_file; a sha256 that does not match is refused."""
    pki = tmp_path / "pki"
    pki.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=fleet-ca", "-keyout", "ca.key",
             "-out", "ca.crt", cwd=pki)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "srv.key", "-out", "srv.csr", cwd=pki)
    (pki / "san.ext").write_text("subjectAltName = IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
             "-extfile", "san.ext", "-out", "srv.crt", cwd=pki)
    served = tmp_path / "www"
    served.mkdir()
    (served / "digits-1.1.0.k2b").write_bytes(releases["1.1.0"].read_bytes())
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(served)))
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki / "srv.crt", pki / "srv.key")
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_address[1]}/digits-1.1.0.k2b"
    try:
        cfg = _config(tmp_path, broker, keys, releases["1.0.0"], extra_tables={"deploy": {"ca_file": str(pki / "ca.crt")}})
        daemon = _daemon(cfg, tmp_path, broker)
        client = Client(broker.port).connect()
        corr = client.publish("k2edge/t1/models/deploy", {"url": url, "sha256": "0" * 64})
        client.wait_for(lambda c: any(k == corr for _, k in c.answers), 60)
        wrong = next(a for a, k in client.answers if k == corr)
        assert (wrong["status"], wrong["check"], wrong["running"]) == ("refused", "hash_mismatch", {"digits": "1.0.0"}), wrong
        corr = client.publish("k2edge/t1/models/deploy", {"url": url + ".missing", "sha256": "0" * 64})
        client.wait_for(lambda c: any(k == corr for _, k in c.answers), 60)
        missing = next(a for a, k in client.answers if k == corr)  # the fetch failed (404): said as such
        assert (missing["status"], missing["check"]) == ("failed", "fetch_failed") and "404" in missing["reason"], missing
        proc = _k2edge("deploy", "--broker", f"127.0.0.1:{broker.port}", "--device", "t1", "--url", url,
                       str(releases["1.1.0"]), "--timeout", "240")
        assert proc.returncode == 0 and proc.stdout.strip() == "t1: deployed digits 1.1.0 (was 1.0.0)", proc.stdout + proc.stderr
        records = [json.loads(x) for x in (tmp_path / "state-t1" / "audit.log").read_text().splitlines()]
        assert [(r["action"], r["status"], r["source"]) for r in records[-4:]] == [
            ("fetch", "hash_mismatch", url), ("fetch", "failed", url + ".missing"), ("install", "installed", url),
            ("activate", "activated", url)]
        assert _ask(client, "fetched")["model_version"] == "1.1.0"
        assert daemon.terminate() == 0
        client.close()
    finally:
        server.shutdown()


def test_a_bare_onnx_is_refused_at_start_unless_unsigned_models_are_allowed(tmp_path, broker, keys):
    """[trust] keys + onnx = ...: one line and exit 1, audited; allow_unsigned serves it and status says so."""
    onnx_entry = {"name": "digits", "onnx": str(ROOT / "models" / "digits" / "model.onnx")}
    cfg = _config(tmp_path, broker, keys, None, model=onnx_entry)
    proc = _k2edge("serve", "--config", str(cfg), timeout=120)
    last = proc.stderr.strip().splitlines()[-1]  # (log lines come before it)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert last.startswith("k2edge serve: error: model digits: a bare onnx path is refused") and "allow_unsigned" in last
    record = json.loads((tmp_path / "state-t1" / "audit.log").read_text().splitlines()[-1])
    assert (record["action"], record["status"], record["ok"]) == ("load", "unsigned", False)

    cfg = _config(tmp_path, broker, keys, None, model=onnx_entry, trust={"keys": [str(keys["pub"])], "allow_unsigned": True})
    daemon = _daemon(cfg, tmp_path, broker)
    status = _status(broker.port)
    assert status["trust"] == {"keys": 1, "allow_unsigned": True} and status["models"][0]["model_version"] is None
    client = Client(broker.port).connect()
    assert _ask(client, "unsigned")["model_version"] is None
    assert daemon.terminate() == 0
    client.close()


def test_the_readmes_broker_acls_let_operators_deploy_and_nobody_else(tmp_path, keys, releases):
    """mosquitto with docs/fleet.md's acl_file: the device (username = device id) takes a deploy from fleet-ops,
    answering on fleet-ops/replies/...; another login may not publish to models/deploy; an application's request to
    the group's pool is answered (mosquitto acknowledges a subscription its ACL does not cover, then delivers
    nothing: the pool's topic must be readable)."""
    pw = tmp_path / "passwd"
    secrets = {"t1": "device-secret", "fleet-ops": "ops-secret", "mallory": "m-secret", "app": "app-secret"}
    for i, (user, secret) in enumerate(secrets.items()):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(pw), user, secret], check=True,
                       capture_output=True)
        (tmp_path / f"{user}.pw").write_text(secret + "\n")
    acl = tmp_path / "acl"
    acl.write_text("pattern readwrite k2edge/%u/#\n\n"
                   "user t1\ntopic read k2edge/group/line-3/models/deploy\ntopic read k2edge/group/line-3/models/rollback\n"
                   "topic write fleet-ops/replies/#\ntopic read k2edge/pool/infer/#\ntopic write apps/replies/#\n\n"
                   "user fleet-ops\ntopic write k2edge/+/models/deploy\ntopic write k2edge/+/models/rollback\n"
                   "topic write k2edge/group/+/models/deploy\ntopic write k2edge/group/+/models/rollback\n"
                   "topic read k2edge/+/audit\ntopic read k2edge/+/status\ntopic read fleet-ops/replies/#\n\n"
                   "user mallory\ntopic read mallory/#\n\n"
                   "user app\ntopic write k2edge/pool/infer/#\ntopic read apps/replies/#\n")
    secured = Broker(tmp_path / "secured", extra_conf=f"message_size_limit {LIMIT + 65536}\n")
    secured.conf.write_text(secured.conf.read_text().replace("allow_anonymous true",
                                                             f"allow_anonymous false\npassword_file {pw}\nacl_file {acl}"))
    secured.start()
    try:
        cfg = write_config(tmp_path / "t1.toml", secured.port, [{"name": "digits", "bundle": releases["1.0.0"]}],
                           fleet="line-3", mqtt_extra={"username": "t1", "password_file": str(tmp_path / "t1.pw")},
                           tables={"trust": {"keys": [str(keys["pub"])]}})
        daemon = DaemonProcess(cfg, tmp_path / "t1.log").start()
        watcher = Client(secured.port)
        watcher.c.username_pw_set("fleet-ops", secrets["fleet-ops"])
        watcher.connect()
        try:
            watcher.wait_state("online", timeout=120)
        except TimeoutError:
            raise AssertionError(daemon.output()) from None
        login = ["--broker", f"127.0.0.1:{secured.port}", "--timeout", "120"]
        ops = [*login, "--username", "fleet-ops", "--password-file", str(tmp_path / "fleet-ops.pw"),
               "--reply-prefix", "fleet-ops/replies"]
        proc = _k2edge("deploy", *ops, "--group", "line-3", "--expect", "1", str(releases["1.1.0"]))
        assert proc.returncode == 0 and proc.stdout.strip() == "t1: deployed digits 1.1.0 (was 1.0.0)", \
            proc.stdout + proc.stderr + daemon.output()
        back = _k2edge("rollback", *ops, "--device", "t1", "--model", "digits")
        assert back.returncode == 0 and back.stdout.strip() == "t1: rolled_back digits 1.0.0 (was 1.1.0)", back.stdout + back.stderr
        rogue = [*login, "--username", "mallory", "--password-file", str(tmp_path / "mallory.pw")]
        denied = _k2edge("deploy", *rogue, "--reply-prefix", "mallory", "--device", "t1", str(releases["1.1.0"]))
        assert denied.returncode == 1 and "the broker refused the message (Not authorized)" in denied.stderr, denied.stderr
        undo = _k2edge("rollback", *rogue, "--reply-prefix", "mallory", "--device", "t1", "--model", "digits")
        assert undo.returncode == 1 and "the broker refused the message (Not authorized)" in undo.stderr, undo.stderr
        status = [s for s in watcher.statuses if s.get("device") == "t1"][-1]
        assert status["models"][0]["model_version"] == "1.0.0"  # mallory changed nothing
        app = Client(secured.port)
        app.reply_topic = "apps/replies/line-3"
        app.c.username_pw_set("app", secrets["app"])
        app.connect()
        corr = app.publish("k2edge/pool/infer/digits", image_request(SAMPLES[0], rid="pooled"))
        try:
            app.wait_for(lambda c: any(k == corr for _, k in c.answers), 60)
        except TimeoutError:
            raise AssertionError("the pool's request was not answered: " + daemon.output()[-3000:]) from None
        assert app.answers[0][0]["status"] == "ok" and app.answers[0][0]["device"] == "t1"
        app.close()
        assert daemon.terminate() == 0
        assert "refused the subscription" not in daemon.output(), daemon.output()[-3000:]
        watcher.close()
    finally:
        secured.stop()


@pytest.mark.parametrize("stop", ["kill", "terminate"])
def test_a_daemon_stopped_mid_deploy_finishes_it_from_the_redelivered_message(stop, tmp_path, broker, keys, releases):
    """kill -9 while the engines build (as a power loss would), or SIGTERM (a drain drops a deploy not yet
    committed, unanswered): the restarted daemon runs 1.0.0, the broker redelivers the unacknowledged deploy
    on the control connection, and it completes; the operator's command, still waiting, gets the one answer."""
    cfg = _config(tmp_path, broker, keys, releases["1.0.0"], cache=tmp_path / "cache")
    daemon = _daemon(cfg, tmp_path, broker)
    watcher = Client(broker.port).connect()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    operator = subprocess.Popen([sys.executable, "-m", "k2edge", "deploy", "--broker", f"127.0.0.1:{broker.port}",
                                 "--device", "t1", str(releases["1.1.0"]), "--timeout", "240"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    watcher.wait_for(lambda c: any((s.get("deploy") or {}).get("state") == "building" for s in c.statuses), 120)
    building = next(s["deploy"] for s in watcher.statuses if (s.get("deploy") or {}).get("state") == "building")
    assert (building["kind"], building["model"], building["version"]) == ("deploy", "digits", "1.1.0"), building
    if stop == "kill":
        daemon.kill()
    else:
        assert daemon.terminate() == 0
    pointer = json.loads((tmp_path / "state-t1" / "models" / "digits" / "state.json").read_text())
    assert pointer["current"] == "1.0.0", daemon.output()  # the deploy had not been committed
    restarted = _daemon(cfg, tmp_path, broker)
    out, err = operator.communicate(timeout=240)
    assert operator.returncode == 0 and out.strip() == "t1: deployed digits 1.1.0 (was 1.0.0)", out + err + restarted.output()
    assert _status(broker.port)["models"][0]["model_version"] == "1.1.0"
    assert _ask(watcher, "after-redelivery")["model_version"] == "1.1.0"
    records = [json.loads(x) for x in (tmp_path / "state-t1" / "audit.log").read_text().splitlines()]
    assert [(r["action"], r["status"], r["version"]) for r in records][-4:] == [
        ("install", "installed", "1.1.0"), ("load", "loaded", "1.0.0"),  # the first try, then the restart
        ("install", "installed", "1.1.0"), ("activate", "activated", "1.1.0")]
    assert restarted.terminate() == 0
    watcher.close()


def test_a_pointer_that_cannot_be_written_swaps_the_old_engines_back(tmp_path, broker, keys, releases):
    """The last step of a deploy fails (state.json cannot be replaced: immutable, as a broken disk refuses a write):
    answered failed, 1.0.0 serves on. A state.json that cannot even be read (a folder in its place) refuses the
    deploy before anything is unpacked."""
    cfg = _config(tmp_path, broker, keys, releases["1.0.0"])
    daemon = _daemon(cfg, tmp_path, broker)
    folder = tmp_path / "state-t1" / "models" / "digits"
    pointer = folder / "state.json"
    kept = pointer.read_bytes()
    pointer.unlink()
    pointer.mkdir()
    deploy = ["deploy", "--broker", f"127.0.0.1:{broker.port}", "--device", "t1", str(releases["1.1.0"]), "--timeout", "240"]
    proc = _k2edge(*deploy)
    assert proc.returncode == 1 and proc.stdout.startswith(f"t1: failed digits 1.1.0: failed: {pointer} cannot be read"), \
        proc.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["1.0.0", "state.json"]
    pointer.rmdir()
    pointer.write_bytes(kept)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(pointer)], capture_output=True).returncode:
        pytest.skip("chattr +i is not possible on this file system (the part above ran)")
    try:
        proc = _k2edge(*deploy)
    finally:
        subprocess.run(["chattr", "-i", str(pointer)], check=True)
    assert proc.returncode == 1 and proc.stdout.startswith(f"t1: failed digits 1.1.0: failed: cannot write {pointer}"), \
        proc.stdout
    assert proc.stdout.strip().endswith("[running: digits 1.0.0]")
    client = Client(broker.port).connect()
    answer = _ask(client, "after-failure")
    assert (answer["model_version"], answer["profile"], answer["top_k"][0]["label"]) == ("1.0.0", "cpu-dev", "0")
    assert daemon.terminate() == 0
    client.close()


def test_the_cli_speaks_tls_to_the_broker(tmp_path):
    """--tls-ca: the broker's certificate is verified (a wrong CA is one line); over TLS a device that never
    answers is reported as such."""
    pki = tmp_path / "pki"
    pki.mkdir()
    for ca in ("ca", "other"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={ca}", "-keyout", f"{ca}.key",
                 "-out", f"{ca}.crt", cwd=pki)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "srv.key", "-out", "srv.csr", cwd=pki)
    (pki / "san.ext").write_text("subjectAltName = IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
             "-extfile", "san.ext", "-out", "srv.crt", cwd=pki)
    tls = Broker(tmp_path / "tls", extra_conf=f"cafile {pki / 'ca.crt'}\ncertfile {pki / 'srv.crt'}\nkeyfile {pki / 'srv.key'}\n")
    tls.start()
    try:
        base = ["rollback", "--broker", f"127.0.0.1:{tls.port}", "--device", "nobody", "--model", "m", "--timeout", "1"]
        proc = _k2edge(*base, "--tls-ca", str(pki / "ca.crt"))
        assert proc.returncode == 1 and "no answer from device nobody within 1 s" in proc.stderr, proc.stderr
        wrong = _k2edge(*base, "--tls-ca", str(pki / "other.crt"))
        assert wrong.returncode == 1 and "cannot reach the broker" in wrong.stderr and "CERTIFICATE_VERIFY_FAILED" in wrong.stderr, \
            wrong.stderr
        assert len(wrong.stderr.strip().splitlines()) == 1
    finally:
        tls.stop()


def test_removing_a_key_revokes_the_installed_version_it_signed(tmp_path, broker, keys, releases):
    """The version in the state directory is verified again at every start: with its signer's key no longer
    trusted, the daemon does not start (one line naming the version and the check), and the trail says why."""
    cfg = _config(tmp_path, broker, keys, releases["1.0.0"])
    assert _daemon(cfg, tmp_path, broker).terminate() == 0
    revoked = _config(tmp_path, broker, keys, releases["1.0.0"], trust={"keys": [str(keys["rogue_pub"])]})
    audit = _audit_watcher(broker.port)
    proc = _k2edge("serve", "--config", str(revoked), timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert last.startswith("k2edge serve: error: model digits: the installed version 1.0.0 is refused: untrusted_key: "), last
    record = json.loads((tmp_path / "state-t1" / "audit.log").read_text().splitlines()[-1])
    assert (record["action"], record["status"], record["ok"]) == ("load", "untrusted_key", False), record
    assert record["source"].endswith("models/digits/1.0.0")
    # the fleet hears it too: the daemon that does not start publishes the record before it exits
    audit.wait_for(lambda c: any(r["status"] == "untrusted_key" for r in _audits(c)), timeout=30)
    assert [r for r in _audits(audit) if not r["ok"]] == [record], _audits(audit)
    audit.close()
    # the line names the way out, on the device: the model's folder moved aside, the config's bundle is installed
    folder = tmp_path / "state-t1" / "models" / "digits"
    assert last.endswith(f"(trust its key again, or move {folder} aside to start from the config's bundle)"), last
    folder.rename(folder.with_name("digits.refused"))
    resigned = _config(tmp_path, broker, keys, releases["1.3.0"], trust={"keys": [str(keys["rogue_pub"])]})
    d = _daemon(resigned, tmp_path, broker)
    assert _status(broker.port)["models"][0]["model_version"] == "1.3.0"
    assert d.terminate() == 0


def test_a_key_rotation_as_docs_fleet_tells_it_keeps_the_device_starting(tmp_path, broker, keys, releases):
    """Both keys trusted, the running version re-signed with the new key and deployed again (no allow_downgrade),
    then the old key removed: the device starts on the re-signed version. (The redeploy used to be answered
    'runs already' with the old signature left on disk, and the device then refused to start.) A state.json that
    cannot be read then stops the start with one line naming what is on disk."""
    from k2edge.bundle import sign_bundle

    both = _config(tmp_path, broker, keys, releases["1.0.0"], trust={"keys": [str(keys["pub"]), str(keys["rogue_pub"])]})
    d = _daemon(both, tmp_path, broker)
    resigned = tmp_path / "digits-1.0.0-new-key.k2b"
    shutil.copy(releases["1.0.0"], resigned)
    sign_bundle(resigned, keys["rogue_key"])
    proc = _k2edge("deploy", "--broker", f"127.0.0.1:{broker.port}", "--device", "t1", "--timeout", "120", str(resigned))
    assert proc.returncode == 0 and "runs already" in proc.stdout and "check out" in proc.stdout, proc.stdout + proc.stderr
    assert d.terminate() == 0
    only_new = _config(tmp_path, broker, keys, releases["1.0.0"], trust={"keys": [str(keys["rogue_pub"])]})
    d = _daemon(only_new, tmp_path, broker)
    assert _status(broker.port)["models"][0]["model_version"] == "1.0.0"
    assert d.terminate() == 0
    pointer = tmp_path / "state-t1" / "models" / "digits" / "state.json"
    pointer.write_text("{")
    proc = _k2edge("serve", "--config", str(only_new), timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert last.startswith(f"k2edge serve: error: model digits: {pointer} cannot be read (not JSON: "), last
    assert "the versions on disk are 1.0.0" in last, last


def test_a_bundle_whose_int8_check_fails_is_not_deployed(tmp_path, broker, keys, releases):
    """1.4.0's card asks INT8 for an exact match (cosine 1.0): the build keeps the best it found, but the deploy
    answers failed with the check, audits it, and 1.0.0 keeps serving."""
    card = ('task = "tensor"\n[input]\nname = "input"\nsize = [32, 32]\nresize = "stretch"\ncolor = "L"\n'
            'scale = 0.00392156862745098\n[quantization]\ntolerance = { cosine = 1.0 }\n')
    strict = small_model_dir(tmp_path / "strict" / "digits", card=card)
    bundle = tmp_path / "digits-1.4.0.k2b"
    create_bundle(strict, bundle, version="1.4.0", profiles=["c2"], key=keys["key"])
    cfg = _config(tmp_path, broker, keys, releases["1.0.0"])
    daemon = _daemon(cfg, tmp_path, broker)
    audit = _audit_watcher(broker.port)
    client = Client(broker.port).connect()
    proc = _k2edge("deploy", "--broker", f"127.0.0.1:{broker.port}", "--device", "t1", "--timeout", "240", "--json",
                   str(bundle))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    body = json.loads(proc.stdout)
    assert (body["status"], body["check"], body["model_version"]) == ("failed", "int8_check", "1.0.0"), body
    check = body["int8_check"]
    assert check["status"] == "failed" and check["tolerance"] == {"cosine": 1.0} and check["measures"]["cosine"] > 0.99
    assert "int8 check" in body["reason"] and "FAILED tolerance" in body["reason"] and "1.0.0 keeps running" in body["reason"]
    assert _ask(client, "still-old")["model_version"] == "1.0.0"
    assert [(r["action"], r["status"], r["version"]) for r in _audits(audit)] == [("install", "installed", "1.4.0"),
                                                                                 ("build", "failed", "1.4.0")]
    assert "FAILED tolerance" in daemon.output()
    client.close()


def test_require_int8_check_answers_a_deploy_with_the_check_that_refused_it(tmp_path, broker, keys, releases):
    """[trust] require_int8_check: 1.1.0 (c2; digits' 40 held-out samples make its check inconclusive) is answered
    failed with check int8_check and the check itself, as a failed check is, not as a build that failed; 1.0.0
    (cpu-dev: no INT8, no check) keeps serving."""
    cfg = _config(tmp_path, broker, keys, releases["1.0.0"], trust={"keys": [str(keys["pub"])], "require_int8_check": True})
    _daemon(cfg, tmp_path, broker)
    client = Client(broker.port).connect()
    proc = _k2edge("deploy", "--broker", f"127.0.0.1:{broker.port}", "--device", "t1", "--timeout", "240", "--json",
                   str(releases["1.1.0"]))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    body = json.loads(proc.stdout)
    assert (body["status"], body["check"], body["model_version"]) == ("failed", "int8_check", "1.0.0"), body
    assert body["int8_check"]["status"] == "inconclusive", body["int8_check"]
    assert "require_int8_check: the INT8 check is inconclusive" in body["reason"] and "1.0.0 keeps running" in body["reason"]
    assert _ask(client, "still-old")["model_version"] == "1.0.0"
    client.close()
