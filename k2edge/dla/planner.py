"""The partition planner: (model, profile, board) -> PartitionPlan.

Every decision about where a layer runs and in which precision is made here, as data.
Backends only apply the plan.

Granularities (``edge_runtime.tensorrt_partition``):

* ``layer-wise``: a cut may fall between any two nodes of the topological order;
* ``block-wise``: cuts only where exactly one tensor crosses (block boundaries);
* ``model-wise``: no cuts; a whole-model engine per device, and ``offload_ratio`` splits the
  *requests* between the GPU engine and the DLA engines.

For the split granularities the planner chooses which atomic units (single nodes, or blocks between
allowed cuts) run on the DLA so that the GPU keeps ``offload_ratio`` of the FLOPs. Among the
splits that land within ``offload_tolerance`` of the requested share it takes the one with the
fewest GPU<->DLA transitions (each costs a reformat), spending another transition only when it
buys at least ``TRANSITION_COST`` of share. It gives up closeness only where the DLA rules, the
allowed cuts or the transition budget leave no choice; the notes then say why. The budget comes from
the board: every DLA segment is one loadable on its core and a core holds at most 16 loadables
("DLA Supported Layers and Restrictions"), so a plan may have two transitions per loadable.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import cached_property

from ..errors import PlanError
from ..model.cost import model_costs
from ..model.ingest import NormalisedModel
from ..profile import Profile
from .boards import MIB, Board, get_board
from .precision import device_kind, layer_precision, usable_chain
from .rules import DOCS, Support, support_table

# "Due to hardware and software memory limitations, only 16 DLA loadable can be loaded concurrently per
# core" [DOCS, general restrictions]. Every DLA segment of a split plan is one loadable on its core.
LOADABLES_PER_CORE = 16
ORIN_SRAM_PER_CORE = 1 * MIB  # "On Orin, each DLA core has 1 MiB of dedicated SRAM" ["Customizing DLA Memory Pools"]
TRANSITION_COST = 0.01  # within tolerance, one more GPU<->DLA transition must buy 1 % of FLOP share
_BINS = 8192  # resolution of the FLOP-share search (1/8192 of the model's FLOPs)


@dataclass(frozen=True)
class Segment:
    """One contiguous piece of the graph on one device.

    For model-wise plans every segment holds the whole graph and ``request_share`` says which share
    of the requests it serves; ``gpu_fallback_nodes`` lists what a DLA engine hands to the GPU.
    """

    index: int
    device: str
    start: int
    stop: int
    nodes: tuple[str, ...]
    flops: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    precision: str = "fp32"
    layer_precision: dict[str, str] = field(default_factory=dict, hash=False)
    request_share: float | None = None
    gpu_fallback_nodes: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return device_kind(self.device)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["nodes"], d["inputs"], d["outputs"] = list(self.nodes), list(self.inputs), list(self.outputs)
        d["gpu_fallback_nodes"] = list(self.gpu_fallback_nodes)
        return d


@dataclass(frozen=True)
class PartitionPlan:
    """Where each layer runs, in which precision, and how that compares with the request."""

    model_sha256: str
    board: str
    granularity: str
    requested_gpu_share: float
    gpu_flop_share: float
    total_flops: int
    transitions: int
    dla_cores: int
    precision_chain: tuple[str, ...]
    segments: tuple[Segment, ...]
    notes: tuple[str, ...]
    model_inputs: tuple[str, ...] = ()
    gpu_fallback: bool = True
    direct_io: bool = False
    dla_memory_pools: tuple[tuple[str, int], ...] = ()
    int8_fallback: tuple[dict, ...] = field(default=(), hash=False)  # layers kept out of INT8 after planning: node, device, precision, reason, figures
    # share of learned-layer FLOPs per precision as the layers will run, per segment and for the model
    # ({"model": {"int8": .., "fp16": .., "fp32": ..}, "segments": [...], "measured": bool}); None until computed
    precision_flops: dict | None = field(default=None, hash=False, compare=False)

    @cached_property
    def routing(self) -> "Routing":
        """How requests travel through the segments, derived once for every backend."""
        return Routing.of(self)

    @property
    def devices(self) -> tuple[str, ...]:
        """Distinct devices in first-use order."""
        return tuple(dict.fromkeys(s.device for s in self.segments))

    @property
    def runs_int8(self) -> bool:
        """Whether any layer runs in INT8 (so the build calibrates and checks)."""
        return any(p == "int8" for s in self.segments for p in s.layer_precision.values())

    @property
    def is_model_wise(self) -> bool:
        return self.granularity == "model-wise"

    def to_dict(self) -> dict:
        return {
            "model_sha256": self.model_sha256,
            "board": self.board,
            "granularity": self.granularity,
            "requested_gpu_share": self.requested_gpu_share,
            "gpu_flop_share": round(self.gpu_flop_share, 6),
            "total_flops": self.total_flops,
            "transitions": self.transitions,
            "dla_cores": self.dla_cores,
            "precision_chain": list(self.precision_chain),
            "segments": [s.to_dict() for s in self.segments],
            "notes": list(self.notes),
            "model_inputs": list(self.model_inputs),
            "gpu_fallback": self.gpu_fallback,
            "direct_io": self.direct_io,
            "dla_memory_pools": dict(self.dla_memory_pools),
            "int8_fallback": [dict(f) for f in self.int8_fallback],
            "precision_flops": self.precision_flops,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class Routing:
    """The routes requests take through a plan's segments, as the backends apply them.

    Attributes:
        routes: segment indices each request runs through, in order: one route through every segment of a
            split plan, or one single-segment route per whole-model engine of a model-wise plan.
        shares: the share of requests per route (model-wise), else None.
        input_steps: per route, the last step that reads a model input: after it a request's staged input
            buffer may be reused (prefetch slots, zero-copy staging).
        segment_devices: the device of each segment, by index.
    """

    routes: tuple[tuple[int, ...], ...]
    shares: tuple[float, ...] | None
    input_steps: tuple[int, ...]
    segment_devices: tuple[str, ...]

    @classmethod
    def of(cls, plan: "PartitionPlan") -> "Routing":
        segs = plan.segments
        if plan.is_model_wise:
            routes = tuple((s.index,) for s in segs)
            shares = tuple(float(s.request_share or 0.0) for s in segs)
        else:
            routes, shares = (tuple(s.index for s in segs),), None
        inputs = set(plan.model_inputs)
        steps = tuple(max((k for k, i in enumerate(r) if inputs & set(segs[i].inputs)), default=0) for r in routes)
        return cls(routes, shares, steps, tuple(s.device for s in segs))


@dataclass
class _Placement:
    segments: list[Segment]
    notes: list[str]
    gpu_flops: float


def plan_partition(
    model: NormalisedModel,
    profile: Profile,
    board: str | Board | None = None,
    precision: str | None = None,
) -> PartitionPlan:
    """Plan where each layer of ``model`` runs on ``board`` under ``profile``.

    Args:
        model: a normalised model.
        profile: the profile (granularity, offload ratio, precision chain, DLA cores).
        board: board key or Board; default ``orin-agx``.
        precision: replace the profile's chain by this single precision. ``"fp32"`` is the
            reference mode of the ONNX Runtime backend: placement stays, every layer runs in FP32.

    Raises:
        PlanError: the profile cannot be honoured at all (a DLA segment with neither fp16 nor
            int8 in the chain, model-wise DLA engines that need GPU fallback when it is off).
    """
    er = profile.edge_runtime
    board = board if isinstance(board, Board) else get_board(board)
    graph = model.graph
    costs = model_costs(graph)
    flops = [c.flops for c in costs]
    total = sum(flops)
    support = support_table(graph)
    if not er.gpu_fallback:
        support = _without_fallback(graph, support)
    cores = board.dla_cores if er.dla_cores is None else min(er.dla_cores, board.dla_cores)
    notes: list[str] = []
    if er.dla_cores is not None and er.dla_cores > board.dla_cores:
        notes.append(f"profile asks for {er.dla_cores} DLA cores; {board.name} has {board.dla_cores}")

    if er.tensorrt_partition == "model-wise":
        placement = _place_model_wise(model, er, cores, board, flops, support)
    else:
        placement = _place_split(model, er, cores, board, flops, support, er.tensorrt_partition == "layer-wise")
    notes += placement.notes
    notes += _sram_notes(er.dla_memory_pools.managed_sram, placement.segments)

    chain = (precision,) if precision else tuple(er.precision_fallback)
    if precision == "fp32" and any(s.kind == "dla" for s in placement.segments):
        notes.append("reference mode: every segment runs in FP32 (a real DLA cannot; ONNX Runtime lanes only)")
    segments = tuple(_assign_precision(s, graph, chain, reference=precision == "fp32") for s in placement.segments)
    share = placement.gpu_flops / total if total else 1.0
    model_wise = er.tensorrt_partition == "model-wise"  # whole-model engines: no cuts, no transitions
    transitions = 0 if model_wise else sum(1 for a, b in zip(segments, segments[1:]) if a.kind != b.kind)
    notes.insert(0, f"requested GPU share {er.offload_ratio:.3f}, achieved {share:.3f}")
    return PartitionPlan(
        model_sha256=model.sha256,
        board=board.key,
        granularity=er.tensorrt_partition,
        requested_gpu_share=er.offload_ratio,
        gpu_flop_share=share,
        total_flops=total,
        transitions=transitions,
        dla_cores=cores,
        precision_chain=chain,
        segments=segments,
        notes=tuple(notes),
        model_inputs=tuple(graph.inputs),
        gpu_fallback=er.gpu_fallback,
        direct_io=er.direct_io,
        dla_memory_pools=tuple((k, int(getattr(er.dla_memory_pools, k))) for k in ("managed_sram", "local_dram", "global_dram")),
    )


def _without_fallback(graph, support):
    """Without GPU fallback, nodes that read the model input or write its output stay on the GPU.

    Model inputs and outputs are FP32 linear host data; a DLA engine exchanging them needs reformats that
    run on the GPU, so a DLA build without GPU_FALLBACK fails even when every layer is on the DLA
    [NVIDIA/TensorRT#3438]. Keeping those nodes on the GPU leaves the DLA only cut tensors, which the
    engines exchange in DLA-native formats (``trt_spec.boundary_formats``).
    """
    inputs, outputs = set(graph.inputs), set(graph.outputs)
    out = list(support)
    for i, node in enumerate(graph.nodes):
        if not out[i].ok:
            continue
        if inputs & set(node.inputs):
            why = "reads the model input"
        elif outputs & set(node.outputs):
            why = "writes the model output"
        else:
            continue
        out[i] = Support(False, f"{why} (FP32, linear): without gpu_fallback TensorRT cannot add the reformat it needs "
                                f"on the GPU, so it stays on the GPU", "NVIDIA/TensorRT#3438")
    return tuple(out)


def max_transitions(cores: int) -> int:
    """GPU<->DLA transitions a split plan may have: two per DLA segment, 16 loadables per core."""
    return 2 * LOADABLES_PER_CORE * max(cores, 1)


def _sram_notes(managed_sram: int, segments) -> list[str]:
    """What TensorRT does with the managed SRAM pool on Orin, when it matters for this plan."""
    notes = []
    if managed_sram > ORIN_SRAM_PER_CORE:
        notes.append(f"dla_memory_pools.managed_sram is {managed_sram // 1024} KiB, but Orin has 1 MiB of SRAM per DLA "
                     f"core: the pool is an upper bound and a loadable never gets more than the core has")
    per_core = Counter(s.device for s in segments if s.kind == "dla")
    for device, n in sorted(per_core.items()):
        if n > 1 and n * min(managed_sram, ORIN_SRAM_PER_CORE) > ORIN_SRAM_PER_CORE:
            notes.append(f"{device} holds {n} loadables that share its 1 MiB of SRAM; one that gets none runs from "
                         f"local DRAM (slower, not an error)")
    return notes


def _assign_precision(seg: Segment, graph, chain, reference: bool) -> Segment:
    fallback = set(seg.gpu_fallback_nodes)
    per_layer = {}
    if reference:
        per_layer = {name: "fp32" for name in seg.nodes}
    else:
        dev_chain = usable_chain(chain, seg.device)
        gpu_chain = usable_chain(chain, "gpu")
        for name in seg.nodes:
            node = graph.by_name[name]
            if name in fallback:
                per_layer[name] = layer_precision(node.op_type, gpu_chain, "gpu")
            else:
                per_layer[name] = layer_precision(node.op_type, dev_chain, seg.device)
    used = set(per_layer.values())
    order = chain if not reference else ("fp32",)
    seg_precision = next((p for p in order if p in used), next(iter(sorted(used)), "fp32"))
    return Segment(**{**seg.__dict__, "precision": seg_precision, "layer_precision": per_layer})


def _reasons(graph, support, indices) -> str:
    """Every reason group, most frequent first, with one example node and the count of the others."""
    by_reason = Counter()
    examples: dict[str, str] = {}
    for i in indices:
        reason = support[i].reason or "unsupported"
        by_reason[reason] += 1
        examples.setdefault(reason, graph.nodes[i].name)
    parts = [f"{examples[r]}{' and %d more' % (c - 1) if c > 1 else ''}: {r}" for r, c in by_reason.most_common()]
    return "; ".join(parts)


def _place_model_wise(model, er, cores, board, flops, support) -> _Placement:
    graph = model.graph
    total = sum(flops)
    everything = tuple(n.name for n in graph.nodes)
    n = len(graph.nodes)
    notes = []
    unsupported = [i for i, s in enumerate(support) if not s.ok]
    ratio = er.offload_ratio
    if cores == 0 and ratio < 1.0:
        notes.append(f"{board.name} has no DLA cores: every request runs on the GPU")
        ratio = 1.0
    segs = []
    if ratio > 0:
        segs.append(Segment(0, "gpu", 0, n, everything, total, graph.inputs, graph.outputs, request_share=ratio))
    if ratio < 1.0:
        if unsupported and not er.gpu_fallback:
            raise PlanError(
                f"model-wise DLA engines need GPU fallback: {len(unsupported)} node(s) cannot run on the DLA "
                f"({_reasons(graph, support, unsupported)}); set edge_runtime.gpu_fallback to true"
            )
        fallback = tuple(graph.nodes[i].name for i in unsupported)
        for core in range(cores):
            segs.append(Segment(len(segs), f"dla{core}", 0, n, everything, total, graph.inputs, graph.outputs,
                                request_share=(1.0 - ratio) / cores, gpu_fallback_nodes=fallback))
    fallback_flops = sum(flops[i] for i in unsupported)
    gpu_flops = ratio * total + (1.0 - ratio) * fallback_flops
    notes.append(
        f"model-wise: {ratio:.0%} of requests on the GPU engine"
        + (f", {1 - ratio:.0%} split over {cores} whole-model DLA engine(s)" if ratio < 1 else "")
    )
    if ratio < 1.0 and unsupported:
        share = fallback_flops / total
        notes.append(
            f"the DLA engines fall back to the GPU for {len(unsupported)} node(s) ({share:.1%} of the FLOPs"
            f"{', which the achieved GPU share includes' if share >= 0.0005 else ''}; each run of them is a DLA->GPU->DLA "
            f"hop inside its engine, not among the transitions between segments): {_reasons(graph, support, unsupported)}"
        )
    return _Placement(segs, notes, gpu_flops)


def _place_split(model, er, cores, board, flops, support, layer_wise: bool) -> _Placement:
    graph = model.graph
    n = len(graph.nodes)
    total = sum(flops)
    notes: list[str] = []
    if layer_wise:
        cuts = list(range(n + 1))
    else:
        counts = graph.crossing_counts
        cuts = [p for p in range(n + 1) if p in (0, n) or counts[p] == 1]
    units = list(zip(cuts, cuts[1:]))
    unit_flops = [sum(flops[a:b]) for a, b in units]
    eligible = [all(support[i].ok for i in range(a, b)) for a, b in units]
    ratio = er.offload_ratio

    if cores == 0 and ratio < 1.0:
        notes.append(f"{board.name} has no DLA cores: everything runs on the GPU")
        on_dla = [False] * len(units)
    elif total == 0 or ratio >= 1.0:
        on_dla = [False] * len(units)
    else:
        target = (1.0 - ratio) * total
        on_dla = _choose_units(unit_flops, eligible, target, total, er.offload_tolerance, max_transitions(cores))

    devices_per_unit = ["dla" if d else "gpu" for d in on_dla]
    dla_flops = sum(f for f, d in zip(unit_flops, on_dla) if d)
    gpu_flops = total - dla_flops
    achieved = gpu_flops / total if total else 1.0

    unsupported = [i for i, s in enumerate(support) if not s.ok]
    if unsupported and any(on_dla):
        notes.append(f"{len(unsupported)} node(s) stay on the GPU (DLA rules): {_reasons(graph, support, unsupported)}")
    if total and abs(achieved - ratio) > er.offload_tolerance and ratio < 1.0 and cores > 0:
        notes.append(_why_off(graph, support, units, unit_flops, eligible, ratio, achieved, total, layer_wise, len(cuts),
                              max_transitions(cores)))

    # runs of equal device -> segments
    runs: list[list[int]] = []
    for i, dev in enumerate(devices_per_unit):
        if runs and devices_per_unit[runs[-1][0]] == dev:
            runs[-1].append(i)
        else:
            runs.append([i])
    spans = [(units[r[0]][0], units[r[-1]][1], devices_per_unit[r[0]], r) for r in runs]
    spans = _assign_cores(spans, units, unit_flops, cores, notes)

    segs = []
    for start, stop, device in spans:
        ins, outs = graph.segment_io(start, stop)
        segs.append(Segment(len(segs), device, start, stop, tuple(nd.name for nd in graph.nodes[start:stop]),
                            sum(flops[start:stop]), ins, outs))
    return _Placement(segs, notes, gpu_flops)


def _why_off(graph, support, units, unit_flops, eligible, ratio, achieved, total, layer_wise, n_cuts, max_t) -> str:
    head = f"achieved GPU share {achieved:.3f} differs from the requested {ratio:.3f}: "
    blocked = [i for i, s in enumerate(support) if not s.ok]
    floor = 1.0 - sum(f for f, e in zip(unit_flops, eligible) if e) / total  # lowest GPU share the rules allow
    if ratio < floor and abs(achieved - floor) <= 0.02:
        why = f"the DLA can run at most {1 - floor:.1%} of the FLOPs"
        if blocked:
            why += f" ({_reasons(graph, support, blocked)})"
        if not layer_wise:
            why += "; block-wise, a block that holds any unsupported node stays on the GPU whole"
        return head + why
    if blocked:
        runs = sum(1 for i, s in enumerate(support) if not s.ok and (i == 0 or support[i - 1].ok))
        return head + (f"{len(blocked)} DLA-unsupported node(s) sit in {runs} separate places "
                       f"({_reasons(graph, support, blocked)}); getting closer needs more than {max_t} "
                       f"GPU<->DLA transitions (each DLA segment is a loadable, {LOADABLES_PER_CORE} per core at most) "
                       f"or more FLOPs than the DLA-capable parts hold")
    if not layer_wise:
        return head + (f"block-wise cuts are allowed at only {n_cuts} places (where exactly one tensor crosses) "
                       f"and no set of whole blocks comes closer")
    return head + "the layers' FLOPs are too coarse for a closer split"


def _choose_units(unit_flops, eligible, target, total, tolerance, max_t) -> list[bool]:
    """Pick DLA units: fewest GPU<->DLA transitions within ``tolerance`` of the target share.

    Dynamic programming over units with, per (transitions so far, device of the last unit), the set
    of reachable DLA FLOP sums as a bitset (Python int) at 1/_BINS resolution. Reconstruction walks
    back through the stored bitsets.
    """
    scale = _BINS / total
    weights = [int(round(f * scale)) for f in unit_flops]
    goal = int(round(target * scale))
    G, D = 0, 1
    history: list[dict[tuple[int, int], int]] = []
    prev: dict[tuple[int, int], int] = {}
    for i, (w, ok) in enumerate(zip(weights, eligible)):
        cur: dict[tuple[int, int], int] = {}
        if i == 0:
            cur[(0, G)] = 1
            if ok:
                cur[(0, D)] = 1 << w
        else:
            for (t, d), bits in prev.items():
                tg = t + (d != G)
                if tg <= max_t:
                    cur[(tg, G)] = cur.get((tg, G), 0) | bits
                if ok:
                    td = t + (d != D)
                    if td <= max_t:
                        cur[(td, D)] = cur.get((td, D), 0) | (bits << w)
        history.append(cur)
        prev = cur

    candidates = []  # (share error, transitions, end state, reachable sum)
    for (t, d), bits in prev.items():
        s = _closest_bit(bits, goal)
        candidates.append((abs(s - goal) / _BINS, t, (t, d), s))
    within = [c for c in candidates if c[0] <= tolerance]
    if within:  # fewest transitions that land within tolerance, one transition worth TRANSITION_COST of share
        best = min(within, key=lambda c: (c[0] + TRANSITION_COST * c[1], c[1], c[2]))
    else:
        best = min(candidates, key=lambda c: (c[0], c[1], c[2]))
    _, _, state, s = best
    return _reconstruct(history, weights, state, s)


def _closest_bit(bits: int, goal: int) -> int:
    below = bits & ((1 << (goal + 1)) - 1)
    lo = below.bit_length() - 1 if below else None
    above = bits >> goal
    hi = goal + ((above & -above).bit_length() - 1) if above else None
    if lo is None:
        return hi
    if hi is None:
        return lo
    return lo if goal - lo <= hi - goal else hi


def _reconstruct(history, weights, state, s) -> list[bool]:
    D = 1  # device codes as in _choose_units (0 is the GPU)
    n = len(history)
    on_dla = [False] * n
    t, d = state
    for i in range(n - 1, -1, -1):
        on_dla[i] = d == D
        if d == D:
            s -= weights[i]
        if i == 0:
            break
        for dp in (d, 1 - d):  # prefer staying on the same device
            tp = t - (dp != d)
            if tp >= 0 and (history[i - 1].get((tp, dp), 0) >> s) & 1:
                t, d = tp, dp
                break
        else:  # pragma: no cover - the forward pass guarantees a predecessor
            raise AssertionError("planner reconstruction lost its path")
    return on_dla


def _assign_cores(spans, units, unit_flops, cores, notes):
    """Name DLA runs dla0/dla1; with two cores, balance FLOPs (splitting a lone run in two)."""
    dla_runs = [i for i, sp in enumerate(spans) if sp[2] == "dla"]
    out = [(a, b, dev) for a, b, dev, _ in spans]
    if not dla_runs:
        return out
    if cores == 1:
        return [(a, b, "dla0" if dev == "dla" else dev) for a, b, dev in out]
    if len(dla_runs) == 1:
        i = dla_runs[0]
        a, b, _, run_units = spans[i]
        split = _balanced_split(run_units, unit_flops)
        if split is None:
            out[i] = (a, b, "dla0")
            return out
        mid = units[split][0]
        notes.append("the DLA part is split between dla0 and dla1 at a balanced cut, so consecutive requests "
                     "pipeline across both cores")
        return out[:i] + [(a, mid, "dla0"), (mid, b, "dla1")] + out[i + 1:]
    load, count = [0, 0], [0, 0]
    for i in dla_runs:
        a, b, _, run_units = spans[i]
        # balance FLOPs, but never more than LOADABLES_PER_CORE segments on one core
        open_cores = [c for c in (0, 1) if count[c] < LOADABLES_PER_CORE]
        core = min(open_cores, key=lambda c: (load[c], c))
        load[core] += sum(unit_flops[u] for u in run_units)
        count[core] += 1
        out[i] = (a, b, f"dla{core}")
    return out


def _balanced_split(run_units, unit_flops):
    """Index of the unit where the second half of a DLA run starts, balancing FLOPs; None if none."""
    if len(run_units) < 2:
        return None
    total = sum(unit_flops[u] for u in run_units)
    acc, best, best_gap = 0, None, None
    for k, u in enumerate(run_units[:-1]):
        acc += unit_flops[u]
        gap = abs(total - 2 * acc)
        if acc > 0 and total - acc > 0 and (best_gap is None or gap < best_gap):
            best, best_gap = run_units[k + 1], gap
    return best
