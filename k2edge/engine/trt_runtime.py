"""Segment engines on CUDA streams: the DMA prefetch ring and the GPU/DLA pipeline.

Every request is enqueued, without waiting, in one pass (TensorRT 10: ``set_tensor_address`` then
``execute_async_v3(stream.handle)``; pycuda: ``memcpy_htod_async``, ``Event.record``,
``Stream.wait_for_event``):

1. its inputs are copied into a page-locked host staging slot (one of ``depth``, the prefetch ring);
   a slot is rewritten only after the event recorded behind its previous copy has completed;
2. the host-to-device copy goes on the **copy stream** and records that event; the first segment's
   stream waits on it, so request n+1's copy runs while request n computes;
3. each segment runs on its device's stream (``gpu``, ``dla0``, ``dla1``), waiting on the event of
   the segment before it, so consecutive requests pipeline across devices;
4. outputs come back on a separate device-to-host stream; a completion thread waits on the
   request's last event, hands the outputs to its future and frees the request's device buffers.

Events are made with ``DISABLE_TIMING`` (they order work, nothing times them), and those a host
thread waits on also with ``BLOCKING_SYNC``, so that the waiting thread sleeps instead of spinning a
core (pycuda ``event_flags``; CUDA ``cuEventCreate``). pycuda's context stack is per thread: every
thread that makes a CUDA call pushes the primary context first (``trt_cuda.pushed``).

Without ``dma_prefetch`` the copy runs on the first segment's own stream (no overlap). With
``zero_copy`` (Jetson's unified memory) inputs are mapped page-locked buffers the engine reads in
place: there is no copy, and a staging slot is freed by the event of the last segment that reads it.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ..dla.planner import Routing
from ..errors import InferenceError
from .pipeline import WeightedChooser
from .trt_cuda import pushed


@dataclass(frozen=True)
class BoundTensor:
    """A tensor some engine binds: its shape, host dtype and device buffer size (format padding included)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


@dataclass
class LoadedSegment:
    """A deserialised segment engine and its execution context; with ``by_batch``, the engine and context that run each
    batch size (batch size -> ``(engine, context, optimization profile index)``: a GPU segment's one engine has a
    context per profile, a DLA segment an engine per batch size), and ``engine``/``context`` are the largest's."""

    index: int
    device: str
    engine: object
    context: object
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    by_batch: dict[int, tuple[object, object, int]] = field(default_factory=dict)


class StreamPipeline:
    """Enqueue requests across copy and device streams; see the module docstring.

    Args:
        cuda: the ``pycuda.driver`` module.
        context: the retained primary CUDA context (shared with TensorRT's runtime API).
        segments: loaded segments, indexed by plan segment index.
        routing: the plan's routes, request shares and the last step of each route that reads a model input.
        tensors: every tensor any engine binds.
        model_inputs / model_outputs: the host-facing tensors.
        depth: page-locked host staging slots (``prefetch_depth``).
        slots: requests in flight (device buffer sets).
        prefetch: copy inputs on their own stream (DMA prefetch) rather than the first segment's.
        zero_copy: mapped page-locked inputs, no host-to-device copy.
    """

    def __init__(self, cuda, context, segments: list[LoadedSegment], routing: Routing,
                 tensors: dict[str, BoundTensor], model_inputs: tuple[str, ...],
                 model_outputs: tuple[str, ...], depth: int, slots: int, prefetch: bool = True, zero_copy: bool = False):
        self._cuda = cuda
        self._ctx = context
        self._segments = {s.index: s for s in segments}
        self._routing = routing
        self._chooser = WeightedChooser(routing.shares) if routing.shares else None
        self._tensors = tensors
        self._inputs = model_inputs
        self._outputs = model_outputs
        self.depth = depth
        self.slots = slots
        self.prefetch = prefetch
        self.zero_copy = zero_copy
        self._lock = threading.Lock()
        self._free: queue.Queue[int] = queue.Queue()
        self._pending: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._next_host = 0

    def current(self):
        """Make the CUDA context current in this thread (pycuda calls need it; contexts are per thread)."""
        return pushed(self._cuda, self._ctx)

    # lifecycle -------------------------------------------------------------------------------
    def start(self) -> "StreamPipeline":
        cuda = self._cuda
        with self.current():
            self._copy_in = cuda.Stream() if self.prefetch and not self.zero_copy else None
            self._copy_out = cuda.Stream()
            self._streams = {d: cuda.Stream() for d in dict.fromkeys(s.device for s in self._segments.values())}
            flags = cuda.host_alloc_flags.DEVICEMAP if self.zero_copy else 0
            self._host_in = [{n: cuda.pagelocked_empty(self._tensors[n].shape, self._tensors[n].dtype, mem_flags=flags)
                              for n in self._inputs} for _ in range(self.depth)]
            # host threads wait on these two kinds of event: sleep, don't spin
            waited = cuda.event_flags.DISABLE_TIMING | cuda.event_flags.BLOCKING_SYNC
            ordering = cuda.event_flags.DISABLE_TIMING
            self._host_free = [cuda.Event(waited) for _ in range(self.depth)]
            on_device = [n for n in self._tensors if not (self.zero_copy and n in self._inputs)]
            self._dev = [{n: cuda.mem_alloc(self._tensors[n].nbytes) for n in on_device} for _ in range(self.slots)]
            self._host_out = [{n: cuda.pagelocked_empty(self._tensors[n].shape, self._tensors[n].dtype) for n in self._outputs}
                              for _ in range(self.slots)]
            self._seg_done = [{i: cuda.Event(ordering) for i in self._segments} for _ in range(self.slots)]
            self._done = [cuda.Event(waited) for _ in range(self.slots)]
            for seg in self._segments.values():
                if not seg.by_batch:
                    for n in seg.inputs:
                        seg.context.set_input_shape(n, self._tensors[n].shape)
                for b, (_, context, profile) in seg.by_batch.items():
                    # each context keeps its profile and shapes: set once, here, on the segment's own stream
                    stream = self._streams[seg.device]
                    if not context.set_optimization_profile_async(profile, stream.handle):
                        raise InferenceError(f"TensorRT refused optimization profile {profile} for segment {seg.index}")
                    stream.synchronize()
                    for n in seg.inputs:
                        context.set_input_shape(n, (b, *self._tensors[n].shape[1:]))
            self._batches = sorted({b for s in self._segments.values() for b in s.by_batch})
            self._slot_rows = [None] * self.slots
        for k in range(self.slots):
            self._free.put(k)
        self._thread = threading.Thread(target=self._complete, name="k2edge-trt-completion", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        with self.current():
            for stream in [self._copy_in, self._copy_out, *self._streams.values()]:
                if stream is not None:
                    stream.synchronize()
            for buffers in self._dev:
                for alloc in buffers.values():
                    alloc.free()
        self._dev, self._host_in, self._host_out = [], [], []

    # requests --------------------------------------------------------------------------------
    def submit(self, feeds: dict[str, np.ndarray], release=None) -> Future:
        """Enqueue one request; the future resolves to the output arrays."""
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        slot = self._free.get()  # bounded in-flight requests: wait for a device buffer set
        try:
            with self._lock, self.current():
                self._enqueue(slot, feeds, release)
                self._pending.put((slot, fut))
        except BaseException as exc:
            with self.current():
                self._synchronize_all()  # nothing enqueued for this slot may still be running when it is reused
            self._free.put(slot)
            fut.set_exception(exc if isinstance(exc, InferenceError) else InferenceError(f"enqueue failed: {exc}"))
        return fut

    def _enqueue(self, slot: int, feeds, release) -> None:
        cuda = self._cuda
        h = self._next_host
        self._next_host = (h + 1) % self.depth
        # A staging slot is rewritten only once the copy (or zero-copy read) of its previous request is done.
        self._host_free[h].synchronize()
        host = self._host_in[h]
        rows = None  # a static engine: every input is its whole buffer
        if self._batches:
            rows = len(feeds[self._inputs[0]])
            if rows not in self._batches:
                raise InferenceError(f"batch of {rows}: the engines take batches of {', '.join(map(str, self._batches))}")
        self._slot_rows[slot] = rows
        for n in self._inputs:
            host[n][:rows] = feeds[n]
        if release is not None:
            release()  # the caller's buffer has been copied into page-locked memory
        r = self._chooser.pick() if self._chooser else 0
        route, input_step = self._routing.routes[r], self._routing.input_steps[r]
        dev = self._dev[slot]
        addr = {n: int(a) for n, a in dev.items()}
        ready = None
        if self.zero_copy:
            for n in self._inputs:
                addr[n] = host[n].base.get_device_pointer()
        else:
            copy = self._copy_in or self._streams[self._segments[route[0]].device]
            for n in self._inputs:
                cuda.memcpy_htod_async(dev[n], host[n][:rows], copy)
            ready = self._host_free[h].record(copy)
        for step, i in enumerate(route):
            seg = self._segments[i]
            stream = self._streams[seg.device]
            if ready is not None:
                stream.wait_for_event(ready)
            context = seg.by_batch[rows][1] if rows is not None else seg.context
            for n in (*seg.inputs, *seg.outputs):
                context.set_tensor_address(n, addr[n])
            if not context.execute_async_v3(stream.handle):
                raise InferenceError(f"TensorRT could not enqueue segment {i} on {seg.device}")
            ready = self._seg_done[slot][i].record(stream)
            if self.zero_copy and step == input_step:
                self._host_free[h].record(stream)
        self._copy_out.wait_for_event(ready)
        for n in self._outputs:
            cuda.memcpy_dtoh_async(self._host_out[slot][n][:rows], dev[n], self._copy_out)
        self._done[slot].record(self._copy_out)

    def _complete(self) -> None:
        with self.current():
            while True:
                item = self._pending.get()
                if item is None:
                    return
                slot, fut = item
                try:
                    self._done[slot].synchronize()
                    rows = self._slot_rows[slot]
                    result = {n: np.array(self._host_out[slot][n][:rows], copy=True) for n in self._outputs}
                except Exception as exc:  # pycuda raises LaunchError/LogicError/RuntimeError for device faults
                    self._free.put(slot)
                    fut.set_exception(InferenceError(f"TensorRT request failed on the device: {exc}"))
                    continue
                self._free.put(slot)
                fut.set_result(result)

    def _synchronize_all(self) -> None:
        for stream in [self._copy_in, self._copy_out, *self._streams.values()]:
            if stream is not None:
                stream.synchronize()
