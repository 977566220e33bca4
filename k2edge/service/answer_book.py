"""The answer book: every answer is recorded under its request's key before it is published, and a
request is acknowledged once its answer is delivered.

A request's key is (reply topic, id, attempt). The book keeps each key's answer in SQLite (WAL,
in the state directory, one transaction per batch, kept for the MQTT session expiry) and knows
what became of it:

* ``working``   — accepted, no answer yet;
* ``recorded``  — the answer is stored and was handed to the MQTT client;
* ``delivered`` — the broker acknowledged the answer.

A redelivered request (after a broker or daemon restart, or a resend with the same key) is never
answered twice: a delivered key is acknowledged at once; a key recorded by this process waits for
its answer's acknowledgement; a key recorded by an earlier process that died before the broker
acknowledged the answer gets the stored answer re-published, byte for byte — the one case in which
a requester can see the same answer twice.

Requests without an id have no key: they are answered each time they arrive (at least once).
Acknowledgements go through the transport, which sends them in arrival order.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from ..sqlite_db import open_wal

log = logging.getLogger(__name__)

ANSWERS_FILE = "answers.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    id INTEGER PRIMARY KEY,
    key BLOB NOT NULL,
    topic TEXT NOT NULL,
    correlation BLOB,
    payload BLOB NOT NULL,
    created REAL NOT NULL,
    delivered REAL
);
-- rows are appended in time order (rowid); only this small index takes the keys' random order, so a
-- batch's commit writes a few pages, not one per answer
CREATE UNIQUE INDEX IF NOT EXISTS answers_key ON answers (key);
CREATE INDEX IF NOT EXISTS answers_created ON answers (created);
"""


class AnswerKey(NamedTuple):
    """What makes two requests the same request."""

    topic: str
    id: str
    attempt: int

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for part in (self.topic.encode(), self.id.encode(), str(self.attempt).encode()):
            h.update(len(part).to_bytes(4, "little") + part)
        return h.digest()


@dataclass(slots=True)
class Answer:
    """One answer to publish: where, what, and whom it acknowledges."""

    key: AnswerKey | None
    topic: str
    payload: bytes
    correlation: bytes | None = None
    tokens: list = field(default_factory=list)  # ack tokens of a keyless request
    on_delivered: Callable[[], None] | None = None
    user: tuple = ()  # MQTT 5 user properties of the publish (the traceparent of the request's span)


@dataclass(slots=True)
class _Entry:
    state: str  # working | recorded | delivered
    tokens: list = field(default_factory=list)
    callbacks: list = field(default_factory=list)


class AnswerBook:
    """Durable answers, duplicate detection and acknowledgement.

    Args:
        state_dir: where ``answers.sqlite3`` lives.
        broker: the broker facade (:class:`~k2edge.service.transport.MqttTransport`): its
            ``publish(topic, payload, correlation=, on_delivered=)`` queues a QoS 1 publish and calls
            ``on_delivered`` (on any thread) once the broker acknowledged it; its ``done(token)``
            acknowledges a request (in arrival order).
        retention_s: how long answers are kept (the MQTT session expiry: no redelivery comes later).
        memory_keys: delivered keys kept in memory (older ones are looked up in the database).
    """

    def __init__(self, state_dir: Path, broker, retention_s: float, memory_keys: int = 50_000,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(state_dir) / ANSWERS_FILE
        self._broker = broker
        self.retention_s = retention_s
        self._memory_keys = memory_keys
        self._clock = clock
        self._lock = threading.Lock()  # entries and counters; never held while calling the transport
        self._db_lock = threading.Lock()
        self._live: OrderedDict[bytes, _Entry] = OrderedDict()
        self._marks: list[tuple[float, bytes]] = []
        self._undelivered = 0
        self._quiet = threading.Condition(self._lock)
        # NORMAL: a commit survives the process dying (kill -9); an OS crash or power cut may lose the
        # last commits, whose requests the broker then redelivers and we answer afresh. Checkpoints
        # (which fsync) run in flush(), on their own connection, never on a request's path.
        self._db = open_wal(self.path, "NORMAL", _SCHEMA, autocheckpoint=False)
        self._maintenance = open_wal(self.path, "FULL")
        self._db_failed = False

    # admission ------------------------------------------------------------------------------------
    def claim(self, key: AnswerKey, token) -> bool:
        """Take ``key`` for answering. False when it was answered (or is being answered) already:
        the request is then acknowledged when its earlier answer is delivered, or at once."""
        d = key.digest()
        with self._lock:
            entry = self._live.get(d)
            if entry is None:
                row = self._lookup(d)
                if row is None:
                    self._live[d] = _Entry("working", [token])
                    return True
                topic, correlation, payload, delivered = row
                entry = self._live[d] = _Entry("delivered" if delivered else "recorded")
                if not delivered:  # recorded by a process that died before the broker acknowledged it
                    entry.tokens.append(token)
                    self._undelivered += 1
                    republish = (topic, payload, correlation)
                else:
                    republish = None
            elif entry.state != "delivered":
                entry.tokens.append(token)
                return False
            else:
                republish = None
        if republish is None:
            self._broker.done(token)
        else:
            log.info("request %s (attempt %d) was answered before a restart; re-publishing that answer", key.id, key.attempt)
            self._send(*republish, d)
        return False

    def acknowledge_early(self, key: AnswerKey | None, tokens: list | None = None) -> None:
        """Acknowledge a request whose answer is not ready but is safe (its cloud work is in the outbox)."""
        if key is not None:
            with self._lock:
                entry = self._live.get(key.digest())
                tokens, entry.tokens = (entry.tokens, []) if entry is not None else ([], [])
        for t in tokens or ():
            self._broker.done(t)

    def recorded(self, key: AnswerKey) -> bool:
        """True when an answer for ``key`` is stored (by this process or an earlier one)."""
        d = key.digest()
        with self._lock:
            entry = self._live.get(d)
            if entry is not None:
                return entry.state != "working"
            return self._lookup(d) is not None

    # answering ------------------------------------------------------------------------------------
    def answer(self, answers: list[Answer]) -> None:
        """Record every keyed answer (one transaction), then publish them all.

        A key that already has an answer keeps it (a recovered outbox job, a retried delivery): the
        stored answer is published if no one has yet, and ``on_delivered`` runs when it is delivered.
        """
        plan: list[tuple[Answer, bytes | None, bytes]] = []
        immediate: list[Callable[[], None]] = []
        with self._lock:
            for a in answers:
                if a.key is None:
                    plan.append((a, None, a.payload))
                    self._undelivered += 1
                    continue
                d = a.key.digest()
                entry = self._live.get(d)
                if entry is None:
                    row = self._lookup(d)
                    if row is not None:  # recorded by an earlier process: that answer stands
                        entry = self._live[d] = _Entry("delivered" if row[3] else "recorded")
                        if not row[3]:
                            self._undelivered += 1
                            plan.append((Answer(a.key, row[0], row[2], row[1]), d, row[2]))
                    else:
                        entry = self._live[d] = _Entry("working")
                if entry.state != "working":  # answered already: the first answer stands
                    if a.on_delivered is not None:
                        if entry.state == "delivered":
                            immediate.append(a.on_delivered)
                        else:
                            entry.callbacks.append(a.on_delivered)
                    continue
                entry.state = "recorded"
                if a.on_delivered is not None:
                    entry.callbacks.append(a.on_delivered)
                self._undelivered += 1
                plan.append((a, d, a.payload))
        rows = [(d, a.topic, a.correlation, payload, self._clock()) for a, d, payload in plan
                if d is not None and payload is a.payload]
        if rows:
            self._record(rows)
        for cb in immediate:
            cb()
        for a, d, payload in plan:
            if d is not None:
                self._send(a.topic, payload, a.correlation, d, a.user)
            else:
                self._broker.publish(a.topic, payload, correlation=a.correlation,
                                     on_delivered=lambda a=a: self._delivered_keyless(a), user=a.user)

    def _send(self, topic: str, payload: bytes, correlation: bytes | None, d: bytes, user: tuple = ()) -> None:
        self._broker.publish(topic, payload, correlation=correlation, on_delivered=lambda: self._delivered(d), user=user)

    def _record(self, rows: list[tuple]) -> None:
        with self._db_lock:
            try:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT OR IGNORE INTO answers (key, topic, correlation, payload, created) "
                                     "VALUES (?, ?, ?, ?, ?)", rows)
                self._db.execute("COMMIT")
                self._db_failed = False
            except sqlite3.Error as exc:
                # keep serving: an answer that cannot be recorded is still published (at least once)
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                if not self._db_failed:
                    log.error("answers cannot be recorded in %s (%s); answering without the duplicate record", self.path, exc)
                self._db_failed = True

    def _lookup(self, d: bytes):
        with self._db_lock:
            try:
                return self._db.execute("SELECT topic, correlation, payload, delivered FROM answers WHERE key = ?",
                                        (d,)).fetchone()
            except sqlite3.Error as exc:
                log.error("answers database %s unreadable: %s", self.path, exc)
                return None

    # acknowledgements from the broker (network thread) -------------------------------------------
    def _delivered(self, d: bytes) -> None:
        with self._lock:
            entry = self._live.get(d)
            if entry is None or entry.state == "delivered":
                return
            entry.state = "delivered"
            tokens, callbacks = entry.tokens, entry.callbacks
            entry.tokens, entry.callbacks = [], []
            self._marks.append((self._clock(), d))
            self._count_delivered()
        for t in tokens:
            self._broker.done(t)
        for cb in callbacks:
            _run_callback(cb)

    def _delivered_keyless(self, a: Answer) -> None:
        with self._lock:
            self._count_delivered()
        for t in a.tokens:
            self._broker.done(t)
        if a.on_delivered is not None:
            _run_callback(a.on_delivered)

    def _count_delivered(self) -> None:
        self._undelivered -= 1
        if self._undelivered <= 0:
            self._quiet.notify_all()

    # housekeeping -----------------------------------------------------------------------------------
    @property
    def undelivered(self) -> int:
        """Answers handed to the MQTT client and not yet acknowledged by the broker."""
        with self._lock:
            return self._undelivered

    def wait_delivered(self, timeout: float) -> bool:
        """Block until every published answer is acknowledged by the broker (drain)."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._undelivered > 0:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._quiet.wait(left)
        return True

    def flush(self) -> None:
        """Write delivery marks, prune, checkpoint the WAL, then forget old delivered keys in memory
        (they are looked up in the database from then on). Call periodically, off the request path."""
        with self._lock:
            marks, self._marks = self._marks, []
        cut = self._clock() - self.retention_s
        db = self._maintenance
        try:
            db.execute("BEGIN")
            if marks:
                db.executemany("UPDATE answers SET delivered = ? WHERE key = ?", marks)
            db.execute("DELETE FROM answers WHERE created < ?", (cut,))
            db.execute("COMMIT")
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            log.error("answers database %s: %s", self.path, exc)
            with self._lock:
                self._marks[:0] = marks
            return
        with self._lock:
            excess = len(self._live) - self._memory_keys
            if excess > 0:  # delivered keys whose mark is in the database; the oldest first
                unwritten = {d for _, d in self._marks}
                old = [d for d, e in itertools.islice(self._live.items(), 2 * excess)
                       if e.state == "delivered" and d not in unwritten]
                for d in old[:excess]:
                    del self._live[d]

    def close(self) -> None:
        self.flush()
        with self._db_lock:
            self._db.close()
        self._maintenance.close()


def _run_callback(callback: Callable[[], None]) -> None:
    """A delivery callback, on the network thread: its failure is logged, never the network loop's."""
    try:
        callback()
    except Exception:
        log.exception("a delivery callback failed")
