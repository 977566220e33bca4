"""The profile schema.

A profile says how one model runs on one device: which partition granularity, what share of the
FLOPs stays on the GPU (``offload_ratio``), the precision chain, whether inputs are prefetched.
The seed example from the design loads unchanged::

    { "edge_runtime": { "tensorrt_partition": "layer-wise", "dma_prefetch": true,
                        "offload_ratio": 0.35, "precision_fallback": ["fp16", "int8"] } }

Every other key is optional with a documented default. Unknown keys and out-of-range values are
errors naming the field path (``edge_runtime.offload_ratio: must be within [0, 1], got 1.7``).
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import ProfileError
from ..readfile import MIB, read_small
from .validation import describe_validation_error, model_keys

_NOT_TEXT = {"Cc", "Cf", "Zl", "Zp"}  # Unicode categories of control, format and line/paragraph separator characters

Precision = Literal["fp32", "fp16", "int8"]
Partition = Literal["layer-wise", "block-wise", "model-wise"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _power_of_two_pool(value: int) -> int:
    # TensorRT: DLA pool sizes must be powers of two, at least 4 KiB ("Customizing DLA Memory Pools").
    if value < 4096 or value & (value - 1):
        raise ValueError(f"must be a power of two of at least 4096 bytes, got {value}")
    return value


class DLAMemoryPools(_Strict):
    """Per-loadable DLA memory pool limits in bytes (TensorRT defaults)."""

    managed_sram: int = Field(1 * MIB, description="DLA_MANAGED_SRAM; Orin has 1 MiB per core")
    local_dram: int = Field(1024 * MIB, description="DLA_LOCAL_DRAM")
    global_dram: int = Field(512 * MIB, description="DLA_GLOBAL_DRAM")

    _check = field_validator("managed_sram", "local_dram", "global_dram")(_power_of_two_pool)


class Calibration(_Strict):
    """INT8 calibration: how a tensor's range comes from the calibration set's statistics."""

    method: Literal["auto", "max", "percentile", "mse", "search"] = Field(
        "auto", description="max: the largest magnitude seen; percentile: the magnitude under which `percentile` % lie; "
        "mse: the range with the least squared INT8 error of the tensor's own values; search: per tensor, the "
        "candidate range that costs the model's output least on calibration samples (slow: one model run per candidate); "
        "auto: the INT8 check tries max, then percentile when max misses its tolerance, and keeps the closer to FP32")
    percentile: float = Field(99.99, description="for method percentile, within (50, 100]")

    @field_validator("percentile", mode="before")
    @classmethod
    def _pct(cls, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 50.0 < value <= 100.0:
            raise ValueError(f"must be a number within (50, 100], got {value!r}")
        return float(value)


def _tolerance_table(value):
    """``{measure: minimum}``: agreement, recall, precision, score_ratio, strict_recall, strict_precision, cosine,
    each within [0, 1]."""
    if not isinstance(value, dict):
        raise ValueError(f"must be a table of measure = minimum, such as {{\"agreement\": 0.99}}, got {value!r}")
    known = ("agreement", "recall", "precision", "score_ratio", "strict_recall", "strict_precision", "cosine")
    out = {}
    for k, v in value.items():
        if k not in known:
            raise ValueError(f"unknown measure {k!r}; measures are {', '.join(known)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{k}: must be a number within [0, 1], got {v!r}")
        out[k] = float(v)
    return out


class EdgeRuntime(_Strict):
    """The ``edge_runtime`` section: placement, precision and staging of one model."""

    tensorrt_partition: Partition = Field(
        "layer-wise",
        description="layer-wise: cut between any two nodes; block-wise: cut only where one tensor "
        "crosses; model-wise: whole-model engines per device, requests split by the ratio",
    )
    dma_prefetch: bool = Field(True, description="stage the next input while the engine runs")
    offload_ratio: float = Field(
        1.0, description="share of the model's FLOPs on the GPU; the rest on the DLA (0.35 = 35 % GPU)"
    )
    precision_fallback: tuple[Precision, ...] = Field(
        ("fp16",), description="precisions in order of preference; each layer takes the first its device runs"
    )
    dla_cores: int | None = Field(None, description="DLA cores to use; null = every core the board has")
    gpu_fallback: bool = Field(True, description="let TensorRT move DLA-incapable layers to the GPU")
    direct_io: bool = Field(
        False,
        description="build TensorRT engines with BuilderFlag.DIRECT_IO: a reformat at a GPU<->DLA cut fails the "
        "build instead of costing time silently",
    )
    batch_size: int = Field(1, description="static batch size the engines are built for")
    prefetch_depth: int = Field(2, description="input buffers in the prefetch ring")
    offload_tolerance: float = Field(
        0.05,
        description="how far the achieved GPU FLOP share may sit from offload_ratio; within it the planner "
        "prefers fewer GPU<->DLA transitions",
    )
    dla_memory_pools: DLAMemoryPools = Field(default_factory=DLAMemoryPools)
    calibration: Calibration = Field(default_factory=Calibration)
    int8_tolerance: dict[str, float] | None = Field(
        None, description="the INT8 check's minimum per measure (agreement, recall, precision, score_ratio, cosine); "
        "null = the task's defaults")

    @field_validator("int8_tolerance", mode="before")
    @classmethod
    def _tolerance(cls, value):
        return None if value is None else _tolerance_table(value)

    @field_validator("offload_ratio", "offload_tolerance", mode="before")
    @classmethod
    def _unit_interval(cls, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number, got {value!r}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"must be within [0, 1], got {value}")
        return float(value)

    @field_validator("precision_fallback", mode="before")
    @classmethod
    def _chain(cls, value):
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"must be a non-empty list such as [\"fp16\", \"int8\"], got {value!r}")
        if len(set(value)) != len(value):
            raise ValueError(f"lists a precision twice: {list(value)}")
        return tuple(value)

    @field_validator("dla_cores")
    @classmethod
    def _cores(cls, value):
        if value is not None and not 0 <= value <= 2:
            raise ValueError(f"must be 0, 1, 2 or null (Orin modules have at most 2 DLA cores), got {value}")
        return value

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, value):
        # DLA: batch <= 4096 ("DLA supported layers and restrictions", general restrictions).
        if not 1 <= value <= 4096:
            raise ValueError(f"must be within [1, 4096], got {value}")
        return value

    @field_validator("prefetch_depth")
    @classmethod
    def _depth(cls, value):
        if not 1 <= value <= 64:
            raise ValueError(f"must be within [1, 64], got {value}")
        return value


class Profile(_Strict):
    """A named profile. ``name`` defaults to the file's stem."""

    name: str | None = None
    description: str | None = None
    edge_runtime: EdgeRuntime

    @field_validator("name", "description")
    @classmethod
    def _one_line_of_text(cls, value: str | None):
        # both are printed by plan, build, sweep and the status: an escape sequence would be run by the terminal.
        # Control and format characters and line breaks are refused; a no-break space is text.
        at = next((i for i, ch in enumerate(value or "") if unicodedata.category(ch) in _NOT_TEXT), None)
        if at is not None:
            raise ValueError(f"holds a control character or a line break (character {at + 1} of {len(value)}: "
                             f"{value[at]!r}); one line of text")
        return value

    @classmethod
    def from_dict(cls, data: object, source: str = "profile") -> "Profile":
        """Validate a decoded JSON document.

        Raises:
            ProfileError: naming the field path of every problem.
        """
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: must be a JSON object with an 'edge_runtime' section")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ProfileError(f"{source}: {describe_validation_error(exc, model_keys(cls))}") from None

    def to_dict(self) -> dict:
        """The profile as JSON-ready data, every default spelled out."""
        return self.model_dump(mode="json")


def profile_search_path() -> list[Path]:
    """Where bare profile names (``c3``) are looked up, in order."""
    paths = [Path(p) for p in os.environ.get("K2EDGE_PROFILE_PATH", "").split(os.pathsep) if p]
    paths += [Path.cwd() / "profiles", Path(__file__).resolve().parents[2] / "profiles", Path("/etc/k2edge/profiles")]
    seen, unique = set(), []
    for p in paths:
        if p not in seen:
            seen.add(p)
            unique.append(p)
    return unique


def find_profile(name_or_path: str | os.PathLike) -> Path:
    """Resolve a profile path, or a bare name such as ``c3`` on :func:`profile_search_path`."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    written_as_path = str(name_or_path).startswith((".", "/")) or str(name_or_path).endswith("/")
    if path.is_dir() and (written_as_path or len(path.parts) > 1):
        raise ProfileError(f"profile file {str(name_or_path)!r} is a directory; give a profile's .json file or a name "
                           "such as c3")
    if path.suffix == "" and len(path.parts) == 1 and not written_as_path:
        for folder in profile_search_path():
            candidate = folder / f"{path.name}.json"
            if candidate.is_file():
                return candidate
        where = ", ".join(str(p) for p in profile_search_path())
        raise ProfileError(f"profile {str(name_or_path)!r} not found (looked in {where})")
    if path.exists():  # a named pipe, a device: read_small says which
        return path
    raise ProfileError(f"profile file {str(name_or_path)!r} does not exist")


def load_profile(source: str | os.PathLike | dict) -> Profile:
    """Load and validate a profile from a path, a bare name (``c3``) or a dict.

    Raises:
        ProfileError: the file is missing, is not JSON, or a field is invalid (the message names it).
    """
    if isinstance(source, dict):
        return Profile.from_dict(source)
    path = find_profile(source)
    try:
        data = json.loads(read_small(path, MIB).decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: not UTF-8 text (byte {exc.start}); a profile is a JSON file") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc.strerror})") from None
    profile = Profile.from_dict(data, source=str(path))
    if profile.name is None:
        profile = profile.model_copy(update={"name": path.stem})
    return profile
