"""Stream events seen by K2: a durable job per selected event, a worker off the frame path, one follow-up each.

Life of a job (one per event id, in ``<state>/stream_escalations.sqlite3``):

1. **submit** (the evidence thread, or the batcher's when the evidence queue is full): the event's
   images are downscaled and encoded (JPEG, longer side at most ``[cloud] image_max_side``) and the job
   is written *before* the event is stored and published, so an event that went out always has its job.
   The queue is bounded (:data:`MAX_WAITING`): past it the event goes out marked ``skipped``.
2. **run** (the workers: ``stream_share`` of ``concurrency`` threads, at least one): a job waits while the breaker is open, the
   streams' share of the request budget is spent (``[cloud] stream_share``), or the ``concurrency``
   slots (shared with MQTT requests) are taken; an outage postpones it with backoff (store-and-forward;
   after ``outbox_ttl_s`` it fails as expired). A job whose follow-up is already stored is only marked
   done: that is the window between storing the follow-up and marking the job (a crash there).
3. **follow-up**: ``<event_id>.k2`` on the stream's events topic, ``event_described`` (``for_event``,
   ``verdict``, ``label``, ``description``, ``model``, ``latency_ms``, ``attempts``) or
   ``event_description_failed`` (``for_event``, ``reason``): stored insert-or-ignore in the
   :class:`~k2edge.service.event_store.EventStore`, published through the same exactly-once path as the
   stream's other events (republished byte-identical at the next start until acknowledged), then the
   job is marked done. A restart runs the jobs not done; none is lost, none answered twice.

A hanging cloud holds a worker, never a frame: nothing here runs on the batcher.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
import time
from dataclasses import dataclass

from .. import tracing
from ..cloud_bridge.errors import (BreakerOpen, CloudAuthError, CloudConfigError, CloudError, CloudQuotaError,
                                   CloudRejected)
from ..cloud_bridge.image import PreparedImage, prepare_image
from ..cloud_bridge.retry import backoff_s, scrub
from ..cloud_bridge.verdict import VERDICT_INSTRUCTIONS, VerdictError, parse_verdict
from ..sqlite_db import open_wal

log = logging.getLogger(__name__)

__all__ = ["EscalationJobs", "Job", "StreamEscalations", "MAX_WAITING", "follow_up_id", "encode_images", "job_text"]

MAX_WAITING = 1000  # jobs waiting at once; past it a selected event goes out marked skipped
KEEP_DONE = 10_000  # finished jobs kept (their attempts and errors, for inspection); older ones are pruned
OUTCOMES = ("described", "failed", "skipped")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL UNIQUE,
    stream TEXT NOT NULL,
    request TEXT NOT NULL,
    images TEXT NOT NULL,
    created REAL NOT NULL,
    not_before REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    outcome TEXT
);
CREATE INDEX IF NOT EXISTS jobs_waiting ON jobs (outcome, not_before, seq);
"""


def follow_up_id(event_id: str) -> str:
    """The follow-up's event id: stable, so a re-run job can only ever produce the one follow-up."""
    return f"{event_id}.k2"


@dataclass(frozen=True, slots=True)
class Job:
    event_id: str
    stream: str
    request: dict
    images: list  # [{"mime", "data" (base64), "width", "height"}]
    created: float
    attempts: int


class EscalationJobs:
    """The SQLite job queue (synchronous FULL: a job is the promise that a follow-up will come)."""

    def __init__(self, path) -> None:
        self._db = open_wal(path, "FULL", _SCHEMA)
        self._lock = threading.Lock()
        self._since_prune = 0

    def put(self, job: Job) -> bool:
        """Store ``job`` (idempotent per event id); False when :data:`MAX_WAITING` jobs wait already."""
        with self._lock:
            (waiting,) = self._db.execute("SELECT COUNT(*) FROM jobs WHERE outcome IS NULL").fetchone()
            if waiting >= MAX_WAITING:
                return False
            self._db.execute("INSERT OR IGNORE INTO jobs (event_id, stream, request, images, created, attempts) "
                             "VALUES (?, ?, ?, ?, ?, ?)", (job.event_id, job.stream, json.dumps(job.request),
                                                            json.dumps(job.images), job.created, job.attempts))
            return True

    def due(self, now: float, exclude: set, limit: int = 8) -> list[Job]:
        """Jobs not done whose time has come, oldest first, leaving out ``exclude`` (running)."""
        with self._lock:
            rows = self._db.execute("SELECT event_id, stream, request, images, created, attempts FROM jobs WHERE "
                                    "outcome IS NULL AND not_before <= ? ORDER BY seq LIMIT ?",
                                    (now, limit + len(exclude))).fetchall()
        return [Job(r[0], r[1], json.loads(r[2]), json.loads(r[3]), r[4], r[5]) for r in rows if r[0] not in exclude][:limit]

    def next_due_in(self, now: float) -> float | None:
        with self._lock:
            (t,) = self._db.execute("SELECT MIN(not_before) FROM jobs WHERE outcome IS NULL").fetchone()
        return None if t is None else max(0.0, t - now)

    def postpone(self, event_id: str, until: float, error: str | None, attempts: int = 0) -> None:
        with self._lock:
            self._db.execute("UPDATE jobs SET not_before = ?, last_error = ?, attempts = attempts + ? WHERE event_id = ?",
                             (until, error, attempts, event_id))

    def done(self, event_id: str, outcome: str) -> None:
        """Mark a job finished (its images dropped); every 1,000 finished, all but the newest
        :data:`KEEP_DONE` finished jobs are pruned, so the file stays bounded on a device that runs for months."""
        with self._lock:
            self._db.execute("UPDATE jobs SET outcome = ?, images = '[]' WHERE event_id = ?", (outcome, event_id))
            self._since_prune += 1
            if self._since_prune >= 1000:
                self._since_prune = 0
                self._db.execute("DELETE FROM jobs WHERE outcome IS NOT NULL AND seq < (SELECT seq FROM jobs WHERE "
                                 "outcome IS NOT NULL ORDER BY seq DESC LIMIT 1 OFFSET ?)", (KEEP_DONE,))

    def get(self, event_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT attempts, last_error, outcome FROM jobs WHERE event_id = ?", (event_id,)).fetchone()
        return None if row is None else {"attempts": row[0], "last_error": row[1], "outcome": row[2]}

    def waiting(self) -> dict[str, int]:
        """Jobs not done, by stream."""
        with self._lock:
            return dict(self._db.execute("SELECT stream, COUNT(*) FROM jobs WHERE outcome IS NULL GROUP BY stream").fetchall())

    def waiting_ids(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT event_id FROM jobs WHERE outcome IS NULL ORDER BY seq")]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def encode_images(images, max_side: int) -> list[dict]:
    """RGB arrays -> JPEGs downscaled to ``max_side`` (then typed by :func:`prepare_image`), as stored in a job."""
    from PIL import Image

    out = []
    for arr in images:
        img = Image.fromarray(arr)
        img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        p = prepare_image(buf.getvalue(), max_side)
        out.append({"mime": p.mime, "data": p.base64, "width": p.width, "height": p.height})
    return out


def _prepared(stored: list[dict]) -> list[PreparedImage]:
    return [PreparedImage(base64.b64decode(i["data"]), i["mime"], i["width"], i["height"], False) for i in stored]


def job_text(request: dict) -> str:
    """The text part of a job's question: the rendered prompt, the edge's findings, the verdict instructions."""
    findings = {k: request.get(k) for k in ("event", "label", "score", "box") if request.get(k) is not None}
    text = (f"{request['prompt']}\n\nThe on-device detector's finding (score in [0, 1]; box = [x1, y1, x2, y2] in "
            f"pixels of the camera frame; {request.get('images_sent', 0)} image(s) attached: {request.get('images_kind')}): "
            f"{json.dumps(findings)}")
    if request.get("verify"):
        text += "\n\n" + VERDICT_INSTRUCTIONS
    return text


class StreamEscalations:
    """The jobs, their workers, and their follow-ups (see the module docstring).

    Args:
        bridge: the daemon's :class:`~k2edge.cloud_bridge.CloudBridge` (client, breaker, budget, slots shared
            with MQTT requests).
        jobs: the job queue.
        events: the event store (the follow-ups' and the original events').
        sink: publishes a follow-up: ``sink.follow_up(stream_name, body)`` stores it, then publishes it.
        metrics: the Prometheus exporter, or None.
        clock: Unix seconds (jobs outlive a process: their times are wall-clock).
    """

    def __init__(self, bridge, jobs: EscalationJobs, events, sink, metrics=None, clock=time.time) -> None:
        self.bridge, self.jobs, self.events, self.sink, self.metrics = bridge, jobs, events, sink, metrics
        self.settings = bridge.settings
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Condition()
        self._running: set[str] = set()
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}
        self._threads: list[threading.Thread] = []
        self._seen = 0  # finished jobs counted when moved() was last asked

    # the frame side -------------------------------------------------------------------------------
    def submit(self, stream: str, body: dict, selected) -> bool:
        """Write the job of ``body`` (an event payload about to be stored) for ``selected`` = (Selection, images,
        TrackStats); marks ``body["escalation"]``. False when the queue is full (``body`` says skipped)."""
        sel, images, stats = selected
        event_id = body["event_id"]
        score = body.get("best_score") if body.get("event") == "track_end" else (round(stats.mean, 4) if stats else None)
        request = {"stream": stream, "event": body.get("event"), "rule": sel.index, "why": sel.reason, "prompt": sel.prompt,
                   "verify": sel.rule.verify, "label": body.get("label"), "score": score, "box": body.get("box"),
                   "images_kind": sel.rule.images, "images_sent": len(images)}
        stored = encode_images(images, self.settings.image_max_side)
        body["escalation"] = {"rule": sel.index, "follow_up": follow_up_id(event_id)}
        if not self.jobs.put(Job(event_id, stream, request, stored, self._clock(), 0)):
            body["escalation"] = {"rule": sel.index, "skipped": f"{MAX_WAITING} escalations wait already"}
            self._count(stream, "skipped")
            return False
        with self._wake:
            self._wake.notify()
        return True

    # lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Jobs whose event never got stored (a crash between the two writes) are dropped; then the workers."""
        for eid in self.jobs.waiting_ids():
            if self.events.find(eid) is None:
                log.warning("stream escalation %s: its event was never stored (the daemon stopped in between); dropped", eid)
                self.jobs.done(eid, "orphan")
        n = max(1, round(self.settings.concurrency * self.settings.stream_share))
        self._threads = [threading.Thread(target=self._work, name=f"k2edge-stream-k2-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def stop(self, timeout: float) -> None:
        """Stop the workers (a call in flight finishes or is abandoned: its job stays, for the next start)."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    def close(self) -> None:
        self.jobs.close()

    # the workers ----------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            job = self._claim()
            if job is None:
                wait = self.jobs.next_due_in(self._clock())
                with self._wake:
                    self._wake.wait(1.0 if wait is None else min(1.0, max(0.02, wait)))
                continue
            try:
                self.run(job)
            except Exception:  # a job never kills its worker; it stays for a later try
                log.exception("stream escalation %s failed unexpectedly", job.event_id)
                self.jobs.postpone(job.event_id, self._clock() + 5.0, "internal error")
            finally:
                with self._lock:
                    self._running.discard(job.event_id)

    def _claim(self) -> Job | None:
        with self._lock:
            due = self.jobs.due(self._clock(), self._running, limit=1)
            if not due:
                return None
            self._running.add(due[0].event_id)
            return due[0]

    def run(self, job: Job) -> str | None:
        """One try of ``job``: its outcome (``described`` / ``failed`` / ``stored``), or None when it waits."""
        now = self._clock()
        fid = follow_up_id(job.event_id)
        if self.events.find(fid) is not None:  # stored before a crash, not marked: it is out (or goes at start)
            self.jobs.done(job.event_id, "stored")
            return "stored"
        if self.events.find(job.event_id) is None:  # submitted a moment ago; the event is being stored
            self.jobs.postpone(job.event_id, now + 0.2, None)
            return None
        b, share = self.bridge, self.settings.stream_share
        if now - job.created > self.settings.outbox_ttl_s:
            return self._finish(job, {"event": "event_description_failed",
                                      "reason": f"expired: no answer within outbox_ttl_s ({self.settings.outbox_ttl_s:g} s)"
                                                f"; last error: {self.jobs.get(job.event_id)['last_error']}"}, "failed")
        if b.breaker.state == "open":
            return self._wait(job, max(0.5, b.breaker.retry_in_s()), "the cloud circuit breaker is open")
        spend = b.budget.try_acquire_share(share)
        if spend is None:
            return self._wait(job, max(0.2, b.budget.share_resets_in_s(share)),
                              f"the streams' share ({share:g}) of the request budget is spent")
        if not b.slots.acquire(timeout=0.5):
            b.budget.refund(spend)  # no call made: each wait for a slot took a request of the streams' share
            return self._wait(job, 0.2, f"{self.settings.concurrency} cloud calls are in flight")
        try:
            deadline = self.settings.timeout_s * (self.settings.max_retries + 1) + 1.0
            # the call's span: the event span's child when its frame was traced; K2 gets its traceparent
            with tracing.description_span(job.event_id, self.settings.model, self.settings.base_url):
                answer = b.client.ask(_prepared(job.images), job_text(job.request), deadline,
                                      json_mode=job.request["verify"])
        except CloudError as exc:
            if not exc.attempts:  # no HTTP attempt (the breaker, no time left, a body not built): nothing spent
                b.budget.refund(spend)
            return self._failed_call(job, exc)
        finally:
            b.slots.release()
        attempts = job.attempts + answer.attempts
        base = {"model": answer.model, "latency_ms": round(answer.latency_ms, 1), "attempts": attempts}
        if not job.request["verify"]:
            body = {"event": "event_described", "verdict": None, "label": job.request.get("label"),
                    "description": answer.text.strip(), **base}
            return self._finish(job, body, "described")
        try:
            v = parse_verdict(answer.text)
        except VerdictError as exc:
            return self._finish(job, {"event": "event_description_failed", "reason": f"not a verdict: {exc}", **base},
                                "failed")
        body = {"event": "event_described", "verdict": v.verdict, "label": v.label or job.request.get("label"),
                "description": v.description, **base}
        return self._finish(job, body, "described")

    def _failed_call(self, job: Job, exc: CloudError) -> str | None:
        message = scrub(str(exc))
        attempts = max(1, getattr(exc, "attempts", 0) or 0) if not isinstance(exc, BreakerOpen) else 0
        if isinstance(exc, (CloudRejected, CloudConfigError)):  # this request is refused: no later try helps
            return self._finish(job, {"event": "event_description_failed", "reason": message,
                                      "attempts": job.attempts + attempts}, "failed")
        # an outage, a timeout, a spent quota, a rejected key: the job waits (the breaker paces the retries)
        wait = backoff_s(min(job.attempts + 1, 6), base=1.0, cap=30.0)
        if isinstance(exc, (CloudQuotaError, CloudAuthError)):
            wait = max(wait, self.bridge.breaker.retry_in_s())
        self.jobs.postpone(job.event_id, self._clock() + wait, message, attempts)
        log.info("stream escalation %s waits %.1f s: %s", job.event_id, wait, message)
        return None

    def _wait(self, job: Job, seconds: float, why: str) -> None:
        self.jobs.postpone(job.event_id, self._clock() + seconds, why)
        return None

    def _finish(self, job: Job, fields: dict, outcome: str) -> str:
        body = {"event_id": follow_up_id(job.event_id), "event": fields.pop("event"), "stream": job.stream,
                "time": self._clock(), "frame": None, "for_event": job.event_id, "rule": job.request.get("rule"), **fields}
        self.sink.follow_up(job.stream, body)  # stored (insert or ignore), then published
        self.jobs.done(job.event_id, outcome)
        self._count(job.stream, outcome)
        return outcome

    # numbers --------------------------------------------------------------------------------------
    def _count(self, stream: str, outcome: str) -> None:
        with self._lock:
            c = self._counts.setdefault(stream, dict.fromkeys(OUTCOMES, 0))
            c[outcome] += 1
        if self.metrics is not None:
            self.metrics.observe_stream_escalation(stream, outcome)

    def moved(self) -> bool:
        """Whether jobs wait, or one finished since the last call (the status then has news)."""
        with self._lock:
            total = sum(sum(c.values()) for c in self._counts.values())
            changed, self._seen = total != self._seen, total
        return changed or bool(self.jobs.waiting())

    def status(self, stream: str, waiting: dict | None = None) -> dict:
        """``{"waiting", "described", "failed", "skipped"}`` of ``stream`` (this run's counts; waiting: now)."""
        waiting = self.jobs.waiting() if waiting is None else waiting
        with self._lock:
            c = dict(self._counts.get(stream, dict.fromkeys(OUTCOMES, 0)))
        return {"waiting": waiting.get(stream, 0), **c}
