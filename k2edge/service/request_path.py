"""The request path: one request from the broker to its answer, in the order it happens.

1. **the request's record** (:class:`Work`): what was asked, where the answer goes, its deadline.
2. **admit** (:meth:`RequestPath.on_message`, the MQTT network thread): parse and validate the
   payload, compute the request's key (reply topic, id, attempt), let the answer book recognise a
   redelivery, check the model and the bound, and put the request on its model's line. Nothing
   here decodes an image or runs a model; a request refused here is answered here.
3. **the line** (:class:`Line`, one thread per model): takes the waiting requests, then the newest
   frame of each of its streams (:mod:`k2edge.service.stream_path`), up to the engines' largest batch,
   as soon as the engine has room (``batch_timeout_ms`` may hold a batch for companions). A lone
   request for an idle, quick, one-lane engine, with nothing else waiting to be read, is run by the
   network thread itself — one thread, no hand-off. Engines change only between batches
   (:meth:`RequestPath.swap`: a deploy, a rollback, a thermal profile switch).
4. **run a batch** (:meth:`RequestPath.run_batch`): drop what passed its deadline
   (``deadline_exceeded``), decode each input into a sample, ask the escalation policy early only
   in the hot and critical thermal states, then infer — inline when the engine has one lane, else
   on the lanes (finishing on the lane that ran the batch).
5. **finish** (:meth:`RequestPath.finish_batch`): the policy once per request on its local result;
   :meth:`Escalation.carry_out <k2edge.service.escalation.Escalation.carry_out>` gives the answer,
   or hands the request to the cloud pool (its answer comes back to :meth:`RequestPath.answer_late`).
6. **answer** (:meth:`RequestPath.answer`, through the
   :class:`~k2edge.service.answer_book.AnswerBook`): every answer — ok, error, busy, cloud, deferred —
   is recorded under its key before it is published, and its request is acknowledged once the
   broker acknowledged the answer (or once its cloud work is in the outbox).

One :class:`~k2edge.deadline.Deadline` travels with a request and is checked when its batch
forms and when its answer is ready: an ``ok`` answer is never sent late.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from ..tasks.result import LocalResult
from ..config.schema import DaemonConfig
from ..deadline import Deadline, clock
from ..errors import InputError, first_line
from . import topics
from .answer_book import Answer, AnswerBook, AnswerKey
from .escalation import Escalation
from .protocol import (BAD_REQUEST, BUSY, DEADLINE_EXCEEDED, INTERNAL, PAYLOAD_TOO_LARGE, UNKNOWN_MODEL, Request,
                       RequestError, encode, error_body, ok_body, parse_request, peek_key)
from .runtime import ModelRuntime
from .metrics import ServiceStats
from .stream_path import StreamPath

log = logging.getLogger(__name__)


# 1. the request's record ------------------------------------------------------------------------
@dataclass(slots=True)
class Work:
    """One admitted request on its way to its answer (a work item of its model's line)."""

    req: Request
    key: AnswerKey | None
    reply_topic: str
    correlation: bytes | None
    content_type: str | None
    received: float
    tokens: list = field(default_factory=list)  # ack tokens of a request without an id (keyed ones: the answer book)
    timings: dict = field(default_factory=dict)
    sample: np.ndarray | None = None
    geometry: object = None  # where an image landed in the sample (detection boxes are mapped back through it)
    result: dict = field(default_factory=dict)  # the task's answer fragment: top_k, detections or outputs
    answered: bool = False  # answered, or handed to the cloud pool
    runtime: ModelRuntime | None = None  # the engines its batch ran on (a deploy may swap the line's since)

    @property
    def deadline(self) -> Deadline:
        return self.req.deadline


class Broker(Protocol):
    """What the request path needs of the broker connection (:class:`~k2edge.service.transport.MqttTransport`)."""

    def wake(self) -> None:
        """Room to read again after backpressure: wake the network thread."""

    def input_pending(self) -> bool:
        """True while more requests wait to be read."""


class RequestPath:
    """Admission, per-model lines, and answers; see the module docstring for the order of events.

    It is the request connection's handler (``on_message``, ``on_connected``, ``saturated``).

    Args:
        cfg: daemon config.
        models: served models by name (kept current: a swap replaces the entry).
        answers: the answer book (records, publishes, acknowledges).
        escalation: thermal state, policy and cloud (it answers cloud work through this path).
        stats: counts every answer (status, telemetry, and the Prometheus metrics when configured).
        broker: wakes the network thread; says whether more requests wait to be read (then a
            request never runs on the network thread: it goes to its line, where it can batch).
    """

    def __init__(self, cfg: DaemonConfig, models: dict[str, ModelRuntime], answers: AnswerBook, escalation: Escalation,
                 stats: ServiceStats, broker: Broker, streams: "StreamPath | None" = None) -> None:
        self.cfg = cfg
        self.models = models
        self.answers = answers
        self.escalation = escalation
        self.stats = stats
        self.broker = broker
        s = cfg.service
        self.hold = s.queue_size  # above this many waiting, the network thread stops reading
        self.hard_limit = 2 * s.queue_size + 64  # the broker overshot: beyond this, busy
        self.draining = threading.Event()
        self._open = 0  # admitted, not yet answered or handed to the cloud
        self._idle = threading.Condition()
        self._decoders = ThreadPoolExecutor(s.staging_threads, thread_name_prefix="k2edge-decode") \
            if s.staging_threads > 1 else None
        self.streams = streams
        self.lines = {name: Line(name, rt, self, s.batch_timeout_ms / 1e3, streams.feeds(name) if streams else ())
                      for name, rt in models.items()}
        escalation.attach(self, answers)

    # lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        for line in self.lines.values():
            line.start()

    def stop(self) -> None:
        for line in self.lines.values():
            line.stop()
        if self._decoders is not None:
            self._decoders.shutdown(wait=False)

    def alive(self, max_age: float) -> bool:
        """True when every line lives and has looped within ``max_age`` seconds (the watchdog)."""
        return all(line.alive(max_age) for line in self.lines.values())

    def swap(self, name: str, runtime: ModelRuntime, timeout: float | None) -> ModelRuntime | None:
        """Make ``runtime`` the engines of model ``name``'s line, between two batches: every answer
        of the old engines is published before the first of the new.

        Args:
            name: the model.
            runtime: its new engines (a deploy's version; the same version's other profile).
            timeout: how long to wait for the line to come to rest (a deploy); None to return at
                once and let the line take it when it is at rest (a thermal switch: the governor's
                thread never waits; a later swap supersedes one not yet taken).

        Returns:
            The runtime replaced (idle: no batch of it is in flight), or None when the line did not
            come to rest within ``timeout`` (nothing changed) or when not waiting.
        """
        return self.lines[name].swap(runtime, timeout)

    def swapped(self, name: str, runtime: ModelRuntime) -> None:
        """A line took ``runtime`` (its thread, or the swapping one)."""
        self.models[name] = runtime

    def running(self, name: str) -> ModelRuntime | None:
        """The engines model ``name`` runs, or will run once a pending swap is taken."""
        line = self.lines.get(name)
        return line.next_runtime() if line is not None else None

    def waiting(self) -> int:
        """Requests admitted and not yet in a batch."""
        return sum(len(line.items) for line in self.lines.values())

    def saturated(self) -> bool:
        return self.waiting() >= self.hold

    def on_connected(self) -> None:
        """Nothing to do per connection: answers queued while disconnected go out with the session."""

    def wait_idle(self, timeout: float) -> bool:
        """Block until every admitted request was answered or handed to the cloud (drain)."""
        end = time.monotonic() + timeout
        with self._idle:
            while self._open:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _close(self, n: int = 1) -> None:
        """``n`` admitted requests need this path no more (answered, or handed to the cloud pool)."""
        with self._idle:
            self._open -= n
            if self._open <= 0:
                self._idle.notify_all()

    # 2. admit (network thread) --------------------------------------------------------------------
    def on_message(self, msg, token) -> None:
        """Admit one MQTT message; must not block (it runs on the network thread)."""
        if self.draining.is_set():
            return  # not acknowledged: the broker keeps it in our session for the next start
        received = clock()
        props = msg.properties
        response_topic = getattr(props, "ResponseTopic", None) or None
        correlation = getattr(props, "CorrelationData", None)
        content_type = getattr(props, "ContentType", None)
        expiry = getattr(props, "MessageExpiryInterval", None)
        user = {str(k): str(v) for k, v in (getattr(props, "UserProperty", None) or [])}
        model = topics.model_of(msg.topic) or ""
        payload = msg.payload
        bad_topic = response_topic is not None and not topics.publishable(response_topic)

        error: RequestError | None = None
        req: Request | None = None
        limit = self.cfg.service.max_payload_bytes
        if len(payload) > limit:
            rid, attempt = peek_key(payload[:65536], user)
            error = RequestError(PAYLOAD_TOO_LARGE, f"payload of {len(payload)} bytes exceeds the limit of {limit}", rid, attempt)
        else:
            try:
                req = parse_request(payload, model, content_type, user, received, expiry, self.cfg.service.default_deadline_ms)
            except RequestError as exc:
                error = exc
        rid, attempt = (req.id, req.attempt) if req is not None else (error.request_id, error.attempt)
        reply = response_topic if response_topic and not bad_topic else \
            (topics.result_topic(self.cfg.prefix, rid) if rid else topics.errors_topic(self.cfg.prefix))
        key = AnswerKey(reply, rid, attempt) if rid is not None else None
        if key is not None and not self.answers.claim(key, token):
            self.stats.count("redelivered")
            return  # answered already (or being answered): acknowledged when that answer is delivered
        work = Work(req or Request(rid, model, attempt), key, reply, correlation, content_type, received,
                    [token] if key is None else [])
        if bad_topic:
            error = RequestError(BAD_REQUEST, f"Response Topic {response_topic[:80]!r} is not a topic one can publish to", rid, attempt)
        elif error is None and model not in self.lines:
            error = RequestError(UNKNOWN_MODEL, f"no model {model[:80]!r} here; served: {sorted(self.lines)}", rid, attempt)
        elif error is None and self.waiting() >= self.hard_limit:
            error = RequestError(BUSY, f"{self.waiting()} requests already wait here", rid, attempt)
        with self._idle:
            self._open += 1
        if error is not None:
            self.answer([(work, self.error(work, error.code, error.message))])
            return
        line = self.lines[model]
        if not self.broker.input_pending() and line.take_idle():
            line.run([work])  # alone, and the engine idle and quick: answered here, no hand-off to wait for
        else:
            line.put(work)

    # 3. the line's hooks --------------------------------------------------------------------------
    def taken(self, n: int) -> None:
        """A line took ``n`` items off its queue: the network thread may read again."""
        waiting = self.waiting()
        if waiting + n >= self.hold > waiting:
            self.broker.wake()

    # 4. run a batch (on its model's line) -----------------------------------------------------------
    def run_batch(self, line: "Line", batch: list[Work], slot: "Slot") -> None:
        """Deadlines, decoding and early routing, then inference (inline or on the lanes).

        ``slot.free()`` gives the engine's room back once the batch has left it (idempotent).
        """
        rt = line.runtime
        now = clock()
        frames = [w for w in batch if not isinstance(w, Work)]  # a stream's frames (the stream path's items)
        if frames:
            batch = [w for w in batch if isinstance(w, Work)]
        done: list[tuple[Work, dict]] = []
        live: list[Work] = []
        timely = []
        for w in batch:
            w.runtime = rt
            w.timings["queue"] = (now - w.received) * 1e3
            if w.deadline.expired(now):  # not decoded: nothing will be done with it
                done.append((w, self.error(w, DEADLINE_EXCEEDED, f"{w.deadline.why} passed before the request could run")))
            else:
                timely.append(w)
        for w, sample in zip(timely, self._decode(rt, timely)):
            if isinstance(sample, RequestError):
                done.append((w, self.error(w, sample.code, sample.message)))
            else:
                w.sample, w.geometry = sample
                # the policy is asked before inference only in the hot and critical states
                d = self.escalation.decide(w.req.model, w.req.prompt, w.req.allow_cloud, w.req.deferrable, None)
                if d is None:
                    live.append(w)
                else:
                    body = self._carry_out(w, d, functools.partial(self._run_one, rt, w))
                    if body is not None:
                        done.append((w, body))
        staged = clock()
        for w in live:
            w.timings["stage"] = (staged - now) * 1e3 / len(batch)
        if done:
            self.answer(done)
        if frames:
            frames = self.streams.stage(rt, frames)
        if not live and not frames:
            slot.free()
            return
        samples = [w.sample for w in live] + [f.sample for f in frames]
        if line.inline:
            try:
                outputs = rt.infer(samples)
            except Exception as exc:
                outputs = exc
            slot.free()
            self._finish(rt, live, frames, outputs, staged)
            return
        try:
            future = rt.submit(samples)
        except Exception as exc:
            slot.free()
            self._finish(rt, live, frames, exc, staged)
            return
        future.add_done_callback(functools.partial(self._lanes_done, rt, live, frames, staged, slot))

    def _lanes_done(self, rt: ModelRuntime, live: list[Work], frames: list, staged: float, slot: "Slot", f: Future) -> None:
        """A batch's lanes finished (on the lane that ran its last segment)."""
        try:
            outputs = f.result()
        except Exception as exc:
            outputs = exc
        try:
            self._finish(rt, live, frames, outputs, staged)
        except Exception as exc:  # nothing else would answer them: this runs as a future's callback
            self._fail(rt.name, live + frames, exc)
        finally:  # after the answers: a line with every slot free has no batch left to answer (a swap waits for that)
            slot.free()

    def _finish(self, rt: ModelRuntime, live: list[Work], frames: list, outputs, started: float) -> None:
        """The requests' answers first (their rows lead the batch), then the frames' (the stream path)."""
        try:
            if live:
                self.finish_batch(rt, live, outputs, started)
        finally:
            if frames:
                rows = outputs if isinstance(outputs, Exception) else {k: v[len(live):] for k, v in outputs.items()}
                self.streams.finish(rt, frames, rows, started)

    def fail_batch(self, line: "Line", batch: list[Work], exc: Exception) -> None:
        """A batch raised: answer what it left unanswered."""
        self._fail(line.name, batch, exc)

    def _fail(self, model: str, batch: list, exc: Exception) -> None:
        """Answer what a failed batch left unanswered; release its frames (once: each knows whether it was)."""
        log.error("model %s: a batch of %d failed", model, len(batch), exc_info=exc)
        for f in batch:
            if not isinstance(f, Work):
                f.stream.release(f, failed=True)
        left = [w for w in batch if isinstance(w, Work) and not w.answered]
        if left:
            self.answer([(w, self.error(w, INTERNAL, f"internal error: {type(exc).__name__}")) for w in left])

    def _decode(self, rt: ModelRuntime, batch: list[Work]) -> list:
        def one(w: Work):
            try:
                return rt.stage(w.req.image, w.req.tensor, self.cfg.service.max_image_pixels)
            except InputError as exc:
                return RequestError(BAD_REQUEST, str(exc))
            except Exception as exc:
                log.exception("decoding request %s failed", w.req.id)
                return RequestError(INTERNAL, f"internal error while decoding: {type(exc).__name__}")

        images = sum(w.req.image is not None for w in batch)
        if self._decoders is not None and images > 1:
            return list(self._decoders.map(one, batch))
        return [one(w) for w in batch]

    def _run_one(self, rt: ModelRuntime, w: Work) -> LocalResult:
        """The local answer computed late (a cloud worker's fallback in the hot state)."""
        result = rt.results(rt.infer([w.sample]), [w.geometry], [w.req.top_k or rt.cfg.top_k])[0]
        if isinstance(result, Exception):
            raise result
        w.result, local = result
        return local

    # 5. finish: the policy on each local result -----------------------------------------------------
    def finish_batch(self, rt: ModelRuntime, live: list[Work], outputs, started: float) -> None:
        """The policy on each local result, then the answers (one record transaction for the batch)."""
        now = clock()
        if isinstance(outputs, Exception):
            log.error("model %s: batch of %d failed: %s", rt.name, len(live), outputs)
            self.answer([(w, self.error(w, INTERNAL, f"inference failed: {first_line(outputs)}")) for w in live])
            return
        self.stats.batch(rt.name, len(live))
        done: list[tuple[Work, dict]] = []
        results = rt.results(outputs, [w.geometry for w in live], [w.req.top_k or rt.cfg.top_k for w in live])
        for w, result in zip(live, results):
            w.timings.update(infer=(now - started) * 1e3, batch=len(live))
            if isinstance(result, Exception):
                done.append((w, self.error(w, INTERNAL, str(result))))
                continue
            w.result, local = result
            d = self.escalation.decide(w.req.model, w.req.prompt, w.req.allow_cloud, w.req.deferrable, local)
            body = self._carry_out(w, d, local)
            if body is not None:
                done.append((w, body))
        if done:
            self.answer(done)

    def _carry_out(self, w: Work, d, local) -> dict | None:
        """The answer body for a decision, or None when the request went to the cloud pool."""
        try:
            return self.escalation.carry_out(w, d, local)
        except Exception as exc:
            log.exception("request %s: carrying out the escalation decision failed", w.req.id)
            return self.error(w, INTERNAL, f"internal error while escalating: {type(exc).__name__}")

    def handed_to_cloud(self, w: Work) -> None:
        """``w``'s cloud work is safe in the outbox: acknowledge the request now; its answer comes later."""
        self.answers.acknowledge_early(w.key, w.tokens)
        w.tokens, w.answered = [], True
        self._close()

    # 6. answer ----------------------------------------------------------------------------------------
    def answer(self, done: list[tuple[Work, dict]]) -> None:
        """Answer admitted requests: never an ``ok`` past its deadline; record, publish, count."""
        self._publish(done)
        self._close(len(done))

    def answer_late(self, w: Work, body: dict, on_delivered: Callable[[], None]) -> None:
        """The answer to a request handed to the cloud pool (a cloud worker's thread)."""
        self._publish([(w, body)], on_delivered)

    def _publish(self, done: list[tuple[Work, dict]], on_delivered: Callable[[], None] | None = None) -> None:
        now = clock()
        answers = []
        limit = self.cfg.service.max_answer_bytes
        for w, body in done:
            w.answered = True
            if body["status"] == "ok" and w.deadline.expired(now):
                body = self.error(w, DEADLINE_EXCEEDED, f"the answer was ready after the {w.deadline.why}")
            payload = encode(body)
            if len(payload) > limit:
                body = self.error(w, PAYLOAD_TOO_LARGE, f"the answer is {len(payload):,} bytes, over max_answer_bytes "
                                  f"({limit:,})")
                payload = encode(body)
            self.stats.answer(w.req.model, body, (now - w.received) * 1e3)
            answers.append(Answer(w.key, w.reply_topic, payload, w.correlation, w.tokens, on_delivered))
        self.answers.answer(answers)

    def template(self, w: Work, **fields) -> dict:
        """``w``'s ``ok`` answer as the edge gives it (the cloud's answers complete it)."""
        return ok_body(w.req, self.cfg.device_id, self._profile(w), w.result, self._latency(w),
                       self.escalation.thermal_name, model_version=self._version(w), **fields)

    def error(self, w: Work, code: str, message: str) -> dict:
        return error_body(code, message, w.req.id, w.req.attempt, w.req.model or None, self.cfg.device_id, self._version(w))

    def _latency(self, w: Work) -> dict:
        latency = {k: round(v, 3) if isinstance(v, float) else v for k, v in w.timings.items()}
        latency["total"] = round((clock() - w.received) * 1e3, 3)
        return latency

    def _profile(self, w: Work) -> str:
        rt = w.runtime or self.models.get(w.req.model)
        return rt.profile_name if rt else None

    def _version(self, w: Work) -> str | None:
        rt = w.runtime or self.models.get(w.req.model)
        return rt.version if rt else None


# the line -----------------------------------------------------------------------------------------
class WorkItem(Protocol):
    """What a line needs of an item: when it arrived (``batch_timeout_ms`` counts from the oldest)."""

    received: float


class FrameFeed(Protocol):
    """A stream, as its model's line sees it (:class:`~k2edge.streams.stream.Stream`)."""

    def ready(self) -> bool:
        """A frame waits and none of this stream is in flight."""

    def take(self):
        """The newest frame as a work item, now in flight; or None."""


class BatchRunner(Protocol):
    """What a line hands its batches to (the request path)."""

    def run_batch(self, line: "Line", batch: list, slot: "Slot") -> None:
        """Run ``batch`` in the calling thread; ``slot.free()`` once it left the engine."""

    def fail_batch(self, line: "Line", batch: list, exc: Exception) -> None:
        """``run_batch`` raised: answer what is left."""

    def taken(self, n: int) -> None:
        """``n`` items left the line's queue."""

    def swapped(self, name: str, runtime: ModelRuntime) -> None:
        """The line took new engines."""


class Slot:
    """The room one batch takes in its line's engine; freed once, however often ``free`` is called."""

    __slots__ = ("line", "freed")

    def __init__(self, line: "Line") -> None:
        self.line = line
        self.freed = False

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self.line.free_slot()


class Line:
    """One model's queue of work items and the thread that forms their batches and runs them.

    A batch goes as soon as the engine has room, with everything waiting by then (up to the
    engines' largest batch size): an idle engine never makes a lone item wait, a busy one lets
    items pile up into the next batch. ``timeout`` > 0 holds a batch up to that long after its
    oldest item arrived, hoping for companions. Room: one batch when the engine has one lane (run
    inline); with several lanes, one per lane plus one, so the lanes are fed while the next batch
    is decoded. New engines are taken only at rest (no batch in flight), by :meth:`swap`.
    """

    STUCK_AFTER_S = 30.0  # a batch in flight this long means a wedged lane: stop the heartbeat
    QUICK_S = 0.005  # a lone request runs on the network thread only on a model that answers it this fast

    def __init__(self, name: str, runtime: ModelRuntime, runner: BatchRunner, timeout: float, feeds=()) -> None:
        self.name = name
        self.runner = runner
        self.timeout = timeout
        self.items: deque = deque()
        self.feeds: list[FrameFeed] = list(feeds)
        self._next_feed = 0  # round robin: which stream's frame a full batch leaves out
        self._cond = threading.Condition()
        self._running = 0  # batches whose run() has not returned (an inline batch's answers are out by then)
        self._next: ModelRuntime | None = None  # engines to take at the next rest
        self._progress = time.monotonic()
        self._heartbeat = time.monotonic()
        self._stopping = False
        self._take(runtime)
        self.thread = threading.Thread(target=self._loop, name=f"k2edge-line-{name}", daemon=True)

    def _take(self, runtime: ModelRuntime) -> None:
        """Engines for every later batch (under the lock, at rest, or before the thread starts)."""
        self.runtime = runtime
        self.inline = runtime.single_lane
        self.quick = runtime.batch1_s < self.QUICK_S
        self.max_batch = max(runtime.engines)
        self.slots = self._free = 1 if self.inline else len(runtime.lanes()) + 1

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.thread.join(timeout=10)

    def put(self, item: WorkItem) -> None:
        with self._cond:
            self.items.append(item)
            self._cond.notify()

    def wake(self) -> None:
        """A feed has a new frame."""
        with self._cond:
            self._cond.notify()

    def _frames_ready(self) -> bool:
        return any(f.ready() for f in self.feeds)

    def _take_frames(self, room: int) -> list:
        """Up to ``room`` frames, one per ready feed, starting after the feed served first last time."""
        n, frames = len(self.feeds), []
        for i in range(n):
            if len(frames) >= room:
                break
            frame = self.feeds[(self._next_feed + i) % n].take()
            if frame is not None:
                frames.append(frame)
        self._next_feed = (self._next_feed + 1) % n if n else 0
        return frames

    def free_slot(self) -> None:
        """A batch left the engine: room for the next."""
        with self._cond:
            self._free += 1
            self._progress = time.monotonic()
            # only what waits for the room is woken (items, a frame, a swap): waking the line's thread for
            # nothing after each lone request the network thread ran costs that request's answer the GIL
            if self.items or self._next is not None or self._frames_ready():
                self._cond.notify_all()

    def alive(self, max_age: float) -> bool:
        return self.thread.is_alive() and time.monotonic() - self._heartbeat <= max_age

    def next_runtime(self) -> ModelRuntime:
        with self._cond:
            return self._next or self.runtime

    def _at_rest(self) -> bool:
        return self._free == self.slots and not self._running

    def swap(self, runtime: ModelRuntime, timeout: float | None) -> ModelRuntime | None:
        """Take ``runtime`` at the next rest, forming no batch meanwhile; see :meth:`RequestPath.swap`."""
        with self._cond:
            if timeout is None:  # a thermal switch: return at once
                if runtime is self.runtime:
                    self._next = None  # back before the switch was taken
                elif runtime is not self._next:
                    self._next = runtime
                    self._cond.notify_all()
                return None
            old, self._next = self.runtime, runtime
            self._cond.notify_all()
            end = time.monotonic() + timeout
            # a thermal switch meanwhile replaces the pending engines by their other profile: the same version
            while not self.runtime.shares_engines(runtime):
                if self._next is None or not self._next.shares_engines(runtime):
                    return None  # superseded by another swap
                if self._at_rest():  # take it here: the line's thread may be waiting for work, not for rest
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
        self._take(runtime)
        self.runner.swapped(self.name, runtime)
        self._cond.notify_all()

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
                    frames = self.feeds and not self._stopping and self._frames_ready()
                    if (self.items or frames) and self._free > 0:
                        if not self.items or frames:
                            break  # a frame never waits for companions: the newest would replace it
                        hold = self.items[0].received + self.timeout - clock()
                        if self.timeout <= 0 or len(self.items) >= self.max_batch or hold <= 0 or self._stopping:
                            break
                        self._cond.wait(min(hold, 0.5))
                        continue
                    if not self.items and self._stopping:
                        return
                    self._cond.wait(0.5)
                batch = [self.items.popleft() for _ in range(min(len(self.items), self.max_batch))]
                requests = len(batch)
                if self.feeds and not self._stopping and len(batch) < self.max_batch:
                    batch += self._take_frames(self.max_batch - len(batch))  # requests first: they have deadlines
                if not batch:
                    continue  # the frame went (a stream stopped) between the check and the take
                self._free -= 1
                self._running += 1
                self._progress = now
            self.runner.taken(requests)
            self.run(batch)

    def take_idle(self) -> bool:
        """Take the engine for one request when nothing waits or runs and the model is quick
        (called by the network thread, which then runs the request itself: no hand-off)."""
        if not (self.inline and self.quick):
            return False
        with self._cond:
            if self.items or self._frames_ready() or not self._at_rest() or self._stopping or self._next is not None:
                return False
            self._free -= 1
            self._running += 1
            self._progress = time.monotonic()
            return True

    def run(self, batch: list) -> None:
        """Run a batch whose room was taken, in the calling thread; never raises, never leaves an
        item unanswered."""
        slot = Slot(self)
        try:
            self.runner.run_batch(self, batch, slot)
        except Exception as exc:  # one bad batch never stops the line
            self.runner.fail_batch(self, batch, exc)
            slot.free()
        finally:
            with self._cond:
                self._running -= 1
                if self._next is not None:
                    self._cond.notify_all()
