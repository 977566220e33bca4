"""The local web app (``[http]``): a page listing every stream with its newest processed frame drawn
(boxes, track ids, zones, lines) and the recent events with their snapshots; the same as JSON and
JPEG for scripts; ``/metrics`` beside them.

=====================================  ==========================================================
``GET /``                              the page (no build step, no external files)
``GET /api/streams``                   the status' ``streams`` object
``GET /api/events?stream=&limit=``     the newest events (stored payloads), newest first (limit 1..200, default 50)
``GET /streams/{name}/frame.jpg``      the newest processed frame, drawn (``X-Frame-Index``: its index)
``GET /events/{event_id}/snapshot.jpg``  the event's snapshot
``GET /events/{event_id}/clip.mp4``    the event's clip (404 while there is none)
``GET /metrics``                       Prometheus (when ``[metrics]`` is on)
=====================================  ==========================================================

``HEAD`` answers as ``GET`` without the body; POST, PUT, DELETE, PATCH and OPTIONS are 405 (a method HTTP does not
define, 501). Every error is JSON ``{"error"}``.

Frames are drawn and encoded only while someone watches: a frame request marks the stream watched
for a few seconds (:meth:`Stream.watch <k2edge.streams.stream.Stream.watch>`), the model's thread then
keeps a reference to the newest processed frame, and the request's own thread draws it, once per
frame whatever the number of viewers. Bound beyond loopback, the app needs a bearer token
(``Authorization: Bearer``, or ``?token=`` once, which sets a cookie) or an HTTP Basic password.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import io
import json
import logging
import threading
from http import HTTPStatus
from urllib.parse import parse_qs, quote, urlsplit

from ..errors import K2EdgeError
from .http_server import BoundedHandler, BoundedHTTPServer
from .live_page import PAGE

log = logging.getLogger(__name__)

_COOKIE = "k2edge_token"
EVENTS_LIMIT = 200


class LiveViewError(K2EdgeError):
    """The web app cannot start (its address cannot be bound)."""


class LiveView:
    """The web app over the daemon's streams (see the module docstring).

    Args:
        streams: the :class:`~k2edge.service.stream_path.StreamPath`, or None (no streams: empty lists).
        metrics: the Prometheus exporter, or None.
        token: the bearer token, or None.
        password: the HTTP Basic password, or None.
        disabled: the configured streams with ``enabled = false`` (named as such, not as unknown).
    """

    def __init__(self, streams, metrics=None, token: str | None = None, password: str | None = None,
                 disabled: tuple[str, ...] = ()) -> None:
        if token == "" or password == "":
            raise ValueError("an empty token or password would let an empty one in")
        self.streams, self.metrics, self.disabled = streams, metrics, frozenset(disabled)
        self.token, self.password = token, password
        self._server: BoundedHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._host: str | None = None
        self._frames: dict[str, tuple[int, bytes]] = {}  # stream -> (frame index, JPEG): drawn once per frame
        self._lock = threading.Lock()

    def bind(self, host: str, port: int) -> None:
        """Take the address now, to serve it later (:meth:`start`): the daemon binds before its engines build, so a
        port in use is told at once rather than after minutes of building.

        Raises:
            LiveViewError: the address cannot be bound.
        """
        view = self

        class Handler(_Handler):
            app = view

        try:
            self._server = BoundedHTTPServer((host, port), Handler)
        except OSError as exc:
            raise LiveViewError(f"http: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        self._host = host

    def start(self, host: str | None = None, port: int | None = None) -> tuple[str, int]:
        """Serve on a daemon thread; (host, port) bound (the port chosen when ``port`` is 0). Binds first unless
        :meth:`bind` did.

        Raises:
            LiveViewError: the address cannot be bound.
        """
        if self._server is None:
            self.bind(host, port)
        self._thread = threading.Thread(target=self._server.serve_forever, name="k2edge-http", daemon=True)
        self._thread.start()
        return self._host, self._server.server_port

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._server is None:
            return
        if self._thread is not None:
            self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server is not None else None

    # what the endpoints return --------------------------------------------------------------------------
    def how_to_sign_in(self) -> str:
        """What a refused request should give: the ways this view is configured to take."""
        ways = (["the token (Authorization: Bearer, or ?token=)"] if self.token is not None else []) + \
            (["the password (HTTP Basic)"] if self.password is not None else [])
        return "give " + " or ".join(ways)

    def authorised(self, headers, query: dict) -> tuple[bool, str | None]:
        """(allowed, a token to set as a cookie) for a request's headers and query."""
        if self.token is None and self.password is None:
            return True, None
        scheme, _, credentials = headers.get("Authorization", "").strip().partition(" ")
        scheme, credentials = scheme.lower(), credentials.strip()  # a scheme is case-insensitive (RFC 9110 11.1)
        if self.token is not None:
            given = query.get("token", [None])[0]
            if given is not None and hmac.compare_digest(given.encode(), self.token.encode()):
                return True, given
            if scheme == "bearer" and hmac.compare_digest(credentials.encode(), self.token.encode()):
                return True, None
            for part in headers.get("Cookie", "").split(";"):
                name, _, value = part.strip().partition("=")
                if name == _COOKIE and hmac.compare_digest(value.encode(), self.token.encode()):
                    return True, None
        if self.password is not None and scheme == "basic":
            try:
                _, _, given = base64.b64decode(credentials).decode().partition(":")
            except (binascii.Error, ValueError):
                return False, None
            if hmac.compare_digest(given.encode(), self.password.encode()):
                return True, None
        return False, None

    def knows(self, name: str) -> bool:
        return self.streams is not None and name in self.streams.streams

    def unknown(self, name: str) -> str:
        """Why a stream this app does not serve is not here."""
        return "disabled in the config (enabled = false)" if name in self.disabled else "no such stream"

    def streams_json(self) -> dict:
        return self.streams.status() if self.streams is not None else {}

    def events_json(self, stream: str | None, limit: int) -> list[dict]:
        return self.streams.events.recent(limit, stream) if self.streams is not None else []

    def ended(self, name: str) -> bool:
        """The stream's source played to its end (a file): no frame comes any more."""
        stream = self.streams.streams.get(name) if self.streams is not None else None
        return stream is not None and stream.reader.state == "ended"

    def frame_jpeg(self, name: str) -> tuple[int, bytes] | None:
        """The stream's newest processed frame, drawn and encoded (once per frame), or None (no such stream,
        or no frame yet: the request marks it watched, so the next processed frame is kept)."""
        stream = self.streams.streams.get(name) if self.streams is not None else None
        if stream is None:
            return None
        stream.watch()
        latest = stream.latest()
        if latest is None:
            return None
        index, image, detections = latest
        with self._lock:
            cached = self._frames.get(name)
        if cached is not None and cached[0] == index:
            return cached
        from PIL import Image

        from ..drawing import draw_detections, draw_zones_and_lines

        img = draw_zones_and_lines(Image.fromarray(image), stream.zones, stream.lines)
        img = draw_detections(img, detections)
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=80)
        drawn = (index, out.getvalue())
        with self._lock:
            self._frames[name] = drawn
        return drawn

    def medium(self, event_id: str, ext: str) -> bytes | None:
        media = self.streams.media if self.streams is not None else None
        return media.read(event_id, ext) if media is not None else None


class _Handler(BoundedHandler):
    app: LiveView
    head = False  # answering a HEAD: the GET's status and headers, no body

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        self.head = True
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        try:
            self._get()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:
            log.exception("http: %s failed", urlsplit(self.path).path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b'{"error": "internal"}', "application/json")

    def _get(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        allowed, cookie = self.app.authorised(self.headers, query)
        if not allowed:
            extra = {"WWW-Authenticate": 'Basic realm="k2edge"'} if self.app.password is not None else {}
            return self._json({"error": f"unauthorised: {self.app.how_to_sign_in()}"}, HTTPStatus.UNAUTHORIZED, extra)
        headers = {"Set-Cookie": f"{_COOKIE}={quote(cookie)}; HttpOnly; SameSite=Strict; Path=/"} if cookie else {}
        parts = [p for p in url.path.split("/") if p]
        if not parts:
            return self._send(HTTPStatus.OK, PAGE.encode(), "text/html; charset=utf-8", headers)
        if parts == ["api", "streams"]:
            return self._json(self.app.streams_json(), headers=headers)
        if parts == ["api", "events"]:
            raw = query.get("limit", ["50"])[0]
            if not (raw.isascii() and raw.isdigit() and len(raw) <= 6 and 1 <= int(raw) <= EVENTS_LIMIT):
                return self._json({"error": f"limit must be a whole number from 1 to {EVENTS_LIMIT}, got {raw[:20]!r}"},
                                  HTTPStatus.BAD_REQUEST)
            stream = query.get("stream", [None])[0]
            events = self.app.events_json(stream, int(raw))
            if stream is not None and not events and not self.app.knows(stream):
                return self._json({"error": f"stream {stream[:80]!r}: {self.app.unknown(stream)}, and no events stored "
                                            "for it"}, HTTPStatus.NOT_FOUND)
            return self._json(events, headers=headers)
        if len(parts) == 3 and parts[0] == "streams" and parts[2] == "frame.jpg":
            drawn = self.app.frame_jpeg(parts[1])
            if drawn is None:
                if not self.app.knows(parts[1]):
                    return self._json({"error": f"stream {parts[1]!r}: {self.app.unknown(parts[1])}"}, HTTPStatus.NOT_FOUND)
                if self.app.ended(parts[1]):
                    return self._json({"error": f"stream {parts[1]!r}: its source played to its end before anyone "
                                                "asked for a frame (frames are kept only while someone watches)"},
                                      HTTPStatus.NOT_FOUND)
                return self._json({"error": f"stream {parts[1]!r}: no processed frame yet (it is kept from now on)"},
                                  HTTPStatus.SERVICE_UNAVAILABLE)
            return self._send(HTTPStatus.OK, drawn[1], "image/jpeg", {"X-Frame-Index": str(drawn[0]),
                                                                     "Cache-Control": "no-store", **headers})
        if len(parts) == 3 and parts[0] == "events" and parts[2] in ("snapshot.jpg", "clip.mp4"):
            ext = parts[2].rsplit(".", 1)[1]
            data = self.app.medium(parts[1], ext)
            if data is None:
                what = "snapshot" if ext == "jpg" else "clip"
                return self._json({"error": f"event {parts[1]!r}: no {what} (none was made, or it was removed)"},
                                  HTTPStatus.NOT_FOUND)
            return self._send(HTTPStatus.OK, data, "image/jpeg" if ext == "jpg" else "video/mp4", headers)
        if parts == ["metrics"] and self.app.metrics is not None:
            return self._send(HTTPStatus.OK, *self.app.metrics.exposition(self.headers))
        return self._json({"error": f"no such page: {url.path}"}, HTTPStatus.NOT_FOUND)

    def _json(self, body, status: HTTPStatus = HTTPStatus.OK, headers: dict | None = None) -> None:
        self._send(status, json.dumps(body).encode(), "application/json", headers or {})

    def _send(self, status: HTTPStatus, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_body(status, data, content_type, headers, head=self.head)
