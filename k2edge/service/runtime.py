"""A served model: engines at the batch sizes the batcher uses, preprocessing, labels."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import numpy as np

from ..config.schema import ModelConfig
from ..errors import InputError
from ..profile import Profile, load_profile

log = logging.getLogger(__name__)


def batch_sizes(max_batch: int) -> list[int]:
    """Engine batch sizes: powers of two up to ``max_batch``, plus ``max_batch`` (padding wastes < 2x)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


class ModelRuntime:
    """Engines of one model, one per batch size, all built through the engine cache.

    The DLA needs static shapes, so a dynamic batch becomes a few static engines; the batcher
    pads a batch up to the next size.
    """

    def __init__(self, cfg: ModelConfig, max_batch: int, board: str | None, cache_dir) -> None:
        from ..engine.engine import Engine

        self.cfg = cfg
        self.name = cfg.name
        base: Profile = load_profile(cfg.profile)
        self.profile_name = base.name
        self.engines: dict[int, Engine] = {}
        for b in batch_sizes(max_batch):
            er = base.edge_runtime.model_copy(update={"batch_size": b})
            profile = base.model_copy(update={"edge_runtime": er})
            engine = Engine.build(cfg.onnx, profile, cfg.calib, board=board, backend=cfg.backend, cache_dir=cache_dir,
                                  labels=cfg.labels)
            self.engines[b] = engine
            log.info("model %s: engine for batch %d ready (%s)", cfg.name, b,
                     ", ".join(f"{k} {'cached' if v else 'built'}" for k, v in engine.info.cache_hits.items()))
        first = self.engines[1]
        self.preprocess = first.preprocess
        self.labels = first.labels
        self.input_name = first.input_name
        self.sample_shape = tuple(first.input_shape[1:])
        self.input_dtype = first.backend.inputs[0].dtype
        self.output_name = first.output_names[0]
        self.max_batch = max_batch

    def activate(self) -> None:
        for e in self.engines.values():
            e.activate()

    def deactivate(self) -> None:
        for e in self.engines.values():
            e.deactivate()

    def lanes(self) -> list[str]:
        return [f"{lane.label} [{lane.precision}]" for lane in self.engines[1].lanes()]

    def stage(self, image: bytes | None, tensor: np.ndarray | None) -> np.ndarray:
        """One sample (C, H, W) from an encoded image or a tensor.

        Raises:
            InputError: undecodable image, wrong tensor shape or dtype.
        """
        if image is not None:
            return self.preprocess.stage(image)
        arr = tensor
        if arr.shape == (1, *self.sample_shape):
            arr = arr[0]
        if arr.shape != self.sample_shape:
            raise InputError(f"tensor shape {list(tensor.shape)} does not fit model {self.name!r}: "
                             f"expected {list(self.sample_shape)} or {[1, *self.sample_shape]}")
        if arr.dtype != self.input_dtype:
            raise InputError(f"tensor dtype {arr.dtype} does not fit model {self.name!r}: expected {self.input_dtype}")
        return arr

    def submit(self, samples: list[np.ndarray]) -> Future:
        """Run a batch of samples; pads to the next engine batch size. Resolves to (n, ...) outputs."""
        n = len(samples)
        size = next(b for b in sorted(self.engines) if b >= n)
        engine = self.engines[size]
        batch = np.empty((size, *self.sample_shape), dtype=self.input_dtype)
        for i in range(size):
            batch[i] = samples[min(i, n - 1)]
        return engine.submit({self.input_name: batch})

    def top_k(self, logits: np.ndarray, k: int) -> list[list[dict]]:
        return self.engines[1].top_k(logits, k)
