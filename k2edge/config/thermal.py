"""Schema of the daemon config's ``[thermal]`` table: the governor's budget and its source."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from .tables import Strict, bound

__all__ = ["ThermalSettings"]


def _gap(fields: dict) -> float | None:
    soft, hard = fields.get("soft_c"), fields.get("hard_c")
    return hard - soft if soft is not None and hard is not None else None


class ThermalSettings(Strict):
    """The thermal governor's budget and where its readings come from.

    Temperatures are the hottest of the watched sensors (``sensors``; all when empty). A state is
    entered when the temperature reaches its limit and left only once it falls ``hysteresis_c``
    below it; readings pass a median filter of ``filter_samples`` first, so one wild reading
    cannot flip the state.
    """

    model_config = ConfigDict(frozen=False)  # Strict's rules, not frozen

    source: Literal["auto", "jtop", "sysfs", "nvml", "trace"] = "auto"
    trace: Path | None = Field(None, validate_default=True)
    sysfs_root: Path = Path("/")
    sample_interval_ms: int = Field(500, ge=10, le=60_000)
    sensors: list[str] = Field(default_factory=list)
    soft_c: float = Field(75.0, gt=0, lt=150)
    hard_c: float = Field(85.0, gt=0, lt=150)
    critical_c: float = Field(95.0, gt=0, lt=150)
    hysteresis_c: float = Field(3.0, ge=0, le=20)
    filter_samples: int = Field(3, ge=1, le=15)
    power_budget_w: float | None = Field(None, gt=0)
    power_window_s: float = Field(10.0, gt=0, le=3600)
    power_hysteresis_w: float = Field(1.0, ge=0)
    power_state: Literal["warm", "hot"] = "warm"

    @field_validator("trace")
    @classmethod
    def _trace_for_source(cls, v, info: ValidationInfo):
        if info.data.get("source") == "trace" and v is None:
            raise ValueError("source 'trace' needs trace = PATH (a .jsonl or .csv trace)")
        return v

    _hard_above_soft = bound("hard_c", ">", "soft_c")
    _critical_above_hard = bound("critical_c", ">", "hard_c")
    _hysteresis_below_gap = bound("hysteresis_c", "<", "hard_c - soft_c", value=_gap)
