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

from ..config.card import LABELS_METADATA_KEY, ModelCard, find_card, load_card, resolve_card
from ..dla.planner import PartitionPlan, plan_partition
from ..errors import BuildError, InputError
from ..model.datasets import Dataset, open_dataset
from ..model.ingest import NORMALISER_VERSION, NormalisedModel, load_onnx, normalise
from ..profile import Profile, load_profile
from ..tasks import Geometry, Preprocess, TaskDecoder
from .base import Backend, LaneInfo, TensorSpec
from .cache import EngineCache, digest
from .prefetch import PrefetchRing

if TYPE_CHECKING:
    from .check import Int8Check

log = logging.getLogger(__name__)


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


def load_labels(model_path: Path | None, model: NormalisedModel, override: str | os.PathLike | None = None,
                card: ModelCard | None = None) -> tuple[str, ...]:
    """Labels from ``override``, else the card's ``labels``, else the file the model's metadata names,
    else ``labels.txt`` beside the model."""
    candidates = []
    if override:
        candidates.append(Path(override))
    elif card is not None and card.labels:
        candidates.append(Path(card.labels))
    elif model_path is not None:
        named = model.metadata().get(LABELS_METADATA_KEY)
        if named:
            candidates.append(model_path.parent / named)
        candidates.append(model_path.parent / "labels.txt")
    for c in candidates:
        if c.is_file():
            return tuple(line.strip() for line in c.read_text().splitlines() if line.strip())
    if override:
        raise BuildError(f"labels file {str(override)!r} does not exist")
    if card is not None and card.labels:
        raise BuildError(f"{card.source or 'card'}: labels: file {card.labels!r} does not exist")
    from ..config.ultralytics import UltralyticsMetadataError, read_ultralytics

    try:  # an Ultralytics export names its classes itself
        return read_ultralytics(model.metadata()).names or ()
    except UltralyticsMetadataError:
        return ()


def card_file(model_path: Path | None, card: str | os.PathLike | ModelCard | None = None) -> ModelCard | None:
    """The card given (a file or a card), else the one beside the model (``<stem>.card.toml``, ``card.toml``), else None."""
    if isinstance(card, ModelCard):
        return card
    if card is not None:
        return load_card(card)
    found = find_card(model_path)
    if found is not None:
        log.info("using the model card beside the model: %s", found)
        return load_card(found)
    return None


def card_input_shapes(model: onnx.ModelProto, card: ModelCard | None, batch_size: int) -> dict[str, tuple[int, ...]] | None:
    """Static input shape from the card's ``size`` (else the model metadata's: k2edge's, then
    Ultralytics' ``imgsz``) for a model whose height/width are dynamic (an export with dynamic axes),
    so it needs no ``--input-shape``; None when nothing is dynamic or no size is known."""
    size = card.input.size if card is not None else None
    layout = card.input.layout if card is not None else "NCHW"
    if size is None:
        from ..config.card import metadata_size

        size = metadata_size({p.key: p.value for p in model.metadata_props})
    if size is None:
        return None
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1 or len(inputs[0].type.tensor_type.shape.dim) != 4:
        return None
    dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in inputs[0].type.tensor_type.shape.dim]
    h_ax, w_ax, c_ax = (2, 3, 1) if layout == "NCHW" else (1, 2, 3)
    if dims[h_ax] and dims[w_ax]:
        return None
    from ..config.card import BOX_TASKS, check_size
    from ..config.ultralytics import read_ultralytics
    from ..model.stride import graph_stride

    # before the graph is fixed to this size: a size off the stride fails deep in shape inference.
    # Only detectors' feature pyramids need it (a classifier's global pooling takes any size).
    md = {p.key: p.value for p in model.metadata_props}
    task = card.task if card is not None and "task" in card.model_fields_set else (read_ultralytics(md).task or "")
    check_size(tuple(size), md, (card.source or "card") if card is not None and card.input.size is not None
               else "model metadata", graph_stride(model) if task in BOX_TASKS else None)
    shape = [batch_size] * 4
    shape[h_ax], shape[w_ax] = size
    shape[c_ax] = dims[c_ax] or (card.input.channels if card is not None else None) or 3
    return {inputs[0].name: tuple(shape)}


def model_card(model_path: Path | None, normalised: NormalisedModel, card: str | os.PathLike | ModelCard | None = None,
               overrides: ModelCard | dict | None = None) -> ModelCard:
    """The card a model runs with: ``overrides`` > ``card`` (a file or a card; default the one found
    beside the model) > the model's metadata > defaults, checked against the model's input."""
    card = card_file(model_path, card)
    graph = normalised.graph
    name = graph.inputs[0]
    return resolve_card(name, graph.shape(name), normalised.metadata(), card, overrides, tuple(graph.inputs))


def load_normalised(source, cache: EngineCache, batch_size: int, input_shapes: dict | None) -> NormalisedModel:
    """Normalise ``source`` through the cache (keyed by the file's bytes and the shape settings)."""
    model, where = load_onnx(source)
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


def find_calibration(model_path: Path | None) -> Path | None:
    """A calibration set shipped beside the model (``calib/`` or ``calib.npz``), if any."""
    if model_path is None:
        return None
    for name in ("calib", "calib.npz"):
        if (model_path.parent / name).exists():
            return model_path.parent / name
    return None


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
    ) -> "Engine":
        """Normalise, plan, calibrate and build ``model`` under ``profile``; every step is cached.

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

        Raises:
            K2EdgeError: any input problem, with one message naming it.
        """
        from .backends import resolve_backend

        started = time.perf_counter()
        backend = resolve_backend(backend)
        if precision is not None and precision not in ("fp32", "fp16", "int8"):
            raise BuildError(f"precision must be fp32, fp16 or int8, got {precision!r}")
        profile = profile if isinstance(profile, Profile) else load_profile(profile)
        er = profile.edge_runtime
        cache = EngineCache(cache_dir)
        model_path = None if isinstance(model, onnx.ModelProto) else Path(model)
        the_card = card_file(model_path, card)
        if input_shapes is None:
            input_shapes = card_input_shapes(load_onnx(model)[0], the_card, er.batch_size)
        normalised = load_normalised(model, cache, er.batch_size, input_shapes)
        hits = {}
        plan = plan_partition(normalised, profile, board, precision)
        if len(normalised.graph.inputs) != 1:
            raise BuildError(f"k2edge serves single-input models; this one has inputs {list(normalised.graph.inputs)}")
        input_name = normalised.graph.inputs[0]
        input_shape = normalised.graph.shape(input_name)
        resolved = model_card(model_path, normalised, the_card, card_overrides)
        preprocess = Preprocess.from_card(resolved)
        label_names = load_labels(model_path, normalised, labels, resolved)

        quant = None
        int8_check = None
        calib_source = None
        if any(p == "int8" for s in plan.segments for p in s.layer_precision.values()):
            if calib is None:
                calib = find_calibration(model_path)
                if calib is not None:
                    log.info("using the calibration set beside the model: %s", calib)
            if calib is None:
                raise BuildError(
                    f"profile {profile.name or ''} runs layers in INT8 and needs a calibration set: "
                    f"pass --calib DIR|FILE.npz (an ImageFolder directory or an .npz with 'x')"
                )
            from ..model.datasets import open_calibration

            dataset = calib if isinstance(calib, Dataset) else open_calibration(calib, label_names)
            calib_source = dataset.source
            checking = None
            if check is not None:
                checking = check if isinstance(check, Dataset) else open_calibration(check, label_names)
            from ..tasks import TaskDecoder
            from .int8 import decide_int8

            decoder = TaskDecoder(resolved, label_names, {o: normalised.graph.shape(o) for o in normalised.graph.outputs})
            decision = decide_int8(normalised, plan, dataset, preprocess, resolved, cache, er, decoder, checking, progress)
            quant, plan, int8_check = decision.quant, decision.plan, decision.check
            hits["int8"] = decision.cached
            _report_check(int8_check, precision)

        graph = normalised.graph
        inputs = (TensorSpec(input_name, input_shape, graph.tensors[input_name].dtype),)
        if backend == "tensorrt":
            from .tensorrt_backend import create_backend

            runner = create_backend(normalised, plan, quant, cache, profile, inputs, graph.outputs)
        else:
            from .onnxruntime_backend import OnnxRuntimeBackend, build_segments

            built = build_segments(normalised, plan, quant, cache)
            runner = OnnxRuntimeBackend(plan, built, inputs, graph.outputs, threads_per_lane, prefetch=er.dma_prefetch,
                                        spinning=spinning)
        hits["engine"] = runner.build.cached
        info = BuildInfo(hits, time.perf_counter() - started, calib_source, tuple(runner.build.notes), int8_check)
        return cls(runner, plan, normalised, profile, resolved, label_names, info)

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
        groups = _batched(items, self.batch_size)
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


def _report_check(check, precision: str | None) -> None:
    """Warn when INT8 misses its tolerance (the CLI prints the check's line on stderr in every case)."""
    if check.status != "failed":
        return
    if precision == "int8":
        log.warning("INT8 misses its accuracy tolerance and --precision int8 forbids falling back: %s", check.summary())
    else:
        log.warning("INT8 misses its accuracy tolerance even with fallback; keeping the best found: %s", check.summary())


def _batched(items: Iterable, n: int) -> Iterator[list]:
    group = []
    for item in items:
        group.append(item)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group
