"""The stream tracker (ByteTrack) and the zone / line analytics on synthetic boxes, then the demo
detector + tracker on a rendered H.264 video scored with motmetrics against its ground truth."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from k2edge.streams.analytics import Analytics, Line, Zone, frame_warnings
from k2edge.streams.tracker import LABEL_WINDOW, RELABEL_GAP, UNTRACKED, ByteTracker, TrackState, box_iou

ROOT = Path(__file__).resolve().parents[1]


def _box(cx: float, cy: float, w: float = 20, h: float = 30) -> list[float]:
    return [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]


def _update(tracker: ByteTracker, *dets):
    """``dets``: (box, score, label) tuples."""
    boxes = np.array([d[0] for d in dets], dtype=np.float64).reshape(-1, 4)
    return tracker.update(boxes, np.array([d[1] for d in dets]), [d[2] for d in dets])


def _state(tid: int, x: float, y: float, label: str = "car", born: bool = False, confirmed: bool = True) -> TrackState:
    """A track whose anchor (bottom-centre) is at (x, y)."""
    return TrackState(id=tid, label=label, box=(x - 5, y - 10, x + 5, y), anchor=(x, y), score=0.9, born=born,
                      confirmed=confirmed)


# ----------------------------------------------------------------------------- tracker


def test_ids_start_at_one_and_are_never_reused():
    """Two objects get ids 1 and 2; after both end, an object at the same place gets id 3."""
    t = ByteTracker(max_lost_s=2.5 / 30)  # updates without a time are 1/30 s apart
    u = _update(t, (_box(50, 50), 0.9, "a"), (_box(150, 50), 0.8, "b"))
    assert u.ids.tolist() == [1, 2] and u.ids.dtype == np.int64
    assert [s.id for s in u.active] == [1, 2] and all(s.born for s in u.active)
    removed = []
    for _ in range(4):
        removed += _update(t).removed
    assert removed == [1, 2] and t.tracks == 0
    assert _update(t, (_box(50, 50), 0.9, "a")).ids.tolist() == [3]


def test_a_track_follows_and_is_born_once():
    """A moving box keeps its id; born is true on the first frame only; the anchor is the bottom-centre."""
    t = ByteTracker()
    for f in range(10):
        u = _update(t, (_box(20 + 6 * f, 40), 0.9, "a"))
        assert u.ids.tolist() == [1]
        (s,) = u.active
        assert s.born == (f == 0)
        x1, y1, x2, y2 = s.box
        assert s.anchor == ((x1 + x2) / 2, y2) and s.label == "a" and s.score == pytest.approx(0.9)


def test_a_lost_track_keeps_its_id_across_a_short_miss():
    """Missed for 5 frames while moving, found again where the Kalman filter expects it: same id, nothing removed."""
    t = ByteTracker(max_lost_s=10.5 / 30)
    for f in range(8):
        _update(t, (_box(20 + 5 * f, 60), 0.9, "a"))
    for f in range(8, 13):
        u = _update(t)
        assert u.active == [] and u.removed == []
    u = _update(t, (_box(20 + 5 * 13, 60), 0.9, "a"))
    assert u.ids.tolist() == [1] and not u.active[0].born


def test_a_track_keeps_its_id_across_dropped_frames():
    """Frames the daemon could not process (a cold engine, a busy device) never reach the tracker: an object
    moving 4 px a frame, 20 px wide, seen again 9 frames later is 36 px on. The filter predicts as many frame
    frames ahead as the update says were decoded since the last one (each frame, and a stream that always skips
    every other one), so it stays one track; one step ahead, its box would not overlap the prediction and a second
    track would start."""
    for every in (1, 2):  # the stream's pace: each frame, or every other one (an overloaded device)
        t = ByteTracker()
        frames = list(range(0, 20, every)) + list(range(28, 40, every))
        ids = [t.update(np.array([_box(20 + 4 * f, 60)]), np.array([0.9]), ["a"], t=f / 15,
                        frames=f - last).ids.tolist() for last, f in zip([0] + frames, frames)]
        assert ids == [[1]] * len(frames), (every, ids)


def test_a_stream_tells_its_tracker_the_frames_it_did_not_process():
    """The daemon's Stream passes the difference of its frames' indices: a box moving 4 px a frame, frames 10-17
    never processed (the reader kept only the newest), stays one track id."""
    import time

    from k2edge.streams.reader import Frame, StreamReader
    from k2edge.streams.source import parse_source
    from k2edge.streams.stream import Stream, StreamFrame

    class Quiet:
        def on_frame(self, r): pass

        def on_state(self, r, *a): pass

    s = Stream("cam", "boxes", StreamReader("cam", parse_source("file:///nowhere.mp4"), Quiet()), max_lost_s=1.0)
    t0, ids = time.monotonic() - 50, set()
    for i in [*range(10), *range(18, 30)]:
        x = 20 + 4 * i
        frame = Frame(i, i / 15, time.time(), t0 + i / 15, t0 + i / 15, np.zeros((240, 320, 3), np.uint8))
        tracked = s.track(StreamFrame(s, frame, time.monotonic()),
                          [{"index": 1, "label": "7", "score": 0.9, "box": [x, 80.0, x + 20, 100.0]}])
        ids |= {d["track_id"] for d in tracked.detections}
    assert ids == {1}, ids


def test_frames_arriving_in_bursts_keep_one_track():
    """A 30 fps camera whose frames arrive four at a time (1 ms apart, then 130 ms: a network that stalls), timed by
    their arrival: the object, 2 px a frame, stays one track, as each is one frame after the last. (Predicting by
    the time elapsed, over the median spacing of the last updates, made the 130 ms gap 130 frames, and each burst
    a new track.)"""
    t = ByteTracker()
    times = [b * 0.133 + k * 0.001 for b in range(10) for k in range(4)]
    ids = [t.update(np.array([_box(20 + 2 * f, 60)]), np.array([0.9]), ["a"], t=at, frames=1).ids.tolist()
           for f, at in enumerate(times)]
    assert ids == [[1]] * len(times), ids


def test_a_lost_track_ends_after_max_lost_seconds_whatever_the_frame_rate():
    """max_lost_s is time: at 10 updates a second a track unseen for 0.3 s ends on the 4th missed
    update; at 1 update a second, on the 1st; an update without a time is 1/30 s after the last."""
    for step, want in ((0.1, [[], [], [], [1]]), (1.0, [[1], [], [], []])):
        t = ByteTracker(max_lost_s=0.35)
        t.update(np.array([_box(50, 50)]), np.array([0.9]), ["a"], t=0.0)
        t.update(np.array([_box(50, 50)]), np.array([0.9]), ["a"], t=step)
        assert [t.update(np.zeros((0, 4)), np.zeros(0), [], t=step * (k + 2)).removed for k in range(4)] == want
    t = ByteTracker(max_lost_s=3.5 / 30)
    _update(t, (_box(50, 50), 0.9, "a"))
    _update(t, (_box(50, 50), 0.9, "a"))
    assert [_update(t).removed for _ in range(4)] == [[], [], [], [1]]


def test_a_tentative_track_that_misses_ends_at_once():
    """A track born after the first frame and not seen the next frame is dropped (ByteTrack's unconfirmed)."""
    t = ByteTracker()
    _update(t, (_box(50, 50), 0.9, "a"))
    u = _update(t, (_box(50, 50), 0.9, "a"), (_box(200, 50), 0.9, "b"))
    assert u.ids.tolist() == [1, 2]
    assert _update(t, (_box(50, 50), 0.9, "a")).removed == [2]


def test_a_low_score_detection_continues_a_track_but_starts_none():
    """Second stage: a 0.3 detection keeps a tracked object; alone it starts nothing (below new_track)."""
    t = ByteTracker()
    _update(t, (_box(50, 50), 0.9, "a"))
    u = _update(t, (_box(53, 50), 0.3, "a"), (_box(200, 80), 0.3, "b"))
    assert u.ids.tolist() == [1, UNTRACKED] and [s.id for s in u.active] == [1]
    t2 = ByteTracker(new_track=0.25)  # the daemon passes the card's score threshold: every detection gets an id
    assert _update(t2, (_box(200, 80), 0.3, "b")).ids.tolist() == [1]
    assert _update(ByteTracker(), (_box(200, 80), 0.05, "b")).ids.tolist() == [UNTRACKED]  # below low


def test_one_object_is_one_track_under_two_labels():
    """The same digit found as 1 and as 7 (IoU >= 0.7): both rows get one id, one track, one active state."""
    t = ByteTracker(new_track=0.25)
    a, b = _box(50, 50), [v + 1 for v in _box(50, 50)]
    assert box_iou(np.array([a]), np.array([b]))[0, 0] >= 0.7
    u = _update(t, (a, 0.8, "1"), (b, 0.4, "7"))
    assert u.ids.tolist() == [1, 1] and t.tracks == 1 and len(u.active) == 1 and u.active[0].label == "1"
    u = _update(t, (b, 0.45, "7"), (a, 0.85, "1"))  # later, and in either order
    assert u.ids.tolist() == [1, 1] and t.tracks == 1


def test_the_label_is_the_most_frequent_ties_to_the_most_recent():
    t = ByteTracker()
    seen = []
    for label in ["6", "5", "5", "6", "6", "5"]:
        seen.append(_update(t, (_box(50, 50), 0.9, label)).active[0].label)
    assert seen == ["6", "5", "5", "6", "6", "5"]  # 1:0, 1:1 tie, 1:2, 2:2 tie, 3:2, 3:3 tie


def test_the_label_is_over_the_last_detections_not_the_whole_life():
    """Twenty detections as "7", then six as "5" on the same track: the label is "5" (window of 10)."""
    t = ByteTracker()
    for _ in range(20):
        _update(t, (_box(50, 50), 0.9, "7"))
    seen = [_update(t, (_box(50, 50), 0.9, "5")).active[0].label for _ in range(6)]
    assert LABEL_WINDOW == 10 and seen == ["7"] * 4 + ["5"] * 2  # 5 of 10 is a tie, to the most recent


def test_a_track_lost_a_while_is_found_again_only_under_a_recent_label():
    """Missed for RELABEL_GAP updates, a "7" is not continued by a "5" where it was (that starts track 2),
    but is by a "7"; missed once, a "5" continues it (two digits overlapping, the detector flickering)."""
    t = ByteTracker()
    for _ in range(5):
        _update(t, (_box(50, 50), 0.9, "7"))
    for _ in range(RELABEL_GAP):
        _update(t)
    assert _update(t, (_box(50, 50), 0.9, "5")).ids.tolist() == [2]
    assert _update(t, (_box(50, 50), 0.9, "5"), (_box(50, 50), 0.9, "7")).ids.tolist()[1] == 1
    t = ByteTracker()
    for _ in range(5):
        _update(t, (_box(50, 50), 0.9, "7"))
    _update(t)
    assert _update(t, (_box(50, 50), 0.9, "5")).ids.tolist() == [1]


def test_a_tentative_track_is_not_confirmed_until_its_second_detection():
    t = ByteTracker()
    assert _update(t, (_box(50, 50), 0.9, "a")).active[0].confirmed  # the first update: confirmed at once
    u = _update(t, (_box(50, 50), 0.9, "a"), (_box(200, 50), 0.9, "b"))
    assert [s.confirmed for s in u.active] == [True, False]
    u = _update(t, (_box(50, 50), 0.9, "a"), (_box(200, 50), 0.9, "b"))
    assert [s.confirmed for s in u.active] == [True, True]


def test_crossing_objects_keep_their_ids():
    """Two boxes crossing each other at constant speed (overlapping for a few frames) keep their ids."""
    t = ByteTracker()
    for f in range(30):
        u = _update(t, (_box(20 + 6 * f, 50), 0.9, "a"), (_box(200 - 6 * f, 56), 0.85, "b"))
        assert u.ids.tolist() == [1, 2], f


def test_update_checks_shapes_and_the_constructor_its_values():
    t = ByteTracker()
    with pytest.raises(ValueError, match="as many"):
        t.update(np.zeros((2, 4)), np.zeros(1), ["a", "b"])
    assert _update(t).ids.shape == (0,)
    for kw in ({"low": 0.6, "high": 0.5}, {"high": 1.5}, {"max_lost_s": -1}, {"match_iou": 0.0}):
        with pytest.raises(ValueError):
            ByteTracker(**kw)


def test_without_scipy_the_tracker_says_what_to_install():
    """The module imports without scipy; the first association names the extra to install."""
    code = """
import sys
sys.modules["scipy"] = None
import numpy as np
from k2edge.errors import BackendUnavailable
from k2edge.streams.tracker import ByteTracker
t = ByteTracker()
t.update(np.array([[0, 0, 10, 10]]), np.array([0.9]), ["a"])
try:
    t.update(np.array([[0, 0, 10, 10]]), np.array([0.9]), ["a"])
except BackendUnavailable as exc:
    print(exc)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and "pip install 'k2edge[streams]'" in proc.stdout, proc.stderr


# ----------------------------------------------------------------------------- analytics


DOOR = Line("door", (100, 0), (100, 200))  # vertical; c = 200 * (100 - x): > 0 left of it, < 0 right


def _walk(analytics: Analytics, xs, y: float = 50, tid: int = 1, label: str = "car") -> list[list[dict]]:
    return [analytics.update([_state(tid, x, y, label, born=(i == 0))]) for i, x in enumerate(xs)]


def test_crossing_in_and_out():
    """Right -> left is c negative -> positive: "in"; left -> right is "out"; one event per crossing."""
    a = Analytics(lines=[DOOR])
    events = _walk(a, [130, 110, 90, 70])
    assert events == [[], [], [{"event": "line_cross", "track_id": 1, "label": "car", "line": "door",
                                "direction": "in"}], []]
    events = sum(_walk(a, [70, 95, 105], tid=2, label="bus"), [])
    assert [(e["track_id"], e["direction"]) for e in events] == [(2, "out")]
    assert a.counts()["lines"] == {"door": {"in": {"car": 1}, "out": {"bus": 1}}}


def test_touching_the_line_is_not_a_crossing_and_touching_through_is_one():
    """c == 0 keeps the side the track came from: 110 -> 100 -> 110 is nothing, 110 -> 100 -> 90 one "in"."""
    a = Analytics(lines=[DOOR])
    assert sum(_walk(a, [110, 100, 110, 100, 110]), []) == []
    events = _walk(a, [110, 100, 90], tid=2)
    assert events[1] == [] and [e["direction"] for e in events[2]] == ["in"]
    events = sum(_walk(a, [100, 90, 110], tid=3), [])  # born on the line: its side is its first off it
    assert [e["direction"] for e in events] == ["out"]


def test_jitter_across_the_line_gives_alternating_crossings():
    a = Analytics(lines=[DOOR])
    events = sum(_walk(a, [103, 97, 103, 97]), [])
    assert [e["direction"] for e in events] == ["in", "out", "in"]


def test_passing_beyond_the_end_of_a_line_is_no_crossing():
    """The anchor changes side of the line's extension below its end (y 250 > 200): no event, and the
    side is updated, so coming back across the segment itself counts once."""
    a = Analytics(lines=[DOOR])
    assert sum(_walk(a, [130, 70], y=250), []) == []
    assert [e["direction"] for e in a.update([_state(1, 130, 50)])] == ["out"]


def test_a_path_through_a_line_end_point_counts():
    a = Analytics(lines=[Line("l", (0, 0), (10, 10))])
    a.update([_state(1, 12, 8)])
    assert [e["direction"] for e in a.update([_state(1, 8, 12)])] == ["in"]  # through (10, 10) exactly


def test_a_lost_track_crosses_along_its_path_since_its_last_position():
    """Seen at x 130, lost for a few updates, found at x 70: one crossing when found."""
    a = Analytics(lines=[DOOR])
    a.update([_state(1, 130, 50, born=True)])
    assert a.update([]) == [] and a.update([]) == []
    assert [e["direction"] for e in a.update([_state(1, 70, 50)])] == ["in"]


SQUARE = Zone("dock", [(0, 0), (100, 0), (100, 100), (0, 100)])


def test_zone_enter_and_leave_with_counts():
    a = Analytics(zones=[SQUARE])
    events = _walk(a, [150, 120, 80, 60, 130])
    assert [[e["event"] for e in ev] for ev in events] == [[], [], ["zone_enter"], [], ["zone_leave"]]
    assert events[2] == [{"event": "zone_enter", "track_id": 1, "label": "car", "zone": "dock"}]
    assert a.counts()["zones"] == {"dock": {"inside": {}, "entered": {"car": 1}}}


def test_born_inside_enters_and_removed_inside_leaves():
    a = Analytics(zones=[SQUARE])
    assert a.update([_state(7, 50, 50, "van", born=True), _state(3, 500, 50, born=True)]) == [
        {"event": "zone_enter", "track_id": 7, "label": "van", "zone": "dock"}]
    assert a.counts()["zones"]["dock"] == {"inside": {"van": 1}, "entered": {"van": 1}}
    assert a.update([], removed=[3, 7]) == [{"event": "zone_leave", "track_id": 7, "label": "van", "zone": "dock"}]
    assert a.counts()["zones"]["dock"] == {"inside": {}, "entered": {"van": 1}}
    assert a.update([], removed=[7]) == []  # removed twice, or never seen: nothing


def test_a_tentative_track_raises_nothing_until_confirmed():
    """Born inside a zone but tentative: no zone_enter; a tentative one that ends: no zone_leave; once
    confirmed inside, it enters; a tentative track crossing a line counts nothing."""
    a = Analytics(zones=[SQUARE], lines=[DOOR])
    assert a.update([_state(4, 50, 50, born=True, confirmed=False)]) == []
    assert a.update([], removed=[4]) == [] and a.counts()["zones"]["dock"]["entered"] == {}
    assert a.update([_state(5, 50, 50, born=True, confirmed=False)]) == []
    assert [e["event"] for e in a.update([_state(5, 60, 50)])] == ["zone_enter"]
    assert a.update([_state(6, 130, 50, born=True, confirmed=False)]) == []
    assert a.update([_state(6, 70, 150, confirmed=False)]) == [] and a.counts()["lines"]["door"]["in"] == {}


def test_a_self_intersecting_zone_is_refused_naming_its_edges():
    with pytest.raises(ValueError, match=r"intersects itself: edge \[0.0, 0.0\]-\[10.0, 10.0\] meets edge"):
        Zone("bowtie", [(0, 0), (10, 10), (10, 0), (0, 10)])
    with pytest.raises(ValueError, match="intersects itself"):
        Zone("fold", [(0, 0), (10, 0), (5, 0), (5, 5)])  # an edge folding back onto the one before
    with pytest.raises(ValueError, match=r"repeats the point \[10.0, 0.0\] \(an edge of no length\)"):
        Zone("repeat", [(0, 0), (10, 0), (10, 0), (0, 10)])  # said as such, not as two edges meeting
    assert len(Zone("closed", [(0, 0), (10, 0), (0, 10), (0, 0)]).points) == 3  # the first point again at the end
    Zone("concave", [(0, 0), (10, 0), (10, 10), (5, 3), (0, 10)])  # concave is fine


def test_zones_and_lines_outside_the_frame_are_warnings():
    """A zone drawn for 1080p on a 640x480 frame can never fire; one partly outside is a milder warning."""
    far = Zone("far", [(1000, 1000), (1900, 1000), (1900, 1080), (1000, 1080)])
    part = Zone("part", [(600, 400), (700, 400), (700, 470), (600, 470)])
    inside = Zone("in", [(0, 0), (640, 0), (640, 480)])
    lines = [Line("gone", (700, 0), (700, 480)), Line("across", (-10, 240), (650, 240)), Line("ok", (0, 0), (10, 10))]
    got = frame_warnings([far, part, inside], lines, 640, 480)
    assert len(got) == 4
    assert got[0].startswith("zone 'far' lies wholly outside the 640x480 frame ([1000, 1000], [1900, 1000], [1900, 1080], "
                             "[1000, 1080]): it can never fire")
    assert got[1].startswith("zone 'part' has points outside the 640x480 frame ([700, 400], [700, 470])")
    assert got[2].startswith("line 'gone' lies wholly outside") and got[3].startswith("line 'across' has points outside")
    assert frame_warnings([inside], lines[2:], 640, 480) == []


def test_events_come_in_a_stable_order():
    """By track id; per track zones (in order) then lines (in order); then the removed tracks' leaves."""
    a = Analytics(zones=[Zone("b", [(0, 0), (200, 0), (200, 200), (0, 200)]), SQUARE], lines=[DOOR])
    a.update([_state(5, 300, 50), _state(2, 150, 50), _state(9, 50, 50)])
    events = a.update([_state(9, 50, 60), _state(5, 300, 50), _state(2, 50, 50)], removed=[9])
    assert [(e["track_id"], e["event"], e.get("zone") or e.get("line")) for e in events] == [
        (2, "zone_enter", "dock"), (2, "line_cross", "door"), (9, "zone_leave", "b"), (9, "zone_leave", "dock")]


def test_inside_counts_follow_the_current_label():
    a = Analytics(zones=[SQUARE])
    a.update([_state(1, 50, 50, "6", born=True)])
    a.update([_state(1, 52, 50, "5")])
    assert a.counts()["zones"]["dock"] == {"inside": {"5": 1}, "entered": {"6": 1}}


def test_zone_and_line_validation():
    with pytest.raises(ValueError, match="at least 3 points"):
        Zone("z", [(0, 0), (1, 1)])
    with pytest.raises(ValueError, match="same point"):
        Line("l", (5, 5), (5, 5))
    with pytest.raises(ValueError, match=r"\[x, y\]"):
        Line("l", (5, 5), (1, 2, 3))
    with pytest.raises(ValueError, match="used twice"):
        Analytics(lines=[DOOR, DOOR])
    triangle = Zone("z", [[0, 0], [4, 0], [0, 4]])
    assert triangle.contains((1, 1)) and not triangle.contains((3, 3))


# ----------------------------------------------------------------------------- the detector on a video


def _detect(folder: Path, make_scenario):
    """A scenario's video, decoded with PyAV and run through the demo detector on the CPU:
    (scenario, per frame the boxes, scores and labels)."""
    pytest.importorskip("av")
    pytest.importorskip("scipy")
    from stream_videos import DETECTOR, read_frames

    from k2edge.engine.engine import Engine

    scenario = make_scenario(folder / "video.mp4")
    frames = []
    with Engine.build(DETECTOR / "model.onnx", "cpu-dev", cache_dir=folder / "cache") as engine:
        for image in read_frames(scenario.path):
            batch, geometries = engine.stage_mapped([image])
            dets = engine.answers(engine.infer({engine.input_name: batch}), 1, geometries)[0]["detections"]
            frames.append((np.array([d["box"] for d in dets], dtype=np.float64).reshape(-1, 4),
                           np.array([d["score"] for d in dets]), [d["label"] for d in dets]))
    assert len(frames) == len(scenario.truth.frames) == 90
    return scenario, frames


@pytest.fixture(scope="module")
def detected_video(tmp_path_factory):
    """The canonical crossing video through the demo detector."""
    from stream_videos import scenario_crossing

    return _detect(tmp_path_factory.mktemp("video"), scenario_crossing)


@pytest.fixture(scope="module")
def switch_video(tmp_path_factory):
    """The identity-switch video (a "5" appears where a "7" vanished) through the demo detector."""
    from stream_videos import scenario_identity_switch

    return _detect(tmp_path_factory.mktemp("switch"), scenario_identity_switch)


def _track_video(scenario, frames, **kw):
    """Run the tracker and analytics over the detections; motmetrics' accumulator, the events and
    the active states per frame."""
    import motmetrics as mm

    tracker, analytics = ByteTracker(**kw), Analytics(lines=[Line("door", *scenario.line)])
    acc = mm.MOTAccumulator(auto_id=True)
    events, states = [], []
    for f, ((boxes, scores, labels), truth) in enumerate(zip(frames, scenario.truth.frames)):
        u = tracker.update(boxes, scores, labels)
        events += [(f, e) for e in analytics.update(u.active, u.removed)]
        states.append(u.active)
        gt = np.array([b for _, _, b in truth]).reshape(-1, 4)
        iou = box_iou(gt, np.array([s.box for s in u.active]).reshape(-1, 4))
        # motmetrics' own iou_matrix breaks on numpy 2: the distance matrix is made here
        acc.update([oid for oid, _, _ in truth], [s.id for s in u.active], np.where(iou >= 0.5, 1 - iou, np.nan))
    return acc, events, states


# The measured figures (tests/support/stream_videos.py's crossing video, 5 digits, 90 frames, onnxruntime
# CPU): new_track 0.5 (the default) MOTA 0.981, IDF1 0.991, 0 ID switches; new_track 0.25 (the
# card's score threshold: every detection gets an id, so the low-score boxes of two overlapping
# digits start short tracks) MOTA 0.972, IDF1 0.959, 5 ID switches on 2026-12-05 (0.974, 0.894 and 3 earlier;
# before a lost track was found again only under a recent label: MOTA 0.958, IDF1 0.903, 6 switches). The floors
# leave a margin.
@pytest.mark.parametrize("new_track, floors", [(0.5, (0.93, 0.93, 2)), (0.25, (0.90, 0.85, 10))])
def test_tracking_quality_on_a_rendered_video(detected_video, new_track, floors):
    import motmetrics as mm

    scenario, frames = detected_video
    acc, _, _ = _track_video(scenario, frames, new_track=new_track)
    summary = mm.metrics.create().compute(acc, metrics=["mota", "idf1", "num_switches", "num_false_positives",
                                                        "num_misses"], name="video")
    mota, idf1, switches = (float(summary[k].iloc[0]) for k in ("mota", "idf1", "num_switches"))
    print(f"new_track {new_track}: MOTA {mota:.3f} IDF1 {idf1:.3f} ID switches {int(switches)} "
          f"FP {int(summary['num_false_positives'].iloc[0])} misses {int(summary['num_misses'].iloc[0])}")
    assert mota >= floors[0] and idf1 >= floors[1] and switches <= floors[2]


@pytest.mark.parametrize("new_track", [0.5, 0.25])
def test_crossings_from_the_detector_match_the_ground_truth(detected_video, new_track):
    """Each object crosses the line as often, in the same direction and within 2 frames of when the
    ground truth says; a track is attributed to the object its box overlaps most at the event."""
    scenario, frames = detected_video
    _, events, states = _track_video(scenario, frames, new_track=new_track)
    got = []
    for f, e in events:
        (box,) = [s.box for s in states[f] if s.id == e["track_id"]]
        truth = scenario.truth.frames[f]
        iou = box_iou(np.array([box]), np.array([b for _, _, b in truth]))[0]
        got.append((truth[int(np.argmax(iou))][0], e["direction"], f))
    want = [(c.object_id, c.direction, c.frame) for c in scenario.crossings]
    assert len(want) == 4 and sorted({c.direction for c in scenario.crossings}) == ["in", "out"]
    assert [g[:2] for g in sorted(got)] == [w[:2] for w in sorted(want)], (got, want)
    assert all(abs(g[2] - w[2]) <= 2 for g, w in zip(sorted(got), sorted(want))), (got, want)


@pytest.mark.parametrize("first", [10, 30, 40])
def test_every_object_keeps_one_id_across_eight_dropped_frames(detected_video, first):
    """The crossing video at its 15 fps with 8 frames not processed (as after a daemon's cold start): every
    ground-truth object is followed by one track id (judged on the 82 processed frames, each track box matched to
    the object it overlaps by IoU >= 0.5). Predicting one frame ahead split 2 or 3 of the 5 objects in each."""
    scenario, frames = detected_video
    fps = scenario.truth.fps
    tracker, ids, judged, last = ByteTracker(), {}, 0, None
    for f, (boxes, scores, labels) in enumerate(frames):
        if first <= f < first + 8:
            continue
        truth = scenario.truth.frames[f]
        since, last = (f - last if last is not None else None), f
        for s in tracker.update(boxes, scores, labels, t=f / fps, frames=since).active:
            iou = box_iou(np.array([s.box]), np.array([b for _, _, b in truth]).reshape(-1, 4))[0]
            if len(iou) and iou.max() >= 0.5:
                ids.setdefault(truth[int(np.argmax(iou))][0], set()).add(s.id)
                judged += 1
    assert len(ids) == 5 and judged >= 300, (ids, judged)
    assert all(len(v) == 1 for v in ids.values()), ids


def test_an_object_appearing_where_another_vanished_raises_events_under_its_own_label(switch_video):
    """The identity switch: a "5" appears where a "7" vanished 0.27 s before (max_lost_s 1). Every event
    carries the label of the object that caused it (the ground-truth object its track's box overlaps most
    at the event, or at its last sighting for a track that ended), and the line and zone counts equal the
    ground truth."""
    from stream_videos import SWITCH_ZONE, zone_entries

    scenario, frames = switch_video
    fps = scenario.truth.fps
    tracker = ByteTracker(max_lost_s=1.0)
    analytics = Analytics(zones=[Zone("left", SWITCH_ZONE)], lines=[Line("door", *scenario.line)])
    last_seen: dict[int, tuple[int, tuple]] = {}
    judged = []
    for f, (boxes, scores, labels) in enumerate(frames):
        u = tracker.update(boxes, scores, labels, t=f / fps)
        last_seen.update({s.id: (f, s.box) for s in u.active})
        for e in analytics.update(u.active, u.removed):
            seen_at, box = last_seen[e["track_id"]]
            truth = scenario.truth.frames[seen_at]
            iou = box_iou(np.array([box]), np.array([b for _, _, b in truth]))[0]
            judged.append((e["event"], e["label"], truth[int(np.argmax(iou))][1], f))
    assert judged and all(label == cause for _, label, cause, _ in judged), judged
    counts = analytics.counts()
    crossed = {d: dict(sorted(Counter(c.label for c in scenario.crossings if c.direction == d).items())) for d in ("in", "out")}
    assert crossed == {"in": {"7": 1}, "out": {"3": 1, "5": 1}}
    assert counts["lines"]["door"] == crossed
    assert counts["zones"]["left"]["entered"] == zone_entries(scenario.truth, SWITCH_ZONE) == {"3": 1, "5": 1, "7": 1}
    print(f"{len(judged)} events judged, each under the label of the object that caused it")
