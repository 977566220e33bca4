"""Retry rules for the K2 client: which failures retry, how long to wait (Retry-After first),
and how to tell a quota error (fail fast) from an ordinary rate limit."""

from __future__ import annotations

import json
import random
import re
import time
from email.utils import parsedate_to_datetime
from typing import Mapping

__all__ = ["parse_retry_after", "is_quota_error", "backoff_s", "scrub", "RETRYABLE_STATUS"]

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
# Phrases the OpenAI, Moonshot and Anthropic APIs use for a spent quota or a billing problem.
_QUOTA_RE = re.compile(r"insufficient[_ ]quota|exceeded[_ ](your[_ ])?current[_ ]quota|quota[_ ]exceeded|billing|"
                       r"credit balance|account[^.]{0,40}suspended", re.I)
_BEARER_RE = re.compile(r"(bearer\s+)[^\s'\",}]+", re.I)
_KEYLIKE_RE = re.compile(r"\b(sk|ak|key)-[A-Za-z0-9_\-]{8,}")


def parse_retry_after(headers: Mapping[str, str] | None, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms``, or ``Retry-After`` as seconds or an HTTP date; None when absent or unparsable."""
    if not headers:
        return None
    lower = {k.lower(): v for k, v in headers.items()}
    ms = lower.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = lower.get("retry-after")
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def is_quota_error(status: int | None, body) -> bool:
    """A 429 (or 402/403) whose body says the quota or billing is spent: retrying will not help."""
    if status not in (402, 403, 429):
        return False
    text = body if isinstance(body, str) else json.dumps(body, default=str) if body is not None else ""
    return bool(_QUOTA_RE.search(text))


def backoff_s(attempt: int, base: float = 0.25, cap: float = 4.0) -> float:
    """Exponential backoff with full jitter for attempt 1, 2, ..."""
    return random.uniform(0, min(cap, base * 2 ** (attempt - 1))) + base / 2


def scrub(text: str, secrets: tuple[str, ...] = ()) -> str:
    """Remove secrets from a message: the given strings, ``Bearer ...`` values and key-like tokens."""
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    text = _BEARER_RE.sub(r"\1***", text)
    return _KEYLIKE_RE.sub("***", text)
