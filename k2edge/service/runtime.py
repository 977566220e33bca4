"""A served model: one engine for every batch size the batcher uses (per batch size where the backend or the
model needs static shapes), its card's preprocessing and the answer its task gives (top-k, detections or raw
tensors)."""

from __future__ import annotations

import copy
import ctypes
import io
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable, TypeVar

import numpy as np

from ..config.card import BOX_TASKS
from ..config.schema import ModelConfig
from ..errors import InferenceError, InputError, K2EdgeError
from ..profile import Profile, load_profile
from ..tasks.classification import top_k as best
from ..tasks.preprocess import image_error
from ..tasks.result import LocalResult

log = logging.getLogger(__name__)
T = TypeVar("T")


BATCH1_BUDGET_S = 0.25  # activation times batch 1 up to five times, stopping once this much has gone


def batch_sizes(max_batch: int) -> list[int]:
    """Static engine batch sizes: powers of two up to ``max_batch``, plus ``max_batch`` (padding wastes < 2x)."""
    from ..model.batch_axis import profile_batch_sizes

    return list(profile_batch_sizes(max_batch))


LARGE_SAMPLE_CPU_S = 0.010
"""A sample this costly alone dwarfs what a batch saves in the daemon (its own per-batch work, about a millisecond)."""
LEAST_BATCH_SAVING = 0.02
"""On such a sample, a batch is worth its latency and memory only if it saves at least this share of a sample's CPU."""


def batch_limit(cpu_alone_s: float, cpu_batch_s: float, batch: int, max_batch: int) -> int:
    """The largest batch worth forming on single-threaded CPU workers, from a measurement: ``cpu_alone_s`` the CPU one
    sample took alone, ``cpu_batch_s`` what a batch of ``batch`` took. A batch saves the per-run cost, in the engine
    and in the daemon; where a sample alone costs :data:`LARGE_SAMPLE_CPU_S` or more and a batch saves less than
    :data:`LEAST_BATCH_SAVING` of it, there is nothing worth saving, and a batch's larger working set can make each
    sample dearer (YOLOv8n at 640 here: 1.00x to 1.02x the CPU a sample at batch 2, 1.01x to 1.15x at batch 4, the
    more so the busier the cores), holds its frames longer and grows the arena: every worker then runs batches of one."""
    if batch < 2 or cpu_alone_s <= 0:
        return max_batch
    saves = 1.0 - cpu_batch_s / batch / cpu_alone_s
    return 1 if cpu_alone_s >= LARGE_SAMPLE_CPU_S and saves < LEAST_BATCH_SAVING else max_batch


class RuntimeStateError(K2EdgeError):
    """A runtime used out of order: run before activate, activated twice, deactivated twice."""


class ModelRuntime:
    """The engines of one model, built through the engine cache: ``engines`` maps every batch size the batcher
    may form to the engine that runs it.

    On ONNX Runtime that is one engine with a dynamic batch axis for every size from 1 to ``max_batch`` (one
    session per segment: the weights and the arena are held once) and a batch runs at its own size. Where one
    engine cannot take every size (TensorRT here; a graph whose computation depends on the batch) there is one
    static engine per size of :func:`batch_sizes` and the batcher pads a batch up to the next. ``memory`` is
    what the engines hold, measured at activation (:meth:`activate`). ``version`` is the bundle version these engines were built
    from (None for a bare ONNX file); ``cache`` counts the engines the cache had ready.

    Lifecycle: ``activate()`` once, then ``infer``/``submit``, then ``deactivate()`` once (or use
    it as a context manager); out of order raises :class:`RuntimeStateError`. A model with a warm
    profile has two engine sets: :meth:`with_profile` gives the same model version running the
    other set (the thermal switch hands it to :meth:`Batcher.follow_thermal`); both views share one
    activation.
    """

    def __init__(self, cfg: ModelConfig, max_batch: int, board: str | None, cache_dir, version: str | None = None,
                 threads_per_lane: int | None = None) -> None:
        self.cfg = cfg
        self.threads_per_lane = threads_per_lane
        self.name = cfg.name
        self.version = version
        self.cache = {"engines": 0, "cached": 0}
        self._keys: dict[str, object] = {}  # engine key -> engine: a warm profile's identical engine is the normal one
        base: Profile = load_profile(cfg.profile)
        self.normal_profile = base.name
        self.normal = self._build(base, max_batch, board, cache_dir)
        self.warm = None
        self.warm_profile = None
        if cfg.escalation.warm_profile:
            warm = load_profile(cfg.escalation.warm_profile)
            self.warm_profile = warm.name
            self.warm = self._build(warm, max_batch, board, cache_dir)
        self.engines = self.normal
        self.profile_name = self.normal_profile
        # shared with the with_profile() views of this version
        self._state = {"active": False, "memory": {}, "held": 0, "retiring": False, "lock": threading.Lock()}
        first = self.engines[1]
        self.card = first.card
        self.task = first.card.task
        self.decoder = first.decoder
        self.preprocess = first.preprocess
        self.labels = first.labels
        self.input_name = first.input_name
        self.sample_shape = tuple(first.input_shape[1:])
        self.input_dtype = first.backend.inputs[0].dtype
        self.max_batch = max(self.engines)
        self.batch1_s = float("inf")  # measured by activate()

    def _build(self, profile: Profile, max_batch: int, board, cache_dir) -> dict:
        """Batch size -> engine under ``profile``: one engine for every size where the backend and the model allow it."""
        from ..engine.backends import resolve_backend
        from ..errors import BuildError, ModelError

        why_not_one = None
        if resolve_backend(self.cfg.backend) in ("onnxruntime", "tensorrt"):
            try:
                engine = self._engine(profile, board, cache_dir, max_batch=max_batch)
            except (BuildError, ModelError) as exc:
                why_not_one = exc  # the model's computation may depend on its batch in a way a batch axis cannot carry
            else:
                sizes = engine.backend.inputs[0].batch_sizes or (engine.batch_size,)
                self._log_ready(profile, engine, f"batch {', '.join(map(str, sizes))}")
                return {b: engine for b in sizes}
        engines = {}
        for b in batch_sizes(max_batch):
            er = profile.edge_runtime.model_copy(update={"batch_size": b})
            # a model that cannot be built at all fails here with its own error, and nothing is said of the batch axis
            engines[b] = self._engine(profile.model_copy(update={"edge_runtime": er}), board, cache_dir)
            self._log_ready(profile, engines[b], f"batch {b}")
        if why_not_one is not None:
            log.warning("model %s: one engine for every batch size cannot be built (%s); built one per batch size",
                        self.cfg.name, why_not_one)
        return engines

    def _engine(self, profile: Profile, board, cache_dir, max_batch: int | None = None):
        from ..engine.engine import Engine

        # several models plus staging, batching and network threads share the cores:
        # idle ONNX Runtime threads must sleep, not spin (and with one thread a lane, none sleeps)
        engine = Engine.build(self.cfg.onnx, profile, self.cfg.calib, check=self.cfg.check, board=board, backend=self.cfg.backend,
                              cache_dir=cache_dir, labels=self.cfg.labels, spinning=False,
                              threads_per_lane=self.threads_per_lane, max_batch=max_batch, **self.cfg.card_args())
        key = engine.describe().get("engine_key")
        if key is not None:
            if key in self._keys:
                return self._keys[key]  # the warm profile plans the same engine: its sessions are the normal ones
            self._keys[key] = engine
        self.cache["engines"] += 1
        self.cache["cached"] += all(engine.info.cache_hits.values())
        return engine

    def _log_ready(self, profile: Profile, engine, sizes: str) -> None:
        log.info("model %s%s: %s engine for %s ready (%s)", self.cfg.name, f" {self.version}" if self.version else "",
                 profile.name, sizes, ", ".join(f"{k} {'cached' if v else 'built'}" for k, v in engine.info.cache_hits.items()))

    @property
    def int8_check(self):
        """The INT8 accuracy check of the engines this view runs (one decision serves every batch size);
        None when no layer runs in INT8."""
        return self.engines[1].info.int8_check

    def _all(self):
        """Every distinct engine of both profiles, each once."""
        engines = [*self.normal.values(), *(self.warm.values() if self.warm else ())]
        return list({id(e): e for e in engines}.values())

    @property
    def memory(self) -> dict[str, int]:
        """Bytes the engines hold, by kind: ``host`` (the process's resident memory that activating them and their runs at
        activation added: batch 1, and 2 where batching is measured; larger batches grow ONNX Runtime's arena from there) and, on TensorRT, ``device``
        (the engines' own accounting: serialized engines and each execution context's memory). Empty before
        :meth:`activate`."""
        return dict(self._state["memory"])

    @property
    def active(self) -> bool:
        return self._state["active"]

    def activate(self) -> "ModelRuntime":
        """Activate every engine and run it at its smallest batch (the first run of a session pays its set-up), measuring
        the memory that took; ``batch1_s`` is what one request took at batch 1. An engine for every batch size is not
        run at its largest: its arena grows to the batches the load brings, not to ``max_batch``.

        Raises:
            RuntimeStateError: already active.
        """
        if self._state["active"]:
            raise RuntimeStateError(f"model {self.name} {self.version or ''}: already active".replace("  ", " "))
        rss0 = resident_bytes()
        device = 0
        for e in self._all():
            e.activate()
            spec = e.backend.inputs[0]
            smallest = {e.input_name: np.zeros((min(spec.batch_sizes), *spec.shape[1:]) if spec.batch_axis else spec.shape,
                                               dtype=spec.dtype)}
            e.infer(smallest)  # the first run pays the session's set-up
            if e is self.engines[min(self.engines)]:
                self.batch1_s = self._least_time(e, smallest)
            self._limit_batches(e, smallest)
            device += e.describe().get("device_memory_bytes") or 0
        memory = {"host": max(0, resident_bytes() - rss0)} if rss0 is not None else {}
        if device:
            memory["device"] = device
        self._state["memory"] = memory
        self._state["active"] = True
        return self

    @staticmethod
    def _least_time(engine, feeds: dict) -> float:
        """The least of up to five runs of ``feeds`` (within :data:`BATCH1_BUDGET_S`): one run on a busy machine can
        take many times what a quiet one does."""
        took, end = float("inf"), time.perf_counter() + BATCH1_BUDGET_S
        for _ in range(5):
            t0 = time.perf_counter()
            engine.infer(feeds)
            took = min(took, time.perf_counter() - t0)
            if t0 > end:
                break
        return took

    def _limit_batches(self, engine, one: dict) -> None:
        """On single-threaded CPU workers (the run's CPU is its thread's), measure a sample alone and in a batch of 2, and
        keep batches at one when batching costs CPU (:func:`batch_limit`): the engines then map batch 1 only. A batch of
        2 grows the arena no further than two workers at batch 1 do."""
        spec = engine.backend.inputs[0]
        described = engine.describe()
        if not spec.batch_axis or described.get("backend") != "onnxruntime" or described.get("threads_per_lane") != 1:
            return
        k = min(2, max(spec.batch_sizes))
        if k < 2:
            return
        batch = {engine.input_name: np.zeros((k, *spec.shape[1:]), dtype=spec.dtype)}
        alone = min(_thread_cpu(engine, one) for _ in range(3))
        together = min(_thread_cpu(engine, batch) for _ in range(2))
        limit = batch_limit(alone, together, k, max(spec.batch_sizes))
        self._state.setdefault("batch_measure", {})[id(engine)] = {"alone_ms": alone * 1e3, "batch": k,
                                                                    "batch_ms": together * 1e3, "limit": limit}
        if limit < max(spec.batch_sizes):
            log.info("model %s: a sample costs %.1f ms of CPU alone, %.1f ms in a batch of %d: batches of %d",
                     self.name, alone * 1e3, together * 1e3 / k, k, limit)
            for engines in (self.normal, self.warm or {}):
                for b in [b for b, e in engines.items() if e is engine and b > limit]:
                    del engines[b]
            self.max_batch = max(self.engines)

    def deactivate(self) -> None:
        """Release every engine (of both profiles), or, while a computation :meth:`held` for later still
        exists, once the last one is gone.

        Raises:
            RuntimeStateError: not active.
        """
        state = self._state
        with state["lock"]:
            if not state["active"]:
                raise RuntimeStateError(f"model {self.name} {self.version or ''}: not active".replace("  ", " "))
            state["active"] = False
            held = state["held"]
            state["retiring"] = held > 0  # from here the last _unhold releases them, on its own thread
        if held:
            log.info("model %s %s: its engines are released once %d pending local answer(s) are settled",
                     self.name, self.version or "", held)
            return
        self._release()

    def held(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn``, a computation on these engines to run later (a local answer a cloud escalation may fall back
        to), holding the engines until ``fn`` is gone: a deploy that swaps this version out and deactivates it
        meanwhile leaves the engines to the fallback, and they are released when the last such ``fn`` is
        dropped. ``fn`` must be an object of its own (e.g. a ``functools.partial``), not one kept elsewhere."""
        state = self._state
        with state["lock"]:
            state["held"] += 1
        weakref.finalize(fn, self._unhold).atexit = False
        return fn

    def _unhold(self) -> None:
        state = self._state
        with state["lock"]:
            state["held"] -= 1
            release = state["retiring"] and state["held"] == 0
            if release:
                state["retiring"] = False
        if release:
            self._release()

    def _release(self) -> None:
        for e in self._all():
            e.deactivate()

    def __enter__(self) -> "ModelRuntime":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    @property
    def warm_engaged(self) -> bool:
        return self.warm is not None and self.engines is self.warm

    def shares_engines(self, other: "ModelRuntime") -> bool:
        """True for the same model version, whichever profile each view runs."""
        return self._state is other._state

    def with_profile(self, warm: bool) -> "ModelRuntime":
        """This model version on its warm (DLA-heavier) engines or its normal ones: ``self`` when it
        runs those already or has no warm profile, else a view sharing engines and activation."""
        if self.warm is None or warm == self.warm_engaged:
            return self
        view = copy.copy(self)
        view.engines, view.profile_name = (self.warm, self.warm_profile) if warm else (self.normal, self.normal_profile)
        view.batch1_s = self.batch1_s  # a view is not re-measured; the batcher judges quickness by it
        return view

    def lanes(self) -> list[str]:
        return [f"{lane.label} [{lane.precision}]" for lane in self.engines[1].lanes()]

    def precision_flops(self) -> dict | None:
        """The learned-layer FLOP share per precision the engines run (``{"int8", "fp16", "fp32"}``; a lane's
        ``[int8]`` says what it asked for, this what runs), or None where no plan measured it."""
        shares = self.engines[1].plan.precision_flops
        return {k: round(v, 4) for k, v in shares["model"].items()} if shares else None

    def stage(self, image: bytes | None, tensor: np.ndarray | None, max_pixels: int):
        """One sample (C, H, W) from an encoded image or a tensor, and where the image landed in it
        (a :class:`~k2edge.tasks.preprocess.Geometry`; None for a tensor: boxes stay in input pixels).

        An image's size is read from its header and checked against ``max_pixels`` before anything
        is decoded; memory a large decode took is handed back to the system afterwards.

        Raises:
            InputError: too many pixels, undecodable image, wrong tensor shape or dtype.
        """
        if image is not None:
            width, height = image_size(image)
            if width * height > max_pixels:
                raise InputError(f"image of {width}x{height} = {width * height:,} pixels exceeds max_image_pixels "
                                 f"({max_pixels:,}); send it downscaled")
            staged = self.preprocess.stage_mapped(image)
            if width * height >= _TRIM_AFTER_PIXELS:
                release_memory()
            return staged
        arr = tensor
        if arr.shape == (1, *self.sample_shape):
            arr = arr[0]
        if arr.shape != self.sample_shape:
            raise InputError(f"tensor shape {list(tensor.shape)} does not fit model {self.name!r}: "
                             f"expected {list(self.sample_shape)} or {[1, *self.sample_shape]}")
        if arr.dtype != self.input_dtype:
            raise InputError(f"tensor dtype {arr.dtype} does not fit model {self.name!r}: expected {self.input_dtype}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise InputError("tensor.data holds NaN or infinite values")
        return arr, None

    def _batch(self, samples: list[np.ndarray]):
        n = len(samples)
        engines = self.engines
        size = next(b for b in sorted(engines) if b >= n)  # n itself on an engine for every size
        one = samples[0]
        if size == 1 and one.shape == self.sample_shape and one.dtype == self.input_dtype and one.flags.c_contiguous:
            # a lone sample is its batch: a view, not a copy (a YOLOv8n frame at 640 is 4.9 MB)
            return engines[1], {self.input_name: one[None]}
        batch = np.empty((size, *self.sample_shape), dtype=self.input_dtype)
        for i in range(size):
            batch[i] = samples[min(i, n - 1)]
        return engines[size], {self.input_name: batch}

    def infer(self, samples: list[np.ndarray]) -> dict[str, np.ndarray]:
        """Run a batch in the calling thread (padded to the next engine batch size): output name -> array."""
        engine, feeds = self._batch(samples)
        return engine.infer(feeds)

    def submit(self, samples: list[np.ndarray]) -> Future:
        """Queue a batch on the lanes; the future resolves to output name -> array (padded rows included)."""
        engine, feeds = self._batch(samples)
        return engine.submit(feeds)

    def results(self, outputs: dict[str, np.ndarray], geometries: list, top_k: list[int]) -> list:
        """Per sample of a batch: ``(answer fragment, LocalResult)`` by the card's task, or an
        ``InferenceError`` when the model's output for it is not finite.

        Args:
            outputs: output name -> batch array (padded rows beyond ``len(geometries)`` ignored).
            geometries: per sample, where its image landed (None: a tensor).
            top_k: per sample, how many classes to answer (classifiers; clipped to the classes).
        """
        n = len(geometries)
        watched = self.decoder.output_names if self.task == "tensor" else (self.decoder.output,)
        finite = np.ones(n, dtype=bool)
        for name in watched:
            finite &= np.isfinite(outputs[name][:n].reshape(n, -1)).all(axis=1)
        out: list = []
        if self.task == "classification":
            for row, k, ok in zip(self.decoder.probabilities(outputs, n), top_k, finite):
                top = best(row, self.labels, min(k, row.size)) if ok else None
                out.append(({"top_k": top}, LocalResult(tuple(top), tuple(row.tolist()), int(row.size))) if ok else None)
        elif self.task in BOX_TASKS:  # detection, segmentation, pose, obb
            fragments = self.decoder.answers(outputs, n, geometries)
            for frag, g, ok in zip(fragments, geometries, finite):
                size = (g.width, g.height) if g is not None else (self.sample_shape[-1], self.sample_shape[-2])
                out.append((frag, LocalResult.from_detections(frag["detections"], image_size=size)) if ok else None)
        else:  # raw tensors carry no confidence: judged sure (only a prompt or the heat sends one to the cloud)
            for frag, ok in zip(self.decoder.answers(outputs, n), finite):
                out.append((frag, LocalResult((), (1.0,), 1)) if ok else None)
        return [r if r is not None else InferenceError(
            f"model {self.name!r} produced non-finite outputs (NaN or infinity) for this input; no answer can be read from them")
            for r in out]


_TRIM_AFTER_PIXELS = 4_000_000
_libc = None


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an encoded image's header, without decoding it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except (Image.DecompressionBombError, UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise image_error(exc) from None


def _thread_cpu(engine, feeds: dict) -> float:
    """CPU seconds this thread spent running ``feeds`` (the whole run, on a single-threaded session)."""
    t0 = time.thread_time()
    engine.infer(feeds)
    return time.thread_time() - t0


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (Linux ``/proc/self/statm``); None elsewhere."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_memory() -> None:
    """Return freed heap to the system (glibc keeps large freed blocks for reuse otherwise)."""
    global _libc
    try:
        _libc = _libc or ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
