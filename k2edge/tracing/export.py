"""The batching span processor: a bounded queue between the spans' threads and one exporter thread.

``on_end`` runs on the thread that ended a span (the request path's, a lane's, a cloud worker's):
it appends to a deque under a lock, or counts a drop when ``queue_size`` spans already wait, and
never waits for the collector. The exporter thread sends up to ``batch_size`` spans at a time, every
``export_interval_ms`` or as soon as a batch is full; a batch the collector refuses or cannot take is
dropped and counted too (spans are diagnostics: holding them for a collector that is down would only
move the memory problem). The SDK's ``BatchSpanProcessor`` also bounds its queue, but drops without
a count a program can read; ``k2edge_trace_spans_dropped_total`` is that count.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

log = logging.getLogger(__name__)

__all__ = ["BoundedBatchProcessor"]


class BoundedBatchProcessor:
    """An OpenTelemetry ``SpanProcessor`` (duck-typed: the SDK calls ``on_start``, ``on_end``, ``shutdown``,
    ``force_flush``).

    Args:
        exporter: ``export(spans) -> bool`` and ``close()`` (:class:`~k2edge.tracing.otlp.OtlpHttpExporter`).
        queue_size: most spans waiting; beyond it new spans are dropped.
        batch_size: most spans in one export.
        interval_s: how long spans wait for companions.
    """

    def __init__(self, exporter, queue_size: int = 2048, batch_size: int = 512, interval_s: float = 0.5) -> None:
        self.exporter = exporter
        self.queue_size, self.batch_size, self.interval_s = queue_size, batch_size, interval_s
        self.dropped = 0  # spans lost: queue full, or the collector did not take them
        self.exported = 0
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._flushes: list[threading.Event] = []
        self._thread = threading.Thread(target=self._loop, name="k2edge-trace-export", daemon=True)
        self._thread.start()

    # the SpanProcessor interface ---------------------------------------------------------------------------
    def on_start(self, span, parent_context=None) -> None:
        pass

    def _on_ending(self, span) -> None:  # SDK >= 1.34 calls it; nothing to do before the span is read-only
        pass

    def on_end(self, span) -> None:
        with self._cond:
            if len(self._queue) >= self.queue_size or self._stop:
                self.dropped += 1
                return
            self._queue.append(span)
            if len(self._queue) == self.batch_size:  # once, as a batch fills: a wake-up per span would cost the GIL
                self._cond.notify()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what waits now; True when that finished within the timeout."""
        done = threading.Event()
        with self._cond:
            self._flushes.append(done)
            self._cond.notify()
        return done.wait(timeout_millis / 1000)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what waits (within ``timeout_s``), then stop the thread."""
        self.force_flush(int(timeout_s * 1000))
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)
        self.exporter.close()

    # the exporter thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:  # one batch per hold of the lock: the spans' threads wait for a few pops at most
                if not self._stop and not self._flushes and len(self._queue) < self.batch_size:
                    self._cond.wait(self.interval_s)
                n = min(self.batch_size, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
                flushes = []
                if not self._queue:  # what waited when a flush was asked for is on its way
                    flushes, self._flushes = self._flushes, []
                stop = self._stop and not self._queue
            if batch:
                ok = False
                try:
                    ok = self.exporter.export(batch)
                except Exception:  # never let the exporter thread die: spans are diagnostics
                    log.exception("exporting %d span(s) failed", len(batch))
                with self._cond:
                    if ok:
                        self.exported += len(batch)
                    else:
                        self.dropped += len(batch)
            for f in flushes:
                f.set()
            if stop:
                return
