"""A content-addressed cache for build artefacts (normalised models, Q/DQ models, engines).

Entries live under ``<root>/<kind>/<key>/`` with a ``manifest.json`` recording the sha256 of every
file. An entry is verified before use; a corrupted, truncated or mismatched entry is logged,
removed and rebuilt — never used. Entries are built in a temporary directory and renamed into
place, so a crash mid-build leaves nothing half-written behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..readfile import file_sha256

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def default_cache_dir() -> Path:
    """``$K2EDGE_CACHE_DIR``, else ``$CACHE_DIRECTORY`` (systemd), else ``~/.cache/k2edge``."""
    for var in ("K2EDGE_CACHE_DIR", "CACHE_DIRECTORY"):
        if os.environ.get(var):
            return Path(os.environ[var].split(os.pathsep)[0])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k2edge"


def digest(*parts: bytes | str) -> str:
    """sha256 over length-prefixed parts (so ('ab','c') and ('a','bc') differ)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    """A verified cache entry."""

    path: Path
    key: str
    meta: dict
    hit: bool

    def file(self, name: str) -> Path:
        return self.path / name


class EngineCache:
    """Build-once storage keyed by content hashes.

    Args:
        root: cache directory (created on first write).
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def entry_dir(self, kind: str, key: str) -> Path:
        return self.root / kind / key

    def get_or_build(self, kind: str, key: str, build: Callable[[Path], dict | None], what: str = "") -> CacheEntry:
        """Return the verified entry ``kind/key``, building it with ``build(tmpdir)`` when absent or bad.

        ``build`` writes its files into the directory it is given and may return metadata to keep.
        """
        final = self.entry_dir(kind, key)
        problem = self.verify(final)
        if problem is None:
            return CacheEntry(final, key, self._manifest(final).get("meta", {}), hit=True)
        if final.exists():
            log.warning("cache entry %s/%s failed verification (%s); rebuilding", kind, key[:12], problem)
            shutil.rmtree(final, ignore_errors=True)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=final.parent))
        except OSError as exc:
            from ..errors import BuildError

            raise BuildError(f"engine cache {str(self.root)!r} is not a writable directory ({exc.strerror or exc}); "
                             f"pass --cache DIR (the daemon: [service] cache_dir) or set K2EDGE_CACHE_DIR") from None
        try:
            started = time.perf_counter()
            meta = build(tmp) or {}
            files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
            manifest = {"key": key, "kind": kind, "what": what, "created": time.time(),
                        "build_seconds": round(time.perf_counter() - started, 3), "files": files, "meta": meta}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            try:
                os.rename(tmp, final)
            except OSError:
                # another process finished the same build first: use theirs if it verifies
                if self.verify(final) is not None:
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return CacheEntry(final, key, self._manifest(final).get("meta", {}), hit=False)

    def verify(self, path: Path) -> str | None:
        """None when the entry at ``path`` is complete and every checksum matches, else why not."""
        if not path.is_dir():
            return "missing"
        try:
            manifest = self._manifest(path)
        except (OSError, ValueError) as exc:
            return f"unreadable manifest: {exc}"
        if manifest.get("key") != path.name:
            return "manifest key does not match the entry"
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            return "manifest lists no files"
        for name, expected in files.items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if file_sha256(f) != expected:
                return f"{name} checksum mismatch"
        return None

    @staticmethod
    def _manifest(path: Path) -> dict:
        return json.loads((path / MANIFEST).read_text())
