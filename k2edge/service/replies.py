"""Replies to admitted requests: their shape, the deadline check, and how many are still open.

Both the request client (:mod:`k2edge.service.request_path`) and the cloud side
(:mod:`k2edge.service.escalation`) reply through one :class:`Replies`: every reply is checked
against its request's deadline (an ``ok`` is never sent late), counted, and handed to the
:class:`~k2edge.service.answer_book.AnswerBook`, which records it under its key before publishing.
A request is *open* from admission until it is replied to or its cloud work is safe in the outbox:
the drain waits for none to be open.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..config.schema import DaemonConfig
from ..deadline import Deadline, clock
from .answer_book import Answer, AnswerBook, AnswerKey
from .metrics import AnswerStats
from .protocol import DEADLINE_EXCEEDED, PAYLOAD_TOO_LARGE, Request, encode, error_body, ok_body
from .runtime import ModelRuntime


@dataclass(slots=True)
class RequestItem:
    """One admitted request on its way to its reply (an item of its model's batcher)."""

    req: Request
    key: AnswerKey | None
    reply_topic: str
    correlation: bytes | None
    content_type: str | None
    received: float
    runtime: ModelRuntime | None  # the engines it ran on (at admission: the ones its model ran then)
    tokens: list = field(default_factory=list)  # ack tokens of a request without an id (keyed ones: the answer book)
    timings: dict = field(default_factory=dict)
    sample: np.ndarray | None = None
    geometry: object = None  # where an image landed in the sample (detection boxes are mapped back through it)
    result: dict = field(default_factory=dict)  # the task's answer fragment: top_k, detections or outputs
    replied: bool = False  # replied to, or handed to the cloud pool
    trace: object = None  # its spans (a k2edge.tracing.RequestTrace) when tracing is on and it is sampled

    @property
    def deadline(self) -> Deadline:
        return self.req.deadline


class Replies:
    """Builds, checks and sends the replies to admitted requests.

    Args:
        cfg: daemon config (device id, ``max_answer_bytes``).
        book: records and publishes every answer, and acknowledges its request.
        stats: counts every reply.
        thermal: the thermal sampler (``state``: the state a reply reports).
    """

    def __init__(self, cfg: DaemonConfig, book: AnswerBook, stats: AnswerStats, thermal) -> None:
        self.cfg = cfg
        self.book = book
        self.stats = stats
        self.thermal = thermal
        self._open = 0  # admitted, not yet replied to or handed to the cloud
        self._idle = threading.Condition()

    # open requests ----------------------------------------------------------------------------------
    def opened(self) -> None:
        """A request was admitted."""
        with self._idle:
            self._open += 1

    def _close(self, n: int = 1) -> None:
        with self._idle:
            self._open -= n
            if self._open <= 0:
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Block until every admitted request was replied to or handed to the cloud (drain)."""
        end = time.monotonic() + timeout
        with self._idle:
            while self._open:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def handed_to_cloud(self, w: RequestItem) -> None:
        """``w``'s cloud work is safe in the outbox: acknowledge the request now; its reply comes later."""
        self.book.acknowledge_early(w.key, w.tokens)
        w.tokens, w.replied = [], True
        if w.trace is not None:
            w.trace.mark("cloud")
        self._close()

    # sending ----------------------------------------------------------------------------------------
    def send(self, replies: list[tuple[RequestItem, dict]]) -> None:
        """Reply to open requests (one record transaction for them all)."""
        self._send([(w, body, None) for w, body in replies])
        self._close(len(replies))

    def send_late(self, replies: list[tuple[RequestItem, dict, Callable[[], None]]]) -> None:
        """Replies to requests handed to the cloud pool (a cloud worker's or the fallback timer's thread),
        each with what to do once the broker has it (one record transaction for them all)."""
        self._send(replies)

    def _send(self, replies: list[tuple[RequestItem, dict, Callable[[], None] | None]]) -> None:
        now = clock()
        answers = []
        limit = self.cfg.service.max_answer_bytes
        for w, body, on_delivered in replies:
            w.replied = True
            if body["status"] == "ok" and w.deadline.expired(now):
                body = self.error(w, DEADLINE_EXCEEDED, f"the answer was ready after the {w.deadline.why}")
            payload = encode(body)
            if len(payload) > limit:
                body = self.error(w, PAYLOAD_TOO_LARGE, f"the answer is {len(payload):,} bytes, over max_answer_bytes "
                                  f"({limit:,})")
                payload = encode(body)
            self.stats.answer(w.req.model, body, (now - w.received) * 1e3)
            user = ()
            if w.trace is not None:  # the answer names the request's span; its spans end when the broker has it
                w.trace.mark("publish", now)
                user, on_delivered = w.trace.user_properties(), w.trace.delivered(body["status"], on_delivered)
            answers.append(Answer(w.key, w.reply_topic, payload, w.correlation, w.tokens, on_delivered, user))
        self.book.answer(answers)

    # shapes -------------------------------------------------------------------------------------------
    def template(self, w: RequestItem, **fields) -> dict:
        """``w``'s ``ok`` reply as the edge gives it (the cloud's answers complete it)."""
        rt = w.runtime
        return ok_body(w.req, self.cfg.device_id, rt.profile_name if rt else None, w.result, self._latency(w),
                       self.thermal.state.state, model_version=rt.version if rt else None, **fields)

    def error(self, w: RequestItem, code: str, message: str) -> dict:
        """``w``'s error reply."""
        return error_body(code, message, w.req.id, w.req.attempt, w.req.model or None, self.cfg.device_id,
                          w.runtime.version if w.runtime else None)

    @staticmethod
    def _latency(w: RequestItem) -> dict:
        latency = {k: round(v, 3) if isinstance(v, float) else v for k, v in w.timings.items()}
        latency["total"] = round((clock() - w.received) * 1e3, 3)
        return latency
