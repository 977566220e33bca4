"""pareto-sweep: the front and recommendation on hand-made points, and real sweeps of the demo model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from k2edge import load_profile
from k2edge.sweep import (MeasureSettings, Point, SweepError, SweepSpec, balanced_costs, config_key, confidence_curve,
                          dominates, pareto_front, parse_grid, recommend, run_sweep, sweep_configs)
from k2edge.sweep.progress import SweepProgress
from k2edge.sweep.sampler import TelemetrySampler
from k2edge.telemetry.base import Sample

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "digits" / "model.onnx"
EVAL = ROOT / "models" / "digits" / "eval.npz"
SMALL = MeasureSettings(runs=2, warmup=5, requests=40, limit=120)


def names(points):
    return [p.name for p in points]


# --- the front ---------------------------------------------------------------------------------

def test_front_of_one_point_is_that_point():
    """A single point is the whole front."""
    assert names(pareto_front([Point("a", 1.0, 0.9)])) == ["a"]
    assert pareto_front([]) == []


def test_front_drops_a_dominated_point():
    """Slower and less accurate is dominated; a strictly better point stays."""
    pts = [Point("fast", 1.0, 0.95), Point("slow", 2.0, 0.90), Point("accurate", 3.0, 0.99)]
    assert names(pareto_front(pts)) == ["fast", "accurate"]


def test_front_breaks_a_tie_in_one_objective_on_the_others():
    """Equal latency: the more accurate point dominates; equal accuracy: the faster one does."""
    assert names(pareto_front([Point("a", 1.0, 0.90), Point("b", 1.0, 0.95)])) == ["b"]
    assert names(pareto_front([Point("a", 1.0, 0.95), Point("b", 2.0, 0.95)])) == ["a"]


def test_front_keeps_both_duplicates():
    """Two points equal on every objective do not dominate each other."""
    pts = [Point("a", 1.0, 0.95, 0.2), Point("b", 1.0, 0.95, 0.2), Point("c", 1.5, 0.9, 0.3)]
    assert names(pareto_front(pts)) == ["a", "b"]


def test_front_holds_every_point_of_a_trade_off():
    """Each point buys accuracy with latency: all on the front."""
    pts = [Point(str(i), 1.0 + i, 0.90 + 0.01 * i) for i in range(5)]
    assert names(pareto_front(pts)) == names(pts)


def test_front_with_a_missing_energy_column():
    """Energy unknown everywhere: latency and accuracy decide; unknown on one side: left out of that comparison."""
    no_energy = [Point("a", 1.0, 0.95), Point("b", 2.0, 0.95), Point("c", 3.0, 0.99)]
    assert names(pareto_front(no_energy)) == ["a", "c"]
    # Same latency and accuracy: energy decides only where both points have it.
    pts = [Point("known_low", 1.0, 0.95, 0.1), Point("known_high", 1.0, 0.95, 0.3), Point("unknown", 1.0, 0.95, None)]
    assert names(pareto_front(pts)) == ["known_low", "unknown"]
    # Energy can keep a slower point on the front.
    pts = [Point("fast", 1.0, 0.95, 0.5), Point("frugal", 2.0, 0.95, 0.1)]
    assert names(pareto_front(pts)) == ["fast", "frugal"]


def test_dominance_needs_an_objective_known_for_both():
    """No shared objective: neither dominates."""
    assert not dominates(Point("a", None, 0.9), Point("b", 1.0, None))
    assert dominates(Point("a", 1.0, 0.9), Point("b", 1.0, 0.8))
    assert not dominates(Point("a", 1.0, 0.9), Point("a2", 1.0, 0.9))


# --- the recommendation ------------------------------------------------------------------------

PTS = [
    Point("fast", 1.0, 0.90, None, latency_p99_ms=3.0),
    Point("mid", 2.0, 0.95, None, latency_p99_ms=2.5),
    Point("best", 4.0, 0.99, None, latency_p99_ms=5.0),
    Point("best_slow", 5.0, 0.99, None, latency_p99_ms=6.0),
]


def test_recommend_latency_and_accuracy_goals():
    """latency: lowest p50; accuracy: highest top-1, the faster of equals."""
    assert recommend(PTS, "latency").name == "fast"
    rec = recommend(PTS, "accuracy")
    assert rec.name == "best" and "99.00 %" in rec.reason


def test_recommend_energy_goal_says_when_energy_is_unknown():
    """energy: lowest J where known; none known -> no recommendation with the reason."""
    rec = recommend(PTS, "energy", energy_unknown_reason="no power rail found (not a Jetson)")
    assert rec.name is None and "unknown" in rec.reason and "not a Jetson" in rec.reason
    pts = PTS[:2] + [Point("frugal", 3.0, 0.9, 0.05), Point("hungry", 1.0, 0.9, 0.2)]
    rec = recommend(pts, "energy")
    assert rec.name == "frugal" and "2 configuration(s) without an energy reading" in rec.reason


def test_recommend_constraints_filter_first():
    """--max-latency-ms constrains p99, --min-accuracy top-1; nothing left -> the reason."""
    assert recommend(PTS, "accuracy", max_latency_ms=2.8).name == "mid"
    assert recommend(PTS, "latency", min_accuracy=0.95).name == "mid"
    rec = recommend(PTS, "balanced", max_latency_ms=1.0)
    assert rec.name is None and "p99 latency <= 1 ms" in rec.reason


def test_balanced_cost_weighs_accuracy_points_against_latency_percent():
    """Costs by hand: points of top-1 given up, plus 10 % of latency over the fastest as one point; sizes count."""
    front = pareto_front(PTS)
    assert names(front) == ["fast", "mid", "best"]
    costs = balanced_costs(front)
    assert costs["fast"] == pytest.approx(9.0)  # 9 points below best, the fastest
    assert costs["mid"] == pytest.approx(4.0 + 10.0)  # 4 points, 100 % slower
    assert costs["best"] == pytest.approx(0.0 + 30.0)  # the highest, 300 % slower
    rec = recommend(PTS, "balanced")
    assert rec.name == "fast" and rec.costs["fast"] == pytest.approx(9.0)
    assert "9.00 point(s) below best's 99.00 %" in rec.reason and "the fastest" in rec.reason
    # two front points always scored 0.5 each under min-max rescaling, and the faster won: sizes count now
    two = [Point("quick", 1.0, 0.80), Point("accurate", 1.01, 0.99)]
    rec = recommend(two, "balanced")
    assert rec.name == "accurate" and "1.0 % slower than quick's 1.000 ms" in rec.reason, rec.reason
    assert recommend([Point("quick", 1.0, 0.97), Point("slow", 10.0, 0.985)], "balanced").name == "quick"
    # energy, known for every point, is averaged with latency
    energy = [Point("a", 1.0, 0.9, 2.0), Point("b", 2.0, 0.9, 1.0)]
    assert balanced_costs(energy) == pytest.approx({"a": 5.0, "b": 5.0})
    why = recommend(energy, "balanced").reason
    assert "1.000 ms p50, the fastest; 2 J per inference, 100.0 % more energy than b's 1 J" in why, why
    assert "(a point of top-1 weighs as much as 10 % of latency and energy, averaged)" in why, why
    assert "tie-break" in recommend([Point("x", None, 0.9), Point("y", 1.0, None)], "balanced").reason
    with pytest.raises(ValueError):
        recommend(PTS, "fastest")


# --- the confidence curve ------------------------------------------------------------------------

def test_confidence_curve_by_hand():
    """Escalating the least confident requests (counted correct) raises accuracy step by step."""
    conf = [0.9, 0.2, 0.6, 0.4]
    correct = [True, False, True, False]
    curve = {c["escalated_pct"]: c for c in confidence_curve(conf, correct, step_pct=25)}
    assert [curve[p]["accuracy"] for p in (0, 25, 50, 75, 100)] == [0.5, 0.75, 1.0, 1.0, 1.0]
    assert curve[25]["max_confidence_escalated"] == 0.2 and curve[0]["max_confidence_escalated"] is None
    assert curve[50]["edge_accuracy"] == 1.0 and curve[100]["edge_accuracy"] is None
    full = confidence_curve(np.linspace(0, 1, 540), np.arange(540) % 3 > 0)
    assert len(full) == 21 and all(a["accuracy"] <= b["accuracy"] for a, b in zip(full, full[1:]))


# --- configurations ------------------------------------------------------------------------------

def test_grid_parsing_names_and_stable_keys():
    """Grid values parse, names list them, identical settings share a key, duplicates are measured once."""
    grid = parse_grid(["offload_ratio=0.2,0.5", "precision=fp16,int8+fp16", "prefetch=off", "partition=block-wise"])
    assert grid["precision"] == [["fp16"], ["int8", "fp16"]] and grid["prefetch"] == [False]
    configs, notes = sweep_configs(["c5"], ["offload_ratio=0.2,0.5", "precision=fp16,int8+fp16"])
    assert [c.name for c in configs] == ["c5-r0.2-fp16", "c5-r0.2-int8+fp16", "c5-r0.5-fp16", "c5-r0.5-int8+fp16"]
    assert configs[3].profile["edge_runtime"]["precision_fallback"] == ["int8", "fp16"]
    assert configs[3].profile["edge_runtime"]["tensorrt_partition"] == "block-wise"  # from c5
    # c1 spelled as a grid point over the defaults has c1's key.
    c1_again, _ = sweep_configs(None, ["offload_ratio=0.35", "precision=fp16+int8"])
    assert c1_again[0].key == config_key(load_profile("c1"))
    configs, notes = sweep_configs(["c1"], ["offload_ratio=0.35,0.350"])
    assert len(configs) == 1
    configs, notes = sweep_configs(["c5", "c5"])
    assert len(configs) == 1 and "measured once" in notes[0]
    assert [c.name for c in sweep_configs()[0]] == ["c1", "c2", "c3", "c4", "c5", "c6"]


@pytest.mark.parametrize("item, fragment", [
    ("offload_ratio=1.7", "edge_runtime.offload_ratio: must be within [0, 1], got 1.7"),
    ("speed=1,2", "unknown key 'speed'"),
    ("batch_size=two", "not a number"),
    ("prefetch=maybe", "on/off"),
    ("precision=fp8", "edge_runtime.precision_fallback"),
    ("offload_ratio", "KEY=V1,V2"),
])
def test_bad_grid_values_name_the_problem(item, fragment):
    """A bad grid is a user error naming the key or field."""
    with pytest.raises(SweepError, match=None) as err:
        sweep_configs(None, [item])
    assert fragment in str(err.value)


# --- telemetry -----------------------------------------------------------------------------------

class FakeRail:
    """A telemetry source with a power rail and a thermal zone that warms up."""

    state, message = "ok", ""

    def __init__(self, watts: float = 8.0) -> None:
        self.watts = watts
        self.n = 0
        self.closed = False

    def sample(self):
        self.n += 1
        return Sample(time.monotonic(), {"cpu": 40.0 + min(self.n, 20) * 0.5, "gpu": 35.0},
                      {"VDD_IN": self.watts}, self.watts)

    def close(self):
        self.closed = True


class NoRail(FakeRail):
    state, message = "unknown", "no power rail found (not a Jetson)"

    def sample(self):
        return Sample(time.monotonic(), {}, {}, None)


class Broken(FakeRail):
    def sample(self):
        raise OSError("i2c bus gone")


def test_sampler_computes_energy_per_inference_from_a_rail():
    """With a rail: J per inference = power x window / inferences; peak temperature from the zones."""
    src = FakeRail(watts=8.0)

    def wait_samples(n: int, since: float) -> None:  # however fast or slow the sampler's thread runs here
        deadline = time.monotonic() + 60
        while len(sampler.samples(since)) < n and time.monotonic() < deadline:
            time.sleep(0.005)

    with TelemetrySampler(src, interval_s=0.02) as sampler:
        wait_samples(2, float("-inf"))
        t0 = time.monotonic()
        wait_samples(10, t0)
        t1 = time.monotonic()
        wait_samples(2, t1)  # readings past the window's end, to interpolate to it
        joules, reason = sampler.energy_per_inference(t0, t1, 100)
        peak, sensor = sampler.peak_temperature(t0, t1)
    assert reason is None and joules == pytest.approx(8.0 * (t1 - t0) / 100, rel=1e-6)
    assert sensor == "cpu" and 40.0 < peak <= 50.0
    assert src.closed


def test_sampler_without_rail_or_with_a_failing_sensor_says_why():
    """No rail: None with the source's message; a failing sensor: None with the failure."""
    with TelemetrySampler(NoRail(), interval_s=0.02) as sampler:
        deadline = time.monotonic() + 60
        while not sampler.samples() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sampler.energy_per_inference(0, time.monotonic(), 10) == (None, "no power rail found (not a Jetson)")
        assert sampler.peak_temperature(0, time.monotonic())[0] is None
    with TelemetrySampler(Broken(), interval_s=0.02) as sampler:
        deadline = time.monotonic() + 60
        while sampler.state != "failed" and time.monotonic() < deadline:
            time.sleep(0.005)
        joules, reason = sampler.energy_per_inference(0, time.monotonic(), 10)
        assert joules is None and "i2c bus gone" in reason and sampler.state == "failed"


# --- real sweeps of the demo model ------------------------------------------------------------------

def sweep(out: Path, profiles, settings=SMALL, telemetry=None, model=MODEL, resume=False, progress=None, **kw):
    configs, _ = sweep_configs(profiles)
    spec = SweepSpec(model=model, dataset=EVAL, out=out, settings=settings, **kw)
    return run_sweep(spec, configs, resume=resume, telemetry=telemetry or NoRail(), progress=progress)


def test_sweep_records_honest_numbers_and_a_loadable_recommendation(tmp_path):
    """Two real configurations: every metric, the spread, the curve, energy from a rail, and the outputs."""
    outcome = sweep(tmp_path, ["c5", "c3"], telemetry=FakeRail(watts=8.0), goal="latency")
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["status"] == "complete" and not outcome.interrupted
    assert doc["backend"]["name"] == "onnxruntime" and doc["backend"]["version"]
    assert doc["machine"]["cores"] == os.cpu_count() and "CPU lane" in doc["machine"]["accelerators"]
    assert doc["dataset"]["samples"] == 120 and doc["settings"]["runs"] == 2
    assert doc["calibration"] == str(ROOT / "models" / "digits" / "calib")  # c3's INT8 was calibrated on the one beside it
    by = {r["name"]: r for r in doc["configs"]}
    assert by["c5"]["devices"] == ["gpu (cpu lane)"]
    assert sorted(by["c3"]["devices"]) == ["dla0 (cpu lane)", "dla1 (cpu lane)", "gpu (cpu lane)"]
    for r in doc["configs"]:
        assert r["status"] == "ok"
        lat = r["latency_ms"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"] and lat["requests"] == 80
        assert len(r["runs"]) == 2 and r["spread"]["latency_p50_ms"]["runs"] == 2
        assert r["spread"]["latency_p50_ms"]["min"] <= lat["p50"] <= r["spread"]["latency_p50_ms"]["max"]
        assert r["top1"] >= 0.95 and r["samples"] == 120
        curve = r["confidence_curve"]
        assert curve[0]["accuracy"] == r["top1"] and curve[-1]["accuracy"] == 1.0 and len(curve) == 21
        for run in r["runs"]:  # 8 W over each throughput window
            assert run["energy_j_per_inference"] == pytest.approx(8.0 / run["throughput_per_s"], rel=0.05)
        assert r["energy_reason"] is None and r["peak_temperature_sensor"] == "cpu"
    assert doc["recommendation"]["name"] == min(doc["configs"], key=lambda r: r["latency_ms"]["p50"])["name"]
    assert doc["pareto_front"] and all(by[n]["on_front"] for n in doc["pareto_front"])
    rec = json.loads((tmp_path / "recommended.json").read_text())
    profile = load_profile(tmp_path / "recommended.json")
    assert profile.to_dict()["edge_runtime"] == by[doc["recommendation"]["name"]]["profile"]["edge_runtime"]
    assert "pareto-sweep" in rec["description"] and "CPU lanes" in rec["description"]
    rows = (tmp_path / "results.csv").read_text().splitlines()
    assert rows[0].startswith("name,key,status") and len(rows) == 3


def test_png_shows_the_points_of_results_json(tmp_path):
    """Every measured configuration is drawn where results.json puts it, front points in the front colour."""
    from PIL import Image

    from k2edge.sweep.report import FRONT_COLOUR, OTHER_COLOUR

    sweep(tmp_path, ["c5", "c6", "cpu-dev"])
    doc = json.loads((tmp_path / "results.json").read_text())
    img = Image.open(tmp_path / "pareto.png")
    plotted = {p["name"]: p for p in json.loads(img.text["k2edge.points"])}
    ok = [r for r in doc["configs"] if r["status"] == "ok"]
    assert set(plotted) == {r["name"] for r in ok}
    rgb = img.convert("RGB")

    def hex_rgb(h):
        return tuple(int(h[i:i + 2], 16) for i in (1, 3, 5))

    def colour_of(p):
        return hex_rgb(FRONT_COLOUR if p["on_front"] else OTHER_COLOUR)

    for r in ok:
        p = plotted[r["name"]]
        assert p["latency_ms"] == pytest.approx(r["latency_ms"]["p50"]) and p["top1_pct"] == pytest.approx(100 * r["top1"])
        assert p["on_front"] == r["on_front"] and p["recommended"] == r["recommended"]
        x, y = (round(v) for v in p["pixel"])
        assert 0 < x < img.width and 0 < y < img.height
        # The marker's colour is at its centre, unless another marker within a marker's radius covers it: its fill or
        # its black edge (a front marker is drawn above the others, a dominated one above those drawn before it; the
        # measured latencies can put two configurations at one pixel)
        near = [q for q in plotted.values() if q is not p and np.hypot(*np.subtract(q["pixel"], p["pixel"])) < 8]
        allowed = [colour_of(p)] + [colour_of(q) for q in near] + ([(0, 0, 0)] if near else [])
        got = rgb.getpixel((x, y))
        assert any(np.abs(np.subtract(got, want)).max() <= 40 for want in allowed), (r["name"], got)


def test_a_configuration_that_cannot_be_built_is_recorded_and_the_sweep_goes_on(tmp_path):
    """INT8 without a calibration set fails with its reason; the next configuration is measured."""
    model = tmp_path / "model" / "model.onnx"
    model.parent.mkdir()
    shutil.copy(MODEL, model)  # no calib/ beside this copy
    outcome = sweep(tmp_path / "out", ["c2", "c5"], model=model)
    by = {r["name"]: r for r in outcome.doc["configs"]}
    assert by["c2"]["status"] == "failed" and "calibration set" in by["c2"]["error"]
    assert by["c5"]["status"] == "ok" and outcome.doc["recommendation"]["name"] == "c5"
    assert not by["c2"]["on_front"]
    from k2edge.sweep.report import print_table
    import io

    text = print_table(outcome.doc, io.StringIO())
    assert "c2" in text and "failed" in text and "calibration set" in text


class InterruptAt(SweepProgress):
    """Presses Ctrl-C when the sweep reaches step ``index`` (a step is one run of one configuration)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.steps = 0

    def begin_step(self, label):
        if self.steps == self.index:
            raise KeyboardInterrupt
        self.steps += 1


def test_interrupt_keeps_what_was_measured_and_resume_continues(tmp_path):
    """Ctrl-C mid-sweep keeps every finished run; --resume adds only the missing runs; another model is refused."""
    # Rounds: c5 run 1, c6 run 1, c5 run 2, [Ctrl-C] c6 run 2.
    first = sweep(tmp_path, ["c5", "c6"], progress=InterruptAt(3))
    assert first.interrupted and first.measured == ["c5", "c6"]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["status"] == "interrupted" and not (tmp_path / "recommended.json").exists()
    by = {r["name"]: r for r in doc["configs"]}
    assert (by["c5"]["status"], len(by["c5"]["runs"])) == ("ok", 2)
    assert (by["c6"]["status"], len(by["c6"]["runs"])) == ("partial", 1)
    second = sweep(tmp_path, ["c5", "c6"], resume=True)
    assert second.reused == ["c5", "c6"] and second.measured == ["c6"]
    doc2 = json.loads((tmp_path / "results.json").read_text())
    by2 = {r["name"]: r for r in doc2["configs"]}
    assert doc2["status"] == "complete" and [r["name"] for r in doc2["configs"]] == ["c5", "c6"]
    assert by2["c5"]["runs"] == by["c5"]["runs"] and by2["c5"]["measured_at"] == by["c5"]["measured_at"]
    assert by2["c6"]["status"] == "ok" and by2["c6"]["runs"][0] == by["c6"]["runs"][0] and len(by2["c6"]["runs"]) == 2
    assert (tmp_path / "recommended.json").exists()
    other = tmp_path / "other.onnx"
    import onnx

    m = onnx.load(str(MODEL))
    m.doc_string = "another model"
    onnx.save(m, str(other))
    with pytest.raises(SweepError, match="another model"):
        sweep(tmp_path, ["c5"], model=other, resume=True)
    with pytest.raises(SweepError, match="--runs 2"):
        sweep(tmp_path, ["c5"], settings=MeasureSettings(runs=3, warmup=5, requests=40, limit=120), resume=True)


def test_a_damaged_results_file_is_refused_in_one_line_on_resume(tmp_path):
    """--resume on a results.json that is not UTF-8, or whose parts have the wrong shape: a SweepError naming
    the damage, never a traceback from the middle of the sweep."""
    from k2edge.sweep.results import SCHEMA, load_previous

    path = tmp_path / "results.json"
    path.write_bytes(b"\x94\xff")
    with pytest.raises(SweepError, match="cannot read"):
        load_previous(path)
    for damaged, what in (({"model": None}, "'model' is not an object"), ({"configs": None}, "'configs' is not a list"),
                          ({"configs": [5]}, r"configs\[0\] has no 'key' and 'name'"),
                          ({"configs": [{"key": "k"}]}, r"configs\[0\] has no 'key' and 'name'")):
        path.write_text(json.dumps({"schema": SCHEMA, **damaged}))
        with pytest.raises(SweepError, match=f"damaged \\({what}"):
            load_previous(path)
    path.write_text(json.dumps({"schema": SCHEMA, "model": {}, "configs": [{"key": "k", "name": "c5"}]}))
    assert load_previous(path)["configs"][0]["name"] == "c5"


def test_two_sweeps_of_one_configuration_agree_within_the_reported_spread(tmp_path):
    """Swept twice, each configuration's headline p50 and throughput differ by no more than the two per-run ranges
    together (their runs' spans overlap: the sweeps run one after the other, on a machine whose load may change)."""
    settings = MeasureSettings(runs=7, warmup=20, requests=100, limit=60)
    a = sweep(tmp_path / "a", ["c5", "c6"], settings=settings).doc["configs"]
    b = sweep(tmp_path / "b", ["c5", "c6"], settings=settings).doc["configs"]
    for ra, rb in zip(a, b):
        assert ra["name"] == rb["name"] and ra["top1"] == rb["top1"]
        for metric, value in (("latency_p50_ms", lambda r: r["latency_ms"]["p50"]),
                              ("throughput_per_s", lambda r: r["throughput_per_s"])):
            allowed = ra["spread"][metric]["range"] + rb["spread"][metric]["range"]
            assert abs(value(ra) - value(rb)) <= allowed, (ra["name"], metric, value(ra), value(rb), allowed)


# --- the command line ------------------------------------------------------------------------------

def k2edge(*args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kw.setdefault("timeout", 900)  # a guard against a hang, not a speed claim
    return subprocess.run([sys.executable, "-m", "k2edge", *args], capture_output=True, text=True, cwd=ROOT, env=env, **kw)


def test_cli_table_json_and_user_errors(tmp_path):
    """The command prints the table with the front marked, --json the document; bad input is one line, exit 1."""
    common = [str(MODEL), "--dataset", str(EVAL), "--runs", "2", "--requests", "30", "--warmup", "5", "--limit", "60"]
    proc = k2edge("pareto-sweep", *common, "--profiles", "c5", "c6", "--out", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stderr
    assert "★" in proc.stdout and "c5" in proc.stdout and "c6" in proc.stdout and "cpu lane" in proc.stdout
    assert "recommended.json" in proc.stdout and "[4/4]" in proc.stderr and "configuration 2/2 done" in proc.stderr
    proc = k2edge("pareto-sweep", *common, "--profiles", "c5", "--out", str(tmp_path / "j"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["configs"][0]["name"] == "c5"
    for bad, fragment in ((["--grid", "offload_ratio=2"], "must be within [0, 1]"),
                          (["--min-accuracy", "150"], "percentage"),
                          (["--profiles", "nope"], "profile 'nope' not found"),
                          (["--min-accuracy", "99.5%"], "cannot be told on 60 sample(s), where a single miss moves top-1 by 1.7 "
                                                       "points: not enough data; give at least 200 samples (a larger --limit)")):
        proc = k2edge("pareto-sweep", *common, "--out", str(tmp_path / "bad"), *bad)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and fragment in proc.stderr, proc.stderr
    proc = k2edge("pareto-sweep", *common, "--profiles", "c5", "--goal", "energy", "--out", str(tmp_path / "e"))
    assert proc.returncode == 1 and "--goal energy needs a power reading, and there is none here" in \
        proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not (tmp_path / "e" / "results.json").exists()  # refused before measuring


@pytest.mark.slow
def test_cli_ctrl_c_keeps_results_and_resume_finishes(tmp_path):
    """SIGINT mid-sweep: exit 130, results kept, the resume command printed; --resume completes the sweep."""
    out = tmp_path / "s"
    args = ["pareto-sweep", str(MODEL), "--dataset", str(EVAL), "--profiles", "c5", "c6", "cpu-dev", "c1",
            "--runs", "3", "--requests", "300", "--warmup", "10", "--limit", "100", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Ctrl-C as a terminal sends it, whatever this test inherited: a shell that runs the suite in the background
    # (nohup, `cmd &` without job control) leaves SIGINT ignored, and Python then keeps ignoring it
    proc = subprocess.Popen([sys.executable, "-m", "k2edge", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((out / "results.json").read_text())["configs"]:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "--resume" in stderr and "interrupted" in stderr
    doc = json.loads((out / "results.json").read_text())
    kept = [r["name"] for r in doc["configs"]]
    assert doc["status"] == "interrupted" and 1 <= len(kept) < 4
    finished = sum(len(r["runs"]) for r in doc["configs"] if r["status"] in ("ok", "partial"))
    full = sum(1 for r in doc["configs"] if r["status"] == "ok")  # the line counts what the file keeps
    assert f"interrupted with {full} of 4 configuration(s) measured in full ({finished} run(s) finished)" in stderr, stderr
    assert "▶ recommended" not in stdout and "▷ provisional, from an incomplete sweep" in stdout, stdout
    proc = k2edge(*args, "--resume")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "complete" and [r["name"] for r in doc["configs"]] == ["c5", "c6", "cpu-dev", "c1"]
    assert f"keeping what was measured of {len(kept)} configuration(s)" in proc.stderr
    assert all(len(r["runs"]) == 3 for r in doc["configs"])


@pytest.mark.slow
def test_default_sweep_of_c1_to_c6_measures_every_profile(tmp_path):
    """The documented default command on the demo model completes with every profile measured (how long it
    takes depends on the machine: the README gives the figure measured with its command)."""
    proc = k2edge("pareto-sweep", str(MODEL), "--dataset", str(EVAL), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in doc["configs"]] == ["c1", "c2", "c3", "c4", "c5", "c6"]
    assert all(r["status"] == "ok" for r in doc["configs"])


def test_recommendation_names_configurations_within_the_run_to_run_spread():
    """A configuration as accurate as the pick, with an overlapping p50 range, is named beside it."""
    from k2edge.sweep.runner import finalise

    def rec(name, p50, lo, hi, top1):
        return {"name": name, "key": name, "status": "ok", "top1": top1, "energy_j_per_inference": None,
                "latency_ms": {"p50": p50, "p99": p50 * 2}, "spread": {"latency_p50_ms": {"min": lo, "max": hi}}}

    doc = {"configs": [rec("a", 1.00, 0.95, 1.10, 0.99), rec("b", 1.05, 1.02, 1.20, 0.99), rec("c", 1.06, 1.0, 1.1, 0.98),
                       rec("d", 1.50, 1.40, 1.60, 0.99)]}
    finalise(doc, SweepSpec(model=MODEL, dataset=EVAL, out=Path("."), goal="latency"))
    assert doc["recommendation"]["name"] == "a" and doc["recommendation"]["within_spread"] == ["b"]
    assert "b matches or beats its top-1 with per-run p50s overlapping its own" in doc["recommendation"]["reason"]
    assert [r["name"] for r in doc["configs"] if r["on_front"]] == ["a"]
    # only configurations that meet the constraints are named: b's p99 (2.1 ms) is over 2.05
    finalise(doc, SweepSpec(model=MODEL, dataset=EVAL, out=Path("."), goal="latency", max_latency_ms=2.05))
    assert doc["recommendation"]["name"] == "a" and doc["recommendation"]["within_spread"] == []


# --- progress where the output is not a terminal -----------------------------------------------------

def test_line_progress_prints_each_finished_step_with_elapsed_and_remaining():
    """A run that leaves its configuration unfinished, then the configuration a run finishes: one line each,
    the remaining time from the pace so far (half the work in 10 s: about 10 s left)."""
    import io

    from k2edge.sweep.progress import LineProgress

    now = [100.0]
    out = io.StringIO()
    p = LineProgress(out, clock=lambda: now[0])
    p.start(total_units=100, steps=2, configs=1)
    p.begin_step("[1/2] c3 run 1/2")
    now[0] += 10
    p.advance(50)
    record = {"name": "c3", "status": "partial", "runs": [{"latency_p50_ms": 0.7123}]}
    p.end_step(record)
    p.begin_step("[2/2] c3 run 2/2")
    now[0] += 12
    p.advance(50)
    record.update(status="ok", latency_ms={"p50": 0.7}, throughput_per_s=1540.0, top1=0.9963, measure_seconds=3.0)
    record["runs"].append({"latency_p50_ms": 0.69})
    p.end_step(record)
    p.config_done(record)
    assert out.getvalue().splitlines() == [
        "[1/2] c3 run 1/2: p50 0.712 ms (0:10 elapsed, about 0:10 left)",
        "[2/2] c3 run 2/2; configuration 1/1 done: c3: p50 0.700 ms, 1,540/s, top-1 99.63 % (2 runs, 3.0 s) (0:22 elapsed, done)",
    ]
    from k2edge.eta import duration

    assert [duration(s) for s in (0.4, 59.6, 61, 3723)] == ["0:00", "1:00", "1:01", "1:02:03"]


def _sweep_lines(text: str, names: list[str]) -> dict[str, list[str]]:
    """The progress lines ``[k/R] name run r/r; configuration c/N done: name: ...`` a sweep printed for each
    configuration it finished."""
    import re

    return {n: [x for x in text.splitlines()
                if re.match(rf"\[\d+/\d+\] {re.escape(n)} run \d+/\d+; configuration \d+/{len(names)} done: {re.escape(n)}: p50 ", x)]
            for n in names}


def test_sweep_with_stdout_to_a_file_prints_one_line_per_configuration(tmp_path):
    """`k2edge pareto-sweep ... > sweep.log` from a terminal: the bar on the terminal (stderr), and in the file one
    line per finished configuration with its elapsed and remaining time, then the table; with `2>&1` (a job's log)
    the same lines once each."""
    import pty
    import threading

    profiles = ["cpu-dev", "c5"]
    args = [sys.executable, "-m", "k2edge", "pareto-sweep", str(MODEL), "--dataset", str(EVAL), "--profiles", *profiles,
            "--runs", "1", "--requests", "5", "--warmup", "0", "--limit", "20"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    master, slave = pty.openpty()
    terminal = bytearray()

    def drain():  # a terminal is read as it is written, or the writer blocks
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            terminal.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    log = tmp_path / "sweep.log"
    with open(log, "w") as f:
        proc = subprocess.run([*args, "--out", str(tmp_path / "a")], stdout=f, stderr=slave, cwd=ROOT, env=env, timeout=600)
    os.close(slave)
    reader.join(timeout=30)
    os.close(master)
    assert proc.returncode == 0, terminal.decode(errors="replace")
    text = log.read_text()
    lines = _sweep_lines(text, profiles)
    assert all(len(v) == 1 for v in lines.values()), text
    assert all(" elapsed" in v[0] for v in lines.values()) and "about " in lines["cpu-dev"][0], text
    assert "pareto-sweep of model.onnx" in text and b"ETA" in terminal  # the table in the file, the bar on the terminal

    with open(tmp_path / "job.log", "w") as f:
        proc = subprocess.run([*args, "--out", str(tmp_path / "b")], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                              timeout=600)
    text = (tmp_path / "job.log").read_text()
    assert proc.returncode == 0, text
    assert all(len(v) == 1 for v in _sweep_lines(text, profiles).values()), text
