"""GPU temperature and board power through NVML (discrete NVIDIA GPUs; not on Jetson, whose
integrated GPU NVML does not expose). ``pynvml`` comes from the ``nvidia-ml-py`` package.
"""

from __future__ import annotations

import logging
import time
from types import ModuleType

from .base import Sample, TelemetrySource

log = logging.getLogger(__name__)

__all__ = ["NvmlSource"]


class NvmlSource(TelemetrySource):
    """Every GPU NVML sees: ``gpu<i>`` temperatures, ``gpu<i>`` power rails, their sum as the total.

    Args:
        pynvml_module: the ``pynvml`` module (injected by tests; imported here otherwise).
    """

    kind = "nvml"

    def __init__(self, pynvml_module: ModuleType | None = None) -> None:
        super().__init__()
        self._nv = None
        self._handles: list = []
        nv = pynvml_module
        if nv is None:
            try:
                import pynvml as nv  # noqa: PLC0415 - optional dependency
            except ImportError:
                self._unknown("NVML is not available: pip install nvidia-ml-py (and an NVIDIA driver)")
                return
        try:
            nv.nvmlInit()
            self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        except Exception as exc:  # pynvml raises NVMLError subclasses generated at runtime
            self._unknown(f"NVML could not start ({exc}); is the NVIDIA driver loaded?")
            return
        self._nv = nv
        if not self._handles:
            self._unknown("NVML sees no GPU")

    @property
    def found(self) -> bool:
        return bool(self._handles)

    def _read(self) -> Sample:
        t = time.monotonic()
        if self._nv is None:
            return Sample(t)
        nv = self._nv
        temps: dict[str, float] = {}
        rails: dict[str, float] = {}
        for i, h in enumerate(self._handles):
            try:
                temps[f"gpu{i}"] = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            except Exception as exc:
                log.debug("nvml temperature gpu%d: %s", i, exc)
            try:
                rails[f"gpu{i}"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0  # mW
            except Exception as exc:
                log.debug("nvml power gpu%d: %s", i, exc)
        if not temps and not rails:
            self._unknown("NVML answered no temperature or power for any GPU")
        elif self._handles:
            self.state, self.message = "ok", ""
        return Sample(t, temps, rails, sum(rails.values()) if rails else None)

    def close(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except Exception as exc:
                log.debug("nvml shutdown: %s", exc)
            self._nv = None
