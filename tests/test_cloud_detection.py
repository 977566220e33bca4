"""The cloud bridge for detectors: detection-aware escalation measures (warm widens the band), the
escalated request's content (downscaled image, the edge's boxes rescaled to it, the prompt), and
``[cloud] vision``: off / auto after a refusal sends the findings as text, says so, and never
counts the refusal against the breaker. Against the real HTTP stand-in (tests/support/k2_server.py)."""

from __future__ import annotations

import json
import math

import pytest

from k2_server import K2StandIn, answer
from k2edge.cloud_bridge import (BridgeRequest, CloudBridge, CloudRejected, CloudSettings, EscalationPolicy,
                                 EscalationRequest, EscalationSettings, K2Client, LocalResult, decide)
from k2edge.config.tables import validate_settings
from test_cloud_bridge import KEY, MODEL, decode_data_url, image_bytes, settings_for

DETS = ({"index": 0, "label": "car", "score": 0.91, "box": [100.0, 200.0, 500.0, 600.0]},
        {"index": 1, "label": "person", "score": 0.42, "box": [1200.0, 0.0, 1600.0, 1200.0]})


def _local(*scores):
    return LocalResult.from_detections([{**DETS[0], "score": s} for s in scores], latency_ms=3.0, image_size=(1600, 1200))


def test_max_box_score_escalates_when_nothing_is_found_confidently():
    s = EscalationSettings(measure="max_box_score", threshold=0.6)
    req = EscalationRequest("det")
    assert decide(req, _local(0.9, 0.3), "normal", settings=s).action == "local"
    d = decide(req, _local(0.5), "normal", settings=s)
    assert d.action == "cloud" and d.confidence == 0.5 and "max_box_score" in d.reason
    assert decide(req, _local(), "normal", settings=s).confidence == 0.0  # nothing found at all
    assert decide(req, _local(0.7), "warm", settings=s).action == "cloud"  # warm bar 0.8


def test_uncertain_boxes_band_and_warm_widening():
    """Any box in [low, high) escalates; warm moves low halfway to 0 and high halfway to 1."""
    s = EscalationSettings(measure="uncertain_boxes", low=0.3, high=0.6)
    req = EscalationRequest("det")
    assert decide(req, _local(0.95, 0.65, 0.2), "normal", settings=s).action == "local"
    d = decide(req, _local(0.95, 0.45), "normal", settings=s)
    assert d.action == "cloud" and "1 box(es) score within the band [0.300, 0.600)" in d.reason
    assert decide(req, _local(0.6), "normal", settings=s).action == "local"  # high is excluded
    assert s.band(warm=True) == (0.15, 0.8)
    warm = decide(req, _local(0.95, 0.65, 0.2), "warm", settings=s)
    assert warm.action == "cloud" and "warm band [0.150, 0.800)" in warm.reason


def test_measures_must_fit_the_model_and_bands_validate():
    with pytest.raises(ValueError, match="does not fit a classifier"):
        decide(EscalationRequest("c"), LocalResult.from_logits([1.0, 2.0]), "normal",
               settings=EscalationSettings(measure="uncertain_boxes"))
    with pytest.raises(ValueError, match="does not fit a detector"):
        _local(0.5).confidence("max_softmax")
    from k2edge.telemetry import SettingsError

    with pytest.raises(SettingsError, match="models.escalation.high: must be above low"):
        validate_settings(EscalationSettings, {"measure": "uncertain_boxes", "low": 0.6, "high": 0.5}, "models.escalation")
    with pytest.raises(SettingsError, match="warm_low: must be <= low"):
        validate_settings(EscalationSettings, {"low": 0.3, "warm_low": 0.4})


@pytest.fixture
def k2():
    with K2StandIn(api_key=KEY) as server:
        yield server


def _user_parts(server) -> list[dict]:
    return server.chat_requests[-1].body["messages"][1]["content"]


def test_escalated_detection_request_carries_rescaled_boxes(k2):
    """The image goes downscaled; the edge's boxes go as JSON in that image's pixels; the prompt leads."""
    client = K2Client(settings_for(k2, image_max_side=800), KEY)
    ans = client.complete(image_bytes("PNG", (1600, 1200)), None, "Is anyone crossing?", None, 5.0, detections=list(DETS))
    assert ans.cloud_input == "image"
    image_part, text_part = _user_parts(k2)
    _, img = decode_data_url(image_part["image_url"]["url"])
    assert img.size == (800, 600)
    text = text_part["text"]
    assert text.startswith("Is anyone crossing?") and "in pixels of the 800x600 image you received" in text
    found = json.loads(text[text.index("): ") + 3:])
    assert found == [{"label": "car", "score": 0.91, "box": [50.0, 100.0, 250.0, 300.0]},
                     {"label": "person", "score": 0.42, "box": [600.0, 0.0, 800.0, 600.0]}]


def test_vision_off_sends_findings_as_text(k2):
    client = K2Client(settings_for(k2, vision="off"), KEY)
    ans = client.complete(image_bytes("PNG", (1600, 1200)), None, None, None, 5.0, detections=list(DETS))
    parts = _user_parts(k2)
    assert ans.cloud_input == "text" and [p["type"] for p in parts] == ["text"]
    assert "of the 1600x1200 image; the image itself could not be sent" in parts[0]["text"]
    assert '"box": [100.0, 200.0, 500.0, 600.0]' in parts[0]["text"]


def test_masks_keypoints_and_oriented_boxes_reach_the_cloud_as_boxes(k2):
    """Segmentation, pose and obb answers escalate like detections: the measures and the cloud's context read
    label, score and box (an oriented box as the rectangle around it; masks and keypoints stay home)."""
    local = LocalResult.from_detections([
        {**DETS[0], "mask": {"size": [1200, 1600], "counts": "x" * 5000}},
        {**DETS[1], "keypoints": [[1300.0, 100.0, 0.9]] * 17},
        {"index": 2, "label": "ship", "score": 0.66, "rbox": [800.0, 600.0, 200.0, 100.0, math.pi / 2]}],
        image_size=(1600, 1200))
    assert [set(d) for d in local.detections] == [{"index", "label", "score", "box"}] * 3
    assert local.detections[2]["box"] == pytest.approx([750.0, 500.0, 850.0, 700.0])
    assert local.confidence("max_box_score") == 0.91
    client = K2Client(settings_for(k2, vision="off"), KEY)
    client.complete(image_bytes("PNG", (1600, 1200)), None, None, None, 5.0, detections=list(local.detections))
    text = _user_parts(k2)[0]["text"]
    assert '"label": "ship"' in text and "counts" not in text and "keypoints" not in text


def test_vision_auto_falls_back_to_text_once_refused_without_tripping_the_breaker():
    """A text-only server refuses image_url: auto resends as text at once, remembers, and the breaker stays closed."""
    with K2StandIn(api_key=KEY, refuse_images=True) as server:
        client = K2Client(settings_for(server, breaker_failures=1), KEY)
        img = image_bytes("JPEG", (640, 480))
        for _ in range(3):
            ans = client.complete(img, None, "what is here?", None, 5.0, detections=list(DETS[:1]))
            assert ans.cloud_input == "text" and ans.text == "stand-in answer"
        kinds = [[p["type"] for p in r.body["messages"][1]["content"]] for r in server.chat_requests]
        assert kinds == [["image_url", "text"], ["text"], ["text"], ["text"]]  # refused once, then text only
        assert client.breaker.state == "closed" and client.vision_refused
        on = K2Client(settings_for(server, vision="on", breaker_failures=1), KEY)
        with pytest.raises(CloudRejected, match="refused the image"):
            on.complete(img, None, "q", None, 5.0)
        assert on.breaker.state == "closed"


def test_bridge_outcome_says_cloud_input_and_keeps_the_edge_detections(tmp_path):
    """An escalated detection: the cloud's text beside the edge's detections, cloud_input in the outcome."""
    with K2StandIn(api_key=KEY, refuse_images=True) as server:
        server.fallback = answer("a car and a person")
        settings = settings_for(server)
        policy = EscalationPolicy({"det": EscalationSettings(measure="uncertain_boxes", low=0.3, high=0.6)})
        bridge = CloudBridge(settings, tmp_path, policy=policy, client=K2Client(settings, KEY))
        local = LocalResult.from_detections(list(DETS), image_size=(1600, 1200))
        out = bridge.handle(BridgeRequest("r1", "det", image=image_bytes("PNG", (1600, 1200))), lambda: local, 5.0)
        assert out.source == "cloud" and out.text == "a car and a person" and out.cloud_input == "text"
        assert out.to_dict()["cloud_input"] == "text" and out.local.detections == DETS
        assert bridge.breaker.state == "closed"
        bridge.close()


def test_cloud_settings_vision_values():
    assert CloudSettings(model=MODEL).vision == "auto"
    from k2edge.telemetry import SettingsError

    with pytest.raises(SettingsError, match="cloud.vision: must be one of 'auto', 'on' or 'off'"):
        validate_settings(CloudSettings, {"vision": "maybe"}, "cloud")


def test_hot_with_no_image_the_cloud_takes_and_no_prompt_is_answered_locally(tmp_path):
    """The hot state sends every offloadable request to the cloud before any local work. With vision off (or images
    refused) and no prompt, the cloud was asked about an image it could not see, with no findings, and its answer
    ("I cannot see any image") stood for the request's. Nothing to ask: the local answer, saying why; in the critical
    state (no local work) busy. With a prompt, the cloud is asked as before."""
    with K2StandIn(api_key=KEY) as server:
        server.fallback = answer("I cannot see any image.")
        settings = settings_for(server, vision="off")
        bridge = CloudBridge(settings, tmp_path, policy=EscalationPolicy({}), client=K2Client(settings, KEY))
        local = LocalResult.from_detections(list(DETS), image_size=(1600, 1200))
        ran = []

        def thunk():
            ran.append(1)
            return local

        img = image_bytes("PNG", (640, 480))
        out = bridge.handle(BridgeRequest("h1", "det", image=img), thunk, 5.0, thermal_state="hot")
        assert out.source == "edge" and out.degraded and ran == [1] and not server.chat_requests, out.reason
        assert "the cloud takes no image here" in out.reason and out.reason.endswith("answered locally")
        busy = bridge.handle(BridgeRequest("c1", "det", image=img), thunk, 5.0, thermal_state="critical")
        assert busy.error_code == "busy" and ran == [1] and not server.chat_requests
        asked = bridge.handle(BridgeRequest("p1", "det", image=img, prompt="is the car parked?"), thunk, 5.0,
                              thermal_state="hot")
        assert asked.source == "cloud" and len(server.chat_requests) == 1
        bridge.close()
    # the client itself makes no such call (a deferred row delivered later goes to it directly)
    with K2StandIn(api_key=KEY) as server:
        client = K2Client(settings_for(server, vision="off"), KEY)
        with pytest.raises(CloudRejected, match="asks nothing"):
            client.complete(img, None, None, None, 5.0)
        assert not server.chat_requests and client.breaker.state == "closed"
    # vision "auto" on a server that refuses images, the first time: not resent as an empty question either
    with K2StandIn(api_key=KEY, refuse_images=True) as server:
        server.fallback = answer("I cannot see any image.")
        settings = settings_for(server)
        bridge = CloudBridge(settings, tmp_path / "auto", policy=EscalationPolicy({}), client=K2Client(settings, KEY))
        out = bridge.handle(BridgeRequest("a1", "det", image=img), thunk, 5.0, thermal_state="hot")
        assert out.source == "edge" and out.degraded and "asks nothing" in out.reason, out.reason
        assert len(server.chat_requests) == 1 and bridge.client.vision_refused  # the refused one only
        assert bridge.status()["breaker"]["state"] == "closed"
        bridge.close()
