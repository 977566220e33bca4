"""Validating one table of the daemon config (``[cloud]``, ``[thermal]``, ...) with field paths."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from ..errors import K2EdgeError
from ..profile.validation import describe_validation_error, model_keys

__all__ = ["SettingsError", "validate_settings"]

M = TypeVar("M", bound=BaseModel)


class SettingsError(K2EdgeError):
    """A settings table fails validation; the message names each field with its path."""


def validate_settings(cls: type[M], data: dict | None, prefix: str = "") -> M:
    """Validate ``data`` as ``cls``; errors read ``thermal.hard_c: must be > soft_c (70.0), got 60.0``.

    Args:
        cls: the pydantic model.
        data: the table (e.g. the ``[thermal]`` table of the daemon's TOML).
        prefix: where the table sits in the config, prepended to every field path.

    Raises:
        SettingsError: one message listing every problem.
    """
    data = {} if data is None else data
    try:
        if not prefix:
            return cls.model_validate(data)
        wrapper = create_model("_Settings", __config__=ConfigDict(extra="forbid"), **{prefix: (cls, ...)})
        return getattr(wrapper.model_validate({prefix: data}), prefix)
    except ValidationError as exc:
        keys = {((prefix,) if prefix else ()) + k: v for k, v in model_keys(cls).items()}
        raise SettingsError(describe_validation_error(exc, keys)) from None
