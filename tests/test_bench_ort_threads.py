"""bench/bench_ort_threads.py (bare ONNX Runtime under the daemon's and the peer's thread settings) still runs,
so the figures docs/performance.md quotes from it can be reproduced."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_ort_threads.py"


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def _time(row: str, setting: str) -> float:
    """The figure printed after ``setting`` in ``row`` (a setting followed by another with the same prefix is not
    taken for it: each is followed by its number)."""
    found = re.search(rf"(?:: |, ){re.escape(setting)} (\d+\.\d+)", row)
    assert found, (setting, row)
    return float(found[1])


def test_threads_and_axis_print_every_setting_with_a_time():
    proc = _bench("threads", "--rounds", "1", "--gap-ms", "0")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("batch ")]
    assert [r.split(",")[0] for r in rows] == ["batch 1", "batch 8"], proc.stdout
    for row in rows:
        assert all(_time(row, s) > 0 for s in ("1 thread", "2 threads, spinning", "2 threads, spinning stops")), row
    proc = _bench("axis", "--rounds", "1", "--batch", "2")
    assert proc.returncode == 0, proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("batch 2")]
    assert all(_time(row, s) > 0 for s in ("dynamic axis", "dynamic, no memory pattern", "fixed batch 2")), row


def test_bad_arguments_are_one_line():
    for args, fragment in ((["axis", "--batch", "0"], ">= 1"), (["axis", "--model", "/nonexistent.onnx"], "cannot read")):
        proc = _bench(*args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and fragment in proc.stderr, proc.stderr
