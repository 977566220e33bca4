"""Reading a TOML file (the daemon config, model cards) with one clear error per problem."""

from __future__ import annotations

import os
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..errors import K2EdgeError

__all__ = ["TOMLDecodeError", "loads", "read_toml"]

TOMLDecodeError = tomllib.TOMLDecodeError
loads = tomllib.loads


def read_toml(path: str | os.PathLike, error: type[K2EdgeError], missing: str) -> dict:
    """The file's tables.

    Args:
        path: the file.
        error: the exception to raise (``ConfigError``, ``CardError``, ...).
        missing: the message when the file does not exist.

    Raises:
        error: the file is missing, unreadable, not UTF-8 or not TOML (naming the file).
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise error(missing) from None
    except OSError as exc:
        raise error(f"{p}: cannot read ({exc.strerror or exc})") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{p}: not valid TOML ({exc})") from None
