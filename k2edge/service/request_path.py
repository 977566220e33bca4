"""The request path: one request from the broker to its answer, in the order it happens.

1. **admit** (the MQTT network thread): parse and validate the payload, compute the request's
   key (reply topic, id, attempt), let the answer book recognise a redelivery, check the model and
   the bound, and put the request on its model's line. Nothing here decodes an image or runs a
   model; a request refused here is answered here.
2. **a model's line** (one thread per model): take everything waiting, up to ``max_batch``, as
   soon as the engine has room (``batch_timeout_ms`` may hold a batch for companions), then for
   that batch, in that thread (a lone request for an idle, quick, one-lane engine, with nothing else
   waiting to be read, is run the same way by the network thread itself — one thread, no hand-off):
   a. drop what passed its deadline (``deadline_exceeded``), decode each input into a sample,
      and ask the escalation policy early only in the hot and critical thermal states;
   b. infer: inline when the engine has one lane, else on the lanes (finishing on the lane that
      ran the batch);
   c. decide (the policy, once per request, on the local result) and answer: locally, or hand the
      request to the cloud pool (its answer comes back to :meth:`RequestPath.cloud_finished`).
3. **answer** (:class:`~k2edge.service.answers.AnswerBook`): every answer — ok, error, busy, cloud,
   deferred — is recorded under its key before it is published, and its request is acknowledged
   once the broker acknowledged the answer (or once its cloud work is in the outbox).

One :class:`~k2edge.deadline.Deadline` travels with a request and is checked when its batch
forms and when its answer is ready: an ``ok`` answer is never sent late.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..cloud_bridge import BridgeRequest, LocalResult, Outcome
from ..cloud_bridge.policy import reason_kind
from ..config.schema import DaemonConfig
from ..deadline import Deadline, clock
from ..errors import InputError, first_line
from . import topics
from .answers import Answer, AnswerBook, AnswerKey
from .escalation import Escalation, degrade
from .protocol import (BAD_REQUEST, BUSY, DEADLINE_EXCEEDED, INTERNAL, PAYLOAD_TOO_LARGE, UNKNOWN_MODEL, Request,
                       RequestError, encode, error_body, ok_body, parse_request, peek_key)
from .runtime import ModelRuntime
from .stats import ServiceStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Work:
    """One admitted request on its way to its answer."""

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
    settled: bool = False  # answered, or handed to the cloud pool
    runtime: ModelRuntime | None = None  # the engines its batch ran on (a deploy may swap the line's since)

    @property
    def deadline(self) -> Deadline:
        return self.req.deadline


class RequestPath:
    """Admission, per-model lines, and answers; see the module docstring for the order of events.

    Args:
        cfg: daemon config.
        models: served models by name.
        answers: the answer book (records, publishes, acknowledges).
        escalation: thermal state, policy and cloud.
        stats: counters for status and telemetry.
        wake: wakes the network thread (room to read again after backpressure).
        input_pending: True while more requests wait to be read (then a request never runs on the
            network thread: it goes to its line, where it can batch with the others).
        metrics: the Prometheus metrics, when ``[metrics]`` is configured.
    """

    def __init__(self, cfg: DaemonConfig, models: dict[str, ModelRuntime], answers: AnswerBook, escalation: Escalation,
                 stats: ServiceStats, wake: Callable[[], None] = lambda: None,
                 input_pending: Callable[[], bool] = lambda: True, metrics=None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.models = models
        self.answers = answers
        self.escalation = escalation
        self.stats = stats
        self._wake = wake
        self._input_pending = input_pending
        s = cfg.service
        self.hold = s.queue_size  # above this many waiting, the network thread stops reading
        self.hard_limit = 2 * s.queue_size + 64  # the broker overshot: beyond this, busy
        self.draining = threading.Event()
        self._open = 0  # admitted, not yet answered or handed to the cloud
        self._idle = threading.Condition()
        self._decoders = ThreadPoolExecutor(s.staging_threads, thread_name_prefix="k2edge-decode") \
            if s.staging_threads > 1 else None
        self.lines = {name: _Line(self, rt) for name, rt in models.items()}

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

    def swap(self, name: str, runtime: ModelRuntime, timeout: float) -> ModelRuntime | None:
        """Between two batches, make ``runtime`` the engines of model ``name``'s line (a deploy).

        Returns:
            The runtime replaced (idle: no batch of it is in flight), or None when the line did not
            come to rest within ``timeout`` (nothing changed).
        """
        old = self.lines[name].swap(runtime, timeout)
        if old is not None:
            self.models[name] = runtime
        return old

    def waiting(self) -> int:
        """Requests admitted and not yet in a batch."""
        return sum(len(line.items) for line in self.lines.values())

    def saturated(self) -> bool:
        return self.waiting() >= self.hold

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

    def _settled(self, n: int = 1) -> None:
        with self._idle:
            self._open -= n
            if self._open <= 0:
                self._idle.notify_all()

    # 1. admit (network thread) --------------------------------------------------------------------
    def admit(self, msg, token) -> None:
        """Take one MQTT message; must not block (it runs on the network thread)."""
        if self.draining.is_set():
            return  # not acknowledged: the broker keeps it in our session for the next start
        received = clock()
        props = getattr(msg, "properties", None)
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
        if not self._input_pending() and line.take_idle():
            line.run([work])  # alone, and the engine idle and quick: answered here, no hand-off to wait for
        else:
            line.put(work)

    # 2. a batch, on its model's line ----------------------------------------------------------------
    def run_batch(self, line: "_Line", batch: list[Work], release: Callable[[], None]) -> None:
        """Deadlines, decoding and early routing, then inference (inline or on the lanes).

        ``release()`` gives the engine's room back once the batch has left it (idempotent).
        """
        rt = line.runtime
        now = clock()
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
                    body = self._carry_out(w, d, lambda w=w: self._run_one(rt, w))
                    if body is not None:
                        done.append((w, body))
        staged = clock()
        for w in live:
            w.timings["stage"] = (staged - now) * 1e3 / len(batch)
        if done:
            self.answer(done)
        if not live:
            release()
            return
        samples = [w.sample for w in live]
        if line.inline:
            try:
                outputs = rt.infer(samples)
            except Exception as exc:
                outputs = exc
            release()
            self.finish_batch(rt, live, outputs, staged)
            return
        try:
            future = rt.submit(samples)
        except Exception as exc:
            release()
            self.finish_batch(rt, live, exc, staged)
            return

        def on_lanes_done(f: Future) -> None:  # on the lane that ran the batch's last segment
            try:
                outputs = f.result()
            except Exception as exc:
                outputs = exc
            try:
                self.finish_batch(rt, live, outputs, staged)
            finally:  # after the answers: a line with every slot free has no batch left to answer (a swap waits for that)
                release()

        future.add_done_callback(on_lanes_done)

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

    # 3. decide and answer -------------------------------------------------------------------------
    def finish_batch(self, rt: ModelRuntime, live: list[Work], outputs, started: float) -> None:
        """The policy on each local result, then the answers (one record transaction for the batch)."""
        now = clock()
        if isinstance(outputs, Exception):
            log.error("model %s: batch of %d failed: %s", rt.name, len(live), outputs)
            self.answer([(w, self.error(w, INTERNAL, f"inference failed: {first_line(outputs)}")) for w in live])
            return
        self.stats.batch(len(live))
        if self.metrics is not None:
            self.metrics.observe_batch(rt.name, len(live))
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
            return self._carry_out_decision(w, d, local)
        except Exception as exc:
            log.exception("request %s: carrying out the escalation decision failed", w.req.id)
            return self.error(w, INTERNAL, f"internal error while escalating: {type(exc).__name__}")

    def _carry_out_decision(self, w: Work, d, local) -> dict | None:
        esc = self.escalation
        computed = local if isinstance(local, LocalResult) else None
        if d.action == "refuse":
            return self.error(w, d.error_code or BUSY, d.reason)
        if esc.wants_cloud(d):
            breq = self._bridge_request(w, computed)
            if d.action == "cloud":
                oid = esc.send(breq, d, local, w.deadline, w.key, lambda outcome, oid, w=w: self.cloud_finished(w, outcome, oid))
                if oid is not None:  # safe in the outbox: acknowledge the request now
                    self.answers.release(w.key, w.tokens)
                    w.tokens, w.settled = [], True
                    self._settled()
                    return None
                d = degrade(d, f"{self.cfg.service.queue_size} requests already wait for the cloud")
            else:  # answer locally now and leave the cloud's later answer to the outbox
                computed = computed or local()
                return self.body_from_outcome(w, esc.carry_out_now(breq, d, computed))
        if computed is None:
            if d.action != "local":
                return self.error(w, d.error_code or BUSY, d.reason)
            computed = local()
        below = d.confidence is not None and d.threshold is not None and d.confidence < d.threshold
        wanted = d.escalate or d.degraded or below  # (below and forbidden: the reason says so)
        return ok_body(w.req, self.cfg.device_id, self._profile(w), w.result, self._latency(w),
                       self._thermal_name(), confidence=d.confidence, degraded=d.degraded,
                       escalation_reason=d.reason if wanted else None, model_version=self._version(w))

    def _bridge_request(self, w: Work, local: LocalResult | None) -> BridgeRequest:
        r = w.req
        template = ok_body(r, self.cfg.device_id, self._profile(w), w.result, self._latency(w), self._thermal_name(),
                           model_version=self._version(w))
        mime = w.content_type if w.content_type and w.content_type.startswith("image/") else None
        return BridgeRequest(id=r.id or f"anon-{id(w):x}", model=r.model, prompt=r.prompt, image=r.image, mime=mime,
                             allow_cloud=r.allow_cloud, deferrable=r.deferrable, response_topic=w.reply_topic,
                             correlation_data=w.correlation, response=template)

    def cloud_finished(self, w: Work, outcome: Outcome | BaseException, oid: str) -> None:
        """A cloud worker's outcome for ``w`` (a cloud worker thread)."""
        if isinstance(outcome, BaseException):
            body = self.error(w, INTERNAL, f"internal error in the cloud offload: {type(outcome).__name__}")
        else:
            body = self.body_from_outcome(w, outcome)
        self._publish([(w, body)], settle=False, on_delivered=lambda: self.escalation.delivered(oid))

    def body_from_outcome(self, w: Work, outcome: Outcome) -> dict:
        if outcome.error_code:
            return self.error(w, outcome.error_code, outcome.reason)
        cloud_ms = outcome.latency_ms if outcome.source == "cloud" else None
        return ok_body(w.req, self.cfg.device_id, self._profile(w), w.result, self._latency(w, cloud=cloud_ms),
                       self._thermal_name(), confidence=outcome.decision.confidence if outcome.decision else None,
                       source=outcome.source, text=outcome.text if outcome.source == "cloud" else None,
                       escalation_reason=outcome.reason if outcome.escalated else None,
                       degraded=outcome.degraded, deferred=outcome.deferred,
                       cloud_input=outcome.cloud_input if outcome.source == "cloud" else None, model_version=self._version(w))

    # answers ----------------------------------------------------------------------------------------
    def answer(self, done: list[tuple[Work, dict]]) -> None:
        """Answer admitted requests: never an ``ok`` past its deadline; record, publish, count."""
        self._publish(done, settle=True)

    def _publish(self, done: list[tuple[Work, dict]], settle: bool, on_delivered: Callable[[], None] | None = None) -> None:
        now = clock()
        answers = []
        for w, body in done:
            w.settled = True
            if body["status"] == "ok" and w.deadline.expired(now):
                body = self.error(w, DEADLINE_EXCEEDED, f"the answer was ready after the {w.deadline.why}")
            payload = encode(body)
            if len(payload) > self.cfg.service.max_answer_bytes:
                body = self.error(w, PAYLOAD_TOO_LARGE, f"the answer is {len(payload):,} bytes, over max_answer_bytes "
                                  f"({self.cfg.service.max_answer_bytes:,})")
                payload = encode(body)
            self._count(body, now, w)
            answers.append(Answer(w.key, w.reply_topic, payload, w.correlation, w.tokens, on_delivered))
        self.answers.answer(answers)
        if settle:
            self._settled(len(done))

    def error(self, w: Work, code: str, message: str) -> dict:
        return error_body(code, message, w.req.id, w.req.attempt, w.req.model or None, self.cfg.device_id, self._version(w))

    def _count(self, body: dict, now: float, w: Work) -> None:
        if body["status"] == "ok":
            self.stats.answered((now - w.received) * 1e3)
            self.stats.count(f"source_{body['source']}")
            if body.get("escalation_reason") and not body["degraded"]:
                self.stats.count("escalated")
        else:
            self.stats.failed(body["error"]["code"])
        if self.metrics is not None:
            self.metrics.observe_answer(w.req.model, body["status"] if body["status"] == "ok" else body["error"]["code"],
                                        body.get("source"), body.get("latency_ms"))
            if body.get("escalation_reason"):
                self.metrics.observe_escalation(w.req.model, reason_kind(body["escalation_reason"]))

    def _latency(self, w: Work, **extra) -> dict:
        latency = {k: round(v, 3) if isinstance(v, float) else v for k, v in w.timings.items()}
        latency.update({k: round(v, 3) for k, v in extra.items() if v is not None})
        latency["total"] = round((clock() - w.received) * 1e3, 3)
        return latency

    def _profile(self, w: Work) -> str:
        rt = w.runtime or self.models.get(w.req.model)
        return rt.profile_name if rt else None

    def _version(self, w: Work) -> str | None:
        rt = w.runtime or self.models.get(w.req.model)
        return rt.version if rt else None

    def _thermal_name(self) -> str:
        st = self.escalation.thermal
        return getattr(st, "state", st) or "unknown"


class _Line:
    """One model's queue and the thread that forms its batches and runs them.

    A batch goes as soon as the engine has room, with everything waiting by then (up to
    ``max_batch``): an idle engine never makes a lone request wait, a busy one lets requests pile
    up into the next batch. ``batch_timeout_ms`` > 0 holds a batch up to that long after its oldest
    request arrived, hoping for companions. Room: one batch when the engine has one lane (run
    inline); with several lanes, one per lane plus one, so the lanes are fed while the next batch
    is decoded.
    """

    STUCK_AFTER_S = 30.0  # a batch in flight this long means a wedged lane: stop the heartbeat
    QUICK_S = 0.005  # a lone request runs on the network thread only on a model that answers it this fast

    def __init__(self, path: RequestPath, runtime: ModelRuntime) -> None:
        self.path = path
        self.runtime = runtime
        s = path.cfg.service
        self.max_batch = s.max_batch
        self.timeout = s.batch_timeout_ms / 1e3
        self.inline = runtime.single_lane
        self.quick = runtime.batch1_s < self.QUICK_S
        self.slots = 1 if self.inline else len(runtime.lanes()) + 1
        self.items: deque[Work] = deque()
        self._cond = threading.Condition()
        self._free = self.slots
        self._swapping = False  # a deploy waits for the batches in flight: form no new one meanwhile
        self._running = 0  # batches whose run() has not returned (an inline batch's answers are out by then)
        self._progress = time.monotonic()
        self._heartbeat = time.monotonic()
        self._stopping = False
        self.thread = threading.Thread(target=self._loop, name=f"k2edge-line-{runtime.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.thread.join(timeout=10)

    def put(self, work: Work) -> None:
        with self._cond:
            self.items.append(work)
            self._cond.notify()

    def release(self) -> None:
        """A batch left the engine: room for the next."""
        with self._cond:
            self._free += 1
            self._progress = time.monotonic()
            self._cond.notify()

    def alive(self, max_age: float) -> bool:
        return self.thread.is_alive() and time.monotonic() - self._heartbeat <= max_age

    def swap(self, runtime: ModelRuntime, timeout: float) -> ModelRuntime | None:
        """Wait until no batch is in flight or being answered (forming none meanwhile), then take
        ``runtime`` for every later batch, under the lock the loop forms batches with: every answer
        of the old engines is published before the first of the new. None on timeout."""
        end = time.monotonic() + timeout
        with self._cond:
            self._swapping = True
            try:
                while self._free != self.slots or self._running:
                    if time.monotonic() >= end:
                        return None
                    self._cond.wait(0.05)  # release() wakes one waiter, perhaps the loop: poll
                old, self.runtime, self.inline = self.runtime, runtime, runtime.single_lane
                self.quick = runtime.batch1_s < self.QUICK_S
                self.slots = self._free = 1 if self.inline else len(runtime.lanes()) + 1
            finally:
                self._swapping = False
                self._cond.notify_all()
        return old

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._free == self.slots or now - self._progress < self.STUCK_AFTER_S:
                        self._heartbeat = now
                    if self.items and self._free > 0 and not self._swapping:
                        hold = self.items[0].received + self.timeout - clock()
                        if self.timeout <= 0 or len(self.items) >= self.max_batch or hold <= 0 or self._stopping:
                            break
                        self._cond.wait(min(hold, 0.5))
                        continue
                    if not self.items and self._stopping:
                        return
                    self._cond.wait(0.5)
                was_saturated = self.path.saturated()
                batch = [self.items.popleft() for _ in range(min(len(self.items), self.max_batch))]
                self._free -= 1
                self._running += 1
                self._progress = now
            if was_saturated and not self.path.saturated():
                self.path._wake()  # the network thread may read again
            self.run(batch)

    def take_idle(self) -> bool:
        """Take the engine for one request when nothing waits or runs and the model is quick
        (called by the network thread, which then runs the request itself: no hand-off)."""
        if not (self.inline and self.quick):
            return False
        with self._cond:
            if self.items or self._free != self.slots or self._stopping or self._swapping:
                return False
            self._free -= 1
            self._running += 1
            self._progress = time.monotonic()
            return True

    def run(self, batch: list[Work]) -> None:
        """Run a batch whose room was taken, in the calling thread; never raises, never leaves a
        request unanswered."""
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self.release()

        try:
            self.path.run_batch(self, batch, release)
        except Exception as exc:  # one bad batch never stops the line
            log.exception("model %s: a batch of %d failed", self.runtime.name, len(batch))
            left = [w for w in batch if not w.settled]
            if left:
                self.path.answer([(w, self.path.error(w, INTERNAL, f"internal error: {type(exc).__name__}")) for w in left])
            release()
        finally:
            with self._cond:
                self._running -= 1
                if self._swapping:
                    self._cond.notify_all()
