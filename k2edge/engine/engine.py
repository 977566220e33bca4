"""The public Engine: build through the cache, then infer, submit or stream.

    from k2edge import Engine, load_profile
    profile = load_profile("profiles/c3.json")
    with Engine.build("model.onnx", profile, calib="calib/") as engine:
        outputs = engine.infer({"input": batch})
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import numpy as np
import onnx

from ..config.card import ModelCard
from ..config.resolve import card_file, find_calibration, load_labels, model_card
from ..config.resolve import input_shapes as resolve_input_shapes
from ..dla.planner import PartitionPlan, plan_partition
from ..errors import BuildError, InputError
from ..model.datasets import Dataset
from ..model.ingest import NORMALISER_VERSION, NormalisedModel, load_onnx, normalise
from ..profile import Profile, load_profile
from ..tasks import Geometry, Preprocess, TaskDecoder
from .base import Backend, LaneInfo, TensorSpec
from .cache import EngineCache, digest
from .calibration import batched
from .prefetch import PrefetchRing

if TYPE_CHECKING:
    from .check import Int8Check

log = logging.getLogger(__name__)

BATCH_AXIS_SIZES = (2, 3)
"""The two batch sizes a model is normalised at to find what follows its batch (neither is 1: a batch of 1
would pass for any constant 1 in the graph)."""


@dataclass(frozen=True)
class BuildInfo:
    """How an engine came to be, for reports."""

    cache_hits: dict[str, bool]
    seconds: float
    calibration: str | None
    notes: tuple[str, ...] = ()
    int8_check: "Int8Check | None" = None  # the INT8 accuracy check (None: no layer runs INT8)


@dataclass
class StreamResult:
    """One request of :meth:`Engine.stream`: its items, outputs (or error) and timing."""

    items: list
    outputs: dict[str, np.ndarray] | None
    error: BaseException | None = None
    latency_ms: float = 0.0
    geometries: list = field(default_factory=list)  # per item: where its image landed (tasks.Geometry)
    extra: dict = field(default_factory=dict)


def load_normalised(source, cache: EngineCache, batch_size: int, input_shapes: dict | None,
                    where: str | None = None) -> NormalisedModel:
    """Normalise ``source`` through the cache (keyed by the file's bytes and the shape settings);
    ``where`` names it in messages (default: its path)."""
    model, loaded_from = load_onnx(source)
    where = where or loaded_from
    raw = model.SerializeToString(deterministic=True)
    shapes = sorted((k, tuple(v)) for k, v in (input_shapes or {}).items())
    key = digest("normalised", NORMALISER_VERSION, onnx.__version__, raw, str(batch_size), repr(shapes))

    def build(tmp: Path) -> dict:
        nm = normalise(model, batch_size=batch_size, input_shapes=input_shapes, where=where)
        (tmp / "model.onnx").write_bytes(nm.serialized)
        return {"original_opset": nm.original_opset}

    entry = cache.get_or_build("normalised", key, build, what=f"normalised {where}")
    loaded = onnx.load(str(entry.file("model.onnx")))
    # the input shapes without their batch dimension: what INT8 calibration is shared across
    spatial = sorted((k, tuple(v)[1:]) for k, v in (input_shapes or {}).items())
    batch_free = digest("model", NORMALISER_VERSION, onnx.__version__, raw, repr(spatial))
    return NormalisedModel(model=loaded, source=where, original_opset=entry.meta["original_opset"], batch_free_key=batch_free)


@dataclass(frozen=True)
class LoadedModel:
    """A model normalised at the shapes its card resolves: what every command that takes a MODEL starts from."""

    path: Path | None          # the ONNX file (None for a ModelProto)
    card: ModelCard | None     # the card file's card (``--card``, else the one beside the model), before layering
    normalised: NormalisedModel


def load_model(model: str | os.PathLike | onnx.ModelProto, cache: EngineCache, batch_size: int,
               input_shapes: dict[str, tuple[int, ...]] | None = None, card: str | os.PathLike | ModelCard | None = None,
               card_overrides: ModelCard | dict | None = None) -> LoadedModel:
    """Load ``model``, resolve its input shapes (``input_shapes``, else its card's size, else its metadata's:
    :func:`k2edge.config.resolve.input_shapes`) and normalise it through the cache.

    Raises:
        ModelError: the file is not an ONNX model, or an input stays dynamic with no size known.
        CardError: the card is malformed or contradicts the model.
    """
    path = None if isinstance(model, onnx.ModelProto) else Path(model)
    the_card = card_file(path, card)
    proto, where = load_onnx(model)
    shapes = resolve_input_shapes(proto, the_card, batch_size, input_shapes, card_overrides)
    return LoadedModel(path, the_card, load_normalised(proto, cache, batch_size, shapes, where=where))


class Engine:
    """A built model: plan, backend, preprocessing and labels. Use :meth:`build`."""

    def __init__(self, backend: Backend, plan: PartitionPlan, model: NormalisedModel, profile: Profile,
                 card: ModelCard, labels: tuple[str, ...], info: BuildInfo) -> None:
        self.backend = backend
        self.plan = plan
        self.model = model
        self.profile = profile
        self.card = card
        self.preprocess = Preprocess.from_card(card)
        self.labels = labels
        self.info = info
        graph = model.graph
        self.decoder = TaskDecoder(card, labels, {o: graph.shape(o) for o in backend.outputs})
        spec = backend.inputs[0]
        self.input_name = spec.name
        self.input_shape = spec.shape

    # construction ----------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        model: str | os.PathLike | onnx.ModelProto,
        profile: Profile | str | os.PathLike | dict,
        calib: str | os.PathLike | Dataset | None = None,
        *,
        precision: str | None = None,
        board: str | None = None,
        backend: str = "auto",
        cache_dir: str | os.PathLike | None = None,
        input_shapes: dict[str, tuple[int, ...]] | None = None,
        labels: str | os.PathLike | None = None,
        threads_per_lane: int | None = None,
        spinning: bool = True,
        card: str | os.PathLike | ModelCard | None = None,
        card_overrides: ModelCard | dict | None = None,
        check: str | os.PathLike | Dataset | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        max_batch: int | None = None,
    ) -> "Engine":
        """Normalise, plan, calibrate and build ``model`` under ``profile``; every step is cached.

        The steps, each its own function: :func:`load_model` (the input shapes its card resolves, then
        normalisation), :func:`~k2edge.dla.planner.plan_partition`, the card, preprocessing and labels
        (:func:`k2edge.config.resolve.model_card`), the INT8 decision (calibration, check, fallback),
        then the backend's build.

        Args:
            model: an ONNX file or ModelProto.
            profile: a Profile, a profile path or name (``c3``), or a dict.
            calib: calibration set (ImageFolder directory or ``.npz``) for INT8 layers; when None,
                a ``calib/`` or ``calib.npz`` beside the model is used if present.
            precision: replace the profile's precision chain (``"fp32"`` = reference mode).
            board: ``orin-agx`` (default), ``orin-nx-16``, ``orin-nx-8`` or ``orin-nano``.
            backend: ``auto`` (TensorRT where it exists, else ONNX Runtime), ``onnxruntime`` or ``tensorrt``.
            cache_dir: engine cache directory (default ``~/.cache/k2edge``).
            threads_per_lane / spinning: ONNX Runtime lanes' intra-op threads and whether they spin
                between runs (lowest latency for one engine; off where many engines share the cores:
                they then spin only within a run).
            card: the model card (a file or a :class:`ModelCard`); default the ``<stem>.card.toml``
                or ``card.toml`` beside the model, if any.
            card_overrides: card keys that override the card (the daemon config's card table).
            check: a set to run the INT8 accuracy check on instead of the held-out calibration samples.
            progress: called as ``progress(what, done, total)`` during long steps (calibration, fallback).
            max_batch: build one engine that runs every batch size up to ``max_batch`` (a dynamic batch axis,
                see :func:`k2edge.model.batch_axis.with_batch_axis`) instead of one at the profile's ``batch_size``:
                on ONNX Runtime any size from 1, on TensorRT those of
                :func:`~k2edge.model.batch_axis.profile_batch_sizes` (GPU segments: one engine, a profile per
                size; DLA segments: a static engine per size). A model exported with a fixed batch keeps it.

        Raises:
            K2EdgeError: any input problem, with one message naming it.
        """
        from .backends import resolve_backend

        started = time.perf_counter()
        backend = resolve_backend(backend)
        profile = _checked_profile(profile, precision)
        cache = EngineCache(cache_dir)
        if max_batch is not None:
            return cls._build_batch_axis(model, profile, calib, precision, board, backend, cache, input_shapes, labels,
                                         threads_per_lane, spinning, card, card_overrides, check, progress, max_batch,
                                         started)
        loaded = load_model(model, cache, profile.edge_runtime.batch_size, input_shapes, card, card_overrides)
        plan = plan_partition(loaded.normalised, profile, board, precision)
        task = _resolve_task(loaded, card_overrides, labels)
        hits: dict[str, bool] = {}
        quant, plan, int8_check, dataset, _ = cls._int8_step(
            loaded.normalised, plan, calib, check, loaded.path, profile, task.labels, task.card, task.preprocess, cache,
            profile.edge_runtime, progress, precision, hits)
        runner = _backend_step(backend, loaded.normalised, plan, quant, cache, profile, threads_per_lane, spinning)
        hits["engine"] = runner.build.cached
        info = BuildInfo(hits, time.perf_counter() - started, dataset.source if dataset is not None else None,
                         tuple(runner.build.notes), int8_check)
        return cls(runner, plan, loaded.normalised, profile, task.card, task.labels, info)

    @classmethod
    def _build_batch_axis(cls, model, profile: Profile, calib, precision, board, backend: str, cache: EngineCache,
                          input_shapes, labels, threads_per_lane, spinning, card, card_overrides, check, progress,
                          max_batch: int, started: float) -> "Engine":
        """:meth:`build` for every batch size up to ``max_batch``: the pipeline runs at two batch sizes
        (:data:`BATCH_AXIS_SIZES`), and the backend builds one engine from the pair."""
        hits: dict[str, bool] = {}
        built = []
        for b in BATCH_AXIS_SIZES:
            shapes = {k: (b, *tuple(v)[1:]) for k, v in input_shapes.items()} if input_shapes else None
            loaded = load_model(model, cache, b, shapes, card, card_overrides)
            plan = plan_partition(loaded.normalised, profile, board, precision)
            task = _resolve_task(loaded, card_overrides, labels)
            step = cls._int8_step(loaded.normalised, plan, calib, check, loaded.path, profile, task.labels, task.card,
                                  task.preprocess, cache, profile.edge_runtime, progress, precision, hits)
            built.append((loaded, task, step))
            # the next batch size takes the sets as opened (found beside the model, read and logged once)
            calib, check = step[3] if step[3] is not None else calib, step[4] if step[4] is not None else check
        (small, task, (quant, plan, int8_check, dataset, _)), (large, _, (quant2, plan2, _, _, _)) = built
        calib_source = dataset.source if dataset is not None else None
        if _placement(plan) != _placement(plan2):
            raise BuildError(f"{small.normalised.source}: the plan differs between batch sizes "
                             f"{BATCH_AXIS_SIZES[0]} and {BATCH_AXIS_SIZES[1]}; build one engine per batch size")
        graph = small.normalised.graph
        name = graph.inputs[0]
        shape = graph.shape(name)
        if backend == "tensorrt":
            from ..model.batch_axis import profile_batch_sizes
            from .tensorrt_backend import create_backend

            trt = create_backend(small.normalised, plan, quant, cache, profile,
                                 (TensorSpec(name, shape, graph.tensors[name].dtype),), graph.outputs,
                                 batch_sizes=profile_batch_sizes(max_batch),
                                 other=(large.normalised, quant2, BATCH_AXIS_SIZES))
            hits["engine"] = trt.build.cached
            info = BuildInfo(hits, time.perf_counter() - started, calib_source, tuple(trt.build.notes), int8_check)
            return cls(trt, plan, small.normalised, profile, task.card, task.labels, info)
        from .onnxruntime_backend import OnnxRuntimeBackend, build_batch_axis_segments

        runner_build = build_batch_axis_segments((small.normalised, large.normalised), (plan, plan2), (quant, quant2),
                                                 BATCH_AXIS_SIZES, cache)
        dynamic = runner_build.batch_axis
        spec = TensorSpec(name, (max_batch, *shape[1:]) if dynamic else shape, graph.tensors[name].dtype,
                          tuple(range(1, max_batch + 1)) if dynamic else ())
        runner = OnnxRuntimeBackend(plan, runner_build, (spec,), graph.outputs, threads_per_lane,
                                    prefetch=profile.edge_runtime.dma_prefetch, spinning=spinning)
        hits["engine"] = runner_build.cached
        info = BuildInfo(hits, time.perf_counter() - started, calib_source, tuple(runner_build.notes), int8_check)
        return cls(runner, plan, small.normalised, profile, task.card, task.labels, info)

    @staticmethod
    def _int8_step(normalised: NormalisedModel, plan: PartitionPlan, calib, check, model_path: Path | None,
                   profile: Profile, label_names: tuple[str, ...], resolved: ModelCard, preprocess: Preprocess,
                   cache: EngineCache, er, progress, precision: str | None, hits: dict):
        """Calibrate and check the plan's INT8 layers (falling back where the chain allows); records the
        cache hit in ``hits``. Returns ``(quant, plan, int8_check, calibration set, check set)``, all None but
        the plan when no layer runs INT8 (the sets as opened: a second plan of the same build takes them)."""
        quant = None
        int8_check = None
        dataset = checking = None
        if plan.runs_int8:
            if calib is None:
                calib = find_calibration(model_path)
                if calib is not None:
                    log.info("using the calibration set beside the model: %s", calib)
            if calib is None:
                raise BuildError(
                    f"profile {profile.name or ''} runs layers in INT8 and needs a calibration set: "
                    f"pass --calib DIR|FILE.npz (an ImageFolder directory or an .npz with 'x')"
                )
            from ..model.datasets import check_fits, open_calibration

            sample_shape = normalised.graph.shape(normalised.graph.inputs[0])[1:]
            dataset = calib if isinstance(calib, Dataset) else open_calibration(calib, label_names)
            check_fits(dataset, sample_shape, "calibration set")
            if check is not None:
                checking = check if isinstance(check, Dataset) else open_calibration(check, label_names, "check set")
                check_fits(checking, sample_shape, "check set")
            from ..tasks import TaskDecoder
            from .int8 import decide_int8

            decoder = TaskDecoder(resolved, label_names, {o: normalised.graph.shape(o) for o in normalised.graph.outputs})
            decision = decide_int8(normalised, plan, dataset, preprocess, resolved, cache, er, decoder, checking, progress)
            quant, plan, int8_check = decision.quant, decision.plan, decision.check
            hits["int8"] = decision.cached
            _report_check(int8_check, precision)
        return quant, plan, int8_check, dataset, checking

    # lifecycle -------------------------------------------------------------------------------
    def activate(self) -> "Engine":
        self.backend.activate()
        return self

    def deactivate(self) -> None:
        self.backend.deactivate()

    @property
    def active(self) -> bool:
        return self.backend.active

    def __enter__(self) -> "Engine":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    # inference -------------------------------------------------------------------------------
    @property
    def output_names(self) -> tuple[str, ...]:
        return self.backend.outputs

    @property
    def batch_size(self) -> int:
        return self.input_shape[0]

    def lanes(self) -> tuple[LaneInfo, ...]:
        return self.backend.lanes()

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch synchronously. Returns output name -> array.

        Raises:
            InputError: wrong input names, shape or dtype.
            EngineStateError: the engine is not active.
        """
        return self.backend.infer(feeds)

    def submit(self, feeds: dict[str, np.ndarray]) -> Future:
        """Queue one batch on the lanes; the future resolves to the outputs dict."""
        return self.backend.submit(feeds)

    def stage(self, items: Sequence, out: np.ndarray | None = None) -> np.ndarray:
        """Stage up to ``batch_size`` items (images, paths, bytes or sample tensors) into one input batch.

        A short last batch is padded by repeating its last item.
        """
        return self.stage_mapped(items, out)[0]

    def stage_mapped(self, items: Sequence, out: np.ndarray | None = None) -> tuple[np.ndarray, list[Geometry | None]]:
        """:meth:`stage`, also returning where each item's image landed in the input (one per item)."""
        if not items:
            raise InputError("nothing to stage")
        if len(items) > self.batch_size:
            raise InputError(f"{len(items)} items do not fit a batch of {self.batch_size}")
        if out is None:
            out = np.empty(self.input_shape, dtype=np.float32)
        geometries = []
        for i, item in enumerate(items):
            geometries.append(self.preprocess.stage_mapped(item, out=out[i])[1])
        for i in range(len(items), self.batch_size):
            out[i] = out[len(items) - 1]
        return out, geometries

    def stream(self, items: Iterable, *, prefetch: bool | None = None, depth: int | None = None,
               max_in_flight: int | None = None) -> Iterator[StreamResult]:
        """Run many inputs through the lanes, results in input order.

        With prefetch (default: the profile's ``dma_prefetch``) a staging thread fills a ring of
        ``prefetch_depth`` buffers ahead of the engine; without it each request is staged inline
        on the first lane, right before its first segment runs.
        """
        er = self.profile.edge_runtime
        prefetch = er.dma_prefetch if prefetch is None else prefetch
        depth = depth or er.prefetch_depth
        in_flight_cap = max_in_flight or max(2, len(self.plan.devices) + depth)
        groups = batched(items, self.batch_size)
        pending: list[tuple[list, Future, float]] = []

        def drain(limit: int):
            while len(pending) > limit:
                group, fut, t0, geometries = pending.pop(0)
                try:
                    outputs = fut.result()
                    yield StreamResult(group, outputs, None, (time.perf_counter() - t0) * 1e3, list(geometries or ()))
                except Exception as exc:
                    yield StreamResult(group, None, exc, (time.perf_counter() - t0) * 1e3, list(geometries or ()))

        if prefetch:
            ring = PrefetchRing(self.input_shape, depth, lambda g, buf: self.stage_mapped(g, out=buf)[1]).start(groups)
            try:
                for staged in ring:
                    if staged.error is not None:
                        yield from drain(0)
                        yield StreamResult(staged.items, None, staged.error)
                        continue
                    slot = staged.slot
                    fut = self.backend.submit({self.input_name: ring.buffers[slot]}, release=lambda s=slot: ring.release(s))
                    pending.append((staged.items, fut, time.perf_counter(), staged.meta))
                    yield from drain(in_flight_cap)
                yield from drain(0)
            finally:
                ring.close()
        else:
            for group in groups:
                geometries: list = []

                def stage(g=group, into=geometries):
                    batch, geoms = self.stage_mapped(g)
                    into.extend(geoms)
                    return {self.input_name: batch}

                fut = self.backend.submit(stage=stage)
                pending.append((group, fut, time.perf_counter(), geometries))
                yield from drain(in_flight_cap)
            yield from drain(0)

    def top_k(self, output: np.ndarray, k: int = 5) -> list[list[dict]]:
        """Per sample: the k best classes as ``{"index", "label", "score"}`` (probabilities: softmax of
        logits, or the output as it is when the card says ``output = "probabilities"``)."""
        from ..tasks.classification import probabilities, top_k

        probs = probabilities(np.asarray(output).reshape(len(output), -1), self.card.classification.output)
        return [top_k(row, self.labels, k) for row in probs]

    def answers(self, outputs: dict[str, np.ndarray], n: int, geometries: Sequence[Geometry | None] | None = None,
                k: int = 5) -> list[dict]:
        """The task's answer fragment for each of the first ``n`` samples (see :class:`TaskDecoder`)."""
        return self.decoder.answers(outputs, n, geometries, k)

    def describe(self) -> dict:
        """The engine as a report: plan summary, lanes, build info."""
        d = self.backend.describe()
        d.update({"profile": self.profile.name, "model": self.model.source, "model_sha256": self.model.sha256,
                  "task": self.card.task, "card": self.card.source,
                  "input": {"name": self.input_name, "shape": list(self.input_shape)},
                  "cache_hits": self.info.cache_hits, "build_seconds": round(self.info.seconds, 3),
                  "calibration": self.info.calibration,
                  "int8_check": self.info.int8_check.to_dict() if self.info.int8_check is not None else None})
        return d


def _checked_profile(profile: Profile | str | os.PathLike | dict, precision: str | None) -> Profile:
    """The profile to build under (loaded when given by path, name or dict); ``precision`` checked."""
    if precision is not None and precision not in ("fp32", "fp16", "int8"):
        raise BuildError(f"precision must be fp32, fp16 or int8, got {precision!r}")
    return profile if isinstance(profile, Profile) else load_profile(profile)


@dataclass(frozen=True)
class ModelTask:
    """What a model is for and how to feed it: its resolved card, the preprocessing it gives, its labels."""

    card: ModelCard
    preprocess: Preprocess
    labels: tuple[str, ...]


def _resolve_task(loaded: LoadedModel, card_overrides: ModelCard | dict | None,
                  labels: str | os.PathLike | None) -> ModelTask:
    """The card layered over the model's metadata (and under the daemon's card table), its preprocessing, its labels."""
    normalised = loaded.normalised
    if len(normalised.graph.inputs) != 1:
        raise BuildError(f"k2edge serves single-input models; this one has inputs {list(normalised.graph.inputs)}")
    resolved = model_card(loaded.path, normalised, loaded.card, card_overrides)
    return ModelTask(resolved, Preprocess.from_card(resolved), load_labels(loaded.path, normalised, labels, resolved))


def _backend_step(backend: str, normalised: NormalisedModel, plan: PartitionPlan, quant, cache: EngineCache,
                  profile: Profile, threads_per_lane: int | None, spinning: bool) -> Backend:
    """The backend that runs ``plan`` (built through the cache): TensorRT engines, else ONNX Runtime lanes."""
    graph = normalised.graph
    name = graph.inputs[0]
    inputs = (TensorSpec(name, graph.shape(name), graph.tensors[name].dtype),)
    if backend == "tensorrt":
        from .tensorrt_backend import create_backend

        return create_backend(normalised, plan, quant, cache, profile, inputs, graph.outputs)
    from .onnxruntime_backend import OnnxRuntimeBackend, build_segments

    built = build_segments(normalised, plan, quant, cache)
    return OnnxRuntimeBackend(plan, built, inputs, graph.outputs, threads_per_lane,
                              prefetch=profile.edge_runtime.dma_prefetch, spinning=spinning)


def _placement(plan: PartitionPlan) -> list[tuple]:
    """Where and how each segment runs: what must be the same at every batch size for one engine to serve them."""
    return [(s.device, s.nodes, s.inputs, s.outputs, sorted(s.layer_precision.items()), s.request_share)
            for s in plan.segments]


def _report_check(check, precision: str | None) -> None:
    """Warn when INT8 misses its tolerance (the CLI prints the check's line on stderr in every case)."""
    if check.status != "failed":
        return
    if precision == "int8":
        log.warning("INT8 misses its accuracy tolerance and --precision int8 forbids falling back: %s", check.summary())
    else:
        log.warning("INT8 misses its accuracy tolerance even with fallback; keeping the best found: %s", check.summary())
