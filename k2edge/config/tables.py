"""Validating one table of the daemon config (``[cloud]``, ``[thermal]``, ...) with field paths."""

from __future__ import annotations

import operator
import re
from types import UnionType
from typing import Annotated, Any, Callable, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, ValidationInfo, create_model, field_validator

from ..errors import K2EdgeError
from ..profile.validation import describe_validation_error, model_keys

__all__ = ["Number", "SettingsError", "Strict", "bound", "topic_level", "validate_settings"]

M = TypeVar("M", bound=BaseModel)

_TOPIC_LEVELS = {  # what a name that becomes an MQTT topic level may hold
    False: (re.compile(r"^[A-Za-z0-9_.:-]+\Z"), "letters, digits, '_', '.', ':' or '-'"),
    True: (re.compile(r"^[A-Za-z0-9_-]+\Z"), "letters, digits, '_' or '-'"),  # stream, zone and line names
}


def _not_bool(v):
    if isinstance(v, bool):
        raise ValueError(f"must be a number, not {str(v).lower()}")
    return v


# a number inside a container field (a zone's point): pydantic takes true as 1.0 there too, and Strict's own check
# sees only a field's top level
Number = Annotated[float, BeforeValidator(_not_bool)]


class Strict(BaseModel):
    """A config table: unknown keys are errors, a number is a finite number (``inf``, ``nan`` and ``true`` are not), and a
    loaded config never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v, info: ValidationInfo):
        # pydantic takes true as 1 for an int or float field (`max_batch = true` would serve one request a batch), and
        # "5" as 5 (a quoted number in the TOML is a mistake to say, not to guess at)
        if isinstance(v, (bool, str)) and info.field_name is not None:
            kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
            if isinstance(v, bool) and kinds & {int, float} and not kinds & {bool, Any}:
                _not_bool(v)
            if isinstance(v, str) and kinds & {int, float} and not kinds & {str, Any}:
                raise ValueError(f"must be a number, not the string {v[:40]!r}")
        return v


def _scalar_kinds(annotation) -> set:
    """The scalar types a field's annotation admits at its top level (through unions and Optional; a Literal's values)."""
    if get_origin(annotation) is Literal:
        return {type(a) for a in get_args(annotation)}
    if get_origin(annotation) is Annotated:
        return _scalar_kinds(get_args(annotation)[0])
    args = get_args(annotation)
    if args and get_origin(annotation) in (Union, UnionType):
        return set().union(*(_scalar_kinds(a) for a in args))
    return {annotation}


def topic_level(value: str, what: str, narrow: bool = False) -> str:
    """``value`` when it can be a topic level (``narrow``: without '.' and ':').

    Raises:
        ValueError: naming ``what`` and the characters allowed.
    """
    pattern, allowed = _TOPIC_LEVELS[narrow]
    if not pattern.match(value):
        raise ValueError(f"{what} must be {allowed} (it becomes a topic level), got {value!r}")
    return value


PREFIX_RULE = "must be topic levels of at most 1,024 bytes without the wildcards '+' and '#'"


def topic_prefix_problem(value: str) -> str | None:
    """Why ``value`` cannot begin topic names (a device's ``topic_prefix``, a client's reply prefix): :data:`PREFIX_RULE`,
    or None when it can."""
    try:
        size = len(value.encode())
    except UnicodeEncodeError:  # a lone surrogate (from argv): no topic can hold it
        return PREFIX_RULE
    return PREFIX_RULE if not value or any(c in value for c in "+#\0") or size > 1024 else None


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


_ORDER = {">": ("above", operator.gt), ">=": (">=", operator.ge), "<": ("below", operator.lt), "<=": ("<=", operator.le)}


def bound(name: str, op: str, other: str, why: str = "", value: Callable[[dict], float | None] | None = None):
    """A field validator: field ``name`` must be ``op`` (``>``, ``>=``, ``<``, ``<=``) another one.

    Args:
        name: the field checked.
        op: the order it must keep.
        other: the field it is compared with (declared before it), or how the message names ``value``.
        why: said in the message after the limit.
        value: computes the limit from the fields validated so far (default: the field ``other``).

    Returns:
        A pydantic validator to assign in the class body (``_hard_above_soft = bound("hard_c", ">", "soft_c")``);
        None on either side skips the check. Its message: ``must be above soft_c (75.0), got 70.0``.
    """
    word, keeps = _ORDER[op]

    def check(cls, v, info: ValidationInfo):
        limit = value(info.data) if value is not None else info.data.get(other)
        if v is not None and limit is not None and not keeps(v, limit):
            raise ValueError(f"must be {word} {other} ({limit}){f': {why};' if why else ','} got {v}")
        return v

    return field_validator(name)(classmethod(check))
