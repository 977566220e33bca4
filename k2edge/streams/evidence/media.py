"""The media store: snapshot files beside the event store (``<state>/media/<event_id>.jpg``), named by
their event's id so an event's media are found from the event alone."""

from __future__ import annotations

import os
import re
from pathlib import Path

_EVENT_ID = re.compile(r"^[0-9a-f]{32}$")


class MediaStore:
    """Media files under ``root`` (created if missing).

    Args:
        root: the media directory (``<state>/media``).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)  # made at the first write: a store that cannot be made fails media, not the daemon

    def path_for(self, event_id: str, ext: str) -> Path:
        """Where ``event_id``'s ``ext`` medium lives (``jpg``, ``mp4``).

        Raises:
            ValueError: ``event_id`` is not an event id (32 hex digits): nothing outside ``root`` is ever named.
        """
        if not _EVENT_ID.match(event_id):
            raise ValueError(f"not an event id: {event_id!r}")
        return self.root / f"{event_id}.{ext}"

    def write(self, event_id: str, ext: str, data: bytes) -> Path:
        """Write a medium whole (a temporary file renamed into place: a reader never sees half of one) and
        flush it to disk, so it is there before its event is stored.

        Raises:
            OSError: the disk is full or not writable (nothing is left behind).
        """
        path = self.path_for(event_id, ext)
        tmp = path.with_suffix(f".{ext}.part")
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def read(self, event_id: str, ext: str) -> bytes | None:
        """The medium's bytes, or None when there is none (never made, or removed)."""
        try:
            return self.path_for(event_id, ext).read_bytes()
        except (OSError, ValueError):
            return None
