"""Progress as plain lines, for output that is not a terminal (a file, a pipe, a job's log): one line
per finished step, each with the time elapsed and the time estimated to remain.

The estimate assumes the rest goes at the pace so far: ``remaining = elapsed * (1 - done) / done``.
"""

from __future__ import annotations

import time
from typing import Callable, TextIO

__all__ = ["StepLines", "duration", "progress_outputs"]


def duration(seconds: float) -> str:
    """``0:07``, ``12:34``, ``1:02:03`` (hours, minutes, seconds)."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class StepLines:
    """Writes one line per finished step to ``stream``, flushed at once (a log read while it grows).

    Args:
        stream: where the lines go.
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, stream: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.clock = clock
        self.started = clock()

    def restart(self, at: float | None = None) -> None:
        """Count the elapsed time from ``at`` (a ``clock()`` reading; default now): a new phase."""
        self.started = self.clock() if at is None else at

    def elapsed(self) -> float:
        return self.clock() - self.started

    def line(self, text: str, done: float) -> None:
        """``text (0:12 elapsed, about 0:36 left)``; ``done`` is the finished share of the work, 0..1."""
        elapsed = self.elapsed()
        if done >= 1:
            timing = f"{duration(elapsed)} elapsed, done"
        elif done > 0:
            timing = f"{duration(elapsed)} elapsed, about {duration(elapsed * (1 - done) / done)} left"
        else:
            timing = f"{duration(elapsed)} elapsed"
        self.stream.write(f"{text} ({timing})\n")
        self.stream.flush()


def progress_outputs(json_output: bool = False) -> tuple[bool, TextIO | None]:
    """Where a long command shows its progress: ``(bar, lines)``.

    ``bar``: a progress bar on stderr, when stderr is a terminal. ``lines``: the stream for one plain
    line per finished step: stderr when it is not a terminal (a pipe, a log, a job's output file);
    else stdout when it is not a terminal and carries no ``--json`` document (``k2edge ... > run.log``
    from a shell: the bar on the terminal, the lines in the file); else None.
    """
    import sys

    if not sys.stderr.isatty():
        return False, sys.stderr
    if not json_output and not sys.stdout.isatty():
        return True, sys.stdout
    return True, None
