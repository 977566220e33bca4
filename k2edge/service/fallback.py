"""The local fallback of a request in the cloud pool, on time whatever the cloud does.

A request sent to the cloud may have to be answered locally after all (the cloud hangs, answers
late, or the pool is busy with other calls). Waiting for the cloud call to give up before
answering puts the reply at the mercy of one thread's wake-up on a loaded machine; instead every
cloud job is armed here, at its deadline less the reserve that covers the local answer and the
publish, and whichever comes first — the cloud's outcome or this timer — replies
(:class:`Settled`: once). One thread serves every armed job.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from typing import Callable

from ..deadline import clock

log = logging.getLogger(__name__)


class Settled:
    """A reply that may come from two places: the first to :meth:`claim` it gives it."""

    __slots__ = ("_lock", "taken")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.taken = False

    def claim(self) -> bool:
        with self._lock:
            if self.taken:
                return False
            self.taken = True
            return True


class FallbackTimer:
    """Runs each armed callback at its time (``clock()`` seconds), on one thread, in time order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="k2edge-fallback", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Run nothing more (callbacks not yet due are dropped: their cloud calls reply)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def arm(self, at: float, callback: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (at, next(self._seq), callback))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (not self._heap or self._heap[0][0] > clock()):
                    self._cond.wait(self._heap[0][0] - clock() if self._heap else None)
                if self._stopping:
                    return
                _, _, callback = heapq.heappop(self._heap)
            try:
                callback()
            except Exception:
                log.exception("a request's local fallback failed")
