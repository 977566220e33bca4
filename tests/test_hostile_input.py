"""Hostile input gets its precise error, never ``internal`` for the sender's fault, never a dead daemon.

The parser is checked directly for each class of input; the daemon, against a real mosquitto, for
the cases that need it (id-less requests sharing correlation data, an id far into the payload,
non-finite model outputs, images with too many pixels and the memory they must not cost).
"""

from __future__ import annotations

import base64
import io
import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from k2edge.service.protocol import MAX_MESSAGE_CHARS, RequestError, error_body, parse_request, peek_key

TENSOR = {"dtype": "float32", "shape": [1, 32, 32], "data": base64.b64encode(bytes(4096)).decode()}


def _parse(payload, ctype=None, props=None) -> RequestError:
    payload = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    with pytest.raises(RequestError) as err:
        parse_request(payload, "m", ctype, props or {}, received=0.0)
    return err.value


def _ok(obj):
    return parse_request(json.dumps(obj).encode(), "m", None, {}, received=0.0)


def test_a_number_too_large_to_parse_is_bad_request_with_the_id():
    err = _parse(b'{"id": "big", "tensor": ' + json.dumps(TENSOR).encode() + b', "top_k": ' + b"9" * 5000 + b"}")
    assert (err.code, err.request_id) == ("bad_request", "big") and "top_k" in err.message and "too large" in err.message
    err = _parse(b'{"id": "big2", "image": "AAAA", "deadline_ms": 1e400}')
    assert (err.code, err.request_id) == ("bad_request", "big2") and "deadline_ms" in err.message
    err = _parse(b'{"id": "big3", "tensor": {"dtype": "float32", "shape": [1e400], "data": ""}}')
    assert err.code == "bad_request" and "tensor.shape" in err.message
    err = _parse(b"x", "image/png", {"id": "big4", "attempt": "9" * 5000})
    assert (err.code, err.request_id) == ("bad_request", "big4") and "attempt" in err.message


@pytest.mark.parametrize("value", ["\u00b2", "\u0661", "1\n", " 1", "1_0", "0x1", "+1", "nan"])
@pytest.mark.parametrize("key", ["attempt", "top_k", "deadline_ms"])
def test_a_number_in_a_user_property_is_ascii_digits(key, value):
    """'²' passed str.isdigit() and then broke int() inside peek_key: a traceback and no answer at all; int() and
    float() also took '١', '1_0' and ' 1\n'. Each is now bad_request under the request's id."""
    err = _parse(b"\xff\xd8x", "image/jpeg", {"id": "h1", key: value})
    assert (err.code, err.request_id) == ("bad_request", "h1") and f"user property {key} must be a number" in err.message
    assert peek_key(b"", {"id": "h1", "attempt": value}) == ("h1", 0)


@pytest.mark.parametrize("payload, where", [
    (b'{"id": "a\\ud800b", "image": "AAAA"}', "id"),
    (b'{"id": "p1", "image": "AAAA", "prompt": "a\\ud800b"}', "prompt"),
    (b'{"id": "p2", "image": "AAAA", "prompt": "\\udc00 alone"}', "prompt"),
    (b'{"id": "p3", "image": "AAAA", "prompt": "a\xed\xa0\x80b"}', "prompt (UTF-8 encoded surrogate)"),
])
def test_strings_with_unpaired_surrogates_are_bad_request(payload, where):
    err = _parse(payload)
    assert err.code == "bad_request", where
    if where != "id":  # the request's id is still read, so the error is answered under its key
        assert err.request_id in ("p1", "p2", "p3")


@pytest.mark.parametrize("field, bad, good", [
    ("top_k", [0, 1001, -3, 2.5, True], [1, 1000]),
    ("deadline_ms", [0, 0.5, 3_600_001, -1], [1, 3_600_000, 250.5]),
    ("attempt", [-1, 1001, 1.5, "1"], [0, 1000]),
])
def test_numbers_outside_their_range_are_bad_request(field, bad, good):
    for value in bad:
        err = _parse({"id": "r", "tensor": TENSOR, field: value})
        assert err.code == "bad_request" and field in err.message, (field, value, err.message)
    for value in good:
        assert getattr(_ok({"id": "r", "tensor": TENSOR, field: value}), field) == value


def test_a_prompt_is_at_most_max_prompt_chars():
    """A prompt goes to the paid cloud model: one longer than a question about an image is refused, in JSON and as a
    raw image's user property alike, under the request's key."""
    from k2edge.service.protocol import MAX_PROMPT_CHARS

    assert _ok({"id": "r", "tensor": TENSOR, "prompt": "p" * MAX_PROMPT_CHARS}).prompt == "p" * MAX_PROMPT_CHARS
    for err in (_parse({"id": "long", "tensor": TENSOR, "prompt": "p" * (MAX_PROMPT_CHARS + 1)}),
                _parse(b"x", "image/png", {"id": "long", "prompt": "p" * (MAX_PROMPT_CHARS + 1)})):
        assert (err.code, err.request_id) == ("bad_request", "long"), err.message
        assert f"prompt: expected a string of length <= {MAX_PROMPT_CHARS}" in err.message, err.message


def test_error_messages_are_capped_at_about_a_kilobyte():
    flood = {f"k{i}": i for i in range(100_000)}
    err = _parse({"id": "flood", "tensor": TENSOR, **flood})
    assert err.code == "bad_request" and len(err.message) <= MAX_MESSAGE_CHARS
    body = error_body("bad_request", "x" * 2_000_000, "flood", 0, "m", "dev")
    assert len(json.dumps(body)) < 1300


# the daemon --------------------------------------------------------------------------------------


@pytest.fixture
def served(run_daemon, broker):
    from mqtt_support import Client

    d = run_daemon(service={"max_image_pixels": 16_777_216})
    client = Client(broker.port).connect()
    yield d, client
    client.close()


@pytest.mark.slow
def test_hostile_requests_through_the_daemon_get_their_codes_and_it_keeps_serving(served):
    from mqtt_support import SAMPLES, TOPIC, image_request, tensor_request

    d, client = served
    huge = np.full((1, 32, 32), np.finfo(np.float32).max, np.float32)
    cases = {
        client.publish(TOPIC, b'{"id": "big", "image": "AAAA", "top_k": ' + b"9" * 5000 + b"}"): ("big", "bad_request"),
        client.publish(TOPIC, b'{"id": "sur", "image": "AAAA", "prompt": "a\\ud800b"}'): ("sur", "bad_request"),
        client.publish(TOPIC, b'{"id": "a\\ud800b", "image": "AAAA"}'): (None, "bad_request"),
        client.publish(TOPIC, tensor_request(huge, rid="inf")): ("inf", "internal"),
        client.publish(TOPIC, tensor_request(huge, rid="late", deadline_ms=3_600_001)): ("late", "bad_request"),
        client.publish(TOPIC, tensor_request(huge, rid="att", attempt=1001)): ("att", "bad_request"),
    }
    for i, v in enumerate((np.nan, np.inf, -np.inf)):  # non-finite tensor values: refused where staged
        bad = np.zeros((1, 32, 32), np.float32)
        bad[0, 3, 4] = v
        cases[client.publish(TOPIC, tensor_request(bad, rid=f"nf{i}"))] = (f"nf{i}", "bad_request")
    many = client.publish(TOPIC, image_request(SAMPLES[3], rid="many", top_k=1000))
    alive = client.publish(TOPIC, image_request(SAMPLES[7], rid="alive"))
    client.wait_answers(len(cases) + 2)
    answers = {c: a for a, c in client.answers}
    for corr, (rid, code) in cases.items():
        a = answers[corr]
        assert a["status"] == "error" and a["error"]["code"] == code and a["id"] == rid, a
    assert "non-finite" in answers[next(c for c, v in cases.items() if v[0] == "inf")]["error"]["message"]
    assert len(answers[many]["top_k"]) == 10  # top_k is clipped to the number of classes
    assert answers[alive]["status"] == "ok" and answers[alive]["top_k"][0]["label"] == "7"
    assert d.proc.poll() is None


@pytest.mark.slow
def test_id_less_requests_are_each_answered_and_a_late_id_still_finds_its_topic(served):
    """Three requests without an id sharing correlation data get three answers; an unknown-model request whose
    id comes after 4 kB of prompt is answered on {prefix}/result/{id}, not on the errors topic; a request with neither
    an id nor a Response Topic is answered on the errors topic."""
    from mqtt_support import SAMPLES, TOPIC

    d, client = served
    body = {"image": base64.b64encode(SAMPLES[2].read_bytes()).decode()}
    corr = uuid.uuid4().bytes
    for _ in range(3):
        client.publish(TOPIC, body, correlation=corr)
    answers = client.wait_answers(3)
    assert [a["status"] for a in answers] == ["ok"] * 3 and all(a["id"] is None for a in answers)
    late = json.dumps({"prompt": "p" * 5000, "image": "AAAA", "id": "deep-id"}).encode()
    client.publish("k2edge/t1/infer/nosuch", late, reply=False)
    client.wait_for(lambda c: any(t == "k2edge/t1/result/deep-id" for t, _ in c.other))
    a = next(b for t, b in client.other if t == "k2edge/t1/result/deep-id")
    assert a["error"]["code"] == "unknown_model"
    assert not any(t.endswith("/errors") for t, _ in client.other)
    client.publish(TOPIC, body, reply=False)  # neither an id nor a Response Topic: nowhere but the errors topic
    client.wait_for(lambda c: any(t == "k2edge/t1/errors" for t, _ in c.other))
    assert [b["status"] for t, b in client.other if t == "k2edge/t1/errors"] == ["ok"]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def big_png() -> bytes:
    """A 7,990 x 7,990 RGBA PNG: about 64 megapixels, a few hundred kB on the wire."""
    from PIL import Image

    img = Image.new("RGBA", (7990, 7990), (30, 60, 90, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    del img
    return buf.getvalue()


@pytest.mark.slow
def test_images_with_too_many_pixels_are_refused_from_their_header_without_memory(served, big_png):
    """Six 8k x 8k PNGs in a row: each refused by max_image_pixels before decoding; RSS grows < 50 MiB."""
    from mqtt_support import SAMPLES, TOPIC, image_request

    d, client = served
    assert len(big_png) < 4 * 1024 * 1024 // 2
    client.publish(TOPIC, image_request(SAMPLES[1], rid="warm"))  # the first answer's allocations are not counted
    client.wait_answers(1)
    before = _rss_mib(d.proc.pid)
    for i in range(6):
        client.publish(TOPIC, {"id": f"png{i}", "image": base64.b64encode(big_png).decode()})
    answers = client.wait_answers(7, timeout=60)[1:]
    for a in answers:
        assert a["error"]["code"] == "bad_request" and "max_image_pixels" in a["error"]["message"], a
    grown = _rss_mib(d.proc.pid) - before
    assert grown < 50, f"RSS grew by {grown:.0f} MiB"
    client.publish(TOPIC, image_request(SAMPLES[4], rid="after"))
    assert client.wait_answers(8)[-1]["top_k"][0]["label"] == "4"
    if os.environ.get("K2EDGE_TEST_VERBOSE"):
        print(f"RSS grew by {grown:.1f} MiB")
