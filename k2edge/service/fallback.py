"""The local fallback of a request in the cloud pool, on time whatever the cloud does.

A request sent to the cloud may have to be answered locally after all (the cloud hangs, answers
late, or the pool is busy with other calls). Waiting for the cloud call to give up before
answering puts the reply at the mercy of one thread's wake-up on a loaded machine; instead every
cloud job is armed here, at its deadline less the reserve that covers its publish, with its local
answer ready, and whichever comes first — the cloud's outcome or this timer — replies
(:class:`Settled`: once).

One thread serves every armed job and hands all that are due at once to one callback (one record
transaction for them). It learns how late its replies reach the broker on this machine (a loaded CPU
wakes it late, and slows the publish): every job waiting fires :meth:`FallbackTimer.margin` before
its time, so what the first of a burst of jobs learns moves the rest of that burst earlier too.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import deque
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
    """Hands each armed job to ``fire`` :meth:`margin` before its time (``clock()`` seconds), never
    before its floor, on one thread; the jobs due together go in one call.

    Args:
        fire: called with the list of due jobs, each as ``(when it was due, job)`` (the timer's thread).
        window: how many recent firings :meth:`margin` looks at.
    """

    def __init__(self, fire: Callable[[list], None], window: int = 64) -> None:
        self._fire = fire
        self._heap: list[tuple[float, int, float, object]] = []  # (time, order, floor, job)
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopping = False
        self._late: deque[float] = deque(maxlen=window)  # how late recent replies were done or delivered (s)
        self._thread = threading.Thread(target=self._run, name="k2edge-fallback", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Fire nothing more (jobs not yet due are dropped: their cloud calls reply)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def arm(self, at: float, job, floor: float | None = None) -> None:
        """Fire ``job`` by ``at``: :meth:`margin` earlier, as the margin is when it is due, but not before ``floor``."""
        with self._cond:
            heapq.heappush(self._heap, (at, next(self._seq), at if floor is None else min(floor, at), job))
            self._cond.notify()

    def margin(self) -> float:
        """Seconds each job fires early by: twice the worst of how late recent replies were done or delivered."""
        with self._cond:
            return self._margin()

    def _margin(self) -> float:
        return 2 * max(self._late, default=0.0)

    def observe(self, late_s: float) -> None:
        """A reply this timer gave reached the broker ``late_s`` seconds after its job was due: the jobs
        waiting move earlier."""
        with self._cond:
            self._late.append(max(0.0, late_s))
            self._cond.notify()

    def _due_at(self, entry: tuple[float, int, float, object]) -> float:
        at, _, floor, _ = entry
        return max(floor, at - self._margin())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (not self._heap or self._due_at(self._heap[0]) > clock()):
                    self._cond.wait(self._due_at(self._heap[0]) - clock() if self._heap else None)
                if self._stopping:
                    return
                now = clock()
                due = []  # the earliest first; one held by its floor holds the later ones at most until its time
                while self._heap and self._due_at(self._heap[0]) <= now:
                    due.append((self._due_at(self._heap[0]), heapq.heappop(self._heap)[3]))
            try:
                self._fire(due)
            except Exception:
                log.exception("the local fallback of %d request(s) failed", len(due))
            done = clock()
            with self._cond:
                self._late.append(max(0.0, done - due[0][0]))
            del due  # the jobs fired (their requests, local answers and the engines those hold) are let go now
