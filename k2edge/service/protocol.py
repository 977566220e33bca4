"""Request parsing and response building for the MQTT contract (pure: no network, no engine).

A request is JSON::

    {"id": "r1", "image": "<base64 JPEG/PNG>" | "tensor": {"dtype": "float32", "shape": [...], "data": "<base64>"},
     "prompt": "...", "top_k": 5, "deadline_ms": 500, "allow_cloud": true, "deferrable": false}

or a raw JPEG/PNG payload with MQTT 5 content type ``image/jpeg``/``image/png`` and the same
fields as user properties. Every failure is a :class:`RequestError` with a contract error code.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field

import numpy as np

from .topics import valid_level

BAD_REQUEST = "bad_request"
PAYLOAD_TOO_LARGE = "payload_too_large"
UNKNOWN_MODEL = "unknown_model"
BUSY = "busy"
DEADLINE_EXCEEDED = "deadline_exceeded"
CLOUD_UNAVAILABLE = "cloud_unavailable"
INTERNAL = "internal"
ERROR_CODES = (BAD_REQUEST, PAYLOAD_TOO_LARGE, UNKNOWN_MODEL, BUSY, DEADLINE_EXCEEDED, CLOUD_UNAVAILABLE, INTERNAL)

IMAGE_TYPES = ("image/jpeg", "image/png")
_DTYPES = {"float32", "float16", "uint8", "int8", "int32", "int64", "float64"}
_FIELDS = {"id", "image", "tensor", "prompt", "top_k", "deadline_ms", "allow_cloud", "deferrable"}


class RequestError(Exception):
    """A request that cannot be served; ``code`` is one of the contract's error codes."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass
class Request:
    """A parsed request. ``image`` holds encoded bytes, ``tensor`` a numpy array (one of them)."""

    id: str | None
    model: str
    image: bytes | None = None
    tensor: np.ndarray | None = None
    prompt: str | None = None
    top_k: int | None = None
    deadline_ms: float | None = None
    allow_cloud: bool | None = None  # None: the model's default
    deferrable: bool = False
    received: float = 0.0  # monotonic seconds
    extra: dict = field(default_factory=dict)

    @property
    def deadline(self) -> float | None:
        """Monotonic time after which no answer may be sent."""
        return None if self.deadline_ms is None else self.received + self.deadline_ms / 1e3


def parse_request(payload: bytes, model: str, content_type: str | None, user_properties: dict[str, str],
                  received: float) -> Request:
    """Parse one request payload.

    Raises:
        RequestError: ``bad_request`` naming the field and what is wrong.
    """
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype in IMAGE_TYPES:
        fields: dict = dict(user_properties)
        for key in ("top_k", "deadline_ms"):
            if key in fields:
                try:
                    fields[key] = float(fields[key]) if key == "deadline_ms" else int(fields[key])
                except ValueError:
                    raise RequestError(BAD_REQUEST, f"user property {key} must be a number, got {fields[key]!r}",
                                       fields.get("id")) from None
        for key in ("allow_cloud", "deferrable"):
            if key in fields:
                if fields[key].lower() not in ("true", "false"):
                    raise RequestError(BAD_REQUEST, f"user property {key} must be true or false, got {fields[key]!r}", fields.get("id"))
                fields[key] = fields[key].lower() == "true"
        unknown = set(fields) - _FIELDS
        if unknown:
            raise RequestError(BAD_REQUEST, f"unknown user properties {sorted(unknown)}", fields.get("id"))
        fields["image"] = payload
        return _build(fields, model, received, image_is_raw=True)
    if ctype and ctype not in ("application/json", "text/json"):
        raise RequestError(BAD_REQUEST, f"content type {ctype!r} is not served; send JSON or image/jpeg or image/png")
    try:
        fields = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(BAD_REQUEST, f"payload is not JSON: {exc}") from None
    except RecursionError:
        raise RequestError(BAD_REQUEST, "payload JSON is nested too deeply") from None
    if not isinstance(fields, dict):
        raise RequestError(BAD_REQUEST, "payload must be a JSON object")
    unknown = set(fields) - _FIELDS
    if unknown:
        raise RequestError(BAD_REQUEST, f"unknown fields {sorted(unknown)}; known: {sorted(_FIELDS)}", _id_or_none(fields))
    return _build(fields, model, received, image_is_raw=False)


def _id_or_none(fields: dict) -> str | None:
    rid = fields.get("id")
    return rid if isinstance(rid, str) and valid_level(rid) else None


def _build(fields: dict, model: str, received: float, image_is_raw: bool) -> Request:
    rid = fields.get("id")
    if rid is not None:
        if not isinstance(rid, str):
            raise RequestError(BAD_REQUEST, f"id must be a string, got {type(rid).__name__}")
        if not valid_level(rid):
            raise RequestError(BAD_REQUEST, f"id {rid!r} cannot be a topic level: no '+', '#', '/' or NUL, 1..256 bytes")
    req = Request(id=rid, model=model, received=received)

    def bad(msg):
        return RequestError(BAD_REQUEST, msg, rid)

    if ("image" in fields) == ("tensor" in fields):
        raise bad("give exactly one of 'image' (base64 JPEG/PNG) or 'tensor'")
    if "image" in fields:
        if image_is_raw:
            req.image = fields["image"]
        else:
            if not isinstance(fields["image"], str):
                raise bad("image must be a base64 string")
            req.image = _b64(fields["image"], "image", rid)
        if not req.image:
            raise bad("image is empty")
    else:
        req.tensor = _tensor(fields["tensor"], rid)
    if "prompt" in fields and fields["prompt"] is not None:
        if not isinstance(fields["prompt"], str):
            raise bad("prompt must be a string")
        req.prompt = fields["prompt"]
    if "top_k" in fields:
        k = fields["top_k"]
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 1000:
            raise bad(f"top_k must be an integer in [1, 1000], got {k!r}")
        req.top_k = k
    if "deadline_ms" in fields:
        d = fields["deadline_ms"]
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 86_400_000:
            raise bad(f"deadline_ms must be a positive number of milliseconds, got {d!r}")
        req.deadline_ms = float(d)
    for key in ("allow_cloud", "deferrable"):
        if key in fields:
            if not isinstance(fields[key], bool):
                raise bad(f"{key} must be true or false, got {fields[key]!r}")
            setattr(req, key, fields[key])
    return req


def _b64(text: str, what: str, rid) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(BAD_REQUEST, f"{what} is not valid base64: {exc}", rid) from None


def _tensor(spec, rid) -> np.ndarray:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data"}:
        raise RequestError(BAD_REQUEST, "tensor must be an object with exactly dtype, shape and data", rid)
    dtype, shape, data = spec["dtype"], spec["shape"], spec["data"]
    if dtype not in _DTYPES:
        raise RequestError(BAD_REQUEST, f"tensor.dtype {dtype!r} is not one of {sorted(_DTYPES)}", rid)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise RequestError(BAD_REQUEST, f"tensor.shape must be a list of positive integers, got {shape!r}", rid)
    if not isinstance(data, str):
        raise RequestError(BAD_REQUEST, "tensor.data must be a base64 string", rid)
    raw = _b64(data, "tensor.data", rid)
    expected = math.prod(shape) * np.dtype(dtype).itemsize
    if len(raw) != expected:
        raise RequestError(BAD_REQUEST, f"tensor.data holds {len(raw)} bytes; {dtype} {tuple(shape)} needs {expected}", rid)
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise RequestError(BAD_REQUEST, "tensor.data holds NaN or infinite values", rid)
    return arr


def error_response(code: str, message: str, request_id: str | None, model: str | None, device: str) -> dict:
    return {"id": request_id, "status": "error", "model": model, "device": device,
            "error": {"code": code, "message": message}}


def ok_response(req: Request, device: str, profile: str, top_k: list[dict], latency: dict, thermal_state: str,
                confidence: float | None = None, source: str = "edge", text: str | None = None,
                escalation_reason: str | None = None, degraded: bool = False, deferred: bool = False) -> dict:
    body = {
        "id": req.id,
        "status": "ok",
        "source": source,
        "model": req.model,
        "profile": profile,
        "device": device,
        "top_k": top_k,
        "confidence": confidence if confidence is not None else (top_k[0]["score"] if top_k else None),
        "latency_ms": latency,
        "thermal_state": thermal_state,
        "degraded": degraded,
    }
    if text is not None:
        body["text"] = text
    if escalation_reason:
        body["escalation_reason"] = escalation_reason
    if deferred:
        body["deferred"] = True
    return body


def encode(response: dict) -> bytes:
    """Strict JSON (no NaN/Infinity, which JSON does not have: such numbers become null)."""
    try:
        return json.dumps(response, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(response), separators=(",", ":"), allow_nan=False).encode()


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
