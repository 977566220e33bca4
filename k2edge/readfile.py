"""Reading a file a user names: a small one (a config, a card, a profile, labels, a key) without hanging or
exhausting memory, and a NumPy file without NumPy's guess that anything else is a pickle.

``Path.read_bytes`` on a named pipe no one writes to waits in ``open`` forever, and on ``/dev/zero`` reads until
memory runs out. :func:`read_small` opens without blocking (a pipe with no writer then reads as empty; one with a
writer, such as the shell's ``--config <(envsubst < k2edge.toml.in)``, is read as it comes) and reads at most
``limit`` bytes; what it refuses is an ``OSError`` whose ``strerror`` says why, so every caller's existing "cannot
read (...)" message carries it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import zipfile

__all__ = ["MAX_SECRET_BYTES", "MIB", "file_sha256", "load_numpy", "read_small"]

MIB = 1 << 20
MAX_SECRET_BYTES = 64 * 1024  # a password, an API key, a PEM key: a few hundred bytes


def _open(path: str | os.PathLike) -> int:
    """A descriptor of ``path`` for reading, opened without waiting for a pipe's writer, then blocking again."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EISDIR, "a directory, not a file", os.fspath(path))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of ``path``, at most ``limit`` of them.

    Raises:
        FileNotFoundError: there is no such file.
        OSError: it cannot be opened or read, it is a directory, or it holds more than ``limit`` bytes
            (``strerror`` "larger than 1 MiB").
    """
    with os.fdopen(_open(path), "rb") as f:
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
        OSError: it cannot be opened or read, or it is a directory.
        ValueError: one line saying why it is no NumPy array file (a pipe or device, not NumPy's format, pickled
            objects, a damaged archive).
    """
    import numpy as np

    with os.fdopen(_open(path), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a file NumPy can load (a pipe or a device); give a .npy or .npz file")
        head = f.read(len(_NPY_MAGIC))
    if not head.startswith(_NPY_MAGIC) and not head.startswith(_ZIP_MAGICS):
        raise ValueError("not a NumPy file: neither a .npy array (numpy.save) nor an .npz archive (numpy.savez)")
    try:
        return np.load(path, allow_pickle=False)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"a damaged .npz archive ({exc})") from None
    except (ValueError, EOFError) as exc:
        if "pickle" in str(exc):
            raise ValueError("it holds Python objects (pickled), which are not loaded; save numbers only") from None
        raise ValueError(str(exc).splitlines()[0][:160] or type(exc).__name__) from None


def file_sha256(path: str | os.PathLike) -> str:
    """The file's sha256 (hex), read a MiB at a time: a model or a bundle of gigabytes never whole in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MIB):
            h.update(block)
    return h.hexdigest()
