"""The daemon's HTTP servers (the web app, ``/metrics``): threads, each connection on its own, with a bound.

``http.server``'s threading server starts a thread per connection and waits on it for as long as the client
wishes: a client that opens connections and sends nothing takes a thread each until the device runs out.
:class:`BoundedHTTPServer` serves at most :data:`MAX_CONNECTIONS` at once (one more is closed unanswered,
the connections being served untouched), and a handler built on :class:`BoundedHandler` gives up on a
connection that sends or reads nothing for :data:`REQUEST_TIMEOUT_S`, and on one whose request line and headers
have not all arrived within :data:`REQUEST_DEADLINE_S` (a client that trickles a byte now and then).
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["MAX_CONNECTIONS", "REQUEST_DEADLINE_S", "REQUEST_TIMEOUT_S", "BoundedHTTPServer", "BoundedHandler"]

REQUEST_TIMEOUT_S = 20.0  # each read or write
REQUEST_DEADLINE_S = 30.0  # the request line and headers, all together
MAX_CONNECTIONS = 64
MAX_DISCARDED_BODY = 64 * 1024  # the body of a request refused unread (405) that is still read off the socket


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server serving at most ``max_connections`` connections at once."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def __init__(self, server_address: tuple[str, int], handler) -> None:
        self._open = threading.BoundedSemaphore(self.max_connections)
        host, port = server_address
        # IPv4 or IPv6 as the host is written ("::1", "::" and names too); raises OSError (socket.gaierror) when it
        # names no address
        self.address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        super().__init__(server_address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._open.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._open.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._open.release()


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler whose socket times out (a silent client's thread is given back) and which logs nothing
    (a query may hold a token)."""

    server_version = "k2edge"
    sys_version = ""  # the Server header names no Python version
    timeout = REQUEST_TIMEOUT_S
    request_deadline = REQUEST_DEADLINE_S

    def setup(self) -> None:
        super().setup()
        # "waiting" for the first request's headers, then whichever comes first: "in" (they are; a keep-alive
        # connection's later requests stay in) or "cut" (the deadline passed)
        self._headers, self._headers_lock = "waiting", threading.Lock()
        self._deadline = threading.Timer(self.request_deadline, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self) -> None:
        """The deadline passed before the request's headers were in: the connection is closed under the reader."""
        with self._headers_lock:
            if self._headers != "waiting":
                return
            self._headers = "cut"
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers
        with self._headers_lock:
            if self._headers == "cut":
                return False  # cut while they came in: not answered
            self._headers = "in"
        self._deadline.cancel()
        return parsed

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def log_message(self, fmt, *args) -> None:
        pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, an unknown method, headers too large) as JSON
        ``{"error"}``, like every other answer of these servers, not its HTML page."""
        try:
            short, _ = self.responses[code]
        except KeyError:
            short = "error"
        self.close_connection = True
        self.send_body(code, json.dumps({"error": message or short}).encode(), "application/json", {"Connection": "close"},
                       head=self.command == "HEAD" or code < 200 or code in (204, 304))

    def _not_allowed(self) -> None:
        # a body left unread would reset the connection under the answer: read a small one, close after a large one
        length = self.headers.get("Content-Length", "")
        if length.isascii() and length.isdigit() and int(length) <= MAX_DISCARDED_BODY:
            self.rfile.read(int(length))
        elif length or self.headers.get("Transfer-Encoding"):
            self.close_connection = True
        self.send_body(405, json.dumps({"error": f"method {self.command} is not allowed: this server answers GET and "
                                                 "HEAD"}).encode(), "application/json", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815 (http.server's names)

    def send_body(self, status: int, data: bytes, content_type: str, headers: dict | None = None,
                  head: bool = False) -> None:
        """One whole answer (``head``: its headers only, as a HEAD request is answered)."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(data)
