"""``k2edge serve [--config PATH]``: the MQTT daemon."""

from __future__ import annotations

COMMAND = "serve"
HELP = "run the daemon: serve the configured models over MQTT 5"
ORDER = 100


def register(p) -> None:
    p.add_argument("--config", "-c", metavar="PATH", default=None,
                   help="daemon config (TOML); default /etc/k2edge/k2edge.toml")


def run(args) -> int:
    import logging

    from ..config import load_config
    from ..service.daemon import serve

    cfg = load_config(args.config)
    if not args.verbose:
        logging.getLogger("k2edge").setLevel(logging.INFO)
    return serve(cfg)
