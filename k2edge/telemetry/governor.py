"""The thermal governor: a pure state machine fed by samples, and a thread that feeds it.

States, coolest first: ``normal`` -> ``warm`` -> ``hot`` -> ``critical``; ``unknown`` when there is
no temperature to judge by. What each means for requests is the escalation policy's business
(:mod:`k2edge.cloud_bridge.policy`); the governor only says which state holds and why.

Rules (all limits from :class:`ThermalSettings`):

* The temperature is the hottest watched sensor, through a median filter over the last
  ``filter_samples`` readings (a lone spike or dropout changes nothing).
* Rising: the state becomes the highest one whose limit the temperature has reached
  (``soft_c`` warm, ``hard_c`` hot, ``critical_c`` critical), at once, skipping states if need be.
* Falling: a state is left only when the temperature is ``hysteresis_c`` below its limit, so a
  sensor hovering at a limit does not flap.
* Power: with ``power_budget_w`` set, the average input power over the last ``power_window_s``
  seconds above the budget holds the state at least at ``power_state`` (warm by default), until
  the average falls ``power_hysteresis_w`` below the budget. Readings age out of the window: with
  none in it (the rail gone, ``filter_samples`` failed reads) power holds no state.
* ``unknown`` after ``filter_samples`` readings in a row with no watched temperature (a missing
  sensor, a source that cannot read): reported, never an exception.

Every transition is logged (WARNING when hotter, INFO when cooler) and kept, with its reason, in
:attr:`ThermalGovernor.transitions` for telemetry.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Literal

from .base import Sample, TelemetrySource
from ..config.thermal import ThermalSettings

log = logging.getLogger(__name__)

__all__ = ["ThermalGovernor", "GovernorState", "Transition", "ThermalSampler", "STATES", "ThermalStateName"]

ThermalStateName = Literal["normal", "warm", "hot", "critical", "unknown"]
STATES: tuple[str, ...] = ("normal", "warm", "hot", "critical")
_LIMIT_NAMES = ("", "soft_c", "hard_c", "critical_c")


@dataclass(frozen=True)
class GovernorState:
    """The governor's verdict after a sample.

    Attributes:
        state: normal | warm | hot | critical | unknown.
        changed: True when this sample changed the state.
        reason: why the state holds (for a change: why it changed), for logs, telemetry and responses.
        t: the sample's time.
        since: when the state began (sample clock).
        temperature_c: the filtered temperature judged (None when unknown).
        sensor: the sensor it came from.
        power_avg_w: the average input power over the window, when power is measured.
    """

    state: ThermalStateName
    changed: bool
    reason: str
    t: float | None = None
    since: float | None = None
    temperature_c: float | None = None
    sensor: str | None = None
    power_avg_w: float | None = None

    @property
    def prefer_dla(self) -> bool:
        """True in warm and hot: run models on their configured DLA-heavier profile."""
        return self.state in ("warm", "hot")

    @property
    def refuses_local_work(self) -> bool:
        """True in critical: no new local inference."""
        return self.state == "critical"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefer_dla"] = self.prefer_dla
        return d


@dataclass(frozen=True)
class Transition:
    """One state change, as kept for telemetry."""

    t: float | None
    from_state: str
    to_state: str
    reason: str
    temperature_c: float | None
    power_avg_w: float | None

    def to_dict(self) -> dict:
        return asdict(self)


class ThermalGovernor:
    """Pure state machine: ``update(sample) -> GovernorState``. Not thread-safe by itself
    (:class:`ThermalSampler` serialises access).

    Args:
        settings: the budget; defaults to :class:`ThermalSettings`'s defaults.
        history: how many transitions to keep.
    """

    def __init__(self, settings: ThermalSettings | None = None, *, history: int = 100) -> None:
        self.settings = settings or ThermalSettings()
        s = self.settings
        self._limits = (float("-inf"), s.soft_c, s.hard_c, s.critical_c)
        self._window: deque[tuple[str, float] | None] = deque(maxlen=s.filter_samples)
        self._power: deque[tuple[float, float]] = deque()
        self._power_missing = 0
        self._temp_level = 0
        self._power_over = False
        self._transitions: deque[Transition] = deque(maxlen=history)
        self.transition_count = 0
        self._current = GovernorState("unknown", False, "no sample yet")

    @property
    def current(self) -> GovernorState:
        return self._current

    @property
    def state(self) -> ThermalStateName:
        return self._current.state

    @property
    def transitions(self) -> list[Transition]:
        """The most recent transitions, oldest first."""
        return list(self._transitions)

    # the state machine -------------------------------------------------------------------------
    def update(self, sample: Sample | None, why_missing: str | None = None) -> GovernorState:
        """Judge one sample.

        Args:
            sample: the reading; None when the source could not read at all.
            why_missing: the source's message when it could not read (shown in the unknown reason).
        """
        t = sample.t if sample is not None else None
        self._window.append(self._watched(sample))
        power_avg = self._power_average(sample)
        valid = [r for r in self._window if r is not None]

        temp = sensor = None
        if valid:
            temp = statistics.median(v for _, v in valid)
            sensor = max(valid, key=lambda r: r[1])[0]
            level, temp_reason = self._temperature_level(temp, sensor)
        else:
            self._temp_level = 0
            level, temp_reason = None, self._missing_reason(sample, why_missing)

        power_level, power_reason = self._power_level(power_avg)
        if level is None and power_level == 0:
            new, reason = "unknown", temp_reason
        elif level is None or power_level > level:
            new, reason = STATES[power_level], power_reason if level is not None else f"{temp_reason}; {power_reason}"
        else:
            new, reason = STATES[level], temp_reason

        prev = self._current
        changed = new != prev.state
        since = t if changed or prev.since is None else prev.since
        self._current = GovernorState(new, changed, reason, t, since, temp, sensor if temp is not None else None, power_avg)
        if changed:
            self._record(prev.state, self._current)
        return self._current

    def _watched(self, sample: Sample | None) -> tuple[str, float] | None:
        if sample is None:
            return None
        temps = sample.temperatures_c
        if self.settings.sensors:
            temps = {k: v for k, v in temps.items() if k in self.settings.sensors}
        if not temps:
            return None
        name = max(temps, key=temps.__getitem__)
        return name, temps[name]

    def _missing_reason(self, sample: Sample | None, why: str | None) -> str:
        if why:
            return f"no temperature reading: {why}"
        if self.settings.sensors:
            return f"no temperature reading: sensor(s) {', '.join(self.settings.sensors)} missing"
        return "no temperature reading: no thermal sensor answered"

    def _temperature_level(self, temp: float, sensor: str) -> tuple[int, str]:
        s = self.settings
        rising = max(i for i, lim in enumerate(self._limits) if temp >= lim)
        current = self._temp_level
        if rising >= current:
            level = rising
        else:
            level = max(i for i in range(current + 1) if temp >= self._limits[i] - (s.hysteresis_c if i else 0))
        previous, self._temp_level = current, level
        if level < previous:
            left = _LIMIT_NAMES[previous]
            return level, (f"{sensor} {temp:.1f} °C < {left} {self._limits[previous]:g} - hysteresis {s.hysteresis_c:g} °C")
        if level > 0 and temp >= self._limits[level]:
            return level, f"{sensor} {temp:.1f} °C >= {_LIMIT_NAMES[level]} {self._limits[level]:g} °C"
        if level > 0:
            lim = self._limits[level]
            return level, (f"{sensor} {temp:.1f} °C, within hysteresis of {_LIMIT_NAMES[level]} {lim:g} °C "
                           f"(leaves {STATES[level]} below {lim - s.hysteresis_c:g} °C)")
        return level, f"{sensor} {temp:.1f} °C below soft_c {s.soft_c:g} °C"

    def _power_average(self, sample: Sample | None) -> float | None:
        """The average input power over the last ``power_window_s`` before this sample, or None without a reading in
        it: readings that stopped (a rail gone, the source lost) age out of the window instead of being judged on."""
        if sample is None:  # no clock to age them by: dropped after as many failed reads as make a temperature unknown
            self._power_missing += 1
            if self._power_missing >= self.settings.filter_samples:
                self._power.clear()
        else:
            self._power_missing = 0
            if sample.total_power_w is not None:
                self._power.append((sample.t, sample.total_power_w))
            horizon = sample.t - self.settings.power_window_s
            while self._power and self._power[0][0] < horizon:
                self._power.popleft()
        if not self._power:
            return None
        pts = list(self._power)
        span = pts[-1][0] - pts[0][0]
        if span <= 0:
            return sum(p for _, p in pts) / len(pts)
        area = sum((pts[i + 1][0] - pts[i][0]) * (pts[i][1] + pts[i + 1][1]) / 2 for i in range(len(pts) - 1))
        return area / span

    def _power_level(self, avg: float | None) -> tuple[int, str]:
        s = self.settings
        if s.power_budget_w is None or avg is None:
            self._power_over = False
            return 0, ""
        if avg > s.power_budget_w:
            self._power_over = True
        elif avg < s.power_budget_w - s.power_hysteresis_w:
            self._power_over = False
        if not self._power_over:
            return 0, ""
        return STATES.index(s.power_state), (f"average power {avg:.1f} W over {s.power_window_s:g} s above "
                                             f"power_budget_w {s.power_budget_w:g} W")

    def _record(self, old: str, cur: GovernorState) -> None:
        tr = Transition(cur.t, old, cur.state, cur.reason, cur.temperature_c, cur.power_avg_w)
        self._transitions.append(tr)
        self.transition_count += 1
        hotter = cur.state == "unknown" or (old != "unknown" and STATES.index(cur.state) > STATES.index(old))
        log.log(logging.WARNING if hotter else logging.INFO, "thermal state %s -> %s: %s", old, cur.state, cur.reason)

    def snapshot(self, transitions: int = 10) -> dict:
        """The state and the last transitions, for status and telemetry."""
        d = self._current.to_dict()
        d["transitions"] = [tr.to_dict() for tr in list(self._transitions)[-transitions:]]
        d["transition_count"] = self.transition_count
        return d


class ThermalSampler:
    """A thread that reads a source every ``interval_s`` and feeds a governor.

    Read ``state`` (the latest :class:`GovernorState`) from any thread. ``on_transition`` is called
    on the sampler's thread for each change (keep it short: hand work to a queue). The last
    ``keep`` samples are kept for energy figures (:meth:`samples_between`).

    Args:
        source: where readings come from (:func:`k2edge.telemetry.open_source`).
        governor: the state machine (built from ``source``'s settings by the caller).
        interval_s: polling period; default from the governor's ``sample_interval_ms``.
        on_transition: optional callback ``(GovernorState) -> None``.
        keep: samples kept.
    """

    def __init__(self, source: TelemetrySource, governor: ThermalGovernor | None = None, *,
                 interval_s: float | None = None, on_transition: Callable[[GovernorState], None] | None = None,
                 keep: int = 1200) -> None:
        self.source = source
        self.governor = governor or ThermalGovernor()
        self.interval_s = interval_s if interval_s is not None else self.governor.settings.sample_interval_ms / 1000.0
        self.on_transition = on_transition
        self._lock = threading.Lock()
        self._samples: deque[Sample] = deque(maxlen=keep)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> GovernorState:
        with self._lock:
            return self.governor.current

    @property
    def latest_sample(self) -> Sample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def samples_between(self, t0: float, t1: float, margin_s: float | None = None) -> list[Sample]:
        """Samples within ``[t0 - margin, t1 + margin]`` (margin: one interval), for energy figures."""
        m = self.interval_s if margin_s is None else margin_s
        with self._lock:
            return [s for s in self._samples if t0 - m <= s.t <= t1 + m]

    def poll(self) -> GovernorState:
        """Read the source once and feed the governor (the thread's body; also callable directly)."""
        sample = self.source.sample()
        why = self.source.message if self.source.state != "ok" else None
        with self._lock:
            self._samples.append(sample)
            st = self.governor.update(sample, why)
        if st.changed and self.on_transition is not None:
            try:
                self.on_transition(st)
            except Exception:
                log.exception("thermal on_transition callback failed")
        return st

    def start(self) -> "ThermalSampler":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="k2edge-thermal", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:
                log.exception("thermal sampling failed")
            now = time.monotonic()
            next_at = max(next_at + self.interval_s, now)  # a slow read skips ticks rather than bursting to catch up
            self._stop.wait(next_at - now)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(2.0, 2 * self.interval_s))
            self._thread = None

    def snapshot(self) -> dict:
        """Governor state, transitions and the latest reading, for status and telemetry."""
        with self._lock:
            d = self.governor.snapshot()
            last = self._samples[-1] if self._samples else None
        d["source"] = self.source.describe()
        d["sample"] = last.to_dict() if last else None
        return d

    def __enter__(self) -> "ThermalSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
