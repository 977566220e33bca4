"""The ONNX Runtime backend: a plan's segments as sub-models, one CPU lane per device.

Each segment is an extracted sub-model with its own InferenceSession; each device of the plan
(``gpu``, ``dla0``, ``dla1``) maps to a lane — a session set plus a worker thread — and every
report names it as such (``dla0 (cpu lane)``): nothing measured here is a DLA number.

Precision is carried out as far as ONNX Runtime can on a CPU: INT8 layers come from the Q/DQ
model, FP16 segments are converted with FP32 at their boundaries, ``fp32`` is the reference mode.
Layers planned FP16 inside an INT8 segment run in FP32 here (a CPU lane cannot mix both in one
session); the build notes say so.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from .._lazy import LazyModule
from ..dla.planner import PartitionPlan
from ..errors import BuildError, InferenceError, first_line
from ..model.extract import extract_submodel
from ..model.ingest import NormalisedModel
from .base import Backend, LaneInfo, TensorSpec
from .cache import EngineCache, digest
from .pipeline import LaneSet, available_cores, lane_layout
from .quantize import QuantArtefacts, quantised_at_entry, to_fp16
from ..tracing.tracer import segments as traced_segments

log = logging.getLogger(__name__)
ort = LazyModule("onnxruntime", "pip install onnxruntime")

BACKEND_VERSION = "4"  # 2: segment models may carry a dynamic batch axis; 3: FP16 folds BatchNorm parameters first;
# 4: an FP16 segment quantises on entry what the Q/DQ model quantises before it (an INT8 segment's INT8 output)


@dataclass(frozen=True)
class SegmentArtefact:
    index: int
    path: Path
    executed_precision: str


@dataclass(frozen=True)
class BuildResult:
    key: str
    segments: tuple[SegmentArtefact, ...]
    notes: tuple[str, ...]
    cached: bool
    batch_axis: bool = False  # the segments take any batch size (else the one they were normalised at)


def _executed_precision(layer_precision: dict[str, str]) -> str:
    used = set(layer_precision.values())
    if "int8" in used:
        return "int8"
    if "fp16" in used:
        return "fp16"
    return "fp32"


def _segment_models(model: NormalisedModel, plan: PartitionPlan, quant: QuantArtefacts | None):
    """Per segment of ``plan``: ``(segment, executed precision, sub-model, notes)``, converted to the precision it runs in."""
    qdq_models: dict[Path, onnx.ModelProto] = {}  # a model-wise plan's GPU and DLA engines have their own

    def qdq_for(device: str) -> onnx.ModelProto:
        path = quant.for_device(device).qdq_model
        if path not in qdq_models:
            qdq_models[path] = onnx.load(str(path))
        return qdq_models[path]

    for seg in plan.segments:
        precision = _executed_precision(seg.layer_precision)
        name = f"segment{seg.index}_{seg.device}"
        notes = []
        if precision == "int8":
            sub = extract_submodel(qdq_for(seg.device), seg.inputs, seg.outputs, name)
            fp16_layers = [n for n, p in seg.layer_precision.items() if p == "fp16"]
            if fp16_layers:
                notes.append(f"segment {seg.index}: {len(fp16_layers)} FP16 layer(s) of an INT8 segment compute in FP32 on the cpu lane "
                             f"(the outputs of layers the INT8 check moved are rounded to FP16)")
        else:
            sub = extract_submodel(model.model, seg.inputs, seg.outputs, name)
            if precision == "fp16":
                sub = to_fp16(sub, [n for n, p in seg.layer_precision.items() if p == "fp32"])
                if quant is not None:
                    sub = quantised_at_entry(sub, qdq_for(seg.device))
        yield seg, precision, sub, notes


def build_segments(model: NormalisedModel, plan: PartitionPlan, quant: QuantArtefacts | None,
                   cache: EngineCache) -> BuildResult:
    """Extract (and convert) one sub-model per segment, through the engine cache."""
    key = digest("onnxruntime", BACKEND_VERSION, ort.__version__, model.sha256, plan.to_json(),
                 quant.keys if quant else "")

    def build(tmp: Path) -> dict:
        notes, executed = [], []
        for seg, precision, sub, seg_notes in _segment_models(model, plan, quant):
            onnx.save(sub, str(tmp / f"segment{seg.index}.onnx"))
            executed.append(precision)
            notes.extend(seg_notes)
        (tmp / "plan.json").write_text(plan.to_json())
        return {"executed_precision": executed, "notes": notes}

    entry = cache.get_or_build("onnxruntime", key, build, what=f"{len(plan.segments)} segment(s) of {model.source}")
    return _result(entry, plan, key, batch_axis=False)


def build_batch_axis_segments(models: tuple[NormalisedModel, NormalisedModel], plans: tuple[PartitionPlan, PartitionPlan],
                              quants: tuple, sizes: tuple[int, int], cache: EngineCache) -> BuildResult:
    """One sub-model per segment that runs every batch size: each segment as :func:`build_segments` makes it at the
    two batch ``sizes``, joined by :func:`~k2edge.model.batch_axis.with_batch_axis`; through the engine cache, under
    a key of its own (an engine of one batch size is never taken for it, nor it for one).

    Raises:
        ModelError: a segment's computation depends on the batch in a way no batch axis expresses.
    """
    from ..model.batch_axis import has_batch_axis, with_batch_axis

    key = digest("onnxruntime-batch-axis", BACKEND_VERSION, ort.__version__, repr(sizes),
                 *(m.sha256 for m in models), *(p.to_json() for p in plans), *((q.keys if q else "") for q in quants))

    def build(tmp: Path) -> dict:
        notes, executed, dynamic = [], [], []
        pairs = zip(_segment_models(models[0], plans[0], quants[0]), _segment_models(models[1], plans[1], quants[1]))
        for (seg, precision, small, seg_notes), (_, _, large, _) in pairs:
            joined = with_batch_axis(small, large, sizes, f"{models[0].source} segment {seg.index}")
            onnx.save(joined, str(tmp / f"segment{seg.index}.onnx"))
            executed.append(precision)
            dynamic.append(has_batch_axis(joined))
            notes.extend(seg_notes)
        if not all(dynamic):
            notes.append("the model's batch is fixed by its export: the engine runs that batch size only")
        (tmp / "plan.json").write_text(plans[0].to_json())
        return {"executed_precision": executed, "notes": notes, "batch_axis": all(dynamic)}

    entry = cache.get_or_build("onnxruntime", key, build,
                               what=f"{len(plans[0].segments)} segment(s) of {models[0].source}, every batch size")
    return _result(entry, plans[0], key, batch_axis=entry.meta["batch_axis"])


def _result(entry, plan: PartitionPlan, key: str, batch_axis: bool) -> BuildResult:
    segs = tuple(SegmentArtefact(s.index, entry.file(f"segment{s.index}.onnx"), p)
                 for s, p in zip(plan.segments, entry.meta["executed_precision"]))
    return BuildResult(key, segs, tuple(entry.meta.get("notes", ())), entry.hit, batch_axis)


class OnnxRuntimeBackend(Backend):
    """Runs a PartitionPlan on CPU lanes.

    Args:
        plan: the plan.
        build: the built segment models.
        inputs / outputs: the model's input specs and output names.
        spinning: let intra-op threads spin-wait between runs (ONNX Runtime's default). Off, they
            still spin within a run (fast hand-offs between an operator's parts) but stop at its end.
        threads_per_lane: intra-op threads of each session; 0 chooses from the process's CPU affinity
            (:func:`~k2edge.engine.pipeline.lane_layout`: a one-device plan runs one single-threaded worker per
            core on one set of sessions); None gives each device's one worker its share of the cores. A prefetch
            staging thread keeps a core for itself.
    """

    name = "onnxruntime"

    def __init__(self, plan: PartitionPlan, build: BuildResult, inputs: tuple[TensorSpec, ...],
                 outputs: tuple[str, ...], threads_per_lane: int | None = None, prefetch: bool = False,
                 spinning: bool = True) -> None:
        super().__init__(inputs, outputs)
        self.plan = plan
        self.build = build
        self.layout = lane_layout(available_cores(), len(plan.devices), threads_per_lane, prefetch)
        self.threads_per_lane = self.layout.threads
        self.spinning = spinning
        self._sessions: list = []
        self._lanes: LaneSet | None = None

    def activate_impl(self) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads_per_lane
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 4  # fatal only: errors reach the caller as InferenceError, once
        if self.build.batch_axis:
            # The memory pattern plans one block per input shape and the arena keeps each: with a batch axis that is a
            # block per batch size seen. YOLOv8n at 640, batches 1..4 on two workers: 460 -> 308 MiB RSS for 1.04x the
            # CPU a sample (bench/bench_lanes.py --memory; docs/performance.md)
            opts.enable_mem_pattern = False
        opts.add_session_config_entry("session.disable_quant_qdq", "1")  # INT8 as Q/DQ: see calibration.session
        if not self.spinning:
            # Idle intra-op threads spin by default: the lowest latency for one engine, but where many
            # engines and threads share a few cores (the daemon) the spinning eats the cores. Spinning
            # only within a run keeps most of its speed: digits model here, batch 1 / 8: 0.32 / 2.0 ms
            # and 0.63 / 4.0 ms CPU a run, against 0.51 / 2.2 ms and 0.81 / 4.4 ms with no spinning at all
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        self._sessions = [self._session(a, opts) for a in self.build.segments]
        self._segment_outputs = [list(s.outputs) for s in self.plan.segments]
        self._segment_inputs = [list(s.inputs) for s in self.plan.segments]
        self._lanes = LaneSet(self.plan.routing, self._run_segment, self.outputs, self.layout.workers)
        self._lanes.start()

    @staticmethod
    def _session(artefact: SegmentArtefact, opts):
        try:
            return ort.InferenceSession(str(artefact.path), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/NotImplemented types
            raise BuildError(f"onnxruntime cannot load segment {artefact.index} ({artefact.executed_precision}): "
                             f"{first_line(exc)}") from None

    def deactivate_impl(self) -> None:
        if self._lanes is not None:
            self._lanes.stop()
        self._lanes = None
        self._sessions = []

    def _run_segment(self, index: int, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self._segment_outputs[index]
        feeds = {k: tensors[k] for k in self._segment_inputs[index]}
        try:
            return dict(zip(names, self._sessions[index].run(names, feeds)))
        except Exception as exc:
            raise InferenceError(f"segment {index} on {self.plan.segments[index].device} (cpu lane) failed: "
                                 f"{first_line(exc)}") from None

    def infer_impl(self, feeds):
        tensors = dict(feeds)
        record = traced_segments()  # a traced batch: each segment's span (device, lane, precision)
        for seg in self._lanes.route():
            t0 = time.monotonic() if record is not None else 0.0
            tensors.update(self._run_segment(seg, tensors))
            if record is not None:
                record.append((seg, threading.current_thread().name, t0, time.monotonic()))
        return {name: tensors[name] for name in self.outputs}

    def submit_impl(self, feeds, stage, release) -> Future:
        return self._lanes.submit(feeds, stage, release)

    def lanes(self) -> tuple[LaneInfo, ...]:
        out = []
        runs = self._lanes.runs() if self._lanes is not None else {}
        workers = self.layout.workers
        for device in self.plan.devices:
            segs = tuple(s.index for s in self.plan.segments if s.device == device)
            precs = sorted({self.build.segments[i].executed_precision for i in segs})
            share = next((s.request_share for s in self.plan.segments if s.device == device), None)
            for k, done in enumerate(runs.get(device, [0] * workers)):
                label = f"{device} (cpu lane{f' {k + 1}/{workers}' if workers > 1 else ''})"
                out.append(LaneInfo(device, label, segs, "+".join(precs), share, done))
        return tuple(out)

    def describe(self) -> dict:
        return {"backend": self.name, "version": ort.__version__, "threads_per_lane": self.threads_per_lane,
                "lane_workers": self.layout.workers, "lane_layout": self.layout.why, "batch_axis": self.build.batch_axis,
                "engine_bytes": sum(a.path.stat().st_size for a in self.build.segments),
                "lanes": [lane.__dict__ for lane in self.lanes()], "engine_key": self.build.key,
                "notes": list(self.build.notes)}
