"""``k2edge build MODEL --profile P``: build the engine (or find it in the cache) and report it."""

from __future__ import annotations

COMMAND = "build"
HELP = "build (or load from the cache) a model's engine for a profile"
ORDER = 30

from .common import add_build, add_json, add_model, build_engine, print_json


def register(p) -> None:
    add_model(p)
    add_build(p)
    add_json(p)


def run(args) -> int:
    engine = build_engine(args)
    d = engine.describe()
    d["plan"] = {"granularity": engine.plan.granularity, "requested_gpu_share": engine.plan.requested_gpu_share,
                 "gpu_flop_share": engine.plan.gpu_flop_share, "segments": len(engine.plan.segments),
                 "notes": list(engine.plan.notes)}
    if args.json:
        print_json(d)
        return 0
    hits = ", ".join(f"{k} {'cached' if v else 'built'}" for k, v in d["cache_hits"].items())
    print(f"{d['model']} with profile {d['profile']}: {hits} in {d['build_seconds']:.2f} s")
    print(f"  engine {d['engine_key'][:16]} ({d['backend']} {d['version']}), input {d['input']['name']} {tuple(d['input']['shape'])}")
    for lane in d["lanes"]:
        share = f", {lane['request_share']:.0%} of requests" if lane["request_share"] is not None else ""
        print(f"  lane {lane['label']}: segment(s) {list(lane['segments'])}, {lane['precision']}{share}")
    for note in list(engine.plan.notes) + d["notes"]:
        print(f"  note: {note}")
    return 0
