"""The frames' path: from a stream's reader to published detections and events, in the order it happens.

Source -> model -> sinks: a reader is the source, the model's batcher runs the frames, and the
detections and events are what a processed frame is handed on to.

1. **read** (:class:`~k2edge.streams.reader.StreamReader`, one thread per stream): decode
   continuously, keep only the newest frame, wake the model's batcher.
2. **take** (:class:`StreamFrames`, the batcher's frame client): when the engine has room, after the
   waiting requests, the newest frame of each stream of that model with none in flight (frames of
   several streams batch together, as DeepStream's nvstreammux does). Frames that find no room are
   replaced by newer ones (dropped); a frame never waits for companions.
3. **stage** (:meth:`StreamPath.stage`, on the batcher): the frame's pixels into a sample by the card.
4. **infer**: in the same batch as the requests (:class:`~k2edge.service.batcher.Batcher`).
5. **finish** (:meth:`StreamPath.finish`): decode detections, track, zones and lines
   (:meth:`Stream.track <k2edge.streams.stream.Stream.track>`), then publish: the detections at
   QoS 0; the events stored in the :class:`~k2edge.service.event_store.EventStore` first, then
   published at QoS 1 and marked delivered when the broker acknowledges them.
6. **evidence** (:meth:`StreamPath.evidence`, on the :class:`~k2edge.streams.evidence.EvidenceWorker`'s
   thread, never the batcher's): a frame's zone and line events wait there for their snapshots (drawn,
   encoded, written to the :class:`~k2edge.streams.evidence.MediaStore`); then the events are stored,
   each snapshot is published raw on ``.../snapshots`` and the events on ``.../events``. A snapshot that
   cannot be made (the queue full, the disk full) leaves its event intact with ``snapshot_error``. A file's
   ``stream_ended`` waits for the frames read before the end (:meth:`Stream.defer_end
   <k2edge.streams.stream.Stream.defer_end>`), then goes out behind their events, on this thread.

7. **escalation** (:mod:`k2edge.service.stream_escalation`): an event a stream's ``[[streams.escalation]]`` rules
   select gets a durable job, written before the event is stored; a worker asks K2 off the frame path and the
   answer comes back as a follow-up event (``<event_id>.k2``) through the same store-then-publish path.

Streams are read from the config at start; a changed ``[[streams]]`` takes effect at the next start.
"""

from __future__ import annotations

import functools
import json
import shutil
import logging
import threading
import time

from .. import tracing
from ..config.streams import StreamConfig
from ..deadline import clock
from ..errors import InputError
from ..streams.evidence import EvidenceWorker, MediaStore, render_snapshot
from ..streams.evidence.clips import ClipInfo, PacketRing
from ..streams.payload import detections_payload, event_payload, frame_latency
from ..streams.reader import Frame, StreamReader, state_event
from ..streams.source import backend_for, parse_source
from ..streams.stream import Stream, StreamFrame, Tracked
from . import topics
from .batcher import BatchClient
from .event_store import EventStore
from .stream_escalation import EscalationJobs, StreamEscalations

log = logging.getLogger(__name__)

_ENDED = object()  # an evidence job's marker: a file's stream_ended, behind its last frames' events


class StreamPath:
    """Every stream of the daemon, and what happens to their frames (see the module docstring).

    Args:
        configs: the enabled ``[[streams]]``.
        prefix: the topic prefix.
        publisher: the request connection (``publish(topic, payload, qos, on_delivered=...)``).
        events: the event store.
        wakeups: each model's batcher condition, notified when one of its streams has a new frame.
        metrics: the Prometheus exporter, or None.
        on_change: called (no arguments) when a stream's state changed: republish the status.
        media: where snapshots are written; None: no snapshots.
        cloud: the daemon's cloud bridge, for the streams' escalation rules (None: without [cloud]).
        passwords: stream name -> the password its ``password_file`` holds (read by the daemon before the engines).
    """

    def __init__(self, configs: list[StreamConfig], prefix: str, publisher, events: EventStore,
                 wakeups: dict[str, threading.Condition], metrics=None, on_change=None,
                 media: MediaStore | None = None, cloud=None, passwords: dict[str, str] | None = None) -> None:
        self.prefix, self.publisher, self.events, self.metrics = prefix, publisher, events, metrics
        self.media = media
        # clips being cut are written here, then moved into the media store; a crash's leftovers go at the start
        self.spool = media.root / "cutting" if media is not None else None
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)
        self.on_change = on_change
        self.wakeups = wakeups
        self.streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._delivered: list[str] = []  # event ids the broker acknowledged, written to the store by tick()
        for c in configs:
            spec = parse_source(c.source, (passwords or {}).get(c.name))
            ring = PacketRing(self.spool, c.pre_s, c.post_s) if c.clips and media is not None else None
            reader = StreamReader(c.name, spec, self, backend=backend_for(spec, c.backend), pace=c.pace, fps=c.fps,
                                  loop=c.loop, read_timeout_s=c.read_timeout_s, reconnect_max_s=c.reconnect_max_s,
                                  open_timeout_s=c.open_timeout_s, packets=ring)
            self.streams[c.name] = Stream(c.name, c.model, reader, [(z.name, z.points) for z in c.zones],
                                          [(ln.name, ln.start, ln.end) for ln in c.lines], max_lost_s=c.max_lost_s,
                                          snapshots=c.snapshots and media is not None, warm_fps=c.warm_fps,
                                          hot_fps=c.hot_fps, rules=c.escalation if cloud is not None else ())
        self.escalations = None
        if cloud is not None and any(s.rules for s in self.streams.values()):
            jobs = EscalationJobs(events.path.parent / "stream_escalations.sqlite3")
            self.escalations = StreamEscalations(cloud, jobs, events, self, metrics)
        wanted = any(s.snapshots or s.reader.packets is not None or s.rules for s in self.streams.values())
        self.evidence = EvidenceWorker(self.evidence_step) if wanted else None

    # lifecycle ------------------------------------------------------------------------------------
    def follow_labels(self, model: str, labels) -> None:
        """``model``'s labels, at start and after a deploy: each of its streams checks its rules against them."""
        for s in self.streams.values():
            if s.model == model:
                s.follow_labels(labels)

    def frames(self, model: str) -> "StreamFrames":
        """Model ``model``'s frame client (for its batcher)."""
        return StreamFrames(self, [s for s in self.streams.values() if s.model == model])

    def start(self) -> None:
        """Republish events a previous run stored and never saw delivered (each after its snapshot, when its file is
        still there), then start reading."""
        for event_id, topic, payload in self.events.pending():
            snapshot = _snapshot_of(payload)
            jpeg = self.media.read(event_id, "jpg") if snapshot is not None and self.media is not None else None
            if jpeg is not None:
                self.publisher.publish(snapshot["topic"], jpeg, qos=1, content_type="image/jpeg", user=(("event_id", event_id),))
            self.publisher.publish(topic, payload, qos=1, on_delivered=functools.partial(self._on_delivered, event_id))
        if self.evidence is not None:
            self.evidence.start()
        if self.escalations is not None:
            self.escalations.start()
        for s in self.streams.values():
            s.reader.start()

    def stop(self, timeout: float) -> None:
        """Stop taking frames, stop the readers and let the frames in flight finish (within ``timeout`` in
        all): their events are stored before the event store closes."""
        end = time.monotonic() + timeout
        for s in self.streams.values():
            s.accepting = False
        for s in self.streams.values():
            if not s.reader.stop(max(0.1, end - time.monotonic())):
                log.warning("stream %s: its reader did not stop in time (a backend read still blocks)", s.name)
            elif s.reader.packets is not None:
                s.reader.packets.close_capture()  # the reader is gone: its clips being written end here
        # until every frame taken has handed its events on (a frame in flight is unconcluded too: it is released first)
        while any(s.unconcluded for s in self.streams.values()) and time.monotonic() < end:
            time.sleep(0.01)
        for s in self.streams.values():  # an ended file whose last frame was left unread: announced now
            ended = s.take_end()
            if ended is not None:
                self._announce_end(s, *ended, stopping=True)
        if self.evidence is not None and not self.evidence.stop(max(0.1, end - time.monotonic())):
            log.warning("streams: %d frame(s) with events still wait for their snapshots; their events are lost",
                        self.evidence.waiting)
        if self.escalations is not None:  # a cloud call in flight is abandoned: its job runs at the next start
            self.escalations.stop(max(0.1, end - time.monotonic()))

    def close(self) -> None:
        """After the broker connection is gone: the last acknowledgements, then the event store."""
        self._write_delivered()
        if self.escalations is not None:
            self.escalations.close()
        self.events.close()

    # the reader's listener ------------------------------------------------------------------------
    def on_frame(self, reader: StreamReader) -> None:
        cond = self.wakeups.get(self.streams[reader.name].model)
        if cond is not None:
            with cond:
                cond.notify()

    def on_state(self, reader: StreamReader, old: str, new: str, reason: str | None) -> None:
        event = state_event(old, new, reason)
        stream = self.streams[reader.name]
        stream.on_state(old, new, reason)
        # back while paused: its stream_up is when the pause ends; back as a pause ends: announced once
        events = stream.announced([event] if event is not None else [])
        self._observe(stream)
        if events and new == "ended":  # after the events of the frames read before the end
            if not stream.defer_end((events, reader.last_index)):
                self._announce_end(stream, events, reader.last_index)
        elif events:
            self._publish_events(stream, events, reader.last_index)
        if self.on_change is not None:
            self.on_change()

    def _announce_end(self, stream: Stream, events: list[dict], index: int | None, stopping: bool = False) -> None:
        """A file's stream_ended, once its frames are handed on, after the ends of the tracks still open
        (:meth:`Stream.end_of_file`): behind the frames' events on the evidence thread (those wait there for their
        snapshots and clips), else at once. With the evidence queue full it waits for the next tick (not ahead of
        the frames in the queue), unless the daemon is stopping."""
        if not self._uses_evidence(stream):
            self._publish_end(stream, events, index)
        elif not self.evidence.submit((stream, _ENDED, events, index)):
            if stopping:
                self._publish_end(stream, events, index)
            else:
                stream.keep_end((events, index))

    def _publish_end(self, stream: Stream, events: list[dict], index: int | None) -> None:
        # a frame still in flight (a stop that did not wait for it) is being tracked on the batcher's thread: the tracks
        # are left as they are then (no frame can be taken any more: the stream accepts none once the stop began)
        tracks = stream.end_of_file() if not stream.unconcluded else Tracked([], [])
        escalations = tracks.escalations if self.escalations is not None else {}
        if tracks.events:
            # not in any frame: no snapshot, no clip (their escalations send the crops kept of the track)
            why = "no snapshot: the file ended before the track did" if stream.snapshots else None
            self._publish_events(stream, tracks.events, index, no_snapshot=why, escalations=escalations)
        self._publish_events(stream, events, index)
        if tracks.events and self.on_change is not None:
            self.on_change()  # the zones' counts changed after the status with the last frame's

    def _uses_evidence(self, stream: Stream) -> bool:
        return self.evidence is not None and bool(stream.snapshots or stream.reader.packets is not None or stream.rules)

    def on_thermal(self, state: str, reason: str | None) -> None:
        """The thermal governor's state changed (the sampler's thread): every stream's limit, now, and the
        pauses and resumptions it causes as events (the caller republishes the status)."""
        for s in self.streams.values():
            events = s.announced(s.set_thermal(state, reason))
            self._observe(s)
            if events:
                self._publish_events(s, events, s.reader.last_index)

    # 3. stage (on the batcher) -------------------------------------------------------------------------
    def stage(self, rt, frames: list[StreamFrame]) -> list[StreamFrame]:
        """The frames' samples, by the card; a frame that cannot be staged is dropped (logged once per stream)."""
        staged = []
        for f in frames:
            t0 = clock()
            try:
                f.sample, f.geometry = rt.preprocess.stage_mapped(f.frame.image)
            except Exception as exc:  # one bad frame fails neither its stream nor the requests of its batch
                if not f.stream.frame_errors:
                    log.warning("stream %s: a frame cannot be staged for model %s: %s", f.stream.name, rt.name,
                                exc if isinstance(exc, InputError) else repr(exc))
                f.stream.release(f, failed=True)
                self._conclude(f)
                continue
            if not (f.stream.snapshots or f.stream.watched or f.stream.rules):
                f.frame.picture = None  # the pixels are in the sample now (a snapshot or a viewer needs them later)
            f.stage_s = clock() - t0
            staged.append(f)
        return staged

    # 5. finish ----------------------------------------------------------------------------------------
    def finish(self, rt, frames: list[StreamFrame], outputs, started: float) -> None:
        """Detections, tracks, events, publishing (``outputs``: the frames' rows, or the batch's exception)."""
        try:
            if isinstance(outputs, Exception):
                log.error("model %s: a batch with %d frame(s) failed: %s", rt.name, len(frames), outputs)
                return
            self._finish(rt, frames, outputs, started)
        except Exception:
            log.exception("model %s: finishing a batch's frames failed", rt.name)
        finally:  # a frame never stays in flight: its stream would take no other
            for f in frames:
                f.stream.release(f, failed=True)  # once: a frame processed is released already
                self._conclude(f)

    def _conclude(self, f: StreamFrame) -> None:
        """``f``'s events are handed on: its stream's stream_ended goes out if it waited for this frame."""
        ended = f.stream.conclude(f)
        if ended is not None:
            self._announce_end(f.stream, *ended)

    def _finish(self, rt, frames: list[StreamFrame], outputs, started: float) -> None:
        now = clock()
        results = rt.results(outputs, [f.geometry for f in frames], [1] * len(frames))
        for f, result in zip(frames, results):
            s = f.stream
            if isinstance(result, Exception):
                continue  # released as failed by finish()
            fragment, _ = result
            tracked = s.track(f, fragment["detections"])
            age = time.monotonic() - f.frame.captured
            latency = frame_latency(f.taken - f.frame.captured, f.stage_s, now - started, len(frames), age)
            body = detections_payload(s.name, f.frame, rt.name, rt.version, tracked.detections, latency)
            if self.publisher.connected.is_set():  # QoS 0: while the broker is away there is no one to tell
                self.publisher.publish(topics.stream_detections_topic(self.prefix, s.name), json.dumps(body).encode(), qos=0)
            s.note_age(age)
            if self.metrics is not None:
                self.metrics.observe_frame_age(s.name, age)
                # the request path's stages: queue (decoded to taken), stage, infer, total (decoded to published)
                self.metrics.observe_latency(rt.name, {"queue": latency["wait"], "stage": latency.get("stage"),
                                                       "infer": latency["infer"], "total": latency["age"]})
            if tracing.tracer().on:  # sampled frames, and every frame that raised events (their spans' parent)
                tracing.tracer().frame(s.name, f.frame.index, f.frame.captured, f.taken, clock(), len(tracked.detections),
                                       len(tracked.events))
            if tracked.events:
                self._raise(s, tracked.events, f.frame, tracked.escalations)
            if s.watched and f.frame.picture is not None:
                s.keep_latest(f.frame, tracked.detections)  # drawn by the live view, on its own thread
            f.frame.picture = None
            if s.reader.state == "ended" and not s.reader.ready() and self.on_change is not None:
                self.on_change()  # the file's last frame is out: the status' counts are final now

    def _raise(self, stream: Stream, events: list[dict], frame: Frame, escalations: dict) -> None:
        """A processed frame's events: to the evidence step for their snapshots (and escalations' images), or out
        at once."""
        escalations = escalations if self.escalations is not None else {}
        if not stream.snapshots and stream.reader.packets is None and not escalations:
            self._publish_events(stream, events, frame.index)
        elif not self.evidence.submit((stream, frame.image if stream.snapshots else None, frame.index, frame.pts, events,
                                       escalations)):
            why = f"no snapshot: {self.evidence.size} frames already wait for theirs (the evidence queue is full)"
            if stream.snapshots:
                stream.count_snapshot(False)
            self._publish_events(stream, events, frame.index, no_snapshot=why if stream.snapshots else None,
                                 escalations=escalations)

    def evidence_step(self, job) -> None:
        """The evidence thread: each event's snapshot written, then the events stored and published; a clip
        asked for each (it is cut on the reader thread); or a finished clip written, then its clip_ready."""
        if isinstance(job[1], ClipInfo):
            return self._clip_ready(*job)
        if job[1] is _ENDED:
            stream, _, events, index = job
            return self._publish_end(stream, events, index)
        stream, image, frame, pts, events, escalations = job
        snapshot_topic = topics.stream_snapshots_topic(self.prefix, stream.name)
        bodies, snapshots = [], {}
        for e in events:
            body = event_payload(stream.name, e, frame)
            bodies.append(body)
            if not stream.snapshots:
                continue
            if e.get("reason"):  # an outage or a file's restart ended the track: the frame after it does not show it
                body.update(snapshot=None, snapshot_error=f"no snapshot: the track ended before this frame ({e['reason']})")
                continue
            try:
                snap = render_snapshot(image, e, stream.zones, stream.lines)
                path = self.media.write(body["event_id"], "jpg", snap.jpeg)
            except Exception as exc:  # a full disk, a frame that cannot be drawn: the event goes out without
                why = f"no snapshot: {exc if isinstance(exc, (OSError, ValueError)) else repr(exc)}"
                log.warning("stream %s: %s", stream.name, why)
                body.update(snapshot=None, snapshot_error=why)
                stream.count_snapshot(False)
                continue
            body["snapshot"] = {"topic": snapshot_topic, "path": str(path), "width": snap.width, "height": snap.height}
            snapshots[body["event_id"]] = snap.jpeg
            stream.count_snapshot(True)
        self._store_and_publish(stream, bodies, snapshots, escalations)
        if stream.snapshots and stream.reader.state == "ended" and self.on_change is not None:
            self.on_change()  # a file's last snapshots come after the status with its final frame counts: count them
        ring = stream.reader.packets
        if ring is not None:
            for body, e in zip(bodies, events):
                if not e.get("reason"):  # ended by an outage or a restart: not in this frame, no clip
                    ring.request(body["event_id"], pts, functools.partial(self._clip_done, stream))

    def _clip_done(self, stream: Stream, info: ClipInfo) -> None:
        """The reader thread: a clip is complete; written and announced by the evidence thread."""
        if self.evidence is None or not self.evidence.submit((stream, info)):
            if info.path is not None:
                info.path.unlink(missing_ok=True)
            info = ClipInfo(info.event_id, None, 0, info.start_s, info.end_s, info.event_s, info.packets, info.cut_short,
                            "no clip: the evidence queue is full")
            self._clip_ready(stream, info)

    def _clip_ready(self, stream: Stream, info: ClipInfo) -> None:
        body = {"event": "clip_ready", "for_event": info.event_id}
        if info.path is not None:
            try:
                path = self.media.adopt(info.event_id, "mp4", info.path)
                body["clip"] = {"path": str(path), "bytes": info.size, "start_s": round(info.start_s, 6),
                                "end_s": round(info.end_s, 6), "event_s": round(info.event_s, 6), "packets": info.packets,
                                "cut_short": info.cut_short, "note": info.reason}
            except (OSError, ValueError) as exc:
                body.update(clip=None, clip_error=f"no clip: {exc}")
        else:
            body.update(clip=None, clip_error=info.reason or "no clip")
        stream.count_clip(body["clip"] is not None)
        if stream.reader.state == "ended" and self.on_change is not None:
            self.on_change()  # a file's last clips come after the status with its final counts: count them
        self._store_and_publish(stream, [event_payload(stream.name, body, None)], {})

    def _publish_events(self, stream: Stream, events: list[dict], frame: int | None, no_snapshot: str | None = None,
                        escalations: dict | None = None) -> None:
        bodies = [event_payload(stream.name, e, frame) for e in events]
        if no_snapshot is not None:
            for b in bodies:
                b.update(snapshot=None, snapshot_error=no_snapshot)
        self._store_and_publish(stream, bodies, {}, escalations)

    def _store_and_publish(self, stream: Stream, bodies: list[dict], snapshots: dict[str, bytes],
                           escalations: dict | None = None) -> None:
        """Write the selected events' escalation jobs, store the events (their snapshots are on disk already), then
        publish each event's snapshot and the event."""
        for pos, selected in (escalations or {}).items():
            self.escalations.submit(stream.name, bodies[pos], selected)
        topic = topics.stream_events_topic(self.prefix, stream.name)
        rows = [(b["event_id"], topic, json.dumps(b).encode()) for b in bodies]
        self.events.add(rows)
        snapshot_topic = topics.stream_snapshots_topic(self.prefix, stream.name)
        for body in bodies if tracing.tracer().on else ():
            tracing.tracer().event(stream.name, body)
        for event_id, _, payload in rows:
            jpeg = snapshots.get(event_id)
            if jpeg is not None:
                self.publisher.publish(snapshot_topic, jpeg, qos=1, content_type="image/jpeg",
                                       user=(("event_id", event_id),))
            self.publisher.publish(topic, payload, qos=1, on_delivered=functools.partial(self._on_delivered, event_id))

    def follow_up(self, stream: str, body: dict) -> None:
        """An escalation's follow-up (a worker thread): stored (insert or ignore), then published like any event."""
        topic = topics.stream_events_topic(self.prefix, stream)
        payload = json.dumps(body).encode()
        self.events.add([(body["event_id"], topic, payload)])
        self.publisher.publish(topic, payload, qos=1, on_delivered=functools.partial(self._on_delivered, body["event_id"]))

    def _on_delivered(self, event_id: str) -> None:
        """The broker acknowledged an event (the MQTT network thread: no disk here; :meth:`tick` writes it)."""
        with self._lock:
            self._delivered.append(event_id)

    def _write_delivered(self) -> None:
        with self._lock:
            ids, self._delivered = self._delivered, []
        if ids:
            try:
                self.events.delivered(ids)
            except Exception:  # a full disk: they are sent again at the next start (byte-identical)
                log.exception("the event store could not record %d delivered event(s)", len(ids))

    # numbers ------------------------------------------------------------------------------------------
    def tick(self) -> None:
        """Once a second (the serving loop): the readers' stall watchdog, the metrics."""
        now = time.monotonic()
        self._write_delivered()
        for s in self.streams.values():
            s.reader.check(now)
            s.sample_rates(now)
            self._observe(s)
            ended = s.end_due()
            if ended is not None:
                self._announce_end(s, *ended)
        if self.media is not None:
            self.media.purge()
            if self.metrics is not None:
                self.metrics.set_media(self.media.status())

    def _observe(self, s: Stream) -> None:
        if self.metrics is not None:
            r = s.reader
            self.metrics.set_stream(s.name, r.state == "up", {"decoded": r.decoded, "processed": s.processed,
                                                              "dropped": r.dropped, "shed": r.shed, "skipped": r.skipped},
                                  r.reconnects)
            self.metrics.set_stream_limit(s.name, s.limit.max_fps)

    def any_up(self) -> bool:
        """Whether a stream is up or its escalations moved (its figures change: the status is republished with the
        telemetry)."""
        return any(s.reader.state == "up" for s in self.streams.values()) or (
            self.escalations is not None and self.escalations.moved())

    def status(self) -> dict:
        """The ``streams`` object of the daemon's status, keyed by stream name."""
        if self.escalations is None:
            return {name: s.status() for name, s in self.streams.items()}
        waiting = self.escalations.jobs.waiting()
        return {name: {**s.status(), "escalations": self.escalations.status(name, waiting) if s.rules else None}
                for name, s in self.streams.items()}


def _snapshot_of(payload: bytes) -> dict | None:
    """A stored event's ``snapshot`` object, or None (none, or not an event of this version)."""
    try:
        snapshot = json.loads(payload).get("snapshot")
    except (ValueError, AttributeError):
        return None
    return snapshot if isinstance(snapshot, dict) and isinstance(snapshot.get("topic"), str) else None


class StreamFrames(BatchClient):
    """One model's streams, as its batcher's frame client: the newest frame of each stream, at most one
    of a stream in flight; a full batch leaves out a different stream's frame each time (round robin)."""

    def __init__(self, path: StreamPath, streams: list[Stream]) -> None:
        self.path = path
        self.streams = streams
        self._next = 0  # which stream is served first

    def ready(self) -> bool:
        return any(s.ready() for s in self.streams)

    def take(self, room: int) -> list[StreamFrame]:
        n, frames = len(self.streams), []
        for i in range(n):
            if len(frames) >= room:
                break
            frame = self.streams[(self._next + i) % n].take()
            if frame is not None:
                frames.append(frame)
        self._next = (self._next + 1) % n if n else 0
        return frames

    def stage(self, rt, frames: list[StreamFrame]) -> list[StreamFrame]:
        return self.path.stage(rt, frames)

    def finish(self, rt, frames: list[StreamFrame], rows, started: float) -> None:
        self.path.finish(rt, frames, rows, started)

    def fail(self, frames: list[StreamFrame], exc: Exception) -> None:
        for f in frames:  # once: each frame knows whether it was released
            f.stream.release(f, failed=True)
            self.path._conclude(f)
