"""The thermal limit of a stream without the daemon: what each state allows, the gate that keeps it on
a frame clock without drifting, the pause and resume events, the warm_fps / hot_fps config, and a real
reader shedding frames of a real video."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from k2edge.config.schema import ConfigError, load_config
from k2edge.streams.reader import StreamReader
from k2edge.streams.source import parse_source
from k2edge.streams.stream import Stream
from k2edge.streams.throttle import SKIP_WINDOW_S, FrameGate, NonrefSkip, limit_events, stream_limit


# what each state allows --------------------------------------------------------------------------
def test_each_state_limits_a_15_fps_stream_by_default():
    """normal: its own rate; warm: half; hot: a quarter; critical: paused; unknown: not throttled."""
    normal, warm, hot, critical, unknown = (stream_limit(s, 15.0, cause="tj 80.0 °C") for s in
                                            ("normal", "warm", "hot", "critical", "unknown"))
    assert (normal.max_fps, normal.throttled, normal.gate_fps) == (15.0, False, None)
    assert (warm.max_fps, warm.throttled, warm.gate_fps) == (7.5, True, 7.5) and "half its rate" in warm.reason
    assert (hot.max_fps, hot.gate_fps) == (3.75, 3.75) and "a quarter" in hot.reason
    assert critical.paused and critical.max_fps == 0 and critical.gate_fps == 0 and "paused" in critical.reason
    assert (unknown.max_fps, unknown.throttled) == (15.0, False) and "not throttled" in unknown.reason
    assert not any(x.paused for x in (normal, warm, hot, unknown))
    assert all("tj 80.0 °C" in x.reason for x in (normal, warm, hot, critical, unknown))
    assert hot.to_dict() == {"thermal_state": "hot", "max_fps": 3.75, "throttled": True, "reason": hot.reason}


def test_configured_limits_hot_at_least_1_fps_never_above_warm_or_the_rate():
    assert stream_limit("warm", 30.0, warm_fps=10.0).max_fps == 10.0
    assert stream_limit("hot", 30.0, warm_fps=10.0, hot_fps=2.0).max_fps == 2.0
    assert stream_limit("hot", 2.0).max_fps == 1.0  # a quarter of 2 fps is below 1 fps: 1
    slow = stream_limit("hot", 0.5)  # at least 1 fps, but never faster than warm (half of 0.5 fps)
    assert (slow.max_fps, slow.throttled) == (0.25, True) and "never faster than warm" in slow.reason
    own = stream_limit("hot", 0.5, warm_fps=0.5)  # 1 fps, capped at warm: its own rate
    assert (own.max_fps, own.throttled) == (0.5, False)
    capped = stream_limit("hot", 30.0, warm_fps=5.0)  # a quarter (7.5) would be faster than warm
    assert capped.max_fps == 5.0 and "never faster than warm" in capped.reason
    above = stream_limit("warm", 10.0, warm_fps=20.0)  # a warm_fps above a source's own rate: its rate
    assert (above.max_fps, above.throttled) == (10.0, False)


def test_a_stream_of_unknown_rate_is_throttled_only_by_explicit_limits():
    assert stream_limit("warm", None).gate_fps is None and "set fps or warm_fps" in stream_limit("warm", None).reason
    assert stream_limit("hot", None).gate_fps is None and "hot_fps" in stream_limit("hot", None).reason
    assert stream_limit("hot", None, warm_fps=6.0).max_fps == 6.0
    assert stream_limit("hot", None, hot_fps=2.0).max_fps == 2.0
    assert stream_limit("critical", None).paused
    with pytest.raises(ValueError, match="got 'tepid'"):
        stream_limit("tepid", 15.0)


# the gate -------------------------------------------------------------------------------------------
def _kept(gate: FrameGate, times) -> list[float]:
    return [t for t in times if gate.keep(t)]


@pytest.mark.parametrize("source_fps,max_fps", [(15, 7.5), (15, 3.75), (15, 4.0), (30, 7.0), (25, 1.0)])
def test_the_gate_keeps_max_fps_on_average_without_drifting(source_fps, max_fps):
    """A minute of frames on a faster grid: max_fps of them pass (within a frame), however the rates divide,
    and no two kept frames are closer than a period minus the quarter-period allowance."""
    times = [i / source_fps for i in range(60 * source_fps)]
    kept = _kept(FrameGate(max_fps), times)
    assert abs(len(kept) - 60 * max_fps) <= 1, len(kept)
    assert min(np.diff(kept)) >= 0.75 / max_fps - 1e-9


def test_the_gate_with_jittery_arrivals_still_keeps_its_rate():
    rng = random.Random(7)
    times = sorted(i / 30 + rng.uniform(-0.01, 0.01) for i in range(30 * 60))
    assert abs(len(_kept(FrameGate(5.0), times)) - 300) <= 2


def test_the_gate_none_keeps_all_zero_keeps_none_and_a_clock_jump_restarts_it():
    times = [i / 15 for i in range(30)]
    assert _kept(FrameGate(None), times) == times and _kept(FrameGate(0), times) == []
    gate = FrameGate(5.0)
    first = _kept(gate, times)
    again = _kept(gate, times)  # a looping file: its pts start again at 0
    assert first == again == times[::3]
    assert gate.keep(10.0) and not gate.keep(10.0 + 1 / 15)
    gate.set(2.5)  # a new rate starts a new schedule at the next frame
    later = [10.0 + i / 15 for i in range(2, 32)]
    kept = _kept(gate, later)
    assert kept[0] == later[0] and len(kept) in (5, 6) and min(np.diff(kept)) >= 0.3  # 2 s at 2.5 fps
    with pytest.raises(ValueError):
        gate.set(-1)


# pause and resume ------------------------------------------------------------------------------------
def _window(skip: NonrefSkip, t: float, decoded: int, used: int) -> list:
    """``decoded`` frames over one window from ``t``, ``used`` of them taken; the settings it changed to."""
    changes = []
    for i in range(decoded):
        if i < used:
            skip.used()
        change = skip.decoded(t + i * SKIP_WINDOW_S / decoded)
        if change is not None:
            changes.append(change)
    return changes


def test_non_reference_frames_are_skipped_only_while_most_decoded_frames_go_unused():
    """A processing side that uses under a third of the frames decoded turns skipping on; while skipping, it stays
    on as long as frames still go unused, and goes off once nearly every frame decoded is used."""
    skip, t = NonrefSkip(), 100.0
    assert _window(skip, t, 15, 15) == [] and not skip.on  # every frame used: decode them all
    assert _window(skip, t + 1, 15, 6) == [] and not skip.on  # 40 % used: still above a third
    assert _window(skip, t + 2, 15, 4) == [] and not skip.on  # the window ends with the next frame
    assert _window(skip, t + 3, 10, 4) == [True] and skip.on  # 4 of 15 (27 %) judged: skipping
    assert _window(skip, t + 4, 10, 6) == [] and skip.on  # 60 % of the reference frames used: frames still go unused
    assert _window(skip, t + 5, 10, 10) == [] and skip.on
    assert _window(skip, t + 6, 10, 10) == [False] and not skip.on  # every one used: the side may take more
    assert _window(skip, t + 7, 15, 0) == [] and _window(skip, t + 8, 15, 0) == [True]  # paused: nothing used
    skip.reset()  # a new limit (resumed): every frame decoded from the next one, judged afresh
    assert not skip.on and _window(skip, t + 9, 15, 15) == [False] and _window(skip, t + 10, 15, 15) == []


def test_pausing_and_resuming_are_events_only_for_a_stream_that_is_there():
    cause = "tj 97.0 °C >= critical_c 95 °C"
    normal, warm, critical = (stream_limit(s, 15.0, cause=cause) for s in ("normal", "warm", "critical"))
    (paused,) = limit_events(warm, critical, "up")
    assert paused == {"event": "stream_paused", "reason": critical.reason} and "tj 97.0 °C" in paused["reason"]
    assert limit_events(normal, critical, "reconnecting") == [paused]  # the source is coming back: paused still
    assert limit_events(critical, normal, "up") == [{"event": "stream_up", "reason": normal.reason}]
    assert limit_events(critical, warm, "reconnecting") == []  # its reader says stream_up when the source is back
    assert limit_events(normal, critical, "ended") == limit_events(normal, critical, "down") == []
    assert limit_events(normal, warm, "up") == limit_events(critical, critical, "up") == []


def test_a_stream_follows_the_thermal_state_in_its_status():
    reader = StreamReader("cam", parse_source("file:///nowhere.mp4"), None, fps=12)  # never started
    stream = Stream("cam", "boxes", reader, hot_fps=2.0)
    assert stream.status()["limit"]["thermal_state"] == "unknown" and stream.status()["limit"]["max_fps"] == 12
    before = time.time()
    assert stream.set_thermal("warm", "tj 80 °C") == [] and stream.limit.max_fps == 6.0
    since = stream.status()["limit"]["since"]  # when the reader's gate took the new limit
    assert before <= since <= time.time()
    stream.set_thermal("warm", "tj 81 °C")  # the same limit again: it has been in effect since then
    assert stream.status()["limit"]["since"] == since
    assert stream.set_thermal("hot") == [] and stream.limit.max_fps == 2.0
    events = stream.set_thermal("critical", "tj 99 °C")
    assert [e["event"] for e in events] == ["stream_paused"] and stream.paused  # the reader is starting: not over
    st = stream.status()
    assert st["state"] == "starting" and st["limit"]["max_fps"] == 0 and st["shed"] == 0
    reader.state = "up"
    assert stream.status()["state"] == "paused"
    assert [e["event"] for e in stream.set_thermal("normal")] == ["stream_up"] and stream.status()["state"] == "up"


def test_a_source_back_at_the_instant_a_pause_ends_is_announced_up_once():
    """The reader (its source back: state up, then its listener) and the thermal sampler (the pause ends) race: the
    stream is announced up once, whichever thread sees it first, and again only after it went down or paused."""
    import threading

    for reader_first in (True, False):
        reader = StreamReader("cam", parse_source("file:///nowhere.mp4"), None, fps=12)  # never started
        stream = Stream("cam", "boxes", reader)
        stream.announced(stream.set_thermal("critical", "tj 99 °C"))
        reader.state = "up"  # the reader sets its state before it tells its listener
        reader_says = [{"event": "stream_up"}]
        if reader_first:  # the reader's listener ran while paused, then the pause ended
            published = stream.announced(reader_says) + stream.announced(stream.set_thermal("normal"))
        else:  # the pause ended first (the sampler saw the reader up), then the reader's listener ran
            published = stream.announced(stream.set_thermal("normal")) + stream.announced(reader_says)
        assert [e["event"] for e in published] == ["stream_up"], (reader_first, published)
        assert stream.announced([{"event": "stream_up"}]) == []  # up already
        assert [e["event"] for e in stream.announced([{"event": "stream_down"}, {"event": "stream_up"}])] == \
            ["stream_down", "stream_up"]

    # the two threads at once, many times: never two stream_ups, never none
    for _ in range(200):
        reader = StreamReader("cam", parse_source("file:///nowhere.mp4"), None, fps=12)
        stream = Stream("cam", "boxes", reader)
        stream.announced(stream.set_thermal("critical"))
        reader.state = "up"
        published, go = [], threading.Barrier(2)

        def sampler():
            go.wait()
            published.extend(stream.announced(stream.set_thermal("normal")))

        def listener():
            go.wait()
            published.extend(stream.announced([{"event": "stream_up"}]))

        threads = [threading.Thread(target=f) for f in (sampler, listener)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [e["event"] for e in published] == ["stream_up"], published


# the config -------------------------------------------------------------------------------------------
def test_warm_and_hot_fps_are_validated_with_field_paths(tmp_path):
    base = 'device_id = "t"\n[[models]]\nname = "boxes"\nonnx = "m.onnx"\n[[streams]]\nname = "a"\n' \
           'source = "file:///x.mp4"\nmodel = "boxes"\n'

    def load(extra: str):
        p = tmp_path / "k.toml"
        p.write_text(base + extra)
        return load_config(p)

    def error(extra: str) -> str:
        with pytest.raises(ConfigError) as e:
            load(extra)
        return str(e.value)

    ok = load("fps = 20\nwarm_fps = 8\nhot_fps = 2\n").streams[0]
    assert (ok.warm_fps, ok.hot_fps) == (8.0, 2.0) and load("").streams[0].warm_fps is None
    assert "streams.0.warm_fps: must be <= fps (10.0)" in error("fps = 10\nwarm_fps = 12\n")
    assert "streams.0.hot_fps: must be <= fps (10.0)" in error("fps = 10\nhot_fps = 11\n")
    assert "streams.0.hot_fps: must be <= warm_fps (5.0)" in error("warm_fps = 5\nhot_fps = 6\n")
    assert "streams.0.warm_fps" in error("warm_fps = 0\n") and "streams.0.hot_fps" in error("hot_fps = -1\n")


# a real reader -----------------------------------------------------------------------------------------
def test_a_reader_sheds_frames_above_its_limit_apart_from_its_fps_drops(tmp_path):
    """On a real 60 fps video played at its rate (a camera stand-in; pace "every" is slowed, not shed: see
    test_stream_sources): fps = 7.5 drops seven of each eight frames, a limit of 2.5 fps sheds two of each three
    left; a limit of 0 sheds every frame and the reader still reads to the end."""
    av = pytest.importorskip("av")
    path = tmp_path / "a.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=60)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.options = {"bf": "0"}  # no B-frames: nothing for the decoder to skip, every frame decoded
        for i in range(60):
            for p in s.encode(av.VideoFrame.from_ndarray(np.full((48, 64, 3), 4 * i, np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)

    class Listener:
        def on_state(self, *a):
            pass

        def on_frame(self, reader):
            pass

    def run(fps, limit):
        r = StreamReader("a", parse_source(path.as_uri()), Listener(), pace="realtime", fps=fps)
        r.limit(limit)
        r.start()
        got = []
        while r.state != "ended" or r.ready():
            f = r.take()
            if f is not None:
                got.append(f.index)
            else:
                time.sleep(0.002)
        return r, got

    r, got = run(7.5, 2.5)
    fps_gate, limit_gate = FrameGate(7.5), FrameGate(2.5)  # the gates' verdicts on the file's own timeline
    by_fps = [i for i in range(60) if fps_gate.keep(i / 60)]
    kept = [i for i in by_fps if limit_gate.keep(i / 60)]
    assert len(by_fps) == 8 and len(kept) == 3  # 7.5 and 2.5 of the 60 frames a second, for one second
    assert got == kept and (r.decoded, r.dropped, r.shed) == (60, 60 - len(by_fps), len(by_fps) - len(kept))
    r, got = run(None, 0)
    assert got == [] and (r.decoded, r.dropped, r.shed) == (60, 0, 60) and r.state == "ended"
