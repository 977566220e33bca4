"""Stream sources without the daemon: URIs and their redaction, the [[streams]] config, and the
newest-frame reader on real videos made with PyAV (pacing, fps throttling, loops, ends, files that
cannot be read)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from k2edge.config.schema import ConfigError, load_config
from k2edge.streams.reader import StreamReader
from k2edge.streams.source import parse_source, redact

av = pytest.importorskip("av")


def _video(path, frames=30, fps=15, size=(64, 48), b_frames=False):
    """A plain H.264 clip whose frame i has grey level 4 * i mod 256 (so a decoded frame tells its index); ``b_frames``: with
    B-frames, one in three a non-reference frame."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = size[0], size[1], "yuv420p"
        s.options = {"crf": "20", "preset": "veryfast", "bf": "2"} if b_frames else {"crf": "0", "preset": "ultrafast", "g": "5"}
        for i in range(frames):
            img = np.full((size[1], size[0], 3), 4 * i % 256, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


class Recorder:
    """The reader's listener: every state change, and a wake-up per frame."""

    def __init__(self):
        self.states: list[tuple[str, str, str | None]] = []
        self.cond = threading.Condition()

    def on_state(self, reader, old, new, reason):
        with self.cond:
            self.states.append((old, new, reason))
            self.cond.notify_all()

    def on_frame(self, reader):
        with self.cond:
            self.cond.notify_all()

    def wait(self, predicate, timeout=30.0):
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), f"timed out; states {self.states}"


def _drain(reader: StreamReader, rec: Recorder, timeout=30.0) -> list:
    """Take every frame until the reader ends or is down."""
    got, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        f = reader.take()
        if f is not None:
            got.append(f)
            continue
        if reader.state in ("ended", "down") and not reader.ready():
            return got
        with rec.cond:
            rec.cond.wait(0.05)
    raise AssertionError(f"the reader did not end; state {reader.state}")


# URIs ----------------------------------------------------------------------------------------------
def test_source_uris_and_redaction():
    """Every scheme parses; credentials never show; malformed URIs are refused without the password."""
    s = parse_source("rtsp://admin:s3cret@10.0.0.5:8554/cam")
    assert s.kind == "rtsp" and s.live and "s3cret" in s.target
    assert s.shown == "rtsp://***@10.0.0.5:8554/cam" and "s3cret" not in repr(s) and str(s) == s.shown
    assert parse_source("rtsp://10.0.0.5/cam", password="p@ss:w/rd").target == "rtsp://:p%40ss%3Aw%2Frd@10.0.0.5/cam"
    assert parse_source("file:///data/a.mp4").target == "/data/a.mp4" and not parse_source("file:///data/a.mp4").live
    assert parse_source("v4l2:///dev/video1").target == "/dev/video1"
    assert parse_source("csi://0").kind == "csi"
    assert parse_source("gst:videotestsrc ! appsink name=sink").target.startswith("videotestsrc")
    for bad in ("http://x/y", "rtsp://user:hunter2@/path", "rtsp://u:hunter2@host:99999/x", "csi://front", "gst:", "/a.mp4"):
        with pytest.raises(ValueError) as e:
            parse_source(bad)
        assert "hunter2" not in str(e.value)
    assert redact("rtsp://u:p@h/x") == "rtsp://***@h/x" and redact("file:///a@b.mp4") == "file:///a@b.mp4"
    assert redact("rtsp://admin:pa/ss@10.0.0.1/s") == "rtsp://***@10.0.0.1/s"  # a "/" in the password too
    with pytest.raises(ValueError, match="percent-encode") as e:
        parse_source("rtsp://admin:hunter2/x@10.0.0.1/s")
    assert "hunter2" not in str(e.value)


def test_streams_config_errors_name_the_field(tmp_path):
    """[[streams]] is validated with field paths; a password in a bad source never reaches the message."""
    base = ('device_id = "t"\n[[models]]\nname = "boxes"\nonnx = "m.onnx"\n')

    def load(streams: str) -> str:
        p = tmp_path / "k.toml"
        p.write_text(base + streams)
        with pytest.raises(ConfigError) as e:
            load_config(p)
        return str(e.value)

    assert "streams.0.name" in load('[[streams]]\nname = "a/b"\nsource = "file:///x.mp4"\nmodel = "boxes"\n')
    msg = load('[[streams]]\nname = "a"\nsource = "rtsp://u:hunter2@/x"\nmodel = "boxes"\n')
    assert "streams.0.source" in msg and "hunter2" not in msg
    assert "streams.0.model: 'cats' is not a model served here" in load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "cats"\n')
    assert "streams.0.fps" in load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "boxes"\nfps = 0\n')
    assert "at least 3" in load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "boxes"\n'
                                '[[streams.zones]]\nname = "z"\npoints = [[0, 0], [1, 1]]\n')
    assert "same point" in load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "boxes"\n'
                                '[[streams.lines]]\nname = "l"\nstart = [1, 1]\nend = [1, 1]\n')
    assert "unique" in load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "boxes"\n' * 2)
    msg = load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "boxes"\n'
               '[[streams.zones]]\nname = "bow"\npoints = [[0, 0], [10, 10], [10, 0], [0, 10]]\n')
    assert "streams.0.zones.0" in msg and "intersects itself" in msg
    msg = load('[[streams]]\nname = "a"\nsource = "rtsp://10.0.0.5/cam"\nmodel = "boxes"\npace = "every"\n')
    assert "streams.0" in msg and 'pace = "every" is for file:// sources' in msg
    assert "streams.0.pace" in load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "boxes"\npace = "fast"\n')
    assert "streams.0.max_lost_s" in load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "boxes"\n'
                                          'max_lost_s = -1\n')
    # a point's coordinate is a number: TOML's true is not 1.0 there either
    msg = load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "boxes"\n'
               '[[streams.zones]]\nname = "z"\npoints = [[0, 0], [10, 0], [true, 10]]\n')
    assert msg.endswith("streams.0.zones.0.points.2.0: must be a number, not true"), msg  # one error: not also "not 2 items"
    msg = load('[[streams]]\nname = "a"\nsource = "file:///x.mp4"\nmodel = "boxes"\n'
               '[[streams.lines]]\nname = "l"\nstart = [0, false]\nend = [1, 1]\n')
    assert "streams.0.lines.0.start.1: must be a number, not false" in msg, msg


# the reader on files ---------------------------------------------------------------------------------
def test_every_frame_in_order_then_ended(tmp_path):
    """pace "every": each frame handed over in order with its index and pts; the end is "ended"."""
    path = _video(tmp_path / "a.mp4", frames=30, fps=15)
    rec = Recorder()
    r = StreamReader("a", parse_source(path.as_uri()), rec, pace="every")
    r.start()
    got = _drain(r, rec)
    assert [f.index for f in got] == list(range(30))
    assert [round(f.pts * 15) for f in got] == list(range(30))
    assert [int(f.image[0, 0, 0]) for f in got] == pytest.approx([4 * i for i in range(30)], abs=3)
    assert r.state == "ended" and r.dropped == 0 and r.decoded == 30 and r.source_fps == 15
    assert [s[1] for s in rec.states] == ["up", "ended"]


def test_fps_throttles_a_file_by_its_own_time(tmp_path):
    """fps = 5 on a 15 fps file keeps every third frame (by pts); the rest count as dropped."""
    path = _video(tmp_path / "a.mp4", frames=30, fps=15)
    rec = Recorder()
    r = StreamReader("a", parse_source(path.as_uri()), rec, pace="every", fps=5)
    r.start()
    got = _drain(r, rec)
    assert [f.index for f in got] == list(range(0, 30, 3))
    assert r.dropped == 20 and r.decoded == 30


def test_newest_frame_only_when_the_taker_is_slow(tmp_path):
    """pace "realtime": a file plays at its own rate; a taker that is slower than it gets the newest
    frame each time, never a backlog, and the rest are counted as dropped."""
    path = _video(tmp_path / "a.mp4", frames=45, fps=30)
    rec = Recorder()
    r = StreamReader("a", parse_source(path.as_uri()), rec, pace="realtime")
    r.start()
    got, started = [], time.monotonic()
    while r.state not in ("ended", "down") or r.ready():
        newest = r.last_index  # the newest frame decoded before this take
        f = r.take()
        if f is not None:
            got.append((f, newest))
            time.sleep(0.1)  # a model three frames slow
        else:
            time.sleep(0.005)
    took = time.monotonic() - started
    assert took >= 45 / 30 * 0.9  # played at its own rate, not as fast as it decodes
    assert len(got) < 45 and r.dropped == 45 - len(got)
    for f, newest in got:  # always the newest frame decoded, never one from a backlog
        assert f.index >= newest


@pytest.mark.parametrize("pace, fps", [("realtime", None), ("every", None), ("every", 5)])
def test_a_stream_is_up_before_its_first_frame_can_be_taken(tmp_path, pace, fps):
    """Whoever takes frames hears "up" first (watch printed frame 0 before stream_up): when the listener is told, no
    frame waits yet, whatever the pace."""

    class Watcher(Recorder):
        waiting_when_up = None

        def on_state(self, reader, old, new, reason):
            if new == "up":
                self.waiting_when_up = reader.ready()
            super().on_state(reader, old, new, reason)

    path = _video(tmp_path / "a.mp4", frames=6, fps=30)
    rec = Watcher()
    r = StreamReader("a", parse_source(path.as_uri()), rec, pace=pace, fps=fps)
    r.start()
    got = _drain(r, rec)
    r.stop(2.0)
    assert got and rec.waiting_when_up is False, (len(got), rec.waiting_when_up)


@pytest.mark.parametrize("taker_s", [0.2, 0.0])
def test_a_slow_taker_lets_the_decoder_skip_non_reference_frames(tmp_path, taker_s):
    """A taker using a sixth of a 30 fps file's frames (0.2 s a frame): after a second the decoder skips its
    non-reference frames (counted as skipped, never as decoded) and the taker still gets the newest frame decoded. A
    taker keeping up (every frame) decodes every frame."""
    path = _video(tmp_path / "b.mp4", frames=75, fps=30, b_frames=True)
    rec = Recorder()
    r = StreamReader("a", parse_source(path.as_uri()), rec, pace="realtime")
    r.start()
    got = []
    while r.state not in ("ended", "down") or r.ready():
        newest = r.last_index
        f = r.take()
        if f is not None:
            got.append((f, newest))
            time.sleep(taker_s)
        else:
            with rec.cond:
                rec.cond.wait(0.005)
    assert r.decoded + r.skipped == 75
    if taker_s:
        assert r.skipped >= 10 and r.decoded + r.skipped == r.last_index + 1  # a third of the frames after a second
        for f, newest in got:
            assert f.index >= newest
            assert f.index == round(f.pts * 30)  # its position in the file, the skipped frames counted
    else:
        assert r.skipped == 0 and len(got) >= 50  # the taker was ready for nearly every frame: none skipped


def test_loop_starts_again_and_keeps_counting(tmp_path):
    """loop = true: the file starts again at its end; frame indices keep counting, pts restart."""
    path = _video(tmp_path / "a.mp4", frames=10, fps=15)
    rec = Recorder()
    r = StreamReader("a", parse_source(path.as_uri()), rec, pace="every", loop=True)
    r.start()
    got = []
    while len(got) < 25:
        f = r.take()
        if f is not None:
            got.append(f)
        else:
            time.sleep(0.005)
    assert r.state == "up" and r.reconnects == 0  # a loop is no reconnect
    assert r.stop(5.0) and r.state == "stopped"
    assert [f.index for f in got] == list(range(25))
    assert [round(f.pts * 15) for f in got[:25]] == [i % 10 for i in range(25)]
    assert [round(f.time * 15) for f in got] == list(range(25))  # the tracker's clock goes on across the loops


def test_pace_every_under_a_thermal_limit_slows_instead_of_shedding_and_a_pause_is_no_stall(tmp_path):
    """pace "every" with a thermal limit: every frame is still handed over, at most at the limit's rate on the
    wall clock (nothing shed); a pause holds the hand-over without a stall, however long, and ends with the limit."""
    path = _video(tmp_path / "a.mp4", frames=12, fps=15)
    rec = Recorder()
    r = StreamReader("a", parse_source(path.as_uri()), rec, pace="every", read_timeout_s=0.3)
    r.limit(10.0)
    r.start()
    t0 = time.monotonic()
    got = _drain(r, rec)
    took = time.monotonic() - t0
    assert [f.index for f in got] == list(range(12)) and r.shed == 0 and r.dropped == 0
    assert took >= 11 / 10 * 0.75, took  # 12 frames at most 10 a second: 11 periods (a quarter early allowed)
    assert [round(f.time * 15) for f in got] == list(range(12))  # the file's time, not the wall clock's

    rec = Recorder()
    r = StreamReader("b", parse_source(path.as_uri()), rec, pace="every", read_timeout_s=0.3)
    r.limit(0)  # paused before the first frame
    r.start()
    rec.wait(lambda: r.state == "up")
    end = time.monotonic() + 1.0  # more than three read timeouts
    while time.monotonic() < end:
        assert r.take() is None
        r.check()  # the watchdog: held by the pause is not a stall
        time.sleep(0.05)
    assert r.state == "up" and r.reconnects == 0 and r.shed == 0
    r.limit(None)
    got = _drain(r, rec)
    assert [f.index for f in got] == list(range(12)) and r.state == "ended"


def test_files_that_cannot_be_read_are_down_at_once(tmp_path):
    """A missing file, a file that is not a video, and one with no video stream: state "down" with
    the reason, no retry loop, the thread gone."""
    (tmp_path / "junk.mp4").write_bytes(b"this is not a video" * 100)
    with av.open(str(tmp_path / "audio.mka"), "w") as c:  # a real media file with an audio stream only
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    for name, why in (("missing.mp4", "no such file"), ("junk.mp4", "not a video PyAV can open ("),
                      ("audio.mka", "no video stream")):
        rec = Recorder()
        r = StreamReader("a", parse_source((tmp_path / name).as_uri()), rec)
        r.start()
        rec.wait(lambda: r.state == "down", 20)
        assert why in r.last_error, r.last_error
        assert r.stop(2.0)
        assert [s[1] for s in rec.states] == ["down"]


def test_corrupt_packets_are_skipped_not_fatal(tmp_path):
    """Bytes overwritten in the middle of a file: the decoder skips what it cannot decode and the
    stream still reaches its end with most frames."""
    path = _video(tmp_path / "a.mp4", frames=60, fps=15, size=(160, 120))
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 400] = bytes(range(256)) + bytes(144)
    path.write_bytes(bytes(data))
    rec = Recorder()
    r = StreamReader("a", parse_source(path.as_uri()), rec, pace="every")
    r.start()
    got = _drain(r, rec)
    assert r.state == "ended" and len(got) >= 30


def test_gstreamer_sources_without_gi_are_refused_with_one_message():
    """csi:// and gst: need GStreamer's python3-gi (JetPack); without it the stream is "down" with a
    message saying what to install, at once."""
    try:
        import gi  # noqa: F401
        pytest.skip("python3-gi is importable here: the refusal cannot be seen")
    except ImportError:
        pass
    for uri in ("csi://0", "gst:videotestsrc ! appsink name=sink", "rtsp://cam/x"):
        rec = Recorder()
        r = StreamReader("a", parse_source(uri), rec, backend="gstreamer")
        r.start()
        rec.wait(lambda: r.state == "down", 10)
        assert "python3-gi" in r.last_error
        # PyAV is the way out only for what PyAV reads: an RTSP camera, not a CSI camera or a pipeline
        assert ('backend = "pyav"' in r.last_error) == uri.startswith("rtsp"), r.last_error


# k2edge watch ----------------------------------------------------------------------------------------
def _watch(*args, timeout=180):
    import subprocess
    import sys

    from mqtt_support import ROOT

    return subprocess.run([sys.executable, "-m", "k2edge", "watch", str(ROOT / "models/detector/model.onnx"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
def test_watch_prints_every_frame_of_a_file_as_the_daemon_publishes_it(tmp_path):
    """--json on a file: one line per frame, exactly the detections payload, in order, tracked; event
    lines carry "event" and no "frame"; --config/--stream take a configured stream's line, whose crossings
    are the video's; --save-annotated writes a video of every processed frame with the line drawn."""
    import json

    from stream_videos import scenario_crossing

    sc = scenario_crossing(tmp_path / "cross.mp4")
    (x0, y0), (x1, y1) = sc.line
    config = tmp_path / "k2edge.toml"
    config.write_text('device_id = "t"\n[[models]]\nname = "boxes"\nonnx = "m.onnx"\n[[streams]]\nname = "gate"\n'
                      f'source = "file:///x.mp4"\nmodel = "boxes"\n[[streams.lines]]\nname = "door"\n'
                      f'start = [{x0}, {y0}]\nend = [{x1}, {y1}]\n')
    out = _watch(sc.path, "--json", "--save-annotated", tmp_path / "out.mp4", "--config", config, "--stream", "gate")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    frames = [x for x in lines if "frame" in x]
    events = [x for x in lines if "event" in x]
    assert [f["frame"] for f in frames] == list(range(len(sc.truth.frames)))
    assert all(set(f) == {"stream", "frame", "pts", "captured_at", "model", "model_version", "detections", "latency_ms"}
               for f in frames)
    assert all(isinstance(d["track_id"], int) for f in frames for d in f["detections"])
    assert [e["event"] for e in events][0] == "stream_up" and events[-1]["event"] == "stream_ended"
    assert not any("frame" in e for e in events)
    assert {x["stream"] for x in lines} == {"gate"}  # named as the daemon names the configured stream
    assert f"{len(frames)} frame(s) processed" in out.stderr
    crossings = sorted((e["label"], e["direction"]) for e in events if e["event"] == "line_cross")
    assert crossings == sorted((c.label, c.direction) for c in sc.crossings)  # the config's line, its events
    with av.open(str(tmp_path / "out.mp4")) as c:
        decoded = [f.to_ndarray(format="rgb24").astype(int) for f in c.decode(video=0)]
    assert len(decoded) == len(frames)
    from k2edge.drawing import LINE_COLOUR

    band = decoded[0][5:235, int(x0) - 1:int(x0) + 3]  # the line, drawn (H.264 blurs its colour): each row has it
    near = (np.abs(band - np.array(LINE_COLOUR)).max(axis=2) < 70).any(axis=1)
    assert near.mean() > 0.9, near.mean()
    bad = _watch(sc.path, "--config", config, "--stream", "nope", timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip().endswith("has no such stream; it has gate"), bad.stderr


def test_the_shipped_clip_is_the_crossing_scenario_and_watch_reads_it(tmp_path):
    """models/detector/samples/crossing.mp4 (the README's first watch command) is what scenario_crossing writes: with
    the scenario's line, watch raises the crossings of its ground truth on every one of its frames."""
    import json

    from mqtt_support import ROOT
    from stream_videos import scenario_crossing

    sc = scenario_crossing(tmp_path / "cross.mp4")  # for its ground truth
    clip = ROOT / "models/detector/samples/crossing.mp4"
    with av.open(str(clip)) as c:
        assert sum(1 for _ in c.decode(video=0)) == len(sc.truth.frames)
    (x0, y0), (x1, y1) = sc.line
    config = tmp_path / "k2edge.toml"
    config.write_text('device_id = "t"\n[[models]]\nname = "boxes"\nonnx = "m.onnx"\n[[streams]]\nname = "gate"\n'
                      f'source = "file:///x.mp4"\nmodel = "boxes"\n[[streams.lines]]\nname = "door"\n'
                      f'start = [{x0}, {y0}]\nend = [{x1}, {y1}]\n')
    out = _watch(clip, "--json", "--config", config, "--stream", "gate")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert [x["frame"] for x in lines if "frame" in x] == list(range(len(sc.truth.frames)))
    crossings = sorted((e["label"], e["direction"]) for e in lines if e.get("event") == "line_cross")
    assert crossings == sorted((c.label, c.direction) for c in sc.crossings) and crossings


def test_watch_refuses_bad_sources_in_one_line(tmp_path):
    """A missing file, a malformed URI, a bad --fps: exit 1 or 2 with one line, no traceback."""
    for args in ((tmp_path / "none.mp4",), ("rtsp://u:hunter2@/x",), (tmp_path / "none.mp4", "--fps", "0")):
        out = _watch(*args, timeout=60)
        assert out.returncode in (1, 2) and "Traceback" not in out.stderr and "hunter2" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def _daemon_latency_keys(tmp_path) -> list:
    """The keys of ``latency_ms`` in what the daemon publishes for a frame: one frame through StreamPath's stage and
    finish (a model double that finds nothing), its published payload read back."""
    import json
    from types import SimpleNamespace

    from k2edge.service.event_store import EventStore
    from k2edge.service.stream_path import StreamPath
    from k2edge.streams.reader import Frame
    from k2edge.streams.stream import Stream, StreamFrame

    class Publisher:  # the transport, connected, its detections kept
        def __init__(self):
            self.connected, self.sent = threading.Event(), []
            self.connected.set()

        def publish(self, topic, payload, qos=0, **kw):
            self.sent.append(json.loads(payload))

    class Preprocess:
        def stage_mapped(self, image):  # the sample, and its geometry (the frame's size)
            return np.zeros((1, 3, 8, 8), np.float32), SimpleNamespace(width=image.shape[1], height=image.shape[0])

    class Served:  # a served model: its card's staging, and no detection in any frame
        name, version, preprocess = "boxes", None, Preprocess()

        def results(self, outputs, geometries, counts):
            return [({"detections": []}, None) for _ in geometries]

    publisher = Publisher()
    path = StreamPath([], "k2edge/t1", publisher, EventStore(tmp_path / "events.sqlite"), {})
    stream = Stream("cam", "boxes", StreamReader("cam", parse_source("file:///nowhere.mp4"), Recorder()))
    now = time.monotonic()
    frame = Frame(0, 0.0, time.time(), now, now, np.zeros((48, 64, 3), np.uint8))
    staged = path.stage(Served(), [StreamFrame(stream, frame, now)])
    path.finish(Served(), staged, [None], time.perf_counter())
    path.close()
    (body,) = publisher.sent
    return list(body["latency_ms"])


def test_watch_frame_lines_are_the_daemons_payload_and_all_come_before_stream_ended(tmp_path):
    """A short file, plain and --json: a line per frame, in order, every one before the stream_ended line (the last
    line); a --json frame line has the daemon's payload keys, latency_ms's the same as the daemon publishes."""
    import json

    clip = _video(tmp_path / "clip.mp4", frames=12, fps=15)
    text = _watch(clip, timeout=120)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("frame ")] == [str(i) for i in range(12)], lines
    assert lines[-1].strip() == "event stream_ended" and sum("stream_ended" in ln for ln in lines) == 1, lines
    out = _watch(clip, "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    frames = [x for x in lines if "frame" in x]
    assert [f["frame"] for f in frames] == list(range(12))
    assert lines[-1]["event"] == "stream_ended" and sum(x.get("event") == "stream_ended" for x in lines) == 1, lines
    assert all(set(f) == {"stream", "frame", "pts", "captured_at", "model", "model_version", "detections", "latency_ms"}
               for f in frames)
    daemon = _daemon_latency_keys(tmp_path)
    assert all(list(f["latency_ms"]) == daemon for f in frames), (frames[0]["latency_ms"], daemon)
    assert all(f["latency_ms"]["batch"] == 1 for f in frames)  # watch runs one frame a batch


def test_watch_a_file_that_is_not_a_video_is_one_line_naming_it_once(tmp_path):
    """A text file given as the source: exit 1, nothing on stdout (no stream_down), one line on stderr (no log
    warning) that names the file as given, once, and why; --json the same."""
    labels = tmp_path / "labels.txt"
    labels.write_text("person\ncar\n")
    for extra in ((), ("--json",)):
        out = _watch(labels, *extra, timeout=60)
        assert out.returncode == 1 and out.stdout == "", (out.stdout, out.stderr)
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith(f"k2edge watch: error: {labels}: not a video PyAV can open ("), line
        assert line.count("labels.txt") == 1, line


def test_watch_a_csi_camera_off_a_jetson_says_what_reads_one():
    """csi://0 where GStreamer's python3-gi is missing: one line saying a CSI camera is read by nvarguscamerasrc on a
    Jetson and why not here, not the advice to use PyAV (which cannot read one, and watch has no backend flag)."""
    from pathlib import Path

    try:
        import gi  # noqa: F401
        pytest.skip("python3-gi is importable here: the refusal cannot be seen")
    except ImportError:
        pass
    out = _watch("csi://0", "--connect-timeout", "5", timeout=60)
    assert out.returncode == 1 and out.stdout == "", (out.stdout, out.stderr)
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("k2edge watch: error: csi://0: a CSI camera is read by GStreamer's nvarguscamerasrc"), line
    here = "this venv cannot import python3-gi" if Path("/etc/nv_tegra_release").exists() else "this machine is not a Jetson"
    assert here in line, line
    assert "pyav" not in line.lower(), line


def test_watch_help_says_its_default_profile():
    """watch, unlike infer, build and eval, runs without -p: its --help says on what (cpu-dev)."""
    import os
    import subprocess
    import sys

    from mqtt_support import ROOT

    out = subprocess.run([sys.executable, "-m", "k2edge", "watch", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, env={**os.environ, "COLUMNS": "200"})  # wide: the help on one line each
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("--profile P")]
    assert "default: cpu-dev" in line, line


def test_watch_gives_up_on_a_camera_that_never_answers_and_on_a_file_without_frames(tmp_path):
    """A camera that refuses every connection: exit 1 after --connect-timeout, the last error in one line (not a
    retry forever after one warning); a file with no decodable frame: exit 1, not "0 frame(s) processed"."""
    import socket

    with socket.socket() as s:  # a loopback port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _watch(f"rtsp://127.0.0.1:{port}/cam", "--connect-timeout", "2", timeout=60)
    error = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert error.startswith("k2edge watch: error: ") and "no frame in 2 s, given up" in error, out.stderr
    assert "--connect-timeout 0 keeps trying" in error, out.stderr
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    out = _watch(tmp_path / "bad.png", timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("no video frame in it (not a video or image that can be decoded)")


# the stream's tracking across outages, its frame size and warnings ----------------------------------
def _stream_with_zone(max_lost_s: float = 1.0):
    from k2edge.streams.stream import Stream

    reader = StreamReader("cam", parse_source("file:///nowhere.mp4"), Recorder())  # never started
    zones = [("left", [(0, 0), (160, 0), (160, 240), (0, 240)]), ("far", [(1000, 1000), (1900, 1000), (1900, 1080)])]
    return Stream("cam", "boxes", reader, zones, [("door", (160, 0), (160, 240))], max_lost_s=max_lost_s)


def _frame(stream, index: int, captured: float, label: str = "7", restarts: int = 0):
    """Track one 320x240 frame captured at ``captured`` (monotonic) with one digit at (80, 100); ``restarts``: the
    file's pass it belongs to."""
    from k2edge.streams.reader import Frame
    from k2edge.streams.stream import StreamFrame

    frame = Frame(index, index / 15, time.time(), captured, captured, np.zeros((240, 320, 3), np.uint8), restarts)
    detections = [{"index": 7, "label": label, "score": 0.9, "box": [70.0, 80.0, 90.0, 100.0]}]
    return stream.track(StreamFrame(stream, frame, time.monotonic()), detections)


def test_a_files_stream_ended_waits_for_the_frames_read_before_it():
    """The reader ends while its last frame waits to be taken (or is in flight): the stream_ended waits for that
    frame's events to be handed on, and is given once; with nothing left it goes at once; a stop takes it anyway."""
    from k2edge.streams.reader import Frame

    stream = _stream_with_zone()
    reader, end = stream.reader, ([{"event": "stream_ended"}], 9)
    last = Frame(9, 9 / 15, time.time(), time.monotonic(), time.monotonic(), np.zeros((240, 320, 3), np.uint8))
    reader._frame = last  # the file's last frame, decoded, not taken yet
    assert stream.defer_end(end)
    item = stream.take()
    assert item is not None and item.frame is last and stream.defer_end(end)  # in flight: it still waits
    stream.release(item)  # the stream may take another frame; its events are not out yet
    assert stream.defer_end(end)
    assert stream.conclude(item) is end and stream.conclude(item) is None  # the frame's events are out: the end, once
    assert not stream.defer_end(end)  # nothing read is left: announce it now
    reader._frame = last
    assert stream.defer_end(end) and stream.end_due() is None
    reader._frame = None  # a thermal pause dropped it from the slot: nothing will conclude it, the daemon's tick asks
    assert stream.end_due() is end and stream.end_due() is None
    stream.keep_end(end)  # the evidence queue was full: asked again at the next tick
    assert stream.end_due() is end and stream.unconcluded == 0
    reader._frame = last  # the daemon stops with a frame never taken: the stop announces the end
    assert stream.defer_end(end) and stream.take_end() is end and stream.take_end() is None


def test_a_looping_file_that_starts_again_ends_every_track():
    """loop = true: the first frame of the file's next pass (whatever frames were dropped before it) ends every
    track, with a reason, before it is tracked; the object at the same place is a new track. Frames of one pass
    keep their tracks."""
    s = _stream_with_zone(max_lost_s=30.0)
    t0 = time.monotonic() - 50
    for i in range(4):
        tracked = _frame(s, i, t0 + i / 15)
    assert tracked.detections[0]["track_id"] == 1 and tracked.events == []
    again = _frame(s, 9, t0 + 9 / 15, restarts=1)  # frames 4..8 dropped: the pass changed all the same
    assert [(e["event"], e["track_id"]) for e in again.events] == [("zone_leave", 1)]
    assert again.events[0]["reason"] == "the file was read again from its start: every track ended"  # not looping
    assert again.detections[0]["track_id"] == 2
    assert _frame(s, 10, t0 + 10 / 15, restarts=1).detections[0]["track_id"] == 2
    s.reader.loop = True
    assert _frame(s, 11, t0 + 11 / 15, restarts=2).events[0]["reason"] == ("the file started again (loop = true): "
                                                                          "every track ended")


def test_a_reader_counts_the_passes_of_a_looping_file(tmp_path):
    """A looping file's frames carry the pass they belong to (Frame.restarts), from 0."""
    path = _video(tmp_path / "a.mp4", frames=5, fps=30)
    rec = Recorder()
    r = StreamReader("a", parse_source(path.as_uri()), rec, pace="every", loop=True)
    r.start()
    got, end = [], time.monotonic() + 30
    while len(got) < 12 and time.monotonic() < end:
        f = r.take()
        if f is None:
            time.sleep(0.005)
            continue
        got.append(f.restarts)
    r.stop(2.0)
    assert got == [0] * 5 + [1] * 5 + [2] * 2, got


def test_an_outage_longer_than_max_lost_ends_every_track_dated_when_the_stream_went_down():
    """Down for longer than max_lost_s: the track inside the zone leaves, dated at the stream_down, with a
    reason, before the next frame is tracked; the object seen after it is a new track. A short outage
    keeps the track."""
    s = _stream_with_zone(max_lost_s=1.0)
    t0 = time.monotonic() - 50
    for i in range(3):
        tracked = _frame(s, i, t0 + i / 15)
    assert [e["event"] for e in _frame(s, 3, t0 + 3 / 15).events] == [] and tracked.detections[0]["track_id"] == 1
    s.on_state("up", "reconnecting", "no frame for 5.0 s (stalled)")
    went_down = time.time()
    s.on_state("reconnecting", "up", None)
    after = _frame(s, 4, time.monotonic() + 0.01)
    (leave,) = after.events
    assert leave["event"] == "zone_leave" and leave["track_id"] == 1 and leave["zone"] == "left"
    assert abs(leave["time"] - went_down) < 1.0 and "max_lost_s 1 s" in leave["reason"] and "stalled" in leave["reason"]
    assert leave["frame"] == 3  # the last frame processed before the outage
    assert after.detections[0]["track_id"] == 2  # a new object: tentative now, no zone_enter yet
    assert [e["event"] for e in _frame(s, 5, time.monotonic()).events] == ["zone_enter"]

    s = _stream_with_zone(max_lost_s=30.0)
    t0 = time.monotonic() - 5
    _frame(s, 0, t0)
    _frame(s, 1, t0 + 0.1)
    s.on_state("up", "reconnecting", "stalled")
    s.on_state("reconnecting", "up", None)
    short = _frame(s, 2, time.monotonic())
    assert short.events == [] and short.detections[0]["track_id"] == 1


def test_the_first_frame_fixes_the_frame_size_and_warns_of_zones_outside_it():
    s = _stream_with_zone()
    st = s.status()
    assert st["frame_size"] is None and st["warnings"] == [] and st["frame_age_ms"] == {"p50": None, "p99": None, "samples": 0}
    _frame(s, 0, time.monotonic())
    for age in (0.010, 0.020, 0.030):
        s.note_age(age)
    st = s.status()
    assert st["frame_size"] == [320, 240]
    assert st["warnings"] == ["zone 'far' lies wholly outside the 320x240 frame ([1000, 1000], [1900, 1000], [1900, 1080]): "
                              "it can never fire; was it drawn for another resolution?"]
    assert st["frame_age_ms"] == {"p50": 20.0, "p99": 29.8, "samples": 3}
    assert s.frame_age(now=time.monotonic() + 10)["samples"] == 0  # only the last 5 s count
