"""What recording and encoding a traced request's spans cost, in one process, without the daemon.

A request's spans as the daemon writes them (its ``process`` span, six phases, a batch span with its link,
one engine segment) into the bounded processor, with an exporter that keeps them; then the OTLP protobuf
encoding of those spans. Prints the CPU microseconds per request and per span (best of ``--repeat``).

    python bench/bench_tracing.py [--requests 3000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k2edge import tracing  # noqa: E402
from k2edge.config.tracing import TracingSettings  # noqa: E402
from k2edge.tracing.otlp import encode_spans  # noqa: E402


class _Keep:
    def __init__(self) -> None:
        self.spans: list = []

    def export(self, spans) -> bool:
        self.spans.extend(spans)
        return True

    def close(self) -> None:
        pass


class _Item:
    def __init__(self, trace) -> None:
        self.trace = trace


class _Runtime:
    engines: dict = {}


def one(t) -> None:
    """One request's spans, in the order the request path writes them."""
    r = t.request("k2edge/bench/infer/digits", "digits", "r1", 100, {}, time.monotonic())
    r.mark("queue")
    r.mark("stage")
    b = t.batch("digits", [_Item(r)], time.monotonic())
    b.records.append((0, "k2edge-lane-gpu", time.monotonic(), time.monotonic()))
    r.mark("infer")
    r.mark("decide")
    r.mark("publish")
    r.user_properties()
    b.end(_Runtime())
    r.end("ok")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if args.requests < 1 or args.repeat < 1:
        print("bench_tracing: --requests and --repeat must be at least 1", file=sys.stderr)
        return 1
    keep = _Keep()
    t = tracing.configure(TracingSettings(queue_size=args.requests * args.repeat * 10), "bench", environ={}, exporter=keep)
    try:
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.process_time()
            for _ in range(args.requests):
                one(t)
            best = min(best, (time.process_time() - t0) / args.requests)
        t.processor.force_flush(30_000)
        spans = keep.spans[: args.requests * 9]
        per_request = len(keep.spans) / (args.requests * args.repeat)
        encode = float("inf")
        for _ in range(args.repeat):
            t0 = time.process_time()
            body = encode_spans(spans)
            encode = min(encode, (time.process_time() - t0) / len(spans))
    finally:
        tracing.shutdown()
    print(f"recording: {best * 1e6:.1f} us CPU per traced request ({per_request:.0f} spans); "
          f"encoding: {encode * 1e6:.1f} us CPU per span ({len(body) / len(spans):.0f} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
