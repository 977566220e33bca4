"""Sweep configurations: profile files, or a grid over a few profile keys.

A configuration is a complete profile document (validated by the profile schema) with a name.
Its stable key is a hash of the ``edge_runtime`` section with every default spelled out, so the
same settings reached from a file or from a grid point share one key (``--resume`` matches on it).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import ProfileError
from ..profile import Profile, find_profile, load_profile
from .errors import SweepError

DEFAULT_PROFILES = ("c1", "c2", "c3", "c4", "c5", "c6")

# grid key -> edge_runtime field
GRID_FIELDS = {
    "offload_ratio": "offload_ratio",
    "partition": "tensorrt_partition",
    "prefetch": "dma_prefetch",
    "precision": "precision_fallback",
    "batch_size": "batch_size",
}

_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


@dataclass(frozen=True)
class SweepConfig:
    """One configuration to measure.

    Attributes:
        name: short and unique within the sweep (``c3``, ``c2-r0.2-int8+fp16``).
        profile: the full profile document (name, description, edge_runtime with defaults).
        source: the profile file it came from, or ``grid``.
    """

    name: str
    profile: dict
    source: str

    @property
    def key(self) -> str:
        return config_key(self.profile)


def config_key(profile: dict | Profile) -> str:
    """A stable 12-hex-digit key of the profile's ``edge_runtime`` settings (name and description excluded)."""
    prof = profile if isinstance(profile, Profile) else Profile.from_dict(profile)
    canonical = json.dumps(prof.to_dict()["edge_runtime"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def _parse_value(key: str, text: str):
    text = text.strip()
    try:
        if key == "offload_ratio":
            return float(text)
        if key == "batch_size":
            return int(text)
    except ValueError:
        raise SweepError(f"--grid {key}: {text!r} is not a number") from None
    if key == "prefetch":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise SweepError(f"--grid prefetch: expected on/off (true/false), got {text!r}")
    if key == "precision":
        chain = [p.strip() for p in text.split("+") if p.strip()]
        return chain
    return text


def parse_grid(items: Sequence[str]) -> dict[str, list]:
    """Parse ``--grid KEY=V1,V2`` arguments into ``{key: [values]}`` (keys in first-seen order).

    Keys: ``offload_ratio`` (0..1), ``partition`` (layer-wise, block-wise, model-wise), ``prefetch``
    (on/off), ``precision`` (a precision or a chain such as ``int8+fp16``), ``batch_size``.

    Raises:
        SweepError: an unknown key, a key given twice, an empty or malformed value.
    """
    grid: dict[str, list] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not values.strip():
            raise SweepError(f"--grid: expected KEY=V1,V2,..., got {item!r}")
        if key not in GRID_FIELDS:
            raise SweepError(f"--grid: unknown key {key!r}; choose from {', '.join(GRID_FIELDS)}")
        if key in grid:
            raise SweepError(f"--grid: {key} given twice; list every value in one --grid {key}=V1,V2")
        parsed = [_parse_value(key, v) for v in values.split(",") if v.strip()]
        if not parsed:
            raise SweepError(f"--grid {key}: no values")
        unique = []
        for v in parsed:
            if v not in unique:
                unique.append(v)
        grid[key] = unique
    return grid


def _name_part(key: str, value) -> str:
    if key == "offload_ratio":
        return f"r{value:g}"
    if key == "partition":
        return str(value).split("-")[0]
    if key == "prefetch":
        return "pf" if value else "no-pf"
    if key == "precision":
        return "+".join(value)
    return f"b{value}"


def profile_config(name_or_path: str) -> SweepConfig:
    """A configuration from a profile file or bare name (``c3``).

    Raises:
        ProfileError: missing or invalid profile (the message names the field).
    """
    path = find_profile(name_or_path)
    prof = load_profile(path)
    return SweepConfig(prof.name or path.stem, prof.to_dict(), str(_display_path(path)))


def _display_path(path: Path) -> Path:
    try:
        return path.resolve().relative_to(Path.cwd())
    except ValueError:
        return path


def grid_configs(grid: dict[str, list], bases: Sequence[SweepConfig] | None = None) -> list[SweepConfig]:
    """Every combination of the grid's values, applied over each base configuration.

    Without bases the grid starts from the schema's defaults (layer-wise, prefetch on, offload ratio
    1.0, fp16, batch 1). Names list the grid values: ``c2-r0.2-int8+fp16``, or ``r0.2-block`` with no base.

    Raises:
        SweepError: a combination the profile schema rejects (naming the grid values and the field).
    """
    if not grid:
        return list(bases or ())
    bases = list(bases) if bases else [None]
    keys = list(grid)
    out = []
    for base in bases:
        for combo in itertools.product(*(grid[k] for k in keys)):
            doc = json.loads(json.dumps(base.profile)) if base else {"edge_runtime": {}}
            er = doc.setdefault("edge_runtime", {})
            for k, v in zip(keys, combo):
                er[GRID_FIELDS[k]] = v
            parts = [_name_part(k, v) for k, v in zip(keys, combo)]
            name = "-".join(([base.name] if base else []) + parts)
            label = ", ".join(f"{k}={'+'.join(v) if isinstance(v, list) else v}" for k, v in zip(keys, combo))
            doc["name"] = name
            doc["description"] = (f"{base.name} with {label}" if base else f"grid point {label}")
            try:
                prof = Profile.from_dict(doc, source=f"--grid {label}")
            except ProfileError as exc:
                raise SweepError(str(exc)) from None
            out.append(SweepConfig(name, prof.to_dict(), "grid"))
    return out


def sweep_configs(profiles: Iterable[str] | None = None, grid_items: Sequence[str] = ()) -> tuple[list[SweepConfig], list[str]]:
    """The configurations of a sweep, duplicates (same key) removed.

    Args:
        profiles: profile files or names; default c1..c6 when there is no grid either.
        grid_items: ``--grid KEY=V1,V2`` arguments; applied over each profile when both are given.

    Returns:
        The configurations and notes about dropped duplicates.
    """
    grid = parse_grid(grid_items)
    names = list(profiles or ())
    if not names and not grid:
        names = list(DEFAULT_PROFILES)
    bases = [profile_config(n) for n in names]
    configs = grid_configs(grid, bases) if grid else bases
    seen: dict[str, SweepConfig] = {}
    notes, unique = [], []
    for c in configs:
        if c.key in seen:
            notes.append(f"{c.name} has the same settings as {seen[c.key].name}; measured once")
            continue
        if any(u.name == c.name for u in unique):
            raise SweepError(f"two different configurations are both named {c.name!r}; give the profile files distinct names")
        seen[c.key] = c
        unique.append(c)
    return unique, notes
