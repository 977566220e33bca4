"""One INT8 decision per model, in steps: statistics -> ranges -> Q/DQ artefacts -> check -> fallback.

The decision (the check's figures and the layers kept out of INT8) is made once per model, card, profile and
calibration set, and cached by what it depends on -- not by the batch size -- so every batch-size engine the
daemon builds shares it: the same layers fall back at every batch size.

1. statistics: one streaming pass over the calibration samples (:func:`~.quantize.calibration_statistics`);
2. ranges: per tensor from the statistics by the calibration method (``auto``: ``max``, and ``percentile`` when the
   check of ``max`` misses; ``percentile`` kept when the check resolves it closer to the tolerance, and when it is
   closer by less than that, each falls back and the one that keeps more INT8 is kept), with the DLA's ties on DLA
   layers only;
3. Q/DQ artefacts: one all-INT8 model per set of devices (:func:`_bases`), each fallback a graph edit of it;
4. check: FP32 and the INT8 Q/DQ emulation (every artefact of the plan: a model-wise plan's GPU and DLA ones) run
   on the check samples (every fifth calibration sample, or a ``--check`` set) and are compared by the card's
   task (:mod:`.check`), exactly and with the check's power;
5. fallback, when the check misses its tolerance and the precision chain continues after int8: learned layers
   ranked by their measured effect on the model's output (:mod:`.fallback`), and the fewest of the most
   sensitive moved, each with its quantisers, to the chain's next precision on the same device; when that keeps
   less than 90 % of the INT8 (on a check with the power for a verdict), ranked again by each one's INT8-alone
   cost per FLOP, the ranking that keeps more INT8 kept. A check without that power first moves a detection
   head's branches (:func:`~.quantize.head_branches`): it cannot vouch for them in INT8.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnx

from ..config.card import BOX_TASKS, ModelCard
from ..dla.planner import PartitionPlan
from ..dla.precision import usable_chain
from ..errors import BuildError
from ..model.datasets import Dataset
from ..model.ingest import NormalisedModel
from ..tasks.preprocess import Preprocess
from .cache import EngineCache, digest
from .calibration import TensorStatistics, runs, session
from .check import (COUNTED, Int8Check, Tally, meets, min_check, relaxed, resolvable, rooms_after, tolerance_for,
                    verdict)
from .fallback import (SENSITIVITY_SAMPLES, OutputProbe, int8_alone_costs, rank, rank_by_cost_per_flop, search_budget,
                       sensitivity, smallest_prefix)
from .quantize import (AUTO, MAX_CALIBRATION_SAMPLES, QUANT_VERSION, SEARCH, QuantArtefacts, QuantSettings,
                       calibration_split, base_qdq, calibration_statistics, candidate_settings, dla_ties,
                       fallback_units, finish_qdq, float_nodes, head_branches, learned_layers, plan_dla_nodes, qdq_int8_layers,
                       quant_settings, quant_variant, stage_batches, statistics_key)
from .range_search import SEARCH_SAMPLES, START, candidate_ranges, search_ranges
from .shares import with_shares

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (what, done, total)
_LOWER_IS_BETTER = ("mean_abs_dp", "max_rel_error", "keypoint_error")
SENSITIVITY_REASON = "INT8 check below tolerance: among the learned layers whose INT8 costs the model's output most"
COST_REASON = "INT8 check below tolerance: among the layers whose INT8 alone costs the model's output most per FLOP"
SECOND_RANKING_BELOW = 0.9  # the sensitivity ranking's fallback kept less than this share of the INT8 FLOPs
FIRST_SEARCH_KEEPS = 0.5  # where the second ranking may run, the first is searched first only as far as this share
# how the decision is made from the same statistics and artefacts (QUANT_VERSION covers those): 2, methods too close
# for the all-INT8 check to tell apart each fall back (:func:`too_close`)
DECISION_VERSION = "3"  # 3: a cost-ranked fallback entry carries int8_alone_error, not "sensitivity" (a check set's
# distinct, uncalibrated samples are keyed through check_idx)


@dataclass(frozen=True)
class Int8Decision:
    """What the INT8 build decided: the artefacts, the plan with its fallback and FLOP shares, and the check."""

    quant: QuantArtefacts
    plan: PartitionPlan
    check: Int8Check
    cached: bool


def next_precision(chain: tuple[str, ...], device: str) -> str | None:
    """The precision after int8 in ``chain`` that ``device`` runs, or None (the chain ends at int8)."""
    usable = usable_chain(chain, device)
    if "int8" not in usable:
        return None
    rest = usable[usable.index("int8") + 1:]
    return rest[0] if rest else None


def _node_devices(plan: PartitionPlan) -> dict[str, str]:
    """Node -> the device it runs INT8 on (a model-wise plan's DLA engines win: there the fallback must hold)."""
    out: dict[str, str] = {}
    for seg in plan.segments:
        for n, p in seg.layer_precision.items():
            if p == "int8" and (n not in out or seg.kind == "dla"):
                out[n] = "gpu" if n in seg.gpu_fallback_nodes else seg.device
    return out


def plan_identity(plan: PartitionPlan) -> str:
    """What of a plan an INT8 decision depends on, the same at every batch size."""
    segs = [(s.device, list(s.nodes), sorted(s.layer_precision.items()), list(s.gpu_fallback_nodes), s.request_share)
            for s in plan.segments]
    return json.dumps([plan.granularity, list(plan.precision_chain), segs], sort_keys=True)


def with_fallback(plan: PartitionPlan, fallback: tuple[dict, ...]) -> PartitionPlan:
    """The plan with each fallback layer in its new precision, listed in ``int8_fallback`` and its notes."""
    if not fallback:
        return plan
    moved = {f["node"]: f["precision"] for f in fallback}
    segments = []
    for seg in plan.segments:
        lp = {n: (moved[n] if n in moved and p == "int8" else p) for n, p in seg.layer_precision.items()}
        used = set(lp.values())
        precision = next((p for p in plan.precision_chain if p in used), seg.precision)
        segments.append(replace(seg, layer_precision=lp, precision=precision))
    by_why: dict[str, int] = {}
    for f in fallback:
        by_why[f["reason"]] = by_why.get(f["reason"], 0) + 1
    notes = tuple(plan.notes) + tuple(f"{n} layer(s) kept out of INT8: {why}" for why, n in by_why.items())
    return replace(plan, segments=tuple(segments), notes=notes, int8_fallback=tuple(fallback))


class CheckRunner:
    """FP32 reference outputs of the check samples (computed once) and INT8 candidates measured against them."""

    def __init__(self, model: NormalisedModel, dataset: Dataset, indices: list[int], preprocess: Preprocess,
                 task: str, decoder, progress: Progress | None):
        self.model, self.dataset, self.indices, self.preprocess = model, dataset, indices, preprocess
        self.task, self.decoder, self.progress = task, decoder, progress
        self.shape = model.graph.shape(model.graph.inputs[0])
        self.outputs = list(model.graph.outputs)
        self.relaxed = None
        if task in BOX_TASKS and decoder is not None:
            from ..tasks import TaskDecoder

            spec = decoder.card.detection
            low = decoder.card.model_copy(update={"detection": spec.model_copy(update={"score_threshold": spec.score_threshold / 2})})
            self.relaxed = TaskDecoder(low, decoder.labels, {o: model.graph.shape(o) for o in model.graph.outputs})
        self.staged = list(stage_batches(dataset, preprocess, self.shape, indices))  # staged once, run per candidate
        self.order = list(range(len(self.staged)))  # the order the batches are measured in
        self.reference = [out for _, out in self._outputs(model.model)]
        self.rooms = [self._tally().room(r) for r in self.reference]
        self.room_after = rooms_after(self.rooms)  # per place in the order
        self.ordered = False

    def _outputs(self, model: onnx.ModelProto) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """``model``'s outputs on each check batch in :attr:`order`, with the batch's index; named, real rows only."""
        feeds = ({self.model.graph.inputs[0]: self.staged[i][0]} for i in self.order)
        for i, values in zip(self.order, runs(session(model, optimise=True), self.outputs, feeds)):
            yield i, {k: v[:self.staged[i][1]] for k, v in zip(self.outputs, values)}

    def _masks(self, outputs, row: int, dets) -> list:
        """A segmentation's masks of one sample's detections, at the input's size."""
        from ..tasks.segmentation import box_masks

        return box_masks(np.asarray(outputs[self.decoder.protos])[row], dets.extra, dets.boxes, None, tuple(self.shape[2:]))

    def _tally(self) -> Tally:
        d, low = self.decoder, self.relaxed
        return Tally(self.task,
                     probabilities=(lambda o: d.probabilities(o)) if d is not None else None,
                     detections=(lambda o: d.detections(o, [None] * len(next(iter(o.values()))))) if d is not None else None,
                     relaxed=(lambda o: low.detections(o, [None] * len(next(iter(o.values()))))) if low is not None else None,
                     masks=self._masks if self.task == "segmentation" and d is not None else None)

    def measure(self, qdq_models: list, stop: dict | None = None) -> dict[str, float]:
        """The check's measures for INT8 emulated by ``qdq_models`` (the worst of them, measure by measure).

        With ``stop`` (a tolerance), measuring ends as soon as a model certainly misses it, whatever the samples
        still to come (:meth:`~.check.Tally.cannot_meet`): the measures so far come back marked ``partial``, a miss
        that is no figure to report. The fallback's search runs its candidates so, most of which miss; and the
        first measure that runs to the end orders the batches for all that follow, those it lost most on first,
        where a candidate that misses most likely misses too. The measures do not depend on that order."""
        per_model, losses = [], np.zeros(len(self.staged))
        for m in qdq_models:
            tally = self._tally()
            outputs = self._outputs(m)
            for at, (i, got) in enumerate(outputs):
                tally.add(self.reference[i], got, i)
                if stop is not None and tally.cannot_meet(stop, self.room_after[at]):
                    outputs.close()  # the runs in flight finish; nothing more is started
                    return {**tally.measures(), "partial": True}
            per_model.append(tally.measures())
            losses += [tally.losses[i] for i in range(len(self.staged))]
        if not self.ordered:
            self.order = sorted(range(len(self.staged)), key=lambda i: -losses[i])  # stable: ties in the set's order
            self.room_after, self.ordered = rooms_after([self.rooms[i] for i in self.order]), True
        return _worst(per_model)


def _worst(per_model: list[dict]) -> dict:
    """The worst of several artefacts' measures, measure by measure (a share with its counts and bound)."""
    worst = dict(per_model[0])
    worst["bounds"] = dict(per_model[0].get("bounds", {}))
    for measures in per_model[1:]:
        for k, v in measures.items():
            if not isinstance(v, float) or k not in worst:
                continue
            if (v > worst[k]) if k in _LOWER_IS_BETTER else (v < worst[k]):
                worst[k] = v
                worst["bounds"][k] = measures.get("bounds", {}).get(k)
                if k in COUNTED:
                    worst.update({c: measures[c] for c in COUNTED[k] if c in measures})
    return worst


@dataclass(frozen=True)
class DecisionInputs:
    """What a decision depends on, and its cache key (known without calibrating)."""

    keep_float: tuple[str, ...]
    exclude: tuple[str, ...]
    settings: QuantSettings
    check_data: Dataset
    check_idx: list[int]
    source: str
    tolerance: dict
    explicit: bool
    devices: dict[str, str]
    allow: bool
    key: str
    branches: tuple[str, ...] = ()


def decision_inputs(model: NormalisedModel, plan: PartitionPlan, calib: Dataset, preprocess: Preprocess,
                    card: ModelCard, edge_runtime, check_set: Dataset | None) -> DecisionInputs:
    """What a decision depends on: the layers in INT8, the card's float layers, the check set, the tolerance."""
    graph = model.graph
    int8_nodes = {n for s in plan.segments for n, p in s.layer_precision.items() if p == "int8"}
    keep_float = tuple(sorted(float_nodes(graph, card) & int8_nodes))
    branches = tuple(sorted(head_branches(graph, card) & int8_nodes - set(keep_float)))
    exclude = tuple(sorted(n.name for n in graph.nodes if n.name not in int8_nodes))
    settings = quant_settings(edge_runtime, card)
    calibrating, held_out, in_sample = calibration_split(len(calib))
    if check_set is not None:
        check_data, check_fp = check_set, check_set.fingerprint()
        check_idx, left_out = check_indices(check_set, calib, calibrating)
        source = f"{check_set.source} ({left_out})" if left_out else check_set.source
    else:
        check_data, check_idx = calib, held_out
        source, check_fp = ("in-sample" if in_sample else "held-out"), "held-out"
    tolerance, explicit = tolerance_for(card.task, getattr(edge_runtime, "int8_tolerance", None), card.quantization.tolerance)
    devices = _node_devices(plan)
    allow = any(next_precision(plan.precision_chain, d) for d in set(devices.values()))
    key = digest("int8-decision", QUANT_VERSION, DECISION_VERSION, model.identity,
                 statistics_key(model, calib, preprocess), settings.method, repr(settings.percentile),
                 json.dumps(tolerance, sort_keys=True), check_fp, repr(check_idx), plan_identity(plan),
                 ",".join(keep_float), ",".join(exclude), ",".join(branches))
    return DecisionInputs(keep_float, exclude, settings, check_data, check_idx, source, tolerance, explicit, devices,
                          allow, key, branches)


def check_indices(check_set: Dataset, calib: Dataset, calibrating: list[int]) -> tuple[list[int], str]:
    """The samples of a ``--check`` set the check judges, and what was left out ("" when nothing): each distinct
    sample once (250 copies of one image are one sample, not enough for a verdict), none of the samples the ranges
    were calibrated on (INT8 judged on the scenes it was fitted to passes too easily), at most
    :data:`MAX_CALIBRATION_SAMPLES`.

    Raises:
        BuildError: no sample is left.
    """
    fitted = set(calib.digests(calibrating))
    seen: set[bytes] = set()
    keep: list[int] = []
    repeated = calibrated = 0
    for i, d in enumerate(check_set.digests()):
        if len(keep) == MAX_CALIBRATION_SAMPLES:  # enough: the rest is not read
            break
        if d in seen:
            repeated += 1
        elif d in fitted:
            calibrated += 1
        else:
            keep.append(i)
        seen.add(d)
    read = len(seen) + repeated
    unfit = [f"{n} {what}" for n, what in ((repeated, "repeated sample(s)"), (calibrated, "calibration sample(s)")) if n]
    if not keep:
        raise BuildError(f"check set {check_set.source}: no sample is left to judge the INT8 check on "
                         f"({' and '.join(unfit) or 'it is empty'}); give distinct samples that did not calibrate")
    if unfit:
        log.warning("check set %s: %s left out of the INT8 check; %d sample(s) judge it", check_set.source,
                    " and ".join(unfit), len(keep))
    beyond = len(check_set) - read
    notes = unfit + ([f"{beyond} beyond the first {MAX_CALIBRATION_SAMPLES} judged"] if beyond > 0 else [])
    return keep, ("left out: " + ", ".join(notes)) if notes else ""


def decide_int8(model: NormalisedModel, plan: PartitionPlan, calib: Dataset, preprocess: Preprocess, card: ModelCard,
                cache: EngineCache, edge_runtime, decoder=None, check_set: Dataset | None = None,
                progress: Progress | None = None) -> Int8Decision:
    """Calibrate, check and (where the chain allows) fall back: one decision per model, shared by every batch size.

    Args:
        plan: the partition plan (its ``int8`` layers are calibrated).
        calib: the calibration set; every fifth of its first 1280 samples is held out for the check (at most 512 of
            the others calibrate).
        decoder: the card's :class:`~k2edge.tasks.TaskDecoder` (classification and detection measures).
        check_set: a set to check on instead of the held-out samples (``--check``).

    Raises:
        BuildError: an explicit tolerance needs more check samples (or boxes) than there are.
    """
    inputs = decision_inputs(model, plan, calib, preprocess, card, edge_runtime, check_set)
    stats, stats_key, samples = calibration_statistics(model, calib, preprocess, cache,
                                                       _counter(progress, "calibrating", len(calibration_split(len(calib))[0])))

    def build(tmp: Path) -> dict:
        runner = CheckRunner(model, inputs.check_data, inputs.check_idx, preprocess, card.task, decoder, progress)
        check = _check_and_fall_back(model, plan, stats, inputs, runner, _probe(model, calib, preprocess), tmp, progress,
                                     _probe(model, calib, preprocess, SEARCH_SAMPLES, spread=True))
        (tmp / "decision.json").write_text(json.dumps(check.to_dict(), indent=1, sort_keys=True))
        return {"status": check.status, "fallback": len(check.fallback)}

    entry = cache.get_or_build("int8-decision", inputs.key, build, what=f"INT8 check of {model.source}")
    check = Int8Check.from_dict(json.loads(entry.file("decision.json").read_text()))
    new_plan = with_fallback(plan, tuple(card_fallback(plan, inputs.keep_float)) + tuple(check.fallback))
    moved = tuple(sorted(f["node"] for f in check.fallback))
    quant = _artefacts(model, stats, stats_key, cache, new_plan, samples, moved, inputs, check)
    return Int8Decision(quant, with_shares(new_plan, model.graph, measured_int8_layers(quant, model)), check, entry.hit)


def measured_int8_layers(quant: QuantArtefacts, model: NormalisedModel) -> dict[str, set]:
    """Per device kind, the learned layers the Q/DQ model really runs in INT8."""
    learned = learned_layers(model.graph)
    gpu = qdq_int8_layers(onnx.load(str(quant.qdq_model)), learned)
    dla = qdq_int8_layers(onnx.load(str(quant.dla.qdq_model)), learned) if quant.dla is not None else gpu
    return {"gpu": gpu, "dla": dla}


def _probe(model: NormalisedModel, calib: Dataset, preprocess: Preprocess, samples: int = SENSITIVITY_SAMPLES,
           spread: bool = False) -> Callable[[], OutputProbe]:
    """The FP32 outputs the sensitivity (the first ``samples`` calibration samples) or the range search
    (``spread``: ``samples`` spread over the calibration samples) compares with, made only when needed."""
    def make() -> OutputProbe:
        idx = calibration_split(len(calib))[0]
        idx = idx[::max(1, len(idx) // samples)][:samples] if spread else idx[:samples]
        shape = model.graph.shape(model.graph.inputs[0])
        return OutputProbe(model.model, model.graph.inputs[0], list(stage_batches(calib, preprocess, shape, idx)))

    return make


@dataclass
class _Candidate:
    """One calibration method's all-INT8 artefacts and their check (step 3 and 4), before any fallback."""

    settings: QuantSettings
    bases: list
    first: dict
    tol: dict
    notes: list


def _check_and_fall_back(model, plan, stats, inputs: DecisionInputs, runner: CheckRunner, probe, tmp: Path,
                         progress, search_probe=None) -> Int8Check:
    """Steps 3 to 5: the check of all-INT8 under each calibration method the settings allow and, if it misses and the
    chain allows, the smallest fallback. A method closer to FP32 than ``max`` on the all-INT8 check is kept when the
    check resolves the difference; when it does not (:func:`too_close`), each falls back and the one that keeps
    more INT8 is kept."""
    tried = _first_checks(model, stats, plan, inputs, runner, tmp, search_probe, progress)
    best = max(tried, key=lambda c: _score(c.first, c.tol))  # a tie keeps the first: max
    if (best is tried[0] or not inputs.allow or meets(best.first, best.tol)
            or not too_close(tried[0].first, tried[0].tol, best.first, best.tol)):
        if len(tried) > 1:
            scored = ", ".join(f"{_method_text(c.settings)} {_score(c.first, c.tol):+.4f}" for c in tried)
            best.notes.append(f"calibration method {_method_text(best.settings)} kept: all-INT8 margin to the "
                              f"tolerance {scored}")
        return _fall_back(model, plan, inputs, runner, probe, progress, best)[0]
    # the check cannot tell the two apart before the fallback (YOLOv8n: max and percentile a box or two apart, and
    # percentile's fallback keeps 47-79 % INT8 where max's keeps 92-94 %): each falls back, the other only as far as
    # it would keep more INT8 and meet the tolerance
    default, kept = _fall_back(model, plan, inputs, runner, probe, progress, tried[0])
    other, other_kept = _fall_back(model, plan, inputs, runner, probe, progress, best, floor=kept)
    won = other if other is not None else default
    versus = (f"{100 * other_kept:.1f} %" if other is not None
              else f"none that met the tolerance keeping more than {100 * kept:.1f} %")
    first, second = _method_text(tried[0].settings), _method_text(best.settings)
    note = (f"calibration method {won.calibration} kept: {first} and {second} are within the check's 95 % interval of "
            f"each other on all-INT8 (margins {_score(tried[0].first, tried[0].tol):+.4f}, {_score(best.first, best.tol):+.4f}), "
            f"so each fell back: {first}'s fallback keeps {100 * kept:.1f} % of the candidate layers' FLOPs INT8, "
            f"{second}'s {versus}")
    return replace(won, notes=won.notes + (note,))


def too_close(default: dict, default_tol: dict, other: dict, other_tol: dict) -> bool:
    """Whether ``other`` (a method's all-INT8 measures), closer to the tolerance than ``default`` (``max``'s), is closer
    by less than the check resolves: its margin no larger than what ``default``'s binding measure (the one furthest
    under its tolerance) reaches at the top of its 95 % interval. A measure without an interval, or lower-is-better,
    resolves every difference."""
    if _score(other, other_tol) <= _score(default, default_tol):
        return False
    binding = min(default_tol, key=lambda k: float(default.get(k, 0.0)) - float(default_tol[k]))
    interval = (default.get("bounds") or {}).get(binding)
    if interval is None or binding in _LOWER_IS_BETTER:
        return False
    return _score(other, other_tol) <= float(interval[1]) - float(default_tol[binding])


def _fall_back(model, plan, inputs: DecisionInputs, runner: CheckRunner, probe, progress, cand: _Candidate,
               floor: float | None = None) -> tuple[Int8Check | None, float]:
    """Step 5 from one method's all-INT8 check: the check as it stands when it meets the tolerance, else the smallest
    fallback (sensitivity ranking, then the cost-per-FLOP one when that keeps too little). Returns the check and the
    share of the candidate layers' learned FLOPs it keeps INT8. With ``floor``, only fallbacks that keep more than that
    share are searched, and None is returned when none meets the tolerance."""
    first, tol, notes, bases = cand.first, cand.tol, list(cand.notes), cand.bases
    task, n_check, method = runner.task, len(inputs.check_idx), _method_text(cand.settings)
    searched = dict(cand.settings.searched) or None
    floats = set(inputs.exclude) | set(inputs.keep_float)
    count, need = min_check(task)
    powered = int(first.get(count, n_check if count == "samples" else 0)) >= need
    # a check without the power for a verdict cannot vouch for a detection head's branches in INT8: they fall back first
    held = inputs.branches if inputs.allow and not powered else ()
    all_int8, before = first, None
    if held:
        first, before = runner.measure([finish_qdq(b, model, held, floats) for b in bases]), all_int8
        notes.append(f"the detection head's branches ({len(held)} node(s)) kept out of INT8: {int(first.get(count, 0))} "
                     f"FP32 box(es) on the check are too few to vouch for them ({need} needed)")
    pre = tuple(_moved(plan, inputs, n, HEAD_REASON) for n in held)
    if meets(first, tol):
        return (Int8Check(task, verdict(task, first, True, bool(held)), inputs.source, n_check, first, tol, pre, before,
                          notes=tuple(notes), calibration=method, ranges=searched), 1.0)
    if not inputs.allow:
        notes.append("the precision chain ends at int8: no layer falls back")
        return (Int8Check(task, "failed", inputs.source, n_check, first, tol, notes=tuple(notes), calibration=method,
                          ranges=searched), 1.0)
    units = fallback_units(model.graph, [n.name for n in model.graph.nodes if n.name in inputs.devices
                                         and n.name not in inputs.keep_float and n.name not in held])
    flops = _unit_flops(model, units)
    measured: dict[frozenset, dict] = {frozenset(held): first}  # by the nodes moved, shared by both rankings

    def above_floor(names: list[str]) -> int:
        """How many prefixes of ``names`` keep more than ``floor`` (every prefix without one)."""
        return len(names) if floor is None else sum(1 for share in _prefix_kept(flops, names) if share > floor)

    def measure(names: list[str], k: int, stop: dict | None = tol) -> dict:
        """The check with the first ``k`` of ``names`` moved (each set of moved nodes measured once; with ``stop``,
        a miss only as far as it is certain: :meth:`CheckRunner.measure`)."""
        key = frozenset(n for u in names[:k] for n in units[u]) | frozenset(held)
        fresh = key not in measured
        if fresh or (stop is None and measured[key].get("partial")):
            measured[key] = runner.measure([finish_qdq(b, model, tuple(sorted(key)), floats) for b in bases], stop)
            if progress and fresh:
                progress("int8 fallback", len(measured) - 1, max(len(measured) - 1, search_budget(len(names))))
        return measured[key]

    def search(names: list[str], upto: int | None = None) -> tuple[int | None, dict[int, dict]]:
        """The smallest prefix of ``names`` (of at most ``upto`` units) whose move meets the tolerance, and every
        prefix measured."""
        tried: dict[int, dict] = {0: first}

        def holds(k: int) -> bool:
            tried[k] = measure(names, k)
            return meets(tried[k], tol)

        limit = min(above_floor(names), len(names) if upto is None else upto)
        if floor is not None and (limit == 0 or not holds(limit)):
            return None, tried  # the most it may move without keeping less than the floor misses: nothing within it
        return smallest_prefix(holds, limit), tried

    scores = sensitivity(probe(), finish_qdq(bases[-1], model, held, floats), model.model, units, progress)
    names = rank(scores, list(units))
    # where the second ranking may run, the first is searched only as far as it keeps FIRST_SEARCH_KEEPS: past that the
    # second runs anyway, and one of its fallbacks that keeps as much beats every longer prefix of the first
    half = sum(1 for share in _prefix_kept(flops, names) if share >= FIRST_SEARCH_KEEPS)
    (best, tried), reason = search(names, half if powered else None), SENSITIVITY_REASON
    if powered and (best is None or _kept(flops, names[:best]) < SECOND_RANKING_BELOW):
        # the sensitivity ranking lost more than a tenth of the INT8: rank by what each layer costs alone, per FLOP, and
        # keep the ranking that keeps more (not on a check too small for a verdict: it could not vouch for the INT8 the
        # second ranking keeps)
        costs = int8_alone_costs(probe(), lambda u: finish_qdq(
            bases[-1], model, tuple(n for v in units if v != u for n in units[v]) + held, floats), units, progress,
            none=finish_qdq(bases[-1], model, tuple(n for v in units for n in units[v]) + held, floats))
        other = rank_by_cost_per_flop(costs, flops, list(units))
        k, tried_other = search(other)
        searched_all = best is not None or k is None or _kept(flops, other[:k]) < FIRST_SEARCH_KEEPS
        if best is None and searched_all:
            best, tried = search(names)  # the rest of the first ranking (what was measured is not measured again)
        if k is not None and (best is None or _kept(flops, other[:k]) > _kept(flops, names[:best])):
            before = (f"{100 * _kept(flops, names[:best]):.1f} %" if best is not None else "none that met the tolerance"
                      if searched_all else f"none that met the tolerance keeping {100 * max(FIRST_SEARCH_KEEPS, floor or 0):.1f} %")
            notes.append(f"ranked by INT8-alone cost per FLOP: {100 * _kept(flops, other[:k]):.1f} % of the candidate "
                         f"layers' FLOPs kept INT8 (by sensitivity: {before})")
            names, best, tried, scores, reason = other, k, tried_other, costs, COST_REASON
    if best is None and floor is not None:
        return None, 0.0
    if best is None:
        tried = {k: measure(names, k, None) for k in tried}  # the best found is kept: each miss measured in full
        best = max(tried, key=lambda k: _score(tried[k], tol))
        notes.append(f"moving all {len(names)} ranked layer(s) out of INT8 did not reach the tolerance; keeping the "
                     f"best found ({best} layer(s))")
    figure = "sensitivity" if reason == SENSITIVITY_REASON else "int8_alone_error"  # what the ranking's scores are
    fallback = pre + tuple(_moved(plan, inputs, n, reason, unit=u, **{figure: float(f"{scores[u]:.6g}")})
                           for u in names[:best] for n in units[u])
    met = meets(tried[best], tol)
    return (Int8Check(task, verdict(task, tried[best], met, True), inputs.source, n_check, tried[best], tol, fallback,
                      all_int8, tuple(notes), calibration=method, ranges=searched), _kept(flops, names[:best]))


HEAD_REASON = "a detection head's branch: the check has too few FP32 boxes to vouch for it in INT8"


def _moved(plan: PartitionPlan, inputs: DecisionInputs, node: str, reason: str, **more) -> dict:
    """The fallback entry of ``node`` moved for ``reason`` to the chain's next precision on its device."""
    device = inputs.devices[node]
    return {"node": node, "device": device, "precision": next_precision(plan.precision_chain, device), "reason": reason,
            **more}


def _unit_flops(model: NormalisedModel, units: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """Per fallback unit, the learned-layer FLOPs in it."""
    from ..model.cost import node_flops

    learned = set(learned_layers(model.graph))
    nodes = {n.name: n for n in model.graph.nodes}
    return {u: sum(node_flops(model.graph, nodes[n]) for n in members if n in learned) for u, members in units.items()}


def _kept(flops: dict[str, int], moved: list[str]) -> float:
    """The share of the units' learned FLOPs that stays INT8 when ``moved`` leave it."""
    total = sum(flops.values())
    return 1.0 - sum(flops[u] for u in moved) / total if total else 1.0


def _prefix_kept(flops: dict[str, int], names: list[str]) -> list[float]:
    """:func:`_kept` of every prefix of ``names``: the share kept INT8 when the first 1, 2, ... of them leave it."""
    total, moved, out = sum(flops.values()), 0, []
    for u in names:
        moved += flops[u]
        out.append(1.0 - moved / total if total else 1.0)
    return out


def _first_checks(model, stats, plan, inputs: DecisionInputs, runner: CheckRunner, tmp: Path, search_probe=None,
                  progress=None) -> list[_Candidate]:
    """Steps 3 and 4 per calibration method (:func:`~.quantize.candidate_settings`: ``auto`` tries percentile only
    when max misses; ``search`` searches its ranges first, :func:`_searched`): the all-INT8 artefacts and their
    check, one candidate per method tried, in the order tried."""
    tried = []
    for settings in candidate_settings(inputs.settings):
        if settings.method == SEARCH and not settings.searched:
            settings = _searched(model, stats, plan, inputs, tmp, settings, search_probe, progress)
        bases = _bases(model, stats, plan, inputs, tmp, settings)
        first = runner.measure([finish_qdq(b, model, (), set(inputs.exclude) | set(inputs.keep_float)) for b in bases])
        tol, notes = _tolerance(first, inputs, len(inputs.check_idx))
        tried.append(_Candidate(settings, bases, first, tol, notes))
        if meets(first, tol):
            break
    return tried


def _searched(model, stats, plan, inputs: DecisionInputs, tmp: Path, settings: QuantSettings, probe, progress
              ) -> QuantSettings:
    """``settings`` with the range search's ranges (:mod:`.range_search`), searched on the all-INT8 model of the
    variant the fallback must hold on, from every tensor at its ``mse`` range; the DLA's tied groups and fused
    gates keep their ranges."""
    scope = _variant_scopes(plan)[-1]
    ties = dla_ties(model.graph, scope)
    start = replace(settings, method=START)
    base = finish_qdq(base_qdq(model, stats, start, inputs.exclude, inputs.keep_float, ties, tmp / "search.onnx"),
                      model, (), set(inputs.exclude) | set(inputs.keep_float))
    (tmp / "search.onnx").unlink()
    fixed = frozenset(t for g in ties.groups for t in g) | ties.gates
    ranges, before, after = search_ranges(base, start.ranges(stats), candidate_ranges(stats), probe(), fixed, progress)
    log.info("INT8 range search: output error %.4f (%s) -> %.4f", before, START, after)
    base_ranges = stats.ranges("max")
    return replace(settings, searched=tuple(sorted((t, a) for t, a in ranges.items() if a != base_ranges.get(t))))


def _method_text(settings: QuantSettings) -> str:
    return f"percentile {settings.percentile:g}" if settings.method == "percentile" else settings.method


def _tolerance(first: dict, inputs: DecisionInputs, n_check: int) -> tuple[dict, list[str]]:
    """The tolerance the check applies: an explicit one it cannot resolve is refused; a default one is relaxed to
    what the count resolves (one miss allowed, exactly)."""
    tol = dict(inputs.tolerance)
    short = resolvable(first, tol)
    if not short:
        return tol, []
    counts = {k: int(first.get(COUNTED[k][1], 0)) for k in short}
    if inputs.explicit:
        need = ", ".join(f"{k} >= {tol[k]:g} needs at least {short[k]} (has {counts[k]})" for k in short)
        raise BuildError(f"int8 tolerance cannot be resolved on {n_check} check sample(s): {need}; "
                         f"give more calibration samples, a --check set, or a looser tolerance")
    tol = relaxed(tol, first, short)
    return tol, ["with " + ", ".join(f"{counts[k]} {'samples' if k == 'agreement' else 'boxes'}" for k in short)
                 + " the default tolerance is relaxed to " + ", ".join(f"{k} >= {tol[k]}" for k in short)]


def _bases(model, stats, plan, inputs: DecisionInputs, tmp: Path, settings: QuantSettings) -> list[onnx.ModelProto]:
    """Step 3, once per decision: the all-INT8 Q/DQ model of every variant of the plan (a model-wise plan's GPU and
    DLA ones; the last is where the fallback must hold). Each candidate fallback is a graph edit of these."""
    out = []
    for i, dla in enumerate(_variant_scopes(plan)):
        out.append(base_qdq(model, stats, settings, inputs.exclude, inputs.keep_float, dla_ties(model.graph, dla),
                            tmp / f"base-{i}.onnx"))
        (tmp / f"base-{i}.onnx").unlink()
    return out


CARD_REASON = "the card keeps it out of INT8 (a detector's head, or [quantization] keep_float)"


def card_fallback(plan: PartitionPlan, nodes) -> list[dict]:
    """The fallback entries of the nodes a card keeps out of INT8 (each to the chain's next precision on its device)."""
    devices = _node_devices(plan)
    return [{"node": n, "device": devices[n], "precision": next_precision(plan.precision_chain, devices[n]) or
             ("fp16" if devices[n].startswith("dla") else "fp32"), "reason": CARD_REASON}
            for n in sorted(nodes) if n in devices]


def plan_with_card(plan: PartitionPlan, model: NormalisedModel, card: ModelCard) -> PartitionPlan:
    """The plan as it runs with ``card``: what the card keeps out of INT8 in its real precision (``k2edge plan``),
    its FLOP shares as planned (a build measures them)."""
    return with_shares(with_fallback(plan, tuple(card_fallback(plan, float_nodes(model.graph, card)))), model.graph)


def cached_decision(model: NormalisedModel, plan: PartitionPlan, calib: Dataset, preprocess: Preprocess,
                    card: ModelCard, cache: EngineCache, edge_runtime, check_set: Dataset | None = None
                    ) -> tuple[PartitionPlan, Int8Check] | None:
    """The plan and check a previous build decided, from the cache only (None when no build decided yet):
    what ``k2edge plan`` shows after a build, with the FLOP shares of its Q/DQ artefacts when they are cached."""
    inputs = decision_inputs(model, plan, calib, preprocess, card, edge_runtime, check_set)
    entry = cache.entry_dir("int8-decision", inputs.key)
    if cache.verify(entry) is not None:
        return None
    check = Int8Check.from_dict(json.loads((entry / "decision.json").read_text()))
    new_plan = with_fallback(plan, tuple(card_fallback(plan, inputs.keep_float)) + tuple(check.fallback))
    stats, stats_key, samples = calibration_statistics(model, calib, preprocess, cache)  # cached with the decision
    quant = _artefacts(model, stats, stats_key, cache, new_plan, samples, tuple(sorted(f["node"] for f in check.fallback)),
                       inputs, check)
    return with_shares(new_plan, model.graph, measured_int8_layers(quant, model)), check


def _score(measures: dict, tol: dict) -> float:
    """How far a candidate is from the tolerance (0 when it holds): the smallest margin, for 'keep the best'."""
    return min(float(measures.get(k, 0.0)) - float(v) for k, v in tol.items())


def settings_of(check: Int8Check, settings: QuantSettings) -> QuantSettings:
    """The calibration settings a decision kept (its check's method; ``auto`` resolved)."""
    method = check.calibration.split()[0]
    searched = tuple(sorted((check.ranges or {}).items()))
    if method == SEARCH:
        return replace(settings, method=method, searched=searched)
    return replace(settings, method=method) if settings.method == AUTO else settings


def _variant_scopes(plan: PartitionPlan) -> list[frozenset]:
    dla, gpu_too = plan_dla_nodes(plan)
    return [frozenset(), dla] if gpu_too else [dla]


def _artefacts(model, stats: TensorStatistics, stats_key: str, cache: EngineCache, plan: PartitionPlan, samples: int,
               fallback_nodes, inputs: DecisionInputs, check: Int8Check) -> QuantArtefacts:
    settings = settings_of(check, inputs.settings)
    made = [quant_variant(model, stats, stats_key, cache, settings, inputs.exclude, inputs.keep_float, dla,
                          samples, fallback_nodes) for dla in _variant_scopes(plan)]
    return replace(made[0], dla=made[1]) if len(made) == 2 else made[0]


def _counter(progress: Progress | None, what: str, total: int):
    if progress is None:
        return None
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        progress(what, done[0], total)

    return advance
