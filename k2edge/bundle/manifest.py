"""``manifest.json``: what a bundle holds, and the path rules every member name must follow.

The manifest names the model, its version (semver), when and by which k2edge it was made, which
file plays which role (``model``, ``card``, ``labels``, ``calib``, ``profiles``) and, for every
file, its path, size and sha256. The signature covers its exact bytes, so nothing in it is trusted
before the signature verifies.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..profile.validation import describe_validation_error, model_keys
from .semver import parse_version

__all__ = ["MANIFEST_NAME", "SIGNATURE_NAME", "FileEntry", "Manifest", "member_name", "path_problem"]

MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
_RESERVED = {MANIFEST_NAME, SIGNATURE_NAME}
# a model name becomes an MQTT topic level and a directory name
NAME_MAX = 128
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*\Z")
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")


def path_problem(path: str) -> str | None:
    """Why ``path`` may not name a file in a bundle, or None when it is a plain relative path.

    Allowed: ``model.onnx``, ``profiles/c2.json``. Refused: absolute paths, ``..`` anywhere, empty
    or ``.`` components, backslashes and control characters (a name must mean the same thing on
    every system that unpacks it).
    """
    if not path:
        return "an empty name"
    if path.startswith("/"):
        return "an absolute path"
    if any(ord(c) < 32 or c in "\\\x7f" or 0xD800 <= ord(c) <= 0xDFFF for c in path):
        # surrogates: tarfile's stand-ins for bytes that are not UTF-8
        return "a backslash, control character or non-UTF-8 byte in the name"
    parts = path.split("/")
    if ".." in parts:
        return "'..' in the path"
    if any(p in ("", ".") for p in parts):
        return "an empty or '.' path component"
    return None


def member_name(raw: str) -> str:
    """A tar member's name as the manifest spells it: leading ``./`` and a directory's trailing ``/``
    removed (tar tools write both); everything else is kept for :func:`path_problem` to judge."""
    name = raw
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/") if name not in ("", "/") else name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    """One file of the bundle."""

    path: str
    size: int = Field(ge=0)
    sha256: str

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _HEX64.match(v):
            raise ValueError(f"must be 64 lower-case hex digits, got {v!r}")
        return v


class Manifest(_Strict):
    """The manifest (format 1)."""

    format: Literal[1] = 1
    name: str
    version: str
    created: str = Field(description="ISO 8601 UTC time the bundle was made")
    k2edge_version: str
    model: str = Field(description="the ONNX model's path")
    card: str | None = Field(None, description="the model card's path")
    labels: str | None = Field(None, description="the labels file's path")
    calib: str | None = Field(None, description="the calibration set: a file (.npz) or a folder")
    profiles: tuple[str, ...] = Field((), description="profile files; the first is the default")
    files: tuple[FileEntry, ...]

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"must be letters, digits, '_', '.', ':' or '-' (it names a topic level and a folder), got {v!r}")
        if len(v) > NAME_MAX:
            raise ValueError(f"must be at most {NAME_MAX} characters (it names a folder), got {len(v)}")
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        parse_version(v)
        return v

    @field_validator("created")
    @classmethod
    def _created(cls, v: str) -> str:
        try:
            datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"must be an ISO 8601 time such as 2026-03-02T09:14:07Z, got {v!r}") from None
        return v

    @model_validator(mode="after")
    def _roles(self):
        paths = [f.path for f in self.files]
        dup = sorted({p for p in paths if paths.count(p) > 1})
        if dup:
            raise ValueError(f"files lists {dup} more than once")
        reserved = sorted(_RESERVED.intersection(paths))
        if reserved:
            raise ValueError(f"files may not list {reserved} (the manifest and its signature are not files of the bundle)")
        listed = set(paths)
        for role in ("model", "card", "labels"):
            value = getattr(self, role)
            if value is not None and value not in listed:
                raise ValueError(f"{role} {value!r} is not among files")
        for p in self.profiles:
            if p not in listed:
                raise ValueError(f"profile {p!r} is not among files")
        if self.calib is not None and not self.calib_files():
            raise ValueError(f"calib {self.calib!r} is neither a file nor a folder among files")
        return self

    # -- reading ------------------------------------------------------------------------------

    @classmethod
    def parse(cls, data: bytes) -> "Manifest":
        """Parse and validate ``manifest.json``'s bytes.

        Raises:
            ValueError: not JSON, or a field is invalid (the message names it).
        """
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"manifest.json is not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise ValueError("manifest.json must be a JSON object")
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise ValueError(f"manifest.json: {describe_validation_error(exc, model_keys(cls))}") from None

    def to_bytes(self) -> bytes:
        """The canonical bytes written into a bundle (sorted keys, two-space indent, final newline)."""
        return (json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()

    @property
    def file_map(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def calib_files(self) -> list[str]:
        """The calibration set's files: the file itself, or every file under the folder."""
        if self.calib is None:
            return []
        if self.calib in self.file_map:
            return [self.calib]
        prefix = self.calib.rstrip("/") + "/"
        return [f.path for f in self.files if f.path.startswith(prefix)]

    def directories(self) -> set[str]:
        """Every folder some file lies in (tar tools may list them as members)."""
        dirs = set()
        for f in self.files:
            parent = PurePosixPath(f.path).parent
            while str(parent) not in (".", ""):
                dirs.add(str(parent))
                parent = parent.parent
        return dirs
