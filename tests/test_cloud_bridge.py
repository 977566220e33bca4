"""The cloud bridge against a real local HTTP stand-in for K2: request bodies, retries, breaker,
budget, outbox across restarts, the escalation policy and curve, secrets, and the CLI."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from email.utils import formatdate
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from k2_server import K2StandIn, answer, delay, garbage, hang, status
from k2edge.cloud_bridge import (
    BreakerOpen,
    BridgeRequest,
    CircuitBreaker,
    CloudAuthError,
    CloudBridge,
    CloudConfigError,
    CloudHealth,
    CloudQuotaError,
    CloudRateLimited,
    CloudRejected,
    CloudSettings,
    CloudTimeout,
    CloudUnavailable,
    EscalationPolicy,
    EscalationRequest,
    EscalationSettings,
    K2Client,
    LocalResult,
    Outbox,
    RequestBudget,
    confidence,
    decide,
    escalation_curve,
    resolve_api_key,
)
from k2edge.cloud_bridge.curve import confidences
from k2edge.cloud_bridge.retry import parse_retry_after
from k2edge.telemetry import SettingsError, validate_settings

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-7f3a9c1e5b2d4f60a8b1c3d5"
MODEL = "kimi-k2.5"


@pytest.fixture
def k2():
    """A started K2 stand-in on 127.0.0.1 that requires the test key."""
    with K2StandIn(api_key=KEY) as server:
        yield server


def settings_for(server: K2StandIn, **kw) -> CloudSettings:
    base = {"base_url": server.url, "model": MODEL, "timeout_s": 2.0, "max_retries": 2, "breaker_failures": 3,
            "breaker_cooldown_s": 30.0}
    base.update(kw)
    return CloudSettings(**base)


def image_bytes(fmt: str, size=(1600, 1200), mode="RGB") -> bytes:
    img = Image.new(mode, size, (200, 30, 30) if mode == "RGB" else 128)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def decode_data_url(url: str) -> tuple[str, Image.Image]:
    head, b64 = url.split(",", 1)
    assert head.startswith("data:") and head.endswith(";base64")
    return head[5:-7], Image.open(io.BytesIO(base64.b64decode(b64)))


TOP3 = [{"index": 3, "label": "cat", "score": 0.61}, {"index": 5, "label": "dog", "score": 0.22},
        {"index": 1, "label": "fox", "score": 0.05}]


# the request body --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_request_body_has_image_part_data_url_and_text(k2, fmt, mime):
    """Exact body: model, temperature 0.6, a content list of image_url (downscaled, base64 data URL, right MIME) + text."""
    client = K2Client(settings_for(k2, image_max_side=512), KEY)
    k2.script(answer("a red cat"))
    ans = client.complete(image_bytes(fmt), "application/octet-stream", "What animal is this?", TOP3, 5.0)
    assert ans.text == "a red cat" and ans.model == MODEL and ans.attempts == 1 and ans.latency_ms > 0
    req = k2.chat_requests[-1]
    assert req.path == "/v1/chat/completions" and req.headers["authorization"] == f"Bearer {KEY}"
    body = req.body
    assert set(body) == {"model", "temperature", "max_tokens", "messages"}
    assert body["model"] == MODEL and body["temperature"] == 0.6 and body["max_tokens"] == 512
    system, user = body["messages"]
    assert system["role"] == "system" and isinstance(system["content"], str)
    assert user["role"] == "user" and isinstance(user["content"], list)  # never the list serialised into a string
    image_part, text_part = user["content"]
    assert set(image_part) == {"type", "image_url"} and image_part["type"] == "image_url"
    sent_mime, img = decode_data_url(image_part["image_url"]["url"])
    assert sent_mime == mime and img.format == fmt and max(img.size) == 512 and img.size == (512, 384)
    assert text_part == {"type": "text", "text": "What animal is this?\n\nThe on-device classifier's top-3 guesses "
                                                "(label, probability): cat (0.610), dog (0.220), fox (0.050)."}


def test_small_images_go_unchanged_and_odd_formats_become_png(k2):
    """An image within the limit is sent as is (sniffed type, not the declared one); BMP is re-encoded as PNG."""
    client = K2Client(settings_for(k2), KEY)
    small = image_bytes("JPEG", (64, 48))
    client.complete(small, "image/png", None, None, 5.0)
    url = k2.chat_requests[-1].body["messages"][1]["content"][0]["image_url"]["url"]
    assert url == "data:image/jpeg;base64," + base64.b64encode(small).decode()
    text = k2.chat_requests[-1].body["messages"][1]["content"][1]["text"]
    assert text.startswith("What does this image show?") and "guesses" not in text
    client.complete(image_bytes("BMP", (900, 300)), "image/bmp", "q", None, 5.0)
    mime, img = decode_data_url(k2.chat_requests[-1].body["messages"][1]["content"][0]["image_url"]["url"])
    assert mime == "image/png" and img.size == (768, 256)


def test_text_only_request_and_undecodable_image(k2):
    """No image: one text part. Bytes that are not an image: CloudRejected, nothing sent, breaker untouched."""
    client = K2Client(settings_for(k2), KEY)
    client.complete(None, None, "Describe a cat", TOP3[:1], 5.0)
    assert [p["type"] for p in k2.chat_requests[-1].body["messages"][1]["content"]] == ["text"]
    n = len(k2.chat_requests)
    with pytest.raises(CloudRejected, match="could not be decoded"):
        client.complete(b"not an image", "image/png", "q", None, 5.0)
    assert len(k2.chat_requests) == n and client.breaker.state == "closed"


def test_an_answer_that_is_not_json_is_a_cloud_error_not_a_crash(k2):
    """A 200 whose body is not JSON (a proxy's page, a broken server): the chat and the model list each raise the
    bridge's own CloudError saying so, not the SDK's AttributeError."""
    from k2edge.cloud_bridge import CloudError

    client = K2Client(settings_for(k2, max_retries=0), KEY)
    k2.script(garbage())
    with pytest.raises(CloudError, match="not the JSON expected"):
        client.complete(None, None, "q", None, 5.0)
    k2.garbled_models = True
    with pytest.raises(CloudUnavailable, match=r"GET /v1/models: the server's answer is not the JSON expected"):
        client.list_models()
    client.close()


def test_anthropic_mode_body_and_temperature_scaling(k2):
    """Anthropic-compatible mode: /v1/messages, image as a base64 source with its media type, temperature 0.6/0.6 = 1.0."""
    client = K2Client(settings_for(k2, base_url=k2.anthropic_url, mode="anthropic", image_max_side=256), KEY)
    k2.script(answer("a cat, says the messages API"))
    ans = client.complete(image_bytes("PNG"), None, "What is it?", TOP3, 5.0)
    assert ans.text == "a cat, says the messages API"
    req = k2.chat_requests[-1]
    assert req.path == "/anthropic/v1/messages" and req.headers["x-api-key"] == KEY
    assert req.headers["anthropic-version"] == "2023-06-01"
    body = req.body
    assert body["temperature"] == pytest.approx(1.0) and body["model"] == MODEL and isinstance(body["system"], str)
    img_part, text_part = body["messages"][0]["content"]
    assert img_part["type"] == "image" and img_part["source"]["type"] == "base64"
    assert img_part["source"]["media_type"] == "image/png"
    assert max(Image.open(io.BytesIO(base64.b64decode(img_part["source"]["data"]))).size) == 256
    assert text_part["type"] == "text" and "cat (0.610)" in text_part["text"]
    assert client.list_models() == sorted(k2.models)
    low = K2Client(settings_for(k2, base_url=k2.anthropic_url, mode="anthropic", temperature=0.3), KEY)
    low.complete(None, None, "q", None, 5.0)
    assert k2.chat_requests[-1].body["temperature"] == pytest.approx(0.5)


def test_anthropic_mode_asks_about_several_images_in_order_and_never_sends_response_format(k2):
    """A stream event's question in Anthropic mode: each image a base64 source with its own media type, in the
    order given, then the text; JSON is asked for in the prompt only (the messages API has no response_format)."""
    from k2edge.cloud_bridge.image import prepare_image

    client = K2Client(settings_for(k2, base_url=k2.anthropic_url, mode="anthropic", image_max_side=128), KEY)
    images = [prepare_image(image_bytes("PNG", (640, 480)), 128), prepare_image(image_bytes("JPEG", (300, 600)), 128),
              prepare_image(image_bytes("PNG", (64, 64)), 128)]
    k2.script(answer('{"verdict": "confirmed", "label": "person", "description": "a walker"}'))
    ans = client.ask(images, "Is this a person? Answer in JSON.", 5.0, json_mode=True)
    assert ans.text.startswith('{"verdict": "confirmed"')
    req = k2.chat_requests[-1]
    assert req.path == "/anthropic/v1/messages" and "response_format" not in req.body
    *parts, text = req.body["messages"][0]["content"]
    assert text == {"type": "text", "text": "Is this a person? Answer in JSON."}
    assert [p["source"]["media_type"] for p in parts] == ["image/png", "image/jpeg", "image/png"]
    sizes = [Image.open(io.BytesIO(base64.b64decode(p["source"]["data"]))).size for p in parts]
    assert sizes == [(128, 96), (64, 128), (64, 64)]  # each downscaled to 128 on its longer side, small ones as they are


# retries ------------------------------------------------------------------------------------------------
def test_429_retry_after_seconds_is_honoured(k2):
    """429 with Retry-After: 0.2 s -> waits at least that long, then the second attempt answers."""
    client = K2Client(settings_for(k2), KEY)
    k2.script(status(429, retry_after="0.2"), answer("ok"))
    t0 = time.monotonic()
    ans = client.complete(None, None, "q", None, 5.0)
    assert ans.text == "ok" and ans.attempts == 2
    chats = k2.chat_requests
    assert chats[-1].t - chats[-2].t >= 0.2 and time.monotonic() - t0 >= 0.2


def test_retry_after_http_date_and_parsing():
    """Retry-After as an HTTP date, as seconds, as retry-after-ms; garbage is ignored."""
    now = 1_700_000_000.0
    assert parse_retry_after({"Retry-After": formatdate(now + 3, usegmt=True)}, now) == pytest.approx(3.0)
    assert parse_retry_after({"retry-after": "1.5"}) == 1.5
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({"Retry-After": "soon"}) is None and parse_retry_after({}) is None


def test_5xx_retried_a_bounded_number_of_times(k2):
    """500, 502 then an answer with max_retries=2 succeeds; three 500s fail after exactly three attempts."""
    client = K2Client(settings_for(k2), KEY)
    k2.script(status(500), status(502), answer("third time"))
    assert client.complete(None, None, "q", None, 5.0).attempts == 3
    n = len(k2.chat_requests)
    k2.script(status(500), status(500), status(500), answer("too late"))
    with pytest.raises(CloudUnavailable) as e:
        client.complete(None, None, "q", None, 5.0)
    assert e.value.attempts == 3 and len(k2.chat_requests) == n + 3 and "HTTP 500" in str(e.value)
    assert client.breaker.snapshot()["consecutive_failures"] == 1  # one failed call, not three


def test_retry_after_beyond_the_deadline_fails_fast(k2):
    """A Retry-After longer than the time left: give up at once rather than sleep past the deadline."""
    client = K2Client(settings_for(k2), KEY)
    k2.script(status(429, retry_after="120"))
    t0 = time.monotonic()
    with pytest.raises(CloudRateLimited, match="Retry-After 120 s is beyond the deadline"):
        client.complete(None, None, "q", None, 30.0)
    # at once: neither the Retry-After nor the 30 s left were slept through
    assert time.monotonic() - t0 < 15.0 and len(k2.chat_requests) == 1


def test_quota_429_fails_fast_and_opens_the_breaker(k2):
    """A 429 saying the quota is exhausted is not retried, and opens the breaker."""
    client = K2Client(settings_for(k2), KEY)
    body = {"error": {"message": "You exceeded your current quota, please check your plan and billing details.",
                      "type": "exceeded_current_quota_error"}}
    k2.script(status(429, retry_after="0.01", body=body), answer("never"))
    with pytest.raises(CloudQuotaError, match="quota or billing is exhausted") as e:
        client.complete(None, None, "q", None, 5.0)
    assert not e.value.retryable and len(k2.chat_requests) == 1 and client.breaker.state == "open"


def test_hanging_server_times_out_within_the_deadline(k2):
    """A server that never answers: CloudTimeout by the deadline, not the (longer) client timeout."""
    client = K2Client(settings_for(k2, timeout_s=60.0), KEY)
    k2.script(hang(60.0))
    t0 = time.monotonic()
    with pytest.raises(CloudTimeout):
        client.complete(None, None, "q", None, 1.0)
    # the 1 s deadline, not the 60 s the server hangs or the client would wait
    assert 0.95 < time.monotonic() - t0 < 20.0


def test_4xx_is_rejected_without_retry_and_does_not_trip_the_breaker(k2):
    """400 (the server is up, the request is bad): CloudRejected, one attempt, breaker stays closed."""
    client = K2Client(settings_for(k2, breaker_failures=1), KEY)
    k2.script(status(400, body={"error": {"message": "image too large", "type": "invalid_request_error"}}))
    with pytest.raises(CloudRejected, match="image too large"):
        client.complete(None, None, "q", None, 5.0)
    assert len(k2.chat_requests) == 1 and client.breaker.state == "closed"


def test_wrong_key_is_an_auth_error(k2):
    """401: CloudAuthError naming where the key came from (never the key); the breaker opens."""
    client = K2Client(settings_for(k2, api_key_env="K2_KEY"), "sk-wrong-0000000000000")
    with pytest.raises(CloudAuthError) as e:
        client.complete(None, None, "q", None, 5.0)
    assert "environment variable K2_KEY" in str(e.value) and "sk-wrong" not in str(e.value)
    assert client.breaker.state == "open"


# circuit breaker ------------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_probes_once_and_closes():
    """closed -> open after N failures -> half-open after the cooldown: one probe; success closes, failure reopens."""
    clock = FakeClock()
    b = CircuitBreaker(failures=3, cooldown_s=10.0, clock=clock)
    for _ in range(2):
        assert b.allow()
        b.record_failure("500")
    assert b.state == "closed"
    b.record_failure("500")
    assert b.state == "open" and not b.allow() and b.retry_in_s() == pytest.approx(10.0)
    clock.t += 10.0
    assert b.state == "half_open" and b.allow() and not b.allow()  # one probe only
    b.record_failure("still down")
    assert b.state == "open" and not b.allow()
    clock.t += 10.0
    assert b.allow()
    b.record_success()
    assert b.state == "closed" and b.allow() and b.snapshot()["consecutive_failures"] == 0


def test_dead_cloud_costs_nothing_once_the_breaker_is_open(k2):
    """After N failed calls no request reaches the server; after the cooldown one probe does and closes it."""
    clock = FakeClock(time.monotonic())
    breaker = CircuitBreaker(2, 30.0, clock)
    client = K2Client(settings_for(k2, max_retries=0), KEY, breaker=breaker)
    k2.fallback = status(503)
    for _ in range(2):
        with pytest.raises(CloudUnavailable):
            client.complete(None, None, "q", None, 2.0)
    n = len(k2.chat_requests)
    for _ in range(20):
        with pytest.raises(BreakerOpen):
            client.complete(None, None, "q", None, 2.0)
    assert len(k2.chat_requests) == n
    k2.fallback = answer("back")
    clock.t += 31.0
    assert client.complete(None, None, "q", None, 2.0).text == "back" and breaker.state == "closed"
    assert len(k2.chat_requests) == n + 1


# budget --------------------------------------------------------------------------------------------------
def test_request_budget_is_a_sliding_minute():
    """3 per minute: the 4th is refused until the first one is 60 s old."""
    clock = FakeClock(0.0)
    budget = RequestBudget(3, clock)
    spent = []
    for t in (0.0, 10.0, 20.0, 20.0):
        clock.t = t
        spent.append(budget.try_acquire() is not None)
    assert spent == [True, True, True, False]
    assert budget.remaining() == 0 and budget.resets_in_s() == pytest.approx(40.0)
    clock.t = 60.0
    assert budget.remaining() == 1 and budget.try_acquire() and not budget.try_acquire()
    assert budget.snapshot()["refused"] == 2
    assert RequestBudget(None).try_acquire() and RequestBudget(None).remaining() is None


def test_a_request_whose_call_was_not_made_goes_back_to_the_budget():
    """refund gives back that very spend (a stream's to its share too), not the latest: the window still resets when
    the others age out; a spend already out of the window gives nothing back."""
    clock = FakeClock(0.0)
    budget = RequestBudget(2, clock)
    first = budget.try_acquire()
    clock.t = 10.0
    shared = budget.try_acquire_share(1.0)
    assert first and shared and budget.remaining() == 0
    budget.refund(shared)
    assert budget.remaining() == 1 and budget.try_acquire_share(0.5)  # the share's one request is free again
    clock.t = 20.0
    budget.refund(first)  # the spend at 0 goes; the one at 20 (the share's) stays
    assert budget.remaining() == 1 and budget.resets_in_s() == 0.0
    assert budget.try_acquire() and budget.resets_in_s() == pytest.approx(50.0)  # the share's spend at 10
    clock.t = 75.0
    late = budget.try_acquire()
    clock.t = 140.0  # late aged out: nothing of the window goes with it
    budget.try_acquire()
    budget.refund(late)
    assert budget.remaining() == 1 and budget.snapshot()["refused"] == 0
    RequestBudget(None).refund(RequestBudget(None).try_acquire())


# the policy -------------------------------------------------------------------------------------------
def local(scores, num_classes=10):
    return LocalResult(tuple({"index": i, "label": f"c{i}", "score": s} for i, s in enumerate(scores)), None, num_classes)


CONFIDENT, UNSURE = local([0.95, 0.03]), local([0.40, 0.35])
S = EscalationSettings(threshold=0.6, warm_profile="c4")


@pytest.mark.parametrize("case,req,result,thermal,health,budget,expect", [
    ("confident stays local", EscalationRequest("m"), CONFIDENT, "normal", None, None, ("local", False, False)),
    ("unsure escalates", EscalationRequest("m"), UNSURE, "normal", None, None, ("cloud", False, False)),
    ("no edge model -> cloud", EscalationRequest("m", has_local_model=False), None, "normal", None, None, ("cloud", False, False)),
    ("prompt needs language", EscalationRequest("m", prompt="is the cat asleep?"), CONFIDENT, "normal", None, None, ("cloud", False, False)),
    ("allow_cloud false respected", EscalationRequest("m", allow_cloud=False), UNSURE, "normal", None, None, ("local", False, False)),
    ("allow_cloud false, hot", EscalationRequest("m", allow_cloud=False), CONFIDENT, "hot", None, None, ("local", False, False)),
    ("a prompt, cloud forbidden: unanswered", EscalationRequest("m", prompt="is it neat?", allow_cloud=False), CONFIDENT, "normal",
     None, None, ("local", True, False)),
    ("hot escalates the confident", EscalationRequest("m"), CONFIDENT, "hot", None, None, ("cloud", False, False)),
    ("hot without local result yet", EscalationRequest("m"), None, "hot", None, None, ("cloud", False, False)),
    ("critical offloads", EscalationRequest("m"), CONFIDENT, "critical", None, None, ("cloud", False, False)),
    ("critical, cloud forbidden -> refuse", EscalationRequest("m", allow_cloud=False), CONFIDENT, "critical", None, None, ("refuse", False, False)),
    ("breaker open -> degraded local", EscalationRequest("m"), UNSURE, "normal", CloudHealth(False, "breaker open"), None, ("local", True, False)),
    ("budget spent -> degraded local", EscalationRequest("m"), UNSURE, "normal", None, 0, ("local", True, False)),
    ("deferrable and cloud down", EscalationRequest("m", deferrable=True), UNSURE, "normal", CloudHealth(False, "down"), None, ("local", True, True)),
    ("no model, cloud down -> refuse", EscalationRequest("m", has_local_model=False), None, "normal", CloudHealth(False, "down"), None, ("refuse", False, False)),
    ("no model, cloud down, deferrable", EscalationRequest("m", has_local_model=False, deferrable=True), None, "normal", CloudHealth(False, "down"), None, ("cloud", True, True)),
    ("unknown state behaves like normal", EscalationRequest("m"), CONFIDENT, "unknown", None, None, ("local", False, False)),
])
def test_policy_table(case, req, result, thermal, health, budget, expect):
    """The escalation rules, one scenario per row: (action, degraded, defer)."""
    d = decide(req, result, thermal, health, budget, S)
    assert (d.action, d.degraded, d.defer) == expect, (case, d)
    assert d.reason and d.escalate == (d.action != "local" or d.degraded)


def test_policy_reasons_codes_and_profiles():
    """Reasons name the numbers; refusals carry an error code; warm/hot carry the DLA-heavier profile."""
    d = decide(EscalationRequest("m"), UNSURE, "normal", settings=S)
    assert d.reason == "confidence 0.400 (max_softmax) < threshold 0.600" and d.escalate and d.confidence == 0.4
    crit = decide(EscalationRequest("m", allow_cloud=False), CONFIDENT, "critical", settings=S)
    assert crit.error_code == "busy" and "allow_cloud false" in crit.reason and "cooled" in crit.reason
    nomodel = decide(EscalationRequest("x", allow_cloud=False, has_local_model=False), None, "normal", settings=S)
    assert nomodel.action == "refuse" and nomodel.error_code == "unknown_model"
    down = decide(EscalationRequest("m", has_local_model=False), None, "normal", CloudHealth(False, "the breaker is open"), settings=S)
    assert down.error_code == "cloud_unavailable" and "the breaker is open" in down.reason
    assert decide(EscalationRequest("m"), CONFIDENT, "warm", settings=S).thermal_state == "warm"
    provisional = decide(EscalationRequest("m"), None, "normal", settings=S)
    assert provisional.action == "local" and provisional.provisional
    prompt_local = decide(EscalationRequest("m", prompt="hi"), CONFIDENT, "normal",
                          settings=EscalationSettings(threshold=0.6, prompts="local"))
    assert prompt_local.action == "local"


def test_a_reason_shows_the_threshold_as_set_and_a_confidence_that_differs_from_it():
    """0.9999 is not printed as 1.000, nor a confidence just under it as the threshold itself."""
    fine = EscalationSettings(threshold=0.9999)
    d = decide(EscalationRequest("m"), local([0.95, 0.05]), "normal", settings=fine)
    assert d.reason == "confidence 0.9500 (max_softmax) < threshold 0.9999", d.reason
    close = decide(EscalationRequest("m"), local([0.99989, 0.00011]), "normal", settings=fine)
    assert close.reason == "confidence 0.99989 (max_softmax) < threshold 0.99990", close.reason


def test_warm_escalates_low_confidence_sooner():
    """0.75 passes the 0.6 threshold in normal but not the warm threshold (halfway to 1: 0.8)."""
    mid = local([0.75, 0.2])
    assert decide(EscalationRequest("m"), mid, "normal", settings=S).action == "local"
    warm = decide(EscalationRequest("m"), mid, "warm", settings=S)
    assert warm.action == "cloud" and warm.threshold == pytest.approx(0.8) and "warm threshold 0.800" in warm.reason
    explicit = EscalationSettings(threshold=0.6, warm_threshold=0.7)
    assert decide(EscalationRequest("m"), mid, "warm", settings=explicit).action == "local"


def test_confidence_measures():
    """max_softmax, margin and normalised entropy on full vectors and on top-k."""
    p = [0.7, 0.2, 0.1]
    assert confidence(p, "max_softmax") == 0.7
    assert confidence(p, "margin") == pytest.approx(0.5)
    h = -sum(x * np.log(x) for x in p)
    assert confidence(p, "entropy") == pytest.approx(1 - h / np.log(3))
    assert confidence([1.0, 0.0, 0.0], "entropy") == pytest.approx(1.0)
    assert confidence([0.25] * 4, "entropy") == pytest.approx(0.0)
    # top-2 of 4 classes: the missing 0.2 spread over the 2 unseen classes
    full = confidence([0.5, 0.3, 0.1, 0.1], "entropy")
    assert confidence([0.5, 0.3], "entropy", num_classes=4) == pytest.approx(full)
    assert confidence([0.9], "margin") == pytest.approx(0.8)
    lr = LocalResult.from_logits(np.array([2.0, 1.0, 0.1]), ["a", "b", "c"], k=2)
    assert lr.summary == "a" and len(lr.top_k) == 2 and lr.num_classes == 3
    assert lr.confidence("max_softmax") == pytest.approx(np.exp(2) / np.exp([2, 1, 0.1]).sum())


# the curve --------------------------------------------------------------------------------------------
def test_escalation_curve_least_confident_first():
    """Escalating the least confident first buys the wrong answers first; thresholds reproduce each share."""
    logits = np.array([[5, 0, 0], [0.2, 0, 0.1], [0, 3, 0], [0, 0.1, 0.3], [4, 0, 1]], dtype=np.float64)
    labels = [0, 1, 1, 2, 0]  # sample 1 is wrong and the least confident
    pts = escalation_curve(logits, labels, "max_softmax", [0, 0.2, 0.4, 1.0])
    assert [p.escalated for p in pts] == [0, 1, 2, 5]
    assert [p.accuracy for p in pts] == [0.8, 1.0, 1.0, 1.0]
    assert pts[0].local_accuracy == 0.8 and pts[-1].local_accuracy is None
    conf = confidences(logits, "max_softmax")
    assert conf[1] == conf.min()
    for p in pts:
        assert (conf < p.threshold).sum() == p.escalated and p.threshold_share == p.escalated / 5
    with pytest.raises(ValueError, match="labels"):
        escalation_curve(logits, [0, 1], "margin")


# secrets -----------------------------------------------------------------------------------------------
def test_key_sources_and_their_errors(tmp_path, monkeypatch):
    """File, systemd credential and environment; each missing source is a one-line error naming it, never a key."""
    f = tmp_path / "k2.key"
    f.write_text(KEY + "\n")
    f.chmod(0o600)
    assert resolve_api_key(CloudSettings(api_key_file=f)).get_secret_value() == KEY
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "k2").write_text(KEY)
    got = resolve_api_key(CloudSettings(api_key_credential="k2"), {"CREDENTIALS_DIRECTORY": str(creds)})
    assert got.get_secret_value() == KEY
    assert resolve_api_key(CloudSettings(api_key_env="K2"), {"K2": KEY}).get_secret_value() == KEY
    assert resolve_api_key(CloudSettings()) is None
    with pytest.raises(CloudConfigError, match="does not exist"):
        resolve_api_key(CloudSettings(api_key_file=tmp_path / "nope"))
    with pytest.raises(CloudConfigError, match=r"CREDENTIALS_DIRECTORY is not set; add LoadCredential=k2"):
        resolve_api_key(CloudSettings(api_key_credential="k2"), {})
    with pytest.raises(CloudConfigError, match="K2 is not set"):
        resolve_api_key(CloudSettings(api_key_env="K2"), {})
    with pytest.raises(SettingsError, match="^cloud: give at most one of .*; got api_key_file, api_key_env$"):
        validate_settings(CloudSettings, {"api_key_file": str(f), "api_key_env": "K2"}, "cloud")  # the key it is
    with pytest.raises(SettingsError, match=r"cloud\.timeout_s: must be > 0"):
        validate_settings(CloudSettings, {"timeout_s": 0}, "cloud")


def test_a_key_that_cannot_be_sent_or_a_pasted_key_as_path_is_refused_without_showing_it(tmp_path):
    """A key file holding two lines (or a space) would fail every call as "cannot connect (LocalProtocolError)": it is
    refused when read, naming the source and never the key; a key pasted where its path goes is not shown back."""
    f = tmp_path / "k2.key"
    f.write_text(f"{KEY}\nsecond-line-{KEY}\n")
    with pytest.raises(CloudConfigError, match="holds a line break, a control character") as err:
        resolve_api_key(CloudSettings(api_key_file=f))
    assert KEY not in str(err.value) and str(f) in str(err.value)
    with pytest.raises(CloudConfigError, match="environment variable K2: the key holds a line break") as err:
        resolve_api_key(CloudSettings(api_key_env="K2"), {"K2": f"{KEY}\t{KEY}"})
    assert KEY not in str(err.value)
    assert resolve_api_key(CloudSettings(api_key_env="K2"), {"K2": "two words"}).get_secret_value() == "two words"
    pasted = "sk-" + "a1B2c3D4e5" * 5
    settings = CloudSettings(api_key_file=tmp_path / pasted)
    with pytest.raises(CloudConfigError, match="does not exist") as err:
        resolve_api_key(settings)
    assert pasted not in str(err.value) and "53 characters, not shown" in str(err.value)
    assert pasted not in settings.key_source()
    as_env = "K2TOPSECRETzz7f3a9c2e41b8d6"  # a key pasted where the variable's name goes (a valid name all the same)
    with pytest.raises(CloudConfigError, match="is not set or empty") as err:
        resolve_api_key(CloudSettings(api_key_env=as_env), {})
    assert as_env not in str(err.value) and as_env not in CloudSettings(api_key_env=as_env).key_source()
    assert CloudSettings(api_key_env="MOONSHOT_API_KEY_2026").key_source() == "environment variable MOONSHOT_API_KEY_2026"
    named = tmp_path / "moonshot_api_key_production"  # a name, not a key: shown
    assert str(named) in CloudSettings(api_key_file=named).key_source()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # no writer: read as empty at once, not waited on
    with pytest.raises(CloudConfigError, match="the file is empty"):
        resolve_api_key(CloudSettings(api_key_file=fifo))


def test_key_never_reaches_a_log_a_repr_or_an_error(k2, caplog, tmp_path, monkeypatch):
    """With openai/httpx loggers at DEBUG: success, retries, a server echoing the header, and anthropic mode leak nothing."""
    for name in ("openai", "httpx", "httpx2", "httpcore", "httpcore2", "k2edge", ""):
        caplog.set_level(logging.DEBUG, logger=name)
    monkeypatch.setenv("K2_TEST_KEY", KEY)
    settings = settings_for(k2, api_key_env="K2_TEST_KEY", breaker_failures=1)
    bridge = CloudBridge(settings, tmp_path)
    client = bridge.client
    errors = []
    k2.script(status(500), answer("fine"))
    client.complete(image_bytes("PNG", (64, 64)), "image/png", "q", TOP3, 5.0)
    k2.script(status(400, body={"error": {"message": f"bad header: Authorization: Bearer {KEY}"}}))
    with pytest.raises(CloudRejected) as e:
        client.complete(None, None, "q", None, 5.0)
    errors.append(e.value)
    k2.script(status(503, body=f"upstream saw key {KEY}"), status(503, body=f"upstream saw key {KEY}"),
              status(503, body=f"upstream saw key {KEY}"))
    out = bridge.handle(BridgeRequest("r1", "m"), UNSURE, 5.0, thermal_state="normal")
    assert out.degraded and out.source == "edge"
    anth = K2Client(settings.model_copy(update={"mode": "anthropic", "base_url": k2.anthropic_url}))
    anth.complete(None, None, "q", None, 5.0)
    assert any(r.name.startswith("openai") for r in caplog.records)  # the SDK really logged at DEBUG
    assert any(r.name.startswith("httpcore") or r.name.startswith("httpx") for r in caplog.records)
    visible = [caplog.text, repr(settings), str(settings), repr(client), repr(anth), json.dumps(bridge.status()),
               json.dumps(out.to_dict()), *map(str, errors), *(repr(r.args) for r in caplog.records)]
    for text in visible:
        assert KEY not in text
    assert "***" in str(errors[0])
    bridge.close()


@pytest.mark.parametrize("at", [280, 290, 295, 299])
def test_a_key_echoed_where_a_message_is_cut_leaves_no_part_of_it(tmp_path, caplog, at):
    """The server's message was cut to 300 characters before the key was scrubbed out: a key echoed across the cut
    passed the scrub in part (the first 10 of a key that does not look like sk-..., in the answer's reason, the
    status' last_error and two log lines). Scrubbed first, then cut."""
    caplog.set_level(logging.DEBUG, logger="k2edge")
    key = "Zq7mW2pX9vLr4Tn8Yb1Kc6Hd"  # no sk-/ak- prefix: only the exact key's scrub can catch it
    with K2StandIn(api_key=key) as server:
        policy = EscalationPolicy({"digits": EscalationSettings(threshold=0.6, warm_profile="c4")})
        settings = settings_for(server, breaker_failures=1, max_retries=0)
        bridge = CloudBridge(settings, tmp_path / "state", policy=policy, client=K2Client(settings, key))
        server.script(status(500, body={"error": {"message": "x" * (at - len("HTTP 500: ")) + f"upstream saw {key})"}}))
        out = bridge.handle(BridgeRequest("r1", "digits"), UNSURE, 5.0, "normal")
        assert out.degraded and out.source == "edge" and "HTTP 500: xxx" in out.reason, out.reason
        for text in (out.reason, json.dumps(bridge.status()), caplog.text):
            for cut in range(6, len(key) + 1):
                assert key[:cut] not in text, (cut, text[-200:])
        bridge.close()


# the bridge ---------------------------------------------------------------------------------------------
def make_bridge(server, tmp_path, **kw):
    policy = EscalationPolicy({"digits": EscalationSettings(threshold=0.6, warm_profile="c4")})
    settings = settings_for(server, **kw)
    return CloudBridge(settings, tmp_path / "state", policy=policy, client=K2Client(settings, KEY))


def test_low_confidence_escalates_and_carries_the_cloud_answer(k2, tmp_path):
    """An unsure local result: source cloud, the cloud's text and latency, the reason with the numbers."""
    bridge = make_bridge(k2, tmp_path)
    k2.script(answer("a tabby cat", delay_s=0.05))
    out = bridge.handle(BridgeRequest("r1", "digits", image=image_bytes("JPEG", (320, 240))), UNSURE, 3.0, "normal")
    assert (out.source, out.text, out.degraded, out.error_code) == ("cloud", "a tabby cat", False, None)
    assert out.latency_ms >= 50 and out.cloud_model == MODEL and "confidence 0.400 (max_softmax) < threshold 0.600" in out.reason
    assert "cat (0.400)" not in k2.chat_requests[-1].body["messages"][1]["content"][1]["text"]  # top-k labels are c0, c1
    assert "c0 (0.400)" in k2.chat_requests[-1].body["messages"][1]["content"][1]["text"]
    confident = bridge.handle(BridgeRequest("r2", "digits"), CONFIDENT, 3.0, "normal")
    assert (confident.source, confident.text, confident.escalated) == ("edge", "c0", False)
    st = bridge.status()
    assert st["counts"]["requests"] == 2 and st["counts"]["escalated"] == 1 and st["escalation_rate"] == 0.5
    assert st["breaker"]["state"] == "closed" and st["budget"]["remaining"] == 59 and st["outbox"]["depth"] == 0
    bridge.close()


def test_hot_escalates_everything_offloadable_without_running_locally(k2, tmp_path):
    """Hot: a confident request still goes to the cloud and the local model is never run; allow_cloud false runs locally."""
    bridge = make_bridge(k2, tmp_path)
    calls = []

    def run_local():
        calls.append(1)
        return CONFIDENT

    out = bridge.handle(BridgeRequest("r1", "digits"), run_local, 3.0, "hot")
    assert out.source == "cloud" and "thermal state hot" in out.reason and calls == []
    kept = bridge.handle(BridgeRequest("r2", "digits", allow_cloud=False), run_local, 3.0, "hot")
    assert kept.source == "edge" and kept.text == "c0" and calls == [1] and "allow_cloud false" in kept.reason
    bridge.close()


def test_critical_refuses_local_work_with_a_clear_error(k2, tmp_path):
    """Critical and the cloud forbidden: error busy, the local model not run."""
    bridge = make_bridge(k2, tmp_path)
    out = bridge.handle(BridgeRequest("r1", "digits", allow_cloud=False), lambda: pytest.fail("ran locally"), 3.0, "critical")
    assert out.error_code == "busy" and out.text is None and "critical" in out.reason
    bridge.close()


def test_dead_cloud_gives_degraded_local_answers_inside_the_deadline(k2, tmp_path):
    """A hanging cloud: the local answer, degraded, within the deadline; once the breaker opens, at once and with no call."""
    bridge = make_bridge(k2, tmp_path, breaker_failures=2, max_retries=0, timeout_s=60.0)
    k2.fallback = hang(60.0)
    for i in range(2):
        t0 = time.monotonic()
        out = bridge.handle(BridgeRequest(f"r{i}", "digits"), UNSURE, 1.0, "normal")
        assert time.monotonic() - t0 < 20.0  # by the 1 s deadline, not the 60 s the cloud would take
        assert (out.source, out.text, out.degraded) == ("edge", "c0", True) and "cloud failed" in out.reason
    n = len(k2.chat_requests)
    t0 = time.monotonic()
    out = bridge.handle(BridgeRequest("r3", "digits"), UNSURE, 30.0, "normal")
    assert time.monotonic() - t0 < 15.0 and len(k2.chat_requests) == n  # no call, so no wait for the 30 s left
    assert out.degraded and "circuit breaker is open" in out.reason
    assert bridge.status()["breaker"]["state"] == "open" and bridge.status()["last_error"]
    bridge.close()


def test_deadlines_shorter_than_a_working_clouds_answers_do_not_open_the_breaker(k2, tmp_path):
    """A cloud that answers in 0.6 s, asked by requests with 0.3 s deadlines: each is answered locally at its deadline,
    and the breaker stays closed, so a request with time to wait still gets the cloud. Three such requests used to open
    it ('backoff beyond the deadline' counted as the cloud failing), switching the cloud off for every request."""
    bridge = make_bridge(k2, tmp_path, breaker_failures=3, max_retries=0, timeout_s=5.0)
    k2.fallback = delay(0.6, "slow but fine")
    assert bridge.handle(BridgeRequest("warm", "digits"), UNSURE, 5.0, "normal").source == "cloud"
    for i in range(4):
        out = bridge.handle(BridgeRequest(f"tight-{i}", "digits"), UNSURE, 0.3, "normal")
        assert out.source == "edge" and out.degraded, out.reason
    assert bridge.status()["breaker"]["state"] == "closed"
    assert bridge.handle(BridgeRequest("patient", "digits"), UNSURE, 5.0, "normal").source == "cloud"
    # a cloud that dies after answering: only breaker_failures (3) such cuts in a row go uncounted, then they count
    k2.fallback = hang(5.0)
    for i in range(6):
        bridge.handle(BridgeRequest(f"dead-{i}", "digits"), UNSURE, 0.3, "normal")
    assert bridge.status()["breaker"]["state"] == "open"
    bridge.close()


def test_a_cloud_too_slow_for_the_deadline_is_not_even_asked(k2, tmp_path):
    """Once the cloud's median round trip is known, a request with less time left is answered locally at once."""
    bridge = make_bridge(k2, tmp_path)
    k2.fallback = delay(0.12, "slow answer")
    for i in range(5):
        assert bridge.handle(BridgeRequest(f"w{i}", "digits"), UNSURE, 3.0, "normal").source == "cloud"
    n = len(k2.chat_requests)
    out = bridge.handle(BridgeRequest("r", "digits"), UNSURE, 0.1, "normal")
    assert len(k2.chat_requests) == n  # not asked: what the stand-in records is what was sent
    assert out.source == "edge" and out.degraded and "median latency" in out.reason
    assert bridge.status()["cloud_latency_ms"]["p50"] >= 120
    bridge.close()


def test_a_404_is_a_misconfiguration_that_opens_the_breaker(k2, tmp_path):
    """A base_url without /v1, or a model the server does not have: 404 on every request. It is said (naming what
    to check) and opens the breaker at once, instead of counting as a server that is up and costing a call each."""
    from k2_server import status

    bridge = make_bridge(k2, tmp_path, breaker_failures=3)
    k2.fallback = status(404, body={"error": {"message": "Not Found"}})
    out = bridge.handle(BridgeRequest("r0", "digits"), UNSURE, 5.0, "normal")
    assert out.source == "edge" and out.degraded and "no such endpoint or model" in out.reason, out.reason
    assert "base_url" in out.reason and bridge.status()["breaker"]["state"] == "open"
    n = len(k2.chat_requests)
    assert "circuit breaker is open" in bridge.handle(BridgeRequest("r1", "digits"), UNSURE, 5.0, "normal").reason
    assert len(k2.chat_requests) == n
    bridge.close()


def test_a_cloud_judged_too_slow_is_asked_again_once_in_a_while(k2, tmp_path, monkeypatch):
    """The record of a slow cloud does not turn it away for good: one request a LATENCY_PROBE_S is asked anyway, and
    a quick answer clears the record, so the next requests are asked again."""
    import k2edge.cloud_bridge.bridge as bridge_module

    monkeypatch.setattr(bridge_module, "LATENCY_PROBE_S", 0.5)
    bridge = make_bridge(k2, tmp_path)
    k2.fallback = delay(0.4, "slow answer")
    for i in range(5):
        assert bridge.handle(BridgeRequest(f"w{i}", "digits"), UNSURE, 3.0, "normal").source == "cloud"
    k2.fallback = delay(0.0, "quick again")
    n = len(k2.chat_requests)
    assert "median latency" in bridge.handle(BridgeRequest("first", "digits"), UNSURE, 0.3, "normal").reason
    assert len(k2.chat_requests) == n  # turned away, as before; the probe's clock starts
    time.sleep(0.6)
    probe = bridge.handle(BridgeRequest("probe", "digits"), UNSURE, 0.3, "normal")  # asked, and quick
    assert probe.source == "cloud" and probe.text == "quick again", probe.reason
    n = len(k2.chat_requests)
    after = bridge.handle(BridgeRequest("after", "digits"), UNSURE, 0.3, "normal")
    assert after.source == "cloud" and len(k2.chat_requests) == n + 1  # the slow record is gone
    k2.fallback = delay(0.4, "slow again")
    for i in range(5):
        bridge.handle(BridgeRequest(f"s{i}", "digits"), UNSURE, 3.0, "normal")
    n = len(k2.chat_requests)
    bridge.handle(BridgeRequest("probe2", "digits"), UNSURE, 0.3, "normal")  # asked: the probe (times out locally)
    turned = bridge.handle(BridgeRequest("turned", "digits"), UNSURE, 0.3, "normal")
    assert len(k2.chat_requests) == n + 1 and "median latency" in turned.reason  # one probe, then turned away
    bridge.close()


def test_no_edge_model_goes_to_the_cloud_and_fails_clearly_when_it_cannot(k2, tmp_path):
    """No edge model: the cloud answers; with the cloud down the error is cloud_unavailable or deadline_exceeded."""
    bridge = make_bridge(k2, tmp_path, max_retries=0)
    out = bridge.handle(BridgeRequest("r1", "captioner", prompt="describe it"), None, 3.0, "normal")
    assert out.source == "cloud" and "no edge model" in out.reason
    k2.script(status(500))
    failed = bridge.handle(BridgeRequest("r2", "captioner"), None, 3.0, "normal")
    assert failed.error_code == "cloud_unavailable" and failed.text is None
    k2.script(hang(2.0))
    late = bridge.handle(BridgeRequest("r3", "captioner"), None, 0.2, "normal")
    assert late.error_code == "deadline_exceeded"
    bridge.close()


def test_budget_spent_answers_locally(k2, tmp_path):
    """requests_per_minute=1: the second escalation is answered locally, degraded, naming the budget."""
    bridge = make_bridge(k2, tmp_path, requests_per_minute=1)
    assert bridge.handle(BridgeRequest("r1", "digits"), UNSURE, 3.0, "normal").source == "cloud"
    second = bridge.handle(BridgeRequest("r2", "digits"), UNSURE, 3.0, "normal")
    assert second.source == "edge" and second.degraded and "budget" in second.reason
    assert len(k2.chat_requests) == 1
    bridge.close()


def test_escalations_that_made_no_call_spend_no_budget(k2, tmp_path):
    """The budget counts the calls K2 sees: a request that found every concurrency slot taken until its deadline,
    and one refused by the open breaker, are answered locally and spend nothing of it."""
    bridge = make_bridge(k2, tmp_path, requests_per_minute=5, concurrency=1, breaker_failures=1, max_retries=0,
                         timeout_s=3.0)
    k2.script(hang(3.5))
    slow = threading.Thread(target=bridge.handle, args=(BridgeRequest("r1", "digits"), UNSURE, 10.0, "normal"))
    slow.start()
    until = time.monotonic() + 10
    while not k2.chat_requests and time.monotonic() < until:  # r1's call is at K2: its slot is taken for 3 s
        time.sleep(0.01)
    busy = bridge.handle(BridgeRequest("r2", "digits"), UNSURE, 0.3, "normal")
    assert busy.source == "edge" and "already in flight" in busy.reason
    assert bridge.status()["budget"]["remaining"] == 4  # r1's call only
    slow.join()
    assert bridge.breaker.state == "open"  # r1 timed out
    refused = bridge.handle(BridgeRequest("r3", "digits"), UNSURE, 3.0, "normal")
    assert refused.source == "edge" and "breaker" in refused.reason
    assert bridge.status()["budget"]["remaining"] == 4 and len(k2.chat_requests) == 1
    bridge.close()


def test_a_request_the_half_open_breaker_turns_away_spends_no_budget(k2, tmp_path):
    """Half-open, one probe call is out: a second request passes the policy (the cloud is not known down) and the
    client refuses it before any call (BreakerOpen); it is answered locally and gives its request back."""
    bridge = make_bridge(k2, tmp_path, requests_per_minute=10, concurrency=2, breaker_failures=1,
                         breaker_cooldown_s=0.2, max_retries=0, timeout_s=3.0)
    k2.script(status(500), hang(3.5))
    assert bridge.handle(BridgeRequest("r1", "digits"), UNSURE, 3.0, "normal").source == "edge"
    until = time.monotonic() + 10
    while bridge.breaker.state != "half_open" and time.monotonic() < until:
        time.sleep(0.01)
    probe = threading.Thread(target=bridge.handle, args=(BridgeRequest("r2", "digits"), UNSURE, 10.0, "normal"))
    probe.start()
    while len(k2.chat_requests) < 2 and time.monotonic() < until:  # the probe is at K2
        time.sleep(0.01)
    turned = bridge.handle(BridgeRequest("r3", "digits"), UNSURE, 3.0, "normal")
    assert turned.source == "edge" and "breaker" in turned.reason, turned.reason
    assert bridge.status()["budget"]["remaining"] == 8 and len(k2.chat_requests) == 2  # r1's and the probe's calls
    probe.join()
    bridge.close()


def render(item, result):
    """The daemon's renderer of a deferred answer (one builder for every cloud answer)."""
    from k2edge.service.escalation import deferred_answer

    return deferred_answer(item, result, "normal")


def deliver(bridge, publish) -> int:
    """One pass over the outbox, as the daemon's loop makes it."""
    return bridge.outbox.deliver_once(lambda item: bridge.deliver_item(item, publish, render))


def test_deferrable_request_is_delivered_once_across_restarts(k2, tmp_path):
    """Cloud down: the deferrable request waits in the outbox; after a restart it is delivered once, and never again."""
    clock = FakeClock(time.time())
    k2.fallback = status(503)
    state = tmp_path / "state"
    b1 = CloudBridge(settings_for(k2, max_retries=0), state, client=K2Client(settings_for(k2, max_retries=0), KEY),
                     outbox=Outbox(state, clock=clock))
    req = BridgeRequest("req-42", "digits", prompt="what digit?", image=image_bytes("PNG", (900, 900)), deferrable=True,
                        response_topic="clients/7/answers", correlation_data=b"\x01corr",
                        response={"id": "req-42", "model": "digits", "top_k": [{"label": "c0", "score": 0.4}]})
    out = b1.handle(req, UNSURE, 1.0, "normal")
    assert out.deferred and out.degraded and out.source == "edge" and out.text == "c0" and "deferred to the outbox" in out.reason
    assert b1.handle(req, UNSURE, 1.0, "normal").deferred  # the same id again: still one row
    assert b1.status()["outbox"]["depth"] == 1
    b1.close()  # "crash"/restart

    k2.fallback = answer("it is a seven")
    published: list[tuple] = []
    b2 = CloudBridge(settings_for(k2), state, client=K2Client(settings_for(k2), KEY), outbox=Outbox(state, clock=clock))
    assert deliver(b2, lambda topic, corr, payload: published.append((topic, corr, payload))) == 1
    assert len(published) == 1
    topic, corr, payload = published[0]
    assert topic == "clients/7/answers" and corr == b"\x01corr"
    assert payload["id"] == "req-42" and payload["source"] == "cloud" and payload["text"] == "it is a seven"
    assert payload["deferred"] is True and payload["status"] == "ok" and payload["top_k"] == [{"label": "c0", "score": 0.4}]
    mime, img = decode_data_url(k2.chat_requests[-1].body["messages"][1]["content"][0]["image_url"]["url"])
    assert mime == "image/png" and img.size == (768, 768)
    assert deliver(b2, lambda *a: published.append(a)) == 0
    b2.close()

    clock.t += 3600
    b3 = CloudBridge(settings_for(k2), state, client=K2Client(settings_for(k2), KEY), outbox=Outbox(state, clock=clock))
    assert deliver(b3, lambda *a: published.append(a)) == 0 and len(published) == 1
    assert b3.status()["outbox"]["depth"] == 0
    b3.close()


def test_failed_publish_resends_the_stored_answer_without_asking_again(k2, tmp_path):
    """The cloud answered but the publish failed: the next pass publishes the same answer, with no second cloud call."""
    clock = FakeClock(time.time())
    state = tmp_path / "state"
    outbox = Outbox(state, clock=clock)
    outbox.put("r9", "t/9", None, {"request": {"prompt": "q"}, "response": {}, "reason": "test"})
    bridge = CloudBridge(settings_for(k2), state, client=K2Client(settings_for(k2), KEY), outbox=outbox)
    k2.script(answer("first and only answer"))

    def broken(*a):
        raise ConnectionError("broker gone")

    assert deliver(bridge, broken) == 0
    assert outbox.depth() == 1 and outbox.get("r9").result["text"] == "first and only answer"
    clock.t += 600
    got = []
    assert deliver(bridge, lambda *a: got.append(a)) == 1
    assert got[0][2]["text"] == "first and only answer" and len(k2.chat_requests) == 1
    bridge.close()


def test_deliver_pending_runs_in_a_worker_thread_and_stops(k2, tmp_path):
    """The daemon's loop: the outbox's loop on a thread, each row delivered by the bridge; stops when told."""
    bridge = make_bridge(k2, tmp_path)
    bridge.outbox.put("r1", "t/1", None, {"request": {"prompt": "q"}, "response": {}, "reason": "x"})
    got, stop = [], threading.Event()
    t = threading.Thread(target=bridge.outbox.deliver_pending, kwargs={"poll_s": 0.01},
                         args=(lambda item: bridge.deliver_item(item, lambda *a: got.append(a), render), stop))
    t.start()
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join(2)
    assert not t.is_alive() and len(got) == 1 and bridge.status()["counts"]["delivered"] == 1
    bridge.close()


# the outbox ---------------------------------------------------------------------------------------------
def test_outbox_put_is_idempotent_and_claims_hold_a_lease(tmp_path):
    """put twice -> one row; a claimed row is not claimable until its lease expires; WAL is on."""
    clock = FakeClock(1000.0)
    box = Outbox(tmp_path, lease_s=30, clock=clock)
    assert box.put("a", "t/a", b"c", {"x": 1}) and not box.put("a", "t/other", None, {"x": 2})
    assert box.get("a").payload == {"x": 1} and box.get("a").correlation_data == b"c"
    item, = box.claim()
    assert item.id == "a" and item.attempts == 1 and box.claim() == [] and box.due() == []
    clock.t += 31
    assert [i.id for i in box.due()] == ["a"]
    mode = box._db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    box.close()


def test_a_stopping_delivery_loop_starts_no_more_calls_and_gives_its_claimed_rows_back_untried(tmp_path):
    """The daemon stops while a delivery turn holds three claimed rows: the call under way finishes, the two not
    started go back at once (due, not leased, their claim's attempt not counted) for the next start."""
    clock = FakeClock(1000.0)
    box = Outbox(tmp_path, lease_s=30, clock=clock)
    for rid in ("a", "b", "c"):
        box.put(rid, f"t/{rid}", None, {})
    stop, sent = threading.Event(), []

    def send(item):
        sent.append(item.id)
        stop.set()  # the drain begins during this call

    assert box.deliver_once(send, stop=stop) == 1 and sent == ["a"]
    assert [i.id for i in box.due()] == ["b", "c"]
    assert [box.get(r).attempts for r in ("b", "c")] == [0, 0]
    box.close()


def test_outbox_crash_mid_delivery_retries_but_never_resends_a_delivered_id(tmp_path):
    """A process dies holding a lease: after restart the row is claimed again; once delivered, never again."""
    clock = FakeClock(1000.0)
    first = Outbox(tmp_path / "state", lease_s=30, clock=clock)
    first.put("x", "t/x", None, {})
    first.put("y", "t/y", None, {})
    assert {i.id for i in first.claim(limit=2)} == {"x", "y"}
    assert first.mark_delivered("y")
    first.close()  # dies with "x" leased
    second = Outbox(tmp_path / "state", lease_s=30, clock=clock)
    assert second.claim(limit=5) == []  # lease still valid
    clock.t += 31
    again = second.claim(limit=5)
    assert [i.id for i in again] == ["x"] and again[0].attempts == 2
    assert second.mark_delivered("x") and not second.mark_delivered("x")
    second.close()
    third = Outbox(tmp_path / "state", clock=clock)
    clock.t += 3600
    assert third.claim(limit=5) == [] and third.depth() == 0
    third.close()


def dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_lease_whose_holder_is_gone_is_void_when_the_outbox_opens(tmp_path):
    """A daemon killed (kill -9, a crash, a power cut) holding a live request's lease: the restarted daemon takes the
    row at once. The lease used to hold it until it ran out (the request's budget + 30 s), past the request's deadline,
    which then came back deadline_exceeded though the daemon had been down for seconds. A holder still running keeps it."""
    import textwrap

    state = tmp_path / "state"
    holder = textwrap.dedent(f"""
        import sys, time
        from k2edge.cloud_bridge.outbox import Outbox
        box = Outbox({str(state)!r}, lease_s=3600)
        box.put(sys.argv[1], "t", None, {{}}, claim_s=3600)  # taken at once, as a live request is
        print("leased", flush=True)
        time.sleep(float(sys.argv[2]))
    """)
    dead = subprocess.run([sys.executable, "-c", holder, "dead", "0"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert dead.stdout.strip() == "leased", dead.stderr
    alive = subprocess.Popen([sys.executable, "-c", holder, "alive", "600"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert alive.stdout.readline().strip() == "leased"
        box = Outbox(state, lease_s=30)
        box._run(lambda db: db.execute("INSERT INTO outbox (id, response_topic, payload, status, created_at, next_attempt_at, "
                                       "lease_owner, lease_until, attempts) VALUES ('reboot', 't', '{}', 'pending', 0, 0, "
                                       "'an-earlier-boot:1:abc', 1e12, 1)"))
        box.close()
        box = Outbox(state, lease_s=30)  # opened as a restarted daemon opens it
        assert sorted(i.id for i in box.claim(limit=5)) == ["dead", "reboot"]  # "alive" is still held
        box.close()
        # an earlier process with this very pid (PID 1 in a container) is gone too; a holder that could not read its
        # boot id is judged by its pid alone (alive here: it runs)
        from k2edge.cloud_bridge import outbox as outbox_module

        box = Outbox(state, lease_s=30)
        box._run(lambda db: db.execute(
            "INSERT INTO outbox (id, response_topic, payload, status, created_at, next_attempt_at, lease_owner, "
            "lease_until, attempts) VALUES ('same-pid', 't', '{}', 'pending', 0, 0, ?, 1e12, 1)",
            (f"{outbox_module._BOOT}:{os.getpid()}:not-one-of-mine",)))
        box.close()
        box = Outbox(state, lease_s=30)
        assert [i.id for i in box.claim(limit=5)] == ["same-pid"]
        box.close()
        assert outbox_module._alive(f":{alive.pid}:its-token") and not outbox_module._alive(f":{dead_pid()}:gone")
    finally:
        alive.kill()
        alive.wait()


# the command line --------------------------------------------------------------------------------------------
def k2edge_cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "k2edge", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_cloud_check_against_the_stand_in(k2, tmp_path):
    """cloud check: models listed, the configured one marked, a round trip measured; --json for machines; --config works."""
    k2.fallback = answer("OK")
    proc = k2edge_cli("cloud", "check", "--base-url", k2.url, "--model", MODEL, "--api-key-env", "K2_TEST_KEY",
                      env_extra={"K2_TEST_KEY": KEY})
    assert proc.returncode == 0, proc.stderr
    assert "2 model(s) listed" in proc.stdout and f"{MODEL}   <- configured" in proc.stdout and "round trip" in proc.stdout
    assert KEY not in proc.stdout + proc.stderr
    (tmp_path / "k2.key").write_text(KEY)
    cfg = tmp_path / "k2edge.toml"
    cfg.write_text(f'[cloud]\nbase_url = "{k2.url}"\nmodel = "{MODEL}"\napi_key_file = "{tmp_path / "k2.key"}"\n')
    data = json.loads(k2edge_cli("cloud", "check", "--config", str(cfg), "--json").stdout)
    assert data["ok"] and data["reachable"] and data["model_listed"] and data["answer"] == "OK" and data["round_trip_ms"] > 0


def test_cloud_check_reads_the_config_as_the_daemon_does(k2, tmp_path):
    """A relative api_key_file in the config is relative to the config's folder (as the daemon reads it), not to
    the directory the command runs in."""
    k2.fallback = answer("OK")
    (tmp_path / "k2.key").write_text(KEY)
    cfg = tmp_path / "k2edge.toml"
    cfg.write_text(f'[cloud]\nbase_url = "{k2.url}"\nmodel = "{MODEL}"\napi_key_file = "k2.key"\n')
    proc = k2edge_cli("cloud", "check", "--config", str(cfg))  # runs in ROOT, not tmp_path
    assert proc.returncode == 0, proc.stderr
    assert f"key: file {tmp_path / 'k2.key'}" in proc.stdout and KEY not in proc.stdout + proc.stderr


def test_cloud_check_with_an_image_fails_when_the_server_refuses_images(k2, tmp_path):
    """--image checks that the model takes images: a server that refuses image content fails the check in one line,
    although the daemon's vision = "auto" would go on with text (it used to pass, saying "with an image")."""
    k2.fallback = answer("OK")
    picture = tmp_path / "p.png"
    picture.write_bytes(image_bytes("PNG", (64, 48)))
    args = ("cloud", "check", "--base-url", k2.url, "--model", MODEL, "--api-key-env", "K2_TEST_KEY", "--image", str(picture))
    proc = k2edge_cli(*args, env_extra={"K2_TEST_KEY": KEY})
    assert proc.returncode == 0 and "with an image" in proc.stdout, proc.stderr
    assert "image_url" in json.dumps(k2.chat_requests[-1].body)
    k2.refuse_images = True
    proc = k2edge_cli(*args, env_extra={"K2_TEST_KEY": KEY})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "the cloud refused the image" in lines[0], proc.stderr


@pytest.mark.parametrize("args,fragment", [
    (["--base-url", "http://127.0.0.1:9/v1", "--model", MODEL], "GET /v1/models: cannot connect"),
    (["--api-key-env", "K2_UNSET_VAR"], "environment variable K2_UNSET_VAR is not set"),
    (["--config", "/nonexistent.toml"], "does not exist"),
    (["--base-url", "http://127.0.0.1:9/v1", "--model", MODEL, "--image", "/nonexistent.jpg"],  # before the network
     "--image '/nonexistent.jpg' does not exist"),
])
def test_cloud_check_failures_are_one_line(args, fragment):
    """Unreachable endpoint, missing key, missing config: one line on stderr, exit 1."""
    proc = k2edge_cli("cloud", "check", *args)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_cloud_check_refuses_a_malformed_config_and_never_repeats_a_secret(k2, tmp_path):
    """[cloud] that is not a table, a base URL with user:password@ or a query, a key pasted where the name of its
    environment variable goes, an endpoint that answers what is not JSON: one line each, no secret in it."""
    (tmp_path / "c.toml").write_text('cloud = "x"\n')
    cases = [(["--config", str(tmp_path / "c.toml")], "cloud must be a table ([cloud]), got str"),
             (["--base-url", "http://u:URLPW@127.0.0.1:9/v1"], "cloud.base_url: must not hold user:password@"),
             (["--base-url", "http://127.0.0.1:9/v1?key=URLKEY"], "cloud.base_url: must not hold a query"),
             (["--api-key-env", "sk-PASTEDKEY123"], "cloud.api_key_env: must name an environment variable")]
    for args, fragment in cases:
        proc = k2edge_cli("cloud", "check", "--model", MODEL, *args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], proc.stderr
        assert not any(secret in proc.stdout + proc.stderr for secret in ("URLPW", "URLKEY", "PASTEDKEY")), proc.stderr
    k2.garbled_models = True
    proc = k2edge_cli("cloud", "check", "--base-url", k2.url, "--model", MODEL, "--api-key-env", "K2_TEST_KEY",
                      env_extra={"K2_TEST_KEY": KEY})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "GET /v1/models: the server's answer is not the JSON expected (" in proc.stderr, proc.stderr


def test_cloud_check_wrong_key_is_one_line(k2):
    """A key the server rejects: one line naming where the key came from."""
    proc = k2edge_cli("cloud", "check", "--base-url", k2.url, "--model", MODEL, "--api-key-env", "K2_TEST_KEY",
                      env_extra={"K2_TEST_KEY": "sk-wrong-1234567890abcdef"})
    assert proc.returncode == 1 and "rejected the API key from environment variable K2_TEST_KEY" in proc.stderr
    assert "sk-wrong" not in proc.stderr


def test_cloud_curve_on_the_demo_model():
    """cloud curve on the demo set: 0 % is the model's own accuracy, 100 % is perfect, accuracy never falls."""
    proc = k2edge_cli("cloud", "curve", str(ROOT / "models/digits/model.onnx"), "--profile", "cpu-dev", "--dataset",
                      str(ROOT / "models/digits/eval.npz"), "--limit", "200", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    pts = data["points"]
    assert [round(p["share"] * 100) for p in pts] == list(range(0, 101, 5)) and data["samples"] == 200
    assert pts[-1]["accuracy"] == 1.0 and pts[-1]["escalated"] == 200 and pts[0]["escalated"] == 0
    assert all(a["accuracy"] <= b["accuracy"] for a, b in zip(pts, pts[1:]))
    text = k2edge_cli("cloud", "curve", str(ROOT / "models/digits/model.onnx"), "--profile", "cpu-dev", "--dataset",
                      str(ROOT / "models/digits/eval.npz"), "--limit", "50", "--shares", "0,10,100", "--measure", "margin")
    assert text.returncode == 0 and "confidence by margin" in text.stdout and "100 %" in text.stdout


def test_reason_kind_labels_every_reason_the_policy_writes():
    """The metrics' closed escalation labels come from the policy's own sentences (a rewording fails here)."""
    from k2edge.cloud_bridge.policy import reason_kind

    det = LocalResult.from_detections([{"index": 0, "label": "car", "score": 0.45, "box": [0.0, 0.0, 1.0, 1.0]}],
                                      image_size=(10, 10))
    cases = {
        "low_confidence": [decide(EscalationRequest("m"), UNSURE, "normal", settings=S),
                           decide(EscalationRequest("m"), UNSURE, "normal", CloudHealth(False, "down"), settings=S),
                           decide(EscalationRequest("m", allow_cloud=False), UNSURE, "warm", settings=S),
                           decide(EscalationRequest("d"), det, "normal",
                                  settings=EscalationSettings(measure="uncertain_boxes", low=0.3, high=0.6))],
        "thermal": [decide(EscalationRequest("m"), CONFIDENT, "hot", settings=S),
                    decide(EscalationRequest("m", allow_cloud=False), CONFIDENT, "critical", settings=S)],
        "prompt": [decide(EscalationRequest("m", prompt="why?"), CONFIDENT, "normal", settings=S)],
        "no_edge_model": [decide(EscalationRequest("m", has_local_model=False), None, "normal", settings=S)],
    }
    for kind, decisions in cases.items():
        for d in decisions:
            assert reason_kind(d.reason) == kind, (kind, d.reason)
    assert reason_kind("a sentence nobody wrote") == "other" and reason_kind(None) == "other"
