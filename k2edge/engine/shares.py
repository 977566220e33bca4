"""The share of a model's learned-layer FLOPs in INT8, FP16 and FP32 as the layers will run, per segment and
for the model.

A learned layer (Conv, ConvTranspose, Gemm, MatMul with a weight) runs in INT8 only when its input and its
weight are quantised: in the Q/DQ model TensorRT takes, both come out of a DequantizeLinear
(:func:`~.quantize.qdq_int8_layers`). A layer the plan lists as ``int8`` that its Q/DQ model does not quantise
runs in the precision after int8 on its device. Before a build has made the Q/DQ models, the shares are the
plan's (``measured`` false). A model-wise plan's model share weighs each engine by its share of the requests.
"""

from __future__ import annotations

from dataclasses import replace

from ..dla.planner import PartitionPlan
from ..dla.precision import usable_chain
from ..model.cost import node_flops
from ..model.graph import Graph
from .quantize import learned_layers

PRECISIONS = ("int8", "fp16", "fp32")


def _instead(chain: tuple[str, ...], device: str) -> str:
    """What a layer planned in int8 runs in when its Q/DQ does not quantise it."""
    usable = usable_chain(chain, device)
    rest = usable[usable.index("int8") + 1:] if "int8" in usable else ()
    return rest[0] if rest else ("fp16" if device.startswith("dla") else "fp32")


def flop_shares(plan: PartitionPlan, graph: Graph, int8_layers: dict[str, set] | None = None) -> dict:
    """The shares (see the module docstring); ``int8_layers``: per device kind (``gpu``, ``dla``), the learned
    layers its Q/DQ model runs in INT8 (None: take the plan's word)."""
    learned = set(learned_layers(graph))
    nodes = {n.name: n for n in graph.nodes}
    segments, model = [], dict.fromkeys(PRECISIONS, 0.0)
    for seg in plan.segments:
        real = None if int8_layers is None else int8_layers.get("dla" if seg.kind == "dla" else "gpu", set())
        flops = dict.fromkeys(PRECISIONS, 0)
        for n in seg.nodes:
            if n not in learned:
                continue
            p = seg.layer_precision.get(n, seg.precision)
            if p == "int8" and real is not None and n not in real:
                p = _instead(plan.precision_chain, seg.device)
            flops[p if p in flops else "fp32"] += node_flops(graph, nodes[n])
        total = sum(flops.values())
        share = {p: (flops[p] / total if total else 0.0) for p in PRECISIONS}
        segments.append({"segment": seg.index, "device": seg.device, "learned_flops": total,
                         **{p: round(v, 4) for p, v in share.items()}})
        weight = seg.request_share if seg.request_share is not None else 1.0
        for p in PRECISIONS:
            model[p] += weight * flops[p]
    total = sum(model.values())
    return {"model": {p: round(model[p] / total, 4) if total else 0.0 for p in PRECISIONS}, "segments": segments,
            "measured": int8_layers is not None}


def with_shares(plan: PartitionPlan, graph: Graph, int8_layers: dict[str, set] | None = None) -> PartitionPlan:
    return replace(plan, precision_flops=flop_shares(plan, graph, int8_layers))


def share_text(shares: dict | None) -> str:
    """``learned-layer FLOPs: int8 82.1 %, fp16 17.9 %, fp32 0.0 %`` (``(planned)`` before a build measured it)."""
    if not shares:
        return ""
    m = shares["model"]
    return ("learned-layer FLOPs: " + ", ".join(f"{p} {100 * m[p]:.1f} %" for p in PRECISIONS)
            + ("" if shares.get("measured") else " (planned; a build measures it on the Q/DQ model)"))


MOSTLY = 0.5  # a profile that asks for INT8 and runs less than this share of its learned FLOPs in it is told so


def mostly_not_int8(plan: PartitionPlan) -> str:
    """One line when a plan asks for INT8 and runs most of its learned-layer FLOPs in another precision (else "")."""
    shares = plan.precision_flops
    if not shares or "int8" not in plan.precision_chain or shares["model"]["int8"] >= MOSTLY:
        return ""
    m = shares["model"]
    other = max(("fp16", "fp32"), key=lambda p: m[p])
    return (f"the profile asks for INT8, but only {100 * m['int8']:.1f} % of the learned-layer FLOPs run in INT8 "
            f"({100 * m[other]:.1f} % in {other}): see the layers kept out of INT8 below")


def observed_flop_shares(plan: PartitionPlan, graph: Graph, observed: dict[int, dict[str, str]]) -> dict:
    """The shares TensorRT really built: per segment index, node -> precision read from the engine inspector
    (:func:`~.trt_placement.observed_precision`). Learned layers the inspector does not name count as
    ``unobserved`` (fused away, or an inspector without formats)."""
    learned = set(learned_layers(graph))
    nodes = {n.name: n for n in graph.nodes}
    kinds = PRECISIONS + ("unobserved",)
    model = dict.fromkeys(kinds, 0.0)
    for seg in plan.segments:
        seen = observed.get(seg.index, {})
        weight = seg.request_share if seg.request_share is not None else 1.0
        for n in seg.nodes:
            if n in learned:
                model[seen.get(n, "unobserved")] += weight * node_flops(graph, nodes[n])
    total = sum(model.values())
    return {p: round(model[p] / total, 4) if total else 0.0 for p in kinds}
