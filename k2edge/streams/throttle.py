"""How fast a stream may be processed: the thermal governor's limit and the gate that keeps it.

The thermal governor (:mod:`k2edge.telemetry.governor`) says which state holds; this module says what
that state means for a stream, as data (:class:`StreamLimit`), and keeps it with a :class:`FrameGate`
on the reader's thread, before a frame is even converted to RGB:

=============  ==================================================================================
``normal``     the stream's own rate (``fps``, or the source's)
``warm``       at most ``warm_fps`` (default: half the stream's rate)
``hot``        at most ``hot_fps`` (default: a quarter of the rate, at least 1 fps), never more than warm
``critical``   paused (0 fps): the reader keeps the connection and discards every frame, so the
               stream resumes at once, without a reconnect, when the device cools down
``unknown``    no throttling: a missing sensor is no reason to starve the cameras (the governor
               reports it; the daemon keeps its normal behaviour, as it does for requests)
=============  ==================================================================================

Frames the limit keeps out are *shed* and counted apart from the overload drops (a newer frame
replacing one the model had no room for). A stream whose rate is not known (no ``fps`` set and a
source that does not say its own) cannot be given half or a quarter of it: it is not throttled in
warm and hot unless ``warm_fps`` / ``hot_fps`` are set, and the limit's reason says so.

Pausing and resuming are stream events (:func:`paused_event`, :func:`resumed_event`), published like
``stream_up`` and ``stream_down``; :func:`limit_events` says which a change of limit causes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FrameGate", "NonrefSkip", "StreamLimit", "limit_events", "paused_event", "resumed_event", "stream_limit"]


@dataclass(frozen=True, slots=True)
class StreamLimit:
    """The most a stream may be processed at, and why.

    Attributes:
        thermal_state: the governor's state it follows.
        max_fps: frames per second at most: the stream's own rate when not throttled (None when that
            is not known), 0 when paused.
        throttled: True when the limit is below the stream's own rate (frames are shed).
        reason: for the status, the live view and the ``stream_paused`` event.
    """

    thermal_state: str
    max_fps: float | None
    throttled: bool
    reason: str

    @property
    def paused(self) -> bool:
        return self.max_fps == 0

    @property
    def gate_fps(self) -> float | None:
        """What the reader's :class:`FrameGate` keeps to: None (every frame) when not throttled."""
        return self.max_fps if self.throttled else None

    def to_dict(self) -> dict:
        return {"thermal_state": self.thermal_state, "max_fps": _round(self.max_fps), "throttled": self.throttled,
                "reason": self.reason}


def stream_limit(state: str, fps: float | None, warm_fps: float | None = None, hot_fps: float | None = None,
                 cause: str | None = None) -> StreamLimit:
    """The limit a thermal state puts on a stream (see the module docstring).

    Args:
        state: the governor's state (``normal``, ``warm``, ``hot``, ``critical`` or ``unknown``).
        fps: the stream's own rate (its ``fps``, or the source's when lower or when none is set); None
            when not known yet.
        warm_fps: the stream's ``warm_fps`` (None: half of ``fps``).
        hot_fps: the stream's ``hot_fps`` (None: a quarter of ``fps``, at least 1).
        cause: the governor's reason for the state, quoted in the limit's reason.

    Returns:
        The limit; never above ``fps``, and hot never above warm.

    Raises:
        ValueError: an unknown state.
    """
    why = f"thermal {state}" + (f" ({cause})" if cause else "")
    if state in ("normal", "unknown"):
        own = "its own rate" if fps is not None else "its own rate (not known yet)"
        extra = "; no sensor to judge by, so not throttled" if state == "unknown" else ""
        return StreamLimit(state, fps, False, f"{why}: {own}{extra}")
    if state == "critical":
        return StreamLimit(state, 0.0, True, f"{why}: paused (the source stays open, its frames are discarded)")
    if state not in ("warm", "hot"):
        raise ValueError(f"thermal state must be normal, warm, hot, critical or unknown, got {state!r}")
    warm, warm_how = _choice(warm_fps, "warm_fps", fps and fps / 2, "half its rate")
    limit, how = warm, warm_how
    if state == "hot":
        limit, how = _choice(hot_fps, "hot_fps", fps and max(1.0, fps / 4), "a quarter of its rate, at least 1 fps")
        if warm is not None and (limit is None or warm < limit):
            limit, how = warm, f"{warm_how}: hot is never faster than warm"
    if limit is None:
        setting = "warm_fps" if state == "warm" else "hot_fps"
        return StreamLimit(state, None, False, f"{why}: not throttled: the stream's rate is not known "
                                                f"(set fps or {setting})")
    if fps is not None and limit >= fps:
        return StreamLimit(state, fps, False, f"{why}: its own rate ({how} {_round(limit):g} fps is not below it)")
    return StreamLimit(state, float(limit), True, f"{why}: at most {_round(limit):g} fps ({how})")


class FrameGate:
    """Which frames to keep so that at most ``max_fps`` pass: one per period, on a schedule.

    Each kept frame moves the schedule on by exactly one period (not to the frame's time plus a
    period), so frames that arrive on a grid of a higher rate pass at ``max_fps`` on average, without
    drifting slower; a frame up to a quarter period early counts as on time (timestamps jitter). A
    clock that jumps back (a looping file's pts starting again) or a gap of more than a period (a
    stall) restarts the schedule. Frame times on another rate's grid never meet a schedule point
    exactly in floating point, so no comparison here relies on equality.

    Args:
        max_fps: frames per second to keep; None: every frame; 0: none.
    """

    def __init__(self, max_fps: float | None = None) -> None:
        self.max_fps: float | None = None
        self._due: float | None = None
        self.set(max_fps)

    def set(self, max_fps: float | None) -> None:
        """A new rate, from the next frame on (the schedule starts again when it changes)."""
        if max_fps is not None and max_fps < 0:
            raise ValueError(f"max_fps must be >= 0 or None, got {max_fps}")
        if max_fps != self.max_fps:
            self.max_fps, self._due = max_fps, None

    @property
    def due(self) -> float:
        """When the next frame is due on the gate's clock (-inf before the first or without a rate)."""
        return float("-inf") if self._due is None or not self.max_fps else self._due - 1.0 / self.max_fps / 4

    def keep(self, t: float) -> bool:
        """Whether the frame at time ``t`` (seconds, any origin; non-decreasing except for jumps) passes."""
        if self.max_fps is None:
            return True
        if self.max_fps == 0:
            return False
        period, due = 1.0 / self.max_fps, self._due
        if due is None or t < due - 2 * period:  # the first frame, or the clock went back (a file looping)
            self._due = t + period
            return True
        if t < due - period / 4:
            return False
        # on schedule: the next is due a period after this one was; after a gap, a period after this frame
        self._due = due + period if t < due + period else t + period
        return True


def paused_event(reason: str) -> dict:
    """``stream_paused``: the thermal limit stopped the stream's processing (its source stays open)."""
    return {"event": "stream_paused", "reason": reason}


def resumed_event(reason: str) -> dict:
    """``stream_up`` after a pause: frames are processed again (``reason``: the limit now)."""
    return {"event": "stream_up", "reason": reason}


def limit_events(old: StreamLimit, new: StreamLimit, reader_state: str) -> list[dict]:
    """The events a change of limit causes: ``stream_paused`` when it pauses a stream that is not over
    (``ended`` or ``down``), ``stream_up`` when it resumes one that is up (a reader that is not up
    announces ``stream_up`` itself when its source comes back)."""
    if new.paused and not old.paused and reader_state not in ("ended", "down"):
        return [paused_event(new.reason)]
    if old.paused and not new.paused and reader_state == "up":
        return [resumed_event(new.reason)]
    return []


def _choice(setting: float | None, setting_name: str, default: float | None, default_how: str):
    """(the limit, how it was chosen): the setting, else the default (None when the rate is not known)."""
    if setting is not None:
        return setting, setting_name
    return (default, default_how) if default is not None else (None, None)


def _round(v: float | None) -> float | None:
    return None if v is None else round(float(v), 3)


SKIP_WINDOW_S = 1.0
"""How often :class:`NonrefSkip` judges the share of decoded frames the processing side used."""
SKIP_ON_SHARE = 1 / 3
"""Skip non-reference frames when the processing side used fewer than this share of the frames decoded: an
IBBP stream's reference frames alone are a third of it, so no frame it would have taken is lost."""
SKIP_OFF_SHARE = 0.9
"""Decode every frame again when, while skipping, the processing side used at least this share of those decoded:
it may be able to take more than the reference frames."""


class NonrefSkip:
    """Whether the decoder may skip non-reference frames (B-frames no other frame is predicted from): judged once a
    window from the share of decoded frames that were used (taken for processing) rather than replaced in the slot,
    dropped by ``fps`` or shed.

    A stream decodes every frame of its source whatever the model takes: a processing side three times slower than
    the camera (the stream overload bench: YOLOv8n on two cores, four 15 fps streams, 3.5 frames/s each) spends
    three quarters of its decoding on frames it replaces. Non-reference frames can be skipped without breaking the
    decode of the others (FFmpeg's ``skip_frame = NONREF``); the newest frame in the slot is then a reference
    frame, at most the stream's B-frame run older. Streams without B-frames (most cameras' H.264) skip nothing.
    """

    def __init__(self, window_s: float = SKIP_WINDOW_S) -> None:
        self.window_s = window_s
        self.on = False
        self._since: float | None = None
        self._decoded = self._used = 0
        self._reset = False

    def reset(self) -> None:
        """Decode every frame again from the next one and judge afresh: what kept the use low changed (a new thermal
        limit: a stream that resumes after a pause is processed at its full rate at once, not a window later)."""
        self._since, self._decoded, self._used = None, 0, 0
        if self.on:
            self.on, self._reset = False, True

    def decoded(self, now: float) -> bool | None:
        """A frame left the decoder at ``now`` (monotonic s); the new setting when the window's judgement (or a
        :meth:`reset`) changes it."""
        if self._since is None:
            self._since = now
        self._decoded += 1
        if self._reset:
            self._reset = False
            return False
        if now - self._since < self.window_s or self._decoded < 3:
            return None
        share, self._since, self._decoded, self._used = self._used / self._decoded, now, 0, 0
        if self.on != (share < SKIP_ON_SHARE if not self.on else share < SKIP_OFF_SHARE):
            self.on = not self.on
            return self.on
        return None

    def used(self) -> None:
        """A decoded frame was taken for processing."""
        self._used += 1
