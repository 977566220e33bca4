"""Progress while a sweep runs: a rich bar with ETA on a terminal (stderr); where the output is not a
terminal, one plain line per finished step with the elapsed and the estimated remaining time.

The lines go to stderr when it is not a terminal, else to stdout when that is a file or a pipe and
carries no ``--json`` document (see :func:`k2edge.eta.progress_outputs`). A step is one run of one
configuration; the runner interleaves configurations round by round.
"""

from __future__ import annotations

import sys
import time

from ..eta import StepLines, progress_outputs
from .results import accuracy_of


class SweepProgress:
    """Receives the sweep's progress; this base class ignores it (library use, tests)."""

    def start(self, total_units: float, steps: int, configs: int = 0) -> None:
        """The sweep starts: ``steps`` runs of ``configs`` configurations, ``total_units`` of work."""

    def begin_step(self, label: str) -> None:
        """A run starts; ``label`` reads ``[3/30] c3 run 1/5``."""

    def advance(self, units: float, phase: str | None = None) -> None:
        pass

    def end_step(self, record: dict, units_left_over: float = 0.0) -> None:
        pass

    def config_done(self, record: dict) -> None:
        """A configuration has all its runs, or has failed."""

    def note(self, text: str) -> None:
        pass

    def stop(self) -> None:
        pass


def summary_line(record: dict) -> str:
    """``c3: p50 0.712 ms, 1,540/s, top-1 99.63 %`` or ``c7: failed: reason``."""
    if record.get("status") == "failed":
        return f"{record['name']}: failed: {record.get('error')}"
    energy = record.get("energy_j_per_inference")
    extra = f", {energy:.3g} J/inference" if energy is not None else ""
    return (f"{record['name']}: p50 {record['latency_ms']['p50']:.3f} ms, {record['throughput_per_s']:,.0f}/s, "
            f"{record.get('accuracy_metric', 'top-1')} {100 * accuracy_of(record):.2f} %{extra} ({len(record['runs'])} runs, {record.get('measure_seconds', 0):.1f} s)")


class LineProgress(SweepProgress):
    """One plain line per finished step (logs, CI, pipes, a job's output file), each with the time elapsed
    and the time estimated to remain: a run that leaves its configuration unfinished
    (``[3/30] c3 run 1/5: p50 0.712 ms``), else the run and the configuration it finishes
    (``[27/30] c3 run 5/5; configuration 2/6 done: c3: p50 ...``), so the run counter reaches its end.

    Args:
        stream: where the lines go (default stderr).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, stream=None, clock=time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.lines = StepLines(self.stream, clock)
        self.done = self.configs = 0
        self.total = 1.0
        self.units = 0.0
        self.label = ""

    def start(self, total_units: float, steps: int, configs: int = 0) -> None:
        self.configs, self.total, self.units = configs, max(total_units, 1.0), 0.0
        self.lines.restart()

    def begin_step(self, label: str) -> None:
        self.label = label

    def advance(self, units: float, phase: str | None = None) -> None:
        self.units += units

    def end_step(self, record: dict, units_left_over: float = 0.0) -> None:
        self.units += units_left_over
        if record.get("status") in ("ok", "failed"):  # the run's own counter, and the configuration's
            self.done += 1
            text = f"{self.label}; configuration {self.done}/{self.configs} done: {summary_line(record)}"
        else:
            text = f"{self.label}: p50 {record['runs'][-1]['latency_p50_ms']:.3f} ms"
        self.lines.line(text, min(1.0, self.units / self.total))

    def note(self, text: str) -> None:
        self.stream.write(f"{text}\n")
        self.stream.flush()


class FanOut(SweepProgress):
    """Progress to several receivers: the bar on the terminal and the lines in the output file."""

    def __init__(self, *receivers: SweepProgress) -> None:
        self.receivers = receivers

    def start(self, total_units: float, steps: int, configs: int = 0) -> None:
        for r in self.receivers:
            r.start(total_units, steps, configs)

    def begin_step(self, label: str) -> None:
        for r in self.receivers:
            r.begin_step(label)

    def advance(self, units: float, phase: str | None = None) -> None:
        for r in self.receivers:
            r.advance(units, phase)

    def end_step(self, record: dict, units_left_over: float = 0.0) -> None:
        for r in self.receivers:
            r.end_step(record, units_left_over)

    def config_done(self, record: dict) -> None:
        for r in self.receivers:
            r.config_done(record)

    def note(self, text: str) -> None:
        for r in self.receivers:
            r.note(text)

    def stop(self) -> None:
        for r in self.receivers:
            r.stop()


class RichProgress(SweepProgress):
    """A rich progress bar with elapsed time and ETA on stderr; finished configurations print above it."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.console = Console(stderr=True)
        self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                             TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
                             transient=True)
        self._task = None
        self.label = ""

    def start(self, total_units: float, steps: int, configs: int = 0) -> None:
        self._bar.start()
        self._task = self._bar.add_task("starting", total=max(total_units, 1))

    def begin_step(self, label: str) -> None:
        self.label = label
        self._bar.update(self._task, description=f"{label}: building")

    def advance(self, units: float, phase: str | None = None) -> None:
        kwargs = {"description": f"{self.label}: {phase}"} if phase else {}
        self._bar.update(self._task, advance=units, **kwargs)

    def end_step(self, record: dict, units_left_over: float = 0.0) -> None:
        if units_left_over:
            self._bar.update(self._task, advance=units_left_over)

    def config_done(self, record: dict) -> None:
        from rich.text import Text

        style = "red" if record.get("status") == "failed" else ""
        self.console.print(Text(summary_line(record), style=style), highlight=False)

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def stop(self) -> None:
        self._bar.stop()


def default_progress(json_output: bool = False) -> SweepProgress:
    """The rich bar when stderr is a terminal, and one line per finished step where the output is not
    one (see :func:`k2edge.eta.progress_outputs`)."""
    bar, lines = progress_outputs(json_output)
    receivers = ([RichProgress()] if bar else []) + ([LineProgress(lines)] if lines is not None else [])
    return receivers[0] if len(receivers) == 1 else FanOut(*receivers)
