"""The one family of errors k2edge raises on purpose.

Every message is written for a person: it names the file, field, node or input at fault and,
where there is one, the fix. Third-party exceptions are translated into these at the boundary
(``raise ModelError(...) from exc``) so callers handle one family.
"""

from __future__ import annotations

__all__ = [
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
    "first_line",
]


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first non-empty line of an exception's message (third-party messages run long), else
    ``default`` (the exception's type name when None)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else (type(exc).__name__ if default is None else default)


class K2EdgeError(Exception):
    """Base class for every error k2edge raises deliberately."""


class ModelError(K2EdgeError):
    """An ONNX model could not be loaded or normalised."""


class ProfileError(K2EdgeError):
    """A profile file is missing, not JSON, or fails validation."""


class PlanError(K2EdgeError):
    """No partition plan satisfies the profile on this board."""


class BuildError(K2EdgeError):
    """An engine could not be built (missing calibration data, backend failure, ...)."""


class Int8CheckRefused(BuildError):
    """Engines built, refused by ``[trust] require_int8_check``: their INT8 ``check`` did not pass."""

    def __init__(self, message: str, check) -> None:
        super().__init__(message)
        self.check = check


class InputError(K2EdgeError):
    """An input tensor or image does not fit the model."""


class DatasetError(K2EdgeError):
    """A calibration or evaluation set is missing or malformed."""


class BackendUnavailable(K2EdgeError):
    """The requested backend is not installed on this machine."""


class EngineStateError(K2EdgeError):
    """An engine method was called in the wrong lifecycle state."""


class InferenceError(K2EdgeError):
    """A backend failed while running a request."""
