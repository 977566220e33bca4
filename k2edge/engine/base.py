"""The backend lifecycle, enforced once here (after Polygraphy's runners).

Public methods check state and validate inputs, then call ``*_impl`` hooks that backends
override. A backend is also a context manager.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import EngineStateError, InputError


@dataclass(frozen=True)
class TensorSpec:
    """An input: its name, shape and dtype. ``batch_sizes``: the batch sizes one engine takes (the first dimension
    of ``shape`` is then the largest); empty: ``shape`` exactly."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    batch_sizes: tuple[int, ...] = ()

    @property
    def batch_axis(self) -> bool:
        """True when the engine takes several batch sizes."""
        return bool(self.batch_sizes)

    def fits(self, shape: tuple[int, ...]) -> bool:
        """True when an array of ``shape`` is a valid value for this input."""
        if self.batch_sizes:
            return len(shape) == len(self.shape) and shape[0] in self.batch_sizes and shape[1:] == self.shape[1:]
        return shape == self.shape


@dataclass(frozen=True)
class LaneInfo:
    """One execution lane as reports show it, e.g. ``dla0 (cpu lane)``."""

    device: str
    label: str
    segments: tuple[int, ...]
    precision: str
    request_share: float | None = None
    runs: int = 0  # segments run on this lane through submit()/stream()


def _sizes(sizes: tuple[int, ...]) -> str:
    """``1..8`` for a run of sizes, ``1|2|4|8`` otherwise."""
    if sizes == tuple(range(sizes[0], sizes[-1] + 1)):
        return f"{sizes[0]}..{sizes[-1]}"
    return "|".join(map(str, sizes))


class Backend(abc.ABC):
    """Base class of the execution backends (ONNX Runtime lanes, TensorRT engines)."""

    name: str = "backend"

    def __init__(self, inputs: tuple[TensorSpec, ...], outputs: tuple[str, ...]) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self._active = False

    # lifecycle -------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._active

    def activate(self) -> "Backend":
        if self._active:
            raise EngineStateError(f"{self.name} backend is already active")
        self.activate_impl()
        self._active = True
        return self

    def deactivate(self) -> None:
        if not self._active:
            return
        try:
            self.deactivate_impl()
        finally:
            self._active = False

    def __enter__(self) -> "Backend":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    # inference -------------------------------------------------------------------------------
    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one request synchronously in the caller's thread (lowest latency)."""
        self._require_active()
        return self.infer_impl(self.validate(feeds))

    def submit(self, feeds: dict[str, np.ndarray] | None = None, *,
               stage: Callable[[], dict[str, np.ndarray]] | None = None,
               release: Callable[[], None] | None = None) -> Future:
        """Queue one request on the lanes; consecutive requests overlap across lanes.

        Args:
            feeds: ready input tensors, or
            stage: a callable the first lane runs to produce them (staging inline with the engine);
            release: called once the first segment no longer needs the inputs (frees a prefetch slot).
        """
        self._require_active()
        if (feeds is None) == (stage is None):
            raise ValueError("give exactly one of feeds or stage")
        if feeds is not None:
            feeds = self.validate(feeds)
        return self.submit_impl(feeds, stage, release)

    def validate(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check names, shapes and dtypes; raise one InputError naming the first problem."""
        if not isinstance(feeds, dict):
            raise InputError(f"inputs must be a dict of name -> array, got {type(feeds).__name__}")
        expected = {s.name for s in self.inputs}
        missing, extra = expected - set(feeds), set(feeds) - expected
        if missing or extra:
            raise InputError(f"inputs must be exactly {sorted(expected)}; missing {sorted(missing)}, unexpected {sorted(extra)}")
        for spec in self.inputs:
            arr = feeds[spec.name]
            if not isinstance(arr, np.ndarray):
                raise InputError(f"input {spec.name!r}: expected a numpy array, got {type(arr).__name__}")
            if arr.dtype != spec.dtype or not spec.fits(tuple(arr.shape)):
                want = (f"({_sizes(spec.batch_sizes)}, {', '.join(map(str, spec.shape[1:]))})" if spec.batch_axis
                        else str(spec.shape))
                raise InputError(f"input {spec.name!r}: expected {spec.dtype} {want}, got {arr.dtype} {tuple(arr.shape)}")
        return feeds

    def _require_active(self) -> None:
        if not self._active:
            raise EngineStateError(f"{self.name} backend is not active: use it in a `with` block or call activate()")

    # hooks -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def activate_impl(self) -> None: ...

    @abc.abstractmethod
    def deactivate_impl(self) -> None: ...

    @abc.abstractmethod
    def infer_impl(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def submit_impl(self, feeds, stage, release) -> Future: ...

    @abc.abstractmethod
    def lanes(self) -> tuple[LaneInfo, ...]: ...
