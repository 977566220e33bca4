"""Reading a file a user names: a small one (a config, a card, a profile, labels, a key) without hanging or
exhausting memory, and a NumPy file without NumPy's guess that anything else is a pickle.

``Path.read_bytes`` on a named pipe waits for a writer forever, and on ``/dev/zero`` reads until memory runs
out. :func:`read_small` opens without blocking, takes only regular files, and reads at most ``limit`` bytes;
what it refuses is an ``OSError`` whose ``strerror`` says why, so every caller's existing "cannot read
(...)" message carries it.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["MIB", "load_numpy", "read_small"]

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
    for unit, size in (("MiB", MIB), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,} bytes"


_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # an archive with members, an empty one


def load_numpy(path: str | os.PathLike):
    """``np.load(path)`` of a .npy array or an .npz archive, never of pickled objects.

    ``np.load`` takes any file that is neither for a pickle ("This file contains pickled (object) data"), which
    tells someone who gave a damaged or wrong file nothing; this says what the file is not.

    Raises:
        OSError: it cannot be opened or read.
        ValueError: one line saying why it is no NumPy array file.
    """
    import numpy as np

    with open(path, "rb") as f:
        head = f.read(len(_NPY_MAGIC))
    if not head.startswith(_NPY_MAGIC) and not head.startswith(_ZIP_MAGICS):
        raise ValueError("not a NumPy file: neither a .npy array (numpy.save) nor an .npz archive (numpy.savez)")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as exc:
        if "pickle" in str(exc):
            raise ValueError("it holds Python objects (pickled), which are not loaded; save numbers only") from None
        raise ValueError(str(exc).splitlines()[0][:160] or type(exc).__name__) from None
