"""What a bundle says about itself (``k2edge bundle inspect``), read without trusting it."""

from __future__ import annotations

import os

from .archive import ArchiveProblem, Limits, is_gzip, iter_members, open_bundle
from .keys import Signature
from .manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest
from .result import BundleError
from .verify import verify_stream

__all__ = ["inspect_bundle"]


def inspect_bundle(source: str | os.PathLike, limits: Limits | None = None) -> dict:
    """The manifest, the signer's key id and whether the files match the manifest.

    Nothing here is trusted: the signer is shown, not checked against any key (``bundle verify``
    does that); ``integrity`` is the first failed check other than trust, or ``verified``.

    Returns:
        ``path``, ``bytes``, ``compression``, ``manifest`` (dict or None), ``manifest_error``,
        ``key_id``, ``integrity`` ({status, detail}) and ``summary`` (label, text) pairs for people.

    Raises:
        BundleError: the file is missing or is not a tar archive.
    """
    limits = limits or Limits()
    try:
        with open_bundle(source, limits) as (f, size):
            gz = is_gzip(f)
            meta = {}
            for m in iter_members(f, limits):
                if m.kind == "file" and m.name in (MANIFEST_NAME, SIGNATURE_NAME) and m.name not in meta:
                    meta[m.name] = m.data
            integrity, _ = verify_stream(f, None, limits, allow_unsigned=True)
    except ArchiveProblem as exc:
        raise BundleError(f"{source}: {exc.status}: {exc.detail}") from None
    manifest, error = None, None
    if meta.get(MANIFEST_NAME) is not None:
        try:
            manifest = Manifest.parse(meta[MANIFEST_NAME])
        except ValueError as exc:
            error = str(exc)
    else:
        error = "no manifest.json"
    kid = None
    if meta.get(SIGNATURE_NAME) is not None:
        try:
            kid = Signature.parse(meta[SIGNATURE_NAME]).key_id
        except ValueError as exc:
            kid = f"unreadable ({exc})"
    info = {"path": str(source), "bytes": size, "compression": "gzip" if gz else "none",
            "manifest": manifest.model_dump(mode="json") if manifest else None, "manifest_error": error,
            "key_id": kid, "integrity": {"status": integrity.status, "detail": integrity.detail}}
    info["summary"] = _summary(info, manifest)
    return info


def _summary(info: dict, m: Manifest | None) -> list[tuple[str, str]]:
    rows = [("bundle", f"{info['path']} ({'gzip ' if info['compression'] == 'gzip' else ''}tar, {info['bytes']:,} bytes)")]
    if m is None:
        return rows + [("manifest", info["manifest_error"])]
    calib = m.calib_files()
    rows += [
        ("model", f"{m.name} {m.version}"),
        ("created", f"{m.created} by k2edge {m.k2edge_version}"),
        ("signed by", f"key {info['key_id']} (not checked here: bundle verify --trust KEY)" if info["key_id"] else "nobody (unsigned)"),
        ("onnx", m.model),
        ("card", m.card or "-"),
        ("labels", m.labels or "-"),
        ("calib", f"{m.calib} ({len(calib)} file{'s' if len(calib) != 1 else ''})" if m.calib else "-"),
        ("profiles", ", ".join(m.profiles) + " (the first is the default)" if m.profiles else "- (the daemon config decides)"),
        ("files", f"{len(m.files)}, {m.total_size:,} bytes unpacked"),
    ]
    integ = info["integrity"]
    rows.append(("contents", "match the manifest; structure checked" if integ["status"] == "verified"
                 else f"{integ['status']}: {integ['detail']}"))
    return rows
