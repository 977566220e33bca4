"""``k2edge request``: publish one request with MQTT 5 request/response and print the answer."""

from __future__ import annotations

import math
import socket
import sys

from ..errors import K2EdgeError
from .common import count, finite_float, positive_float
from .control import add_login

COMMAND = "request"
HELP = "send one request to a daemon over MQTT 5 and print its answer"
ORDER = 110


def register(p) -> None:
    p.add_argument("input", metavar="INPUT", help="image file (JPEG/PNG) or .npy tensor")
    p.add_argument("--broker", default="127.0.0.1:1883", metavar="HOST[:PORT]", help="broker (default 127.0.0.1:1883)")
    p.add_argument("--model", required=True, help="model name as the daemon serves it")
    p.add_argument("--device", default=socket.gethostname().split(".")[0], metavar="ID",
                   help="daemon's device id (default: this host's name)")
    p.add_argument("--prompt", metavar="TEXT", help="prompt for the cloud model")
    p.add_argument("--top-k", type=int, metavar="K")
    p.add_argument("--deadline-ms", type=finite_float, metavar="MS",
                   help="answer within MS or not at all; the message also expires at the broker (whole seconds). "
                        "Default: the --timeout less a margin (at most an hour), so that a slow cloud gives way to the local "
                        "answer while this waits")
    p.add_argument("--retries", type=count(0), default=0, metavar="N",
                   help="retry up to N times after busy, deadline_exceeded or cloud_unavailable (each a new attempt)")
    p.add_argument("--no-cloud", action="store_true", help="forbid escalation to the cloud")
    p.add_argument("--raw", action="store_true", help="send the image as a raw payload with its content type")
    p.add_argument("--timeout", type=positive_float, metavar="S",
                   help="seconds to wait for the answer (default 10, or the --deadline-ms and 2 s when that is longer)")
    p.add_argument("--json", action="store_true", help="print the raw JSON answer")
    add_login(p)


def run(args) -> int:
    import json
    import time
    import uuid

    from .client import RequestClient, build_payload
    from .control import broker_address, device_prefix, login
    from ..service.protocol import RETRYABLE
    from ..service.topics import valid_level

    if not valid_level(args.model):
        raise K2EdgeError(f"--model {args.model!r} cannot be a topic level (no '+', '#' or '/')")
    password = login(args)
    topic = f"{device_prefix(args)}/infer/{args.model}"
    host, port_n = broker_address(args.broker)
    request_id = uuid.uuid4().hex[:16]
    timeout, deadline_ms = wait_and_deadline(args.timeout, args.deadline_ms)

    def request(attempt: int):
        # a retry is a new attempt: the same (id, attempt) again would be taken for a redelivery
        return build_payload(args.input, prompt=args.prompt, top_k=args.top_k, deadline_ms=deadline_ms,
                             allow_cloud=not args.no_cloud, raw=args.raw, request_id=request_id, attempt=attempt)

    first = request(0)  # a bad input is refused before the broker is dialled
    with RequestClient(host, port_n, username=args.username, password=password, tls_ca=args.tls_ca,
                       reply_prefix=args.reply_prefix) as client:
        for attempt in range(args.retries + 1):
            payload, ctype, props = first if attempt == 0 else request(attempt)
            answer, elapsed_ms = client.request(topic, payload, ctype, props,
                                                timeout, deadline_ms=deadline_ms)
            code = (answer.get("error") or {}).get("code")
            if answer.get("status") == "ok" or code not in RETRYABLE or attempt == args.retries:
                break
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
    if args.json:
        print(json.dumps(answer))  # an error answer is data here too; the exit status says which it was
        return 0 if answer.get("status") == "ok" else 1
    if answer.get("status") == "ok":
        if "detections" in answer:
            best = f"{len(answer['detections'])} detection(s)" + "".join(
                f"\n  {d['label']} {d['score']:.3f} {_where(d)}" for d in answer["detections"])
        elif "outputs" in answer:
            best = ", ".join(f"{name} {o['dtype']} {o['shape']}" for name, o in answer["outputs"].items())
        else:
            best = ", ".join(f"{t['label']} {t['score']:.3f}" for t in answer.get("top_k", []))
        print(f"{args.input}: {best or '(no local answer)'}  (source {answer.get('source')}, {elapsed_ms:.1f} ms round trip, "
              f"profile {answer.get('profile')}, device {answer.get('device')})")
        if answer.get("text"):
            print(f"  cloud: {answer['text']}")
        if answer.get("escalation_reason"):
            flags = " ".join(f for f in ("degraded", "deferred") if answer.get(f))
            print(f"  {flags + ': ' if flags else ''}{answer['escalation_reason']}")
    else:
        err = answer.get("error", {})
        print(f"k2edge request: {args.input}: the daemon answered error {err.get('code')}: {err.get('message')}",
              file=sys.stderr)
        return 1
    return 0


def wait_and_deadline(timeout: float | None, deadline_ms: float | None) -> tuple[float, float | None]:
    """How long to wait, and the deadline the request carries. Without a deadline the daemon would give
    an escalated request the cloud's whole timeout and retries (a minute or more), long after this
    command stopped waiting: the wait is then the deadline, less a margin for the answer's way back.

    Raises:
        K2EdgeError: the wait given is shorter than the deadline given.
    """
    if deadline_ms is None:
        from ..service.protocol import MAX_DEADLINE_MS

        timeout = timeout or 10.0
        return timeout, round(min(MAX_DEADLINE_MS, max(1.0, 1e3 * (timeout - min(0.5, 0.1 * timeout)))), 1)
    if timeout is None:
        return max(10.0, deadline_ms / 1e3 + 2.0), deadline_ms
    if 0 < timeout * 1e3 < deadline_ms:
        raise K2EdgeError(f"--timeout {timeout:g} s is shorter than --deadline-ms {deadline_ms:g}: the answer could come "
                          "after this command stopped waiting; leave --timeout out or make it longer")
    return timeout, deadline_ms


def _where(d: dict) -> str:
    """A detection's place as one line: its box, or an oriented box with its angle in degrees."""
    if "rbox" in d:
        cx, cy, w, h, angle = d["rbox"]
        return f"centre ({cx:.1f}, {cy:.1f}) {w:.1f} x {h:.1f} at {math.degrees(angle):.1f} deg"
    return f"[{', '.join(f'{v:.1f}' for v in d['box'])}]"
