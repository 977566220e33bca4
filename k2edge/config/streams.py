"""``[[streams]]``: video sources bound to a detection model, with their zones and lines.

A source is a URI in jetson-inference's style (see :mod:`k2edge.streams.source` for what each
scheme means and which backend reads it). RTSP credentials may sit in the URI; they are redacted
everywhere the source is shown (logs, status, metrics). ``password_file`` keeps the password out of
the TOML altogether.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from .stream_escalation import EscalationRule
from .tables import Number, Strict as _Strict, bound, topic_level


def _name(value: str, what: str) -> str:
    return topic_level(value, what, narrow=True)


Point = tuple[Number, Number]


class ZoneConfig(_Strict):
    """A simple polygon in source pixels; a track's anchor (its box's bottom-centre) inside it is in the zone."""

    name: str
    points: tuple[Point, ...] = Field(min_length=3, description="[[x, y], ...] in source pixels, at least 3, in order "
                                      "around the area (edges that cross and repeated points are refused; the "
                                      "first point again at the end is dropped)")

    @field_validator("name")
    @classmethod
    def _check_name(cls, v):
        return _name(v, "zone name")

    @model_validator(mode="after")
    def _simple(self):
        from ..streams.analytics import Zone

        Zone(self.name, self.points)  # raises ValueError naming the edges that meet
        return self


class LineConfig(_Strict):
    """A segment in source pixels; a track's anchor crossing it is a ``line_cross`` event."""

    name: str
    start: Point
    end: Point

    @field_validator("name")
    @classmethod
    def _check_name(cls, v):
        return _name(v, "line name")

    @model_validator(mode="after")
    def _length(self):
        if tuple(self.start) == tuple(self.end):
            raise ValueError(f"line {self.name!r}: start and end are the same point")
        return self


class StreamConfig(_Strict):
    """One video source, processed by one served detection model."""

    name: str
    source: str = Field(description="file:///path.mp4 | rtsp://[user:pass@]host[:port]/path | v4l2:///dev/video0 | "
                                    "csi://0 | gst:<pipeline ending in an appsink>")
    model: str = Field(description="a [[models]] name; its card's task must be detection")
    fps: float | None = Field(None, gt=0, le=1000, description="frames per second to process; default the source's own rate")
    warm_fps: float | None = Field(None, gt=0, le=1000, description="thermal state warm: process at most this many "
                                   "frames per second; default half the stream's rate")
    hot_fps: float | None = Field(None, gt=0, le=1000, description="thermal state hot: at most this many; default a "
                                  "quarter of the stream's rate, at least 1 (never more than in warm)")
    enabled: bool = True
    loop: bool = Field(False, description="file:// sources: start again at the end instead of ending")
    pace: str = Field("realtime", pattern="^(realtime|every)$",
                      description="file:// sources: realtime plays the file at its own rate, dropping the frames the "
                      "model has no room for (a camera stand-in); every analyses every frame at the model's speed "
                      "(a recorded video in full; the thermal limit slows it instead of shedding frames)")
    backend: str = Field("auto", pattern="^(auto|pyav|gstreamer)$",
                         description="auto: gstreamer for csi:// and gst:, pyav (FFmpeg) for the rest")
    reconnect_max_s: float = Field(2.0, gt=0, le=3600, description="the cap of the jittered exponential reconnect backoff")
    read_timeout_s: float = Field(5.0, gt=0, le=3600, description="no decoded frame for this long is a stall: reconnect")
    open_timeout_s: float = Field(10.0, gt=0, le=3600, description="how long opening the source may take")
    password_file: Path | None = Field(None, description="the RTSP password (replaces one in the URI; never logged)")
    max_lost_s: float = Field(1.0, ge=0, le=3600, description="a track unseen for longer ends (zone_leave); so does "
                              "every track when the source comes back after an outage this long")
    snapshots: bool = Field(True, description="each zone and line event gets a snapshot (JPEG, the box drawn), "
                            "stored under the state directory and published on .../snapshots")
    clips: bool = Field(False, description="each zone and line event gets an MP4 clip remuxed from the source's "
                        "packets (PyAV sources), announced by a clip_ready event")
    pre_s: float = Field(3.0, ge=0, le=60, description="clips: seconds before the event (from the keyframe at or before)")
    post_s: float = Field(5.0, ge=0, le=60, description="clips: seconds after the event")
    zones: tuple[ZoneConfig, ...] = ()
    lines: tuple[LineConfig, ...] = ()
    escalation: tuple[EscalationRule, ...] = Field((), description="[[streams.escalation]]: the events K2 is asked "
                                                   "about (first match wins; needs [cloud])")

    _warm_within_fps = bound("warm_fps", "<=", "fps", "a thermal limit is at most the stream's own rate")
    _hot_within_fps = bound("hot_fps", "<=", "fps", "a thermal limit is at most the stream's own rate")
    _hot_within_warm = bound("hot_fps", "<=", "warm_fps", "hot is the hotter state")

    @field_validator("name")
    @classmethod
    def _check_name(cls, v):
        return _name(v, "stream name")

    @field_validator("source")
    @classmethod
    def _check_source(cls, v):
        from ..streams.source import parse_source

        parse_source(v)  # raises ValueError naming what is wrong (without the password)
        return v

    @model_validator(mode="after")
    def _pace(self):
        from ..streams.source import backend_for, parse_source

        spec = parse_source(self.source)
        if self.pace == "every" and spec.live:
            raise ValueError('pace = "every" is for file:// sources: a live source cannot wait for the model')
        backend_for(spec, self.backend)  # raises ValueError: this backend cannot read this kind of source
        return self

    @model_validator(mode="after")
    def _clips(self):
        if self.clips and (self.backend == "gstreamer" or self.source.startswith(("csi:", "gst:"))):
            raise ValueError("clips = true needs the pyav backend (its packet ring reads the source's encoded packets); "
                             "GStreamer sources have no clips yet")
        return self

    @model_validator(mode="after")
    def _unique(self):
        for what, items in (("zone", self.zones), ("line", self.lines)):
            names = [i.name for i in items]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{what} names must be unique within a stream, repeated: {dup}")
        zones, lines = {z.name for z in self.zones}, {ln.name for ln in self.lines}
        for i, r in enumerate(self.escalation):
            if r.zone is not None and r.zone not in zones:
                raise ValueError(f"escalation.{i}.zone: no zone {r.zone!r} in this stream; zones: {sorted(zones)}")
            if r.line is not None and r.line not in lines:
                raise ValueError(f"escalation.{i}.line: no line {r.line!r} in this stream; lines: {sorted(lines)}")
        return self


class StorageSettings(_Strict):
    """``[storage]``: the stream media (snapshots) under the state directory."""

    max_bytes: int = Field(2 * 1024 ** 3, gt=0, description="the most the media may take; the oldest go first to make "
                           "room (events are never removed)")
    max_age_days: float = Field(30.0, gt=0, le=36500, description="media older than this are removed")
