"""The prefetch ring: preallocated input buffers filled by a staging thread ahead of the engine.

With ``dma_prefetch`` on, a staging thread decodes, resizes and normalises request n+1 into a
free ring slot while the engine runs request n; the engine hands the slot back once the first
segment has consumed it. On a Jetson the same ring holds page-locked buffers and the copy runs on
a separate CUDA stream; here the ring is host memory and the "copy" is the staging itself.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

_DONE = object()


@dataclass
class StagedItem:
    """A ring slot holding one staged batch, or the error staging raised."""

    slot: int | None
    items: list
    error: BaseException | None = None
    meta: Any = None  # what stage_into returned (the items' geometries)


class PrefetchRing:
    """``depth`` buffers of ``shape``; a staging thread fills them from an iterable of item groups.

    Args:
        shape: one buffer's shape (the model input, batch included).
        depth: number of buffers (how far staging may run ahead).
        stage_into: ``stage_into(items, buffer)`` fills ``buffer`` from a group of raw items; what it
            returns (e.g. where each image landed) travels with the slot as ``StagedItem.meta``.
    """

    def __init__(self, shape: tuple[int, ...], depth: int, stage_into: Callable[[list, np.ndarray], Any],
                 dtype=np.float32):
        self.buffers = [np.empty(shape, dtype=dtype) for _ in range(depth)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(depth):
            self._free.put(i)
        self._ready: queue.Queue[Any] = queue.Queue()
        self._stage_into = stage_into
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, groups: Iterable[list]) -> "PrefetchRing":
        self._thread = threading.Thread(target=self._fill, args=(iter(groups),), name="k2edge-prefetch", daemon=True)
        self._thread.start()
        return self

    def _fill(self, groups) -> None:
        try:
            for items in groups:
                slot = self._take_free()
                if slot is None:
                    return
                try:
                    meta = self._stage_into(items, self.buffers[slot])
                    self._ready.put(StagedItem(slot, items, meta=meta))
                except Exception as exc:  # a bad input fails its own request only
                    self._free.put(slot)
                    self._ready.put(StagedItem(None, items, exc))
        except BaseException as exc:  # the source iterator itself failed
            self._ready.put(StagedItem(None, [], exc))
        finally:
            self._ready.put(_DONE)

    def _take_free(self) -> int | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def __iter__(self):
        while True:
            item = self._ready.get()
            if item is _DONE:
                return
            yield item

    def release(self, slot: int) -> None:
        """Give a slot back once the engine has consumed its contents."""
        self._free.put(slot)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
