"""Which backend runs a plan: ``onnxruntime`` (CPU lanes, everywhere), ``tensorrt`` (Jetson GPU + DLA).

``auto`` prefers TensorRT where it and pycuda are importable, else ONNX Runtime.
"""

from __future__ import annotations

import importlib.util

from ..errors import BackendUnavailable

BACKEND_CHOICES = ("auto", "onnxruntime", "tensorrt")


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install or an import hook that refuses it
        return False


def tensorrt_available() -> bool:
    """True when both tensorrt and pycuda can be found (checked without importing them)."""
    return all(_findable(m) for m in ("tensorrt", "pycuda"))


def resolve_backend(name: str) -> str:
    """The concrete backend for ``name``.

    Raises:
        BackendUnavailable: an unknown name, or ``tensorrt`` on a machine without it.
    """
    if name not in BACKEND_CHOICES:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    if name == "auto":
        return "tensorrt" if tensorrt_available() else "onnxruntime"
    if name == "tensorrt" and not tensorrt_available():
        raise BackendUnavailable(
            "the tensorrt backend needs tensorrt and pycuda: on a Jetson, JetPack's python3-libnvinfer in a venv made "
            "with --system-site-packages, and pip install 'k2edge[jetson]'"
        )
    return name
