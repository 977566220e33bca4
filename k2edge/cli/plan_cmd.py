"""``k2edge plan MODEL``: the GPU/DLA partition plan under a profile or an ad-hoc ratio."""

from __future__ import annotations

COMMAND = "plan"
HELP = "plan the GPU/DLA partition of a model under a profile"
ORDER = 20

from pathlib import Path

from .common import BOARD_CHOICES, MAX_DIM, add_json, add_model, board_of, count, print_json, table


def register(p) -> None:
    add_model(p)
    p.add_argument("--profile", "-p", metavar="P", help="profile file or name")
    p.add_argument("--offload-ratio", type=float, metavar="R", help="GPU share of the FLOPs, 0..1 (instead of --profile)")
    p.add_argument("--partition", choices=("layer-wise", "block-wise", "model-wise"), help="granularity (with --offload-ratio)")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8"), help="replace the profile's precision chain")
    p.add_argument("--board", choices=BOARD_CHOICES, help="board (default: this board, else orin-agx)")
    p.add_argument("--calib", metavar="DATA", help="the calibration set a build used (default: calib/ or calib.npz "
                   "beside the model): shows the layers that build's INT8 check kept out of INT8")
    p.add_argument("--check", metavar="DATA", help="the --check set that build used, if any")
    p.add_argument("--cache", metavar="DIR", help="engine cache directory (default: ~/.cache/k2edge)")
    p.add_argument("--max-batch", type=count(1, MAX_DIM), default=8, metavar="N",
                   help="the largest batch the engines run, for the weights they hold (default 8, the daemon's max_batch)")
    add_json(p)


def run(args) -> int:
    from ..dla.planner import plan_partition
    from ..profile import load_profile

    from ..errors import K2EdgeError

    if args.profile and (args.offload_ratio is not None or args.partition):
        raise K2EdgeError("give either --profile or --offload-ratio with --partition, not both")
    if args.profile:
        profile = load_profile(args.profile)
    elif args.offload_ratio is not None and args.partition:
        profile = load_profile({"name": "ad-hoc", "edge_runtime": {"offload_ratio": args.offload_ratio,
                                                                   "tensorrt_partition": args.partition}})
    else:
        raise K2EdgeError("give --profile P, or both --offload-ratio R and --partition G")
    from ..engine.cache import EngineCache
    from ..config.resolve import model_card
    from ..engine.engine import load_model

    cache = EngineCache(args.cache)
    loaded = load_model(args.model, cache, profile.edge_runtime.batch_size, dict(args.input_shape) or None, args.card)
    the_card, nm = loaded.card, loaded.normalised
    plan = plan_partition(nm, profile, board_of(args), args.precision)
    check = None
    if the_card is not None or plan.runs_int8:
        # placement does not depend on the card, precision does: what it keeps out of INT8, and what a build's
        # INT8 check moved to fp16 (from the cache)
        card = model_card(Path(args.model), nm, the_card)
        plan, check = _with_int8(plan, nm, card, profile, cache, args)
    from ..engine.footprint import plan_footprint

    footprint = plan_footprint(plan, nm.graph, args.max_batch)
    data = plan.to_dict()
    data["memory"] = footprint.to_dict()
    data["int8_check"] = check.to_dict() if check is not None else None
    data["profile"] = profile.name
    data["model"] = nm.source
    if args.json:
        print_json(data)
        return 0
    print(f"{nm.source} on {plan.board}, profile {profile.name}: {plan.granularity}, requested GPU share "
          f"{plan.requested_gpu_share:.3f}, achieved {plan.gpu_flop_share:.3f}, {plan.transitions} GPU<->DLA transition(s)")
    rows = []
    for s in plan.segments:
        span = f"{s.nodes[0]} .. {s.nodes[-1]}" if len(s.nodes) > 1 else s.nodes[0]
        share = f"{s.request_share:.0%} of requests" if s.request_share is not None else f"{s.flops / max(plan.total_flops, 1):.1%}"
        rows.append([s.index, s.device, len(s.nodes), share, _precision_text(s, plan.precision_chain, plan.precision_flops), span,
                     ", ".join(s.inputs) if len(s.inputs) <= 2 else f"{len(s.inputs)} tensors"])
    print(table(rows, ["seg", "device", "nodes", "FLOPs / share", "precision", "span", "inputs"]))
    for note in plan.notes[1:]:
        print(f"note: {note}")
    for line in footprint.lines():
        print(f"memory: {line}")
    from ..engine.check import fallback_figure

    for f in plan.int8_fallback:
        if fallback_figure(f):
            print(f"{f['precision']}: {f['node']} on {f['device']} (INT8 check; {fallback_figure(f)})")
    if plan.precision_flops:
        from ..engine.shares import share_text

        print(share_text(plan.precision_flops))
    if check is not None:
        print(check.line())
    elif plan.runs_int8:
        print("note: no build has checked INT8 for this model, profile and calibration set yet: the layers its INT8 "
              "check moves to fp16 show here after `k2edge build`")
    return 0


def _with_int8(plan, nm, card, profile, cache, args):
    """The plan with the card's float layers and, when a build decided it, the INT8 check's fallback."""
    from ..config.resolve import find_calibration, load_labels
    from ..engine.int8 import cached_decision, plan_with_card
    from ..model.datasets import open_calibration
    from ..tasks.preprocess import Preprocess

    calib = args.calib or find_calibration(Path(args.model))
    if calib is None or not plan.runs_int8:
        return plan_with_card(plan, nm, card), None
    labels = load_labels(Path(args.model), nm, None, card)
    check_set = open_calibration(args.check, labels) if args.check else None
    found = cached_decision(nm, plan, open_calibration(calib, labels), Preprocess.from_card(card), card, cache,
                            profile.edge_runtime, check_set)
    return found if found is not None else (plan_with_card(plan, nm, card), None)


def _precision_text(seg, chain, shares=None) -> str:
    """What a segment's layers really run in: the share of its learned-layer FLOPs in each precision
    (``int8 82 %, fp16 18 % of learned FLOPs``), else one precision, or the count of each (``int8 42, fp16 13``)."""
    from collections import Counter

    mine = next((s for s in (shares or {}).get("segments", []) if s["segment"] == seg.index), None)
    if mine is not None and mine["learned_flops"]:
        return ", ".join(f"{p} {100 * mine[p]:.0f} %" for p in ("int8", "fp16", "fp32") if mine[p] > 0) + " of learned FLOPs"
    counts = Counter(seg.layer_precision.values())
    if len(counts) <= 1:
        return seg.precision
    order = list(chain) + [p for p in ("fp32", "fp16", "int8") if p not in chain]
    return ", ".join(f"{p} {counts[p]}" for p in order if counts.get(p))
