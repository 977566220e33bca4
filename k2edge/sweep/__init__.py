"""pareto-sweep: measure configurations, find the latency / accuracy / energy front, recommend a profile.

Pure pieces (``configs``, ``frontier``, the curve in ``measure``) decide; ``runner`` measures
through the engine; ``report`` draws. Heavy imports (onnxruntime, matplotlib, rich) happen inside
the functions that use them.
"""

from __future__ import annotations

from .configs import DEFAULT_PROFILES, GRID_FIELDS, SweepConfig, config_key, grid_configs, parse_grid, sweep_configs
from .errors import NoRecommendation, SweepError
from .frontier import GOALS, Point, Recommendation, balanced_costs, dominates, pareto_front, recommend
from .measure import MeasureSettings, confidence_curve, measure_run, summarise
from .runner import SweepOutcome, SweepSpec, run_sweep
from .sampler import TelemetrySampler

__all__ = [
    "DEFAULT_PROFILES",
    "GOALS",
    "GRID_FIELDS",
    "MeasureSettings",
    "NoRecommendation",
    "Point",
    "Recommendation",
    "SweepConfig",
    "SweepError",
    "SweepOutcome",
    "SweepSpec",
    "TelemetrySampler",
    "balanced_costs",
    "config_key",
    "confidence_curve",
    "dominates",
    "grid_configs",
    "measure_run",
    "pareto_front",
    "parse_grid",
    "recommend",
    "run_sweep",
    "summarise",
    "sweep_configs",
]
