"""``k2edge build MODEL --profile P``: build the engine (or find it in the cache) and report it."""

from __future__ import annotations

COMMAND = "build"
HELP = "build (or load from the cache) a model's engine for a profile"
ORDER = 30

from .common import add_build, add_json, add_model, build_engine, print_json


def _mix(segments: list[dict]) -> str:
    """`` (learned FLOPs: int8 82 %, fp16 18 %)`` of a lane's segments."""
    total = sum(s["learned_flops"] for s in segments)
    if not total:
        return ""
    parts = [(p, sum(s[p] * s["learned_flops"] for s in segments) / total) for p in ("int8", "fp16", "fp32")]
    return " (learned FLOPs: " + ", ".join(f"{p} {100 * v:.0f} %" for p, v in parts if v > 0) + ")"


def register(p) -> None:
    add_model(p)
    add_build(p)
    add_json(p)


def run(args) -> int:
    from ..engine.shares import mostly_not_int8, share_text

    engine = build_engine(args)
    d = engine.describe()
    not_int8 = mostly_not_int8(engine.plan)  # a note in --json too: a machine reading "int8" lanes must see it
    d["plan"] = {"granularity": engine.plan.granularity, "requested_gpu_share": engine.plan.requested_gpu_share,
                 "gpu_flop_share": engine.plan.gpu_flop_share, "segments": len(engine.plan.segments),
                 "notes": [not_int8] * bool(not_int8) + list(engine.plan.notes),
                 "int8_fallback": [dict(f) for f in engine.plan.int8_fallback],
                 "precision_flops": engine.plan.precision_flops}
    if args.json:
        print_json(d)
        return 0
    hits = ", ".join(f"{k} {'cached' if v else 'built'}" for k, v in d["cache_hits"].items())
    print(f"{d['model']} with profile {d['profile']}: {hits} in {d['build_seconds']:.2f} s")
    print(f"  engine {d['engine_key'][:16]} ({d['backend']} {d['version']}), input {d['input']['name']} {tuple(d['input']['shape'])}")
    shares = engine.plan.precision_flops
    by_segment = {s["segment"]: s for s in (shares or {}).get("segments", [])}
    for lane in d["lanes"]:
        share = f", {lane['request_share']:.0%} of requests" if lane["request_share"] is not None else ""
        flops = [by_segment[i] for i in lane["segments"] if i in by_segment]
        mix = _mix(flops)
        print(f"  lane {lane['label']}: segment(s) {list(lane['segments'])}, {lane['precision']}{share}{mix}")
    if shares:
        print(f"  {share_text(shares)}")
        if not_int8:
            print(f"  note: {not_int8}")
    if d.get("engine_bytes"):
        print(f"  memory: engine files {d['engine_bytes'] / 2**20:.2f} MiB (weights; a running daemon reports what its "
              f"activated engines hold: status `memory`, metric k2edge_model_memory_bytes)")
    for note in list(engine.plan.notes) + d["notes"]:
        print(f"  note: {note}")
    _print_fallback(engine)
    return 0


def _print_fallback(engine) -> None:
    """Every layer kept out of INT8, why, and the check's figures before and after."""
    from ..engine.check import fallback_figure

    fallback = engine.plan.int8_fallback
    if not fallback:
        return
    check = engine.info.int8_check
    print(f"  layers kept out of INT8 ({len(fallback)}):")
    for f in fallback:
        figure = f"; {fallback_figure(f)}" if fallback_figure(f) else ""
        # model-wise, every engine runs the whole model: a layer moved is moved in each (its device set the precision)
        where = f"every engine (as on {f['device']})" if engine.plan.is_model_wise else f["device"]
        print(f"    {f['node']} on {where}: {f['precision']} ({f['reason']}{figure})")
    if check is not None and check.before:
        keys = [k for k in check.tolerance]
        before = ", ".join(f"{k} {check.before[k]:.3f}" for k in keys)
        after = ", ".join(f"{k} {check.measures[k]:.3f}" for k in keys)
        print(f"  int8 check before fallback: {before}; after: {after}")
