"""Turn pydantic validation errors into one line per field, with the field's dotted path."""

from __future__ import annotations

from pydantic import ValidationError

_RANGE_WORDS = {
    "greater_than_equal": "must be >= {ge}",
    "less_than_equal": "must be <= {le}",
    "greater_than": "must be > {gt}",
    "less_than": "must be < {lt}",
}


def describe_validation_error(exc: ValidationError, known_keys: dict[tuple, list[str]] | None = None,
                              toml: bool = False) -> str:
    """Render every error of ``exc`` as ``path.to.field: what is wrong, got X``, joined by '; '. With ``toml`` (a TOML
    file was read), a table given as the wrong kind says how TOML writes the right one."""
    parts = []
    errors = exc.errors()
    for err in errors:
        loc = ".".join(str(p) for p in err["loc"])
        kind = err["type"]
        if kind == "too_short" and any(e["loc"][:len(err["loc"])] == err["loc"] and len(e["loc"]) > len(err["loc"])
                                       for e in errors):
            continue  # "at least 3 items after validation, not 2": an item under it failed, and that is what to say
        ctx = err.get("ctx") or {}
        got = err.get("input")
        table = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))  # as TOML writes a table's header
        if kind == "extra_forbidden":
            known = _known(known_keys, tuple(err["loc"][:-1]))
            hint = f" (known keys: {', '.join(known)})" if known else ""
            parts.append(f"{loc}: unknown key{hint}")
        elif kind == "missing":
            parts.append(f"{loc}: required")
        elif kind in _RANGE_WORDS:
            parts.append(f"{loc}: {_RANGE_WORDS[kind].format(**ctx)}, got {got!r}")
        elif kind == "value_error":  # a check of the whole file or table names its keys itself
            parts.append(f"{loc}: {ctx.get('error', err['msg'])}" if loc else str(ctx.get("error", err["msg"])))
        elif kind == "literal_error":
            parts.append(f"{loc}: must be one of {ctx.get('expected')}, got {got!r}")
        elif kind == "model_type" and isinstance(got, list) and got and all(isinstance(g, dict) for g in got):
            parts.append(f"{loc}: must be one table, got an array of tables" + _toml(toml, f"[{table}], not [[{table}]]"))
        elif kind == "model_type":
            entry = f"a [[{table}]] entry" if isinstance(err["loc"][-1], int) else f"a [{table}] section"
            parts.append(f"{loc}: must be a table of keys{_toml(toml, entry)}, got {got!r}")
        elif kind in ("tuple_type", "list_type") and isinstance(got, dict):
            parts.append(f"{loc}: must be an array of tables, got one table" + _toml(toml, f"[[{table}]], not [{table}]"))
        else:
            parts.append(f"{loc}: {err['msg'].lower()}, got {got!r}")
    return "; ".join(parts)


def model_keys(model_cls, prefix: tuple = ()) -> dict[tuple, list[str]]:
    """Map each nested model's location to its field names (for 'unknown key' hints): a table that may be left out
    (``CloudSettings | None``) or repeated (``list[ModelConfig]``, its items at ``*``) included."""
    keys = {prefix: list(model_cls.model_fields)}
    for name, field in model_cls.model_fields.items():
        for cls, repeated in _models_in(field.annotation):
            keys.update(model_keys(cls, prefix + ((name, "*") if repeated else (name,))))
    return keys


def _models_in(ann, repeated: bool = False):
    """(model class, whether it sits in a list or tuple) for each pydantic model an annotation holds."""
    import typing

    if isinstance(ann, type) and hasattr(ann, "model_fields"):
        yield ann, repeated
        return
    origin = typing.get_origin(ann)
    for arg in typing.get_args(ann):
        if arg is not Ellipsis:
            yield from _models_in(arg, repeated or origin in (list, tuple))


def _known(known_keys: dict[tuple, list[str]] | None, where: tuple) -> list[str] | None:
    return (known_keys or {}).get(tuple("*" if isinstance(p, int) else p for p in where))


def _toml(toml: bool, how: str) -> str:
    return f" (in TOML: {how})" if toml else ""
