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
    if args.broker is not None:
        from .control import broker_address

        host, port = broker_address(args.broker, cfg.mqtt.host, cfg.mqtt.port)
        cfg = cfg.model_copy(update={"mqtt": cfg.mqtt.model_copy(update={"host": host, "port": port})})
    if args.backend:
        cfg = cfg.model_copy(update={"models": tuple(m.model_copy(update={"backend": args.backend}) for m in cfg.models)})
    if not args.verbose:
        logging.getLogger("k2edge").setLevel(logging.INFO)
    return serve(cfg)
