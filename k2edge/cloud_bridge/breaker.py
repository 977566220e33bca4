"""A circuit breaker, so a dead cloud costs nothing per request.

``closed`` (calls go through; consecutive failures counted) -> ``open`` after ``failures`` in a row
(calls fail at once, no network) -> ``half_open`` once ``cooldown_s`` has passed: exactly one
probe call goes through while the others are still refused; its success closes the breaker, its
failure opens it for another cooldown. A fatal failure (quota spent, key rejected) opens it at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Literal

log = logging.getLogger(__name__)

__all__ = ["CircuitBreaker", "BreakerState"]

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Thread-safe; ``clock`` is injectable for tests.

    Args:
        failures: consecutive failures that open it.
        cooldown_s: open time before a probe.
        clock: monotonic seconds.
    """

    def __init__(self, failures: int = 5, cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._consecutive = 0
        self._opened_at: float | None = None
        self._probing = False
        self._probe_started = 0.0
        self.last_error: str | None = None
        self.opened_count = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._peek()

    def _peek(self) -> BreakerState:
        if self._state == "open" and self._opened_at is not None and self._clock() - self._opened_at >= self.cooldown_s:
            return "half_open"
        return self._state

    def allow(self) -> bool:
        """May a call go out now? In half-open, True for the one probe only (the caller must then
        report its outcome with :meth:`record_success` or :meth:`record_failure`)."""
        with self._lock:
            state = self._peek()
            if state == "closed":
                return True
            stale_probe = self._probing and self._clock() - self._probe_started >= self.cooldown_s
            if state == "half_open" and (not self._probing or stale_probe):
                self._state, self._probing, self._probe_started = "half_open", True, self._clock()
                log.info("cloud circuit breaker half-open: sending one probe")
                return True
            return False

    def release_probe(self) -> None:
        """The allowed call was not made after all (e.g. no time left): give the probe slot back."""
        with self._lock:
            self._probing = False

    def retry_in_s(self) -> float:
        """Seconds until a probe is allowed (0 when calls may go out)."""
        with self._lock:
            if self._state == "open" and self._opened_at is not None:
                return max(0.0, self.cooldown_s - (self._clock() - self._opened_at))
            return 0.0

    def record_success(self) -> None:
        with self._lock:
            if self._state != "closed":
                log.info("cloud circuit breaker closed: the cloud answered")
            self._state, self._consecutive, self._probing, self._opened_at = "closed", 0, False, None

    def record_failure(self, reason: str = "", *, fatal: bool = False) -> None:
        """Count one failed call (after its retries). ``fatal`` opens the breaker at once."""
        with self._lock:
            self.last_error = reason or self.last_error
            self._consecutive += 1
            probe_failed = self._state == "half_open"
            self._probing = False
            if fatal or probe_failed or self._consecutive >= self.failures:
                if self._state != "open" or probe_failed:
                    self.opened_count += 1
                    log.warning("cloud circuit breaker open for %.0f s after %d failure(s): %s",
                                self.cooldown_s, self._consecutive, reason)
                self._state, self._opened_at = "open", self._clock()

    def snapshot(self) -> dict:
        with self._lock:
            state = self._peek()
            retry = max(0.0, self.cooldown_s - (self._clock() - self._opened_at)) if self._state == "open" and self._opened_at else 0.0
            return {"state": state, "consecutive_failures": self._consecutive, "retry_in_s": round(retry, 3),
                    "opened_count": self.opened_count, "last_error": self.last_error}
