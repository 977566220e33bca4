"""``k2edge request``: publish one request with MQTT 5 request/response and print the answer."""

from __future__ import annotations

import socket

from ..errors import K2EdgeError

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
    p.add_argument("--deadline-ms", type=float, metavar="MS")
    p.add_argument("--no-cloud", action="store_true", help="forbid escalation to the cloud")
    p.add_argument("--raw", action="store_true", help="send the image as a raw payload with its content type")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for the answer (default 10)")
    p.add_argument("--json", action="store_true", help="print the raw JSON answer")


def run(args) -> int:
    import json

    from ..service.client import RequestClient, build_payload
    from ..service.topics import valid_level

    for what, value in (("--model", args.model), ("--device", args.device)):
        if not valid_level(value):
            raise K2EdgeError(f"{what} {value!r} cannot be a topic level (no '+', '#' or '/')")

    host, _, port = args.broker.partition(":")
    try:
        port_n = int(port) if port else 1883
    except ValueError:
        raise K2EdgeError(f"--broker {args.broker!r}: port must be a number") from None
    payload, ctype, props = build_payload(args.input, prompt=args.prompt, top_k=args.top_k,
                                          deadline_ms=args.deadline_ms, allow_cloud=not args.no_cloud, raw=args.raw)
    with RequestClient(host or "127.0.0.1", port_n) as client:
        answer, elapsed_ms = client.request(f"k2edge/{args.device}/infer/{args.model}", payload, ctype, props, args.timeout)
    if args.json:
        print(json.dumps(answer))
    elif answer.get("status") == "ok":
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
        print(f"{args.input}: error {err.get('code')}: {err.get('message')}")
        return 1
    return 0
