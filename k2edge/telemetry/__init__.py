"""Thermal and power telemetry, and the thermal governor.

Sources (``open_source(kind)``), each returning :class:`Sample` objects:

* ``jtop``: jetson-stats 4.x through the root ``jtop.service``; when the service is not running
  the source's ``state`` is ``"unknown"`` and ``message`` says how to start it.
* ``sysfs``: thermal zones and the Jetson INA3221 power rails, read under an injectable root.
* ``nvml``: GPU temperature and power on machines with a discrete NVIDIA GPU (``nvidia-ml-py``).
* ``trace``: a recorded JSONL/CSV trace (tests, replays); see :mod:`k2edge.telemetry.trace`.
* ``auto``: the trace when one is given, else jtop when its service answers, else sysfs when the
  board has INA3221 rails, else NVML when it sees a GPU, else any sysfs thermal zones, else a
  source whose state is ``unknown``.

Using it::

    from k2edge.telemetry import open_source
    from k2edge.telemetry.energy import energy_per_inference

    src = open_source("auto")              # or open_source("sysfs", root=Path("/tmp/fake"))
    s0 = src.sample(); t0 = time.monotonic()
    ... run N inferences, sampling every ~100 ms into `samples` ...
    joules = energy_per_inference(samples, t0, time.monotonic(), N)   # None without a power rail
    src.close()

The daemon's side (one sampler thread feeding the governor; read the state from any thread)::

    from k2edge.telemetry import ThermalSettings, thermal_sampler

    sampler = thermal_sampler(ThermalSettings(soft_c=75, hard_c=85, critical_c=95),
                              on_transition=lambda st: queue.put(("thermal", st)))
    sampler.start()
    st = sampler.state            # GovernorState(state, changed, reason, temperature_c, ...)
    st.prefer_dla                 # warm/hot: switch models to their DLA-heavier profile
    st.refuses_local_work         # critical: no new local inference
    telemetry["thermal"] = sampler.snapshot()   # state, reason, last transitions, last sample
    sampler.stop(); sampler.source.close()

The governor itself is pure (``ThermalGovernor(settings).update(sample) -> GovernorState``); its
rules are in :mod:`k2edge.telemetry.governor`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .base import Sample, TelemetryError, TelemetrySource, UnavailableSource
from .governor import STATES, GovernorState, ThermalGovernor, ThermalSampler, Transition
from ..config.tables import SettingsError, validate_settings
from ..config.thermal import ThermalSettings

log = logging.getLogger(__name__)

__all__ = [
    "open_source",
    "thermal_sampler",
    "Sample",
    "TelemetrySource",
    "UnavailableSource",
    "TelemetryError",
    "ThermalSettings",
    "SettingsError",
    "validate_settings",
    "ThermalGovernor",
    "GovernorState",
    "Transition",
    "ThermalSampler",
    "STATES",
    "SOURCE_KINDS",
]

SOURCE_KINDS = ("auto", "jtop", "sysfs", "nvml", "trace")
JTOP_SOCKET = "run/jtop.sock"


def open_source(kind: str = "auto", root: str | os.PathLike = Path("/"), trace: str | os.PathLike | None = None,
                **options) -> TelemetrySource:
    """Open a telemetry source.

    Args:
        kind: ``auto``, ``jtop``, ``sysfs``, ``nvml`` or ``trace``.
        root: the directory holding ``sys/`` and ``run/`` (``/`` on a device; a fake tree in tests).
        trace: a JSONL/CSV trace; required for ``trace``, and chosen by ``auto`` when given.
        options: passed to the source (``realtime``/``loop`` for traces, ``jtop_module``,
            ``pynvml_module`` for test doubles).

    Returns:
        A source. A source that exists but cannot read (jtop without its service, a machine with
        no sensor) is returned with ``state == "unknown"`` and a ``message`` saying why.

    Raises:
        TelemetryError: an unknown kind, ``trace`` without a file, or a malformed trace.
    """
    root = Path(root)
    if kind not in SOURCE_KINDS:
        raise TelemetryError(f"telemetry source must be one of {', '.join(SOURCE_KINDS)}, got {kind!r}")
    if kind == "trace" or (kind == "auto" and trace is not None):
        if trace is None:
            raise TelemetryError("telemetry source 'trace' needs a trace file (.jsonl or .csv)")
        from .trace import TraceSource

        return TraceSource(trace, **{k: v for k, v in options.items() if k in ("realtime", "loop", "clock")})
    if kind == "jtop":
        from .jtop_source import JtopSource

        return JtopSource(**{k: options[k] for k in ("jtop_module", "clock") if k in options})
    if kind == "sysfs":
        from .sysfs import SysfsSource

        return SysfsSource(root)
    if kind == "nvml":
        from .nvml import NvmlSource

        return NvmlSource(pynvml_module=options.get("pynvml_module"))
    return _auto(root, options)


def _auto(root: Path, options: dict) -> TelemetrySource:
    from .nvml import NvmlSource
    from .sysfs import SysfsSource

    tried = []
    if (root / JTOP_SOCKET).exists():
        from .jtop_source import JtopSource

        src = JtopSource(jtop_module=options.get("jtop_module"))
        if src.state == "ok":
            return src
        tried.append(src.message)
        src.close()
    sysfs = SysfsSource(root)
    if sysfs.has_jetson_sensors:
        return sysfs
    nvml = NvmlSource(pynvml_module=options.get("pynvml_module"))
    if nvml.state == "ok":
        return nvml
    tried.append(nvml.message)
    nvml.close()
    if sysfs.found:
        return sysfs
    tried.append(sysfs.message)
    return UnavailableSource("no telemetry source found: " + "; ".join(m for m in tried if m))


def thermal_sampler(settings: ThermalSettings | None = None, *, on_transition=None, root: str | os.PathLike | None = None,
                    **options) -> ThermalSampler:
    """A :class:`ThermalSampler` (not started) on the source ``settings`` names, feeding a governor with its limits."""
    settings = settings or ThermalSettings()
    src = open_source(settings.source, settings.sysfs_root if root is None else root, settings.trace, **options)
    if src.state != "ok":
        log.warning("thermal telemetry: %s", src.message)
    return ThermalSampler(src, ThermalGovernor(settings), on_transition=on_transition)
