"""k2edge: an edge inference runtime for NVIDIA Jetson Orin.

The public surface is small and Polygraphy-like::

    from k2edge import Engine, load_profile
    profile = load_profile("profiles/c3.json")
    with Engine.build("model.onnx", profile, calib="calib/") as engine:
        outputs = engine.infer({"input": batch})

Importing this package imports neither TensorRT, pycuda nor onnxruntime; the engine module is
loaded on first use of :class:`Engine`.
"""

from __future__ import annotations

from .errors import (
    BackendUnavailable,
    BuildError,
    DatasetError,
    EngineStateError,
    InferenceError,
    InputError,
    K2EdgeError,
    ModelError,
    PlanError,
    ProfileError,
)
from .config.card import CardError, ModelCard, load_card
from .profile import Profile, load_profile

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "Profile",
    "load_profile",
    "ModelCard",
    "load_card",
    "CardError",
    "K2EdgeError",
    "ModelError",
    "ProfileError",
    "PlanError",
    "BuildError",
    "InputError",
    "DatasetError",
    "BackendUnavailable",
    "EngineStateError",
    "InferenceError",
    "__version__",
]


def __getattr__(name: str):
    # Engine pulls in onnx and numpy-heavy modules; keep `import k2edge` cheap for the CLI.
    if name == "Engine":
        from .engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'k2edge' has no attribute {name!r}")
