"""The daemon's TOML config (``/etc/k2edge/k2edge.toml``) and model cards, validated with field paths."""

from .card import CardError, ModelCard, find_card, load_card, resolve_card
from .schema import DaemonConfig, ModelConfig, MqttConfig, ServiceConfig, load_config, read_secret

__all__ = ["CardError", "DaemonConfig", "ModelCard", "ModelConfig", "MqttConfig", "ServiceConfig", "find_card", "load_card",
           "load_config", "read_secret", "resolve_card"]
