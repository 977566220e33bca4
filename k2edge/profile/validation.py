"""Turn pydantic validation errors into one line per field, with the field's dotted path."""

from __future__ import annotations

from pydantic import ValidationError

_RANGE_WORDS = {
    "greater_than_equal": "must be >= {ge}",
    "less_than_equal": "must be <= {le}",
    "greater_than": "must be > {gt}",
    "less_than": "must be < {lt}",
}


def describe_validation_error(exc: ValidationError, known_keys: dict[tuple, list[str]] | None = None) -> str:
    """Render every error of ``exc`` as ``path.to.field: what is wrong, got X``, joined by '; '."""
    parts = []
    errors = exc.errors()
    for err in errors:
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        kind = err["type"]
        if kind == "too_short" and any(e["loc"][:len(err["loc"])] == err["loc"] and len(e["loc"]) > len(err["loc"])
                                       for e in errors):
            continue  # "at least 3 items after validation, not 2": an item under it failed, and that is what to say
        ctx = err.get("ctx") or {}
        got = err.get("input")
        if kind == "extra_forbidden":
            where = tuple(err["loc"][:-1])
            known = (known_keys or {}).get(where)
            hint = f" (known keys: {', '.join(known)})" if known else ""
            parts.append(f"{loc}: unknown key{hint}")
        elif kind == "missing":
            parts.append(f"{loc}: required")
        elif kind in _RANGE_WORDS:
            parts.append(f"{loc}: {_RANGE_WORDS[kind].format(**ctx)}, got {got!r}")
        elif kind == "value_error":
            parts.append(f"{loc}: {ctx.get('error', err['msg'])}")
        elif kind == "literal_error":
            parts.append(f"{loc}: must be one of {ctx.get('expected')}, got {got!r}")
        else:
            parts.append(f"{loc}: {err['msg'].lower()}, got {got!r}")
    return "; ".join(parts)


def model_keys(model_cls, prefix: tuple = ()) -> dict[tuple, list[str]]:
    """Map each nested model's location to its field names (for 'unknown key' hints)."""
    keys = {prefix: list(model_cls.model_fields)}
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            keys.update(model_keys(ann, prefix + (name,)))
    return keys
