"""The K2 client: one chat completion with an optional image, bounded retries honouring
Retry-After within the request's deadline, quota errors failing fast, and a circuit breaker.

OpenAI mode uses the official ``openai`` SDK with its own retries off (``max_retries=0``): the
retries are done here so Retry-After, the deadline, quota errors and the breaker's count (one
failure per call, not per attempt) are all handled in one place. Anthropic mode posts to the
Anthropic-compatible ``/v1/messages`` with ``httpx2`` (the SDK's HTTP library); Moonshot's
endpoint multiplies the temperature by 0.6, so the client sends ``temperature / 0.6`` (capped at
1.0, the API's maximum, i.e. an effective 0.6 at most) to get the configured effective value.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from pydantic import SecretStr

from .. import tracing
from .breaker import CircuitBreaker
from .errors import (
    BreakerOpen,
    CloudAuthError,
    CloudConfigError,
    CloudError,
    CloudQuotaError,
    CloudRateLimited,
    CloudRejected,
    CloudTimeout,
    CloudUnavailable,
)
from .image import PreparedImage, prepare_image
from .retry import RETRYABLE_STATUS, backoff_s, is_quota_error, parse_retry_after, scrub
from ..config.cloud import CloudSettings
from .apikey import resolve_api_key

log = logging.getLogger(__name__)

__all__ = ["K2Client", "CloudAnswer", "build_text", "ANTHROPIC_TEMPERATURE_SCALE", "DEFAULT_QUESTION"]

ANTHROPIC_TEMPERATURE_SCALE = 0.6  # Moonshot's /anthropic: real_temperature = request_temperature * 0.6
ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_QUESTION = "What does this image show? Answer with the most likely label and one short sentence."
_MIN_ATTEMPT_S = 0.01
_RESOLVE = object()


@dataclass(frozen=True)
class CloudAnswer:
    """The cloud's answer: its text, the model that answered, the round trip (all attempts) and attempts made."""

    text: str
    model: str
    latency_ms: float
    attempts: int
    cloud_input: str = "image"  # what K2 was given besides the text: "image", or "text" (findings only)


def build_text(prompt: str | None, top_k: Sequence[dict] | None, detections: Sequence[dict] | None = None,
               image: PreparedImage | None = None, image_size: tuple[int, int] | None = None) -> str:
    """The text part: the user's prompt (or a default question) and the edge's findings as context.

    Args:
        prompt: the user's question; a default one when empty.
        top_k: a classifier's top-k (``{"label", "score"}``).
        detections: a detector's boxes (``{"label", "score", "box"}``, original-image pixels).
        image: the image K2 receives with this text: boxes are rescaled to its pixels. None when
            no image goes along (vision off or refused): the findings then stand in for it.
        image_size: the original image's (width, height), for the text-only description.
    """
    text = prompt.strip() if prompt and prompt.strip() else DEFAULT_QUESTION
    if top_k:
        guesses = ", ".join(f"{r.get('label', r.get('index'))} ({float(r.get('score', 0.0)):.3f})" for r in top_k)
        text += f"\n\nThe on-device classifier's top-{len(top_k)} guesses (label, probability): {guesses}."
    if detections is not None:
        boxes = image.scale_boxes([d["box"] for d in detections]) if image is not None else [d["box"] for d in detections]
        found = [{"label": d.get("label"), "score": round(float(d.get("score", 0.0)), 3), "box": b}
                 for d, b in zip(detections, boxes)]
        if image is not None:
            where = f"in pixels of the {image.width}x{image.height} image you received"
        else:
            size = f" of the {image_size[0]}x{image_size[1]} image" if image_size else ""
            where = f"in pixels{size}; the image itself could not be sent, so answer from these findings"
        text += (f"\n\nThe on-device detector found {len(found)} object(s) (box = [x1, y1, x2, y2] {where}): "
                 f"{json.dumps(found)}")
    return text


# A 4xx whose message says the server takes no image content (vLLM serving a text-only model, ...).
_IMAGE_REFUSAL = re.compile(r"image|vision|multi-?modal|content part|content type", re.IGNORECASE)


class _Failure(Exception):
    """One failed HTTP attempt, normalised across wires."""

    def __init__(self, kind: str, detail: str, status: int | None = None, headers=None, body=None) -> None:
        super().__init__(detail)
        self.kind, self.detail, self.status, self.headers, self.body = kind, detail, status, headers or {}, body


class _OpenAIWire:
    def __init__(self, settings: CloudSettings, key: str) -> None:
        import openai

        self._openai = openai
        self.client = openai.OpenAI(base_url=settings.base_url, api_key=key, timeout=settings.timeout_s, max_retries=0)
        self.settings = settings

    def body(self, image: PreparedImage | None, text: str) -> dict:
        content: list[dict] = []
        if image is not None:
            content.append({"type": "image_url", "image_url": {"url": image.data_url}})
        content.append({"type": "text", "text": text})
        return {"model": self.settings.model, "temperature": self.settings.temperature, "max_tokens": self.settings.max_tokens,
                "messages": [{"role": "system", "content": self.settings.system_prompt}, {"role": "user", "content": content}]}

    def send(self, body: dict, timeout: float) -> tuple[str, str]:
        try:
            resp = self.client.chat.completions.create(**body, timeout=timeout, extra_headers=tracing.headers() or None)
        except Exception as exc:
            raise self._failure(exc) from None
        if getattr(resp, "usage", None) is not None:
            tracing.note(**{"gen_ai.usage.input_tokens": resp.usage.prompt_tokens or 0,
                            "gen_ai.usage.output_tokens": resp.usage.completion_tokens or 0})
        try:
            text = resp.choices[0].message.content or ""
        except (AttributeError, IndexError, TypeError):
            raise _Failure("protocol", "the server's answer has no choices[0].message") from None
        return text, getattr(resp, "model", None) or body["model"]

    def models(self, timeout: float) -> list[str]:
        try:
            return sorted(m.id for m in self.client.models.list(timeout=timeout).data)
        except Exception as exc:
            raise self._failure(exc) from None

    def _failure(self, exc: Exception) -> _Failure:
        o = self._openai
        if isinstance(exc, o.APITimeoutError):
            return _Failure("timeout", "no answer before the timeout")
        if isinstance(exc, o.APIConnectionError):
            cause = exc.__cause__ or exc.__context__
            return _Failure("connection", f"cannot connect ({type(cause).__name__ if cause else 'connection error'})")
        if isinstance(exc, o.APIStatusError):
            body = exc.body
            return _Failure("status", f"HTTP {exc.status_code}: {_summary(body)}", exc.status_code,
                            dict(exc.response.headers), body)
        if isinstance(exc, o.OpenAIError):
            return _Failure("protocol", f"{type(exc).__name__}")
        if isinstance(exc, (AttributeError, TypeError, ValueError)):  # the SDK choking on an answer it cannot parse
            return _Failure("protocol", f"the server's answer is not the JSON expected ({type(exc).__name__})")
        raise exc


class _AnthropicWire:
    def __init__(self, settings: CloudSettings, key: str) -> None:
        import httpx2

        self._httpx = httpx2
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if key:
            headers.update({"x-api-key": key, "authorization": f"Bearer {key}"})
        self.client = httpx2.Client(base_url=settings.base_url, headers=headers, timeout=settings.timeout_s)
        self.settings = settings
        self.temperature = min(1.0, settings.temperature / ANTHROPIC_TEMPERATURE_SCALE)
        if settings.temperature > ANTHROPIC_TEMPERATURE_SCALE:
            log.warning("anthropic mode: temperature %.2f cannot be reached (the endpoint scales 0..1 to 0..0.6); using 0.6",
                        settings.temperature)

    def body(self, image: PreparedImage | None, text: str) -> dict:
        content: list[dict] = []
        if image is not None:
            content.append({"type": "image", "source": {"type": "base64", "media_type": image.mime, "data": image.base64}})
        content.append({"type": "text", "text": text})
        return {"model": self.settings.model, "max_tokens": self.settings.max_tokens, "temperature": self.temperature,
                "system": self.settings.system_prompt, "messages": [{"role": "user", "content": content}]}

    def _request(self, method: str, path: str, timeout: float, body: dict | None = None):
        h = self._httpx
        try:
            r = self.client.request(method, path, json=body, timeout=timeout, headers=tracing.headers() or None)
        except h.TimeoutException:
            raise _Failure("timeout", "no answer before the timeout") from None
        except h.TransportError as exc:
            raise _Failure("connection", f"cannot connect ({type(exc).__name__})") from None
        try:
            data = r.json()
        except ValueError:
            data = r.text
        if r.status_code >= 400:
            raise _Failure("status", f"HTTP {r.status_code}: {_summary(data)}", r.status_code, dict(r.headers), data)
        return data

    def send(self, body: dict, timeout: float) -> tuple[str, str]:
        data = self._request("POST", "/v1/messages", timeout, body)
        try:
            text = "".join(part.get("text", "") for part in data["content"] if part.get("type") == "text")
        except (KeyError, TypeError, AttributeError):
            raise _Failure("protocol", "the server's answer has no content list") from None
        return text, data.get("model") or body["model"]

    def models(self, timeout: float) -> list[str]:
        data = self._request("GET", "/v1/models", timeout)
        try:
            return sorted(m["id"] for m in data["data"])
        except (KeyError, TypeError):
            raise _Failure("protocol", "the model list has no data[].id") from None


def _summary(body) -> str:
    """The server's error message, bounded but not cut for showing: a cut made before the key is scrubbed out could
    halve a key the server echoed, and the half would pass the scrub (:meth:`K2Client._scrub` cuts after it)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("type") or json.dumps(err, default=str)
            return str(msg)[:_READ_CHARS]
        return str(err)[:_READ_CHARS]
    return (str(body) if body is not None else "no body")[:_READ_CHARS]


NOTHING_TO_ASK = ("the cloud takes no image here ([cloud] vision off, or the server refused images) and the request "
                  "asks nothing, with no local findings to send instead")
_READ_CHARS = 16_384  # of a server's error message (a key in it is scrubbed before it is cut to SHOWN_CHARS)
SHOWN_CHARS = 320  # of a failure's detail, in answers, the status and logs


class K2Client:
    """A K2 endpoint.

    Args:
        settings: the endpoint.
        api_key: the key; by default read from where ``settings`` says (:func:`resolve_api_key`).
        breaker: the circuit breaker; by default one from ``settings``.
        clock, sleep: monotonic clock and sleep (injectable for tests).

    Raises:
        CloudConfigError: the key source is missing or empty.
    """

    def __init__(self, settings: CloudSettings, api_key: SecretStr | str | None | object = _RESOLVE, *,
                 breaker: CircuitBreaker | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.settings = settings
        if api_key is _RESOLVE:
            api_key = resolve_api_key(settings)
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else (api_key or "")
        self._secrets = (key,) if key else ()
        self.breaker = breaker or CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown_s, clock)
        self._clock, self._sleep = clock, sleep
        self._wire = None
        self._wire_lock = threading.Lock()
        self._key = SecretStr(key)
        self.last_answer_s: float | None = None  # how long the cloud's last answer took (a deadline's cut is judged by it)
        self._excused_in_a_row = 0  # deadline-cut timeouts not counted by the breaker since the last answer
        self.vision_refused = False  # vision = "auto": set once the server refused image content
        self.json_mode_refused = False  # set once the server refused response_format json_object

    def __repr__(self) -> str:
        return f"<K2Client {self.settings.mode} {self.settings.base_url} model={self.settings.model} key={self.settings.key_source()}>"

    @property
    def wire(self):
        with self._wire_lock:
            if self._wire is None:
                # Self-hosted servers without auth still need a non-empty key for the SDK; it is not a secret.
                key = self._key.get_secret_value() or ("EMPTY" if self.settings.mode == "openai" else "")
                cls = _OpenAIWire if self.settings.mode == "openai" else _AnthropicWire
                self._wire = cls(self.settings, key)
            return self._wire

    def sends_images(self) -> bool:
        """Whether images go to K2 now (``vision`` on, or auto and not refused yet)."""
        return self.settings.vision == "on" or (self.settings.vision == "auto" and not self.vision_refused)

    def nothing_to_ask(self, image_bytes: bytes | None, prompt: str | None, top_k=None, detections=None) -> bool:
        """A request with an image K2 does not take now, no prompt and no local findings: K2 would be asked about an
        image it cannot see (and its "I cannot see any image" would stand for the answer)."""
        return image_bytes is not None and not self.sends_images() and not prompt and not top_k and not detections

    def request_body(self, image_bytes: bytes | None, prompt: str | None, top_k: Sequence[dict] | None,
                     detections: Sequence[dict] | None = None, with_image: bool = True) -> dict:
        """The exact JSON body :meth:`complete` sends (image downscaled, data URL, text part with the
        edge's findings; boxes rescaled to the image sent, or described in words without it)."""
        image = prepare_image(image_bytes, self.settings.image_max_side) if image_bytes else None
        if image is not None and not with_image:
            size = (image.original_width, image.original_height)
            return self.wire.body(None, build_text(prompt, top_k, detections, None, size))
        return self.wire.body(image, build_text(prompt, top_k, detections, image))

    def complete(self, image_bytes: bytes | None, mime: str | None, prompt: str | None, top_k: Sequence[dict] | None,
                 deadline_s: float, detections: Sequence[dict] | None = None) -> CloudAnswer:
        """Ask K2 once (with bounded retries) and return its answer.

        Args:
            image_bytes: the request's image (JPEG/PNG/WEBP/GIF...), or None for text only.
            mime: the caller's idea of its type; the bytes are sniffed and the real type is sent.
            prompt: the user's question (a default question when None).
            top_k: the edge's top-k (``{"label", "score"}`` rows) as context.
            deadline_s: seconds from now by which the answer must be back, retries included.
            detections: a detector's boxes as context (original-image pixels; rescaled to the image sent).

        With ``vision = "off"``, or ``auto`` after the server refused image content, the image stays
        here and the findings go as text (``CloudAnswer.cloud_input == "text"``); under ``auto`` the
        first refusal switches to text and the same request is sent again at once. A refusal is the
        server answering, not an outage: it never counts against the breaker.

        Raises:
            BreakerOpen: the breaker is open (no call made).
            CloudTimeout: no answer within the deadline.
            CloudRateLimited / CloudUnavailable: 429 / 5xx / connection failures after the retries.
            CloudQuotaError: the quota or billing is spent (no retry; opens the breaker).
            CloudAuthError: the key was rejected (opens the breaker).
            CloudRejected: the server refuses this request (bad image, unknown model); not an outage.
            CloudConfigError: no model configured.
        """
        del mime  # the bytes decide the MIME type; see prepare_image
        start = self._clock()
        self._admit()
        with_image = image_bytes is not None and self.sends_images()
        if self.nothing_to_ask(image_bytes, prompt, top_k, detections):  # no call (a deferred row's, a live one's)
            self.breaker.release_probe()
            raise CloudRejected(NOTHING_TO_ASK)
        tracing.note(**{"k2edge.cloud.breaker": str(self.breaker.state)})
        try:
            body = self.request_body(image_bytes, prompt, top_k, detections, with_image)
        except CloudError:
            self.breaker.release_probe()
            raise

        def adapt(f: _Failure, body: dict, attempts: int) -> dict | None:
            nonlocal with_image
            if not (with_image and self._refuses_images(f)):
                return None
            self.breaker.record_success()  # the server is up; it takes no images
            if self.settings.vision != "auto":
                raise CloudRejected(f"the cloud refused the image ({self._scrub(f.detail)}); set [cloud] vision = "
                                    "\"off\" or \"auto\" for a text-only deployment", status=f.status,
                                    attempts=attempts) from None
            if not self.vision_refused:
                log.warning("the cloud refused image content (%s); sending the edge's findings as text from now on "
                            "([cloud] vision = \"auto\")", self._scrub(f.detail))
            self.vision_refused = True
            with_image = False
            if self.nothing_to_ask(image_bytes, prompt, top_k, detections):  # without the image, nothing left to ask
                raise CloudRejected(NOTHING_TO_ASK, status=f.status, attempts=attempts) from None
            return self.request_body(image_bytes, prompt, top_k, detections, with_image)

        text, model, attempts = self._send(body, start, deadline_s, adapt)
        return CloudAnswer(text, model, (self._clock() - start) * 1e3, attempts, "image" if with_image else "text")

    def _admit(self) -> None:
        """Raise when no call may be made: no model configured, or the breaker open."""
        if not self.settings.model:
            raise CloudConfigError("no cloud model configured: set model (k2edge cloud check lists what the server offers)")
        if not self.breaker.allow():
            raise BreakerOpen(f"cloud circuit breaker open (last error: {self.breaker.last_error or 'unknown'}); "
                              f"next probe in {self.breaker.retry_in_s():.0f} s")

    def _send(self, body: dict, start: float, deadline_s: float, adapt) -> tuple[str, str, int]:
        """``body`` sent until answered, with bounded retries within ``deadline_s`` of ``start``; the breaker counts
        one failure per call. ``adapt(failure, body, attempts)`` may answer a failure with a changed request (asked
        again at once), return None (the failure is classified: raised, or retried after a wait), or raise.
        Returns ``(text, model, attempts)``."""
        end = start + deadline_s
        attempts = 0
        while True:
            remaining = end - self._clock()
            if remaining < _MIN_ATTEMPT_S:
                late = CloudTimeout(f"no answer from the cloud within the deadline ({deadline_s:.2f} s, {attempts} attempt(s))",
                                    attempts=attempts)
                if attempts == 0:  # no time was left to try: not the cloud's failure
                    self.breaker.release_probe()
                    raise late
                self._fail(late)
            attempts += 1
            attempt_s, sent = min(self.settings.timeout_s, remaining), self._clock()
            try:
                text, model = self.wire.send(body, attempt_s)
            except _Failure as f:
                changed = adapt(f, body, attempts)
                if changed is not None:
                    body = changed
                    continue
                if f.kind == "timeout" and self._excused(attempt_s):
                    raise CloudTimeout(f"no answer from the cloud within the deadline ({deadline_s:.2f} s); its last "
                                       f"answer took {self.last_answer_s:.2f} s", attempts=attempts)
                wait = self._classify(f, attempts, deadline_s, end)
                log.debug("cloud attempt %d failed (%s); retrying in %.2f s", attempts, self._scrub(f.detail), wait)
                tracing.event("retry", **{"k2edge.cloud.attempt": attempts, "k2edge.cloud.wait_s": wait, "error.type": f.kind})
                self._sleep(wait)
                continue
            self.breaker.record_success()
            self.last_answer_s, self._excused_in_a_row = self._clock() - sent, 0
            log.debug("cloud answered in %.0f ms after %d attempt(s)", (self._clock() - start) * 1e3, attempts)
            tracing.note(**{"k2edge.cloud.attempts": attempts, "gen_ai.response.model": model})
            return text, model, attempts

    def _excused(self, attempt_s: float) -> bool:
        """Whether a timed-out attempt goes uncounted by the breaker: the caller's deadline cut it shorter than the
        cloud's last answer took, so it is no sign of an outage (one client's tight deadlines would otherwise switch
        the cloud off for every request). Never a half-open probe (it must settle the breaker), and at most
        ``breaker_failures`` in a row without an answer between: a cloud that died after its last answer still opens."""
        if attempt_s >= self.settings.timeout_s or self.last_answer_s is None or self.last_answer_s <= attempt_s:
            return False
        if self.breaker.state == "half_open" or self._excused_in_a_row >= self.settings.breaker_failures:
            return False
        self._excused_in_a_row += 1
        return True

    @staticmethod
    def _refuses_images(f: _Failure) -> bool:
        return f.kind == "status" and f.status in (400, 415, 422) and bool(_IMAGE_REFUSAL.search(f.detail))

    def _classify(self, f: _Failure, attempts: int, deadline_s: float, end: float) -> float:
        """Raise for a failure that must not be retried; return the wait before the next attempt."""
        detail = self._scrub(f.detail)
        status = f.status
        if f.kind == "status" and is_quota_error(status, f.body):
            self._fail(CloudQuotaError(f"the cloud account's quota or billing is exhausted ({detail}); retrying will not help",
                                       status=status, attempts=attempts), fatal=True)
        if status in (401, 403):
            self._fail(CloudAuthError(f"the cloud rejected the API key from {self.settings.key_source()} ({detail})",
                                      status=status, attempts=attempts), fatal=True)
        if status == 404:  # no such endpoint or model: every request would meet it, so it opens the breaker
            self._fail(CloudRejected(f"the cloud has no such endpoint or model ({detail}): check [cloud] base_url (an "
                                     f"OpenAI-compatible one usually ends in /v1) and model {self.settings.model!r}",
                                     status=status, attempts=attempts), fatal=True)
        if f.kind == "status" and status not in RETRYABLE_STATUS:
            self.breaker.record_success()  # the server is up; it refuses this request
            raise CloudRejected(f"the cloud refused the request ({detail})", status=status, attempts=attempts)
        if f.kind == "protocol":
            self._fail(CloudUnavailable(f"the cloud's answer was malformed ({detail})", attempts=attempts))
        error_cls = CloudRateLimited if status == 429 else CloudTimeout if f.kind == "timeout" else CloudUnavailable
        if attempts > self.settings.max_retries:
            self._fail(error_cls(f"the cloud failed after {attempts} attempt(s) ({detail})", status=status, attempts=attempts))
        retry_after = parse_retry_after(f.headers)
        wait = retry_after if retry_after is not None else backoff_s(attempts)
        if self._clock() + wait + _MIN_ATTEMPT_S >= end:
            why = f"Retry-After {retry_after:g} s" if retry_after is not None else f"backoff {wait:.2f} s"
            self._fail(error_cls(f"the cloud failed ({detail}) and {why} is beyond the deadline ({deadline_s:.2f} s)",
                                 status=status, attempts=attempts))
        return wait

    def _fail(self, err: CloudError, fatal: bool = False):
        self.breaker.record_failure(str(err), fatal=fatal)
        tracing.note(**{"error.type": type(err).__name__, "k2edge.cloud.attempts": err.attempts or 0})
        raise err

    def _scrub(self, text: str) -> str:
        """``text`` without the key (and key-like tokens), then cut to :data:`SHOWN_CHARS`: in that order, so that no
        part of a key survives a cut."""
        text = scrub(text, self._secrets)
        return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…"

    def ask_body(self, images: Sequence[PreparedImage], text: str, json_mode: bool = False) -> dict:
        """The exact JSON body :meth:`ask` sends: every image as a part of the user message (OpenAI ``image_url``
        data URLs, or Anthropic base64 ``image`` sources), then the text; ``response_format`` JSON when asked."""
        if self.settings.mode == "openai":
            parts = [{"type": "image_url", "image_url": {"url": im.data_url}} for im in images]
        else:
            parts = [{"type": "image", "source": {"type": "base64", "media_type": im.mime, "data": im.base64}}
                     for im in images]
        body = self.wire.body(None, text)
        body["messages"][-1]["content"] = parts + body["messages"][-1]["content"]
        if json_mode and self.settings.mode == "openai" and not self.json_mode_refused:
            body["response_format"] = {"type": "json_object"}
        return body

    def ask(self, images: Sequence[PreparedImage], text: str, deadline_s: float, json_mode: bool = False) -> CloudAnswer:
        """Ask K2 about several images (already prepared: downscaled, typed) with ``text``; bounded retries within
        ``deadline_s``, the breaker counting one failure per call, as :meth:`complete`.

        ``json_mode`` asks for ``response_format = {"type": "json_object"}``; a server that refuses the field
        (400 naming it) is asked again at once without it, and not asked with it again. Images follow ``vision``
        as in :meth:`complete`: none with ``off``; under ``auto`` a refusal of image content sends the text alone.

        Raises:
            The errors of :meth:`complete`.
        """
        start = self._clock()
        self._admit()
        tracing.note(**{"k2edge.cloud.breaker": str(self.breaker.state)})
        images = list(images) if self.sends_images() else []

        def adapt(f: _Failure, body: dict, attempts: int) -> dict | None:
            nonlocal images
            if "response_format" in body and f.kind == "status" and f.status in (400, 422) \
                    and re.search(r"response_format|json", f.detail, re.IGNORECASE):
                log.warning("the cloud refused response_format json_object (%s); asking for JSON in the prompt only",
                            self._scrub(f.detail))
                self.json_mode_refused = True
                return {k: v for k, v in body.items() if k != "response_format"}
            if images and self._refuses_images(f) and self.settings.vision == "auto":
                log.warning("the cloud refused image content (%s); sending the text only from now on "
                            "([cloud] vision = \"auto\")", self._scrub(f.detail))
                self.vision_refused, images = True, []
                return self.ask_body(images, text, json_mode)
            return None

        answer, model, attempts = self._send(self.ask_body(images, text, json_mode), start, deadline_s, adapt)
        return CloudAnswer(answer, model, (self._clock() - start) * 1e3, attempts, "image" if images else "text")

    def list_models(self, timeout_s: float | None = None) -> list[str]:
        """Model ids from ``GET /v1/models`` (no breaker, no retries: a check, not a request).

        Raises:
            CloudError: unreachable, rejected key, or a malformed answer.
        """
        try:
            return self.wire.models(timeout_s or self.settings.timeout_s)
        except _Failure as f:
            detail = self._scrub(f.detail)
            if f.status in (401, 403):
                raise CloudAuthError(f"the cloud rejected the API key from {self.settings.key_source()} ({detail})", status=f.status) from None
            if f.kind == "timeout":
                raise CloudTimeout(f"GET /v1/models: {detail}") from None
            raise CloudUnavailable(f"GET /v1/models: {detail}", status=f.status) from None

    def close(self) -> None:
        with self._wire_lock:
            if self._wire is not None:
                self._wire.client.close()
                self._wire = None
