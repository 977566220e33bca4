"""The per-minute cloud request budget (a sliding 60-second window), so spend has a cap."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

__all__ = ["RequestBudget", "Spend"]


@dataclass(frozen=True)
class Spend:
    """One request taken from the budget (what :meth:`RequestBudget.refund` gives back); always true."""

    at: float | None  # when, on the budget's clock; None: an unlimited budget recorded nothing
    shared: bool = False  # taken from the streams' share


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
        self._shared: deque[float] = deque()  # the spends of try_acquire_share (streams), also in _spent
        self.refused = 0

    def _trim(self, now: float) -> None:
        while self._spent and self._spent[0] <= now - self.window_s:
            self._spent.popleft()
        while self._shared and self._shared[0] <= now - self.window_s:
            self._shared.popleft()

    def remaining(self) -> int | None:
        """Requests left in the current window (None when unlimited)."""
        if self.per_minute is None:
            return None
        with self._lock:
            self._trim(self._clock())
            return max(0, self.per_minute - len(self._spent))

    def try_acquire(self) -> Spend | None:
        """Spend one request if the budget allows: the :class:`Spend`; None (nothing spent) when it is used up."""
        if self.per_minute is None:
            return Spend(None)
        with self._lock:
            now = self._clock()
            self._trim(now)
            if len(self._spent) >= self.per_minute:
                self.refused += 1
                return None
            self._spent.append(now)
            return Spend(now)

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

    def share_cap(self, share: float) -> int | None:
        """The most requests a ``share`` of the budget may spend in any window (None when unlimited)."""
        return None if self.per_minute is None else int(self.per_minute * share)

    def try_acquire_share(self, share: float) -> Spend | None:
        """Spend one request of the ``share`` of the budget kept for one kind of caller (streams): allowed while
        that kind spent less than ``share`` of the budget in the window and the whole budget has room, so the
        rest stays for :meth:`try_acquire`'s callers. None (nothing spent) otherwise."""
        if self.per_minute is None:
            return Spend(None, shared=True)
        cap = self.share_cap(share)
        with self._lock:
            now = self._clock()
            self._trim(now)
            if len(self._shared) >= cap or len(self._spent) >= self.per_minute:
                return None
            self._spent.append(now)
            self._shared.append(now)
            return Spend(now, shared=True)

    def refund(self, spend: Spend) -> None:
        """Give back ``spend``, a request whose call was never made (no concurrency slot, an open breaker, the daemon
        stopping): the budget caps the calls K2 sees, not the attempts to make one. That very spend goes, so the
        window still resets when the others age out; one already aged out is not in the window to give back."""
        if spend.at is None:
            return
        with self._lock:
            for spent in (self._spent, self._shared) if spend.shared else (self._spent,):
                try:
                    spent.remove(spend.at)  # spends at one instant are alike: any of them is this one
                except ValueError:
                    pass

    def share_resets_in_s(self, share: float) -> float:
        """Seconds until :meth:`try_acquire_share` may succeed (0 when it may now; the window when the share is 0)."""
        if self.per_minute is None:
            return 0.0
        cap = self.share_cap(share)
        with self._lock:
            now = self._clock()
            self._trim(now)
            waits = [0.0]
            if len(self._shared) >= cap:
                waits.append(self._shared[0] + self.window_s - now if self._shared else self.window_s)
            if len(self._spent) >= self.per_minute:
                waits.append(self._spent[0] + self.window_s - now)
            return max(0.0, *waits)

    def snapshot(self) -> dict:
        return {"per_minute": self.per_minute, "remaining": self.remaining(), "resets_in_s": round(self.resets_in_s(), 3),
                "refused": self.refused}
