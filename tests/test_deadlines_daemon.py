"""Deadlines kept under load: with every core busy, an escalated request (a prompt, or low confidence)
to a cloud that hangs, or answers only after 3 s, still gets its local answer (``ok``, ``degraded``)
within its ``deadline_ms`` at the requester, give or take the publish."""

from __future__ import annotations

import base64
import multiprocessing
import os
import time
import uuid

import pytest

from k2_server import answer, hang, K2StandIn
from mqtt_support import DIGITS, SAMPLES, TOPIC, Client

pytestmark = pytest.mark.slow

DEADLINE_MS = 1500
SLACK_MS = 150  # from the daemon's answer to the requester: the publish through the broker
PER_KIND = 8  # requests of each kind (prompt, low confidence) per cloud behaviour


def _spin(stop) -> None:
    while not stop.is_set():
        pass


@pytest.fixture
def busy_cores():
    """One busy process per core (``os.cpu_count()``), for as long as the test runs."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 1)]
    for p in procs:
        p.start()
    yield len(procs)
    stop.set()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()


def _img(path, **extra) -> dict:
    return {"id": uuid.uuid4().hex[:10], "image": base64.b64encode(path.read_bytes()).decode(), **extra}


@pytest.mark.parametrize("cloud", ["hangs", "answers after 3 s"])
def test_escalated_requests_keep_their_deadline_with_every_core_busy(run_daemon, broker, busy_cores, cloud):
    """Prompt and low-confidence requests, each with deadline_ms 1500, every core busy: each gets its local
    answer, degraded, within deadline_ms + 150 ms of being sent."""
    with K2StandIn() as k2:
        k2.fallback = hang(10.0) if cloud == "hangs" else answer("too late", delay_s=3.0)
        cloud_cfg = {"base_url": k2.url, "model": "kimi-k2.5", "api_key_env": "K2_TEST_KEY", "timeout_s": 5.0,
                     "max_retries": 0, "breaker_failures": 1000, "concurrency": 4}
        run_daemon(models=[{**DIGITS, "escalation": {"threshold": 0.9999999}}], env={"K2_TEST_KEY": "sk-test-key-123"},
                   tables={"cloud": cloud_cfg})
        client = Client(broker.port).connect()
        sent: dict[bytes, tuple[str, float]] = {}
        for i in range(PER_KIND):
            for kind, extra in (("prompt", {"prompt": "Is this written neatly?"}), ("low confidence", {})):
                body = _img(SAMPLES[i % len(SAMPLES)], deadline_ms=DEADLINE_MS, **extra)
                t = time.monotonic()
                corr = client.publish(TOPIC, body)
                sent[corr] = (kind, t)
                time.sleep(0.05)  # one at a time, as requesters do: each its own cloud call
        client.wait_for(lambda c: len(c.answers) >= len(sent), 60)
        missed = []  # (kind, ms at the requester, what came) of every answer not ok, degraded and in time
        for (a, corr), (_, arrived) in zip(client.answers, client.raw):
            kind, t = sent[corr]
            elapsed_ms = round((arrived - t) * 1e3)
            good = a["status"] == "ok" and a.get("degraded") is True and a.get("source") == "edge"
            if not good or elapsed_ms > DEADLINE_MS + SLACK_MS:
                missed.append((kind, elapsed_ms, a["status"] if good else (a.get("error") or a.get("source"))))
        client.close()
    judged = len(client.answers)
    assert judged == 2 * PER_KIND, f"{judged} answers judged"
    assert not missed, f"{len(missed)} of {judged} answers (cores busy: {busy_cores}) were not a degraded local " \
                       f"answer within {DEADLINE_MS + SLACK_MS} ms: {missed}"
