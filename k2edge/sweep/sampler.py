"""Power and temperature while a configuration runs: a small background sampler.

The readings come from ``k2edge.telemetry`` (jtop, sysfs rails and thermal zones, ...), opened
lazily; the source is injectable so tests pass a fake one. No source, a source in state
``unknown`` or a source that fails is reported, never fatal: energy is then ``None`` with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


class _Unavailable:
    """Stands in for a telemetry source that could not be opened."""

    state = "unknown"

    def __init__(self, message: str) -> None:
        self.message = message

    def sample(self):  # pragma: no cover - never sampled
        raise RuntimeError(self.message)

    def close(self) -> None:
        pass


def open_telemetry(kind: str = "auto", root: Path = Path("/")):
    """Open ``k2edge.telemetry``'s source, or a stand-in saying why there is none."""
    try:
        from ..telemetry import open_source
    except ImportError as exc:
        return _Unavailable(f"k2edge.telemetry is not available ({exc})")
    try:
        return open_source(kind=kind, root=root)
    except Exception as exc:  # a broken sensor must not stop a sweep
        return _Unavailable(f"telemetry source failed to open: {exc}")


def _energy_functions() -> tuple[Callable | None, Callable | None]:
    try:
        from ..telemetry.energy import energy_per_inference, peak_temperature
    except ImportError:
        return None, None
    return energy_per_inference, peak_temperature


class TelemetrySampler:
    """Samples a telemetry source every ``interval_s`` on a daemon thread.

    Args:
        source: a telemetry source (``state``, ``message``, ``sample()``, ``close()``); None opens
            ``k2edge.telemetry``'s automatic source.
        interval_s: seconds between samples.

Energy and peak temperature are computed by ``k2edge.telemetry.energy`` from the samples.

    Times are ``time.monotonic()`` seconds, the clock the samples carry.
    """

    def __init__(self, source=None, interval_s: float = 0.1) -> None:
        self.source = source if source is not None else open_telemetry()
        self.interval_s = interval_s
        self._energy, self._peak = _energy_functions()
        self._samples: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    @property
    def state(self) -> str:
        return "failed" if self.error else getattr(self.source, "state", "unknown")

    @property
    def message(self) -> str | None:
        return self.error or getattr(self.source, "message", None)

    def no_power(self, tries: int = 3) -> str | None:
        """Why no energy can be measured here (no source, or one without an input power rail), from up to ``tries``
        samples ``interval_s`` apart (a source's first reading may come before its rails); None when it reads power."""
        if isinstance(self.source, _Unavailable):
            return self.source.message
        for attempt in range(tries):
            try:
                if self.source.sample().total_power_w is not None:
                    return None
            except Exception as exc:  # a sensor that fails now fails the energy goal, not the sweep's other goals
                return f"the telemetry source failed: {exc}"
            if attempt + 1 < tries:
                time.sleep(self.interval_s)
        return self.message or "the telemetry source reads no input power rail"

    def start(self) -> "TelemetrySampler":
        if isinstance(self.source, _Unavailable) or self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._loop, name="k2edge-sweep-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            self.source.close()
        except Exception:  # closing a sensor cannot fail a sweep
            log.debug("telemetry source close failed", exc_info=True)

    def __enter__(self) -> "TelemetrySampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                s = self.source.sample()
            except Exception as exc:
                self.error = f"telemetry sampling failed: {exc}"
                log.warning("%s; energy and temperature are unknown from here on", self.error)
                return
            with self._lock:
                self._samples.append(s)
            self._stop.wait(self.interval_s)

    def samples(self, t0: float = float("-inf"), t1: float = float("inf")) -> list:
        """The samples taken in [t0, t1]."""
        with self._lock:
            return [s for s in self._samples if t0 <= s.t <= t1]

    def energy_per_inference(self, t0: float, t1: float, inferences: int) -> tuple[float | None, str | None]:
        """(joules per inference over [t0, t1], None) or (None, why it is unknown)."""
        # Samples just outside the window let the integration interpolate to its edges.
        margin = 2 * self.interval_s
        window = self.samples(t0 - margin, t1 + margin)
        if not any(s.total_power_w is not None for s in window):
            return None, self._why_no("no power reading during the run")
        if self._energy is None:
            return None, "k2edge.telemetry is not available to integrate power"
        try:
            value = self._energy(window, t0, t1, inferences)
        except Exception as exc:
            return None, f"energy integration failed: {exc}"
        return (value, None) if value is not None else (None, "too few power readings to integrate")

    def peak_temperature(self, t0: float, t1: float) -> tuple[float | None, str | None]:
        """(highest temperature in °C over [t0, t1], its sensor) or (None, why it is unknown).

        As for energy, samples up to two intervals outside the window count: a run shorter than the sampling
        interval would otherwise see no reading at all (and temperatures change slower than that).
        """
        margin = 2 * self.interval_s
        best = self._peak(self.samples(t0 - margin, t1 + margin)) if self._peak else None
        if best is None:
            return None, self._why_no("no temperature sensor reading during the run", use_message=False)
        return float(best[1]), best[0]

    def _why_no(self, default: str, use_message: bool = True) -> str:
        if self.error:
            return self.error
        if isinstance(self.source, _Unavailable):
            return self.source.message
        message = getattr(self.source, "message", None)
        if use_message and getattr(self.source, "state", "ok") != "ok" and message:
            return message
        return default
