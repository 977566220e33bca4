"""Streams under the thermal governor, in the daemon, against a real mosquitto: a recorded temperature trace
takes the device normal -> warm -> hot -> critical -> normal while a ``file://`` stream of the crossing video
plays at 15 fps through the demo detector. The processed rate follows each state from the status that
announces it (warm: half, hot: a quarter, critical: paused with ``stream_paused``, back with ``stream_up``),
the limit is in the status, the live view and /metrics, and every event goes out exactly once."""

from __future__ import annotations

import json
import sqlite3
import urllib.request

import pytest
from mqtt_support import ROOT, Client, free_port
from stream_videos import scenario_crossing

pytestmark = pytest.mark.slow
pytest.importorskip("av")

DETECTOR = ROOT / "models" / "detector"
BOXES = {"name": "boxes", "onnx": DETECTOR / "model.onnx", "profile": "cpu-dev"}
FPS = 15
INTERVAL_S = 0.2  # the thermal sampler's interval: one trace row each
# (state, temperature, seconds): soft_c 75, hard_c 85, critical_c 95 (the defaults); the first phase covers
# the stream's start, the last one lasts as long as the test needs (a trace's last row repeats)
PHASES = (("normal", 50.0, 5.0), ("warm", 80.0, 3.0), ("hot", 90.0, 3.0), ("critical", 97.0, 2.0),
          ("normal", 50.0, 1.0))
LIMITS = {"warm": FPS / 2, "hot": FPS / 4}  # the defaults: half, a quarter
MAX_FPS = {"normal": FPS, **LIMITS, "critical": 0.0}  # what the status and /metrics say


def _trace(path):
    rows, t = [], 0.0
    for _, temp, seconds in PHASES:
        for _ in range(round(seconds / INTERVAL_S)):
            rows.append(json.dumps({"t": round(t, 3), "temperatures_c": {"tj": temp}}))
            t += INTERVAL_S
    path.write_text("\n".join(rows) + "\n")
    return path


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def test_the_processed_rate_follows_the_thermal_state_and_nothing_is_lost(run_daemon, broker, tmp_path):
    """Each state's processed rate, measured on the frames decoded from one sampler interval after its limit took
    effect (the limit's ``since`` in the status that announced it): normal at the stream's rate, warm and hot at
    most their limits (and no two frames closer than the gate allows), critical none, normal again; stream_paused
    once with its reason, stream_up when it resumes; the status, the live view and k2edge_stream_max_fps say the
    limit; every event exactly once."""
    crossing = scenario_crossing(tmp_path / "crossing.mp4", fps=FPS)
    (x0, y0), (x1, y1) = crossing.line
    metrics_port, http_port = free_port(), free_port()
    client = Client(broker.port).connect()
    client.subscribe("k2edge/t1/streams/#")
    daemon = run_daemon(models=[BOXES], streams=[{
        "name": "cam", "source": crossing.path.as_uri(), "model": "boxes", "loop": True, "snapshots": False,
        "lines": [{"name": "door", "start": [x0, y0], "end": [x1, y1]}]}],
        tables={"thermal": {"source": "trace", "trace": _trace(tmp_path / "trace.jsonl"),
                            "sample_interval_ms": int(INTERVAL_S * 1000), "filter_samples": 1},
                "metrics": {"port": metrics_port}, "http": {"port": http_port}})

    def changes(c) -> list[tuple[str, float, dict]]:
        """(thermal state, the daemon's time, the stream's status) of each status that announced a new state."""
        out = []
        for s in c.statuses:
            cam = s.get("streams", {}).get("cam")
            if (cam is not None and s.get("state") == "online" and s["thermal"] != "unknown"  # before the first sample
                    and (not out or out[-1][0] != s["thermal"])):
                out.append((s["thermal"], s["time"], cam))
        return out

    def in_state(state: str, n: int = 1):
        return lambda c: [x[0] for x in changes(c)].count(state) >= n

    client.wait_for(in_state("hot"), 60)
    # the limit is in /metrics and in the live view's API while hot (republished at once, not at the next scrape)
    text = _get(f"http://127.0.0.1:{metrics_port}/metrics")
    assert 'k2edge_stream_max_fps{stream="cam"} 3.75' in text, [l for l in text.splitlines() if "max_fps" in l]
    api = json.loads(_get(f"http://127.0.0.1:{http_port}/api/streams"))["cam"]
    assert api["limit"]["thermal_state"] in ("hot", "critical") and "shed" in api
    client.wait_for(in_state("normal", 2), 60)
    resumed_at = changes(client)[-1][1]
    client.wait_for(lambda c: any(s["time"] > resumed_at + 2.0 for s in c.statuses), 30)  # two seconds back at normal
    assert daemon.terminate() == 0, daemon.output()
    # the broker acknowledged the offline status before the daemon exited; this client may receive it a moment later
    client.wait_state("offline", timeout=30)

    seen = changes(client)
    assert [s for s, _, _ in seen] == ["normal", "warm", "hot", "critical", "normal"], seen
    # each status that announced a state already carries the stream's limit for it (set before it was published)
    for state, _, cam in seen:
        # the source's rate is not known before it opens, and a stream is starting until its first frame
        own = cam["state"] == "starting" and state == "normal"
        want = (None, MAX_FPS[state]) if own else (MAX_FPS[state],)
        assert cam["limit"]["thermal_state"] == state and cam["limit"]["max_fps"] in want, cam
        assert state != "critical" or (cam["state"] == "paused" and "paused" in cam["limit"]["reason"])
    assert all(cam["limit"]["since"] <= t for _, t, cam in seen), seen  # in effect before it was announced
    frames = [m for t, m in client.other if t == "k2edge/t1/streams/cam/detections"]
    first = min(f["captured_at"] for f in frames)
    # a state's frames: from when its limit took effect (under the reader's lock, as each frame's captured_at), not
    # from its status, which goes out after the streams, the models and the stream_up event have followed it
    bounds = [max(cam["limit"]["since"], first) for _, _, cam in seen] + [max(f["captured_at"] for f in frames)]
    rates = {}
    for i, (state, _, _) in enumerate(seen):
        start, end = bounds[i] + INTERVAL_S, bounds[i + 1]
        phase = sorted((f for f in frames if start <= f["captured_at"] < end), key=lambda f: f["captured_at"])
        rates[f"{state}{i}"] = (len(phase), end - start)
        if state in LIMITS:  # the gate's own bound: no two frames closer than 3/4 of the limit's period (by pts)
            gaps = [b["pts"] - a["pts"] for a, b in zip(phase, phase[1:]) if b["pts"] > a["pts"]]
            assert gaps and min(gaps) >= 0.75 / LIMITS[state] - 1e-3, (state, gaps)
    print("processed fps by state:", {k: round(n / w, 2) for k, (n, w) in rates.items()},
          {k: f"{n} frames in {w:.2f} s" for k, (n, w) in rates.items()})
    normal = rates["normal0"][0] / rates["normal0"][1]
    assert normal > 1.25 * LIMITS["warm"], f"normal: {normal:.2f} fps, too slow here to tell warm's limit from the load"
    for key, limit in (("warm1", LIMITS["warm"]), ("hot2", LIMITS["hot"])):
        n, w = rates[key]
        # the gate keeps at most limit * w + 2 frames by pts in a window of w s (a schedule point per period, a
        # quarter period early at most); 10 % more for the reader's wall-clock lag against pts on a busy machine
        assert 0.75 * min(limit, normal) * w - 1 <= n <= 1.1 * limit * w + 2, (key, n, w, limit)
    n_critical = sum(1 for f in frames if bounds[3] <= f["captured_at"] < bounds[4])
    assert rates["critical3"][0] == 0 and n_critical == 0  # nothing decoded after the pause was processed
    n, w = rates["normal4"]
    assert n >= 0.75 * normal * w - 1, (n, w, normal)

    # events: stream_up, then the crossings, stream_paused (critical) once, stream_up when it resumed; exactly once
    events = [m for t, m in client.other if t == "k2edge/t1/streams/cam/events"]
    kinds = [e["event"] for e in events]
    assert kinds.count("stream_paused") == 1 and kinds.count("stream_up") == 2 and "stream_down" not in kinds, kinds
    paused = kinds.index("stream_paused")
    assert kinds.index("stream_up") < paused < len(kinds) - 1 - kinds[::-1].index("stream_up")
    assert "critical" in events[paused]["reason"] and "°C" in events[paused]["reason"]
    assert "line_cross" in kinds
    assert len({e["event_id"] for e in events}) == len(events)
    db = sqlite3.connect(f"file:{tmp_path / 'state-t1' / 'events.sqlite'}?mode=ro", uri=True)
    stored = db.execute("SELECT event_id, payload, delivered FROM events").fetchall()
    db.close()
    assert sorted(json.loads(p)["event_id"] for _, p, _ in stored) == sorted(e["event_id"] for e in events)
    assert all(d == 1 for _, _, d in stored)

    # every frame counted once: processed, dropped (overload) or shed (the limit); the final status is offline
    final = client.statuses[-1]
    assert final["state"] == "offline"
    cam = final["streams"]["cam"]
    assert cam["processed"] == len(frames) and cam["shed"] > 0
    assert cam["decoded"] - 1 <= cam["processed"] + cam["dropped"] + cam["shed"] <= cam["decoded"], cam
    print(f"decoded {cam['decoded']}, processed {cam['processed']}, dropped {cam['dropped']}, shed {cam['shed']}")
