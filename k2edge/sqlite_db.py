"""Opening the daemon's SQLite files (the answer book, the cloud outbox): one way, one set of pragmas."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Literal

__all__ = ["open_wal"]


def open_wal(path: Path, synchronous: Literal["NORMAL", "FULL"], schema: str | None = None,
             autocheckpoint: bool = True) -> sqlite3.Connection:
    """A connection in autocommit mode (explicit ``BEGIN``), usable from any thread (callers lock),
    in WAL mode, creating the folder and ``schema`` when missing.

    Args:
        path: the database file.
        synchronous: ``NORMAL`` (a commit survives the process dying; an OS crash may lose the last
            ones) or ``FULL`` (a commit survives a power cut).
        schema: statements run once opened (``CREATE ... IF NOT EXISTS``).
        autocheckpoint: False leaves checkpoints (which fsync) to the caller, off the request path.

    Raises:
        sqlite3.Error, OSError: the file cannot be created or opened.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={synchronous}")
    if not autocheckpoint:
        db.execute("PRAGMA wal_autocheckpoint=0")
    if schema:
        db.executescript(schema)
    return db
