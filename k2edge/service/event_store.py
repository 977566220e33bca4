"""Stream events, stored before they are published: an event raised while the broker is away is
delivered once it returns, and one raised just before a crash is delivered at the next start.

Each event is one row keyed by its ``event_id``, holding the exact bytes published: a redelivery
(after a broker restart, or at the next start) is byte-identical, never a second, different event
for the same crossing. A row is marked delivered when the broker acknowledged it (QoS 1).
Independent of ``[cloud]`` and its outbox.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from ..sqlite_db import open_wal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL UNIQUE,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    delivered INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS events_pending ON events (delivered, seq);
"""
KEEP_DELIVERED = 10_000  # delivered rows kept (a short history for inspection); older ones are pruned


class EventStore:
    """The SQLite event store (``<state>/events.sqlite``)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._db = open_wal(self.path, "NORMAL", _SCHEMA)
        self._lock = threading.Lock()
        self._since_prune = 0

    def add(self, rows: list[tuple[str, str, bytes]]) -> None:
        """Store ``(event_id, topic, payload)`` rows in one transaction (before publishing them)."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR IGNORE INTO events (event_id, topic, payload) VALUES (?, ?, ?)", rows)
            self._db.execute("COMMIT")

    def delivered(self, event_ids: list[str]) -> None:
        """The broker acknowledged these events (one transaction)."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany("UPDATE events SET delivered = 1 WHERE event_id = ?", [(i,) for i in event_ids])
            self._db.execute("COMMIT")
            self._since_prune += len(event_ids)
            if self._since_prune >= 1000:
                self._since_prune = 0
                self._db.execute("DELETE FROM events WHERE delivered = 1 AND seq < "
                                 "(SELECT seq FROM events WHERE delivered = 1 ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                                 (KEEP_DELIVERED,))

    def pending(self) -> list[tuple[str, str, bytes]]:
        """``(event_id, topic, payload)`` of every event not yet acknowledged, oldest first."""
        with self._lock:
            return self._db.execute("SELECT event_id, topic, payload FROM events WHERE delivered = 0 ORDER BY seq").fetchall()

    def recent(self, limit: int = 50, stream: str | None = None) -> list[dict]:
        """The newest ``limit`` events (of ``stream``), newest first, as their payloads."""
        with self._lock:
            rows = self._db.execute("SELECT payload FROM events ORDER BY seq DESC LIMIT ?",
                                    (limit if stream is None else max(limit * 20, 1000),)).fetchall()
        out = []
        for (payload,) in rows:
            body = json.loads(payload)
            if stream is None or body.get("stream") == stream:
                out.append(body)
                if len(out) >= limit:
                    break
        return out

    def find(self, event_id: str) -> dict | None:
        """One event's payload, or None."""
        with self._lock:
            row = self._db.execute("SELECT payload FROM events WHERE event_id = ?", (event_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def close(self) -> None:
        with self._lock:
            self._db.close()
