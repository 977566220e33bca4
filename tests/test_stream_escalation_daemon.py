"""Stream escalation in the daemon, against a real mosquitto and the real K2 stand-in, on the crossing video:
the follow-ups equal the events the rules select, one per event id, across a cloud outage, a broker restart and
a kill -9; with a hanging cloud the escalating stream keeps the rate and frame age of a stream beside it that
escalates nothing (the same file, the same run); the streams' share of the request budget leaves the rest to
MQTT requests; the API key reaches no log, event, status or live view."""

from __future__ import annotations

import json
import sqlite3
import statistics
import time
import urllib.request

import pytest
from k2_server import K2StandIn, answer, hang, status, verdict
from mqtt_support import Client, free_port, image_request
from test_streams_daemon import (BOXES, SCENES, STREAMS, _events, _messages, _stored_events, _stream, _wait_event,
                                 _wait_until, crossing)  # noqa: F401 (crossing: the module's fixture)

pytestmark = pytest.mark.slow
pytest.importorskip("av")

SECRET = "sk-stand-in-7f3a9c1e5b"
FOLLOW = ("event_described", "event_description_failed")


def _cloud(k2, tmp_path, **extra) -> dict:
    key = tmp_path / "k2.key"
    key.write_text(SECRET + "\n")
    return {"base_url": k2.url, "model": "kimi-k2.5", "api_key_file": str(key), "max_retries": 0, **extra}


def _follow_ups(client: Client, stream: str = "cam") -> list[dict]:
    return [e for e in _messages(client, "events", stream) if e["event"] in FOLLOW]


def _jobs(state) -> list[tuple]:
    db = sqlite3.connect(f"file:{state / 'stream_escalations.sqlite3'}?mode=ro", uri=True, timeout=5)
    try:
        return db.execute("SELECT event_id, outcome FROM jobs").fetchall()
    finally:
        db.close()


def test_follow_ups_equal_the_selected_events_once_across_an_outage_a_broker_restart_and_a_kill(
        run_daemon, broker, crossing, tmp_path):
    """The cloud is down while the video plays (jobs wait); it comes back while the broker is away (follow-ups are
    stored, not delivered); the daemon is killed with jobs undone; the next start (the video again) delivers one
    follow-up per line crossing of both runs, each redelivery the same bytes, every verdict parsed."""
    state = tmp_path / "state-t1"
    with K2StandIn(api_key=SECRET) as k2:
        k2.fallback = status(503)
        cloud = _cloud(k2, tmp_path, timeout_s=2.0, breaker_failures=3, breaker_cooldown_s=0.5,
                       requests_per_minute=1000)
        rules = [{"on": "line_cross", "verify": True, "prompt": "Is this a {label} crossing {line} ({direction})?"}]
        client = Client(broker.port, client_id=f"watcher-{tmp_path.name[-8:]}", persistent=True).connect()
        client.subscribe(STREAMS)
        d = run_daemon(models=[BOXES], streams=[_stream(crossing, pace="every", escalation=rules)],
                       tables={"cloud": cloud}, verbose=True)
        _wait_event(client, "stream_ended")
        n = len(crossing.crossings)
        _wait_until(lambda: len(_events(client, "line_cross")) >= n, 30, "the crossings")
        _wait_until(lambda: len(k2.chat_requests) >= 1, 30, "a first try at the cloud")
        assert _follow_ups(client) == []  # the cloud is down: every job waits
        assert all(o is None for _, o in _jobs(state))
        broker.stop()
        k2.fallback = verdict("confirmed", None, "a digit crossing the line", delay_s=0.3)
        _wait_until(lambda: any(e["event_id"].endswith(".k2") for e in _stored_events(state, "event_described")), 60,
                    "a follow-up stored while the broker is away")
        d.kill()  # SIGKILL: jobs undone, follow-ups stored and not delivered
        undone = sum(o is None for _, o in _jobs(state))
        broker.start()
        run_daemon(models=[BOXES], streams=[_stream(crossing, pace="every", escalation=rules)], tables={"cloud": cloud},
                   verbose=True)
        _wait_until(lambda: len({e["event_id"] for e in _events(client, "line_cross")}) >= 2 * n, 120,
                    "the second run's crossings")
        crossings = {e["event_id"] for e in _events(client, "line_cross")}
        _wait_until(lambda: {f["for_event"] for f in _follow_ups(client)} >= crossings, 120,
                    "a follow-up for every crossing")
        by_id: dict[str, dict] = {}
        for f in _follow_ups(client):
            assert by_id.setdefault(f["event_id"], f) == f  # a redelivery is the same follow-up
            assert f["event_id"] == f["for_event"] + ".k2"
        assert {f["for_event"] for f in by_id.values()} == crossings  # one per selected event, no other
        assert all(f["event"] == "event_described" and f["verdict"] == "confirmed" and f["model"] == "kimi-k2.5"
                   and f["label"] is not None and f["attempts"] >= 1 for f in by_id.values()), by_id
        waited = [f for f in by_id.values() if f["attempts"] > 1]
        assert waited, "no follow-up went through the outage"
        for e in _events(client, "line_cross"):
            assert e["escalation"] == {"rule": 0, "follow_up": e["event_id"] + ".k2"}
        client.wait_for(lambda c: all(o is not None for _, o in _jobs(state)), 30)
        client.wait_for(lambda c: c.statuses[-1]["streams"]["cam"]["escalations"]["waiting"] == 0, 30)
        st = client.statuses[-1]["streams"]["cam"]["escalations"]
        print(f"{n} crossings per run, 2 runs: {len(by_id)} follow-ups; {undone} job(s) undone at the kill; "
              f"{len(waited)} waited through the outage; status {st}")
        assert st["described"] >= 1 and st["failed"] == 0
        for path in tmp_path.glob("*.log"):
            assert SECRET not in path.read_text(errors="replace")
        assert SECRET not in json.dumps(client.other) + json.dumps(client.statuses)
        client.close()


def test_a_hanging_cloud_slows_no_stream_and_the_requests_keep_their_share_of_the_budget(
        run_daemon, broker, crossing, tmp_path):
    """Two streams of the same looping file, one escalating every event to a hanging cloud and one escalating
    nothing: the first's processed rate and frame age are the second's. The streams spend their share of the
    request budget (half of 10 a minute) and no more; the MQTT requests then get the other half from the cloud."""
    with K2StandIn(api_key=SECRET) as k2:
        k2.fallback = hang(30.0)
        cloud = _cloud(k2, tmp_path, timeout_s=1.5, breaker_failures=100, requests_per_minute=10, stream_share=0.5)
        every = [{"on": kind, "images": "frame"} for kind in ("line_cross", "zone_enter", "zone_leave")]
        client = Client(broker.port).connect()
        client.subscribe(STREAMS)
        port = free_port()
        run_daemon(models=[{**BOXES, "escalation": {"threshold": 1.0}}], tables={"cloud": cloud, "http": {"port": port}},
                   streams=[_stream(crossing, "on", loop=True, escalation=every), _stream(crossing, "off", loop=True)],
                   verbose=True)
        _wait_event(client, "stream_up", "on")
        _wait_event(client, "stream_up", "off")
        started = time.monotonic()
        time.sleep(3.0)  # the rate window fills
        samples = []
        while time.monotonic() - started < 12.0:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/streams", timeout=10) as resp:
                samples.append(json.loads(resp.read()))
            time.sleep(1.0)
        fps = {s: statistics.mean(x[s]["fps_processed"] for x in samples) for s in ("on", "off")}
        age = {s: statistics.median(x[s]["frame_age_ms"]["p50"] for x in samples) for s in ("on", "off")}
        interval_ms = 1000 / fps["off"]
        print(f"hanging cloud: on {fps['on']:.2f} fps, frame age p50 {age['on']:.1f} ms; off {fps['off']:.2f} fps, "
              f"{age['off']:.1f} ms")
        assert fps["on"] >= 0.9 * fps["off"] and age["on"] <= age["off"] + interval_ms, (fps, age)
        stream_calls = [r for r in k2.chat_requests if "camera frame" in json.dumps(r.body)]
        assert len(stream_calls) == 5  # half of 10 a minute, every one hanging; the rest wait
        assert samples[-1]["on"]["escalations"]["waiting"] > 0 and samples[-1]["off"]["escalations"] is None
        parts = stream_calls[0].body["messages"][-1]["content"]
        assert parts[0]["image_url"]["url"].startswith("data:image/jpeg;base64,")

        k2.fallback = answer("cloud says boxes")
        rids = [client.publish("k2edge/t1/infer/boxes", image_request(p, rid=f"r{i}", deadline_ms=20000))
                for i, p in enumerate(SCENES * 2)]
        answers = client.wait_answers(len(rids), timeout=60)
        from_cloud = [a for a in answers if a.get("source") == "cloud"]
        assert len(from_cloud) == 10 - 5 and len(answers) > 5, [a.get("escalation_reason") for a in answers]
        assert all("budget" in a["escalation_reason"] for a in answers if a.get("source") != "cloud")
        assert len([r for r in k2.chat_requests if "camera frame" in json.dumps(r.body)]) == 5
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/events?limit=200", timeout=10) as resp:
            live = resp.read().decode()
        for path in tmp_path.glob("*.log"):
            assert SECRET not in path.read_text(errors="replace")
        assert SECRET not in live + json.dumps(client.other) + json.dumps(client.statuses)
        client.close()


def test_watch_with_a_cloud_config_prints_one_follow_up_beside_each_selected_event(crossing, tmp_path):
    """``k2edge watch --cloud-config``: the rules of the file select the crossings; each gets its follow-up line
    (K2's text as the description), keyed to its event; the key is in no output."""
    import subprocess
    import sys

    from mqtt_support import ROOT

    (x0, y0), (x1, y1) = crossing.line
    config = tmp_path / "k2edge.toml"
    config.write_text('device_id = "t"\n[[models]]\nname = "boxes"\nonnx = "m.onnx"\n[[streams]]\nname = "gate"\n'
                      'source = "file:///x.mp4"\nmodel = "boxes"\n[[streams.lines]]\nname = "door"\n'
                      f'start = [{x0}, {y0}]\nend = [{x1}, {y1}]\n')
    with K2StandIn(api_key=SECRET) as k2:
        k2.fallback = answer("a handwritten digit walking through the door")
        cloud = _cloud(k2, tmp_path)
        lines = ["[cloud]", *(f"{k} = {json.dumps(v)}" for k, v in cloud.items()),
                 "[[escalation]]", 'on = "line_cross"', 'line = "door"', 'prompt = "What crossed {line} going {direction}?"']
        (tmp_path / "cloud.toml").write_text("\n".join(lines) + "\n")
        out = subprocess.run([sys.executable, "-m", "k2edge", "watch", str(ROOT / "models/detector/model.onnx"),
                              str(crossing.path), "--json", "--config", str(config), "--stream", "gate",
                              "--cloud-config", str(tmp_path / "cloud.toml"), "--cloud-wait", "30"],
                             capture_output=True, text=True, cwd=ROOT, timeout=180)
        assert out.returncode == 0, out.stderr
        rows = [json.loads(x) for x in out.stdout.splitlines()]
        crossings = [r for r in rows if r.get("event") == "line_cross"]
        follow = [r for r in rows if r.get("event") == "event_described"]
        assert len(crossings) == len(crossing.crossings) and crossings
        assert sorted(f["for_event"] for f in follow) == sorted(c["event_id"] for c in crossings)
        assert all(f["description"] == "a handwritten digit walking through the door" for f in follow)
        texts = [r.body["messages"][-1]["content"][-1]["text"] for r in k2.chat_requests]
        assert sorted(t.split("\n")[0] for t in texts) == sorted(f"What crossed door going {c['direction']}?"
                                                                 for c in crossings)
        assert SECRET not in out.stdout + out.stderr
