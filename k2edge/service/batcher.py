"""One model's batcher: the thread that forms batches from its clients' items and runs them on its engines.

The batcher knows nothing of what its items are. It is given its clients in priority order (the
daemon gives MQTT requests first, because they have deadlines, then stream frames) and asks each,
through :class:`BatchClient`, for what it has waiting; the items of one batch are staged, inferred
together and finished by the client they came from, each client with its own rows of the outputs.
How a client picks its items (oldest request first; the newest frame of each stream, at most one
frame of a stream in flight) is the client's own policy.

A batch goes as soon as the engine has room, with everything waiting by then (up to the engines'
largest batch size): an idle engine never makes a lone item wait, a busy one lets items pile up into
the next batch. A client whose items may wait for companions (:attr:`BatchClient.holds`) lets
``timeout`` > 0 hold a batch up to that long after its oldest item arrived; an item of a client that
does not hold never waits. Room: one batch when the engine has one lane (run inline); with several
lanes, one per lane plus one, so the lanes are fed while the next batch is staged.

Engines change only at rest (no batch in flight): :meth:`Batcher.swap` (a deploy, a rollback) and
:meth:`Batcher.follow_thermal` (the thermal governor's profile switch). Whatever engines it is given,
the batcher runs them in the profile the thermal state asks for.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future

from .. import tracing
from ..deadline import clock
from .runtime import ModelRuntime

log = logging.getLogger(__name__)


class BatchClient:
    """Where a batcher's items come from and go to: a subclass per kind of item.

    Everything but :meth:`stage`, :meth:`finish` and :meth:`fail` is called under the batcher's lock
    (``cond``, the condition a client notifies when it has something new: :meth:`Batcher.wake`).
    """

    holds = False  # True: its items may wait up to the batcher's timeout for companions
    drains = False  # True: what waits when the batcher stops is still run (False: it is left untaken)

    def ready(self) -> bool:
        """Something waits to be taken."""
        raise NotImplementedError

    def oldest(self) -> float:
        """When the oldest waiting item arrived (``clock()``); asked only of a client that holds."""
        raise NotImplementedError

    def full(self, max_batch: int) -> bool:
        """At least ``max_batch`` items wait (a holding batch goes at once)."""
        return False

    def take(self, room: int) -> list:
        """Up to ``room`` items, now in flight."""
        raise NotImplementedError

    def stage(self, rt: ModelRuntime, items: list) -> list:
        """Prepare the taken ``items`` for ``rt`` (each gets its ``sample``); the ones to infer. Items left
        out are the client's to conclude (answered, released) before it returns."""
        raise NotImplementedError

    def finish(self, rt: ModelRuntime, items: list, rows, started: float) -> None:
        """The staged ``items`` ran: ``rows`` are their outputs (name -> array, one row per item, in
        order), or the exception the batch raised. ``started``: when staging ended."""
        raise NotImplementedError

    def fail(self, items: list, exc: Exception) -> None:
        """Running the batch raised ``exc``: conclude whatever of ``items`` is not concluded yet."""
        raise NotImplementedError


QUICK_S = 0.005  # a model that answers a lone request this fast is "quick"
# a model this quick at batch 1 may run its batches on the batcher's thread: a hand-off to a worker costs it more than
# a second worker gains (digits, 0.41 ms here) -- unless staging the batch took long enough for the workers to pay by
# overlapping it with the previous batch's inference (OVERLAP_S)
INLINE_S = 0.0007
# a batch whose staging (decoding its images) took this long goes to the workers even on a quick model: the next batch
# is staged while it runs. The demo detector (JPEG requests, 0.55 ms of decoding each) on a day its batch 1 measured
# under INLINE_S: `bench/bench_peer.py --models detector --rounds 3 --requests 1000` at 16 in flight, 650 requests/s
# all inline (1.22x the peer), the batcher's thread busy for 83 % of the daemon's samples; see docs/performance.md for
# the figures with this rule. Digits (tensors, 0.2 ms to stage a batch of 8) stays inline.
OVERLAP_S = 0.0005


def runs_inline(runtime: ModelRuntime) -> bool:
    """Whether the thread that forms a batch runs it when staging it was quick (:data:`OVERLAP_S`): on an engine with
    one lane, and on a model quicker than :data:`INLINE_S` at batch 1 whose workers all run one device (the auto CPU
    layout), where a hand-off to a worker costs more than a second worker gains (digits, ``bench/bench_peer.py
    --tracing --baseline-src`` with one lane against two workers: 1.24x the throughput at 16 in flight, 0.96 against
    1.20 CPU ms a request). A plan over several devices keeps its lanes: they overlap a batch's segments."""
    lanes = runtime.engines[1].lanes()
    return len(lanes) == 1 or (len({lane.device for lane in lanes}) == 1 and runtime.batch1_s < INLINE_S)


def slots_for(runtime: ModelRuntime) -> int:
    """Batches a batcher keeps in flight on ``runtime``: one on an engine with one lane, else one per lane plus
    one (the lanes are fed while the next batch is staged; a batch run inline holds one, and frees it when done)."""
    lanes = len(runtime.lanes())
    return 1 if lanes == 1 else lanes + 1


class Slot:
    """The room one batch takes in its batcher's engine; freed once, however often ``free`` is called."""

    __slots__ = ("batcher", "freed")

    def __init__(self, batcher: "Batcher") -> None:
        self.batcher = batcher
        self.freed = False

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self.batcher.free_slot()


class Batcher:
    """One model's batches (see the module docstring).

    Args:
        name: the model.
        runtime: its engines (run in the profile ``thermal`` asks for).
        thermal: the thermal sampler (``state.prefer_dla``: the DLA-heavier warm profile).
        clients: in priority order: a batch takes what the first has waiting, then the next.
        cond: the condition the clients notify when they have something new.
        timeout: how long a holding client's batch may wait for companions (seconds; 0: never).
        on_batch: told ``(model, size)`` once per batch run on the engines, every client's items
            counted (requests and stream frames alike): the batch-size figures.
    """

    STUCK_AFTER_S = 30.0  # a batch in flight this long means a wedged lane: stop the heartbeat
    QUICK_S = QUICK_S  # a lone item is run by its caller's thread only on a model that answers it this fast

    def __init__(self, name: str, runtime: ModelRuntime, thermal, clients: list[BatchClient],
                 cond: threading.Condition, timeout: float, on_batch=None) -> None:
        self.name = name
        self.on_batch = on_batch
        self.thermal = thermal
        self.clients = list(clients)
        self.timeout = timeout
        self._cond = cond
        self._running = 0  # batches whose run() has not returned (an inline batch's items are concluded by then)
        self._next: ModelRuntime | None = None  # engines to take at the next rest
        self._progress = time.monotonic()
        self._heartbeat = time.monotonic()
        self._stopping = False
        self._take(self._profiled(runtime))
        self.thread = threading.Thread(target=self._loop, name=f"k2edge-batch-{name}", daemon=True)

    # lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Run what draining clients still have waiting, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.thread.join(timeout=10)

    def alive(self, max_age: float) -> bool:
        """The thread lives and has looped within ``max_age`` seconds (the watchdog)."""
        return self.thread.is_alive() and time.monotonic() - self._heartbeat <= max_age

    def wake(self) -> None:
        """A client has something new (any thread)."""
        with self._cond:
            self._cond.notify()

    # engines --------------------------------------------------------------------------------------
    def _profiled(self, runtime: ModelRuntime) -> ModelRuntime:
        return runtime.with_profile(self.thermal.state.prefer_dla)

    def _take(self, runtime: ModelRuntime) -> None:
        """Engines for every later batch (under the lock, at rest, or before the thread starts)."""
        self.runtime = runtime
        self.inline = runs_inline(runtime)
        self.quick = runtime.batch1_s < self.QUICK_S
        self.max_batch = max(runtime.engines)
        self.slots = self._free = slots_for(runtime)

    def next_runtime(self) -> ModelRuntime:
        """The engines it runs, or will run once a pending change is taken."""
        with self._cond:
            return self._next or self.runtime

    def _at_rest(self) -> bool:
        return self._free == self.slots and not self._running

    def follow_thermal(self) -> ModelRuntime:
        """The thermal state changed: run the same engines in the profile it asks for, from the next rest
        (without waiting: the sampler's thread calls this). Returns the runtime it will run."""
        with self._cond:
            target = self._profiled(self._next or self.runtime)
            self._next = None if target is self.runtime else target
            if self._next is not None:
                self._cond.notify_all()
            return target

    def swap(self, runtime: ModelRuntime, timeout: float) -> ModelRuntime | None:
        """Make ``runtime`` (in the profile the thermal state asks for) the engines, between two batches:
        every item of the old engines is concluded before the first of the new is taken.

        Args:
            runtime: the new engines (a deploy's version, or the one a failed deploy replaced).
            timeout: how long to wait for the batcher to come to rest.

        Returns:
            The runtime replaced (idle: no batch of it is in flight), or None when the batcher did not
            come to rest within ``timeout``, or another swap superseded this one (nothing changed).
        """
        with self._cond:
            old, self._next = self.runtime, self._profiled(runtime)
            self._cond.notify_all()
            end = time.monotonic() + timeout
            # a thermal switch meanwhile replaces the pending engines by their other profile: the same version
            while not self.runtime.shares_engines(runtime):
                if self._next is None or not self._next.shares_engines(runtime):
                    return None  # superseded by another swap
                if self._at_rest():  # take it here: the thread may be waiting for items, not for rest
                    self._apply()
                    continue
                left = end - time.monotonic()
                if left <= 0:
                    self._next = None  # withdrawn: nothing changed
                    return None
                self._cond.wait(left)
            return old

    def _apply(self) -> None:
        runtime, self._next = self._next, None
        self._take(self._profiled(runtime))  # the thermal state may have changed since the swap was asked
        self._cond.notify_all()

    # forming batches ------------------------------------------------------------------------------
    def free_slot(self) -> None:
        """A batch left the engine: room for the next."""
        with self._cond:
            self._free += 1
            self._progress = time.monotonic()
            # only what waits for the room is woken (an item, a swap, the stop): waking the thread for nothing
            # after each lone request its caller ran costs that request's answer the GIL
            if self._next is not None or self._stopping or any(c.ready() for c in self.clients):
                self._cond.notify_all()

    def _holding(self, now: float) -> float | None:
        """Seconds the batch may still wait for companions, or None when it goes now (under the lock)."""
        if self.timeout <= 0 or self._stopping:
            return None
        hold = None
        for c in self.clients:
            if not c.ready():
                continue
            if not c.holds or c.full(self.max_batch):
                return None  # an item that never waits: the newest would replace it
            left = c.oldest() + self.timeout - now
            if left <= 0:
                return None
            hold = left if hold is None else min(hold, left)
        return hold

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._free == self.slots or now - self._progress < self.STUCK_AFTER_S:
                        self._heartbeat = now
                    if self._next is not None:
                        if self._at_rest():
                            self._apply()
                            continue
                        self._cond.wait(0.5)
                        continue
                    ready = [c for c in self.clients if (c.drains or not self._stopping) and c.ready()]
                    if ready and self._free > 0:
                        hold = self._holding(clock())
                        if hold is None:
                            break
                        self._cond.wait(min(hold, 0.5))
                        continue
                    if self._stopping and not ready:
                        return
                    self._cond.wait(0.5)
                groups, room = [], self.max_batch
                for c in self.clients:  # in priority order: requests have deadlines
                    if room > 0 and (c.drains or not self._stopping) and c.ready():
                        items = c.take(room)
                        if items:
                            groups.append((c, items))
                            room -= len(items)
                if not groups:
                    continue  # what was ready went (a stream stopped) between the check and the take
                self._free -= 1
                self._running += 1
                self._progress = now
            self.run(groups)

    def take_idle(self) -> bool:
        """Take the engine for one item when nothing waits or runs and the model is quick (called by a
        client's thread, which then runs the item itself with ``run(groups, inline=True)``: no hand-off, even to a
        lane's worker, since every worker is idle)."""
        if not self.quick:
            return False
        with self._cond:
            if (any(c.ready() for c in self.clients) or not self._at_rest() or self._stopping
                    or self._next is not None):
                return False
            self._free -= 1
            self._running += 1
            self._progress = time.monotonic()
            return True

    # running a batch ------------------------------------------------------------------------------
    def runs_here(self, staging_s: float) -> bool:
        """Whether a batch whose staging took ``staging_s`` runs on this thread rather than on the lanes' workers: on
        a quick model (:func:`runs_inline`) unless its staging took :data:`OVERLAP_S` or more and there are workers to
        give it to, so that the next batch is staged while this one runs."""
        return self.inline and (self.slots == 1 or staging_s < OVERLAP_S)

    def run(self, groups: list[tuple[BatchClient, list]], inline: bool = False) -> None:
        """Run a batch whose room was taken, in the calling thread; never raises, never leaves an item
        unconcluded. ``groups``: (client, its items), in the order their rows are in the batch. ``inline``: infer in
        this thread even where the engine has lanes (a lone item taken with :meth:`take_idle`)."""
        slot = Slot(self)
        try:
            self._run(groups, slot, inline)
        except Exception as exc:  # one bad batch never stops the batcher
            self._fail(groups, exc)
            slot.free()
        finally:
            with self._cond:
                self._running -= 1
                if self._next is not None:
                    self._cond.notify_all()

    def _run(self, groups: list[tuple[BatchClient, list]], slot: Slot, lone: bool) -> None:
        rt = self.runtime
        begun = clock()
        staged = [(c, c.stage(rt, items)) for c, items in groups]
        staged = [(c, items) for c, items in staged if items]
        if not staged:
            slot.free()
            return
        started = clock()
        inline = lone or self.runs_here(started - begun)
        items = [it for _, items in staged for it in items]
        bt = tracing.tracer().batch(rt.name, items, started) if tracing.tracer().on else None
        if bt is None:
            self._infer(rt, staged, [it.sample for it in items], slot, inline, started, None)
        else:
            with bt.recording():  # one span per batch, one per segment it ran
                self._infer(rt, staged, [it.sample for it in items], slot, inline, started, bt)

    def _infer(self, rt: ModelRuntime, staged: list, samples: list, slot: Slot, inline: bool, started: float, bt) -> None:
        if inline:
            try:
                outputs = rt.infer(samples)
            except Exception as exc:
                outputs = exc
            slot.free()
            self._finish(rt, staged, outputs, started, bt)
            return
        try:
            future = rt.submit(samples)
        except Exception as exc:
            slot.free()
            self._finish(rt, staged, exc, started, bt)
            return
        future.add_done_callback(functools.partial(self._lanes_done, rt, staged, started, slot, bt))

    def _lanes_done(self, rt: ModelRuntime, staged: list, started: float, slot: Slot, bt, f: Future) -> None:
        """A batch's lanes finished (on the lane that ran its last segment)."""
        try:
            outputs = f.result()
        except Exception as exc:
            outputs = exc
        try:
            self._finish(rt, staged, outputs, started, bt)
        except Exception as exc:  # nothing else would conclude them: this runs as a future's callback
            self._fail(staged, exc)
        finally:  # after the items are concluded: every slot free means no batch left to conclude (a swap waits for that)
            slot.free()

    def _finish(self, rt: ModelRuntime, staged: list, outputs, started: float, bt=None) -> None:
        """Each client finishes its items with its own rows (in batch order); one client's failure leaves
        the others' rows to them."""
        if bt is not None:
            bt.end(rt, outputs if isinstance(outputs, Exception) else None)
        if self.on_batch is not None and not isinstance(outputs, Exception):
            self.on_batch(rt.name, sum(len(items) for _, items in staged))
        first, failure = 0, None
        for c, items in staged:
            rows = outputs if isinstance(outputs, Exception) else {k: v[first:first + len(items)] for k, v in outputs.items()}
            first += len(items)
            try:
                c.finish(rt, items, rows, started)
            except Exception as exc:
                failure = failure or exc
                c.fail(items, exc)
        if failure is not None:
            log.error("model %s: finishing a batch failed", rt.name, exc_info=failure)

    def _fail(self, groups: list, exc: Exception) -> None:
        log.error("model %s: a batch of %d failed", self.name, sum(len(items) for _, items in groups), exc_info=exc)
        for c, items in groups:
            try:
                c.fail(items, exc)
            except Exception:
                log.exception("model %s: concluding a failed batch's items failed", self.name)
