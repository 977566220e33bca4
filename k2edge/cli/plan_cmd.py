"""``k2edge plan MODEL``: the GPU/DLA partition plan under a profile or an ad-hoc ratio."""

from __future__ import annotations

COMMAND = "plan"
HELP = "plan the GPU/DLA partition of a model under a profile"
ORDER = 20

from .common import BOARD_CHOICES, add_json, add_model, board_of, print_json, table


def register(p) -> None:
    add_model(p)
    p.add_argument("--profile", "-p", metavar="P", help="profile file or name")
    p.add_argument("--offload-ratio", type=float, metavar="R", help="GPU share of the FLOPs, 0..1 (instead of --profile)")
    p.add_argument("--partition", choices=("layer-wise", "block-wise", "model-wise"), help="granularity (with --offload-ratio)")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8"), help="replace the profile's precision chain")
    p.add_argument("--board", choices=BOARD_CHOICES, help="board (default: this board, else orin-agx)")
    add_json(p)


def run(args) -> int:
    from ..dla.planner import plan_partition
    from ..model import normalise
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
    nm = normalise(args.model, batch_size=profile.edge_runtime.batch_size, input_shapes=dict(args.input_shape) or None)
    from pathlib import Path

    from ..config.card import find_card
    from ..engine.engine import model_card

    plan = plan_partition(nm, profile, board_of(args), args.precision)
    card_path = args.card or find_card(Path(args.model))
    if card_path:  # placement does not depend on the card, precision does: what it keeps out of INT8
        from ..engine.int8 import plan_with_card

        plan = plan_with_card(plan, nm, model_card(Path(args.model), nm, card_path))
    data = plan.to_dict()
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
        rows.append([s.index, s.device, len(s.nodes), share, _precision_text(s, plan.precision_chain), span,
                     ", ".join(s.inputs) if len(s.inputs) <= 2 else f"{len(s.inputs)} tensors"])
    print(table(rows, ["seg", "device", "nodes", "FLOPs / share", "precision", "span", "inputs"]))
    for note in plan.notes[1:]:
        print(f"note: {note}")
    if any(p == "int8" for s in plan.segments for p in s.layer_precision.values()):
        print("note: layers the INT8 accuracy check moves to fp16 are decided at build (k2edge build lists them)")
    return 0


def _precision_text(seg, chain) -> str:
    """What a segment's layers really run in: one precision, or the count of each (``int8 42, fp16 13``)."""
    from collections import Counter

    counts = Counter(seg.layer_precision.values())
    if len(counts) <= 1:
        return seg.precision
    order = list(chain) + [p for p in ("fp32", "fp16", "int8") if p not in chain]
    return ", ".join(f"{p} {counts[p]}" for p in order if counts.get(p))
