"""One stream's state, owned in one place: its reader, its tracker, its zones and lines, its counts.

The processing side (the daemon's model line, or ``k2edge watch``) asks :meth:`Stream.take` for
the newest frame, runs the model on it, and hands the frame's detections to :meth:`Stream.track`,
which gives every detection a ``track_id`` and returns the zone and line events it caused. One
frame of a stream is in flight at a time, so tracking sees its frames in order and a frame's age
is bounded by one batch.

Tracking runs on the frames' capture times. When the source went down between two processed
frames and they lie more than ``max_lost_s`` apart, every track ends before the new frame is
tracked: a reconnected camera's objects are new objects. Their ``zone_leave`` events are dated
when the stream went down (``time``; ``frame``: the last processed before it) and say why (``reason``).

With escalation rules (``[[streams.escalation]]``), each confirmed track's scores are kept while it lives
(:class:`~k2edge.streams.escalation_rules.TrackStats`; with the crops the rules send), a track that ends
raises ``track_end`` when a rule asks for it (its frames, mean and best score, the best's frame and box),
and every event is matched against the rules (:func:`~k2edge.streams.escalation_rules.select`): a
:class:`Tracked`'s ``escalations`` say which events K2 is to be asked about, with which images.

The first processed frame fixes the stream's frame size; zones and lines with points outside it
are :attr:`Stream.warnings` (logged once, shown in the status).

The thermal governor's state limits the stream's rate (:meth:`Stream.set_thermal`; what each state
means is :mod:`k2edge.streams.throttle`'s): the reader sheds the frames above the limit, and in
``critical`` the stream is ``paused``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .analytics import Analytics, Line as CountLine, Zone, frame_warnings
from .escalation_rules import Selection, TrackStats, label_warnings, select
from .reader import Frame, StreamReader
from .throttle import StreamLimit, limit_events, stream_limit
from .tracker import ByteTracker

log = logging.getLogger(__name__)

RATE_WINDOW_S = 5.0  # fps and frame age figures are over this many seconds
WATCH_S = 5.0  # a live viewer's request keeps the stream's newest processed frame for this long


@dataclass(slots=True)
class StreamFrame:
    """A frame taken for processing (a work item of its model's line)."""

    stream: "Stream"
    frame: Frame
    taken: float  # monotonic
    sample: np.ndarray | None = None
    geometry: object = None
    stage_s: float | None = None  # how long staging it took (the daemon's batch; watch stages its own)
    finished: bool = False  # released: the stream may take its next frame
    concluded: bool = False  # its detections and events are handed on (see Stream.conclude)

    @property
    def received(self) -> float:
        return self.frame.captured


@dataclass(frozen=True, slots=True)
class Tracked:
    """One processed frame: its detections with track ids, and the events they caused (without ids); with
    escalation rules, per event position the rule it falls under and the images to send (RGB arrays)."""

    detections: list
    events: list
    escalations: dict = field(default_factory=dict)  # event position -> (Selection, [np.ndarray, ...], TrackStats)


@dataclass(slots=True)
class _TrackMemory:
    """A live track's scores, and the crops the rules want of it (the best one, the most recent ones)."""

    label: str | None = None
    frames: int = 0
    total: float = 0.0
    best: float = -1.0
    best_frame: int | None = None
    best_box: list | None = None
    best_crop: np.ndarray | None = None
    recent: deque = field(default_factory=deque)

    def stats(self) -> TrackStats:
        return TrackStats(self.frames, self.total / max(1, self.frames), max(0.0, self.best), self.best_frame)


def crop(image: np.ndarray | None, box) -> np.ndarray | None:
    """A copy of ``box`` (source pixels) cut from ``image``, a tenth wider each side for context; None when empty."""
    if image is None or box is None:
        return None
    h, w = image.shape[:2]
    x1, y1, x2, y2 = (float(v) for v in box)
    mx, my = 0.1 * (x2 - x1), 0.1 * (y2 - y1)
    a, b = max(0, int(x1 - mx)), max(0, int(y1 - my))
    c, d = min(w, int(np.ceil(x2 + mx))), min(h, int(np.ceil(y2 + my)))
    return image[b:d, a:c].copy() if c > a and d > b else None


class Stream:
    """A source bound to a model: reader, tracker and analytics (see the module docstring).

    Args:
        name: the stream's name (a topic level).
        model: the served model that processes it.
        reader: its reader (not started).
        zones: ``(name, points)`` pairs in source pixels.
        lines: ``(name, start, end)`` triples in source pixels.
        max_lost_s: a track unseen for longer ends; so does every track after an outage this long.
        snapshots: its zone and line events get snapshots (the frame's pixels are kept until it is tracked).
        warm_fps: the most it is processed at in the thermal state warm (None: half its rate).
        hot_fps: and in hot (None: a quarter of its rate, at least 1 fps).
        rules: its ``[[streams.escalation]]`` rules (:class:`~k2edge.config.stream_escalation.EscalationRule`).
    """

    def __init__(self, name: str, model: str, reader: StreamReader, zones=(), lines=(), max_lost_s: float = 1.0,
                 snapshots: bool = True, warm_fps: float | None = None, hot_fps: float | None = None,
                 rules=()) -> None:
        self.name, self.model, self.reader = name, model, reader
        self.zones, self.lines = tuple(zones), tuple(lines)
        self.snapshots = snapshots and bool(self.zones or self.lines)  # only zone and line events have snapshots
        self.tracker = ByteTracker(max_lost_s=max_lost_s)
        self.analytics = Analytics([Zone(n, p) for n, p in zones], [CountLine(n, s, e) for n, s, e in lines])
        self.processed = 0
        self.frame_errors = 0
        self.frame_size: tuple[int, int] | None = None  # (width, height), from the first processed frame
        self.warnings: list[str] = []
        self._rule_warnings: list[str] = []  # rules naming labels the model lacks (follow_labels)
        self._in_flight = False
        self._open = 0  # frames taken whose detections and events are not handed on yet (conclude)
        self._end: tuple | None = None  # the reader's stream_ended, waiting for the frames before it (defer_end)
        self._lock = threading.Lock()
        self._up_announced = False  # a stream_up was published and no stream_down / _ended / _paused since
        self._rates: deque = deque()  # (monotonic, decoded, processed)
        self._ages: deque = deque()   # (monotonic, age s) of the frames processed in the last RATE_WINDOW_S
        self._counts = self.analytics.counts()  # a snapshot for status (other threads), taken after each frame
        self._last_captured: float | None = None  # the newest processed frame's capture time (monotonic)
        self._last_index: int | None = None       # and its index
        self._boxes: dict[int, list[float]] = {}  # track id -> its latest box (an event carries its track's box)
        self._snapshots = {"made": 0, "failed": 0}
        self._clips = {"made": 0, "failed": 0}
        self._watched_until = 0.0  # monotonic: until then a live viewer wants the newest processed frame
        self._latest: tuple | None = None  # (frame index, RGB image, detections), kept only while watched
        self._down: tuple[float, float, str | None] | None = None  # (monotonic, unix, reason) it last went down
        self.accepting = True
        self.warm_fps, self.hot_fps = warm_fps, hot_fps
        self._thermal: tuple[str, str | None] = ("unknown", None)  # the governor's state and its reason
        self.limit: StreamLimit = stream_limit("unknown", self.rate)
        self._limit_since = time.time()  # when the reader's frames began to follow this limit (Unix time)
        self.rules = tuple(rules)
        self._memory: dict[int, _TrackMemory] = {}  # track id -> its scores (only with rules)
        self._keep_crops = max((r.keeps_crops for r in self.rules), default=0)
        self._track_end = any(r.on == "track_end" for r in self.rules)
        self._outage_ended: list[int] = []  # tracks ended by an outage or a loop, until this frame's rules saw them
        self._last_index: int | None = None  # the last tracked frame's index (the tracker predicts the frames since)
        self._last_restarts: int | None = None  # the last processed frame's Frame.restarts

    # the line's feed ----------------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.accepting and not self._in_flight and self.reader.ready()

    @property
    def in_flight(self) -> bool:
        return self._in_flight

    @property
    def unconcluded(self) -> int:
        """Frames taken whose events are not handed on yet (a frame is released before that)."""
        return self._open

    def take(self) -> StreamFrame | None:
        """The newest frame, now in flight; None when none waits or one is in flight already."""
        with self._lock:
            if self._in_flight or not self.accepting:
                return None
            frame = self.reader.take()
            if frame is None:
                return None
            self._in_flight = True
            self._open += 1
            return StreamFrame(self, frame, time.monotonic())

    def release(self, item: StreamFrame, failed: bool = False) -> None:
        """``item`` (the frame in flight) is finished: processed, or failed (then counted as dropped). Once."""
        with self._lock:
            if item.finished:
                return
            item.finished = True
            self._in_flight = False
            if failed:
                self.frame_errors += 1
        if failed:
            self.reader.count_dropped()

    def conclude(self, item: StreamFrame) -> tuple | None:
        """``item``'s detections and events are handed on (published, or queued for their snapshots): once, after
        :meth:`release`. Returns the ended stream's announcement (:meth:`defer_end`) when it was the last frame."""
        with self._lock:
            if item.concluded:
                return None
            item.concluded = True
            self._open -= 1
            return self._end_due()

    def defer_end(self, announcement: tuple) -> bool:
        """The reader ended (its thread): True when frames it read are still to be handed on, so that
        ``announcement`` waits for them (the last :meth:`conclude` returns it; :meth:`take_end` at a stop); False:
        announce it now."""
        with self._lock:  # the lock take() holds from the reader's slot to the frame in flight
            if not self._open and not self.reader.ready():
                return False
            self._end = announcement
            return True

    def keep_end(self, announcement: tuple) -> None:
        """``announcement`` could not be queued behind the frames' events (the evidence queue is full): it waits again
        (:meth:`end_due`, asked once a second)."""
        with self._lock:
            self._end = announcement

    def take_end(self) -> tuple | None:
        """The announcement still waiting (the daemon stops: a frame left in the reader is never taken), once."""
        with self._lock:
            end, self._end = self._end, None
            return end

    def end_due(self) -> tuple | None:
        """The waiting announcement, once, if nothing read before it is left (a frame the thermal pause dropped from
        the reader's slot is never concluded: the daemon asks once a second)."""
        with self._lock:
            return self._end_due()

    def _end_due(self) -> tuple | None:
        if self._end is None or self._open or self.reader.ready():
            return None
        end, self._end = self._end, None
        return end

    def on_state(self, old: str, new: str, reason: str | None) -> None:
        """The reader's state changed (its thread): remember when it went down, for :meth:`track`; once up,
        the source's rate is known (the thermal limit's defaults are fractions of it)."""
        if old == "up" and new != "up":
            with self._lock:
                self._down = (time.monotonic(), time.time(), reason)
        if new == "up":
            self._relimit()

    # the thermal limit --------------------------------------------------------------------------------
    @property
    def rate(self) -> float | None:
        """The stream's own rate: its ``fps``, or its source's when lower or when none is set (None: not known)."""
        rates = [r for r in (self.reader.fps, self.reader.source_fps) if r]
        return min(rates) if rates else None

    @property
    def paused(self) -> bool:
        return self.limit.paused

    def set_thermal(self, state: str, cause: str | None = None) -> list[dict]:
        """The thermal governor's state changed (its thread): the stream's new limit, now; returns the events
        it causes (``stream_paused``, or ``stream_up`` when a pause ends)."""
        with self._lock:
            self._thermal = (state, cause)
        return self._relimit()

    def announced(self, events: list[dict]) -> list[dict]:
        """Of the reader's and the thermal limit's events (their two threads), those to publish: a
        ``stream_up`` only while the stream is up and not paused and once each time it comes up or
        resumes (a source back at the instant a pause ends is announced by whichever thread sees it first)."""
        out = []
        with self._lock:
            for e in events:
                if e["event"] == "stream_up":
                    if self._up_announced or self.limit.paused or self.reader.state != "up":
                        continue
                    self._up_announced = True
                elif e["event"] in ("stream_down", "stream_ended", "stream_paused"):
                    self._up_announced = False
                out.append(e)
        return out

    def _relimit(self) -> list[dict]:
        with self._lock:  # the reader's gate too: two threads (sampler, reader) never leave it a stale limit
            state, cause = self._thermal
            old = self.limit
            self.limit = new = stream_limit(state, self.rate, self.warm_fps, self.hot_fps, cause=cause)
            since = self.reader.limit(new.gate_fps)
            changed = new.max_fps != old.max_fps or new.thermal_state != old.thermal_state
            if changed:
                self._limit_since = since
        if changed:
            log.log(logging.WARNING if new.throttled else logging.INFO, "stream %s: %s", self.name, new.reason)
        return limit_events(old, new, self.reader.state)

    # after inference --------------------------------------------------------------------------------
    def track(self, item: StreamFrame, detections: list[dict]) -> Tracked:
        """Track ids for ``detections`` (``{"index", "label", "score", "box"}`` in source pixels) and
        the zone/line events of this frame (an outage's ``zone_leave`` events first). Releases the frame."""
        try:
            captured = item.frame.captured
            if self.frame_size is None:
                self._first_frame(item)
            events = self._after_outage(captured) + self._after_restart(item.frame)
            boxes = np.asarray([d["box"] for d in detections], dtype=np.float64).reshape(-1, 4)
            scores = np.asarray([d["score"] for d in detections], dtype=np.float64)
            index, last = item.frame.index, self._last_index
            self._last_index = index
            update = self.tracker.update(boxes, scores, [d["label"] for d in detections], t=item.frame.time,
                                         frames=index - last if last is not None else None)
            out = [{**d, "track_id": int(t)} for d, t in zip(detections, update.ids)]
            self._boxes.update({a.id: [round(v, 2) for v in a.box] for a in update.active})
            image = item.frame.image if self.rules and item.frame.picture is not None else None
            if self.rules:
                self._remember(update.active, image, item.frame.index)
            events += self._with_boxes(self.analytics.update(update.active, update.removed))
            events += self._track_ends(update.removed)
            for tid in update.removed:
                self._boxes.pop(tid, None)
            counts = self.analytics.counts()
            with self._lock:
                self._counts = counts
            self._last_captured, self._last_index = captured, item.frame.index
            self.processed += 1
            gone = set(update.removed) | set(self._outage_ended)
            escalations = self._select(events, image, gone) if self.rules else {}
            self._forget(list(update.removed) + self._outage_ended)
            self._outage_ended = []
            return Tracked(out, events, escalations)
        finally:
            self.release(item)

    # escalation rules --------------------------------------------------------------------------------
    def _remember(self, active, image: np.ndarray | None, index: int) -> None:
        """The confirmed tracks' scores this frame (and the crops the rules want)."""
        for a in active:
            if not a.confirmed:
                continue
            m = self._memory.get(a.id)
            if m is None:
                m = self._memory[a.id] = _TrackMemory(recent=deque(maxlen=max(0, self._keep_crops - 1)))
            m.label = a.label
            m.frames += 1
            m.total += float(a.score)
            if a.score > m.best:
                m.best, m.best_frame, m.best_box = float(a.score), index, [round(v, 2) for v in a.box]
                if self._keep_crops:
                    m.best_crop = crop(image, a.box)
            elif self._keep_crops > 1 and m.frames % 5 == 0:  # a crop every fifth frame: different views, few copies
                c = crop(image, a.box)
                if c is not None:
                    m.recent.append(c)

    def _track_ends(self, ended) -> list[dict]:
        """``track_end`` for each confirmed track that ended (only when a rule asks for them)."""
        if not self._track_end:
            return []
        out = []
        for tid in ended:
            m = self._memory.get(tid)
            if m is None or not m.frames:
                continue
            st = m.stats()
            out.append({"event": "track_end", "track_id": int(tid), "label": m.label,
                        "frames": st.frames, "mean_score": round(st.mean, 4), "best_score": round(st.best, 4),
                        "best_frame": st.best_frame, "best_box": m.best_box})
        return self._with_boxes(out)

    def _forget(self, ended) -> None:
        for tid in ended:
            self._memory.pop(tid, None)

    def _select(self, events: list[dict], image: np.ndarray | None, gone: set) -> dict:
        """Per event position, the rule it falls under and its images (see :class:`Tracked`)."""
        out = {}
        for i, e in enumerate(events):
            m = self._memory.get(e.get("track_id"))
            sel: Selection | None = select(self.rules, e, m.stats() if m is not None else None, self.name)
            if sel is None:
                continue
            rule, images = sel.rule, []
            if rule.images == "frame":
                images = [image] if image is not None and e.get("track_id") not in gone else []
            elif e.get("track_id") in gone:  # the track is not in this frame: what was kept of it
                images = [m.best_crop] if m is not None and m.best_crop is not None else []
                if rule.images == "track" and m is not None:
                    images += list(m.recent)[-(rule.count - len(images)):] if rule.count > len(images) else []
            else:
                c = crop(image, e.get("box"))
                images = [c] if c is not None else []
                if rule.images == "track" and m is not None:
                    kept = ([m.best_crop] if m.best_crop is not None else []) + list(m.recent)
                    images += kept[:max(0, rule.count - len(images))]
            out[i] = (sel, images, m.stats() if m is not None else None)
        return out

    def _after_outage(self, captured: float) -> list[dict]:
        """Every track ends when the source went down since the last processed frame and this one comes
        more than ``max_lost_s`` after it; their zone leaves are dated when the stream went down."""
        with self._lock:
            down, last = self._down, self._last_captured
            if down is None or down[0] > captured:
                return []
            self._down = None
        if last is None or captured - last <= self.tracker.max_lost_s:
            return []
        gap = captured - last
        why = f"the stream was down ({down[2]})" if down[2] else "the stream was down"
        reason = f"{why}; no frame for {gap:.1f} s, longer than max_lost_s {self.tracker.max_lost_s:g} s: every track ended"
        return [{**e, "time": down[1]} for e in self._end_every_track(reason)]

    def _after_restart(self, frame) -> list[dict]:
        """Every track ends when the file was read from its start again since the last processed frame (a loop,
        or a reopen after a read error): the objects at its end are not those at its start (a track carried
        across would take another object's id)."""
        last, self._last_restarts = self._last_restarts, frame.restarts
        if last is None or frame.restarts == last:
            return []
        why = "the file started again (loop = true)" if self.reader.loop else "the file was read again from its start"
        return self._end_every_track(f"{why}: every track ended")

    def end_of_file(self) -> Tracked:
        """The file ended (read to its end, not looping): every track ends at the last processed frame, with its
        zone leaves, track ends and the rules' selections of them, so that an object still in view at the end is
        counted out and judged like one that walked away. Called once, when no frame of the stream is in flight."""
        events = self._end_every_track("the file ended: every track ended")
        gone = set(self._outage_ended)
        escalations = self._select(events, None, gone) if self.rules else {}
        self._forget(self._outage_ended)
        self._outage_ended = []
        with self._lock:
            self._counts = self.analytics.counts()
        return Tracked([], events, escalations)

    def _end_every_track(self, reason: str) -> list[dict]:
        """End every track before this frame is tracked: their zone leaves and track ends, at the last processed
        frame, with ``reason``."""
        ended = self.tracker.end_all()
        self._outage_ended += ended  # their scores are kept until this frame's events are matched to the rules
        events = self._with_boxes(self.analytics.update([], ended)) + self._track_ends(ended)
        for tid in ended:
            self._boxes.pop(tid, None)
        return [{**e, "frame": self._last_index, "reason": reason} for e in events]

    def _with_boxes(self, events: list[dict]) -> list[dict]:
        """Each track event with its track's box: this frame's, or, for a track that ended, its last."""
        return [{**e, "box": self._boxes.get(e["track_id"])} for e in events]

    def _first_frame(self, item: StreamFrame) -> None:
        geometry = item.geometry
        if geometry is not None and getattr(geometry, "width", None):
            size = (int(geometry.width), int(geometry.height))
        else:
            shape = item.frame.image.shape
            size = (int(shape[1]), int(shape[0]))
        self.frame_size = size
        self.warnings = frame_warnings(self.analytics.zones, self.analytics.lines, *size)
        for w in self.warnings:
            log.warning("stream %s: %s", self.name, w)

    def follow_labels(self, labels) -> None:
        """The model's labels (at start, and after a deploy): a rule naming one it lacks can never fire; said in
        the status' warnings and logged (not refused: a deploy that relabels the model must not stop the next
        start)."""
        found = label_warnings(self.rules, tuple(labels))
        for w in found:
            if w not in self._rule_warnings:
                log.warning("stream %s: %s", self.name, w)
        self._rule_warnings = found

    # the live view ------------------------------------------------------------------------------------
    def watch(self) -> None:
        """A live viewer asked for a frame: keep the newest processed frame for :data:`WATCH_S` seconds."""
        self._watched_until = time.monotonic() + WATCH_S

    @property
    def watched(self) -> bool:
        return time.monotonic() < self._watched_until

    def keep_latest(self, frame: Frame, detections: list[dict]) -> None:
        """A processed frame and its tracked detections, for the live view (a reference: nothing is copied)."""
        latest = (frame.index, frame.image, detections) if self.watched else None
        with self._lock:
            self._latest = latest

    def latest(self) -> tuple | None:
        """``(frame index, RGB image, detections)`` of the newest processed frame while watched, else None."""
        with self._lock:
            return self._latest if self.watched else None

    def count_snapshot(self, made: bool) -> None:
        """One of its events got its snapshot (``made``), or went out without one (the event says why)."""
        with self._lock:
            self._snapshots["made" if made else "failed"] += 1

    def count_clip(self, made: bool) -> None:
        """One of its events got its clip into the media store (``made``), or a clip_ready without one (cut short of
        packets, the queue full, the store refusing it: the event says why)."""
        with self._lock:
            self._clips["made" if made else "failed"] += 1

    def note_age(self, age_s: float, now: float | None = None) -> None:
        """A processed frame was ``age_s`` old when its results went out (for the status' percentiles)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._ages.append((now, age_s))
            while self._ages and now - self._ages[0][0] > RATE_WINDOW_S:
                self._ages.popleft()

    # numbers ------------------------------------------------------------------------------------------
    def sample_rates(self, now: float | None = None) -> None:
        """Record the counts now (about once a second, by one thread): :meth:`rates` averages over them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            r = self._rates
            r.append((now, self.reader.decoded + self.reader.skipped, self.processed))  # the source's frames, decoded or not
            while len(r) > 2 and now - r[1][0] >= RATE_WINDOW_S:
                r.popleft()

    def rates(self) -> tuple[float, float]:
        """(fps_in, fps_processed) over the last :data:`RATE_WINDOW_S` seconds of samples."""
        with self._lock:
            if len(self._rates) < 2:
                return 0.0, 0.0
            (t0, d0, p0), (t1, d1, p1) = self._rates[0], self._rates[-1]
        return ((d1 - d0) / (t1 - t0), (p1 - p0) / (t1 - t0)) if t1 > t0 else (0.0, 0.0)

    def frame_age(self, now: float | None = None) -> dict:
        """``{"p50", "p99", "samples"}``: the age in ms of the frames processed in the last
        :data:`RATE_WINDOW_S` seconds when their results went out (None without any)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            ages = [a for t, a in self._ages if now - t <= RATE_WINDOW_S]
        if not ages:
            return {"p50": None, "p99": None, "samples": 0}
        p50, p99 = np.percentile(np.asarray(ages) * 1e3, [50, 99])
        return {"p50": round(float(p50), 2), "p99": round(float(p99), 2), "samples": len(ages)}

    def status(self) -> dict:
        """The stream's entry in the daemon's status."""
        fps_in, fps_processed = self.rates()
        with self._lock:
            counts, snapshots, clips = self._counts, dict(self._snapshots), dict(self._clips)
            paused, limit = self.limit.paused, {**self.limit.to_dict(), "since": self._limit_since}
        r = self.reader
        state = "paused" if paused and r.state == "up" else r.state
        return {"state": state, "source": r.spec.shown, "model": self.model, "fps_in": round(fps_in, 2),
                "fps_processed": round(fps_processed, 2), "frame_age_ms": self.frame_age(),
                "frame_size": list(self.frame_size) if self.frame_size else None, "decoded": r.decoded,
                "processed": self.processed, "dropped": r.dropped, "shed": r.shed, "skipped": r.skipped, "limit": limit,
                "corrupt": r.corrupt, "reconnects": r.reconnects,
                "last_error": r.last_error, "warnings": [*self.warnings, *self._rule_warnings], "counts": counts,
                "snapshots": snapshots if self.snapshots else None,
                "clips": {**r.packets.status(), **clips} if r.packets is not None else None}
