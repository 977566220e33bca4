"""The media store: snapshot (and clip) files beside the event store (``<state>/media/<event_id>.jpg``),
named by their event's id so an event's media are found from the event alone, under a byte budget
and an age limit.

The oldest media go first: a write that would pass ``max_bytes`` removes the oldest files until it
fits, and :meth:`MediaStore.purge` (about once a second) removes those older than ``max_age_s``.
Events are never removed: an event whose medium went keeps naming it, and the file is gone. A write
that fails (a full disk) fails that medium only; the store says so (:attr:`MediaStore.degraded`)
until a write succeeds again.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)

_EVENT_ID = re.compile(r"^[0-9a-f]{32}\Z")
_MEDIUM = re.compile(r"^[0-9a-f]{32}\.(jpg|mp4)\Z")
DEFAULT_MAX_BYTES = 2 * 1024 ** 3
DEFAULT_MAX_AGE_S = 30 * 86400.0


class MediaStore:
    """Media files under ``root`` (created at the first write).

    Args:
        root: the media directory (``<state>/media``).
        max_bytes: the most the media may take together.
        max_age_s: media older than this are removed.
    """

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        if max_bytes <= 0 or max_age_s <= 0:
            raise ValueError(f"media store: max_bytes and max_age_s must be above 0, got {max_bytes} and {max_age_s}")
        self.root = Path(root)  # made at the first write: a store that cannot be made fails media, not the daemon
        self.max_bytes, self.max_age_s = int(max_bytes), float(max_age_s)
        self.degraded: str | None = None  # why the last write failed, until one succeeds
        self.removed = {"budget": 0, "age": 0}
        self.failed = 0
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, float]] | None = None  # name -> (bytes, mtime), oldest first
        self._bytes = 0

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
        flush it to disk, so it is there before its event is stored; the oldest media go first to make room.

        Raises:
            OSError: the disk is full or not writable (nothing is left behind; :attr:`degraded` says so).
            ValueError: a medium larger than the whole budget, or not an event id.
        """
        path = self.path_for(event_id, ext)
        if len(data) > self.max_bytes:
            raise self._too_large(len(data))
        tmp = path.with_suffix(f".{ext}.part")
        with self._lock:
            self._load()
            self._make_room(len(data))
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as exc:
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass  # the directory itself is unusable: nothing was written
                self.failed += 1
                if self.degraded is None:
                    log.warning("media: cannot write to %s (%s): events go out without media until a write succeeds",
                                self.root, exc)
                self.degraded = f"cannot write media to {self.root}: {exc.strerror or exc}"
                raise
            self.degraded = None
            self._index[path.name] = (len(data), time.time())
            self._index.move_to_end(path.name)
            self._bytes += len(data)
        return path

    def _too_large(self, size: int) -> ValueError:
        """A medium the whole budget cannot hold: counted as failed, and :attr:`degraded` says so until a write
        succeeds (the budget is set too small for this stream's snapshots or clips)."""
        why = f"a {size}-byte medium is larger than the whole media budget ([storage] max_bytes {self.max_bytes})"
        with self._lock:
            self.failed += 1
            self.degraded = why
        return ValueError(why)

    def adopt(self, event_id: str, ext: str, source: Path) -> Path:
        """Move a medium written elsewhere on the same filesystem (a clip cut in the spool) into the store,
        flushed to disk first; the oldest media go to make room, as for :meth:`write`.

        Raises:
            OSError: it cannot be moved (``source`` is removed either way; :attr:`degraded` says so).
            ValueError: a medium larger than the whole budget, or not an event id (``source`` is removed).
        """
        path = self.path_for(event_id, ext)
        try:
            size = os.path.getsize(source)
            if size > self.max_bytes:
                raise self._too_large(size)
            with self._lock:
                self._load()
                self._make_room(size)
                try:
                    self.root.mkdir(parents=True, exist_ok=True)
                    with open(source, "rb") as f:
                        os.fsync(f.fileno())
                    os.replace(source, path)
                except OSError as exc:
                    self.failed += 1
                    self.degraded = f"cannot write media to {self.root}: {exc.strerror or exc}"
                    raise
                self.degraded = None
                self._index[path.name] = (size, time.time())
                self._index.move_to_end(path.name)
                self._bytes += size
        finally:
            Path(source).unlink(missing_ok=True)
        return path

    def read(self, event_id: str, ext: str) -> bytes | None:
        """The medium's bytes, or None when there is none (never made, or removed)."""
        try:
            return self.path_for(event_id, ext).read_bytes()
        except (OSError, ValueError):
            return None

    def purge(self, now: float | None = None) -> int:
        """Remove the media older than ``max_age_s``; how many went."""
        now = time.time() if now is None else now
        gone = 0
        with self._lock:
            self._load()
            while self._index and now - next(iter(self._index.values()))[1] > self.max_age_s:
                self._remove_oldest("age")
                gone += 1
        return gone

    def status(self) -> dict:
        """``{"bytes", "files", "max_bytes", "max_age_s", "removed": {"budget", "age"}, "failed", "degraded"}``."""
        with self._lock:
            self._load()
            return {"bytes": self._bytes, "files": len(self._index), "max_bytes": self.max_bytes,
                    "max_age_s": self.max_age_s, "removed": dict(self.removed), "failed": self.failed,
                    "degraded": self.degraded}

    # under the lock ------------------------------------------------------------------------------------
    def _load(self) -> None:
        """The index, from the directory at first use (media of earlier runs count against the budget)."""
        if self._index is not None:
            return
        found = []
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            entries = []
        for e in entries:
            try:
                if e.name.endswith(".part"):
                    os.unlink(e.path)  # a write a crash cut short
                elif _MEDIUM.match(e.name) and e.is_file():
                    st = e.stat()
                    found.append((st.st_mtime, e.name, st.st_size))
            except OSError:
                continue
        found.sort()
        self._index = OrderedDict((name, (size, mtime)) for mtime, name, size in found)
        self._bytes = sum(size for _, _, size in found)

    def _make_room(self, size: int) -> None:
        while self._index and self._bytes + size > self.max_bytes:
            self._remove_oldest("budget")

    def _remove_oldest(self, why: str) -> None:
        name, (size, _) = self._index.popitem(last=False)
        self._bytes -= size
        self.removed[why] += 1
        try:
            os.unlink(self.root / name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("media: cannot remove %s: %s", name, exc)
