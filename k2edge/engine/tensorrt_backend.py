"""The TensorRT backend for Jetson Orin: one engine per plan segment on the GPU or a DLA core.

It applies a :class:`PartitionPlan` and decides nothing: ``trt_spec`` turns each segment into
builder settings, ``trt_build`` applies them to TensorRT's builder and compares the engine
inspector's placement with the plan, ``trt_runtime`` runs the engines on CUDA streams with the DMA
prefetch ring. Engines live in the engine cache, one entry per segment, keyed by the segment model,
its plan, the builder settings, the TensorRT version, the L4T release and the GPU (``trt_store``);
every engine file is checksummed before it is deserialised, and an engine that TensorRT refuses
("version tag does not match" after a JetPack upgrade) is rebuilt with a log line saying why.

Written against the TensorRT 10.x Python API as JetPack 6 ships it (DLA support ends with 10.7 there)
and pycuda. Neither is imported before a backend is created.
"""

from __future__ import annotations

import importlib
import logging
import os
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..dla.planner import PartitionPlan
from ..errors import BackendUnavailable, BuildError
from ..model.ingest import NormalisedModel
from ..profile import Profile
from .base import Backend, LaneInfo, TensorSpec
from .cache import EngineCache, digest
from .quantize import QuantArtefacts
from .trt_cuda import primary_context, process_logger, pushed
from .trt_runtime import BoundTensor, LoadedSegment, StreamPipeline
from .trt_spec import (DLA_LOADABLES_PER_CORE, SegmentBuildSpec, TargetFacts, dla_loadables, segment_specs,
                       tensor_nbytes)
from .trt_store import EngineStore, target_facts

log = logging.getLogger(__name__)

INSTALL_HINT = ("on a Jetson, JetPack's python3-libnvinfer in a venv made with --system-site-packages, "
                "and pip install 'k2edge[jetson]' (pycuda)")
ZERO_COPY_ENV = "K2EDGE_TRT_ZERO_COPY"


def _modules():
    """(tensorrt, pycuda.driver), imported now (never at module import)."""
    try:
        return importlib.import_module("tensorrt"), importlib.import_module("pycuda.driver")
    except ImportError as exc:
        raise BackendUnavailable(f"the tensorrt backend needs tensorrt and pycuda ({exc}): {INSTALL_HINT}") from None


@dataclass(frozen=True)
class SegmentEngine:
    """One built segment engine in the cache."""

    index: int
    device: str
    precision: str
    key: str
    path: Path
    placement: dict
    profile_batches: tuple[int, ...] = ()  # one optimization profile per batch size; empty: static shapes


@dataclass(frozen=True)
class TensorRTBuild:
    key: str
    segments: tuple[SegmentEngine, ...]
    notes: tuple[str, ...]
    cached: bool


def create_backend(normalised: NormalisedModel, plan: PartitionPlan, quant: QuantArtefacts | None, cache: EngineCache,
                   profile: Profile, inputs: tuple[TensorSpec, ...], outputs: tuple[str, ...],
                   zero_copy: bool | None = None, batch_sizes: tuple[int, ...] = (),
                   other: tuple[NormalisedModel, QuantArtefacts | None, tuple[int, int]] | None = None) -> "TensorRTBackend":
    """Build (or fetch from the cache) one TensorRT engine per plan segment, or with ``batch_sizes`` the engines that
    run every one of them (:func:`~k2edge.engine.trt_spec.engine_batches`: a GPU segment's one engine with a profile
    per batch size, a DLA segment's engine per batch size).

    Args:
        zero_copy: mapped page-locked inputs instead of copies (Jetson unified memory); default from
            ``$K2EDGE_TRT_ZERO_COPY``.
        batch_sizes / other: the batch sizes to run, and the same model, INT8 artefacts at a second batch size with
            the two sizes (what :func:`~k2edge.model.batch_axis.with_batch_axis` joins into one batch axis).

    Raises:
        BuildError: FP32 on a DLA, a DLA core this device lacks, or a TensorRT build failure.
        BackendUnavailable: tensorrt or pycuda is missing.
    """
    specs = segment_specs(plan, normalised.graph, quant is not None)  # pure checks first
    trt, cuda = _modules()
    logger = process_logger(trt)
    facts = target_facts(trt, cuda, logger)
    need = max((s.dla_core + 1 for s in specs if s.is_dla), default=0)
    if need > facts.dla_cores:
        raise BuildError(f"the plan uses dla{need - 1} but TensorRT reports {facts.dla_cores} DLA core(s) on this device; "
                         f"plan for this board (--board) or set edge_runtime.dla_cores")
    store = EngineStore(trt, logger, cache, normalised, plan, specs, quant, facts, profile.edge_runtime.batch_size,
                        batch_sizes, other)
    loadables = dla_loadables(specs, store.batch_sizes)
    full = {core: n for core, n in loadables.items() if n > DLA_LOADABLES_PER_CORE}
    if full:
        core, n = next(iter(full.items()))
        raise BuildError(f"dla{core} would hold {n} engines (one per DLA segment and batch size), more than the "
                         f"{DLA_LOADABLES_PER_CORE} loadables a DLA core holds; lower service.max_batch or plan fewer DLA segments")
    units = [(s, sizes) for s in specs for sizes in store.units[s.index]]
    entries = [store.entry(s.index, sizes) for s, sizes in units]
    notes = []
    for entry in entries:
        notes += entry.meta.get("notes", [])
    if store.batch_sizes:
        notes += [f"dla{core}: {n} static engine(s), one per DLA segment and batch size ({'/'.join(map(str, store.batch_sizes))}): "
                  f"the DLA takes static shapes only and its loadables hold their own weights" for core, n in loadables.items()]
    segments = tuple(SegmentEngine(s.index, s.device, s.precision_label, e.key, e.path, e.meta.get("placement", {}), sizes)
                     for (s, sizes), e in zip(units, entries))
    build = TensorRTBuild(digest(*(e.key for e in entries)), segments, tuple(notes), all(e.hit for e in entries))
    er = profile.edge_runtime
    if store.batch_sizes:
        largest = max(store.batch_sizes)
        inputs = tuple(TensorSpec(i.name, (largest, *i.shape[1:]), i.dtype, store.batch_sizes) for i in inputs)
    if zero_copy is None:
        zero_copy = os.environ.get(ZERO_COPY_ENV, "") not in ("", "0", "false")
    return TensorRTBackend(plan, build, store, inputs, outputs, prefetch=er.dma_prefetch, depth=er.prefetch_depth,
                           zero_copy=zero_copy)


class TensorRTBackend(Backend):
    """Runs a PartitionPlan's segment engines on the GPU and DLA cores (see the module docstring)."""

    name = "tensorrt"

    def __init__(self, plan: PartitionPlan, build: TensorRTBuild, store: EngineStore, inputs: tuple[TensorSpec, ...],
                 outputs: tuple[str, ...], prefetch: bool = True, depth: int = 2, zero_copy: bool = False) -> None:
        super().__init__(inputs, outputs)
        self.plan, self.build, self.store = plan, build, store
        self.prefetch, self.depth, self.zero_copy = prefetch, depth, zero_copy
        self._pipeline: StreamPipeline | None = None
        self._runtimes: dict = {}
        self._device_bytes = 0

    @property
    def facts(self) -> TargetFacts:
        return self.store.facts

    def activate_impl(self) -> None:
        trt, cuda = _modules()
        # The primary context is the one TensorRT's runtime API uses: pycuda buffers and streams share it.
        # Held once per process (trt_cuda): deactivating from another thread must not leak a retain.
        ctx = primary_context(cuda)
        try:
            with pushed(cuda, ctx):
                self._runtimes = {}
                self._device_bytes = 0
                loaded = [self._load_segment(trt, spec) for spec in self.store.specs]
                tensors = _bound_tensors(trt, loaded)
            slots = max(2, len(self.plan.devices) + 1)  # enough to keep every device and the copy engine busy
            self._pipeline = StreamPipeline(cuda, ctx, loaded, self.plan.routing, tensors, tuple(s.name for s in self.inputs),
                                            self.outputs, depth=self.depth, slots=slots, prefetch=self.prefetch,
                                            zero_copy=self.zero_copy).start()
        except BaseException:
            self._runtimes = {}
            raise

    def _load_segment(self, trt, spec: SegmentBuildSpec) -> LoadedSegment:
        """The segment's engines: one static, or per :func:`engine_batches` the contexts of every batch size."""
        seg = self.plan.segments[spec.index]
        by_batch = {}
        for sizes in self.store.units[spec.index]:
            engine = self._load(trt, spec, sizes)
            for k, b in enumerate(sizes):  # one execution context per optimization profile
                by_batch[b] = (engine, engine.create_execution_context(), k)
        if by_batch:
            engine, context, _ = by_batch[max(by_batch)]
        else:
            context = engine.create_execution_context()
        self._device_bytes += sum(_context_bytes(e) for e, _, _ in by_batch.values()) if by_batch else _context_bytes(engine)
        return LoadedSegment(spec.index, spec.device, engine, context, seg.inputs, seg.outputs, by_batch)

    def _load(self, trt, spec: SegmentBuildSpec, sizes: tuple[int, ...] = ()):
        logger = self.store.logger
        runtime = self._runtimes.get(spec.device)
        if runtime is None:
            runtime = self._runtimes[spec.device] = trt.Runtime(logger)
            if spec.is_dla:
                runtime.DLA_core = spec.dla_core
        logger.take_errors()
        data = self.store.read_engine(spec.index, sizes)
        engine = runtime.deserialize_cuda_engine(data)
        if engine is None:
            errors = logger.take_errors()
            why = next((e for e in errors if "version tag" in e.lower()), errors[-1] if errors else "deserialisation failed")
            log.warning("segment %d (%s): the cached engine does not load with TensorRT %s here (%s); rebuilding it "
                        "(cached engines must be rebuilt after a TensorRT or JetPack upgrade)",
                        spec.index, spec.device, self.facts.tensorrt, why.strip())
            self.store.rebuild(spec.index, sizes)
            data = self.store.read_engine(spec.index, sizes)
            engine = runtime.deserialize_cuda_engine(data)
            if engine is None:
                raise BuildError(f"TensorRT cannot load the engine it just built for segment {spec.index}: "
                                 f"{'; '.join(logger.take_errors()) or 'deserialisation failed'}")
        self._device_bytes += len(data)  # the serialized engine: its weights, as close as the engine tells them
        return engine

    def deactivate_impl(self) -> None:
        if self._pipeline is not None:
            self._pipeline.stop()
        self._pipeline = None
        self._runtimes = {}

    def infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._pipeline.submit(feeds).result()

    def submit_impl(self, feeds, stage, release) -> Future:
        if feeds is None:
            feeds = self.validate(stage())
        return self._pipeline.submit(feeds, release)

    def lanes(self) -> tuple[LaneInfo, ...]:
        out = []
        for device in self.plan.devices:
            segs = tuple(s.index for s in self.plan.segments if s.device == device)
            precs = sorted({self.build.segments[i].precision for i in segs})
            share = next((s.request_share for s in self.plan.segments if s.device == device), None)
            label = device if device == "gpu" else f"{device} (DLA core {device[3:]})"
            out.append(LaneInfo(device, label, segs, "+".join(precs), share))
        return tuple(out)

    def describe(self) -> dict:
        return {"backend": self.name, "version": self.facts.tensorrt, "target": asdict(self.facts),
                "lanes": [lane.__dict__ for lane in self.lanes()], "engine_key": self.build.key,
                "segments": [{"index": s.index, "device": s.device, "precision": s.precision, "engine": str(s.path),
                              "placement": s.placement, "profile_batches": list(s.profile_batches)}
                             for s in self.build.segments],
                "batch_sizes": list(self.store.batch_sizes),
                "engine_bytes": sum((s.path / "engine.plan").stat().st_size for s in self.build.segments
                                    if (s.path / "engine.plan").exists()),
                "device_memory_bytes": self._device_bytes or None,
                "prefetch": {"dma_prefetch": self.prefetch, "depth": self.depth,
                             "mode": "zero-copy" if self.zero_copy else "copy"},
                "notes": list(self.build.notes)}


def _context_bytes(engine) -> int:
    """Device memory one execution context of ``engine`` allocates (TensorRT's accounting: the largest profile's)."""
    return int(getattr(engine, "device_memory_size_v2", 0) or 0)


def _bound_tensors(trt, loaded: list[LoadedSegment]) -> dict[str, BoundTensor]:
    """Shape, dtype and buffer size of every I/O tensor, sized for the largest format any engine uses (and the largest
    batch, where the engines take several)."""
    out: dict[str, BoundTensor] = {}
    for seg in loaded:
        e = seg.engine
        for i in range(e.num_io_tensors):
            name = e.get_tensor_name(i)
            shape = tuple(int(d) for d in e.get_tensor_shape(name))
            if seg.by_batch and shape and shape[0] < 0:
                shape = (max(seg.by_batch), *shape[1:])
            if any(d < 0 for d in shape):
                raise BuildError(f"segment {seg.index}: tensor {name!r} has dynamic dimensions {shape} beyond the batch")
            dtype = np.dtype(trt.nptype(e.get_tensor_dtype(name)))
            vdim = int(e.get_tensor_vectorized_dim(name))  # -1 unless the format is vectorised (kCHW16 ...)
            per_component = int(e.get_tensor_bytes_per_component(name)) if vdim >= 0 else dtype.itemsize
            nbytes = tensor_nbytes(shape, per_component, vdim, int(e.get_tensor_components_per_element(name)))
            known = out.get(name)
            if known is not None:  # a cut tensor: the producer's and consumers' formats agree by construction
                dtype, nbytes = known.dtype, max(nbytes, known.nbytes)
            out[name] = BoundTensor(name, shape, dtype, nbytes)
    return out

