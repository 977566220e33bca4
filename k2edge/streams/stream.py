"""One stream's state, owned in one place: its reader, its tracker, its zones and lines, its counts.

The processing side (the daemon's model line, or ``k2edge watch``) asks :meth:`Stream.take` for
the newest frame, runs the model on it, and hands the frame's detections to :meth:`Stream.track`,
which gives every detection a ``track_id`` and returns the zone and line events it caused. One
frame of a stream is in flight at a time, so tracking sees its frames in order and a frame's age
is bounded by one batch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .analytics import Analytics, Line as CountLine, Zone
from .reader import Frame, StreamReader
from .tracker import ByteTracker

RATE_WINDOW_S = 5.0


@dataclass(slots=True)
class StreamFrame:
    """A frame taken for processing (a work item of its model's line)."""

    stream: "Stream"
    frame: Frame
    taken: float  # monotonic
    sample: np.ndarray | None = None
    geometry: object = None
    timings: dict = field(default_factory=dict)
    finished: bool = False

    @property
    def received(self) -> float:
        return self.frame.captured


@dataclass(frozen=True, slots=True)
class Tracked:
    """One processed frame: its detections with track ids, and the events they caused (without ids)."""

    detections: list
    events: list


class Stream:
    """A source bound to a model: reader, tracker and analytics (see the module docstring).

    Args:
        name: the stream's name (a topic level).
        model: the served model that processes it.
        reader: its reader (not started).
        zones: ``(name, points)`` pairs in source pixels.
        lines: ``(name, start, end)`` triples in source pixels.
    """

    def __init__(self, name: str, model: str, reader: StreamReader, zones=(), lines=()) -> None:
        self.name, self.model, self.reader = name, model, reader
        self.tracker = ByteTracker()
        self.analytics = Analytics([Zone(n, p) for n, p in zones], [CountLine(n, s, e) for n, s, e in lines])
        self.processed = 0
        self.frame_errors = 0
        self._in_flight = False
        self._lock = threading.Lock()
        self._rates: deque = deque()  # (monotonic, decoded, processed)
        self._counts = self.analytics.counts()  # a snapshot for status (other threads), taken after each frame
        self.accepting = True

    # the line's feed ----------------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.accepting and not self._in_flight and self.reader.ready()

    @property
    def in_flight(self) -> bool:
        return self._in_flight

    def take(self) -> StreamFrame | None:
        """The newest frame, now in flight; None when none waits or one is in flight already."""
        with self._lock:
            if self._in_flight or not self.accepting:
                return None
            frame = self.reader.take()
            if frame is None:
                return None
            self._in_flight = True
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

    # after inference --------------------------------------------------------------------------------
    def track(self, item: StreamFrame, detections: list[dict]) -> Tracked:
        """Track ids for ``detections`` (``{"index", "label", "score", "box"}`` in source pixels) and
        the zone/line events of this frame. Releases the frame."""
        try:
            boxes = np.asarray([d["box"] for d in detections], dtype=np.float64).reshape(-1, 4)
            scores = np.asarray([d["score"] for d in detections], dtype=np.float64)
            update = self.tracker.update(boxes, scores, [d["label"] for d in detections])
            out = [{**d, "track_id": int(t)} for d, t in zip(detections, update.ids)]
            events = self.analytics.update(update.active, update.removed)
            counts = self.analytics.counts()
            with self._lock:
                self._counts = counts
            self.processed += 1
            return Tracked(out, events)
        finally:
            self.release(item)

    # numbers ------------------------------------------------------------------------------------------
    def sample_rates(self, now: float | None = None) -> None:
        """Record the counts now (about once a second, by one thread): :meth:`rates` averages over them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            r = self._rates
            r.append((now, self.reader.decoded, self.processed))
            while len(r) > 2 and now - r[1][0] >= RATE_WINDOW_S:
                r.popleft()

    def rates(self) -> tuple[float, float]:
        """(fps_in, fps_processed) over the last :data:`RATE_WINDOW_S` seconds of samples."""
        with self._lock:
            if len(self._rates) < 2:
                return 0.0, 0.0
            (t0, d0, p0), (t1, d1, p1) = self._rates[0], self._rates[-1]
        return ((d1 - d0) / (t1 - t0), (p1 - p0) / (t1 - t0)) if t1 > t0 else (0.0, 0.0)

    def status(self) -> dict:
        """The stream's entry in the daemon's status."""
        fps_in, fps_processed = self.rates()
        with self._lock:
            counts = self._counts
        r = self.reader
        return {"state": r.state, "source": r.spec.shown, "model": self.model, "fps_in": round(fps_in, 2),
                "fps_processed": round(fps_processed, 2), "decoded": r.decoded, "processed": self.processed,
                "dropped": r.dropped, "corrupt": r.corrupt, "reconnects": r.reconnects, "last_error": r.last_error,
                "counts": counts}
