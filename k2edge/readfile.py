"""Reading a small file a user names (a config, a card, a profile, labels, a key) without hanging or exhausting memory.

``Path.read_bytes`` on a named pipe waits for a writer forever, and on ``/dev/zero`` reads until memory runs
out. :func:`read_small` opens without blocking, takes only regular files, and reads at most ``limit`` bytes;
what it refuses is an ``OSError`` whose ``strerror`` says why, so every caller's existing "cannot read
(...)" message carries it.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["MIB", "read_small"]

MIB = 1 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_small(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Raises:
        FileNotFoundError: there is no such file.
        OSError: it cannot be opened or read, it is not a regular file (``strerror`` "not a regular file: a
            named pipe"), or it holds more than ``limit`` bytes (``strerror`` "larger than 1 MiB").
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "a special file")
            raise OSError(errno.EINVAL, f"not a regular file: {kind}", os.fspath(path))
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {_size(limit)}", os.fspath(path))
    return data


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n:,} bytes"
