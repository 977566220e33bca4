"""What every telemetry source returns: a :class:`Sample`, and the :class:`TelemetrySource` contract."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from ..errors import K2EdgeError

__all__ = ["Sample", "TelemetrySource", "UnavailableSource", "TelemetryError", "SourceState"]

SourceState = Literal["ok", "unknown"]


class TelemetryError(K2EdgeError):
    """A telemetry source or trace is misconfigured or malformed (bad trace file, unknown source kind)."""


@dataclass(frozen=True)
class Sample:
    """One reading of a board's sensors.

    Attributes:
        t: seconds, monotonic for live sources (``time.monotonic()``), the trace's own clock for traces.
        temperatures_c: sensor name -> °C. Names are the thermal zone type without ``-thermal``
            (``cpu``, ``gpu``, ``cv0``, ``soc0``, ``tj``), as jtop names them; offline sensors are absent.
        rails_w: power rail label -> W (``VDD_IN``, ``VDD_GPU_SOC``, ...).
        total_power_w: the board's input power in W: the ``VDD_IN`` rail where the module has one
            (Orin NX, Orin Nano), else the sum of the module's rails (AGX Orin has no single input
            rail), as jtop computes its total; None when no power sensor exists.
    """

    t: float
    temperatures_c: dict[str, float] = field(default_factory=dict)
    rails_w: dict[str, float] = field(default_factory=dict)
    total_power_w: float | None = None

    @property
    def hottest(self) -> tuple[str, float] | None:
        """``(sensor, °C)`` of the hottest sensor, or None without temperatures."""
        if not self.temperatures_c:
            return None
        name = max(self.temperatures_c, key=self.temperatures_c.__getitem__)
        return name, self.temperatures_c[name]

    def to_dict(self) -> dict:
        return {"t": self.t, "temperatures_c": dict(self.temperatures_c), "rails_w": dict(self.rails_w),
                "total_power_w": self.total_power_w}


class TelemetrySource:
    """A place samples come from. Subclasses implement :meth:`_read`.

    ``state`` is ``"ok"`` while the source can read its sensors and ``"unknown"`` when it cannot;
    ``message`` then says why and what to do. ``sample()`` never raises for a missing or failing
    sensor: it returns what it could read (possibly nothing) and updates ``state``/``message``.
    """

    kind: str = "?"

    def __init__(self) -> None:
        self.state: SourceState = "ok"
        self.message: str = ""

    def sample(self) -> Sample:
        """Read the sensors now."""
        try:
            return self._read()
        except OSError as exc:
            self._unknown(f"{self.kind}: reading the sensors failed: {exc}")
            return Sample(time.monotonic())

    def _read(self) -> Sample:  # pragma: no cover - abstract
        raise NotImplementedError

    def _unknown(self, message: str) -> None:
        self.state, self.message = "unknown", message

    def close(self) -> None:
        """Release the source (a jtop connection, NVML)."""

    def describe(self) -> dict:
        return {"kind": self.kind, "state": self.state, "message": self.message}

    def __enter__(self) -> "TelemetrySource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.state}{': ' + self.message if self.message else ''}>"


class UnavailableSource(TelemetrySource):
    """No sensor at all: every sample is empty and the state is ``unknown`` with the reason."""

    kind = "none"

    def __init__(self, message: str) -> None:
        super().__init__()
        self._unknown(message)

    def _read(self) -> Sample:
        return Sample(time.monotonic())
