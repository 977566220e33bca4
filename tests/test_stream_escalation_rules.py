"""Stream escalation, component by component: the rules' validation with field paths, select (first match wins,
low confidence by mean or best), the strict verdict parse, the streams' share of the request budget, K2Client.ask
against the real HTTP stand-in, and the durable job queue's exactly-once (the stand-in answering, failing, hanging
and refusing JSON mode; a crash between storing a follow-up and marking its job)."""

from __future__ import annotations

import base64
import json
import threading

import numpy as np
import pytest
from k2_server import K2StandIn, answer, hang, status, verdict

from k2edge.cloud_bridge import CloudBridge, CloudSettings, K2Client
from k2edge.cloud_bridge.budget import RequestBudget
from k2edge.cloud_bridge.verdict import VerdictError, parse_verdict
from k2edge.config.schema import DaemonConfig
from k2edge.config.stream_escalation import EscalationRule
from k2edge.config.tables import SettingsError, validate_settings
from k2edge.profile.validation import describe_validation_error, model_keys
from k2edge.service.event_store import EventStore
from k2edge.service.stream_escalation import EscalationJobs, StreamEscalations, follow_up_id
from k2edge.service.stream_path import StreamPath
from k2edge.streams.escalation_rules import TrackStats, select
from k2edge.streams.payload import event_payload

SECRET = "sk-test-secret-0123456789"


def _config(rules, cloud=True) -> dict:
    stream = {"name": "cam", "source": "file:///tmp/x.mp4", "model": "boxes",
              "lines": [{"name": "door", "start": [100, 0], "end": [100, 240]}],
              "zones": [{"name": "yard", "points": [[0, 0], [50, 0], [50, 50]]}], "escalation": rules}
    cfg = {"models": [{"name": "boxes", "onnx": "/tmp/m.onnx"}], "streams": [stream]}
    if cloud:
        cfg["cloud"] = {"base_url": "http://127.0.0.1:9/v1", "model": "kimi-k2.5"}
    return cfg


def _error(cfg: dict) -> str:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as exc:
        DaemonConfig.model_validate(cfg)
    return describe_validation_error(exc.value, model_keys(DaemonConfig))


def test_rules_load_and_bad_rules_are_refused_with_their_field_path():
    """A valid rule set loads; each mistake is one error naming the field's path."""
    ok = DaemonConfig.model_validate(_config([{"on": "line_cross", "line": "door", "labels": ["person"], "verify": True},
                                              {"on": "track_end", "when": "low_confidence", "threshold": 0.5,
                                               "measure": "best", "images": "track", "count": 4,
                                               "prompt": "A {label} left {stream}; what is it?"}]))
    rules = ok.streams[0].escalation
    assert rules[0].measure == "mean" and rules[1].count == 4 and ok.cloud.stream_share == 0.5
    assert "streams.0.escalation.0.prompt: unknown placeholder(s) ['plate']" in _error(
        _config([{"on": "line_cross", "prompt": "read the {plate}"}]))
    assert "streams.0.escalation.0.on: must be one of" in _error(_config([{"on": "loiter"}]))
    assert "needs a threshold" in _error(_config([{"on": "zone_enter", "when": "low_confidence"}]))
    assert "streams.0.escalation.0.count: must be <= 8" in _error(_config([{"on": "track_end", "images": "track",
                                                                              "count": 9}]))
    assert "escalation.0.zone: no zone 'gate' in this stream" in _error(_config([{"on": "zone_enter", "zone": "gate"}]))
    assert "line is for line_cross rules" in _error(_config([{"on": "zone_enter", "line": "door"}]))
    assert "a track_end has no frame" in _error(_config([{"on": "track_end", "images": "frame"}]))
    assert "streams.0.escalation.0.threshold: must be <= 1" in _error(
        _config([{"on": "track_end", "when": "low_confidence", "threshold": 1.5}]))
    assert "streams.0.escalation: rules need a [cloud] table" in _error(_config([{"on": "track_end"}], cloud=False))
    assert "stream_share: must be <= 1" in str(pytest.raises(SettingsError, validate_settings, CloudSettings,
                                                             {"stream_share": 1.5}, "cloud").value)


def test_select_first_match_wins_and_low_confidence_uses_the_named_measure():
    """Rules are tried in order; zone, line and labels narrow them; low_confidence compares mean or best."""
    rules = [EscalationRule(on="line_cross", line="door", labels=("car",)),
             EscalationRule(on="line_cross", when="low_confidence", threshold=0.5, prompt="{label} {direction} {line}"),
             EscalationRule(on="line_cross", when="low_confidence", threshold=0.5, measure="best", verify=True),
             EscalationRule(on="zone_enter", zone="yard", prompt="{label} in {zone} of {stream}")]
    cross = {"event": "line_cross", "label": "person", "line": "door", "direction": "in"}
    assert select(rules, {**cross, "label": "car"}, None).index == 0
    low_mean = select(rules, cross, TrackStats(10, 0.4, 0.9), "cam")
    assert (low_mean.index, low_mean.prompt) == (1, "person in door") and "mean score 0.400" in low_mean.reason
    assert select(rules, cross, TrackStats(10, 0.6, 0.45)).index == 2  # mean not low, best is
    assert select(rules, cross, TrackStats(10, 0.6, 0.9)) is None
    assert select(rules, cross, None) is None  # low confidence needs the track's scores
    z = select(rules, {"event": "zone_enter", "label": "dog", "zone": "yard"}, None, "cam")
    assert (z.index, z.prompt) == (3, "dog in yard of cam")
    assert select(rules, {"event": "zone_enter", "label": "dog", "zone": "porch"}, None) is None
    assert select(rules, {"event": "zone_leave", "label": "dog", "zone": "yard"}, None) is None


@pytest.mark.parametrize("text, why", [
    ("Sure! {\"verdict\": \"confirmed\"}", "not JSON"),
    ("[1, 2]", "not an object"),
    (json.dumps({"verdict": "maybe", "label": "x", "description": "d"}), "verdict must be one of"),
    (json.dumps({"verdict": "relabelled", "label": "", "description": "d"}), "needs the new label"),
    (json.dumps({"verdict": "confirmed", "label": "x"}), "description must be a string"),
    (json.dumps({"verdict": "confirmed", "label": "x", "description": "d", "score": 1}), "unexpected key"),
])
def test_a_verdict_that_does_not_parse_is_a_failure_with_its_reason(text, why):
    with pytest.raises(VerdictError, match=why):
        parse_verdict(text)


def test_a_verdict_parses_strictly():
    v = parse_verdict(json.dumps({"verdict": "relabelled", "label": "cat", "description": "a cat, not a dog"}))
    assert (v.verdict, v.label, v.description) == ("relabelled", "cat", "a cat, not a dog")


def test_the_streams_share_of_the_budget_leaves_the_rest_to_requests():
    """Streams spend at most their share in a window; requests always keep the rest; the window frees both."""
    now = [0.0]
    b = RequestBudget(10, clock=lambda: now[0])
    assert sum(b.try_acquire_share(0.3) is not None for _ in range(20)) == 3
    assert b.share_resets_in_s(0.3) == pytest.approx(60.0)
    assert sum(b.try_acquire() is not None for _ in range(20)) == 7  # the requests' part is whole
    now[0] = 30.0
    assert not b.try_acquire_share(0.3) and b.share_resets_in_s(0.3) == pytest.approx(30.0)
    now[0] = 60.5
    assert b.try_acquire_share(0.3) and b.remaining() == 9
    b2 = RequestBudget(10, clock=lambda: now[0])
    assert sum(b2.try_acquire() is not None for _ in range(10)) == 10
    assert not b2.try_acquire_share(0.5)  # requests may take the whole budget; streams then wait
    assert not RequestBudget(10).try_acquire_share(0.0)
    assert RequestBudget(None).try_acquire_share(0.0)


# the job queue, with the real stand-in, a real event store, the stream path's follow-up publishing -------------

class Publisher:
    """Records what the stream path publishes (the broker connection's place)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.connected = threading.Event()
        self.connected.set()

    def publish(self, topic, payload, qos=0, on_delivered=None, **kw):
        self.sent.append((topic, json.loads(payload)))
        if on_delivered is not None:
            on_delivered()


class CrashAfterStore(StreamPath):
    """A stream path whose process dies right after a follow-up is stored (before its job is marked done)."""

    def follow_up(self, stream, body):
        topic = f"{self.prefix}/streams/{stream}/events"
        self.events.add([(body["event_id"], topic, json.dumps(body).encode())])
        raise SystemExit("killed")


def _setup(tmp_path, k2: K2StandIn, path_cls=StreamPath, metrics=None, **cloud):
    settings = CloudSettings(base_url=k2.url, model="kimi-k2.5", timeout_s=cloud.pop("timeout_s", 2.0), max_retries=0,
                             breaker_failures=cloud.pop("breaker_failures", 100), **cloud)
    bridge = CloudBridge(settings, tmp_path, client=K2Client(settings, api_key=SECRET))
    events = EventStore(tmp_path / "events.sqlite")
    pub = Publisher()
    path = path_cls([], "k2edge/t1", pub, events, {})
    esc = StreamEscalations(bridge, EscalationJobs(tmp_path / "stream_escalations.sqlite3"), events, path, metrics)
    return esc, events, pub


def _event(events: EventStore, rule: EscalationRule, esc: StreamEscalations, label="person", image=True) -> dict:
    """An event as the stream path raises it: its job first, then the event stored."""
    body = event_payload("cam", {"event": "line_cross", "track_id": 1, "label": label, "line": "door", "direction": "in",
                                 "box": [10.0, 10.0, 50.0, 90.0]}, 3)
    sel = select([rule], body, TrackStats(5, 0.42, 0.6), "cam")
    img = np.zeros((80, 40, 3), np.uint8)
    img[:, :20] = 200
    assert esc.submit("cam", body, (sel, [img] if image else [], TrackStats(5, 0.42, 0.6)))
    events.add([(body["event_id"], "k2edge/t1/streams/cam/events", json.dumps(body).encode())])
    return body


def _follow_ups(pub: Publisher) -> list[dict]:
    return [b for _, b in pub.sent if b["event"] in ("event_described", "event_description_failed")]


def test_a_verdict_comes_back_once_with_the_images_the_label_score_and_box_sent(tmp_path):
    """verify: the request carries the crop as a JPEG data URL, the edge's label, score and box, the prompt and JSON
    mode; the follow-up (<id>.k2) holds the verdict; running the job again sends nothing and publishes nothing."""
    with K2StandIn() as k2:
        from k2edge.service.metrics import PrometheusMetrics

        k2.script(verdict("relabelled", "cat", "a cat, not a person"))
        metrics = PrometheusMetrics()
        esc, events, pub = _setup(tmp_path, k2, metrics=metrics)
        body = _event(events, EscalationRule(on="line_cross", verify=True, prompt="Is this a {label}?"), esc)
        assert body["escalation"] == {"rule": 0, "follow_up": body["event_id"] + ".k2"}
        (job,) = esc.jobs.due(1e12, set())
        assert esc.run(job) == "described"
        (req,) = k2.chat_requests
        assert req.headers["authorization"] == f"Bearer {SECRET}"  # the key goes to K2, and nowhere else
        parts = req.body["messages"][-1]["content"]
        assert req.body["response_format"] == {"type": "json_object"}
        assert [p["type"] for p in parts] == ["image_url", "text"]
        url = parts[0]["image_url"]["url"]
        assert url.startswith("data:image/jpeg;base64,")
        from PIL import Image
        import io
        assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size == (40, 80)
        text = parts[1]["text"]
        assert text.startswith("Is this a person?") and '"score": 0.42' in text and "[10.0, 10.0, 50.0, 90.0]" in text
        assert '"verdict": "confirmed" | "rejected" | "relabelled"' in text
        (f,) = _follow_ups(pub)
        assert f["event_id"] == follow_up_id(body["event_id"]) and f["for_event"] == body["event_id"]
        assert (f["event"], f["verdict"], f["label"], f["description"]) == ("event_described", "relabelled", "cat",
                                                                            "a cat, not a person")
        assert f["model"] == "kimi-k2.5" and f["attempts"] == 1 and f["latency_ms"] > 0
        assert events.find(f["event_id"]) == f
        assert esc.jobs.due(1e12, set()) == [] and esc.status("cam")["described"] == 1
        assert 'k2edge_stream_escalations_total{outcome="described",stream="cam"} 1.0' in metrics.render().decode()
        assert SECRET not in json.dumps(pub.sent)


def test_malformed_json_fails_with_its_reason_and_servers_without_json_mode_or_vision_are_asked_again(tmp_path):
    """A verdict that is not JSON is a failed escalation (never a guess); a 400 refusing response_format is
    retried at once without it, and not sent again; a server refusing images gets the text alone."""
    with K2StandIn(refuse_json_mode=True) as k2:
        k2.script(answer("I think it is a person."), verdict("confirmed", "person", "yes"))
        esc, events, pub = _setup(tmp_path, k2)
        rule = EscalationRule(on="line_cross", verify=True)
        _event(events, rule, esc)
        (job,) = esc.jobs.due(1e12, set())
        assert esc.run(job) == "failed"
        (f,) = _follow_ups(pub)
        assert f["event"] == "event_description_failed" and f["reason"].startswith("not a verdict: the answer is not JSON")
        assert ["response_format" in r.body for r in k2.chat_requests] == [True, False]
        _event(events, rule, esc)
        (job,) = esc.jobs.due(1e12, set())
        assert esc.run(job) == "described"
        assert "response_format" not in k2.chat_requests[-1].body and len(k2.chat_requests) == 3
        k2.refuse_images = True  # a text-only deployment (vision = "auto"): the text alone, asked again at once
        k2.script(verdict("rejected", "person", "nothing there"))
        _event(events, rule, esc)
        (job,) = esc.jobs.due(1e12, set())
        assert esc.run(job) == "described" and _follow_ups(pub)[-1]["verdict"] == "rejected"
        assert [len(r.body["messages"][-1]["content"]) for r in k2.chat_requests[-2:]] == [2, 1]


def test_an_outage_keeps_jobs_waiting_and_a_crash_after_storing_the_follow_up_never_doubles_it(tmp_path):
    """A failing, then hanging cloud postpones the job (store-and-forward); the answer's follow-up stored just before
    a crash is found at the restart: the job is marked done without asking K2 again or publishing a second one."""
    with K2StandIn() as k2:
        k2.script(status(503), hang(3.0))
        esc, events, pub = _setup(tmp_path, k2, timeout_s=0.3, path_cls=CrashAfterStore)
        body = _event(events, EscalationRule(on="line_cross", prompt="what {label}?"), esc, image=False)
        (job,) = esc.jobs.due(1e12, set())
        assert esc.run(job) is None  # 503: waits
        (job,) = esc.jobs.due(1e12, set())
        assert esc.run(job) is None  # hangs past the timeout: waits
        state = esc.jobs.get(body["event_id"])
        assert state["outcome"] is None and state["attempts"] == 2 and "timeout" in state["last_error"]
        assert _follow_ups(pub) == [] and esc.status("cam")["waiting"] == 1
        k2.script(answer("a person at the door"))
        (job,) = esc.jobs.due(1e12, set())
        with pytest.raises(SystemExit):
            esc.run(job)  # stored, then the process died
        assert esc.jobs.get(body["event_id"])["outcome"] is None
        calls = len(k2.chat_requests)
        esc.jobs.close()
        events.close()
        # the restart: the same files
        esc2, events2, pub2 = _setup(tmp_path, k2)
        (job,) = esc2.jobs.due(1e12, set())
        assert esc2.run(job) == "stored" and len(k2.chat_requests) == calls and _follow_ups(pub2) == []
        (stored,) = [json.loads(p) for eid, _, p in events2.pending() if eid.endswith(".k2")]
        assert stored["description"] == "a person at the door" and stored["attempts"] == 3
        assert esc2.jobs.due(1e12, set()) == []


def test_a_job_waiting_for_a_concurrency_slot_spends_none_of_the_streams_share(tmp_path):
    """Every slot taken (a request's call in flight): the job waits, each try taking and giving back a request of
    the streams' share (6 tries took all 5 of it, and the job then waited for the window, a minute); once the slot
    is free, it is asked and spends one."""
    with K2StandIn() as k2:
        esc, events, pub = _setup(tmp_path, k2, requests_per_minute=10, stream_share=0.5, concurrency=1)
        body = _event(events, EscalationRule(on="line_cross", prompt="what {label}?"), esc, image=False)
        budget = esc.bridge.budget
        assert esc.bridge.slots.acquire(timeout=1)  # the one slot: a request's call
        for _ in range(6):  # each waits 0.5 s for the slot
            (job,) = esc.jobs.due(1e12, set())
            assert esc.run(job) is None
        assert "cloud calls are in flight" in esc.jobs.get(body["event_id"])["last_error"]
        assert budget.remaining() == 10 and budget.share_resets_in_s(0.5) == 0 and k2.chat_requests == []
        esc.bridge.slots.release()
        (job,) = esc.jobs.due(1e12, set())
        assert esc.run(job) == "described" and budget.remaining() == 9 and len(_follow_ups(pub)) == 1


def test_a_job_whose_event_was_never_stored_is_dropped_at_start_and_the_queue_is_bounded(tmp_path, monkeypatch):
    """The job is written first; a crash before its event was stored leaves an orphan, dropped at the next start.
    Past MAX_WAITING jobs an event goes out marked skipped, counted."""
    import k2edge.service.stream_escalation as se

    with K2StandIn() as k2:
        esc, events, pub = _setup(tmp_path, k2)
        rule = EscalationRule(on="line_cross")
        body = event_payload("cam", {"event": "line_cross", "track_id": 1, "label": "x", "box": [0, 0, 5, 5]}, 1)
        esc.submit("cam", body, (select([rule], body, None), [], None))
        esc.start()
        esc.stop(1.0)
        assert esc.jobs.get(body["event_id"])["outcome"] == "orphan" and k2.chat_requests == []
        monkeypatch.setattr(se, "MAX_WAITING", 1)
        kept = _event(events, rule, esc)
        extra = event_payload("cam", {"event": "line_cross", "track_id": 2, "label": "x", "box": [0, 0, 5, 5]}, 1)
        assert not esc.submit("cam", extra, (select([rule], extra, None), [], None))
        assert extra["escalation"]["skipped"] and kept["escalation"]["follow_up"]
        assert esc.status("cam") == {"waiting": 1, "described": 0, "failed": 0, "skipped": 1}


def test_finished_jobs_are_pruned_to_the_newest_and_waiting_ones_never(tmp_path, monkeypatch):
    """A device escalating for months keeps a bounded job file: finished jobs beyond KEEP_DONE go, waiting ones stay."""
    import k2edge.service.stream_escalation as se
    from k2edge.service.stream_escalation import Job

    monkeypatch.setattr(se, "KEEP_DONE", 5)
    jobs = EscalationJobs(tmp_path / "jobs.sqlite3")
    for i in range(1003):  # e0, e1 and e1002 stay waiting; 1,000 finished trigger one prune
        assert jobs.put(Job(f"e{i}", "cam", {"prompt": "p"}, [], 0.0, 0))
        if 2 <= i < 1002:
            jobs.done(f"e{i}", "described")
    assert jobs.waiting_ids() == ["e0", "e1", "e1002"]
    kept = [i for i in range(1003) if jobs.get(f"e{i}") is not None]
    assert kept == [0, 1, *range(996, 1003)], kept  # the newest finished (6: KEEP_DONE past the newest) and the waiting
    jobs.close()


def test_a_stream_raises_track_end_with_its_scores_and_selects_events_with_their_crops():
    """With rules, a confirmed track's end is an event with its frames, mean and best score; the line crossing and
    the track's end fall under their rules, with the crop of the event's box, or the track's kept crops (the best
    first) once the track is gone; a stream without rules raises no track_end."""
    import time

    from k2edge.streams.reader import Frame, StreamReader
    from k2edge.streams.source import parse_source
    from k2edge.streams.stream import Stream, StreamFrame

    class Quiet:
        def on_frame(self, r): pass

        def on_state(self, r, *a): pass

    rules = [EscalationRule(on="line_cross", line="door"),
             EscalationRule(on="track_end", when="low_confidence", threshold=0.7, images="track", count=3)]

    def run(stream_rules):
        s = Stream("cam", "boxes", StreamReader("cam", parse_source("file:///nowhere.mp4"), Quiet()), [],
                   [("door", (160, 0), (160, 240))], max_lost_s=0.3, rules=stream_rules)
        t0, out = time.monotonic() - 50, []
        scores = [0.65, 0.6, 0.9, 0.6, 0.62, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]
        for i in range(len(scores) + 10):
            img = np.full((240, 320, 3), i, np.uint8)
            x = 130 + 4 * i
            dets = [{"index": 1, "label": "7", "score": scores[i], "box": [x, 80.0, x + 20, 100.0]}] if i < len(scores) else []
            out.append(s.track(StreamFrame(s, Frame(i, i / 15, time.time(), t0 + i / 15, t0 + i / 15, img), time.monotonic()), dets))
        return out

    tracked = run(rules)
    events = [(e, t.escalations.get(i)) for t in tracked for i, e in enumerate(t.events)]
    (cross, sel_c), = [(e, s) for e, s in events if e["event"] == "line_cross"]
    (end, sel_e), = [(e, s) for e, s in events if e["event"] == "track_end"]
    assert sel_c[0].index == 0 and len(sel_c[1]) == 1 and sel_c[1][0].shape == (24, 24, 3)
    assert end["frames"] >= 10 and end["best_score"] == 0.9 and end["mean_score"] < 0.7 and end["label"] == "7"
    assert end["box"] is not None and end["best_frame"] == 2
    sel, crops, stats = sel_e
    assert sel.index == 1 and "mean score" in sel.reason and stats.best == 0.9
    assert 2 <= len(crops) <= 3 and int(crops[0][0, 0, 0]) == 2  # the best crop first: cut from frame 2
    assert not any(e["event"] == "track_end" for t in run(()) for e in t.events)


def test_the_end_of_a_file_ends_the_tracks_still_in_view_and_the_rules_judge_them():
    """A file read to its end with an object still in view: Stream.end_of_file ends its track at the last frame, with
    its zone leave and its track_end (the rule selects it, with the track's kept crops), the zone's count goes back to
    nothing inside, and a second call ends nothing."""
    import time

    from k2edge.streams.reader import Frame, StreamReader
    from k2edge.streams.source import parse_source
    from k2edge.streams.stream import Stream, StreamFrame

    class Quiet:
        def on_frame(self, r): pass

        def on_state(self, r, *a): pass

    rule = EscalationRule(on="track_end", when="low_confidence", threshold=0.7, images="track", count=2)
    s = Stream("cam", "boxes", StreamReader("cam", parse_source("file:///nowhere.mp4"), Quiet()),
               [("all", [(0, 0), (320, 0), (320, 240), (0, 240)])], [], max_lost_s=0.3, rules=[rule])
    t0 = time.monotonic() - 50
    for i in range(12):
        img = np.full((240, 320, 3), i, np.uint8)
        dets = [{"index": 1, "label": "7", "score": 0.6, "box": [100.0 + i, 80.0, 120.0 + i, 100.0]}]
        tracked = s.track(StreamFrame(s, Frame(i, i / 15, time.time(), t0 + i / 15, t0 + i / 15, img), time.monotonic()), dets)
        assert not any(e["event"] in ("zone_leave", "track_end") for e in tracked.events)
    assert s.analytics.counts()["zones"]["all"]["inside"] == {"7": 1}
    end = s.end_of_file()
    assert [e["event"] for e in end.events] == ["zone_leave", "track_end"], end.events
    assert all(e["frame"] == 11 and e["reason"] == "the file ended: every track ended" for e in end.events)
    (pos, (sel, crops, stats)), = end.escalations.items()
    assert end.events[pos]["event"] == "track_end" and sel.rule is rule and stats.frames == 12 and len(crops) >= 1
    assert s.analytics.counts()["zones"]["all"]["inside"] == {}
    assert s.end_of_file().events == []
