"""The request path: one MQTT request from the broker to its reply, in the order it happens.

1. **admit** (:meth:`RequestPath.on_message`, the MQTT network thread): parse and validate the
   payload, compute the request's key (reply topic, id, attempt), let the answer book recognise a
   redelivery, check the model and the :class:`Backlog`, and queue the request
   (:class:`~k2edge.service.replies.RequestItem`) for its model's
   :class:`~k2edge.service.batcher.Batcher`. Nothing here decodes an image or runs a model; a
   request refused here is replied to here. A lone request for an idle, quick, one-lane engine,
   with nothing else waiting to be read, is run by the network thread itself — one thread, no
   hand-off.
2. **batch** (the batcher's thread): :class:`RequestQueue` is the batcher's request client: the
   oldest requests first, before any frame (they have deadlines); ``batch_timeout_ms`` may hold a
   batch for companions.
3. **stage** (:meth:`RequestQueue.stage`): drop what passed its deadline (``deadline_exceeded``),
   decode each input into a sample, ask the escalation policy early only in the hot and critical
   thermal states.
4. **finish** (:meth:`RequestQueue.finish`): the policy once per request on its local result;
   :meth:`Escalation.carry_out <k2edge.service.escalation.Escalation.carry_out>` gives the reply,
   or hands the request to the cloud pool (which replies later through the same
   :class:`~k2edge.service.replies.Replies`).
5. **reply** (:class:`~k2edge.service.replies.Replies`, through the
   :class:`~k2edge.service.answer_book.AnswerBook`): every reply — ok, error, busy, cloud, deferred —
   is recorded under its key before it is published, and its request is acknowledged once the
   broker acknowledged the answer (or once its cloud work is in the outbox).

One :class:`~k2edge.deadline.Deadline` travels with a request and is checked when it is staged and
when its reply is ready: an ``ok`` reply is never sent late.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from .. import tracing
from ..config.schema import DaemonConfig
from ..deadline import clock
from ..errors import InputError, first_line
from ..tasks.result import LocalResult
from . import topics
from .answer_book import AnswerBook, AnswerKey
from .batcher import BatchClient, Batcher
from .escalation import Escalation
from .metrics import AnswerStats
from .protocol import (BAD_REQUEST, BUSY, DEADLINE_EXCEEDED, INTERNAL, PAYLOAD_TOO_LARGE, UNKNOWN_MODEL, Request,
                       RequestError, parse_request, peek_key)
from .replies import Replies, RequestItem
from .runtime import ModelRuntime

log = logging.getLogger(__name__)


class Backlog:
    """Requests admitted and waiting for a batch, across every model: the bound the network thread reads by.

    Args:
        hold: above this many waiting, the network thread stops reading (the broker keeps the rest).
        hard_limit: the broker overshot: beyond this many waiting, and the most one read may bring past the pause
            (``broker.read_allowance()``), a new request is answered ``busy``.
        broker: the request connection (``wake()``: room to read again).
    """

    def __init__(self, hold: int, hard_limit: int, broker) -> None:
        self.hold, self.hard_limit, self.broker = hold, hard_limit, broker
        self.waiting = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.waiting += 1

    def taken(self, n: int) -> None:
        """``n`` requests went into a batch: wake the network thread when that made room to read."""
        with self._lock:
            before = self.waiting
            self.waiting -= n
        if before >= self.hold > self.waiting:
            self.broker.wake()

    def saturated(self) -> bool:
        return self.waiting >= self.hold

    def full(self) -> bool:
        # one read of the connection takes as many requests as it has answers unacknowledged (paho's loop_read): after
        # a broker restart, 107-115 answers re-sent at once let one read overshoot a hard limit of 80 (a burst of 300
        # at queue_size 8 got 4 ``busy``), which is the client's read, not the broker ignoring the Receive Maximum
        return self.waiting >= self.hard_limit + self.broker.read_allowance()


class RequestQueue(BatchClient):
    """One model's waiting requests, as its batcher's client: oldest first, before any frame.

    Args:
        cond: the batcher's condition (notified when a request is queued).
        backlog: counts what waits, across models.
        replies: replies to the requests.
        escalation: the policy, and the cloud.
        decoders: a pool that decodes the images of a batch in parallel, or None.
        max_pixels: the largest image accepted (``service.max_image_pixels``).
    """

    holds = True  # a batch of requests may wait batch_timeout_ms for companions
    drains = True  # requests admitted are run even while the daemon stops

    def __init__(self, cond: threading.Condition, backlog: Backlog, replies: Replies, escalation: Escalation,
                 decoders: ThreadPoolExecutor | None, max_pixels: int) -> None:
        self.cond, self.backlog, self.replies, self.escalation = cond, backlog, replies, escalation
        self.decoders, self.max_pixels = decoders, max_pixels
        self.items: deque[RequestItem] = deque()

    def put(self, w: RequestItem) -> None:
        self.backlog.add()
        with self.cond:
            self.items.append(w)
            self.cond.notify()

    # taking (under the batcher's lock) ------------------------------------------------------------------
    def ready(self) -> bool:
        return bool(self.items)

    def oldest(self) -> float:
        return self.items[0].received

    def full(self, max_batch: int) -> bool:
        return len(self.items) >= max_batch

    def take(self, room: int) -> list[RequestItem]:
        batch = [self.items.popleft() for _ in range(min(len(self.items), room))]
        self.backlog.taken(len(batch))
        return batch

    # staging: deadlines, decoding and early routing -----------------------------------------------------
    def stage(self, rt: ModelRuntime, batch: list[RequestItem]) -> list[RequestItem]:
        now = clock()
        replies: list[tuple[RequestItem, dict]] = []
        live: list[RequestItem] = []
        timely = []
        for w in batch:
            w.runtime = rt
            w.timings["queue"] = (now - w.received) * 1e3
            if w.trace is not None:
                w.trace.mark("stage", now)
            if w.deadline.expired(now):  # not decoded: nothing will be done with it
                replies.append((w, self.replies.error(w, DEADLINE_EXCEEDED, f"{w.deadline.why} passed before the request could run")))
            else:
                timely.append(w)
        for w, sample in zip(timely, self._decode(rt, timely)):
            if isinstance(sample, RequestError):
                replies.append((w, self.replies.error(w, sample.code, sample.message)))
                continue
            w.sample, w.geometry = sample
            # the policy is asked before inference only in the hot and critical states
            d = self.escalation.decide(w.req.model, w.req.prompt, w.req.allow_cloud, w.req.deferrable, None)
            if d is None:
                live.append(w)
            else:
                body = self._carry_out(w, d, rt.held(functools.partial(run_one, rt, w)))
                if body is not None:
                    replies.append((w, body))
        staged = clock()
        for w in live:
            w.timings["stage"] = (staged - now) * 1e3 / len(batch)
        if replies:
            self.replies.send(replies)
        return live

    def _decode(self, rt: ModelRuntime, batch: list[RequestItem]) -> list:
        def one(w: RequestItem):
            try:
                return rt.stage(w.req.image, w.req.tensor, self.max_pixels)
            except InputError as exc:
                return RequestError(BAD_REQUEST, str(exc))
            except Exception as exc:
                log.exception("decoding request %s failed", w.req.id)
                return RequestError(INTERNAL, f"internal error while decoding: {type(exc).__name__}")

        images = sum(w.req.image is not None for w in batch)
        if self.decoders is not None and images > 1:
            return list(self.decoders.map(one, batch))
        return [one(w) for w in batch]

    # finishing: the policy on each local result ---------------------------------------------------------
    def finish(self, rt: ModelRuntime, live: list[RequestItem], rows, started: float) -> None:
        """The policy on each local result, then the replies (one record transaction for the batch)."""
        now = clock()
        if isinstance(rows, Exception):
            log.error("model %s: batch of %d failed: %s", rt.name, len(live), rows)
            self.replies.send([(w, self.replies.error(w, INTERNAL, f"inference failed: {first_line(rows)}")) for w in live])
            return
        replies: list[tuple[RequestItem, dict]] = []
        results = rt.results(rows, [w.geometry for w in live], [w.req.top_k or rt.cfg.top_k for w in live])
        for w, result in zip(live, results):
            w.timings.update(infer=(now - started) * 1e3, batch=len(live))
            if w.trace is not None:
                w.trace.mark("infer", started), w.trace.mark("decide", now)
            if isinstance(result, Exception):
                replies.append((w, self.replies.error(w, INTERNAL, str(result))))
                continue
            w.result, local = result
            d = self.escalation.decide(w.req.model, w.req.prompt, w.req.allow_cloud, w.req.deferrable, local)
            body = self._carry_out(w, d, local)
            if body is not None:
                replies.append((w, body))
        if replies:
            self.replies.send(replies)

    def _carry_out(self, w: RequestItem, d, local) -> dict | None:
        """The reply body for a decision, or None when the request went to the cloud pool."""
        if w.trace is not None:
            w.trace.decided(d.action, d.reason, d.escalate)
        try:
            return self.escalation.carry_out(w, d, local)
        except Exception as exc:
            log.exception("request %s: carrying out the escalation decision failed", w.req.id)
            return self.replies.error(w, INTERNAL, f"internal error while escalating: {type(exc).__name__}")

    def fail(self, batch: list[RequestItem], exc: Exception) -> None:
        """A batch raised: reply to what it left without a reply."""
        left = [w for w in batch if not w.replied]
        if left:
            self.replies.send([(w, self.replies.error(w, INTERNAL, f"internal error: {type(exc).__name__}")) for w in left])


def run_one(rt: ModelRuntime, w: RequestItem) -> LocalResult:
    """``w``'s local result computed late (a decision made before inference, in the hot state)."""
    result = rt.results(rt.infer([w.sample]), [w.geometry], [w.req.top_k or rt.cfg.top_k])[0]
    if isinstance(result, Exception):
        raise result
    w.result, local = result
    return local


class RequestPath:
    """Admission: the request connection's handler (``on_message``, ``on_connected``, ``saturated``).

    Args:
        cfg: daemon config.
        queues: each served model's :class:`RequestQueue`.
        batchers: each served model's batcher (a lone request may run on the network thread).
        book: the answer book (recognises a redelivery).
        replies: replies to the requests admitted.
        backlog: what waits, across models.
        broker: the request connection (``input_pending()``: more requests wait to be read, so a
            request never runs on the network thread: it goes to its batcher, where it can batch).
        draining: set when the daemon drains: nothing more is admitted.
    """

    def __init__(self, cfg: DaemonConfig, queues: dict[str, RequestQueue], batchers: dict[str, Batcher],
                 book: AnswerBook, replies: Replies, backlog: Backlog, broker, draining: threading.Event) -> None:
        self.cfg = cfg
        self.queues, self.batchers = queues, batchers
        self.book, self.replies, self.backlog, self.broker = book, replies, backlog, broker
        self.stats: AnswerStats = replies.stats
        self.draining = draining

    def saturated(self) -> bool:
        return self.backlog.saturated()

    def on_connected(self) -> None:
        """Nothing to do per connection: answers queued while disconnected go out with the session."""

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
        carrier = {k: user.pop(k) for k in ("traceparent", "tracestate") if k in user}  # W3C trace context, not fields
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
        if key is not None and not self.book.claim(key, token):
            self.stats.count("redelivered")
            return  # answered already (or being answered): acknowledged when that answer is delivered
        batcher = self.batchers.get(model)
        w = RequestItem(req or Request(rid, model, attempt), key, reply, correlation, content_type, received,
                        batcher.runtime if batcher is not None else None, [token] if key is None else [])
        w.trace = tracing.tracer().request(msg.topic, model, rid, len(payload), carrier, received)
        if bad_topic:
            error = RequestError(BAD_REQUEST, f"Response Topic {response_topic[:80]!r} is not a topic one can publish to", rid, attempt)
        elif error is None and batcher is None:
            error = RequestError(UNKNOWN_MODEL, f"no model {model[:80]!r} here; served: {sorted(self.batchers)}", rid, attempt)
        elif error is None and self.backlog.full():
            error = RequestError(BUSY, f"{self.backlog.waiting} requests already wait here", rid, attempt)
        self.replies.opened()
        if error is not None:
            self.replies.send([(w, self.replies.error(w, error.code, error.message))])
            return
        queue = self.queues[model]
        if w.trace is not None:
            w.trace.mark("queue")
        if not self.broker.input_pending() and batcher.take_idle():
            batcher.run([(queue, [w])], inline=True)  # alone, the engine idle and quick: replied to here, no hand-off
        else:
            queue.put(w)
