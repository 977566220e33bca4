"""pareto-sweep guards: --resume against changed inputs, INT8 whose check failed, and refusals before measuring."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from k2edge.sweep import MeasureSettings, SweepError, SweepSpec, run_sweep, sweep_configs
from k2edge.telemetry.base import Sample

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "digits" / "model.onnx"
EVAL = ROOT / "models" / "digits" / "eval.npz"
TINY = MeasureSettings(runs=1, warmup=2, requests=10, limit=60)


class NoRail:
    """Telemetry without a power rail (not a Jetson)."""

    state, message = "unknown", "no power rail found (not a Jetson)"

    def sample(self):
        return Sample(time.monotonic(), {}, {}, None)

    def close(self):
        pass


def sweep(out: Path, profiles, settings=TINY, resume=False, overwrite=False, **kw):
    configs, _ = sweep_configs(profiles)
    spec = SweepSpec(model=MODEL, dataset=EVAL, out=out, settings=settings, **kw)
    return run_sweep(spec, configs, resume=resume, overwrite=overwrite, telemetry=NoRail())


def k2edge(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "k2edge", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)


COMMON = [str(MODEL), "--dataset", str(EVAL), "--runs", "1", "--requests", "10", "--warmup", "2", "--limit", "60"]


def one_line_error(proc, fragment: str) -> None:
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and fragment in proc.stderr, proc.stderr


# --- --resume ---------------------------------------------------------------------------------------

def test_resume_measures_a_profile_edited_under_the_same_name_again(tmp_path):
    """A profile file edited between the sweep and --resume: one row per name, and the recommendation is the new one."""
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"name": "mine", "edge_runtime": {"offload_ratio": 0.5, "tensorrt_partition": "block-wise"}}))
    out = tmp_path / "out"
    sweep(out, [str(mine)])
    mine.write_text(json.dumps({"name": "mine", "edge_runtime": {"offload_ratio": 0.8, "tensorrt_partition": "block-wise"}}))
    outcome = sweep(out, [str(mine)], resume=True)
    doc = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in doc["configs"]] == ["mine"] and outcome.measured == ["mine"]
    assert doc["configs"][0]["profile"]["edge_runtime"]["offload_ratio"] == 0.8
    assert sum(r["recommended"] for r in doc["configs"]) == 1
    rows = list(csv.DictReader(io.StringIO((out / "results.csv").read_text())))
    assert [row["recommended"] for row in rows] == ["True"]
    assert json.loads((out / "recommended.json").read_text())["edge_runtime"]["offload_ratio"] == 0.8


def test_resume_refuses_another_calibration_check_set_or_card(tmp_path):
    """--calib, --check and --card are recorded (sha256); a resume with other ones is refused in one line."""
    out = tmp_path / "out"
    sweep(out, ["c5"])
    doc = json.loads((out / "results.json").read_text())
    assert doc["inputs"]["calib"]["path"] == str(ROOT / "models" / "digits" / "calib")
    assert doc["inputs"]["card"]["path"] == str(ROOT / "models" / "digits" / "card.toml") and doc["inputs"]["check"] is None
    with pytest.raises(SweepError, match=r"--calib .*calib \(sha256 .*\(now .*calib\.npz"):
        sweep(out, ["c5"], resume=True, calib=str(ROOT / "models" / "digits" / "calib.npz"))
    with pytest.raises(SweepError, match=r"--check none \(now .*calib\.npz"):
        sweep(out, ["c5"], resume=True, check=str(ROOT / "models" / "digits" / "calib.npz"))
    card = tmp_path / "card.toml"
    card.write_text((ROOT / "models" / "digits" / "card.toml").read_text() + "\n# edited\n")
    (tmp_path / "labels.txt").write_text((ROOT / "models" / "digits" / "labels.txt").read_text())  # the card names it
    with pytest.raises(SweepError, match=r"--card .*card\.toml \(sha256 .*\(now .*card\.toml"):
        sweep(out, ["c5"], resume=True, card=str(card))
    # The same inputs again: the resume goes on (nothing left to measure).
    assert sweep(out, ["c5"], resume=True).reused == ["c5"]


def test_resume_reports_a_measured_record_without_its_figures_as_damaged(tmp_path):
    """A hand-damaged record (no latency_ms, no runs) is told as damage, not a KeyError."""
    from k2edge.sweep.results import SCHEMA, load_previous

    path = tmp_path / "results.json"
    good = {"key": "k", "name": "c5", "status": "ok", "runs": [{}], "top1": 0.9, "throughput_per_s": 10.0,
            "latency_ms": {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}}
    for damage, what in ((("latency_ms",), "'latency_ms'"), (("runs",), "'runs' list"),
                         (("throughput_per_s",), "'throughput_per_s'"), (("top1",), "accuracy")):
        record = {k: v for k, v in good.items() if k not in damage}
        path.write_text(json.dumps({"schema": SCHEMA, "model": {}, "configs": [record]}))
        with pytest.raises(SweepError, match=rf"damaged \(configs\[0\] \(c5\) is ok but has no {what}"):
            load_previous(path)
    failed = {"key": "k", "name": "c5", "status": "failed"}  # a failed one is measured again: nothing of it is read
    path.write_text(json.dumps({"schema": SCHEMA, "model": {}, "configs": [failed]}))
    assert load_previous(path)["configs"][0]["status"] == "failed"


# --- INT8 whose accuracy check failed -----------------------------------------------------------------

def _record(name, p50, top1, check=None, int8_share=None):
    return {"key": name, "name": name, "status": "ok", "profile": {"edge_runtime": {}}, "runs": [{}],
            "latency_ms": {"mean": p50, "p50": p50, "p90": p50, "p99": p50}, "throughput_per_s": 1000 / p50,
            "top1": top1, "int8_check": None if check is None else {"status": check},
            "plan": {"precision_flops": None if int8_share is None else {"int8": int8_share, "fp16": 1 - int8_share}}}


def test_int8_whose_check_failed_is_never_recommended_and_the_table_and_csv_say_so(tmp_path):
    """The fastest configuration's INT8 check failed: the next is recommended, the reason names why, the check shows."""
    from k2edge.sweep.report import print_table
    from k2edge.sweep.results import write_csv
    from k2edge.sweep.runner import finalise

    spec = SweepSpec(model=MODEL, dataset=EVAL, out=tmp_path, goal="latency")
    doc = {"status": "complete", "model": {"path": str(MODEL)}, "dataset": {"samples": 60}, "settings": {"runs": 1},
           "configs": [_record("fast-int8", 1.0, 0.98, "failed", 0.72), _record("ok-int8", 2.0, 0.98, "passed", 0.9),
                       _record("fp16", 3.0, 0.99)]}
    finalise(doc, spec)
    rec = doc["recommendation"]
    assert rec["name"] == "ok-int8" and "fast-int8 not considered: its INT8 accuracy check failed" in rec["reason"]
    assert [r["name"] for r in doc["configs"] if r["recommended"]] == ["ok-int8"]
    assert doc["configs"][0]["on_front"]  # measured figures: still on the front
    text = print_table(doc, io.StringIO())
    assert "INT8 check" in text and "failed (int8 72 %)" in text and "passed (int8 90 %)" in text
    write_csv(tmp_path / "r.csv", doc)
    rows = {row["name"]: row for row in csv.DictReader(open(tmp_path / "r.csv"))}
    assert rows["fast-int8"]["int8_check"] == "failed" and rows["fast-int8"]["int8_flop_share"] == "0.72"
    assert rows["fp16"]["int8_check"] == ""
    # Every configuration's check failed: no recommendation, and the reason says why.
    doc["configs"] = doc["configs"][:1]
    finalise(doc, spec)
    assert doc["recommendation"]["name"] is None and "INT8 accuracy check failed" in doc["recommendation"]["reason"]


# --- refused before measuring -------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--calib", "--check"])
def test_a_mistyped_calib_or_check_is_refused_before_measuring(tmp_path, flag):
    """A missing --calib / --check path: exit 1 with one line, and no --out folder is left behind."""
    out = tmp_path / "out"
    proc = k2edge("pareto-sweep", *COMMON, "--profiles", "c2", flag, str(tmp_path / "nope"), "--out", str(out))
    one_line_error(proc, f"{flag} '{tmp_path / 'nope'}' does not exist")
    assert not out.exists()


def test_an_existing_results_file_is_not_overwritten_without_resume_or_overwrite(tmp_path):
    """A second sweep into the same --out is refused in one line; --overwrite replaces it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"kept": true}')
    proc = k2edge("pareto-sweep", *COMMON, "--profiles", "c5", "--out", str(out))
    one_line_error(proc, "results.json exists: pass --resume to continue it, --overwrite to replace it, or another --out")
    assert json.loads((out / "results.json").read_text()) == {"kept": True}
    proc = k2edge("pareto-sweep", *COMMON, "--profiles", "c5", "--out", str(out), "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "results.json").read_text())["configs"][0]["name"] == "c5"


def _read_only_dir(tmp_path: Path) -> Path:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for candidate in (ro, Path("/sys")):  # root writes through 0o555; /sys refuses a new file even to root
        try:
            with tempfile.TemporaryFile(dir=candidate):
                pass
        except OSError:
            return candidate
    pytest.skip("no read-only folder here")


def test_a_read_only_out_is_refused_before_measuring_naming_out(tmp_path):
    """--out that cannot be written: one line naming --out (not a temporary file), before any configuration is built."""
    ro = _read_only_dir(tmp_path)
    with pytest.raises(SweepError, match=rf"^--out '{ro}' is not writable: ") as err:
        sweep(ro, ["c5"])
    assert "tmp" not in str(err.value).replace(str(tmp_path), "")


def test_min_accuracy_of_100_percent_is_refused_on_any_sample_count(tmp_path):
    """--min-accuracy 100 % no evaluation set can tell: refused before measuring, no --out left behind."""
    out = tmp_path / "out"
    with pytest.raises(SweepError, match=r"--min-accuracy 100 % cannot be told on any number of samples"):
        sweep(out, ["c5"], settings=MeasureSettings(runs=1, warmup=2, requests=10, limit=3), min_accuracy=1.0)
    assert not out.exists()
    proc = k2edge("pareto-sweep", *COMMON, "--limit", "3", "--min-accuracy", "100%", "--profiles", "c5", "--out", str(out))
    one_line_error(proc, "--min-accuracy 100 % cannot be told")
    assert not out.exists()
