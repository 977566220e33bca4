"""Counters and recent latencies for status and telemetry (thread-safe)."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

import numpy as np


class ServiceStats:
    def __init__(self, window: int = 2048) -> None:
        self._lock = threading.Lock()
        self._latency = deque(maxlen=window)
        self._batch = deque(maxlen=window)
        self.counts: Counter = Counter()
        self.started = time.time()

    def answered(self, latency_ms: float) -> None:
        with self._lock:
            self._latency.append(latency_ms)
            self.counts["ok"] += 1

    def failed(self, code: str) -> None:
        self.count(code)

    def count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def batch(self, size: int) -> None:
        with self._lock:
            self._batch.append(size)
            self.counts["batches"] += 1

    def snapshot(self) -> dict:
        with self._lock:
            lat = np.array(self._latency, dtype=np.float64)
            batches = list(self._batch)
            counts = dict(self.counts)
        pct = {f"p{q}": round(float(np.percentile(lat, q)), 3) for q in (50, 90, 99)} if lat.size else {}
        return {
            "uptime_s": round(time.time() - self.started, 1),
            "counts": counts,
            "latency_ms": pct,
            "mean_batch": round(sum(batches) / len(batches), 2) if batches else None,
        }
