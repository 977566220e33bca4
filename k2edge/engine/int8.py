"""One INT8 decision per model: calibrate, check against FP32, and fall back layer by layer when INT8 costs too much.

The decision (the check's figures and the layers kept out of INT8) is made once per model, card, profile and
calibration set, and cached by what it depends on -- not by the batch size -- so every batch-size engine the
daemon builds shares it: the same layers fall back at every batch size.

Check: FP32 and the INT8 Q/DQ emulation (every artefact of the plan: a model-wise plan's GPU and DLA ones) run
on the check samples (every fifth calibration sample, or a ``--check`` set) and are compared by the card's task
(:mod:`.check`). Fallback, when the check misses its tolerance and the precision chain continues after int8:
layers are ranked by the signal-to-quantisation-noise ratio of their output (one streaming pass over the check
samples; SQNR = 20 log10(|x| / |x - Q/DQ(x)|), as onnxruntime's ``quantization/qdq_loss_debug.py``
``compute_signal_to_quantization_noice_ratio`` computes it, here from running sums instead of every
activation kept in memory), then a bisection finds how few of the worst must move to the chain's next
precision on the same device (FP16: the DLA runs it, so no GPU<->DLA transition is added) for the tolerance to
hold (a bisection from above, then doubling probes from below; the smallest k that held wins).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ..config.card import BOX_TASKS, ModelCard
from ..dla.planner import PartitionPlan
from ..dla.precision import usable_chain
from ..errors import BuildError
from ..model.datasets import Dataset
from ..model.ingest import NormalisedModel
from ..tasks.preprocess import Preprocess
from .cache import EngineCache, digest
from .calibration import activation_tensors, observed_model, session
from .check import COUNTED, Int8Check, compare_outputs, meets, relaxed, resolvable, tolerance_for, verdict
from .quantize import (MAX_CALIBRATION_SAMPLES, QUANT_VERSION, QuantArtefacts, QuantSettings, calibration_split,
                       calibration_statistics, float_nodes, quant_settings, quant_variant, stage_batches,
                       variant_files)

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (what, done, total)
_LOWER_IS_BETTER = ("mean_abs_dp", "max_rel_error", "keypoint_error")


@dataclass(frozen=True)
class Int8Decision:
    """What the INT8 build decided: the artefacts, the plan with its fallback, and the check."""

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


class _CheckRunner:
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
        ref = session(model.model, optimise=True)
        self.reference = [self._named(ref.run(self.outputs, {self.model.graph.inputs[0]: b}), n) for b, n in self.batches()]

    def batches(self):
        return stage_batches(self.dataset, self.preprocess, self.shape, self.indices)

    def _named(self, values, n) -> dict[str, np.ndarray]:
        return {k: v[:n] for k, v in zip(self.outputs, values)}

    def _masks(self, outputs, row: int, dets) -> list:
        """A segmentation's masks of one sample's detections, at the input's size."""
        from ..tasks.segmentation import box_masks

        return box_masks(np.asarray(outputs[self.decoder.protos])[row], dets.extra, dets.boxes, None, tuple(self.shape[2:]))

    def measure(self, qdq_models: list) -> dict[str, float]:
        """The check's measures for INT8 emulated by ``qdq_models`` (the worst of them, measure by measure)."""
        d, low = self.decoder, self.relaxed
        per_model = []
        for m in qdq_models:
            s = session(m, optimise=True)
            got = [self._named(s.run(self.outputs, {self.model.graph.inputs[0]: b}), n) for b, n in self.batches()]
            per_model.append(compare_outputs(
                self.task, self.reference, got,
                probabilities=(lambda o: d.probabilities(o)) if d is not None else None,
                detections=(lambda o: d.detections(o, [None] * len(next(iter(o.values()))))) if d is not None else None,
                relaxed=(lambda o: low.detections(o, [None] * len(next(iter(o.values()))))) if low is not None else None,
                masks=self._masks if self.task == "segmentation" and d is not None else None))
        return _worst(per_model)

    def sqnr(self, ranges: dict[str, float], tensors: list[str]) -> dict[str, float]:
        """Per tensor: SQNR (dB) of its own INT8 rounding at ``ranges``, over the check samples, in one streaming pass."""
        tensors = [t for t in tensors if ranges.get(t, 0.0) > 0.0]
        if not tensors:
            return {}
        s = session(observed_model(self.model.model, tensors))
        signal = dict.fromkeys(tensors, 0.0)
        noise = dict.fromkeys(tensors, 0.0)
        for b, n in self.batches():
            for t, x in zip(tensors, s.run(tensors, {self.model.graph.inputs[0]: b})):
                x = x[:n].astype(np.float64)
                step = ranges[t] / 127.0
                q = np.clip(np.round(x / step), -127, 127) * step
                signal[t] += float((x * x).sum())
                noise[t] += float(((x - q) ** 2).sum())
        eps = np.finfo(np.float32).eps
        return {t: 20 * math.log10(max(math.sqrt(signal[t]), eps) / max(math.sqrt(noise[t]), eps)) for t in tensors}


def _worst(per_model: list[dict]) -> dict:
    """The worst of several artefacts' measures, measure by measure (a share with its counts and bound)."""
    worst = {k: v for k, v in per_model[0].items()}
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


def decide_int8(model: NormalisedModel, plan: PartitionPlan, calib: Dataset, preprocess: Preprocess, card: ModelCard,
                cache: EngineCache, edge_runtime, decoder=None, check_set: Dataset | None = None,
                progress: Progress | None = None, force_ties: bool = False) -> Int8Decision:
    """Calibrate, check and (where the chain allows) fall back: one decision per model, shared by every batch size.

    Args:
        plan: the partition plan (its ``int8`` layers are calibrated).
        calib: the calibration set; every fifth of its first 512 samples is held out for the check.
        decoder: the card's :class:`~k2edge.tasks.TaskDecoder` (classification and detection measures).
        check_set: a set to check on instead of the held-out samples (``--check``).

    Raises:
        BuildError: an explicit tolerance needs more check samples (or boxes) than there are.
    """
    graph = model.graph
    setup = _setup(model, plan, calib, preprocess, card, edge_runtime, check_set, force_ties)
    keep_float, exclude, settings, devices = setup["keep_float"], setup["exclude"], setup["settings"], setup["devices"]
    check_data, check_idx, source, task = setup["check_data"], setup["check_idx"], setup["source"], card.task
    tolerance, explicit, allow, key = setup["tolerance"], setup["explicit"], setup["allow"], setup["key"]
    stats, stats_key, samples = calibration_statistics(model, calib, preprocess, cache,
                                                       _counter(progress, "calibrating", len(calib)))
    common = dict(settings=settings, exclude_nodes=exclude, keep_float=keep_float, force_ties=force_ties)
    head = card_fallback(plan, keep_float)

    def build(tmp: Path) -> dict:
        runner = _CheckRunner(model, check_data, check_idx, preprocess, task, decoder, progress)
        tol = dict(tolerance)
        notes = []
        n_check = len(check_idx)

        def evaluate(fallback_nodes: tuple[str, ...]) -> dict[str, float]:
            with tempfile.TemporaryDirectory(dir=tmp) as d:
                paths = []
                for i, dla in enumerate(_variant_scopes(plan)):
                    sub = Path(d) / str(i)
                    sub.mkdir()
                    variant_files(model, stats, sub, dla_nodes=dla, fallback_nodes=fallback_nodes, **common)
                    paths.append(sub / "qdq.onnx")
                import onnx

                return runner.measure([onnx.load(str(p)) for p in paths])

        first = evaluate(())
        short = resolvable(first, tol)
        if short:
            counts = {k: int(first.get(COUNTED[k][1], 0)) for k in short}
            if explicit:
                need = ", ".join(f"{k} >= {tol[k]:g} needs at least {short[k]} (has {counts[k]})" for k in short)
                raise BuildError(f"int8 tolerance cannot be resolved on {n_check} check sample(s): {need}; "
                                 f"give more calibration samples, a --check set, or a looser tolerance")
            tol = relaxed(tol, first, short)  # a default tolerance: as strict as the count resolves (one miss allowed)
            notes.append("with " + ", ".join(f"{counts[k]} {'samples' if k == 'agreement' else 'boxes'}" for k in short)
                         + " the default tolerance is relaxed to " + ", ".join(f"{k} >= {tol[k]}" for k in short))
        fallback: list[dict] = []
        before = None
        measures = first
        status = "passed" if meets(first, tol) else "failed"
        if status == "failed" and not allow:
            notes.append("the precision chain ends at int8: no layer falls back")
        elif status == "failed":
            ranges = _emulated_ranges(model, stats, plan, **common)
            candidates = [n for n in graph.nodes if n.name in devices and n.name not in keep_float]
            out_of = {n.name: [o for o in n.outputs if o in ranges] for n in candidates}
            sqnr = runner.sqnr(ranges, [o for outs in out_of.values() for o in outs])
            ranked = sorted((min(sqnr[o] for o in outs), n) for n, outs in out_of.items() if outs and all(o in sqnr for o in outs))
            names = [n for _, n in ranked]
            db = {n: s for s, n in ranked}
            tried = {0: first}
            done = [0]

            def check_k(k: int) -> bool:
                if k not in tried:
                    tried[k] = evaluate(tuple(names[:k]))
                    done[0] += 1
                    if progress:
                        progress("int8 fallback", done[0], max(done[0], 2 * math.ceil(math.log2(len(names) + 1))))
                return meets(tried[k], tol)

            # The measures are not monotonic in k on a few dozen samples, so one search can settle on a large k
            # where a smaller one holds: bisect from above (between none and all ranked layers), then probe
            # doubling k from below the answer, and keep the smallest k that held.
            if names and check_k(len(names)):
                lo, hi = 0, len(names)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if check_k(mid):
                        hi = mid
                    else:
                        lo = mid
                lo, k = 0, 1
                while k < hi:
                    if check_k(k):
                        while k - lo > 1:  # bisect between the last miss and this hit
                            mid = (lo + k) // 2
                            if check_k(mid):
                                k = mid
                            else:
                                lo = mid
                        break
                    lo, k = k, k * 2
                best = min(k for k in tried if k > 0 and meets(tried[k], tol))
                status = "fallback"
            else:
                best = max(tried, key=lambda k: _score(tried[k], tol))
                notes.append(f"moving all {len(names)} ranked layer(s) to {next_precision(plan.precision_chain, 'gpu') or 'fp16'} "
                             f"did not reach the tolerance; keeping the best found ({best} layer(s))")
            before, measures = first, tried[best]
            for n in names[:best]:
                fallback.append({"node": n, "device": devices[n], "precision": next_precision(plan.precision_chain, devices[n]),
                                 "reason": "INT8 check below tolerance: among the layers with the lowest output SQNR",
                                 "sqnr_db": round(db[n], 2)})
        status = status if status == "failed" else verdict(task, measures, True, bool(fallback))
        check = Int8Check(task, status, source, n_check, measures, tol, tuple(fallback), before, tuple(notes))
        (tmp / "decision.json").write_text(json.dumps(check.to_dict(), indent=1, sort_keys=True))
        return {"status": status, "fallback": len(fallback)}

    entry = cache.get_or_build("int8-decision", key, build, what=f"INT8 check of {model.source}")
    check = Int8Check.from_dict(json.loads(entry.file("decision.json").read_text()))
    fallback = tuple(head) + tuple(check.fallback)
    new_plan = with_fallback(plan, fallback)
    moved = tuple(sorted(f["node"] for f in check.fallback))
    quant = _artefacts(model, stats, stats_key, cache, new_plan, samples, moved, **common)
    return Int8Decision(quant, new_plan, check, entry.hit)


CARD_REASON = "the card keeps it out of INT8 (a detector's head, or [quantization] keep_float)"


def card_fallback(plan: PartitionPlan, nodes) -> list[dict]:
    """The fallback entries of the nodes a card keeps out of INT8 (each to the chain's next precision on its device)."""
    devices = _node_devices(plan)
    return [{"node": n, "device": devices[n], "precision": next_precision(plan.precision_chain, devices[n]) or
             ("fp16" if devices[n].startswith("dla") else "fp32"), "reason": CARD_REASON}
            for n in sorted(nodes) if n in devices]


def plan_with_card(plan: PartitionPlan, model: NormalisedModel, card: ModelCard) -> PartitionPlan:
    """The plan as it runs with ``card``: what the card keeps out of INT8 in its real precision (``k2edge plan``)."""
    return with_fallback(plan, tuple(card_fallback(plan, float_nodes(model.graph, card))))


def _setup(model, plan, calib, preprocess, card, edge_runtime, check_set, force_ties) -> dict:
    """What a decision depends on, and its cache key (no calibration needed to know it)."""
    from .quantize import statistics_key

    graph = model.graph
    int8_nodes = {n for s in plan.segments for n, p in s.layer_precision.items() if p == "int8"}
    keep_float = tuple(sorted(float_nodes(graph, card) & int8_nodes))
    exclude = tuple(sorted(n.name for n in graph.nodes if n.name not in int8_nodes))
    settings = quant_settings(edge_runtime, card)
    _, held_out, in_sample = calibration_split(len(calib))
    if check_set is not None:
        check_data, check_idx = check_set, list(range(min(len(check_set), MAX_CALIBRATION_SAMPLES)))
        source, check_fp = check_set.source, check_set.fingerprint()
    else:
        check_data, check_idx = calib, held_out
        source, check_fp = ("in-sample" if in_sample else "held-out"), "held-out"
    tolerance, explicit = tolerance_for(card.task, getattr(edge_runtime, "int8_tolerance", None), card.quantization.tolerance)
    devices = _node_devices(plan)
    allow = any(next_precision(plan.precision_chain, d) for d in set(devices.values()))
    key = digest("int8-decision", QUANT_VERSION, model.identity, statistics_key(model, calib, preprocess), settings.method,
                 repr(settings.percentile), json.dumps(tolerance, sort_keys=True), check_fp, repr(check_idx),
                 plan_identity(plan), ",".join(keep_float), ",".join(exclude), str(force_ties))
    return dict(keep_float=keep_float, exclude=exclude, settings=settings, check_data=check_data, check_idx=check_idx,
                source=source, tolerance=tolerance, explicit=explicit, devices=devices, allow=allow, key=key)


def cached_decision(model: NormalisedModel, plan: PartitionPlan, calib: Dataset, preprocess: Preprocess,
                    card: ModelCard, cache: EngineCache, edge_runtime, check_set: Dataset | None = None
                    ) -> tuple[PartitionPlan, Int8Check] | None:
    """The plan and check a previous build decided, from the cache only (None when no build decided yet):
    what ``k2edge plan`` shows after a build."""
    setup = _setup(model, plan, calib, preprocess, card, edge_runtime, check_set, False)
    entry = cache.entry_dir("int8-decision", setup["key"])
    if cache.verify(entry) is not None:
        return None
    check = Int8Check.from_dict(json.loads((entry / "decision.json").read_text()))
    return with_fallback(plan, tuple(card_fallback(plan, setup["keep_float"])) + tuple(check.fallback)), check


def _score(measures: dict, tol: dict) -> float:
    """How far a candidate is from the tolerance (0 when it holds): the smallest margin, for 'keep the best'."""
    return min(float(measures.get(k, 0.0)) - float(v) for k, v in tol.items())


def _variant_scopes(plan: PartitionPlan) -> list[frozenset]:
    from .quantize import plan_dla_nodes

    dla, gpu_too = plan_dla_nodes(plan)
    return [frozenset(), dla] if gpu_too else [dla]


def _emulated_ranges(model, stats, plan, settings, exclude_nodes, keep_float, force_ties) -> dict[str, float]:
    """The ranges the emulation rounds with (the DLA variant's where a plan has both)."""
    from .quantize import dla_ties, tie_ranges

    graph = model.graph
    scope = {n.name for n in graph.nodes} if force_ties else set(_variant_scopes(plan)[-1])
    ties = dla_ties(graph, scope, fuse_gates=not force_ties)
    ranges = tie_ranges(stats.ranges(settings.method, settings.percentile), ties)
    return {t: a for t, a in ranges.items() if t not in ties.gates}


def _artefacts(model, stats, stats_key, cache, plan, samples, fallback_nodes, settings, exclude_nodes, keep_float,
               force_ties) -> QuantArtefacts:
    scopes = _variant_scopes(plan)
    made = [quant_variant(model, stats, stats_key, cache, settings, exclude_nodes, keep_float, dla, samples,
                          force_ties, fallback_nodes) for dla in scopes]
    return replace(made[0], dla=made[1]) if len(made) == 2 else made[0]


def _counter(progress: Progress | None, what: str, total: int):
    if progress is None:
        return None
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        progress(what, done[0], total)

    return advance
