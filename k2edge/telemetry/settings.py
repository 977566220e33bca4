"""Re-exports: the thermal settings schema lives with the daemon config (:mod:`k2edge.config`)."""

from ..config.tables import SettingsError, validate_settings
from ..config.thermal import ThermalSettings

__all__ = ["ThermalSettings", "SettingsError", "validate_settings"]
