"""Schemas of the over-the-air deploy tables: ``[trust]`` (which signers a device believes) and
``[deploy]`` (limits on a bundle, and how bundles are fetched)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator

from .tables import Strict as _Strict

__all__ = ["DeploySettings", "TrustSettings"]

MIB = 1 << 20
# the most a device may be set to take ([deploy]'s upper bounds): what an operator's tools read a bundle with, the
# device it goes to judging it by its own limits
MOST_BUNDLE_BYTES, MOST_UNPACKED_BYTES, MOST_FILES = 2048 * MIB, 16384 * MIB, 1_000_000


class TrustSettings(_Strict):
    """Which signers a device believes. Removing a key file from ``keys`` revokes that key: bundles
    it signed are refused, installed versions included (they are re-verified when loaded)."""

    allow_unsigned: bool = Field(False, description="also load bare onnx paths and unsigned bundles; status reports it")
    keys: tuple[Path, ...] = Field((), validate_default=True,
                                   description="trusted Ed25519 public keys (.pub, SubjectPublicKeyInfo PEM)")
    require_int8_check: bool = Field(False, description="serve only engines whose INT8 check passed: an inconclusive "
                                     "(too few check samples) or failed check refuses the model, at start and on deploy")

    @field_validator("keys")
    @classmethod
    def _keys(cls, v, info: ValidationInfo):
        dup = sorted({str(p) for p in v if v.count(p) > 1})
        if dup:
            raise ValueError(f"lists {dup} more than once")
        if not v and not info.data.get("allow_unsigned"):
            raise ValueError("list at least one public key file, or set allow_unsigned = true")
        return v


class DeploySettings(_Strict):
    """Limits on a bundle and how bundles are fetched."""

    max_bundle_bytes: int = Field(64 * MIB, ge=1024, le=MOST_BUNDLE_BYTES,
                                  description="largest bundle accepted, as received (the broker's message_size_limit must allow it)")
    max_unpacked_bytes: int = Field(256 * MIB, ge=1024, le=MOST_UNPACKED_BYTES, description="largest total of a bundle's files, unpacked")
    max_files: int = Field(4096, ge=4, le=MOST_FILES, description="most members in a bundle, folders included")
    ca_file: Path | None = Field(None, description="CA bundle for fetching bundles over HTTPS from a private CA")
