"""One source's connection: a thread that decodes continuously and keeps only the newest frame.

States (:data:`STATES`)::

    starting --first frame--> up --error / live source ended / no frame for read_timeout_s--> reconnecting
    reconnecting --first frame after a reopen--> up
    starting | reconnecting --a failure retrying cannot help (no such file, no video stream)--> down
    up --a file's end (loop = false)--> ended
    any but ended and down --stop(), its threads gone--> stopped

A frame waits in the reader's slot until the processing side takes it; a newer one replaces it
and the older is counted as dropped, never queued. So a processed frame is at most one frame
interval plus one batch old, however slow the model (the lag of users' capture loops is a queue).

The reader never blocks its owner: opening and reading are bounded by the backend's timeouts,
and the watchdog (:meth:`StreamReader.check`) declares a stall after ``read_timeout_s`` without a
decoded frame whatever the backend does, abandons the stuck thread (it exits when its read
returns) and reconnects with a fresh one. Reconnections back off exponentially with jitter, capped
at ``reconnect_max_s``.

Pacing (``pace``): ``live`` keeps the newest frame; ``realtime`` plays a file at its own frame
rate (a camera stand-in: what the daemon does with ``file://`` by default); ``every`` hands over every frame,
waiting for it to be taken (``k2edge watch`` on a file, a stream's ``pace = "every"``): a recorded video analysed
in full at the model's speed, whatever the machine's. Under ``every`` a frame's :attr:`Frame.time` is the file's
own timeline (continued across loops), so the tracker sees the video's time, not the machine's.

Two :class:`~k2edge.streams.throttle.FrameGate` s pick the frames kept, on the frame's time (a file's
pts, a camera's arrival): ``fps`` (the rest are dropped, as configured) and then the thermal limit
(:meth:`StreamReader.limit`; the rest are *shed*, counted apart). A limit of 0 pauses the stream: every
frame is read and discarded, so the connection stays open and no stall is declared. Under ``every`` the
thermal limit sheds nothing: it slows the hand-over to at most its rate on the wall clock (0: it waits
until the pause ends), so every frame is still analysed, only later.

While the processing side uses under a third of the frames decoded (a model slower than the camera, ``fps``, the
thermal limit), a PyAV capture skips decoding non-reference frames (:class:`~k2edge.streams.throttle.NonrefSkip`),
counted as *skipped*; pace ``every`` decodes every frame.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from ..backoff import backoff
from .capture import Capture, SourceError, open_capture
from .source import SourceSpec
from .throttle import FrameGate, NonrefSkip

log = logging.getLogger(__name__)

STATES = ("starting", "up", "reconnecting", "down", "ended", "stopped")
RECONNECT_MIN_S = 0.1


@dataclass(slots=True)
class Frame:
    """One decoded frame.

    Attributes:
        index: 0-based, counted from the stream's first open (it keeps counting across reconnects); the
            non-reference frames skipped before it count too, so on a file it is the frame's position.
        pts: seconds on the source's own timeline (may restart after a reconnect).
        captured_at: Unix time at which it was decoded.
        captured: the same instant on the monotonic clock (frame age).
        time: the frame's time for tracking, in seconds: :attr:`captured`, or under pace ``every`` the
            file's timeline continued across loops (a file read faster or slower than its rate).
        picture: the decoder's frame (converted to RGB only when :attr:`image` is first read: a
            frame replaced before it is processed is never converted), or an (H, W, 3) array.
        restarts: how often the file had been read from its start again before this frame (a loop, or a reopen
            after a read error): a frame of a new pass follows one of the last, and what was in view is not any
            more, whatever frames were dropped between. Always 0 on a live source.
    """

    index: int
    pts: float
    captured_at: float
    captured: float
    time: float
    picture: object
    restarts: int = 0

    @property
    def image(self) -> np.ndarray:
        """(H, W, 3) uint8 RGB."""
        if not isinstance(self.picture, np.ndarray):
            self.picture = self.picture.to_ndarray(format="rgb24", **_rgb_options())
        return self.picture


@functools.cache
def _rgb_options() -> dict:
    """PyAV 17 spreads a conversion over a thread per core by default: for a 640 x 480 frame on cores the engine keeps
    busy, the hand-offs cost more than they save (0.26 against 0.19 CPU ms, and up to 1.6 against 0.8 ms on the
    converting thread's wall clock), so the conversion runs on the thread that asks for it. Earlier versions use one."""
    import av  # a picture to convert means PyAV is loaded

    return {"threads": 1} if int(av.__version__.split(".")[0]) >= 17 else {}


def state_event(old: str, new: str, reason: str | None) -> dict | None:
    """The event a state change is, if any: ``stream_up`` (the first frame after an open or a reopen),
    ``stream_down`` (leaving ``up``, the first sign of loss, or a first open that failed: a camera
    misconfigured from the start; with its reason), ``stream_ended``."""
    if new == "up":
        return {"event": "stream_up"}
    if old in ("up", "starting") and new in ("reconnecting", "down"):
        return {"event": "stream_down", "reason": reason}
    if new == "ended":
        return {"event": "stream_ended"}
    return None


class ReaderListener(Protocol):
    def on_state(self, reader: "StreamReader", old: str, new: str, reason: str | None) -> None:
        """A state change (the reader's or the watchdog's thread): ``up`` is a stream_up, leaving
        ``up`` for ``reconnecting``/``down`` a stream_down, ``ended`` a stream_ended."""

    def on_frame(self, reader: "StreamReader") -> None:
        """A new frame waits in the slot (wake the processing side)."""


class StreamReader:
    """See the module docstring.

    Args:
        name: the stream's name (logs).
        spec: the parsed source.
        listener: told of state changes and new frames.
        backend: ``pyav`` or ``gstreamer``.
        pace: ``live``, ``realtime`` or ``every`` (see the module docstring); live sources are always ``live``.
        fps: frames per second to keep; the rest are dropped (counted). None: every frame.
        loop: a file starts again at its end.
        opener: opens a source (tests inject a failing one; default :func:`open_capture`).
        packets: a :class:`~k2edge.streams.evidence.clips.PacketRing` fed every demuxed packet (clips;
            PyAV captures only), or None.
    """

    def __init__(self, name: str, spec: SourceSpec, listener: ReaderListener, *, backend: str = "pyav",
                 pace: str = "live", fps: float | None = None, loop: bool = False, read_timeout_s: float = 5.0,
                 reconnect_max_s: float = 2.0, open_timeout_s: float = 10.0,
                 opener: Callable[..., Capture] = open_capture, packets=None) -> None:
        self.name, self.spec, self.listener = name, spec, listener
        self.backend, self.fps, self.loop = backend, fps, loop
        self.pace = "live" if spec.live else pace
        self.read_timeout_s, self.reconnect_max_s, self.open_timeout_s = read_timeout_s, reconnect_max_s, open_timeout_s
        self._open = opener
        self.packets = packets
        self._cond = threading.Condition()
        self._frame: Frame | None = None
        self._generation = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self.state = "starting"
        self.last_error: str | None = None
        self.decoded = self.dropped = self.reconnects = self.shed = self.skipped = 0
        # whether to skip non-reference frames: judged across reopenings and loops (the processing side stays the same)
        self._skip = NonrefSkip() if self.pace != "every" and backend == "pyav" else None
        self._corrupt_closed = 0  # corrupt packets of captures closed since
        self._capture: Capture | None = None
        self.source_fps: float | None = None
        self._next_index = 0
        self._last_frame = time.monotonic()
        self._media_end = None  # pace every: the file time after the last frame handed over (loops continue it)
        self.restarts = 0  # how often the file was read from its start again
        self._opened = False  # a capture was opened once: the next one of a file starts it again
        self._held = False  # pace every: waiting for the thermal limit's next slot (not a stall)
        self._fps_gate = FrameGate(fps or None)  # fps throttling (dropped)
        self._limit_gate = FrameGate()  # the thermal limit (shed)

    # lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._spawn()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop reading; True when every reader thread exited within ``timeout``."""
        with self._cond:
            self._stopping = True
            self._generation += 1
            self._cond.notify_all()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        ended = not any(t.is_alive() for t in self._threads)
        with self._cond:  # read no more: the daemon's last status says so (an ended file or a source given up stays)
            if ended and self.state not in ("ended", "down"):
                self.state = "stopped"
        return ended

    def _spawn(self) -> None:
        gen = self._generation
        t = threading.Thread(target=self._run, args=(gen,), name=f"k2edge-stream-{self.name}", daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    @property
    def corrupt(self) -> int:
        """Packets that could not be decoded (skipped), the open capture's included."""
        cap = self._capture
        return self._corrupt_closed + (cap.corrupt if cap is not None else 0)

    def count_dropped(self, n: int = 1) -> None:
        """``n`` frames taken for processing were never processed (they failed)."""
        with self._cond:
            self.dropped += n

    @property
    def last_index(self) -> int | None:
        """The index of the newest decoded frame (None before the first)."""
        return self._next_index - 1 if self._next_index else None

    def limit(self, max_fps: float | None) -> float:
        """Keep at most ``max_fps`` of the frames ``fps`` keeps, from the next frame on (None: all; 0: none,
        the stream paused); the rest are counted as shed. Under pace ``every`` nothing is shed: the hand-over slows
        to that rate (0: it waits). Returns when it took effect (Unix time): every frame whose ``captured_at`` is
        earlier was kept or shed by the old limit, every later one by the new."""
        with self._cond:
            if max_fps != self._limit_gate.max_fps and self._skip is not None:
                self._skip.reset()
            self._limit_gate.set(max_fps)
            if max_fps == 0 and self._frame is not None and self.pace != "every":  # paused: the waiting frame goes too
                self._frame = None
                self.shed += 1
            self._cond.notify_all()  # a reader waiting for room in the slot, or (pace every) for its slot, looks again
            return time.time()  # under the lock, as each frame's captured_at is

    # the processing side ----------------------------------------------------------------------------
    def ready(self) -> bool:
        return self._frame is not None

    def take(self) -> Frame | None:
        """The newest frame, or None; the slot is empty afterwards."""
        with self._cond:
            frame, self._frame = self._frame, None
            if frame is not None:
                if self._skip is not None:
                    self._skip.used()
                self._cond.notify_all()  # pace "every": the thread may decode the next
            return frame

    def check(self, now: float | None = None) -> None:
        """The stall watchdog (call it about once a second): no decoded frame for ``read_timeout_s``
        while up is a stall, whatever the backend's own timeouts do."""
        now = time.monotonic() if now is None else now
        with self._cond:
            if self.state != "up" or self._stopping or now - self._last_frame < self.read_timeout_s:
                return
            if self.pace == "every" and (self._frame is not None or self._held):
                return  # waiting for the frame to be taken, or for the thermal limit's slot, is not a stall
            self._generation += 1  # the stuck thread's frames are ignored; it exits when its read returns
            self._cond.notify_all()
            self._spawn()  # under the lock: the new thread's first state change waits for this one's
            stalled = now - self._last_frame
        self._set_state("reconnecting", f"no frame for {stalled:.1f} s (stalled)")

    # the reader thread --------------------------------------------------------------------------------
    def _current(self, gen: int) -> bool:
        return gen == self._generation and not self._stopping

    def _run(self, gen: int) -> None:
        attempt = 0
        while self._current(gen):
            cap = None
            try:
                cap = self._open(self.spec, self.backend, self.open_timeout_s, self.read_timeout_s)
                self._capture = cap
                if not self.spec.live and self._opened:
                    self.restarts += 1  # a file opened again reads from its start: a new pass
                self._opened = True
                self.source_fps = cap.fps or self.source_fps
                if self.packets is not None and hasattr(cap, "tap"):
                    cap.tap(self.packets, lambda p, gen=gen: self._current(gen) and self.packets.add(p))
                self._read(gen, cap)
                if not self._current(gen):
                    return
                if not self.spec.live:
                    if self.loop:
                        attempt = 0
                        continue
                    self._set_state("ended", None)
                    return
                reason = "the source ended (a live source that ends is a disconnect)"
            except SourceError as exc:
                reason = str(exc)
                if exc.permanent:
                    if self._current(gen):
                        self._set_state("down", reason)
                    return
            except Exception as exc:  # a backend bug must not kill the stream: it is a disconnect
                log.exception("stream %s: reading failed", self.name)
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                if cap is not None:
                    with self._cond:
                        self._corrupt_closed += cap.corrupt
                        if self._capture is cap:
                            self._capture = None
                    if self.packets is not None and self._current(gen):
                        self.packets.close_capture()  # clips asked for or being written end with this capture
                    cap.close()
            if not self._current(gen):
                return
            self._set_state("reconnecting", reason)
            delay = backoff(attempt, RECONNECT_MIN_S, self.reconnect_max_s)
            attempt += 1
            with self._cond:
                self._cond.wait_for(lambda: not self._current(gen), delay)

    def _read(self, gen: int, cap: Capture) -> None:
        start_wall = first_pts = last_pts = None
        origin = None  # pace every: this capture's pts 0 on the stream's file timeline
        skip = self._skip if hasattr(cap, "skip_nonref") else None
        skipped_here = False  # whether this capture's decoder has skipped: its frames still in flight skip after it stops
        if skip is not None and skip.on:
            cap.skip_nonref(True)
            skipped_here = True
        for picture, pts in cap.frames():
            now = time.monotonic()
            if not self._current(gen):
                return
            skipping = None
            if self.pace == "realtime":  # a file as a camera: each frame at its time
                if start_wall is None:
                    start_wall, first_pts = now, pts
                wait = start_wall + (pts - first_pts) - now
                if wait > 0:
                    with self._cond:
                        if self._cond.wait_for(lambda: not self._current(gen), wait):
                            return
                    now = time.monotonic()
            t_track = now
            if self.pace == "every":
                if origin is None:
                    origin = (self._media_end or 0.0) - pts
                t_track = origin + pts
                self._media_end = t_track + 1.0 / (self.source_fps or 30.0)
            with self._cond:
                if not self._current(gen):
                    return
                gap = 0  # frames of the source between the last decoded one and this one, not decoded
                if skip is not None:
                    if last_pts is not None and self.source_fps:
                        gap = min(max(round((pts - last_pts) * self.source_fps) - 1, 0), 16)
                        if skipped_here:
                            self.skipped += gap
                    skipping = skip.decoded(now)
                self._next_index += gap  # a skipped frame has its number too: on a file, index is its position
                frame = Frame(self._next_index, pts, time.time(), now, t_track, picture, self.restarts)
                self._next_index += 1
                self.decoded += 1
                self._last_frame = now
                last_pts = pts
                first = self.state != "up"
                t = pts if not self.spec.live else now
                if not self._fps_gate.keep(t):
                    self.dropped += 1  # throttled to fps
                    frame = None
                elif self.pace != "every" and not self._limit_gate.keep(t):
                    self.shed += 1  # the thermal limit
                    frame = None
                if frame is not None and self.pace != "every" and not first:
                    self._place(frame)
            if skipping is not None:
                cap.skip_nonref(skipping)
                skipped_here = skipped_here or skipping
                log.debug("stream %s: %s non-reference frames", self.name, "skipping" if skipping else "decoding")
            if first:
                if self.state == "reconnecting":
                    self.reconnects += 1
                self._set_state("up", None)
                if frame is not None and self.pace != "every":  # up first: no one takes a frame of a stream not yet up
                    with self._cond:
                        if not self._current(gen):
                            return
                        if self._limit_gate.max_fps == 0:
                            self.shed += 1  # paused as it came up (told "up", the stream took its thermal limit)
                        else:
                            self._place(frame)
            if frame is not None and self.pace == "every":  # up first: a stream paused from its start is up
                with self._cond:
                    self._cond.wait_for(lambda: self._frame is None or not self._current(gen))
                    if not self._slot(gen):
                        return
                    self._frame = frame
            if frame is not None:
                self._tell(self.listener.on_frame, self)

    def _place(self, frame: Frame) -> None:
        """The newest frame waits to be taken (the lock held); the one it replaces was never processed."""
        if self._frame is not None:
            self.dropped += 1
        self._frame = frame

    def _slot(self, gen: int) -> bool:
        """Pace ``every`` under a thermal limit (the lock held): wait for the limit's next slot on the wall clock
        (a pause: until it ends); False when the reader is stopping or superseded meanwhile."""
        self._held = True
        try:
            while self._current(gen):
                gate = self._limit_gate
                if gate.max_fps is None:
                    return True
                now = time.monotonic()
                if gate.max_fps > 0 and gate.keep(now):
                    return True
                self._cond.wait(0.5 if gate.max_fps == 0 else max(gate.due - now, 0.001))
            return False
        finally:
            self._held = False
            self._last_frame = time.monotonic()

    def _set_state(self, new: str, reason: str | None) -> None:
        with self._cond:
            old = self.state
            if old == new:
                if reason:
                    self.last_error = reason
                return
            self.state = new
            if reason:
                self.last_error = reason
            if new == "up":
                self._last_frame = time.monotonic()
        if new in ("reconnecting", "down") and reason:
            log.warning("stream %s: %s: %s", self.name, new, reason)
        else:
            log.info("stream %s: %s", self.name, new)
        self._tell(self.listener.on_state, self, old, new, reason)

    def _tell(self, callback, *args) -> None:
        """A listener's failure (a full disk under the event store) must not stop the reader."""
        try:
            callback(*args)
        except Exception:
            log.exception("stream %s: the listener failed", self.name)
