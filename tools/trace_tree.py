#!/usr/bin/env python3
"""Print traces as trees: each span with its duration, offset from the trace's start, and its key attributes.

    python tools/trace_tree.py spans.jsonl            # spans as JSON lines (tests/support/otlp_receiver.py's dicts)
    python tools/trace_tree.py --listen 4318          # a tiny OTLP/HTTP receiver: prints each trace as it arrives

``--listen`` needs opentelemetry-proto (``pip install 'k2edge[dev]'``); a trace is printed once no span of it
arrived for ``--quiet-s`` seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHOWN = ("k2edge.device", "k2edge.lane", "k2edge.precision", "k2edge.decision", "messaging.batch.message_count",
         "gen_ai.request.model", "gen_ai.response.model", "k2edge.cloud.attempts", "k2edge.cloud.breaker",
         "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "k2edge.status", "error.type")


def render(spans: list[dict]) -> str:
    """The trees of ``spans`` (dicts with trace_id, span_id, parent_id, name, start, end, attributes), one per
    trace; a span whose parent is not among them (the requester's) is a root."""
    out = []
    for trace_id in dict.fromkeys(s["trace_id"] for s in sorted(spans, key=lambda s: s["start"])):
        members = [s for s in spans if s["trace_id"] == trace_id]
        ids = {s["span_id"] for s in members}
        children: dict[str | None, list[dict]] = {}
        for s in members:
            children.setdefault(s["parent_id"] if s["parent_id"] in ids else None, []).append(s)
        t0 = min(s["start"] for s in members)
        out.append(f"trace {trace_id}")

        def walk(parent: str | None, indent: str) -> None:
            kids = sorted(children.get(parent, []), key=lambda s: (s["start"], s["end"]))
            for i, s in enumerate(kids):
                last = i == len(kids) - 1
                attrs = s.get("attributes", {})
                extra = " ".join(f"{k.split('.', 1)[1]}={attrs[k]}" for k in SHOWN if k in attrs)
                links = f" links={len(s['links'])}" if s.get("links") else ""
                out.append(f"{indent}{'└─ ' if last else '├─ '}{s['name']:<{max(8, 44 - len(indent))}} "
                           f"{(s['end'] - s['start']) / 1e6:9.3f} ms  @{(s['start'] - t0) / 1e6:8.3f}{links}"
                           f"{'  ' + extra if extra else ''}")
                walk(s["span_id"], indent + ("   " if last else "│  "))

        walk(None, "")
    return "\n".join(out)


def _listen(host: str, port: int, quiet_s: float) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from otlp_receiver import OtlpReceiver

    r = OtlpReceiver(host, port).start()
    print(f"receiving OTLP/HTTP on {r.endpoint}/v1/traces", file=sys.stderr)
    printed: set[str] = set()
    while True:
        time.sleep(quiet_s / 2)
        now = time.time_ns()
        spans = list(r.spans)
        done = {s["trace_id"] for s in spans} - printed
        for tid in sorted(done):
            members = [s for s in spans if s["trace_id"] == tid]
            if now - max(s["end"] for s in members) > quiet_s * 1e9:
                print(render(members), flush=True)
                printed.add(tid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spans", nargs="?", help="a JSON-lines file of spans")
    ap.add_argument("--listen", type=int, metavar="PORT", help="receive OTLP/HTTP on PORT and print traces")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    ap.add_argument("--quiet-s", type=float, default=2.0)
    args = ap.parse_args(argv)
    if args.listen is not None:
        _listen(args.host, args.listen, args.quiet_s)
        return 0
    if not args.spans:
        ap.error("give a spans file or --listen PORT")
    spans = [json.loads(line) for line in Path(args.spans).read_text().splitlines() if line.strip()]
    print(render(spans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
