"""Scheduling: a bounded intake queue, staging workers, and a dynamic batcher per model.

Nothing here runs in paho's network thread except :meth:`Scheduler.offer`, which only does a
``put_nowait``. A full queue answers ``busy`` at once. A request past its deadline is answered
``deadline_exceeded`` — before it runs if it is already late, and instead of the answer if the
answer comes too late. One failing request never takes the others down.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import InputError
from .protocol import BAD_REQUEST, DEADLINE_EXCEEDED, INTERNAL, UNKNOWN_MODEL, Request, RequestError, parse_request
from .runtime import ModelRuntime

log = logging.getLogger(__name__)


@dataclass
class Work:
    """One request from arrival to answer."""

    topic: str
    model: str
    payload: bytes
    content_type: str | None
    user_properties: dict
    response_topic: str | None
    correlation: bytes | None
    received: float
    ack_token: object = None
    reply_topic: str | None = None  # where the answer goes (Response Topic, or the fallback)
    template: dict | None = None  # the local answer, kept for a deferred cloud answer to complete
    dedupe_key: bytes | None = None
    request: Request | None = None
    sample: np.ndarray | None = None
    staged: float = 0.0
    timings: dict = field(default_factory=dict)


class Scheduler:
    """Intake queue -> staging workers -> per-model batchers -> engines -> ``respond``.

    Args:
        models: served models by name.
        respond: ``respond(work, result)`` publishes the answer; returns False when it handed the
            request on (to the cloud pool), which later comes back through :meth:`answer`.
        is_duplicate: ``is_duplicate(work)`` — True when this id was already answered or is in flight.
        route: ``route(work)`` before staging — truthy when the request leaves the local path
            (a RequestError to answer with, or True when it was handed on).
    """

    def __init__(self, models: dict[str, ModelRuntime], *, queue_size: int, max_batch: int, batch_timeout_ms: float,
                 staging_threads: int, default_deadline_ms: float | None, respond: Callable, is_duplicate: Callable,
                 route: Callable | None = None, on_batch: Callable[[int], None] | None = None) -> None:
        self.models = models
        self.intake: queue.Queue[Work | None] = queue.Queue(maxsize=queue_size)
        self._queue_size = queue_size
        self._batchers = {name: _Batcher(self, rt, max_batch, batch_timeout_ms / 1e3) for name, rt in models.items()}
        self._respond = respond
        self._is_duplicate = is_duplicate
        self._route = route
        self.on_batch = on_batch
        self._default_deadline_ms = default_deadline_ms
        self._stagers = [threading.Thread(target=self._stage_loop, name=f"k2edge-stage-{i}", daemon=True)
                         for i in range(staging_threads)]
        # answers are built and published here, not on a lane: a lane goes straight to its next batch
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._responder = threading.Thread(target=self._respond_loop, name="k2edge-respond", daemon=True)
        self._outstanding = 0
        self._idle = threading.Condition()
        self.heartbeats: dict[str, float] = {}

    # lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        now = time.monotonic()
        threads = [self._responder, *self._stagers, *(b.thread for b in self._batchers.values())]
        # every key exists before any thread runs: alive() never sees the dict change size
        self.heartbeats.update({t.name: now for t in threads})
        for t in threads:
            t.start()

    def offer(self, work: Work) -> bool:
        """Queue a request (network thread). False when ``queue_size`` requests already wait.

        Waiting means not yet handed to an engine: in the intake queue or staged for a batcher.
        """
        if self.queue_depth() >= self._queue_size:
            return False
        with self._idle:
            self._outstanding += 1
        try:
            self.intake.put_nowait(work)
            return True
        except queue.Full:
            self._finished()
            return False

    def queue_depth(self) -> int:
        return self.intake.qsize() + sum(b.depth() for b in self._batchers.values())

    def wait_idle(self, timeout: float) -> bool:
        """Block until every accepted request has been answered (drain)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def stop(self) -> None:
        for _ in self._stagers:
            self.intake.put(None)
        for b in self._batchers.values():
            b.stop()
        self._answers.put(None)
        self._responder.join(timeout=10)

    def alive(self, max_age: float) -> bool:
        """True when every worker thread lives and has looped within ``max_age`` seconds."""
        now = time.monotonic()
        threads = [*self._stagers, self._responder, *(b.thread for b in self._batchers.values())]
        return all(t.is_alive() for t in threads) and all(now - hb <= max_age for hb in self.heartbeats.values())

    # internals ---------------------------------------------------------------------------------
    def _finished(self) -> None:
        with self._idle:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

    def answer(self, work: Work, result) -> None:
        """Queue the answer (outputs, a RequestError, or None for a duplicate) for publishing."""
        self._answers.put((work, result))

    def _serve(self, q, handle) -> None:
        """A worker's loop: heartbeat, take the next item (None ends it), handle it."""
        name = threading.current_thread().name
        while True:
            self.heartbeats[name] = time.monotonic()
            try:
                item = q.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            handle(item)

    def _respond_loop(self) -> None:
        self._serve(self._answers, self._respond_one)

    def _respond_one(self, item) -> None:
        work, result = item
        done = True
        try:
            done = self._respond(work, result) is not False
        except Exception:
            log.exception("publishing the answer to %s failed", work.topic)
        finally:
            if done:
                self._finished()

    def _stage_loop(self) -> None:
        self._serve(self.intake, self._stage_one)

    def _stage_one(self, work: Work) -> None:
        try:
            self._stage(work)
        except RequestError as err:
            self.answer(work, err)
        except InputError as err:
            self.answer(work, RequestError(BAD_REQUEST, str(err), work.request.id if work.request else None))
        except Exception as exc:
            log.exception("staging a request on %s failed", work.topic)
            self.answer(work, RequestError(INTERNAL, f"internal error while staging: {type(exc).__name__}"))

    def _stage(self, work: Work) -> None:
        runtime = self.models.get(work.model)
        if runtime is None:
            raise RequestError(UNKNOWN_MODEL, f"no model {work.model!r} here; served: {sorted(self.models)}")
        req = parse_request(work.payload, work.model, work.content_type, work.user_properties, work.received)
        if req.deadline_ms is None and self._default_deadline_ms:
            req.deadline_ms = self._default_deadline_ms
        work.request = req
        if self._is_duplicate(work):
            log.info("request %s on %s already answered or in flight; not answering twice", req.id, work.topic)
            self.answer(work, None)
            return
        if req.deadline is not None and time.monotonic() > req.deadline:
            raise RequestError(DEADLINE_EXCEEDED, f"deadline of {req.deadline_ms:g} ms passed before staging", req.id)
        if self._route is not None:
            routed = self._route(work)
            if isinstance(routed, RequestError):
                raise routed
            if routed:
                return
        t0 = time.monotonic()
        work.sample = runtime.stage(req.image, req.tensor)
        work.staged = time.monotonic()
        work.timings["stage"] = (work.staged - t0) * 1e3
        work.timings["queue"] = (t0 - work.received) * 1e3
        self._batchers[work.model].put(work)


class _Batcher:
    """Adaptive dynamic batching for one model.

    A batch goes as soon as the engine has a free slot, with everything queued by then (up to
    ``max_batch``): an idle engine never makes a lone request wait, and a busy one lets requests
    pile up into the next batch. ``timeout`` > 0 additionally holds a batch for up to that long
    after its oldest request was staged, hoping for companions. Slots: one per lane plus one, so
    the engine is fed while the next batch is stacked.
    """

    STUCK_AFTER_S = 30.0  # a batch in flight this long means a wedged lane: stop the heartbeat

    def __init__(self, scheduler: Scheduler, runtime: ModelRuntime, max_batch: int, timeout: float) -> None:
        self.s = scheduler
        self.rt = runtime
        self.max_batch = max_batch
        self.timeout = timeout
        self._cond = threading.Condition()
        self._items: deque[Work] = deque()
        self._slots = len(runtime.lanes()) + 1 if hasattr(runtime, "lanes") else 2
        self._free = self._slots
        self._progress = time.monotonic()
        self._stopping = False
        self.thread = threading.Thread(target=self._loop, name=f"k2edge-batch-{runtime.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.thread.join(timeout=10)

    def put(self, work: Work) -> None:
        with self._cond:
            self._items.append(work)
            self._cond.notify()

    def depth(self) -> int:
        return len(self._items)

    def _release(self) -> None:
        with self._cond:
            self._free += 1
            self._progress = time.monotonic()
            self._cond.notify()

    def _beat(self, now: float) -> None:
        if self._free == self._slots or now - self._progress < self.STUCK_AFTER_S:
            self.s.heartbeats[self.thread.name] = now

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    self._beat(now)
                    if self._items and self._free > 0:
                        hold = self._items[0].staged + self.timeout - now
                        if self.timeout <= 0 or len(self._items) >= self.max_batch or hold <= 0 or self._stopping:
                            break
                        self._cond.wait(min(hold, 0.5))
                        continue
                    if not self._items and self._stopping:
                        return
                    self._cond.wait(0.5)
                batch = [self._items.popleft() for _ in range(min(len(self._items), self.max_batch))]
                self._free -= 1
                self._progress = now
            self._dispatch(batch)

    def _dispatch(self, batch: list[Work]) -> None:
        now = time.monotonic()
        live = []
        for w in batch:
            if w.request.deadline is not None and now > w.request.deadline:
                self.s.answer(w, RequestError(DEADLINE_EXCEEDED, f"deadline of {w.request.deadline_ms:g} ms passed in the queue", w.request.id))
            else:
                live.append(w)
        if not live:
            self._release()
            return
        started = time.monotonic()
        try:
            future = self.rt.submit([w.sample for w in live])
        except Exception as exc:
            self._release()
            log.exception("model %s: submitting a batch failed", self.rt.name)
            for w in live:
                self.s.answer(w, RequestError(INTERNAL, f"inference failed: {exc}", w.request.id))
            return
        future.add_done_callback(lambda f: self._complete(f, live, started))

    def _complete(self, future, live: list[Work], started: float) -> None:
        self._release()
        done = time.monotonic()
        try:
            outputs = future.result()[self.rt.output_name]
        except Exception as exc:
            log.error("model %s: batch of %d failed: %s", self.rt.name, len(live), exc)
            for w in live:
                self.s.answer(w, RequestError(INTERNAL, f"inference failed: {exc}", w.request.id))
            return
        if self.s.on_batch is not None:
            self.s.on_batch(len(live))
        for i, w in enumerate(live):
            w.timings["batch_wait"] = (started - w.staged) * 1e3
            w.timings["infer"] = (done - started) * 1e3
            w.timings["batch"] = len(live)
            if w.request.deadline is not None and done > w.request.deadline:
                self.s.answer(w, RequestError(DEADLINE_EXCEEDED, f"answer ready after the {w.request.deadline_ms:g} ms deadline", w.request.id))
            else:
                self.s.answer(w, outputs[i:i + 1])
