"""The audit trail: one JSON line per bundle result, loaded or refused, in a size-rotated log.

The daemon writes every result of the model store (``install``, ``activate``, ``load``,
``rollback``) with :meth:`AuditLog.write` and publishes the returned record on ``{prefix}/audit``,
so the file on the device and the message a fleet operator sees are the same JSON.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import datetime, timezone
from pathlib import Path

from .result import BundleResult

__all__ = ["AUDIT_NAME", "AuditLog", "audit_record"]

AUDIT_NAME = "audit.log"


def audit_record(result: BundleResult, action: str, source: str, **extra) -> dict:
    """The JSON-able record of one result.

    Args:
        result: what the store (or a verification) returned.
        action: what was attempted: ``verify``, ``install``, ``activate``, ``load``, ``rollback``.
        source: where the bundle came from: a path, ``mqtt:TOPIC``, ``https://...``, ``config``.
        extra: more fields (``device``, ``request_id``, ...); they never replace the standard ones.

    Returns:
        ``time`` (ISO 8601 UTC), ``action``, ``source``, ``status``, ``ok``, ``detail``, ``model``,
        ``version``, ``previous``, ``key_id``, ``manifest_sha256``, then ``extra``.
    """
    record = {
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "action": action,
        "source": source,
        "status": result.status,
        "ok": result.ok,
        "detail": result.detail,
        "model": result.name,
        "version": result.version,
        "previous": result.previous,
        "key_id": result.key_id,
        "manifest_sha256": result.sha256,
    }
    for key, value in extra.items():
        record.setdefault(key, value)
    return record


class AuditLog:
    """An append-only JSON-lines file rotated by size (``audit.log``, ``audit.log.1``, ...).

    Args:
        path: the log file, normally ``STATE/audit.log``.
        max_bytes: rotate before a line would take the file past this size.
        backups: rotated files kept; the oldest is deleted.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int = 1 << 20, backups: int = 5) -> None:
        if max_bytes < 1024 or backups < 1:
            raise ValueError("an audit log needs max_bytes >= 1024 and backups >= 1")
        self.path, self.max_bytes, self.backups = Path(path), max_bytes, backups
        self._lock = threading.Lock()

    def write(self, result: BundleResult, action: str, source: str, **extra) -> dict:
        """Append the result's record (fsynced: deploys are rare and the trail must survive a power loss).

        Returns:
            The record written (see :func:`audit_record`), ready to publish.

        Raises:
            OSError: the state directory is not writable.
        """
        record = audit_record(result, action, source, **extra)
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.max_bytes:
                self._rotate()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        return record

    def _rotate(self) -> None:
        oldest = self.path.with_name(f"{self.path.name}.{self.backups}")
        oldest.unlink(missing_ok=True)
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def files(self) -> list[Path]:
        """The log and its rotated files, newest first."""
        rotated = [self.path.with_name(f"{self.path.name}.{i}") for i in range(1, self.backups + 1)]
        return [p for p in [self.path, *rotated] if p.exists()]

    def records(self) -> list[dict]:
        """Every record still on disk, oldest first."""
        out = []
        for p in reversed(self.files()):
            out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return out
