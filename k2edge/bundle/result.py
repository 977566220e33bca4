"""What a bundle check decides, as data: the statuses, in the order they are checked, and the result.

A refusal is never an exception: :func:`~k2edge.bundle.verify.verify_bundle` and the
:class:`~k2edge.bundle.store.ModelStore` return a :class:`BundleResult` whose ``status`` says what
happened and whose ``detail`` says why, in words a person can act on. :class:`BundleError` is kept
for mistakes of the caller (a trust file that is not a public key, a model directory without a
model), which the CLI prints as one line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import K2EdgeError

__all__ = ["BundleError", "BundleResult", "CHECK_ORDER", "FAILED", "STORE_REFUSALS", "SUCCESS", "VERIFIED"]

VERIFIED = "verified"
SUCCESS: tuple[str, ...] = (VERIFIED, "installed", "current", "activated", "rolled_back", "loaded")
"""What went right: verified (checked only), installed (unpacked into the state directory, not yet
current), current (the version that runs, installed again: its files checked and mended, its signature
the bundle's), activated (made current), rolled_back (the previous version made current), loaded
(the current version re-verified for loading)."""

CHECK_ORDER: tuple[str, ...] = (
    "not_a_bundle",        # missing, unreadable, not a tar (optionally gzip) archive, corrupt stream
    "unsigned",            # no manifest.json or no manifest.sig
    "untrusted_key",       # the signature's key id is not among the trusted keys
    "bad_signature",       # the signature does not verify over manifest.json's exact bytes
    "bad_manifest",        # signed, but not a valid manifest (fields, semver, roles)
    "unsafe_path",         # absolute, '..', links, devices, duplicate names
    "unexpected_file",     # a member that the manifest does not list
    "missing_file",        # a file the manifest lists that the archive lacks
    "hash_mismatch",       # a file whose size or sha256 differs from the manifest
    "too_large",           # past the archive size, member count or unpacked size limits
    "structure_mismatch",  # the ONNX's inputs/outputs contradict the card, labels or profile
)
"""Verification statuses, checked in this order; the first failure is the answer.

``too_large`` is also reported as soon as a limit is passed while reading (an archive bigger than
``max_bundle_bytes``, more members than ``max_files``, more bytes than ``max_unpacked_bytes``),
because reading on would cost unbounded work: an oversized archive is refused before its signature
is looked at.
"""

STORE_REFUSALS: tuple[str, ...] = (
    "not_newer",           # anti-rollback: the version is not newer than the running one
    "version_conflict",    # this version is installed already with different content
    "no_previous",         # rollback asked with no previous version on disk
    "not_installed",       # no version of this model in the state directory
)
FAILED = "failed"           # an I/O error while installing (disk full, permissions): nothing changed


class BundleError(K2EdgeError):
    """A caller's mistake around bundles: an unreadable key, a model directory without a model."""


@dataclass(frozen=True)
class BundleResult:
    """The outcome of verifying, installing, loading or rolling back a bundle.

    Attributes:
        status: one of :data:`SUCCESS`, of :data:`CHECK_ORDER`, of :data:`STORE_REFUSALS`, or ``failed``.
        detail: one sentence: what was checked, or what is wrong and where.
        name: the model's name from the manifest (None when it was never read).
        version: the bundle's semver version (None when never read).
        key_id: sha256 (hex) of the signer's raw public key; None for an unsigned bundle.
        sha256: sha256 (hex) of manifest.json's bytes, which identifies the content.
        paths: where the verified files lie once installed (``dir``, ``model``, ``card``, ``labels``,
            ``calib``, ``profiles``); empty when nothing was installed.
        previous: the version that was current before (install / rollback), if any.
    """

    status: str
    detail: str
    name: str | None = None
    version: str | None = None
    key_id: str | None = None
    sha256: str | None = None
    paths: dict = field(default_factory=dict)
    previous: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in SUCCESS

    @property
    def line(self) -> str:
        """One line: ``verified NAME VERSION`` (what ``k2edge bundle verify`` prints) or ``STATUS: detail``."""
        return f"{self.status} {self.name} {self.version}" if self.ok else f"{self.status}: {self.detail}"

    def to_dict(self) -> dict:
        """JSON-ready: paths as strings."""
        data = asdict(self)
        data["paths"] = {k: _jsonable(v) for k, v in self.paths.items()}
        return data


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
