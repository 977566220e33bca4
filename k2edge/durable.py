"""Replacing a file whole or not at all: the one durable write-and-rename of the project.

A power loss (or a crash) leaves either the old file or the new one, never half of one: the new
content goes to a temporary file (beside the target, or in a folder of the caller's choosing on
the same file system), is flushed and fsynced, renamed over the target, and the folder is fsynced
so the rename itself is durable.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

__all__ = ["fsync_dir", "make_dir", "replace_file", "write_replacing"]


def make_dir(path: Path) -> str | None:
    """Create the folder ``path`` (and its parents) unless it is there; why it cannot be, or None.

    The reason reads after the path: ``is a file, not a directory``, ``cannot be created: Permission denied``.
    """
    if path.exists() and not path.is_dir():
        return "is a file, not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot be created: {exc.strerror or exc}"
    return None


def fsync_dir(path: Path) -> None:
    """fsync a folder, making the names created or renamed in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replace_file(path: Path, mode: int = 0o644, *, text: bool = False, tmp_dir: Path | None = None,
                 prefix: str | None = None) -> Iterator[IO]:
    """Yield a file to write; when the block ends without an exception it replaces ``path`` durably
    (fsync, chmod ``mode``, rename, fsync the folder); otherwise it is removed and ``path`` is untouched.

    Args:
        path: the file to replace (its folder is created if missing).
        mode: permission bits of the new file.
        text: open in text mode (UTF-8, universal newlines off) instead of binary.
        tmp_dir: where the temporary file lies (same file system as ``path``); ``path``'s folder by default.
        prefix: the temporary file's name prefix (``.NAME.`` by default), for finding leftovers.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=prefix or f".{path.name}.", dir=tmp_dir or path.parent)
    tmp = Path(tmp_name)
    try:
        with (os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb")) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_replacing(path: Path, data: bytes, mode: int = 0o644, **options) -> None:
    """Replace ``path`` with ``data`` durably (see :func:`replace_file`)."""
    with replace_file(path, mode, **options) as f:
        f.write(data)
