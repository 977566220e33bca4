"""A local stand-in for the K2 server: a real HTTP server on 127.0.0.1 (port 0) in a thread.

It speaks ``GET /v1/models``, ``POST /v1/chat/completions`` (OpenAI-compatible) and, under
``/anthropic``, ``GET /v1/models`` and ``POST /v1/messages``; it records every request (method,
path, headers, JSON body) and answers each chat request with the next scripted behaviour::

    with K2StandIn() as k2:
        k2.script(status(429, retry_after="0.05"), status(500), answer("a cat"))
        ... point a client at k2.url (OpenAI) or k2.anthropic_url ...
        assert k2.chat_requests[-1].body["model"] == "kimi-k2.5"

Behaviours: :func:`answer` (optionally after a delay), :func:`delay`, :func:`status` (any code,
Retry-After, body), :func:`hang` (hold the connection longer than the client waits, then close
it unanswered). When the script is empty the fallback behaviour answers (``k2.fallback = ...``
to make, e.g., a dead cloud that always returns 500). Reused by the daemon's MQTT end-to-end tests.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["K2StandIn", "Recorded", "answer", "delay", "status", "hang", "verdict", "DEFAULT_MODELS"]

DEFAULT_MODELS = ("kimi-k2.5", "moonshot-v1-8k-vision-preview")


@dataclass(frozen=True)
class Behaviour:
    kind: str  # answer | status | hang | garbage
    text: str = "stand-in answer"
    delay_s: float = 0.0
    code: int = 200
    headers: dict = field(default_factory=dict)
    body: object = None


def answer(text: str = "stand-in answer", delay_s: float = 0.0) -> Behaviour:
    """Answer with ``text`` (after ``delay_s``)."""
    return Behaviour("answer", text=text, delay_s=delay_s)


def delay(seconds: float, text: str = "stand-in answer") -> Behaviour:
    """Answer, but only after ``seconds``."""
    return Behaviour("answer", text=text, delay_s=seconds)


def status(code: int, retry_after: str | float | None = None, body: object = None, headers: dict | None = None) -> Behaviour:
    """Answer ``code`` with a JSON error body (``body``, or a generic one) and optional Retry-After."""
    h = dict(headers or {})
    if retry_after is not None:
        h["Retry-After"] = str(retry_after)
    if body is None:
        body = {"error": {"message": f"stand-in status {code}", "type": "server_error" if code >= 500 else "rate_limit_reached_error"}}
    return Behaviour("status", code=code, headers=h, body=body)


def verdict(kind: str = "confirmed", label: str | None = "person", description: str = "a person walking",
            delay_s: float = 0.0) -> Behaviour:
    """Answer with a stream escalation's verdict JSON (``answer("not json")`` makes a malformed one)."""
    return Behaviour("answer", text=json.dumps({"verdict": kind, "label": label, "description": description}),
                     delay_s=delay_s)


def garbage() -> Behaviour:
    """Answer 200 with a body that is not JSON (a proxy's error page, a broken server)."""
    return Behaviour("garbage")


def hang(seconds: float = 5.0) -> Behaviour:
    """Read the request, send nothing for ``seconds`` (or until the stand-in stops), then close."""
    return Behaviour("hang", delay_s=seconds)


@dataclass(frozen=True)
class Recorded:
    """One request as received (header names lower-cased)."""

    method: str
    path: str
    headers: dict
    body: object
    t: float


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a hanging handler must not hold up stop()


class K2StandIn:
    """The stand-in. ``start()``/``stop()`` or use it as a context manager.

    Args:
        models: ids listed by ``GET /v1/models``.
        api_key: when set, requests without ``Authorization: Bearer <key>`` (or ``x-api-key``) get 401.
        refuse_images: answer a chat request carrying image content with the 400 a vLLM serving a
            text-only model gives (``"<model> is not a multimodal model"``), as a self-hosted
            text-only Kimi K2 does. Settable while running.
        refuse_json_mode: answer a chat request asking ``response_format`` with the 400 a server without JSON mode
            gives. Settable while running.
        garbled_models: answer ``GET /v1/models`` with 200 and a body that is not JSON. Settable while running.
    """

    def __init__(self, models=DEFAULT_MODELS, api_key: str | None = None, refuse_images: bool = False,
                 refuse_json_mode: bool = False) -> None:
        self.models = tuple(models)
        self.api_key = api_key
        self.refuse_images = refuse_images
        self.refuse_json_mode = refuse_json_mode
        self.garbled_models = False
        self.fallback: Behaviour = answer()
        self._script: deque[Behaviour] = deque()
        self._lock = threading.Lock()
        self._requests: list[Recorded] = []
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # control -----------------------------------------------------------------------------------
    def start(self) -> "K2StandIn":
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="k2-stand-in", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "K2StandIn":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the stand-in first"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL (``.../v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def anthropic_url(self) -> str:
        """The Anthropic-compatible base URL (``.../anthropic``)."""
        return f"http://127.0.0.1:{self.port}/anthropic"

    def script(self, *behaviours: Behaviour) -> "K2StandIn":
        """Queue behaviours for the next chat requests, in order."""
        with self._lock:
            self._script.extend(behaviours)
        return self

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._requests)

    @property
    def chat_requests(self) -> list[Recorded]:
        """Chat-completion and messages requests only."""
        return [r for r in self.requests if r.path.endswith(("/chat/completions", "/messages"))]

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()
            self._script.clear()

    # serving -----------------------------------------------------------------------------------
    def _next(self) -> Behaviour:
        with self._lock:
            return self._script.popleft() if self._script else self.fallback

    def _record(self, r: Recorded) -> None:
        with self._lock:
            self._requests.append(r)

    def _handler_class(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # no 40 ms delayed-ACK stalls between header and body writes

            def handle(self) -> None:
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up first (its deadline passed during a delay): nothing left to answer

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    return json.loads(raw) if raw else None
                except ValueError:
                    return raw.decode("utf-8", "replace")

            def _send(self, code: int, payload: object, headers: dict | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _send_raw(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                if standin.api_key is None:
                    return True
                auth = self.headers.get("Authorization", "")
                return auth == f"Bearer {standin.api_key}" or self.headers.get("x-api-key") == standin.api_key

            def _route(self, method: str) -> None:
                body = self._body() if method == "POST" else None
                standin._record(Recorded(method, self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic()))
                anthropic = self.path.startswith("/anthropic/")
                path = self.path[len("/anthropic"):] if anthropic else self.path
                if not self._authorised():
                    self._send(401, {"error": {"message": "Invalid Authentication", "type": "invalid_authentication_error"}})
                    return
                if method == "GET" and path == "/v1/models":
                    if standin.garbled_models:
                        self._send_raw(200, b"\xff\xfe not json")
                        return
                    data = [{"id": m, "object": "model", "created": 0, "owned_by": "stand-in"} for m in standin.models]
                    self._send(200, {"object": "list", "data": data})
                    return
                if method == "POST" and path in ("/v1/chat/completions", "/v1/messages"):
                    self._chat(body if isinstance(body, dict) else {}, anthropic)
                    return
                self._send(404, {"error": {"message": f"no route {method} {self.path}", "type": "not_found"}})

            def _chat(self, body: dict, anthropic: bool) -> None:
                if standin.refuse_images and _has_image(body):
                    self._send(400, {"object": "error", "message": f"{body.get('model', 'model')} is not a multimodal model None",
                                     "type": "BadRequestError", "param": None, "code": 400})
                    return
                if standin.refuse_json_mode and "response_format" in body:
                    self._send(400, {"error": {"message": "response_format json_object is not supported by this model",
                                               "type": "invalid_request_error"}})
                    return
                b = standin._next()
                if b.kind == "hang":
                    standin._stopping.wait(b.delay_s)
                    self.close_connection = True
                    return
                if b.delay_s:
                    standin._stopping.wait(b.delay_s)
                if b.kind == "status":
                    self._send(b.code, b.body, b.headers)
                    return
                if b.kind == "garbage":
                    self._send_raw(200, b"\xff\xfe not json")
                    return
                model = body.get("model", "unknown")
                if anthropic:
                    self._send(200, {"id": "msg_standin", "type": "message", "role": "assistant", "model": model,
                                     "content": [{"type": "text", "text": b.text}], "stop_reason": "end_turn",
                                     "usage": {"input_tokens": 1, "output_tokens": 1}})
                else:
                    self._send(200, {"id": "chatcmpl-standin", "object": "chat.completion", "created": int(time.time()),
                                     "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                                                                  "message": {"role": "assistant", "content": b.text}}],
                                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                self._route("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._route("POST")

        return Handler


def _has_image(body: dict) -> bool:
    """Whether a chat body carries image content (OpenAI ``image_url`` or Anthropic ``image`` parts)."""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in ("image_url", "image") for p in content):
            return True
    return False
