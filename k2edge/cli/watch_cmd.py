"""``k2edge watch MODEL SOURCE``: one video source through a detector, with the daemon's reader and tracker.

A frame line is the daemon's detections payload, ``latency_ms`` included (one frame a batch: ``batch`` is 1); a
file's ``stream_ended`` comes after its last frame's line, as the daemon publishes it (:meth:`Stream.defer_end
<k2edge.streams.stream.Stream.defer_end>`). A source that cannot be opened is one error line, exit status 1: the
reader's state changes are watch's own lines (events, that error), not log warnings as well (``-v`` shows them).
"""

from __future__ import annotations

COMMAND = "watch"
HELP = "run a detector on a video file, RTSP camera or V4L2 device: tracked detections per frame, and events"
ORDER = 45

import json
import logging
import sys
import threading
import time
from pathlib import Path

from ..errors import InputError
from .common import add_build, add_model, build_engine, positive_float, seconds_or_zero

STREAM = "watch"
_OUTPUT = threading.Lock()  # the main loop and the cloud's follow-ups print whole lines, never into each other


def say(line: str) -> None:
    """One line on stdout, whole."""
    with _OUTPUT:
        print(line, flush=True)


def register(p) -> None:
    add_model(p)
    p.add_argument("source", metavar="SOURCE", help="file:///path.mp4 (or a plain path), rtsp://[user:pass@]host[:port]/path, "
                   "v4l2:///dev/video0, csi://0 (Jetson), gst:<pipeline>")
    add_build(p, default_profile=("cpu-dev", "one lane, FP32, no calibration"))
    p.add_argument("--fps", type=positive_float, metavar="N", help="frames to process per second (of video, for a file); "
                   "default: every frame")
    p.add_argument("--realtime", action="store_true",
                   help="play a file at its own frame rate, dropping what the model cannot keep up with (as a camera)")
    p.add_argument("--json", action="store_true", help="one JSON line per processed frame (the daemon's detections "
                   "payload) and per event")
    p.add_argument("--save-annotated", metavar="OUT.mp4", help="write the processed frames with their boxes and track ids")
    p.add_argument("--read-timeout", type=positive_float, default=5.0, metavar="S",
                   help="a live source with no frame for this long is reconnected (default 5)")
    p.add_argument("--connect-timeout", type=seconds_or_zero, default=30.0, metavar="S",
                   help="a live source that gives no first frame for this long is given up, exit status 1 (default 30; "
                        "0: keep trying); once it has given one, a cut is reconnected for as long as it lasts")
    p.add_argument("--config", metavar="FILE", help="a daemon config: with --stream, take that stream's zones, lines and "
                   "max_lost_s (drawn in --save-annotated; their events printed)")
    p.add_argument("--stream", metavar="NAME", help="the [[streams]] entry of --config whose zones and lines to use")
    p.add_argument("--cloud-config", metavar="FILE", help="a TOML file with a [cloud] table and [[escalation]] rules "
                   "(or --stream's): the events they select are sent to K2, its follow-ups printed beside them")
    p.add_argument("--cloud-wait", type=seconds_or_zero, default=60.0, metavar="S",
                   help="at the end, how long to wait for follow-ups still to come (default 60)")


class _Listener:
    """The reader's news, for the main loop: a frame waits, or the state changed."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.events: list[dict] = []
        self.stream = None  # the Stream, told of state changes too (an outage ends its tracks)
        self._lock = threading.Lock()

    def on_frame(self, reader) -> None:
        self.wake.set()

    def on_state(self, reader, old: str, new: str, reason: str | None) -> None:
        from ..streams.reader import state_event

        event = state_event(old, new, reason)
        if self.stream is not None:
            self.stream.on_state(old, new, reason)
        if new == "down" and old != "up":
            event = None  # a source that could not be (re)opened: the run ends on it, in its one error line
        elif event is not None and new == "ended" and self.stream is not None \
                and self.stream.defer_end(([event], reader.last_index)):
            event = None  # behind the frames read before the end: the main loop hands it on after the last one
        if event is not None:
            with self._lock:
                self.events.append(event)
        self.wake.set()

    def drain(self) -> list[dict]:
        with self._lock:
            out, self.events = self.events, []
        return out


def _source(text: str):
    """The source ``text`` names; a plain path is shown as given (it holds no credentials), not as its URI."""
    from dataclasses import replace

    from ..streams.source import parse_source

    if "://" not in text and not text.startswith("gst:"):
        path = Path(text)
        if path.is_dir():
            raise InputError(f"source {text!r} is a directory; give a video file or a URI such as rtsp://host/path")
        if not path.is_file():
            raise InputError(f"source {text!r}: no such file (give a file path or a URI such as rtsp://host/path)")
        return replace(parse_source(path.resolve().as_uri()), shown=text)
    try:
        return parse_source(text)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _configured_stream(args) -> tuple[list, list, float, tuple]:
    """The zones, lines, max_lost_s and escalation rules of ``--config``'s ``--stream`` (none without them)."""
    if (args.config is None) != (args.stream is None):
        raise InputError("--config and --stream go together: the config file and the name of its stream")
    if args.config is None:
        return [], [], 1.0, ()
    from ..config.schema import load_config

    cfg = load_config(args.config)  # a ConfigError is one line naming the field
    streams = {s.name: s for s in cfg.streams}
    if args.stream not in streams:
        raise InputError(f"--stream {args.stream!r}: {args.config} has no such stream; it has "
                         f"{', '.join(sorted(streams)) or 'none'}")
    s = streams[args.stream]
    return ([(z.name, z.points) for z in s.zones], [(ln.name, ln.start, ln.end) for ln in s.lines], s.max_lost_s,
            s.escalation)


def run(args) -> int:
    reader_log = logging.getLogger("k2edge.streams.reader")
    level = reader_log.level
    if not getattr(args, "verbose", False):
        reader_log.setLevel(logging.ERROR)  # its state warnings: watch prints each as an event or its error line
    try:
        return _watch(args)
    finally:
        reader_log.setLevel(level)


def _watch(args) -> int:
    from ..streams.payload import detections_payload, event_payload, frame_latency
    from ..streams.reader import StreamReader
    from ..streams.source import backend_for
    from ..streams.stream import Stream

    spec = _source(args.source)
    if not spec.live and spec.kind == "file" and not Path(spec.target).is_file():
        raise InputError(f"source {spec.shown!r}: no such file")
    out = Path(args.save_annotated) if args.save_annotated else None
    if out is not None and not out.resolve().parent.is_dir():
        raise InputError(f"--save-annotated {args.save_annotated!r}: its directory does not exist")
    try:
        backend = backend_for(spec)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    zones, lines, max_lost_s, rules = _configured_stream(args)
    cloud = None
    if args.cloud_config:
        from .watch_cloud import WatchCloud, load_cloud_file

        settings, own_rules = load_cloud_file(args.cloud_config)
        rules = own_rules or rules
        names = ({z for z, _ in zones}, {n for n, _, _ in lines})
        for i, r in enumerate(rules):
            if (r.zone and r.zone not in names[0]) or (r.line and r.line not in names[1]):
                raise InputError(f"{args.cloud_config}: escalation.{i}: names {r.zone or r.line!r}, which the watched "
                                 "stream lacks (give --config and --stream for its zones and lines)")
    engine = build_engine(args)
    if engine.card.task != "detection":
        raise InputError(f"watch tracks detections; this model's task is {engine.card.task!r} (a card with "
                         "task = \"detection\" makes it a detector)")
    listener = _Listener()
    pace = "realtime" if args.realtime else "every"
    name = args.stream or STREAM  # the events and detections name the config's stream when it is given
    reader = StreamReader(name, spec, listener, backend=backend, pace=pace, fps=args.fps, read_timeout_s=args.read_timeout)
    model = Path(args.model).stem if Path(args.model).stem != "model" else Path(args.model).resolve().parent.name
    if args.cloud_config:
        cloud = WatchCloud(settings, rules, say, as_json=args.json)
    stream = listener.stream = Stream(name, model, reader, zones, lines, max_lost_s=max_lost_s,
                                      rules=rules if cloud is not None else ())
    writer = None
    frames = 0
    gave_up = False

    def emit(events: list[dict], frame: int | None, escalations: dict | None = None) -> None:
        for i, e in enumerate(events):
            if e["event"] == "stream_ended":  # the file's end ends the tracks still open first, as the daemon does
                tracks = stream.end_of_file()
                emit(tracks.events, frame, tracks.escalations)
            body = event_payload(name, e, frame)
            if cloud is not None and i in (escalations or {}):
                cloud.submit(name, body, escalations[i])
            if args.json:
                body.pop("frame")  # event lines carry "event" and no "frame": a reader tells them from frame lines
                say(json.dumps(body))
            else:
                extra = " ".join(f"{k}={body[k]}" for k in ("track_id", "label", "zone", "line", "direction", "reason",
                                                            "mean_score", "best_score") if body.get(k) is not None)
                if body.get("escalation"):
                    extra += f" -> k2 {body['event_id'][:8]} (rule {body['escalation']['rule']})"
                say(f"  event {body['event']} {extra}".rstrip())

    with engine:
        reader.start()
        started = time.monotonic()
        try:
            while True:
                emit(listener.drain(), reader.last_index)
                reader.check()  # the stall watchdog, as the daemon runs it
                item = stream.take()
                if item is None:
                    if reader.state in ("ended", "down") and not reader.ready():
                        break
                    if (spec.live and args.connect_timeout and reader.decoded == 0
                            and time.monotonic() - started > args.connect_timeout):
                        gave_up = True  # a camera that never answered: a typo in the URL, not a cut to ride out
                        break
                    listener.wake.wait(0.5)
                    listener.wake.clear()
                    continue
                t0 = time.perf_counter()
                batch, geometries = engine.stage_mapped([item.frame.image])
                t1 = time.perf_counter()
                outputs = engine.infer({engine.input_name: batch})
                t2 = time.perf_counter()
                detections = engine.answers(outputs, 1, geometries, 1)[0]["detections"]
                tracked = stream.track(item, detections)
                latency = frame_latency(item.taken - item.frame.captured, t1 - t0, t2 - t1, 1,
                                        time.monotonic() - item.frame.captured)
                body = detections_payload(name, item.frame, model, None, tracked.detections, latency)
                frames += 1
                if args.json:
                    say(json.dumps(body))
                else:
                    dets = ", ".join(f"{d['label']}#{d['track_id']} {d['score']:.2f}" for d in body["detections"])
                    say(f"frame {body['frame']} pts {body['pts']:.3f}: {len(body['detections'])} detection(s)"
                        + (f": {dets}" if dets else ""))
                emit(tracked.events, item.frame.index, tracked.escalations)
                ended = stream.conclude(item)  # a file's stream_ended, when it waited for this frame
                if ended is not None:
                    emit(*ended)
                if out is not None:
                    writer = writer or _Writer(out, args.fps or reader.source_fps or 25.0, item.frame.image.shape)
                    writer.write(item.frame.image, tracked.detections, stream.zones, stream.lines)
        except KeyboardInterrupt:
            pass
        finally:
            reader.stop(2.0)
            emit(listener.drain(), reader.last_index)
            ended = stream.take_end()  # interrupted with the file's last frame unprocessed: its end, announced now
            if ended is not None:
                emit(*ended)
            if writer is not None:
                writer.close()
            if cloud is not None:
                cloud.finish(args.cloud_wait)
    if reader.state == "down":  # the backend's reason names the source, unless it is about this machine
        why = reader.last_error or "cannot be read"
        raise InputError(why if why.startswith(spec.shown) else f"{spec.shown}: {why}")
    if gave_up:
        raise InputError(f"source {spec.shown!r}: no frame in {args.connect_timeout:g} s, given up "
                         f"({reader.last_error or 'connected, nothing decoded'}; --connect-timeout 0 keeps trying)")
    if reader.decoded == 0 and not spec.live:
        raise InputError(f"source {spec.shown!r}: no video frame in it (not a video or image that can be decoded)")
    r = reader
    print(f"{frames} frame(s) processed, {r.decoded} decoded, {r.dropped} dropped, {r.reconnects} reconnect(s)"
          + (f"; annotated video: {out}" if out is not None and writer is not None else ""), file=sys.stderr)
    return 0


class _Writer:
    """The annotated video (H.264 through PyAV)."""

    def __init__(self, path: Path, fps: float, shape: tuple) -> None:
        import av
        from fractions import Fraction

        self._av = av
        try:
            self.container = av.open(str(path), "w")
        except (av.error.FFmpegError, OSError, ValueError) as exc:  # ValueError: no container for the file's extension
            raise InputError(f"--save-annotated {str(path)!r}: cannot write ({exc}; give a video file such as out.mp4)") from None
        self.stream = self.container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        self.h, self.w = shape[0] - shape[0] % 2, shape[1] - shape[1] % 2  # yuv420p needs even sizes
        self.stream.width, self.stream.height, self.stream.pix_fmt = self.w, self.h, "yuv420p"

    def write(self, image, detections: list[dict], zones=(), lines=()) -> None:
        from PIL import Image

        from ..drawing import draw_detections, draw_zones_and_lines

        img = draw_zones_and_lines(Image.fromarray(image[: self.h, : self.w]), zones, lines)
        img = draw_detections(img, detections)
        frame = self._av.VideoFrame.from_image(img)
        for packet in self.stream.encode(frame):
            self.container.mux(packet)

    def close(self) -> None:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()
