"""The daemon's TOML config (``/etc/k2edge/k2edge.toml``), validated with field paths."""

from .schema import DaemonConfig, ModelConfig, MqttConfig, ServiceConfig, load_config, read_secret

__all__ = ["DaemonConfig", "ModelConfig", "MqttConfig", "ServiceConfig", "load_config", "read_secret"]
