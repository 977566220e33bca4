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
import os
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
from .pipeline import LaneSet
from .quantize import QuantArtefacts, to_fp16

log = logging.getLogger(__name__)
ort = LazyModule("onnxruntime", "pip install onnxruntime")

BACKEND_VERSION = "1"


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


def _executed_precision(layer_precision: dict[str, str]) -> str:
    used = set(layer_precision.values())
    if "int8" in used:
        return "int8"
    if "fp16" in used:
        return "fp16"
    return "fp32"


def build_segments(model: NormalisedModel, plan: PartitionPlan, quant: QuantArtefacts | None,
                   cache: EngineCache) -> BuildResult:
    """Extract (and convert) one sub-model per segment, through the engine cache."""
    key = digest("onnxruntime", BACKEND_VERSION, ort.__version__, model.sha256, plan.to_json(),
                 quant.keys if quant else "")

    def build(tmp: Path) -> dict:
        qdq_models: dict[Path, onnx.ModelProto] = {}  # a model-wise plan's GPU and DLA engines have their own

        def qdq_for(device: str) -> onnx.ModelProto:
            path = quant.for_device(device).qdq_model
            if path not in qdq_models:
                qdq_models[path] = onnx.load(str(path))
            return qdq_models[path]

        notes = []
        executed = []
        for seg in plan.segments:
            precision = _executed_precision(seg.layer_precision)
            name = f"segment{seg.index}_{seg.device}"
            if precision == "int8":
                sub = extract_submodel(qdq_for(seg.device), seg.inputs, seg.outputs, name)
                fp16_layers = [n for n, p in seg.layer_precision.items() if p == "fp16"]
                if fp16_layers:
                    notes.append(f"segment {seg.index}: {len(fp16_layers)} FP16 layer(s) of an INT8 segment compute in FP32 on the cpu lane "
                                 f"(the outputs of layers the INT8 check moved are rounded to FP16)")
            else:
                sub = extract_submodel(model.model, seg.inputs, seg.outputs, name)
                if precision == "fp16":
                    keep32 = [n for n, p in seg.layer_precision.items() if p == "fp32"]
                    from onnxruntime.transformers.float16 import convert_float_to_float16

                    sub = convert_float_to_float16(sub, keep_io_types=True, node_block_list=keep32) if keep32 else to_fp16(sub)
            onnx.save(sub, str(tmp / f"segment{seg.index}.onnx"))
            executed.append(precision)
        (tmp / "plan.json").write_text(plan.to_json())
        return {"executed_precision": executed, "notes": notes}

    entry = cache.get_or_build("onnxruntime", key, build, what=f"{len(plan.segments)} segment(s) of {model.source}")
    segs = tuple(SegmentArtefact(s.index, entry.file(f"segment{s.index}.onnx"), p)
                 for s, p in zip(plan.segments, entry.meta["executed_precision"]))
    return BuildResult(key, segs, tuple(entry.meta.get("notes", ())), entry.hit)


class OnnxRuntimeBackend(Backend):
    """Runs a PartitionPlan on CPU lanes.

    Args:
        plan: the plan.
        build: the built segment models.
        inputs / outputs: the model's input specs and output names.
        spinning: let intra-op threads spin-wait between runs (ONNX Runtime's default). Off, they
            still spin within a run (fast hand-offs between an operator's parts) but stop at its end.
        threads_per_lane: intra-op threads of each session. Default: the cores left after one for the
            prefetch staging thread (when ``prefetch``), shared between the lanes, at least 1. On a
            Jetson the GPU and DLAs leave the CPU to staging; CPU lanes must leave it a core.
    """

    name = "onnxruntime"

    def __init__(self, plan: PartitionPlan, build: BuildResult, inputs: tuple[TensorSpec, ...],
                 outputs: tuple[str, ...], threads_per_lane: int | None = None, prefetch: bool = False,
                 spinning: bool = True) -> None:
        super().__init__(inputs, outputs)
        self.plan = plan
        self.build = build
        cores = max(1, (os.cpu_count() or 1) - (1 if prefetch else 0))
        self.threads_per_lane = threads_per_lane or max(1, cores // len(plan.devices))
        self.spinning = spinning
        self._sessions: list = []
        self._lanes: LaneSet | None = None

    def activate_impl(self) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads_per_lane
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 4  # fatal only: errors reach the caller as InferenceError, once
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
        self._lanes = LaneSet(self.plan.routing, self._run_segment, self.outputs)
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
        for seg in self._lanes.route():
            tensors.update(self._run_segment(seg, tensors))
        return {name: tensors[name] for name in self.outputs}

    def submit_impl(self, feeds, stage, release) -> Future:
        return self._lanes.submit(feeds, stage, release)

    def lanes(self) -> tuple[LaneInfo, ...]:
        out = []
        runs = self._lanes.runs() if self._lanes is not None else {}
        for device in self.plan.devices:
            segs = tuple(s.index for s in self.plan.segments if s.device == device)
            precs = sorted({self.build.segments[i].executed_precision for i in segs})
            share = next((s.request_share for s in self.plan.segments if s.device == device), None)
            out.append(LaneInfo(device, f"{device} (cpu lane)", segs, "+".join(precs), share, runs.get(device, 0)))
        return tuple(out)

    def describe(self) -> dict:
        return {"backend": self.name, "version": ort.__version__, "threads_per_lane": self.threads_per_lane,
                "lanes": [lane.__dict__ for lane in self.lanes()], "engine_key": self.build.key,
                "notes": list(self.build.notes)}
