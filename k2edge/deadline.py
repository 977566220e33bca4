"""One deadline per request: an absolute time on one clock (``time.monotonic``), or none.

A request's deadline is the earlier of what it asks for (``deadline_ms``, counted from its
arrival at the daemon) and what is left of its MQTT 5 Message Expiry Interval (the broker counts
that down while the message waits, so it is counted from publication, in whole seconds: mosquitto
keeps time in whole seconds, so the expiry it reports is right to within a second). Every
stage of the request path asks the same object; nothing converts it to milliseconds here and an
absolute time there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

__all__ = ["Deadline", "clock"]

clock = time.monotonic


@dataclass(frozen=True)
class Deadline:
    """When an answer stops being useful.

    Attributes:
        at: ``clock()`` seconds after which no ``ok`` answer may be sent; None = no deadline.
        why: what set it, for error messages (``"deadline_ms 500"``, ``"message expiry 3 s"``).
    """

    at: float | None = None
    why: str = ""

    @classmethod
    def of(cls, received: float, deadline_ms: float | None = None, expiry_s: int | None = None) -> "Deadline":
        """The earlier of ``deadline_ms`` after ``received`` and ``expiry_s`` (the expiry left on arrival)."""
        candidates = []
        if deadline_ms is not None:
            candidates.append((received + deadline_ms / 1e3, f"deadline_ms {deadline_ms:g}"))
        if expiry_s is not None:  # whole seconds left by the broker's clock; 0: under a second (expiring now)
            candidates.append((received + float(expiry_s), f"message expiry ({expiry_s} s left on arrival)"))
        if not candidates:
            return cls()
        at, why = min(candidates)
        return cls(at, why)

    @property
    def set(self) -> bool:
        return self.at is not None

    def remaining(self, now: float | None = None) -> float:
        """Seconds left (may be negative); ``inf`` without a deadline."""
        if self.at is None:
            return math.inf
        return self.at - (clock() if now is None else now)

    def expired(self, now: float | None = None) -> bool:
        return self.at is not None and (clock() if now is None else now) >= self.at

    def wall_clock(self) -> float | None:
        """The same instant on the wall clock (what survives a restart, e.g. in the outbox)."""
        return None if self.at is None else time.time() + self.remaining()
