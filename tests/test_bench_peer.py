"""bench/bench_peer.py (k2edge against the hand-written peer) still runs end to end, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_peer.py"
sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.slow
def test_bench_peer_runs_and_prints_the_comparison(tmp_path):
    """A tiny run of both models: both targets answer every request ok, the tables and the JSON carry both sides."""
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--requests", "50", "--rounds", "1", "--warmup", "10",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("throughput, 16 in flight", "p50 round trip, 1 in flight", "answers not ok", "CPU ms per request"):
        assert row in proc.stdout, proc.stdout
    models = json.loads(out.read_text())["models"]
    assert set(models) == {"digits", "detector"} and "== detector ==" in proc.stdout
    for target, summary in ((t, m["summary"]) for t in ("k2edge", "peer") for m in models.values()):
        assert summary[target]["failures"] == 0, summary[target]["errors"]
        assert summary[target]["requests"] == 120  # (10 warm-up + 50) at 16 in flight and at one in flight
        assert summary[target]["throughput"]["throughput_per_s"]["median"] > 0
        assert summary[target]["latency"]["p50_ms"]["median"] > 0
        assert set(summary[target]["throughput"]["cpu_ms_per_request"]) == {"k2edge", "peer", "broker", "loadgen"}
    for summary in (m["summary"] for m in models.values()):
        assert summary["k2edge"]["throughput"]["mean_batch"] >= 1  # k2edge's answers say their batch size
        k, p, versus = summary["k2edge"], summary["peer"], summary["versus_peer"]
        ratio = k["throughput"]["throughput_per_s"]["median"] / p["throughput"]["throughput_per_s"]["median"]
        added = k["latency"]["p50_ms"]["median"] - p["latency"]["p50_ms"]["median"]
        assert versus["throughput_ratio"]["value"] == pytest.approx(ratio)  # one round: its ratio is the median's
        assert versus["throughput_ratio"]["per_round"]["median"] == pytest.approx(ratio)
        assert versus["p50_added_ms"]["value"] == pytest.approx(added)
        assert versus["p50_added_ms"]["per_round"]["median"] == pytest.approx(added)
        assert f"{ratio:.2f}x" in proc.stdout and f"{added:+.3f} ms" in proc.stdout, proc.stdout


def test_bench_peer_refuses_bad_arguments_in_one_line(tmp_path):
    """Bad input: exit 1 and one line, before any broker or daemon starts."""
    proc = subprocess.run([sys.executable, str(BENCH), "--requests", "0"], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "bench_peer: --requests must be at least 1, got 0"
    proc = subprocess.run([sys.executable, str(BENCH), "--tracing", "--baseline-src", str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"bench_peer: --baseline-src {str(tmp_path)!r} is not a k2edge checkout"
    # k2edge's [service] settings are checked by the daemon's own schema before anything starts
    proc = subprocess.run([sys.executable, str(BENCH), "--service", "threads_per_lanes=2"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "bench_peer: --service threads_per_lanes: Extra inputs are not permitted"
    proc = subprocess.run([sys.executable, str(BENCH), "--service", "staging_threads=0"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith("bench_peer: --service staging_threads: "), proc.stderr
    proc = subprocess.run([sys.executable, str(BENCH), "--service", "max_batch=4"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)  # the bench's own setting: stated in its report, not changed behind it
    assert proc.returncode == 2 and "max_batch is the bench's own: use --max-batch" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_bench_peer_tracing_compares_tracing_off_and_on(tmp_path):
    """--tracing: k2edge with tracing off and on answer every request ok; the traced one's spans reach the receiver."""
    pytest.importorskip("opentelemetry.sdk")
    out = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tracing", "--models", "digits", "--requests", "40", "--rounds", "1",
                           "--warmup", "5", "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())["models"]["digits"]
    assert r["summary"]["failures"] == {"off": 0, "on": 0}
    assert r["traced_answers"] == 90 and r["spans_received"] >= 7 * 90  # each request: its span and at least 6 more
    vs = r["summary"]["versus_off"]["on"]
    assert f"{vs['throughput_ratio']['median']:.2f}x" in proc.stdout and "tracing on (all sampled)" in proc.stdout


def test_collapse_counts_own_time_per_function_and_thread():
    """py-spy's raw stacks: the innermost frame gets the own time; every frame once gets inclusive time."""
    from bench_peer import collapse

    raw = ("thread (1): net;loop (t.py:3);read (t.py:9) 6\n"
           "thread (1): net;loop (t.py:3);read (t.py:10) 2\n"
           "thread (2): line;run (r.py:5);loop (t.py:4) 2\n")
    prof = collapse(raw)
    assert prof["samples"] == 10
    assert prof["own"][0] == {"function": "read (t.py)", "samples": 8, "share": 0.8}
    assert prof["own_lines"][0] == {"line": "read (t.py:9)", "samples": 6, "share": 0.6}
    assert {r["function"]: r["samples"] for r in prof["inclusive"]}["loop (t.py)"] == 10
    assert prof["threads"] == [{"thread": "net", "samples": 8, "share": 0.8}, {"thread": "line", "samples": 2, "share": 0.2}]
