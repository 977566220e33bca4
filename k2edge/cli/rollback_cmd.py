"""``k2edge rollback``: return a device's (or a fleet group's) model to its previous version."""

from __future__ import annotations

from .control import add_target

COMMAND = "rollback"
HELP = "roll a model back to its previous version on a device or a fleet group over MQTT"
ORDER = 118


def register(p) -> None:
    p.add_argument("--model", required=True, metavar="NAME", help="the model's name, as the devices serve it")
    add_target(p, timeout=300.0)


def run(args) -> int:
    import json

    from .control import send

    return send(args, "rollback", json.dumps({"model": args.model}).encode(), "application/json")
