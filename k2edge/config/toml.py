"""Reading a TOML file (the daemon config, model cards) with one clear error per problem."""

from __future__ import annotations

import os
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..errors import K2EdgeError
from ..readfile import MIB, read_small

__all__ = ["MAX_TOML_BYTES", "TOMLDecodeError", "loads", "read_toml"]

MAX_TOML_BYTES = 4 * MIB  # a config with hundreds of streams is tens of KiB

TOMLDecodeError = tomllib.TOMLDecodeError
loads = tomllib.loads


def read_toml(path: str | os.PathLike, error: type[K2EdgeError], missing: str) -> dict:
    """The file's tables.

    Args:
        path: the file.
        error: the exception to raise (``ConfigError``, ``CardError``, ...).
        missing: the message when the file does not exist.

    Raises:
        error: the file is missing, unreadable, not a regular file, over ``MAX_TOML_BYTES``, not UTF-8 or not TOML
            (naming the file).
    """
    p = Path(path)
    try:
        raw = read_small(p, MAX_TOML_BYTES)
    except FileNotFoundError:
        raise error(missing) from None
    except OSError as exc:
        raise error(f"{p}: cannot read ({exc.strerror or exc})") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{p}: not valid TOML ({exc})") from None
