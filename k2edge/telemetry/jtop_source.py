"""Temperatures and power rails from jetson-stats' ``jtop`` (4.x), which reads them through the
root ``jtop.service`` over ``/run/jtop.sock``.

jetson-stats 4.x API used here (``from jtop import jtop, JtopException``): ``jtop(interval=s)``,
``start()`` (raises ``JtopException`` when the service is not active), ``close()``,
``temperature`` -> ``{name: {"temp": °C, "online": bool}}`` and ``power`` ->
``{"rail": {NAME: {"power": mW, ...}}, "tot": {"power": mW, "name": "VDD_IN"?}}`` (the total is
``VDD_IN`` where the module has it, taken out of ``rail``, else the sum of the rails).
A connection refused at start or lost later is made again, with a jittered backoff (5 s doubling to
60 s), so starting jtop.service after the daemon brings the readings back. The logic here is deliberately
thin: the sysfs source reads the same sensors and is the one tested on fake trees.
"""

from __future__ import annotations

import logging
import time
from types import ModuleType

from ..backoff import backoff
from .base import Sample, TelemetrySource

log = logging.getLogger(__name__)

__all__ = ["JtopSource", "START_HINT"]

START_HINT = "sudo systemctl enable --now jtop.service"
INSTALL_HINT = "pip install jetson-stats, then " + START_HINT


class JtopSource(TelemetrySource):
    """A live jtop connection, made again when jtop.service was not running or went away.

    Args:
        interval_s: jtop's update interval.
        jtop_module: the ``jtop`` module (injected by tests; imported here otherwise).
        clock: the time source (tests); ``time.monotonic``.
    """

    kind = "jtop"
    RETRY_S = (5.0, 60.0)
    """Reconnection delays: jittered, doubling from 5 s to at most 60 s while jtop.service stays away."""

    def __init__(self, interval_s: float = 0.5, jtop_module: ModuleType | None = None,
                 clock=time.monotonic) -> None:
        super().__init__()
        self._jetson, self._interval_s, self._clock = None, interval_s, clock
        self._attempt, self._next_try = 0, 0.0
        self._module = jtop_module
        if self._module is None:
            try:
                import jtop as module  # noqa: PLC0415 - Jetson-only dependency
            except ImportError:
                self._unknown(f"jetson-stats (jtop) is not installed: {INSTALL_HINT}")
                return
            self._module = module
        self._connect()

    def _connect(self) -> None:
        """Start a jtop connection; on failure the source is unknown and the next try waits its backoff."""
        module = self._module
        try:
            jetson = module.jtop(interval=self._interval_s)
            jetson.start()
        except module.JtopException as exc:
            detail = " ".join(str(exc).split())
            self._retry_later(f"jtop.service is not running: {START_HINT} ({detail})")
            return
        except (OSError, ValueError) as exc:
            self._retry_later(f"jtop could not connect to jtop.service ({exc}): {START_HINT}")
            return
        if self._attempt:
            log.info("jtop: connected to jtop.service again")
        self._jetson, self._attempt = jetson, 0

    def _retry_later(self, message: str) -> None:
        self._unknown(message)
        self._next_try = self._clock() + backoff(self._attempt, *self.RETRY_S)
        self._attempt += 1

    def _read(self) -> Sample:
        t = time.monotonic()
        if self._jetson is None:
            if self._module is not None and self._clock() >= self._next_try:
                self._connect()
            if self._jetson is None:
                return Sample(t)
        try:
            temperatures = _temperatures(self._jetson.temperature)
            rails, total = _power(self._jetson.power)
        except Exception as exc:  # jtop surfaces a lost service as assorted errors from its thread
            self.close()
            self._retry_later(f"jtop lost jtop.service ({type(exc).__name__}: {exc}): {START_HINT}")
            return Sample(t)
        self.state, self.message = "ok", ""
        return Sample(t, temperatures, rails, total)

    def close(self) -> None:
        if self._jetson is not None:
            try:
                self._jetson.close()
            except Exception as exc:  # closing a dead connection must not fail the caller
                log.debug("jtop close: %s", exc)
            self._jetson = None


def _temperatures(raw: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in (raw or {}).items():
        if isinstance(value, dict):  # 4.x
            if not value.get("online", True):
                continue
            value = value.get("temp")
        try:
            c = float(value)
        except (TypeError, ValueError):
            continue
        if -40.0 < c < 200.0:  # -256 marks an offline sensor
            out[str(name)] = c
    return out


def _power(raw) -> tuple[dict[str, float], float | None]:
    if not isinstance(raw, dict):
        return {}, None
    rails = {str(name): float(v["power"]) / 1000.0 for name, v in (raw.get("rail") or {}).items()
             if isinstance(v, dict) and v.get("power") is not None}
    tot = raw.get("tot") or {}
    total = float(tot["power"]) / 1000.0 if tot.get("power") is not None else None
    if tot.get("name") and total is not None:
        rails[str(tot["name"])] = total  # jtop moves the input rail out of "rail"; keep every rail visible
    return rails, total
