"""Reading the K2 API key from where :class:`~k2edge.config.cloud.CloudSettings` says (file, systemd credential, environment).

The key is read into a ``SecretStr``, whose ``repr``/``str`` are masked.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Mapping

from pydantic import SecretStr

from ..config.cloud import CloudSettings, shown_env_name, shown_key_path
from ..readfile import MAX_SECRET_BYTES, read_small
from .errors import CloudConfigError

log = logging.getLogger(__name__)

__all__ = ["resolve_api_key"]


def resolve_api_key(settings: CloudSettings, environ: Mapping[str, str] | None = None) -> SecretStr | None:
    """Read the key from where ``settings`` says. None when no source is configured.

    Raises:
        CloudConfigError: the file/credential/variable is missing, unreadable or empty (the
            message names the source, never a key).
    """
    env = os.environ if environ is None else environ
    if settings.api_key_file is not None:
        return SecretStr(_read_key_file(Path(settings.api_key_file), f"api_key_file {shown_key_path(settings.api_key_file)}"))
    if settings.api_key_credential is not None:
        creds = env.get("CREDENTIALS_DIRECTORY")
        if not creds:
            raise CloudConfigError(f"api_key_credential {settings.api_key_credential!r}: $CREDENTIALS_DIRECTORY is not set; "
                                   f"add LoadCredential={settings.api_key_credential}:/path/to/key to the systemd unit")
        return SecretStr(_read_key_file(Path(creds) / settings.api_key_credential,
                                        f"systemd credential {settings.api_key_credential}"))
    if settings.api_key_env is not None:
        value = (env.get(settings.api_key_env) or "").strip()
        shown = shown_env_name(settings.api_key_env)
        if not value:
            raise CloudConfigError(f"api_key_env: environment variable {shown} is not set or empty")
        return SecretStr(_checked(value, f"api_key_env: environment variable {shown}"))
    return None


def _read_key_file(path: Path, what: str) -> str:
    try:
        text = read_small(path, MAX_SECRET_BYTES).decode("utf-8").strip()
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CloudConfigError(f"{what}: the file does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CloudConfigError(f"{what}: cannot read it ({type(exc).__name__}: {getattr(exc, 'strerror', None) or 'unreadable'})") from None
    if not text:
        raise CloudConfigError(f"{what}: the file is empty")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("%s is readable by other users (mode %o); chmod 600 it", what, stat.S_IMODE(mode))
    return _checked(text, what)


def _checked(key: str, what: str) -> str:
    """``key`` when every character can go in an HTTP header (printable ASCII; a space inside is allowed, as some
    self-hosted servers' keys have one); else one line naming where, not what."""
    bad = next((i for i, ch in enumerate(key) if not " " <= ch <= "~"), None)
    if bad is not None:
        raise CloudConfigError(f"{what}: the key holds a line break, a control character or a character an HTTP header "
                               f"cannot carry (character {bad + 1} of {len(key)}); it must be the key alone, on one line")
    return key

