"""The per-minute cloud request budget (a sliding 60-second window), so spend has a cap."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

__all__ = ["RequestBudget"]


class RequestBudget:
    """At most ``per_minute`` cloud requests in any 60 s; None = unlimited. Thread-safe.

    Args:
        per_minute: the cap.
        clock: monotonic seconds (injectable for tests).
        window_s: the window (60 s).
    """

    def __init__(self, per_minute: int | None, clock: Callable[[], float] = time.monotonic, window_s: float = 60.0) -> None:
        self.per_minute = per_minute
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._spent: deque[float] = deque()
        self.refused = 0

    def _trim(self, now: float) -> None:
        while self._spent and self._spent[0] <= now - self.window_s:
            self._spent.popleft()

    def remaining(self) -> int | None:
        """Requests left in the current window (None when unlimited)."""
        if self.per_minute is None:
            return None
        with self._lock:
            self._trim(self._clock())
            return max(0, self.per_minute - len(self._spent))

    def try_acquire(self) -> bool:
        """Spend one request if the budget allows; False (and nothing spent) when it is used up."""
        if self.per_minute is None:
            return True
        with self._lock:
            now = self._clock()
            self._trim(now)
            if len(self._spent) >= self.per_minute:
                self.refused += 1
                return False
            self._spent.append(now)
            return True

    def resets_in_s(self) -> float:
        """Seconds until one more request is allowed (0 when one is allowed now)."""
        if self.per_minute is None:
            return 0.0
        with self._lock:
            now = self._clock()
            self._trim(now)
            if len(self._spent) < self.per_minute:
                return 0.0
            return max(0.0, self._spent[0] + self.window_s - now)

    def snapshot(self) -> dict:
        return {"per_minute": self.per_minute, "remaining": self.remaining(), "resets_in_s": round(self.resets_in_s(), 3),
                "refused": self.refused}
