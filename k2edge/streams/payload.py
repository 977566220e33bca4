"""What a stream publishes, built in one place for the daemon and ``k2edge watch``."""

from __future__ import annotations

import time
import uuid

from .reader import Frame


def detections_payload(stream: str, frame: Frame, model: str, model_version: str | None, detections: list,
                       latency_ms: dict) -> dict:
    """One processed frame: ``{"stream", "frame", "pts", "captured_at", "model", "model_version",
    "detections": [{"index", "label", "score", "box", "track_id"}], "latency_ms"}``."""
    return {"stream": stream, "frame": frame.index, "pts": round(frame.pts, 6), "captured_at": frame.captured_at,
            "model": model, "model_version": model_version,
            "detections": [{k: d[k] for k in ("index", "label", "score", "box", "track_id")} for d in detections],
            "latency_ms": {k: round(v, 3) for k, v in latency_ms.items()}}


def frame_latency(wait_s: float, stage_s: float | None, infer_s: float, batch: int, age_s: float) -> dict:
    """A detections payload's ``latency_ms``, the daemon's and ``k2edge watch``'s alike: ``wait`` (decoded to taken),
    ``stage``, ``infer`` (the batch's run), ``batch`` (frames in it), ``age`` (decoded to answered)."""
    staged = {} if stage_s is None else {"stage": stage_s * 1e3}
    return {"wait": wait_s * 1e3, **staged, "infer": infer_s * 1e3, "batch": batch, "age": age_s * 1e3}


def event_payload(stream: str, event: dict, frame: int | None, at: float | None = None) -> dict:
    """One event: ``{"event_id", "event", "stream", "time", "frame", ...}`` plus the event's own keys
    (``track_id``, ``label``, ``zone`` | ``line``, ``direction``; ``reason`` for ``stream_down`` and an
    outage's ``zone_leave``); an event's own ``time`` or ``frame`` (an outage's zone leaves are dated when
    the stream went down) replaces ``at`` or ``frame``. ``event_id`` is new here and travels with the
    event's stored bytes, so it is stable."""
    return {"event_id": uuid.uuid4().hex, "event": event["event"], "stream": stream,
            "time": time.time() if at is None else at, "frame": frame,
            **{k: v for k, v in event.items() if k != "event"}}
