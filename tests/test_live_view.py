"""The live view's web app on a real HTTP server without the daemon: who may see it (token, cookie,
password), its JSON and errors; the [http] table's refusal to expose it unguarded."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request

import pytest

from k2edge.config.schema import ConfigError, load_config
from k2edge.service.live_view import LiveView


def _get(url: str, headers: dict | None = None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture
def app():
    view = LiveView(None, token="s3cret-token", password="pa55")
    host, port = view.start("127.0.0.1", 0)
    yield f"http://{host}:{port}"
    view.stop()


def test_without_the_token_or_password_nothing_is_shown(app):
    for path in ("/", "/api/streams", "/api/events", "/streams/cam/frame.jpg", "/events/" + "a" * 32 + "/snapshot.jpg"):
        status, headers, body = _get(app + path)
        assert status == 401 and "unauthorised" in json.loads(body)["error"] and "s3cret" not in body.decode()
        assert headers["WWW-Authenticate"] == 'Basic realm="k2edge"'
    assert _get(app + "/api/streams", {"Authorization": "Bearer wrong"})[0] == 401
    assert _get(app + "/api/streams", {"Authorization": "Basic " + base64.b64encode(b"u:wrong").decode()})[0] == 401
    assert _get(app + "/api/streams", {"Authorization": "Basic !!!"})[0] == 401


@pytest.mark.parametrize("token, password, said", [
    ("t0ken", None, "unauthorised: give the token (Authorization: Bearer, or ?token=)"),
    (None, "pa55", "unauthorised: give the password (HTTP Basic)"),
    ("t0ken", "pa55", "unauthorised: give the token (Authorization: Bearer, or ?token=) or the password (HTTP Basic)"),
])
def test_a_refusal_names_only_the_ways_in_that_are_configured(token, password, said):
    view = LiveView(None, token=token, password=password)
    host, port = view.start("127.0.0.1", 0)
    try:
        status, headers, body = _get(f"http://{host}:{port}/api/streams")
    finally:
        view.stop()
    assert status == 401 and json.loads(body) == {"error": said}
    assert ("WWW-Authenticate" in headers) == (password is not None)


def test_the_token_once_in_the_url_sets_a_cookie_and_bearer_and_basic_work(app):
    status, headers, body = _get(app + "/?token=s3cret-token")
    assert status == 200 and b"k2edge: streams" in body
    cookie = headers["Set-Cookie"].split(";")[0]
    assert "HttpOnly" in headers["Set-Cookie"] and cookie == "k2edge_token=s3cret-token"
    assert _get(app + "/api/streams", {"Cookie": cookie})[0] == 200
    assert json.loads(_get(app + "/api/streams", {"Authorization": "Bearer s3cret-token"})[2]) == {}
    basic = "Basic " + base64.b64encode(b"anyone:pa55").decode()
    assert json.loads(_get(app + "/api/events", {"Authorization": basic})[2]) == []


def test_bad_requests_get_one_clear_json_error(app):
    auth = {"Authorization": "Bearer s3cret-token"}
    for limit in ("many", "0", "-5", "201", "9" * 5000):
        status, _, body = _get(app + f"/api/events?limit={limit}", auth)
        assert status == 400, (limit, status)
        assert json.loads(body)["error"].startswith("limit must be a whole number from 1 to 200, got "), body[:120]
    assert _get(app + "/api/events?limit=200", auth)[0] == 200
    status, _, body = _get(app + "/api/events?stream=nope", auth)
    assert status == 404 and json.loads(body) == {"error": "stream 'nope': no such stream, and no events stored for it"}
    status, _, body = _get(app + "/streams/nope/frame.jpg", auth)
    assert status == 404 and json.loads(body) == {"error": "stream 'nope': no such stream"}
    status, _, body = _get(app + "/events/../../etc/passwd/snapshot.jpg", auth)
    assert status == 404
    status, _, body = _get(app + "/events/" + "a" * 32 + "/clip.mp4", auth)
    assert status == 404 and "no clip" in json.loads(body)["error"]
    assert _get(app + "/metrics", auth)[0] == 404  # no [metrics]: not served


def test_a_live_view_beyond_loopback_needs_a_token_or_a_password(tmp_path):
    base = 'device_id = "t"\n[[models]]\nname = "boxes"\nonnx = "m.onnx"\n[http]\nport = 8080\n'
    p = tmp_path / "k.toml"
    p.write_text(base + 'host = "0.0.0.0"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "http" in str(e.value) and "token_file or password_file" in str(e.value)
    (tmp_path / "token").write_text("t0k\n")
    p.write_text(base + 'host = "0.0.0.0"\ntoken_file = "token"\n')
    assert load_config(p).http.token_file == tmp_path / "token"
    p.write_text(base)
    assert load_config(p).http.host == "127.0.0.1"


@pytest.mark.parametrize("server", ["live view", "metrics"])
def test_a_client_that_trickles_its_request_is_let_go_at_the_deadline(monkeypatch, server):
    """A client that sends a header byte every 0.2 s never trips the per-read timeout; the deadline on the whole request
    (its line and headers) closes it unanswered, and the server answers the next client."""
    import select
    import socket

    from k2edge.service import http_server
    from k2edge.service.metrics import PrometheusMetrics

    monkeypatch.setattr(http_server.BoundedHandler, "request_deadline", 1.0)
    view = LiveView(None) if server == "live view" else PrometheusMetrics()
    host, port = view.start("127.0.0.1", 0)
    try:
        s = socket.create_connection((host, port), timeout=30)
        s.sendall(b"GET /api/streams HTTP/1.0\r\nX-Slow: ")
        got, started = None, time.monotonic()
        while got is None and time.monotonic() - started < 60:  # the deadline is 1 s: 60 s is a broken server
            try:
                s.sendall(b"a")
            except OSError:
                got = b""
                break
            if select.select([s], [], [], 0.2)[0]:
                try:
                    got = s.recv(1024)
                except OSError:
                    got = b""
        s.close()
        assert got == b"", got  # closed, never answered
        assert _get(f"http://{host}:{port}/api/streams" if server == "live view" else f"http://{host}:{port}/metrics")[0] == 200
    finally:
        view.stop()


@pytest.mark.parametrize("server", ["live view", "metrics"])
def test_a_silent_client_is_let_go_and_connections_past_the_bound_are_closed_unanswered(monkeypatch, server):
    """Each connection holds a thread, on the web app as on /metrics: one that sends nothing is closed after the
    request timeout, and past MAX_CONNECTIONS a new one is closed at once, while the ones already served go on and
    the server answers again once the silent ones are gone."""
    import socket

    from k2edge.service import http_server
    from k2edge.service.metrics import PrometheusMetrics

    monkeypatch.setattr(http_server.BoundedHandler, "timeout", 3.0)
    monkeypatch.setattr(http_server.BoundedHTTPServer, "max_connections", 3)
    view = LiveView(None) if server == "live view" else PrometheusMetrics()
    host, port = view.start("127.0.0.1", 0)
    try:
        silent = [socket.create_connection((host, port), timeout=30) for _ in range(3)]
        extra = socket.create_connection((host, port), timeout=30)
        try:
            extra.sendall(b"GET /api/streams HTTP/1.0\r\n\r\n")
        except ConnectionError:  # closed before the request went
            pass
        try:
            answer = extra.recv(1024)
        except ConnectionError:
            answer = b""
        assert answer == b""  # closed unanswered: the three silent ones hold every slot
        extra.close()
        for s in silent:  # each let go by the server after its timeout, never answered
            assert s.recv(1024) == b""
            s.close()
        deadline = time.monotonic() + 30
        while True:  # a slot comes back as its serving thread ends, just after it closed the socket
            try:
                status = _get(f"http://{host}:{port}/api/streams")[0]
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "no slot came back"
                time.sleep(0.05)
        assert status == 200
    finally:
        view.stop()


def test_other_methods_and_malformed_requests_get_json_and_head_gets_the_headers(app):
    """POST (or any method but GET and HEAD) is 405 with Allow; http.server's own refusals are JSON too; HEAD answers
    as GET without the body."""
    import socket

    auth = {"Authorization": "Bearer s3cret-token"}
    req = urllib.request.Request(app + "/api/streams", data=b"{}", headers=auth, method="POST")
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("POST was answered")
    except urllib.error.HTTPError as exc:
        assert exc.code == 405 and exc.headers["Allow"] == "GET, HEAD"
        assert json.loads(exc.read()) == {"error": "method POST is not allowed: this server answers GET and HEAD"}
    head = urllib.request.Request(app + "/api/streams", headers=auth, method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "application/json" and resp.read() == b""
        assert int(resp.headers["Content-Length"]) == len(b"{}")
    host, port = app.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    # a request line without a version is HTTP/0.9's: answered with the body alone, no status line or headers
    assert json.loads(answer) == {"error": "Bad request syntax ('GARBAGE')"}, answer
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"BREW / HTTP/1.1\r\n\r\n")  # a method http.server has no do_ for
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    head_part, _, body = answer.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.0 501") and b"Content-Type: application/json" in head_part, answer
    assert json.loads(body) == {"error": "Unsupported method ('BREW')"} and b"Python" not in head_part, answer


def test_a_disabled_stream_is_named_as_such():
    view = LiveView(None, disabled=("gate",))
    host, port = view.start("127.0.0.1", 0)
    try:
        for path in ("/streams/gate/frame.jpg", "/api/events?stream=gate"):
            status, _, body = _get(f"http://{host}:{port}{path}")
            assert status == 404 and "stream 'gate': disabled in the config (enabled = false)" in json.loads(body)["error"]
        assert json.loads(_get(f"http://{host}:{port}/streams/other/frame.jpg")[2]) == {"error": "stream 'other': no such stream"}
    finally:
        view.stop()


def test_an_empty_credential_is_no_credential(app):
    """The scheme is case-insensitive; an empty bearer token or password never matches, and an empty secret is
    refused outright (the config refuses an empty token_file or password_file too: test_service)."""
    assert _get(app + "/api/streams", {"Authorization": "bearer s3cret-token"})[0] == 200
    assert _get(app + "/api/streams", {"Authorization": "Bearer "})[0] == 401
    assert _get(app + "/api/streams", {"Authorization": "Basic " + base64.b64encode(b"u:").decode()})[0] == 401
    assert _get(app + "/api/streams", {"Cookie": "k2edge_token="})[0] == 401
    for kw in ({"token": ""}, {"password": ""}):
        with pytest.raises(ValueError, match="empty"):
            LiveView(None, **kw)


def test_a_live_view_port_in_use_stops_the_daemon_before_any_engine_builds(tmp_path):
    """[http]'s port taken: the daemon says so and exits before building (it was told after every engine had built,
    minutes on a Jetson, where a [metrics] port in use was told at once). Nothing reaches the engine cache."""
    import socket
    import subprocess
    import sys

    from mqtt_support import DIGITS, ROOT, free_port, write_config

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        cache = tmp_path / "cache"
        cfg = write_config(tmp_path / "k.toml", free_port(), [{**DIGITS, "profile": "c2"}],
                           service={"cache_dir": str(cache)}, tables={"http": {"port": port}})
        proc = subprocess.run([sys.executable, "-m", "k2edge", "serve", "--config", str(cfg)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
    finally:
        taken.close()
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert last == f"k2edge serve: error: http: cannot listen on 127.0.0.1:{port} (Address already in use)", last
    assert not cache.exists() or not any(cache.iterdir()), sorted(cache.rglob("*"))
