"""TensorRT segment engines in the engine cache: keyed, built when missing, verified before loading.

One cache entry per plan segment (``<cache>/tensorrt/<key>/``: ``segment.onnx``, ``calib.cache`` for
DLA INT8, ``engine.plan``, ``inspector.json``, ``placement.json``, and the manifest with every file's
sha256). The key (``trt_spec.engine_key``) covers the segment model, its plan, the builder settings,
the TensorRT version, the L4T release and the GPU, because an engine runs only on the TensorRT
version and device that built it [NVIDIA/TensorRT#2105]. A small record per segment
(``<cache>/tensorrt-targets/``) remembers the target of its last build, so that a rebuild after an
upgrade says what changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path

from ..dla.planner import PartitionPlan
from ..model.extract import extract_submodel
from ..model.ingest import NormalisedModel
from .cache import MANIFEST, CacheEntry, EngineCache, digest
from .quantize import QuantArtefacts
from .trt_build import build_segment_engine, segment_calibration_cache
from .trt_spec import SegmentBuildSpec, TargetFacts, engine_batches, engine_key

log = logging.getLogger(__name__)


def target_facts(trt, cuda, logger) -> TargetFacts:
    """The TensorRT version, L4T release, GPU compute capability, CUDA version and DLA cores here."""
    from .probe import l4t_release

    cuda.init()
    major, minor = cuda.Device(0).compute_capability()
    return TargetFacts(tensorrt=str(trt.__version__), l4t=l4t_release(), compute_capability=f"{major}.{minor}",
                       cuda=".".join(str(v) for v in cuda.get_version()),
                       dla_cores=int(trt.Builder(logger).num_DLA_cores))


class EngineStore:
    """Segment engines through the cache: build when missing or corrupt, verify before loading, rebuild on demand.

    With ``batch_sizes`` (and the same model and INT8 artefacts at a second batch size, ``other``) every segment
    model takes a dynamic batch axis (:func:`~k2edge.model.batch_axis.with_batch_axis`) and is built as the engines
    :func:`~k2edge.engine.trt_spec.engine_batches` says; a unit is ``(segment index, profile batch sizes)``.
    Without, one static engine per segment: the unit ``(index, ())``.
    """

    def __init__(self, trt, logger, cache: EngineCache, model: NormalisedModel, plan: PartitionPlan,
                 specs: tuple[SegmentBuildSpec, ...], quant: QuantArtefacts | None, facts: TargetFacts, batch_size: int,
                 batch_sizes: tuple[int, ...] = (), other: tuple[NormalisedModel, QuantArtefacts | None, tuple[int, int]] | None = None):
        self.trt, self.logger, self.cache = trt, logger, cache
        self.plan, self.specs, self.facts = plan, specs, facts
        self._quant = quant
        self._batch = batch_size
        self.batch_sizes = tuple(batch_sizes) if other is not None else ()
        qdq: dict[Path, object] = {}
        self._models = {}
        self.keys = {}
        self._identity = {}
        self.units: dict[int, tuple[tuple[int, ...], ...]] = {}
        for seg, spec in zip(plan.segments, specs):
            sub = self._segment_model(model, quant, seg, spec, qdq)
            if other is not None:
                from ..model.batch_axis import has_batch_axis, with_batch_axis

                large = self._segment_model(other[0], other[1], seg, spec, qdq)
                sub = with_batch_axis(sub, large, other[2], f"{model.source} segment {seg.index}")
                if not has_batch_axis(sub):
                    self.batch_sizes = ()
            self._models[seg.index] = sub
        for seg, spec in zip(plan.segments, specs):
            # a model-wise plan's GPU engine and DLA engines each have their own artefacts (DLA ties apply to the DLA's)
            seg_quant = quant.for_device(seg.device) if quant else None
            calib_sha = _sha256(seg_quant.trt_calibration_cache.read_bytes()) if seg_quant else ""
            seg_sha = _sha256(self._models[seg.index].SerializeToString(deterministic=True))
            seg_plan = json.dumps(seg.to_dict(), sort_keys=True)
            calib = calib_sha if spec.int8_source == "calibration-cache" else ""
            self.units[seg.index] = engine_batches(spec, self.batch_sizes)
            for sizes in self.units[seg.index]:
                self.keys[(seg.index, sizes)] = engine_key(seg_sha, spec, seg_plan, facts, calib, sizes)
                # the same engine on any target: where the last build of it is recorded (to say why a rebuild happens)
                self._identity[(seg.index, sizes)] = digest("tensorrt-segment", seg_sha, seg_plan, spec.to_json(), calib,
                                                            repr(sizes))

    @staticmethod
    def _segment_model(model: NormalisedModel, quant, seg, spec: SegmentBuildSpec, qdq: dict):
        source = model.model
        if spec.source_model == "qdq":
            import onnx

            path = quant.for_device(seg.device).qdq_model
            if path not in qdq:
                qdq[path] = onnx.load(str(path))
            source = qdq[path]
        return extract_submodel(source, seg.inputs, seg.outputs, f"segment{seg.index}_{seg.device}")

    def entry(self, index: int, sizes: tuple[int, ...] = ()) -> CacheEntry:
        """The verified cache entry of segment ``index``'s engine for the profile batch ``sizes``, built now if missing
        or corrupt."""
        spec = self.specs[index]
        unit = (index, tuple(sizes))

        def build(tmp: Path) -> dict:
            sub = self._models[index]
            (tmp / "segment.onnx").write_bytes(sub.SerializeToString())
            calib = None
            if spec.int8_source == "calibration-cache":
                segment_calibration_cache(self._quant.for_device(spec.device).trt_calibration_cache, sub, tmp / "calib.cache", self.facts.tensorrt)
                calib = (tmp / "calib.cache").read_bytes()
            why = self._changed_target(unit)
            log.log(logging.WARNING if why else logging.INFO, "building TensorRT engine for segment %d (%s, %s%s)%s",
                    index, spec.device, spec.precision_label, f", batch {'/'.join(map(str, sizes))}" if sizes else "", why)
            meta = build_segment_engine(self.trt, self.logger, spec, sub, tmp, calib, self._batch, profile_batches=tuple(sizes))
            return {**meta, "device": spec.device, "precision": spec.precision_label, "target": asdict(self.facts),
                    "profile_batches": list(sizes)}

        entry = self.cache.get_or_build("tensorrt", self.keys[unit], build,
                                        what=f"TensorRT segment {index} ({spec.device}, {spec.precision_label})")
        if not entry.hit:
            record = self._record_path(unit)
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"key": self.keys[unit], "target": asdict(self.facts)}))
        return entry

    def _record_path(self, unit) -> Path:
        return self.cache.root / "tensorrt-targets" / f"{self._identity[unit]}.json"

    def _changed_target(self, unit) -> str:
        """Why an engine that was built before is built again: what changed on this device, if anything."""
        try:
            before = json.loads(self._record_path(unit).read_text())["target"]
        except (OSError, ValueError, KeyError):
            return ""
        now = asdict(self.facts)
        changed = [f"{k} {before.get(k)} -> {now[k]}" for k in ("tensorrt", "l4t", "compute_capability", "cuda")
                   if before.get(k) != now[k]]
        if not changed:
            return ""
        return (f": the cached engine was built for another target ({', '.join(changed)}); TensorRT engines run only on "
                f"the TensorRT version and device that built them")

    def read_engine(self, index: int, sizes: tuple[int, ...] = ()) -> bytes:
        """The engine's bytes, checked against the manifest's sha256 first; a mismatch is rebuilt."""
        entry = self.entry(index, sizes)
        data = (entry.path / "engine.plan").read_bytes()
        expected = json.loads((entry.path / MANIFEST).read_text())["files"].get("engine.plan")
        if _sha256(data) != expected:
            log.warning("segment %d: engine.plan in %s changed since it was built (checksum mismatch); rebuilding",
                        index, entry.path)
            entry = self.rebuild(index, sizes)
            data = (entry.path / "engine.plan").read_bytes()
        return data

    def rebuild(self, index: int, sizes: tuple[int, ...] = ()) -> CacheEntry:
        shutil.rmtree(self.cache.entry_dir("tensorrt", self.keys[(index, tuple(sizes))]), ignore_errors=True)
        return self.entry(index, sizes)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
