"""Cloud offload and thermal governance end to end: MQTT requests through the daemon to a local
K2 stand-in (a real HTTP server), driven by confidence and by a recorded thermal trace."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from k2_server import K2StandIn, answer, hang
from mqtt_support import DIGITS, SAMPLES, TOPIC, Client

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def k2():
    with K2StandIn() as server:
        yield server


def _img(path, **extra):
    body = {"id": uuid.uuid4().hex[:10], "image": base64.b64encode(path.read_bytes()).decode()}
    body.update(extra)
    return body


def _cloud(k2, **extra):
    return {"base_url": k2.url, "model": "kimi-k2.5", "api_key_env": "K2_TEST_KEY", "timeout_s": 2.0, "max_retries": 0,
            "breaker_failures": 3, "breaker_cooldown_s": 60, **extra}


def _daemon(run_daemon, cloud=None, thermal=None, escalation=None):
    tables = {k: v for k, v in (("cloud", cloud), ("thermal", thermal)) if v}
    model = {**DIGITS, **({"escalation": escalation} if escalation else {})}
    return run_daemon(models=[model], env={"K2_TEST_KEY": "sk-test-secret-key-123"}, tables=tables)


def test_low_confidence_is_escalated_to_k2(tmp_path, run_daemon, broker, k2):
    """Below the model's threshold the request goes to K2 with the image and the edge's top-k."""
    k2.fallback = answer("It is a handwritten three.")
    d = _daemon(run_daemon, cloud=_cloud(k2), escalation={"threshold": 0.9999999})
    client = Client(broker.port).connect()
    client.publish(TOPIC, _img(SAMPLES[3], id="low-1"))
    client.publish(TOPIC, _img(SAMPLES[4], id="stay-local", allow_cloud=False))
    answers = {a["id"]: a for a in client.wait_answers(2, timeout=30)}
    a = answers["low-1"]
    assert a["status"] == "ok" and a["source"] == "cloud" and a["text"] == "It is a handwritten three."
    assert "confidence" in a["escalation_reason"] and "< threshold" in a["escalation_reason"]
    assert a["top_k"][0]["label"] == "3" and a["latency_ms"]["cloud"] > 0
    local = answers["stay-local"]
    assert local["source"] == "edge" and "allow_cloud false" in local["escalation_reason"]
    req = k2.chat_requests[0]
    assert req.body["model"] == "kimi-k2.5" and req.body["temperature"] == pytest.approx(0.6)
    parts = req.body["messages"][-1]["content"]
    assert isinstance(parts, list)
    image_part = next(p for p in parts if p["type"] == "image_url")
    assert image_part["image_url"]["url"].startswith("data:image/jpeg;base64,")
    text = " ".join(p["text"] for p in parts if p["type"] == "text")
    assert "3" in text
    assert req.headers.get("authorization") == "Bearer sk-test-secret-key-123"
    assert "sk-test-secret-key-123" not in d.output()
    # the retained status tells the budget as it is after the call (it stayed at its last value between other changes)
    per_minute = 60
    client.wait_for(lambda c: any((s.get("cloud") or {}).get("budget", {}).get("remaining") == per_minute - 1
                                  for s in c.statuses), 30)
    client.close()


def test_hot_trace_escalates_everything_offloadable(tmp_path, run_daemon, broker, k2):
    trace = tmp_path / "hot.jsonl"
    trace.write_text("".join(json.dumps({"t": i, "temperatures_c": {"tj": 90.0}, "rails_w": {}, "total_power_w": None}) + "\n"
                             for i in range(3)))
    k2.fallback = answer("cloud says 7")
    _daemon(run_daemon, cloud=_cloud(k2), thermal={"source": "trace", "trace": trace, "sample_interval_ms": 50})
    client = Client(broker.port).connect()
    client.wait_for(lambda c: any(s.get("thermal") == "hot" for s in c.statuses), 30)
    for i, p in enumerate(SAMPLES[:4]):
        client.publish(TOPIC, _img(p, id=f"hot-{i}"))
    client.publish(TOPIC, _img(SAMPLES[5], id="hot-forbidden", allow_cloud=False))
    answers = {a["id"]: a for a in client.wait_answers(5, timeout=30)}
    for i in range(4):
        a = answers[f"hot-{i}"]
        assert a["source"] == "cloud" and a["text"] == "cloud says 7" and a["thermal_state"] == "hot"
        assert "thermal state hot" in a["escalation_reason"]
    kept = answers["hot-forbidden"]
    assert kept["source"] == "edge" and kept["top_k"][0]["label"] == "5"
    assert len(k2.chat_requests) == 4
    client.close()


def test_dead_cloud_gives_degraded_local_answers_inside_the_deadline(tmp_path, run_daemon, broker, k2):
    k2.fallback = hang(10.0)
    _daemon(run_daemon, cloud=_cloud(k2, timeout_s=5.0), escalation={"threshold": 0.9999999})
    client = Client(broker.port).connect()
    for i, p in enumerate(SAMPLES[:3]):
        client.publish(TOPIC, _img(p, id=f"dead-{i}", deadline_ms=2000))
    answers = {a["id"]: a for a in client.wait_answers(3, timeout=30)}
    for i in range(3):
        a = answers[f"dead-{i}"]
        assert a["status"] == "ok" and a["source"] == "edge" and a["degraded"] is True, a.get("error")
        assert a["top_k"][0]["label"] == str(i)
        assert a["latency_ms"]["total"] <= 2000, a["latency_ms"]
        assert "cloud failed" in a["escalation_reason"]
    client.close()


def test_prompt_goes_to_the_cloud_and_no_cloud_means_degraded(tmp_path, run_daemon, broker):
    """Without [cloud], a prompt the edge cannot answer comes back locally, degraded, with the reason."""
    run_daemon()
    client = Client(broker.port).connect()
    client.publish(TOPIC, _img(SAMPLES[2], id="p1", prompt="Is this written neatly?"))
    a = client.wait_answers(1)[0]
    assert a["source"] == "edge" and a["degraded"] is True
    assert "no [cloud] section" in a["escalation_reason"] and "prompt" in a["escalation_reason"]
    client.close()


def test_a_prompt_with_the_cloud_forbidden_says_it_went_unanswered(tmp_path, run_daemon, broker, k2):
    """A prompt with allow_cloud false: the local answer, degraded, with the reason saying the cloud was forbidden (the
    answer looked like any confident local one, so nothing said the question went unasked)."""
    k2.fallback = answer("not asked")
    _daemon(run_daemon, cloud=_cloud(k2))
    client = Client(broker.port).connect()
    client.publish(TOPIC, _img(SAMPLES[2], id="q1", prompt="Is this written neatly?", allow_cloud=False))
    a = client.wait_answers(1)[0]
    assert a["source"] == "edge" and a["degraded"] is True and not k2.chat_requests
    assert "prompt" in a["escalation_reason"] and "forbids the cloud (allow_cloud false)" in a["escalation_reason"], a
    client.close()


def test_deferrable_request_is_delivered_after_a_restart_exactly_once(tmp_path, run_daemon, broker, k2):
    """Cloud down: the local answer now (deferred); after a restart with the cloud back, K2's answer once."""
    from k2_server import status

    k2.fallback = status(503)
    model = {**DIGITS, "escalation": {"threshold": 0.9999999}}
    kw = dict(models=[model], env={"K2_TEST_KEY": "k"}, service={"state_dir": str(tmp_path / "state")},
              tables={"cloud": _cloud(k2, breaker_failures=100)})
    d = run_daemon(**kw)
    client = Client(broker.port, client_id="outbox-client", persistent=True).connect()
    corr = client.publish(TOPIC, _img(SAMPLES[6], id="later-1", deferrable=True))
    first = client.wait_answers(1)[0]
    assert first["source"] == "edge" and first["deferred"] is True and first["degraded"] is True
    assert d.terminate() == 0
    k2.fallback = answer("delivered from the outbox")
    started = time.time()
    run_daemon(**kw)
    client.wait_answers(2, timeout=60)
    # the outbox is empty once the delivery is recorded (the retained status follows its depth); a second
    # delivery could only come from a row still pending, and a marker answered after that sees everything before it
    client.wait_for(lambda c: any(s.get("time", 0) >= started and ((s.get("cloud") or {}).get("outbox") or {}).get("depth") == 0
                                  for s in c.statuses), 60)
    client.settle(TOPIC)
    late = [(a, c) for a, c in client.answers if a.get("source") == "cloud"]
    assert len(late) == 1, client.answers
    body, c = late[0]
    assert c == corr and body["id"] == "later-1" and body["text"] == "delivered from the outbox" and body["deferred"] is True
    client.close()


def test_the_cloud_queue_is_bounded(tmp_path, run_daemon, broker, k2):
    """With the cloud hanging and queue_size 2, the rest are answered locally at once, not queued for the cloud."""
    k2.fallback = hang(10.0)
    model = {**DIGITS, "escalation": {"threshold": 0.9999999}}
    run_daemon(models=[model], env={"K2_TEST_KEY": "k"}, service={"queue_size": 2},
               tables={"cloud": _cloud(k2, timeout_s=3.0, concurrency=1)})
    client = Client(broker.port).connect()
    for i in range(8):
        client.publish(TOPIC, _img(SAMPLES[i], id=f"q{i}", deadline_ms=4000))
    client.wait_for(lambda c: len(c.answers) >= 6, timeout=30)
    quick = [a for a, _ in client.answers][:6]
    # two wait for the (hanging) cloud; the other six are answered locally without waiting for it
    assert all(a.get("source") == "edge" and a["degraded"] and "already wait for the cloud" in a["escalation_reason"]
               for a in quick), quick
    late = client.wait_answers(8, timeout=30)[6:]
    assert all(a.get("source") == "edge" and a["degraded"] and "cloud failed" in a["escalation_reason"] for a in late), late
    client.close()


def test_warm_trace_switches_the_model_to_its_dla_heavier_profile(tmp_path, run_daemon, broker):
    trace = tmp_path / "warm.jsonl"
    trace.write_text("".join(json.dumps({"t": i, "temperatures_c": {"tj": 79.0}, "rails_w": {}, "total_power_w": None}) + "\n"
                             for i in range(3)))
    model = {**DIGITS, "escalation": {"warm_profile": "c4"}}
    run_daemon(models=[model], tables={"thermal": {"source": "trace", "trace": trace, "sample_interval_ms": 50}})
    client = Client(broker.port).connect()
    # the serving loop may publish the warm state a moment before the sampler's thread has switched the model: the
    # switch is republished at once
    client.wait_for(lambda c: any(s.get("thermal") == "warm" and (s.get("models") or [{}])[0].get("profile") == "c4"
                              for s in c.statuses), 30)
    client.publish(TOPIC, _img(SAMPLES[8], id="warm-1"))
    a = client.wait_answers(1)[0]
    assert a["profile"] == "c4" and a["thermal_state"] == "warm" and a["top_k"][0]["label"] == "8"
    client.close()


def _outbox_rows(state, where: str) -> int:
    import sqlite3

    db = sqlite3.connect(str(state / "outbox.sqlite3"))
    try:
        return db.execute(f"SELECT COUNT(*) FROM outbox WHERE status = 'pending' AND {where}").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0
    finally:
        db.close()


def test_cloud_work_resumed_after_a_restart_is_answered_like_a_live_cloud_answer(tmp_path, run_daemon, broker):
    """Drained with cloud calls still queued, restarted: those requests get the cloud's answer with the
    same fields as a live cloud answer (cloud_input and latency_ms.cloud included)."""
    state = tmp_path / "state"
    model = {**DIGITS, "escalation": {"threshold": 0.9999999}}
    client = Client(broker.port, client_id="resume-client", persistent=True).connect()
    with K2StandIn() as k2:
        k2.fallback = hang(60.0)  # until the stand-in stops
        d = run_daemon(models=[model], env={"K2_TEST_KEY": "k"}, service={"state_dir": str(state)},
                       tables={"cloud": _cloud(k2, timeout_s=30.0, concurrency=1)})
        for i in range(4):  # one in the (hanging) call, one waiting for the call slot, two queued in the pool
            client.publish(TOPIC, _img(SAMPLES[i], id=f"resume-{i}", deadline_ms=120_000))
        _wait(lambda: _outbox_rows(state, "1") == 4 and len(k2.chat_requests) >= 1, "four requests in the outbox")
        d.proc.send_signal(signal.SIGTERM)
        # the drain hands the queued cloud work back to the outbox (unleased) before it waits for the running call, and
        # the request waiting for the call slot too: it would have started a call once the running one ended
        _wait(lambda: _outbox_rows(state, "lease_owner IS NULL") >= 3, "queued and waiting cloud work handed back")
        # and the draining daemon leaves it there: its outbox loop (a poll a second) takes nothing back
        left = time.monotonic() + 2.5
        while time.monotonic() < left:
            assert _outbox_rows(state, "lease_owner IS NULL") >= 3, "the draining daemon took handed-back work again"
            time.sleep(0.1)
        assert len(k2.chat_requests) == 1, "a call was started while the daemon drained"
    assert d.proc.wait(timeout=60) == 0  # the running call failed when the stand-in stopped: answered locally

    with K2StandIn() as k2:
        k2.fallback = answer("a cloud answer")
        kw = dict(models=[model], env={"K2_TEST_KEY": "k"}, service={"state_dir": str(state)}, tables={"cloud": _cloud(k2)})
        run_daemon(**kw)
        client.wait_for(lambda c: sum(a.get("source") == "cloud" for a, _ in c.answers) >= 3, timeout=60)
        resumed = [a for a, _ in client.answers if a.get("source") == "cloud"]
        client.publish(TOPIC, _img(SAMPLES[5], id="live-1"))
        client.wait_for(lambda c: any(a.get("id") == "live-1" for a, _ in c.answers), timeout=30)
        live = next(a for a, _ in client.answers if a.get("id") == "live-1")
    assert live["source"] == "cloud" and live["text"] == "a cloud answer"
    for a in resumed:
        assert a["status"] == "ok" and a["text"] == "a cloud answer" and a["id"].startswith("resume-")
        assert set(a) == set(live), (sorted(a), sorted(live))
        assert set(a["latency_ms"]) == set(live["latency_ms"]) and "cloud" in a["latency_ms"]
        assert a["cloud_input"] == live["cloud_input"] == "image"
    assert len({a["id"] for a, _ in client.answers}) == len(client.answers)  # no request answered twice
    client.close()


def test_a_cloud_call_in_flight_when_the_daemon_is_killed_is_resumed_at_the_restart(tmp_path, run_daemon, broker):
    """kill -9 while a request waits for the cloud: the restarted daemon asks the cloud again at once, in the time the
    request has left. Its lease (the request's budget + 30 s) used to keep the row from the new process until the
    deadline had passed, and the request then came back deadline_exceeded though the daemon was down for a moment."""
    state = tmp_path / "state"
    model = {**DIGITS, "escalation": {"threshold": 0.9999999}}
    client = Client(broker.port, client_id="killed-client", persistent=True).connect()
    with K2StandIn() as k2:
        k2.fallback = hang(60.0)
        d = run_daemon(models=[model], env={"K2_TEST_KEY": "k"}, service={"state_dir": str(state)},
                       tables={"cloud": _cloud(k2, timeout_s=30.0)})
        client.publish(TOPIC, _img(SAMPLES[0], id="killed-0", deadline_ms=120_000))
        _wait(lambda: len(k2.chat_requests) >= 1 and _outbox_rows(state, "lease_owner IS NOT NULL") == 1,
              "the request leased and its cloud call made")
        d.kill()
    with K2StandIn() as k2:
        k2.fallback = answer("a cloud answer")
        run_daemon(models=[model], env={"K2_TEST_KEY": "k"}, service={"state_dir": str(state)}, tables={"cloud": _cloud(k2)})
        client.wait_for(lambda c: any(a.get("id") == "killed-0" for a, _ in c.answers), timeout=60)  # not 150 s
    answer_ = next(a for a, _ in client.answers if a.get("id") == "killed-0")
    assert answer_["status"] == "ok" and answer_["source"] == "cloud" and answer_["text"] == "a cloud answer", answer_
    client.close()


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"not reached: {what}"
        time.sleep(0.05)


def test_request_command_gets_the_local_answer_while_the_cloud_hangs(tmp_path, run_daemon, broker, k2):
    """`k2edge request` without --deadline-ms sends its wait as the deadline: a hanging cloud (whose timeout is far
    longer) gives way to the local answer, degraded, before the command gives up (it used to time out)."""
    k2.fallback = hang(60.0)
    _daemon(run_daemon, cloud=_cloud(k2, timeout_s=30.0), escalation={"threshold": 0.9999999})
    base = ["request", "--broker", f"127.0.0.1:{broker.port}", "--device", "t1", "--model", "digits", str(SAMPLES[3])]
    proc = _k2edge(*base, "--timeout", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    a = json.loads(proc.stdout)
    assert a["source"] == "edge" and a["degraded"] is True and "cloud failed" in a["escalation_reason"], a
    assert a["top_k"][0]["label"] == "3" and a["latency_ms"]["total"] < 6000, a
    assert k2.chat_requests, "the request was not escalated"
    proc = _k2edge(*base, "--timeout", "2", "--deadline-ms", "5000")
    assert proc.returncode == 1 and "--timeout 2 s is shorter than --deadline-ms 5000" in proc.stderr, proc.stderr


def _k2edge(*args):
    return subprocess.run([sys.executable, "-m", "k2edge", *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
