"""Request parsing and answer building for the MQTT contract (pure: no network, no engine).

A request is JSON::

    {"id": "r1", "attempt": 0,
     "image": "<base64 JPEG/PNG>" | "tensor": {"dtype": "float32", "shape": [...], "data": "<base64>"},
     "prompt": "...", "top_k": 5, "deadline_ms": 500, "allow_cloud": true, "deferrable": false}

or a raw JPEG/PNG payload with MQTT 5 content type ``image/jpeg``/``image/png`` and the same
fields as user properties. Parsing is one typed msgspec decode (JSON, base64 and bounds in C);
every failure is a :class:`RequestError` with a contract error code and a message of at most
about 1 kB.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated

import msgspec
import numpy as np

from ..deadline import Deadline
from .topics import valid_level

BAD_REQUEST = "bad_request"
PAYLOAD_TOO_LARGE = "payload_too_large"
UNKNOWN_MODEL = "unknown_model"
BUSY = "busy"
DEADLINE_EXCEEDED = "deadline_exceeded"
CLOUD_UNAVAILABLE = "cloud_unavailable"
INTERNAL = "internal"
ERROR_CODES = (BAD_REQUEST, PAYLOAD_TOO_LARGE, UNKNOWN_MODEL, BUSY, DEADLINE_EXCEEDED, CLOUD_UNAVAILABLE, INTERNAL)
RETRYABLE = (BUSY, DEADLINE_EXCEEDED, CLOUD_UNAVAILABLE)  # a retry with attempt + 1 may get another answer

IMAGE_TYPES = ("image/jpeg", "image/png")
MAX_MESSAGE_CHARS = 1000  # error messages are capped: an error must not be a megabyte of echoed input
MAX_ATTEMPT = 1000
MAX_DEADLINE_MS = 3_600_000
MAX_PROMPT_CHARS = 16_384  # about 4,000 tokens: a question about an image; a longer text is not a request for this daemon
_DTYPES = ("float32", "float16", "uint8", "int8", "int32", "int64", "float64")

_Dim = Annotated[int, msgspec.Meta(ge=1, le=2**31)]


class _Tensor(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: Annotated[list[_Dim], msgspec.Meta(min_length=1, max_length=8)]
    data: bytes  # base64 in JSON, decoded by msgspec


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    id: str | None = None
    attempt: Annotated[int, msgspec.Meta(ge=0, le=MAX_ATTEMPT)] = 0
    image: bytes | None = None
    tensor: _Tensor | None = None
    prompt: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None
    deadline_ms: Annotated[float, msgspec.Meta(ge=1, le=MAX_DEADLINE_MS)] | None = None
    allow_cloud: bool | None = None
    deferrable: bool = False


FIELDS = tuple(_Body.__struct_fields__)
_JSON = msgspec.json.Decoder(_Body)
_ANY_JSON = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()
_PEEK_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
_PEEK_ATTEMPT = re.compile(rb'"attempt"\s*:\s*(\d{1,4})\b')


class RequestError(Exception):
    """A request that cannot be served; ``code`` is one of the contract's error codes."""

    def __init__(self, code: str, message: str, request_id: str | None = None, attempt: int = 0):
        message = cap(message)
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.attempt = attempt


@dataclass(slots=True)
class Request:
    """A parsed, validated request. ``image`` holds encoded bytes, ``tensor`` a numpy array (one of them)."""

    id: str | None
    model: str
    attempt: int = 0
    image: bytes | None = None
    tensor: np.ndarray | None = None
    prompt: str | None = None
    top_k: int | None = None
    deadline_ms: float | None = None
    allow_cloud: bool | None = None  # None: the model's default
    deferrable: bool = False
    deadline: Deadline = Deadline()


def cap(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to about ``limit`` characters."""
    return message if len(message) <= limit else message[: limit - 15] + " ... (cut)"


def parse_request(payload: bytes, model: str, content_type: str | None, user_properties: dict[str, str],
                  received: float, expiry_s: int | None = None, default_deadline_ms: float | None = None) -> Request:
    """Parse and validate one request.

    Args:
        payload: the MQTT payload.
        model: the model named by the topic.
        content_type / user_properties: the MQTT 5 properties.
        received: ``clock()`` time of arrival.
        expiry_s: the Message Expiry Interval left on arrival, if the message had one.
        default_deadline_ms: the daemon's deadline for requests that name none.

    Raises:
        RequestError: ``bad_request`` naming the field and what is wrong (with the request's id and
            attempt where they could be read, so the error is answered under its key).
    """
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype in IMAGE_TYPES:
        body = _from_user_properties(user_properties)
        body.image = payload
    elif ctype and ctype not in ("application/json", "text/json"):
        rid, attempt = peek_key(payload, user_properties)
        raise RequestError(BAD_REQUEST, f"content type {ctype!r} is not served; send JSON or image/jpeg or image/png", rid, attempt)
    else:
        try:
            body = _JSON.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            rid, attempt = peek_key(payload)
            raise RequestError(BAD_REQUEST, _describe(exc), rid, attempt) from None
    return _finish(body, model, received, expiry_s, default_deadline_ms)


_INTEGER = re.compile(r"-?[0-9]+\Z")
_DECIMAL = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?\Z")


def _from_user_properties(props: dict[str, str]) -> _Body:
    unknown = sorted(set(props) - set(FIELDS) - {"image", "tensor"})
    rid, attempt = peek_key(b"", props)
    if unknown:
        raise RequestError(BAD_REQUEST, f"unknown user properties {unknown}; known: {sorted(set(FIELDS) - {'image', 'tensor'})}",
                           rid, attempt)
    fields: dict = {}
    for key, value in props.items():
        if key in ("image", "tensor"):
            raise RequestError(BAD_REQUEST, f"user property {key} is not allowed: the payload is the image", rid, attempt)
        if key in ("top_k", "attempt", "deadline_ms"):
            # ASCII digits only: int() and float() also take '١', '1_0', ' 1\n' and 'nan'
            if not (_DECIMAL if key == "deadline_ms" else _INTEGER).match(value) or len(value) > 40:
                raise RequestError(BAD_REQUEST, f"user property {key} must be a number, got {value[:40]!r}", rid, attempt)
            fields[key] = float(value) if key == "deadline_ms" else int(value)
        elif key in ("allow_cloud", "deferrable"):
            if value.lower() not in ("true", "false"):
                raise RequestError(BAD_REQUEST, f"user property {key} must be true or false, got {value[:40]!r}", rid, attempt)
            fields[key] = value.lower() == "true"
        else:
            fields[key] = value
    try:
        return msgspec.convert(fields, _Body)
    except msgspec.ValidationError as exc:
        raise RequestError(BAD_REQUEST, "user property " + _describe(exc), rid, attempt) from None


def _finish(body: _Body, model: str, received: float, expiry_s: int | None, default_deadline_ms: float | None) -> Request:
    rid = body.id
    if rid is not None and not valid_level(rid):
        raise RequestError(BAD_REQUEST, f"id {rid[:80]!r} cannot be a topic level: no '+', '#', '/' or NUL, 1..256 bytes")

    def bad(message: str) -> RequestError:
        return RequestError(BAD_REQUEST, message, rid, body.attempt)

    if (body.image is None) == (body.tensor is None):
        raise bad("give exactly one of 'image' (base64 JPEG/PNG) or 'tensor'")
    if body.image is not None and not body.image:
        raise bad("image is empty")
    tensor = _tensor(body.tensor, bad) if body.tensor is not None else None
    deadline_ms = body.deadline_ms if body.deadline_ms is not None else default_deadline_ms
    return Request(id=rid, model=model, attempt=body.attempt, image=body.image, tensor=tensor, prompt=body.prompt,
                   top_k=body.top_k, deadline_ms=deadline_ms, allow_cloud=body.allow_cloud, deferrable=body.deferrable,
                   deadline=Deadline.of(received, deadline_ms, expiry_s))


def _tensor(spec: _Tensor, bad) -> np.ndarray:
    if spec.dtype not in _DTYPES:
        raise bad(f"tensor.dtype {spec.dtype[:40]!r} is not one of {sorted(_DTYPES)}")
    itemsize = np.dtype(spec.dtype).itemsize
    expected = math.prod(spec.shape) * itemsize
    if len(spec.data) != expected:
        raise bad(f"tensor.data holds {len(spec.data)} bytes; {spec.dtype} {tuple(spec.shape)} needs {expected}")
    # NaN and infinity are refused where the tensor is staged (runtime.stage), off the network thread
    return np.frombuffer(spec.data, dtype=spec.dtype).reshape(spec.shape)


def peek_key(payload: bytes, user_properties: dict[str, str] | None = None) -> tuple[str | None, int]:
    """The id and attempt of a request that failed to parse, where they can still be read.

    Used to answer an error under the request's key (so its redelivery is recognised). Reads the
    user properties, else a lenient JSON decode, else a scan of the raw bytes.
    """
    props = user_properties or {}
    if "id" in props:
        rid = props["id"] if valid_level(props["id"]) else None
        attempt = props.get("attempt", "0")
        return rid, int(attempt) if attempt.isascii() and attempt.isdigit() and len(attempt) <= 4 and int(attempt) <= MAX_ATTEMPT else 0
    try:
        fields = _ANY_JSON.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        fields = None
    if isinstance(fields, dict):
        rid = fields.get("id")
        attempt = fields.get("attempt", 0)
        rid = rid if isinstance(rid, str) and valid_level(rid) else None
        ok = isinstance(attempt, int) and not isinstance(attempt, bool) and 0 <= attempt <= MAX_ATTEMPT
        return rid, attempt if ok else 0
    m = _PEEK_ID.search(payload)
    rid = m.group(1).decode(errors="replace") if m else None
    a = _PEEK_ATTEMPT.search(payload)
    attempt = int(a.group(1)) if a and int(a.group(1)) <= MAX_ATTEMPT else 0
    return (rid if rid is not None and valid_level(rid) else None), attempt


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bytes": "a base64 string", "str": "a string", "bool": "true or false",
               "object": "a JSON object", "array": "an array", "null": "null"}
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.S)


def _describe(exc: BaseException) -> str:
    """msgspec's error in the contract's words: the field path first, then what is wrong."""
    if isinstance(exc, RecursionError):
        return "payload JSON is nested too deeply"
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):  # (a ValidationError is a DecodeError too)
        return f"payload is not valid JSON: {text}"
    m = _AT.match(text)
    what, path = m.group("what"), m.group("path")
    what = what.replace(" | null", "")
    for name, words in _TYPE_WORDS.items():
        what = what.replace(f"`{name}`", words)
    what = what.replace("`", "'")
    if what.startswith("Object contains unknown field"):
        return f"unknown field {what.rsplit(' ', 1)[-1]}; known: {list(FIELDS)}"
    if what.startswith("Object missing required field"):
        return f"{path + ': ' if path else ''}missing field {what.rsplit(' ', 1)[-1]}"
    if "out of range" in what and what.startswith(("Integer", "Number")):
        what = f"{what} (a number too large to parse)"
    if not path:
        return f"payload: {what[:1].lower() + what[1:]}"
    return f"{path}: {what[:1].lower() + what[1:]}"


# answers ----------------------------------------------------------------------------------------
def error_body(code: str, message: str, request_id: str | None, attempt: int, model: str | None, device: str,
               model_version: str | None = None) -> dict:
    """An error answer; a retryable one says how to retry (the same id and attempt is a redelivery)."""
    message = cap(message)
    if code in RETRYABLE and request_id is not None:
        message += f'; to retry, send it again with "attempt": {attempt + 1}'
    return {"id": request_id, "attempt": attempt, "status": "error", "model": model, "model_version": model_version,
            "device": device, "error": {"code": code, "message": message}}


def ok_body(req: Request, device: str, profile: str, result: dict, latency: dict, thermal_state: str,
            confidence: float | None = None, source: str = "edge", text: str | None = None,
            escalation_reason: str | None = None, degraded: bool = False, deferred: bool = False,
            cloud_input: str | None = None, model_version: str | None = None) -> dict:
    """An ``ok`` answer. ``result`` is the task's fragment (``top_k``, ``detections`` or ``outputs``;
    empty when the cloud answered without local work); ``model_version`` is the version of the model
    that ran (None for a model loaded from a bare ONNX file)."""
    if confidence is None:
        scores = [r["score"] for r in result.get("top_k") or result.get("detections") or ()]
        confidence = max(scores) if scores else None
    body = {
        "id": req.id,
        "attempt": req.attempt,
        "status": "ok",
        "source": source,
        "model": req.model,
        "model_version": model_version,
        "profile": profile,
        "device": device,
        **result,
        "confidence": confidence,
        "latency_ms": latency,
        "thermal_state": thermal_state,
        "degraded": degraded,
    }
    if text is not None:
        body["text"] = text
    if cloud_input is not None:
        body["cloud_input"] = cloud_input
    if escalation_reason:
        body["escalation_reason"] = escalation_reason
    if deferred:
        body["deferred"] = True
    return body


def encode(body: dict) -> bytes:
    """Strict JSON (JSON has no NaN or Infinity: such numbers become null)."""
    return _ENCODER.encode(body)
