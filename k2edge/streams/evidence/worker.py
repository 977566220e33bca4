"""The evidence stage's thread: jobs (a processed frame's events and its pixels) are handed over by
the model's thread and done here, so drawing and encoding never delay the next frame."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

QUEUE_SIZE = 8  # frames with events waiting for their snapshots (their pixels held); a full queue refuses, never blocks


class EvidenceWorker:
    """A named thread running ``handle(job)`` for each job submitted, in order.

    Args:
        handle: does one job (the stream path's evidence step); an exception is logged, the thread goes on.
        size: how many jobs may wait.
    """

    def __init__(self, handle: Callable[[object], None], size: int = QUEUE_SIZE) -> None:
        self._handle = handle
        self._jobs: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name="k2edge-evidence", daemon=True)
        self.size = size

    def start(self) -> None:
        self._thread.start()

    def submit(self, job) -> bool:
        """Queue ``job``; False (at once) when the queue is full or the worker stopped."""
        if self._stop.is_set():
            return False
        try:
            self._jobs.put_nowait(job)
            return True
        except queue.Full:
            return False

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=0.2)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                self._handle(job)
            except Exception:
                log.exception("evidence: a job failed")
            finally:
                self._jobs.task_done()

    def stop(self, timeout: float) -> bool:
        """Take no new jobs, finish those waiting (within ``timeout``); True when the thread ended."""
        self._stop.set()
        end = time.monotonic() + timeout
        if self._thread.is_alive():
            self._thread.join(max(0.0, end - time.monotonic()))
        return not self._thread.is_alive()
