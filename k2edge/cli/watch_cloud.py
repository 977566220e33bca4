"""``k2edge watch --cloud-config FILE``: the daemon's stream escalation on one source, follow-ups printed beside
the events, so a prompt can be tuned before it is deployed.

FILE is TOML: a ``[cloud]`` table (as in the daemon's config) and ``[[escalation]]`` rules (the keys of
``[[streams.escalation]]``); without rules there, those of ``--config``'s ``--stream``. The jobs, the worker, the
verdict parse and the budget share are the daemon's (:mod:`k2edge.service.stream_escalation`); their files live
in a temporary folder removed at the end.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from pydantic import Field, ValidationError

from ..config.cloud import CloudSettings
from ..config.stream_escalation import EscalationRule
from ..config.tables import Strict
from ..errors import InputError


class _CloudFile(Strict):
    cloud: CloudSettings
    escalation: tuple[EscalationRule, ...] = Field(())


def load_cloud_file(path: str) -> tuple[CloudSettings, tuple[EscalationRule, ...]]:
    """The ``[cloud]`` table and the ``[[escalation]]`` rules of ``path``.

    Raises:
        InputError: missing, not TOML, or invalid (naming each field by its path).
    """
    from ..config.toml import read_toml
    from ..profile.validation import describe_validation_error, model_keys

    p = Path(path)
    data = read_toml(p, InputError, f"--cloud-config {path!r}: no such file")
    cloud = data.get("cloud")
    if isinstance(cloud, dict) and isinstance(cloud.get("api_key_file"), str) and not Path(cloud["api_key_file"]).is_absolute():
        cloud["api_key_file"] = str(p.resolve().parent / cloud["api_key_file"])
    try:
        f = _CloudFile.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{path}: {describe_validation_error(exc, model_keys(_CloudFile))}") from None
    return f.cloud, f.escalation


class _Printer:
    """The follow-ups' sink: each one printed (a JSON line with ``--json``), stored like the daemon's."""

    def __init__(self, events, say, as_json: bool) -> None:
        self.events, self.say, self.as_json = events, say, as_json

    def follow_up(self, stream: str, body: dict) -> None:
        self.events.add([(body["event_id"], f"watch/{stream}/events", json.dumps(body).encode())])
        if self.as_json:
            self.say(json.dumps(body))
        elif body["event"] == "event_described":
            verdict = f" verdict={body['verdict']}" if body.get("verdict") else ""
            self.say(f"  k2 {body['for_event'][:8]}{verdict} label={body.get('label')} ({body['latency_ms']:.0f} ms, "
                     f"{body['attempts']} attempt(s)): {body['description']}")
        else:
            self.say(f"  k2 {body['for_event'][:8]} failed: {body['reason']}")


class WatchCloud:
    """The escalation of ``k2edge watch``: rules, the bridge, the job queue, a worker, the printer.

    Args:
        settings: the ``[cloud]`` table.
        rules: the escalation rules.
        say: prints one whole line (shared with the watch loop's own lines).
        as_json: follow-ups as JSON lines.
    """

    def __init__(self, settings: CloudSettings, rules, say, as_json: bool = False) -> None:
        from ..cloud_bridge import CloudBridge
        from ..service.event_store import EventStore
        from ..service.stream_escalation import EscalationJobs, StreamEscalations

        if not rules:
            raise InputError("--cloud-config: no [[escalation]] rules (there, or in --config's --stream)")
        self.rules = tuple(rules)
        self._dir = tempfile.TemporaryDirectory(prefix="k2edge-watch-")
        root = Path(self._dir.name)
        self.bridge = CloudBridge(settings, root)
        self.events = EventStore(root / "events.sqlite")
        self.printer = _Printer(self.events, say, as_json)
        self.escalations = StreamEscalations(self.bridge, EscalationJobs(root / "stream_escalations.sqlite3"),
                                             self.events, self.printer)
        self.escalations.start()

    def submit(self, stream: str, body: dict, selected) -> None:
        """As the daemon: the job first, then the event stored."""
        self.escalations.submit(stream, body, selected)
        self.events.add([(body["event_id"], f"watch/{stream}/events", json.dumps(body).encode())])

    def finish(self, wait_s: float) -> int:
        """Wait up to ``wait_s`` for the follow-ups still to come; stop; the number left unanswered."""
        end = time.monotonic() + wait_s
        while self.escalations.jobs.waiting() and time.monotonic() < end:
            time.sleep(0.1)
        left = sum(self.escalations.jobs.waiting().values())
        self.escalations.stop(1.0)
        self.escalations.close()
        self.events.close()
        self.bridge.close()
        self._dir.cleanup()
        if left:
            print(f"watch: {left} escalation(s) still unanswered after {wait_s:g} s (the cloud: "
                  f"{self.bridge.breaker.last_error or 'no answer yet'})", file=sys.stderr)
        return left
