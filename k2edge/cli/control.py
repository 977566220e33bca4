"""What ``k2edge deploy`` and ``k2edge rollback`` share: the broker login (``request`` uses it too), the target (a
device or a fleet group), sending one control message and printing the answers as they arrive."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import K2EdgeError
from .common import positive_float

OK_STATUSES = ("deployed", "rolled_back")


def add_target(p: argparse.ArgumentParser, timeout: float) -> None:
    p.add_argument("--broker", required=True, metavar="HOST[:PORT]", help="the fleet's broker")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--device", metavar="ID", help="one device (its device_id)")
    who.add_argument("--group", metavar="G", help="every device of fleet group G (their [fleet] group)")
    p.add_argument("--timeout", type=positive_float, default=timeout, metavar="S",
                   help=f"seconds to wait for answers (default {timeout:g}; building engines can take minutes)")
    p.add_argument("--expect", type=int, metavar="N", help="with --group: stop waiting once N devices have answered")
    add_login(p)
    p.add_argument("--json", action="store_true", help="print each answer as a JSON line")


def add_login(p: argparse.ArgumentParser) -> None:
    """The broker login and the topics of a device, shared by ``request``, ``deploy`` and ``rollback``."""
    p.add_argument("--username", metavar="USER", help="broker login")
    p.add_argument("--password-file", metavar="FILE", help="file holding the broker password")
    p.add_argument("--tls-ca", metavar="CA.pem", help="connect over TLS, verifying the broker against this CA")
    p.add_argument("--reply-prefix", default="k2edge-client", metavar="TOPIC",
                   help="first levels of the private reply topic (an ACL may grant yours, e.g. fleet-ops/replies)")
    p.add_argument("--topic-prefix", metavar="TOPIC",
                   help="the device's topics, where its config sets [mqtt] topic_prefix (default k2edge/DEVICE)")


def login(args) -> str | None:
    """The broker password from ``--password-file`` (None without one), after checking ``--reply-prefix`` and
    ``--topic-prefix``; each bad one refused in one line before anything is sent."""
    from ..config.tables import topic_prefix_problem

    for flag, value in (("--reply-prefix", args.reply_prefix), ("--topic-prefix", args.topic_prefix)):
        if value is not None and (problem := topic_prefix_problem(value)):
            raise K2EdgeError(f"{flag} {value[:80]!r} {problem}")
    if not args.password_file:
        return None
    try:
        with open(args.password_file, encoding="utf-8") as f:
            return f.read().rstrip("\r\n")
    except OSError as exc:
        raise K2EdgeError(f"--password-file {args.password_file!r}: {exc.strerror}") from None


def device_prefix(args) -> str:
    """Where a device's topics start: ``--topic-prefix``, else ``k2edge/DEVICE``."""
    from ..service import topics

    if args.topic_prefix:
        return args.topic_prefix
    if not topics.valid_level(args.device):
        raise K2EdgeError(f"--device {args.device!r} cannot be a topic level (no '+', '#' or '/')")
    return f"k2edge/{args.device}"


def broker_address(text: str, default_host: str = "127.0.0.1", default_port: int = 1883) -> tuple[str, int]:
    """``--broker HOST[:PORT]`` (the defaults for what it leaves out).

    Raises:
        K2EdgeError: a bad port, or a host that is a URL, holds ``user:password@`` (the message never repeats it) or
            spaces.
    """
    from ..config.schema import host_problem

    if not text:  # an unset variable in a script (`--broker "$BROKER"`): say so rather than dial the default
        raise K2EdgeError("--broker is empty: give HOST[:PORT] (a port alone is :PORT)")
    shown = "(not repeated: it may hold a password)" if "@" in text else repr(text)
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        port_n = int(port) if port else default_port
        if not 1 <= port_n <= 65535:
            raise ValueError
    except ValueError:
        raise K2EdgeError(f"--broker {shown}: expected HOST[:PORT] with a port in 1..65535") from None
    problem = host_problem(host or default_host)
    if problem:
        raise K2EdgeError(f"--broker {shown}: the host {problem}")
    return host or default_host, port_n


def target_topic(args, kind: str) -> str:
    from ..service import topics

    if args.device is not None:
        prefix = device_prefix(args)
        return topics.deploy_topic(prefix) if kind == "deploy" else topics.rollback_topic(prefix)
    if not topics.valid_level(args.group):
        raise K2EdgeError(f"--group {args.group!r} cannot be a topic level (no '+', '#' or '/')")
    return topics.group_deploy_topic(args.group) if kind == "deploy" else topics.group_rollback_topic(args.group)


def describe(answer: dict) -> str:
    """One line per device's answer."""
    who = answer.get("device") or "?"
    what = " ".join(str(v) for v in (answer.get("model"), answer.get("version")) if v)
    status = answer.get("status")
    if status in OK_STATUSES:
        was = f" (was {answer['previous']})" if answer.get("previous") else ""
        note = f"; {answer['reason']}" if answer.get("check") == "already_current" else ""
        return f"{who}: {status} {what}{was}{note}"
    versions = answer.get("running") or {}
    running = ", ".join(f"{name} {version or 'unversioned'}" for name, version in versions.items())
    running = f" [running: {running}]" if running else ""
    return f"{who}: {status} {what + ': ' if what else ''}{answer.get('check') or 'error'}: {answer.get('reason')}{running}"


def target(args, kind: str) -> tuple[str, str, int, str | None]:
    """The message's topic, the broker's host and port, and the broker password, from the target options;
    each bad one refused in one line before anything is read or sent."""
    password = login(args)
    if args.expect is not None and (args.expect < 1 or args.device is not None):
        raise K2EdgeError("--expect N takes a number >= 1, with --group")
    if args.topic_prefix is not None and args.device is None:
        raise K2EdgeError("--topic-prefix names one device's topics: give it with --device, not --group")
    topic = target_topic(args, kind)
    host, port = broker_address(args.broker)
    return topic, host, port, password


def send(args, kind: str, payload: bytes, content_type: str, user_properties: dict | None = None) -> int:
    """Publish one control message and print every answer within the timeout; 0 when all succeeded."""
    from .client import RequestClient

    topic, host, port, password = target(args, kind)

    def show(answer: dict) -> None:
        print(json.dumps(answer) if args.json else describe(answer), flush=True)

    with RequestClient(host, port, username=args.username, password=password, tls_ca=args.tls_ca,
                       reply_prefix=args.reply_prefix) as client:
        corr, _ = client.send(topic, payload, content_type, user_properties)
        answers = client.collect(corr, args.timeout, expect=1 if args.device is not None else args.expect, on_answer=show)
    if not answers:
        who = f"device {args.device}" if args.device is not None else f"group {args.group}"
        raise K2EdgeError(f"no answer from {who} within {args.timeout:g} s (is it running, and is {topic} "
                          "its topic? A device that is down gets the message when it returns)")
    if args.device is None and args.expect and len(answers) < args.expect:  # a device silent is not a success
        print(f"k2edge {kind}: {len(answers)} of the {args.expect} devices expected answered within {args.timeout:g} s "
              "(a device that is down gets the message when it returns)", file=sys.stderr)
        return 1
    return 0 if all(a.get("status") in OK_STATUSES for a in answers) else 1
