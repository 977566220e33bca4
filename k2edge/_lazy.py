"""Lazy imports for heavy or optional dependencies (TensorRT, pycuda, onnxruntime, PIL).

``ort = LazyModule("onnxruntime")`` costs nothing until an attribute is used; a missing optional
dependency then raises :class:`BackendUnavailable` naming what to install.
"""

from __future__ import annotations

import importlib
import types

from .errors import BackendUnavailable


class LazyModule:
    """A module proxy that imports on first attribute access."""

    def __init__(self, name: str, install_hint: str | None = None) -> None:
        self._name = name
        self._hint = install_hint
        self._module: types.ModuleType | None = None

    def _load(self) -> types.ModuleType:
        if self._module is None:
            try:
                self._module = importlib.import_module(self._name)
            except ImportError as exc:
                hint = f"; {self._hint}" if self._hint else ""
                raise BackendUnavailable(f"{self._name} is not installed{hint}") from exc
        return self._module

    def __getattr__(self, attr: str):
        return getattr(self._load(), attr)

    @property
    def available(self) -> bool:
        """True when the module can be imported (the import is attempted once)."""
        try:
            self._load()
        except BackendUnavailable:
            return False
        return True
