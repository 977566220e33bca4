"""The durable outbox: deferrable requests wait here (SQLite, WAL, in the state directory) until
the cloud answers, and are delivered to their response topic exactly once per id.

Life of a row: ``put`` (idempotent per id) -> ``claim`` (a lease: ``lease_s`` seconds during
which no one else takes it) -> the sender works (asks the cloud, stores the answer with
``set_result`` so a retry re-sends the same answer without asking again, publishes) ->
``mark_delivered``; on failure ``release`` puts it back with a retry time. A process that dies
mid-delivery leaves its lease, which a process opening the outbox later voids at once when its holder is gone (a
process of this boot that no longer runs, or any process of an earlier boot: a crash, a kill -9, a power cut), so
the row is claimed again right after a restart rather than once the lease runs out. A
delivered row is never claimed again. The one window left is a crash between the publish and
``mark_delivered``: the response then goes out twice with the same id (consumers can drop the
duplicate by id); there is no window in which it is lost.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..sqlite_db import open_wal
from .errors import OutboxError

log = logging.getLogger(__name__)

__all__ = ["Outbox", "OutboxItem", "Postpone", "OUTBOX_FILE"]

OUTBOX_FILE = "outbox.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id TEXT PRIMARY KEY,
    response_topic TEXT NOT NULL,
    correlation_data BLOB,
    payload TEXT NOT NULL,
    result TEXT,
    status TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    next_attempt_at REAL NOT NULL,
    lease_owner TEXT,
    lease_until REAL,
    delivered_at REAL,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS outbox_due ON outbox (status, next_attempt_at);
"""


@dataclass(frozen=True)
class OutboxItem:
    """One deferred request as stored."""

    id: str
    response_topic: str
    correlation_data: bytes | None
    payload: dict
    result: dict | None
    status: str
    attempts: int
    created_at: float
    next_attempt_at: float
    last_error: str | None


class Outbox:
    """A SQLite outbox. Thread-safe (one connection behind a lock); wall-clock times survive restarts.

    Args:
        path: the database file, or a directory (the state directory) to hold ``outbox.sqlite3``.
        lease_s: how long a claim holds a row; longer than one delivery takes.
        clock: wall-clock seconds (injectable for tests).

    Raises:
        OutboxError: the file cannot be created or opened.
    """

    def __init__(self, path: str | os.PathLike, *, lease_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        p = Path(path)
        if p.is_dir() or not p.suffix:
            p = p / OUTBOX_FILE
        self.path = p
        self.lease_s = lease_s
        self._clock = clock
        self.owner = f"{_BOOT}:{os.getpid()}:{uuid.uuid4().hex}"  # who holds a lease, and whether it can still run
        _OWNERS.add(self.owner)
        self._lock = threading.Lock()
        try:
            self._db = open_wal(p, "FULL", _SCHEMA)  # an accepted request must survive a power cut
        except (sqlite3.Error, OSError) as exc:
            raise OutboxError(f"outbox {str(p)!r} cannot be opened: {exc}") from None
        self._void_dead_leases()

    def _void_dead_leases(self) -> None:
        """Leases whose holder is gone no longer hold their rows: it died mid-delivery (the lease would keep a live
        request from the restarted daemon until it ran out, and with it the request's deadline). A holder of this
        boot that still runs (another process on this outbox) keeps its leases."""
        rows = self._run(lambda db: db.execute(
            "SELECT id, lease_owner FROM outbox WHERE status = 'pending' AND lease_owner IS NOT NULL").fetchall())
        dead = [(rid, owner) for rid, owner in rows if not _alive(owner)]
        if dead:
            log.info("outbox: %d row(s) leased by a process that is gone are taken up again now", len(dead))
            self._run(lambda db: db.executemany(  # only if still held by that holder (not claimed since the read)
                "UPDATE outbox SET lease_owner = NULL, lease_until = NULL WHERE id = ? AND status = 'pending' "
                "AND lease_owner = ?", dead))

    def now(self) -> float:
        """The outbox's wall clock (what ``created_at`` is measured on)."""
        return self._clock()

    def _run(self, fn):
        with self._lock:
            try:
                return fn(self._db)
            except sqlite3.Error as exc:
                raise OutboxError(f"outbox {str(self.path)!r}: {exc}") from None

    # writing -----------------------------------------------------------------------------------
    def put(self, request_id: str, response_topic: str, correlation_data: bytes | None, payload: dict,
            claim_s: float | None = None) -> bool:
        """Store a deferred request; True when new, False when the id is already there (nothing changes).

        ``claim_s``: store it already claimed by this process for that long (work it is about to do
        itself; should the process die, the row is taken up again once the lease has run out).
        """
        now = self._clock()
        text = json.dumps(payload, sort_keys=True)
        owner, until, attempts = (self.owner, now + claim_s, 1) if claim_s is not None else (None, None, 0)
        cur = self._run(lambda db: db.execute(
            "INSERT OR IGNORE INTO outbox (id, response_topic, correlation_data, payload, created_at, next_attempt_at, "
            "lease_owner, lease_until, attempts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (request_id, response_topic, correlation_data, text, now, now, owner, until, attempts)))
        return cur.rowcount == 1

    def claim(self, limit: int = 1, lease_s: float | None = None) -> list[OutboxItem]:
        """Take up to ``limit`` due rows under a lease (attempts counted)."""
        now = self._clock()
        until = now + (self.lease_s if lease_s is None else lease_s)

        def tx(db):
            db.execute("BEGIN IMMEDIATE")
            try:
                rows = db.execute(
                    "SELECT * FROM outbox WHERE status = 'pending' AND next_attempt_at <= ? "
                    "AND (lease_until IS NULL OR lease_until <= ?) ORDER BY next_attempt_at, created_at LIMIT ?",
                    (now, now, limit)).fetchall()
                for r in rows:
                    db.execute("UPDATE outbox SET lease_owner = ?, lease_until = ?, attempts = attempts + 1 WHERE id = ?",
                               (self.owner, until, r[0]))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return rows

        rows = self._run(tx)
        return [self._item(r, attempts_delta=1) for r in rows]

    def holds(self, request_id: str) -> bool:
        """True while this process's lease on the row is still valid (check before publishing)."""
        now = self._clock()
        row = self._run(lambda db: db.execute(
            "SELECT 1 FROM outbox WHERE id = ? AND status = 'pending' AND lease_owner = ? AND lease_until > ?",
            (request_id, self.owner, now)).fetchone())
        return row is not None

    def set_result(self, request_id: str, result: dict) -> None:
        """Keep the answer to deliver, so a retried delivery sends the same one without asking the cloud again."""
        self._run(lambda db: db.execute("UPDATE outbox SET result = ? WHERE id = ? AND status = 'pending'",
                                        (json.dumps(result, sort_keys=True), request_id)))

    def mark_delivered(self, request_id: str) -> bool:
        """Record the delivery; True the first time, False when it was already delivered or is unknown."""
        now = self._clock()
        cur = self._run(lambda db: db.execute(
            "UPDATE outbox SET status = 'delivered', delivered_at = ?, lease_owner = NULL, lease_until = NULL "
            "WHERE id = ? AND status = 'pending'", (now, request_id)))
        return cur.rowcount == 1

    def unlease(self, request_id: str, error: str, retry_in_s: float) -> None:
        """Give a claimed row back after a failed delivery; it is due again in ``retry_in_s``."""
        now = self._clock()
        self._run(lambda db: db.execute(
            "UPDATE outbox SET lease_owner = NULL, lease_until = NULL, next_attempt_at = ?, last_error = ? "
            "WHERE id = ? AND status = 'pending'", (now + max(0.0, retry_in_s), error[:500], request_id)))

    def release(self, request_ids: list[str]) -> None:
        """Give claimed rows back untried: no longer leased, due as they were, the claim's attempt not counted."""
        self._run(lambda db: db.executemany(
            "UPDATE outbox SET lease_owner = NULL, lease_until = NULL, attempts = MAX(0, attempts - 1) "
            "WHERE id = ? AND status = 'pending'", [(i,) for i in request_ids]))

    def purge_delivered(self, older_than_s: float = 7 * 86400) -> int:
        """Delete delivered rows older than ``older_than_s`` (their ids are no longer remembered)."""
        cut = self._clock() - older_than_s
        cur = self._run(lambda db: db.execute("DELETE FROM outbox WHERE status = 'delivered' AND delivered_at < ?", (cut,)))
        return cur.rowcount

    # reading -----------------------------------------------------------------------------------
    def due(self) -> list[OutboxItem]:
        """Rows that could be claimed now (pending, due, not leased)."""
        now = self._clock()
        rows = self._run(lambda db: db.execute(
            "SELECT * FROM outbox WHERE status = 'pending' AND next_attempt_at <= ? AND (lease_until IS NULL OR lease_until <= ?) "
            "ORDER BY next_attempt_at, created_at", (now, now)).fetchall())
        return [self._item(r) for r in rows]

    def get(self, request_id: str) -> OutboxItem | None:
        row = self._run(lambda db: db.execute("SELECT * FROM outbox WHERE id = ?", (request_id,)).fetchone())
        return self._item(row) if row else None

    def depth(self) -> int:
        """Requests waiting for delivery."""
        return self._run(lambda db: db.execute("SELECT COUNT(*) FROM outbox WHERE status = 'pending'").fetchone()[0])

    def snapshot(self) -> dict:
        now = self._clock()
        depth, oldest = self._run(lambda db: db.execute(
            "SELECT COUNT(*), MIN(created_at) FROM outbox WHERE status = 'pending'").fetchone())
        return {"depth": depth, "oldest_age_s": round(now - oldest, 3) if oldest is not None else None, "path": str(self.path)}

    @staticmethod
    def _item(r, attempts_delta: int = 0) -> OutboxItem:
        return OutboxItem(id=r[0], response_topic=r[1], correlation_data=bytes(r[2]) if r[2] is not None else None,
                          payload=json.loads(r[3]), result=json.loads(r[4]) if r[4] else None, status=r[5],
                          attempts=r[6] + attempts_delta, created_at=r[7], next_attempt_at=r[8], last_error=r[12])

    # delivery ----------------------------------------------------------------------------------
    def deliver_once(self, send: Callable[[OutboxItem], None], limit: int = 16,
                     retry_in_s: Callable[[OutboxItem, Exception], float] | None = None,
                     stop: threading.Event | None = None) -> int:
        """Claim due rows and ``send`` each; mark delivered when ``send`` returns, unlease when it raises.

        ``send`` raising :class:`Postpone` unleases the row without counting a failure
        (e.g. the cloud budget is spent for this minute). Once ``stop`` is set, the rows not sent yet go back
        untried (:meth:`release`): a stopping daemon starts no more cloud calls. Returns how many were delivered.
        """
        delivered = 0
        items = self.claim(limit)
        for n, item in enumerate(items):
            if stop is not None and stop.is_set():
                self.release([i.id for i in items[n:]])
                break
            try:
                send(item)
            except Exception as exc:
                wait = exc.retry_in_s if isinstance(exc, Postpone) else (retry_in_s or _default_retry)(item, exc)
                log.info("outbox %s: not delivered (%s); next try in %.0f s", item.id, exc, wait)
                self.unlease(item.id, str(exc), wait)
                continue
            if self.mark_delivered(item.id):
                delivered += 1
        return delivered

    def deliver_pending(self, send: Callable[[OutboxItem], None], stop: threading.Event, poll_s: float = 1.0,
                        retry_in_s: Callable[[OutboxItem, Exception], float] | None = None) -> None:
        """The delivery loop for a worker thread: :meth:`deliver_once` until ``stop`` is set."""
        while not stop.is_set():
            try:
                self.deliver_once(send, retry_in_s=retry_in_s, stop=stop)
            except OutboxError:
                log.exception("outbox delivery failed")
            stop.wait(poll_s)

    def close(self) -> None:
        with self._lock:
            self._db.close()


class Postpone(Exception):
    """Raised by a sender to put a row back for later without counting it as a failure."""

    def __init__(self, reason: str, retry_in_s: float) -> None:
        super().__init__(reason)
        self.retry_in_s = retry_in_s



def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


_BOOT = _boot_id()
_OWNERS: set[str] = set()  # the lease holders this process made (a lease of this pid not among them is a dead one's)


def _alive(owner: str) -> bool:
    """Whether a lease's holder (``BOOT:PID:TOKEN``) may still be running: of this boot, its process still there. A
    holder written another way (an older version's bare token) is taken as alive: its lease runs out as before."""
    boot, _, rest = owner.partition(":")
    pid, _, token = rest.partition(":")
    if not token or not pid.isascii() or not pid.isdigit():
        return True
    if boot and _BOOT and boot != _BOOT:  # another boot: gone (where either side could not read its boot, the pid decides)
        return False
    if int(pid) == os.getpid():  # this process: held by one of its own outboxes, or by an earlier process with its pid
        return owner in _OWNERS
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # running, as another user
        return True
    return True


def _default_retry(item: OutboxItem, exc: Exception) -> float:
    """Exponential: 2 s, 4 s, ... capped at 5 minutes."""
    return min(300.0, 2.0 * 2 ** max(0, item.attempts - 1))
