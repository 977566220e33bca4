"""``k2edge serve [--config PATH]``: the MQTT daemon."""

from __future__ import annotations

COMMAND = "serve"
HELP = "run the daemon: serve the configured models over MQTT 5"
ORDER = 100


def register(p) -> None:
    p.add_argument("--config", "-c", metavar="PATH", default=None,
                   help="daemon config (TOML); default /etc/k2edge/k2edge.toml")
    p.add_argument("--broker", metavar="HOST[:PORT]", help="override the config's mqtt.host and mqtt.port")
    p.add_argument("--backend", choices=("auto", "onnxruntime", "tensorrt"),
                   help="override every model's backend from the config (default: the config's, itself auto)")


def run(args) -> int:
    import logging

    from ..config import load_config
    from ..service.daemon import serve

    cfg = load_config(args.config)
    if args.broker:
        from ..errors import K2EdgeError

        from pydantic import ValidationError

        from ..config.schema import MqttConfig

        host, _, port = args.broker.rpartition(":") if ":" in args.broker else (args.broker, "", "")
        try:
            fields = {**cfg.mqtt.model_dump(), "host": host or cfg.mqtt.host, "port": int(port) if port else cfg.mqtt.port}
            mqtt = MqttConfig.model_validate(fields)
        except (ValueError, ValidationError):
            raise K2EdgeError(f"--broker {args.broker!r}: expected HOST[:PORT] with a port in 1..65535") from None
        cfg = cfg.model_copy(update={"mqtt": mqtt})
    if args.backend:
        cfg = cfg.model_copy(update={"models": tuple(m.model_copy(update={"backend": args.backend}) for m in cfg.models)})
    if not args.verbose:
        logging.getLogger("k2edge").setLevel(logging.INFO)
    return serve(cfg)
