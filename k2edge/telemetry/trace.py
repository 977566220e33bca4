"""Recorded traces: timestamped temperatures and power, replayed as a telemetry source.

Two formats, chosen by suffix:

* JSONL (``.jsonl``): one object per line, ``{"t": 12.5, "temperatures_c": {"tj": 71.2},
  "rails_w": {"VDD_IN": 9.8}, "total_power_w": 9.8}``. ``temperatures_c`` empty or null is a
  reading with no temperature (a missing sensor). Blank lines and lines starting with ``#`` are skipped.
* CSV (``.csv``): a header with ``t``, ``temp.<sensor>`` (°C), ``rail.<NAME>`` (W) and optionally
  ``total_w``; an empty cell is a missing reading. Without ``total_w`` the total follows the
  rails as on the board (``VDD_IN``, else their sum).

``t`` is in seconds on the trace's own clock and must not decrease.
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable

from .base import Sample, TelemetryError, TelemetrySource
from .sysfs import input_power

__all__ = ["TraceSource", "load_trace", "write_trace"]


def load_trace(path: str | os.PathLike) -> list[Sample]:
    """Read a JSONL or CSV trace.

    Raises:
        TelemetryError: the file is missing, empty, of another format, or a row is malformed
            (the message names the file and line).
    """
    p = Path(path)
    if not p.is_file():
        raise TelemetryError(f"trace {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        samples = _load_jsonl(p)
    elif suffix == ".csv":
        samples = _load_csv(p)
    else:
        raise TelemetryError(f"trace {str(p)!r}: expected a .jsonl or .csv file")
    if not samples:
        raise TelemetryError(f"trace {str(p)!r} holds no samples")
    return samples


def _num(value, where: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TelemetryError(f"{where}: expected a number, got {value!r}") from None


def _mapping(value, where: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TelemetryError(f"{where}: expected an object of name -> number, got {value!r}")
    out = {}
    for k, v in value.items():
        n = _num(v, f"{where}.{k}")
        if n is not None:
            out[str(k)] = n
    return out


def _check_time(samples: list[Sample], t: float, where: str) -> None:
    if samples and t < samples[-1].t:
        raise TelemetryError(f"{where}: t goes backwards ({t} after {samples[-1].t})")


def _load_jsonl(p: Path) -> list[Sample]:
    samples: list[Sample] = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{p}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TelemetryError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or "t" not in row:
            raise TelemetryError(f"{where}: expected an object with 't'")
        unknown = set(row) - {"t", "temperatures_c", "rails_w", "total_power_w"}
        if unknown:
            raise TelemetryError(f"{where}: unknown key(s) {sorted(unknown)} (known: t, temperatures_c, rails_w, total_power_w)")
        t = _num(row["t"], f"{where}: t")
        if t is None:
            raise TelemetryError(f"{where}: t is required")
        rails = _mapping(row.get("rails_w"), f"{where}: rails_w")
        total = _num(row.get("total_power_w"), f"{where}: total_power_w") if "total_power_w" in row else input_power(rails)
        _check_time(samples, t, where)
        samples.append(Sample(t, _mapping(row.get("temperatures_c"), f"{where}: temperatures_c"), rails, total))
    return samples


def _load_csv(p: Path) -> list[Sample]:
    samples: list[Sample] = []
    with p.open(newline="") as f:
        rows = csv.reader(line for line in f if not line.startswith("#"))
        header = next(rows, None)
        if not header or "t" not in header:
            raise TelemetryError(f"{p}: the CSV header needs a 't' column (then temp.<sensor>, rail.<NAME>, total_w)")
        bad = [h for h in header if h not in ("t", "total_w") and not h.startswith(("temp.", "rail."))]
        if bad:
            raise TelemetryError(f"{p}: unknown column(s) {bad} (known: t, temp.<sensor>, rail.<NAME>, total_w)")
        for lineno, row in enumerate(rows, 2):
            if not any(cell.strip() for cell in row):
                continue
            where = f"{p}:{lineno}"
            if len(row) != len(header):
                raise TelemetryError(f"{where}: {len(row)} cells for {len(header)} columns")
            cells = dict(zip(header, (c.strip() for c in row)))
            t = _num(cells["t"], f"{where}: t")
            if t is None:
                raise TelemetryError(f"{where}: t is required")
            temps = {h[5:]: v for h in header if h.startswith("temp.") and (v := _num(cells[h], f"{where}: {h}")) is not None}
            rails = {h[5:]: v for h in header if h.startswith("rail.") and (v := _num(cells[h], f"{where}: {h}")) is not None}
            total = _num(cells["total_w"], f"{where}: total_w") if "total_w" in cells else input_power(rails)
            _check_time(samples, t, where)
            samples.append(Sample(t, temps, rails, total))
    return samples


def write_trace(samples: Iterable[Sample], path: str | os.PathLike) -> Path:
    """Record samples as a JSONL trace (to replay a board's day later, or to make a test fixture)."""
    p = Path(path)
    with p.open("w") as f:
        for s in samples:
            f.write(json.dumps(s.to_dict(), sort_keys=True) + "\n")
    return p


class TraceSource(TelemetrySource):
    """Replays a trace.

    Args:
        path: the trace file.
        realtime: False (default): each ``sample()`` returns the next row. True: ``sample()``
            returns the row current at the time elapsed since the first call (a replay at the
            trace's own pace, for a daemon run against a recorded day).
        loop: start over at the end (times keep increasing); otherwise the last row repeats.
        clock: the clock ``realtime`` follows.
    """

    kind = "trace"

    def __init__(self, path: str | os.PathLike, *, realtime: bool = False, loop: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.path = Path(path)
        self.samples = load_trace(self.path)
        self.realtime, self.loop, self._clock = realtime, loop, clock
        self._next = 0
        self._started: float | None = None
        self._duration = self.samples[-1].t - self.samples[0].t

    @property
    def exhausted(self) -> bool:
        """True once every row has been returned (never with ``loop``)."""
        return not self.loop and self._next >= len(self.samples)

    def _read(self) -> Sample:
        n = len(self.samples)
        if self.realtime:
            now = self._clock()
            if self._started is None:
                self._started = now
            elapsed = now - self._started
            laps = 0
            if self.loop and self._duration > 0:
                laps, elapsed = divmod(elapsed, self._duration)
            target = self.samples[0].t + elapsed
            i = max(j for j in range(n) if self.samples[j].t <= target) if self.samples[0].t <= target else 0
            self._next = i + 1
            return _shift(self.samples[i], laps * self._duration)
        i = self._next
        self._next += 1
        if i < n:
            return self.samples[i]
        if not self.loop:
            return self.samples[-1]
        laps, j = divmod(i, n)
        period = self._duration + (self.samples[1].t - self.samples[0].t if n > 1 else 1.0)
        return _shift(self.samples[j], laps * period)


def _shift(s: Sample, dt: float) -> Sample:
    return s if not dt else Sample(s.t + dt, s.temperatures_c, s.rails_w, s.total_power_w)
