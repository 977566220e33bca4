"""Thermal zones and INA3221 power rails read straight from sysfs, under an injectable root.

Layout (Jetson Linux r35/r36, the kernel's generic thermal and hwmon ABIs):

* ``/sys/class/thermal/thermal_zone*/type`` (``cpu-thermal``, ``gpu-thermal``, ``cv0-thermal``,
  ``soc0-thermal``, ``tj-thermal``, ...) and ``temp`` in millidegrees Celsius. On Orin the
  ``cv*`` zones answer EAGAIN while the DLA/PVA cluster is power-gated; such a zone is skipped
  for that sample, not an error.
* INA3221 monitors at ``/sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon*/`` (``ina3221x``
  on older releases; also reachable as ``/sys/class/hwmon/hwmon*`` with ``name`` = ``ina3221``):
  ``in<N>_label`` names the rail, ``in<N>_input`` is its voltage in mV, ``curr<N>_input`` its
  current in mA. Channels labelled ``NC`` are not connected and channel 7 is the "sum of shunt
  voltages", both skipped (as jetson-stats does, ``jtop/core/power.py``).
* Rails per module (NVIDIA Jetson Linux Developer Guide, "Jetson Orin Nano Series, Jetson Orin
  NX Series and Jetson AGX Orin Series", software-based power consumption modelling):
  AGX Orin ``1-0040``: ``VDD_GPU_SOC``, ``VDD_CPU_CV``, ``VIN_SYS_5V0`` and ``1-0041``:
  ``NC``, ``VDDQ_VDD2_1V8AO``, ``NC``; Orin NX and Orin Nano ``1-0040``: ``VDD_IN`` (the
  module's input), ``VDD_CPU_GPU_CV``, ``VDD_SOC``.

The board's input power (:attr:`Sample.total_power_w`) is ``VDD_IN`` where it exists, else the sum
of every connected rail (AGX Orin has no single input rail; jetson-stats sums the same way).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from .base import Sample, TelemetrySource

log = logging.getLogger(__name__)

__all__ = ["SysfsSource", "THERMAL_DIR", "INA3221_DRIVER_DIRS", "HWMON_CLASS_DIR", "INPUT_RAILS"]

THERMAL_DIR = "sys/class/thermal"
INA3221_DRIVER_DIRS = ("sys/bus/i2c/drivers/ina3221", "sys/bus/i2c/drivers/ina3221x")
HWMON_CLASS_DIR = "sys/class/hwmon"
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")
_LABEL_RE = re.compile(r"^in(\d+)_label\Z")
_SUM_OF_SHUNTS = 7
# Plausible die temperatures; -256 °C is how Tegra reports an offline sensor.
_MIN_C, _MAX_C = -40.0, 200.0


def zone_name(zone_type: str) -> str:
    """``cpu-thermal`` -> ``cpu`` (the name jtop shows); other types unchanged."""
    for suffix in ("-thermal", "_thermal"):
        if zone_type.endswith(suffix) and len(zone_type) > len(suffix):
            return zone_type[: -len(suffix)]
    return zone_type


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError, TypeError):
        # TypeError: some Python versions surface a zone's EAGAIN as a None read.
        return None


def _read_number(path: Path) -> float | None:
    text = _read_text(path)
    if not text:
        return None
    try:
        return float(text.split()[0])
    except ValueError:
        return None


class SysfsSource(TelemetrySource):
    """Thermal zones and INA3221 rails under ``root`` (``/`` on the device, a fake tree in tests).

    Args:
        root: the directory that holds ``sys/``.
    """

    kind = "sysfs"

    def __init__(self, root: str | os.PathLike = "/") -> None:
        super().__init__()
        self.root = Path(root)
        self.zones: dict[str, Path] = self._find_zones()
        self.rails: dict[str, tuple[Path, Path]] = self._find_rails()
        if not self.zones and not self.rails:
            self._unknown(f"sysfs: no thermal zone under {self.root / THERMAL_DIR} and no INA3221 power monitor under "
                          f"{self.root / INA3221_DRIVER_DIRS[0]}")
        else:
            log.info("sysfs telemetry: zones %s, rails %s", sorted(self.zones), sorted(self.rails))

    @property
    def found(self) -> bool:
        """True when at least one thermal zone or power rail exists."""
        return bool(self.zones or self.rails)

    @property
    def has_jetson_sensors(self) -> bool:
        """True when an INA3221 power monitor exists (a Jetson, not a PC's ACPI zones)."""
        return bool(self.rails)

    # discovery ---------------------------------------------------------------------------------
    def _find_zones(self) -> dict[str, Path]:
        base = self.root / THERMAL_DIR
        zones: dict[str, Path] = {}
        if not base.is_dir():
            return zones
        for zone in sorted(base.glob("thermal_zone*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
            kind = _read_text(zone / "type")
            if not kind or "PMIC" in kind or not (zone / "temp").exists():
                continue
            name = zone_name(kind)
            unique, i = name, 1
            while unique in zones:
                unique, i = f"{name}{i}", i + 1
            zones[unique] = zone / "temp"
        return zones

    def _hwmon_dirs(self) -> list[Path]:
        dirs: list[Path] = []
        for driver in INA3221_DRIVER_DIRS:
            dirs.extend(sorted((self.root / driver).glob("*/hwmon/hwmon*")))
        for hw in sorted((self.root / HWMON_CLASS_DIR).glob("hwmon*")):
            if (_read_text(hw / "name") or "").startswith("ina3221"):
                dirs.append(hw)
        unique, seen = [], set()
        for d in dirs:
            key = d.resolve()
            if key not in seen:
                seen.add(key)
                unique.append(d)
        return unique

    def _find_rails(self) -> dict[str, tuple[Path, Path]]:
        rails: dict[str, tuple[Path, Path]] = {}
        for hw in self._hwmon_dirs():
            for label_file in sorted(hw.glob("in*_label")):
                m = _LABEL_RE.match(label_file.name)
                if not m:
                    continue
                channel = int(m.group(1))
                label = _read_text(label_file) or ""
                if not label or label.upper() == "NC" or channel == _SUM_OF_SHUNTS or "sum of shunt" in label.lower():
                    continue
                volt, curr = hw / f"in{channel}_input", hw / f"curr{channel}_input"
                if volt.exists() and curr.exists():
                    rails.setdefault(label, (volt, curr))
        return rails

    # reading -----------------------------------------------------------------------------------
    def _read(self) -> Sample:
        t = time.monotonic()
        temps: dict[str, float] = {}
        for name, path in self.zones.items():
            milli = _read_number(path)
            if milli is None:
                continue
            c = milli / 1000.0
            if _MIN_C < c < _MAX_C:
                temps[name] = c
        rails: dict[str, float] = {}
        for label, (volt, curr) in self.rails.items():
            mv, ma = _read_number(volt), _read_number(curr)
            if mv is not None and ma is not None:
                rails[label] = mv * ma / 1e6
        total = input_power(rails)
        if not self.found:
            pass  # state stays unknown with the discovery message
        elif self.zones and not temps and not rails:
            self._unknown(f"sysfs: none of the {len(self.zones)} thermal zones under {self.root / THERMAL_DIR} could be read")
        else:
            self.state, self.message = "ok", ""
        return Sample(t, temps, rails, total)


def input_power(rails: dict[str, float]) -> float | None:
    """The board's input power from its rails: ``VDD_IN`` where present, else their sum; None without rails."""
    for name in INPUT_RAILS:
        if name in rails:
            return rails[name]
    return sum(rails.values()) if rails else None
