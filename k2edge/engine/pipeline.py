"""Lanes: one worker thread per device, handing each request from segment to segment.

Consecutive requests overlap across lanes: while the ``dla0`` lane runs segment 1 of request n,
the ``gpu`` lane can run segment 0 of request n+1. Model-wise plans instead send each request to
one whole-model lane, chosen by smooth weighted round-robin over the plan's request shares.

A device may have several workers (``workers``): threads taking jobs from one inbox and running the
same sessions concurrently, so one engine's weights serve several batches at once.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..dla.planner import Routing
from ..tracing.tracer import segments as _traced_segments

RunSegment = Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class Job:
    """One request travelling through the lanes."""

    future: Future
    route: tuple[int, ...]  # segment indices in order
    tensors: dict[str, np.ndarray] | None = None
    stage: Callable[[], dict[str, np.ndarray]] | None = None
    release: Callable[[], None] | None = None
    release_after: int = 0  # route step after which no segment reads the request's inputs
    step: int = 0
    outputs: tuple[str, ...] = field(default_factory=tuple)
    segments: list | None = None  # a traced batch's record: (segment, lane, start, end) per segment run


class Lane(threading.Thread):
    """A device's worker: takes jobs from its inbox, runs the job's current segment, passes it on."""

    def __init__(self, device: str, run: RunSegment, lane_of_segment: Callable[[int], "Lane"],
                 inbox: queue.SimpleQueue | None = None, worker: int = 0):
        super().__init__(name=f"k2edge-lane-{device}" + (f"-{worker}" if worker else ""), daemon=True)
        self.device = device
        self.inbox: queue.SimpleQueue = inbox if inbox is not None else queue.SimpleQueue()
        self.runs = 0  # segments this lane has run (reports, and the routing by share is checked on it)
        self._run = run
        self._lane_of = lane_of_segment

    def run(self) -> None:
        while True:
            job = self.inbox.get()
            if job is None:
                return
            self._step(job)

    def _step(self, job: Job) -> None:
        if job.future.cancelled():
            _release(job)
            return
        try:
            if job.tensors is None:
                job.tensors = job.stage()  # staging inline, on the engine's own lane
            seg = job.route[job.step]
            t0 = time.monotonic() if job.segments is not None else 0.0
            produced = self._run(seg, job.tensors)
            if job.segments is not None:
                job.segments.append((seg, self.name, t0, time.monotonic()))
            self.runs += 1
            if job.step >= job.release_after:
                _release(job)
            job.tensors.update(produced)
        except BaseException as exc:  # report any failure on the request's future, keep the lane alive
            _release(job)
            job.future.set_exception(exc)
            return
        job.step += 1
        if job.step == len(job.route):
            job.future.set_result({name: job.tensors[name] for name in job.outputs})
        else:
            self._lane_of(job.route[job.step]).inbox.put(job)


def _release(job: Job) -> None:
    if job.release is not None:
        release, job.release = job.release, None
        release()


class WeightedChooser:
    """Smooth weighted round-robin (as nginx): over N picks, lane i gets round(N * share_i)."""

    def __init__(self, shares: Sequence[float]):
        self._weights = list(shares)
        self._current = [0.0] * len(shares)
        self._lock = threading.Lock()

    def pick(self) -> int:
        with self._lock:
            total = sum(self._weights)
            for i, w in enumerate(self._weights):
                self._current[i] += w
            best = max(range(len(self._current)), key=lambda i: self._current[i])
            self._current[best] -= total
            return best


class LaneSet:
    """The lanes of one plan and the routing of requests through them (the plan's :class:`Routing`)."""

    def __init__(self, routing: Routing, run: RunSegment, outputs: tuple[str, ...], workers: int = 1):
        self._lanes = {d: Lane(d, run, self._lane_for_segment) for d in dict.fromkeys(routing.segment_devices)}
        # further workers of each device share its first lane's inbox: jobs go to whichever is free
        self._workers = {d: [lane] + [Lane(d, run, self._lane_for_segment, lane.inbox, k) for k in range(1, workers)]
                         for d, lane in self._lanes.items()}
        self._routing = routing
        self._chooser = WeightedChooser(routing.shares) if routing.shares else None
        self._outputs = outputs

    def _lane_for_segment(self, seg: int) -> Lane:
        return self._lanes[self._routing.segment_devices[seg]]

    def runs(self) -> dict[str, list[int]]:
        """Segments run so far per device, per worker."""
        return {d: [w.runs for w in workers] for d, workers in self._workers.items()}

    def _pick(self) -> int:
        return self._chooser.pick() if self._chooser else 0

    def route(self) -> tuple[int, ...]:
        """The next request's route (model-wise: by request share)."""
        return self._routing.routes[self._pick()]

    def _all(self) -> list[Lane]:
        return [w for workers in self._workers.values() for w in workers]

    def start(self) -> None:
        for lane in self._all():
            lane.start()

    def stop(self) -> None:
        for lane in self._all():
            lane.inbox.put(None)  # one stop per worker: workers of a device share the inbox
        for lane in self._all():
            lane.join(timeout=30)

    def submit(self, feeds, stage, release) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        r = self._pick()
        job = Job(fut, self._routing.routes[r], tensors=dict(feeds) if feeds is not None else None, stage=stage,
                  release=release, release_after=self._routing.input_steps[r], outputs=self._outputs,
                  segments=_traced_segments())
        self._lane_for_segment(job.route[0]).inbox.put(job)
        return fut


@dataclass(frozen=True)
class LaneLayout:
    """How a plan's lanes use the CPU: workers per device (concurrent runs of one set of sessions) and each
    session's intra-op threads; ``why`` says how it was chosen, for reports."""

    workers: int
    threads: int
    cores: int
    why: str


def lane_layout(cores: int, devices: int, threads_per_lane: int | None, prefetch: bool) -> LaneLayout:
    """The lanes for ``cores`` CPU cores (the process's affinity) and a plan over ``devices`` devices.

    ``threads_per_lane`` > 0 keeps its meaning: one worker per device with that many intra-op threads. 0 (the
    daemon's ``"auto"``) chooses: a one-device plan gets one single-threaded worker per core (batches run
    concurrently on the one engine), because on a shared CPU a run's own threads cost more CPU per frame than they
    save (the measurement is in docs/performance.md, "Lanes sized to the cores"); a plan that names several
    devices keeps one lane per device, the cores shared between them. None (the :class:`~k2edge.Engine` API's
    default, where one caller's ``infer`` wants the lowest latency) gives each device's one worker its share of
    the cores. A prefetch ring's staging thread takes a core first.
    """
    usable = max(1, cores - (1 if prefetch else 0))
    if threads_per_lane:
        return LaneLayout(1, threads_per_lane, cores, f"threads_per_lane = {threads_per_lane}")
    if threads_per_lane is None:
        threads = max(1, usable // devices)
        return LaneLayout(1, threads, cores, f"one lane per device, {threads} thread(s) each on {cores} core(s)")
    if devices == 1:
        return LaneLayout(usable, 1, cores, f"auto: {usable} single-threaded worker(s) on {cores} core(s)")
    threads = max(1, usable // devices)
    return LaneLayout(1, threads, cores, f"auto: {devices} device lanes of {threads} thread(s) on {cores} core(s)")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; the count of all cores where that is unknown)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
