"""Verify a bundle: every check of :data:`~k2edge.bundle.result.CHECK_ORDER`, in order, first failure wins.

Nothing is written while verifying. The archive is read forward once to list and hash its members
(stopping at the signature when ``manifest.json`` and ``manifest.sig`` come first, as
``k2edge bundle create`` writes them, so an untrusted bundle costs two tar headers), and once more
for the few files the structure check reads. An installed version (a folder in the state
directory) is verified the same way, so a device re-checks what it loads after a restart against
the keys it trusts now: removing a trusted key revokes what it signed.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

from .archive import ArchiveProblem, Limits, Member, iter_members, open_bundle, read_files
from .keys import Signature, TrustStore
from .manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, path_problem
from .result import VERIFIED, BundleResult
from .structure import model_io, parse_labels, parse_profile, read_card, structure_problem

__all__ = ["Verified", "verify_bundle", "verify_directory", "verify_stream"]

_META = (MANIFEST_NAME, SIGNATURE_NAME)


@dataclass(frozen=True)
class Verified:
    """What a successful verification knows, for the store to extract."""

    manifest: Manifest
    manifest_bytes: bytes
    signature_bytes: bytes | None
    key_id: str | None


def _short(kid: str) -> str:
    return kid[:16]


def _signature_refusal(manifest_b: bytes, sig_b: bytes, trust: TrustStore | None) -> tuple[str, str, str | None] | None:
    """(status, detail, the key id the signature claims) of a signature that does not make the bundle
    trusted; None when it does (or ``trust`` is None)."""
    try:
        sig = Signature.parse(sig_b)
    except ValueError as exc:
        return "bad_signature", str(exc), None
    if trust is None:  # integrity only (inspect, sign): no trust decision
        return None
    if sig.key_id not in trust:
        return "untrusted_key", (f"signed by key {_short(sig.key_id)}, which is not among the {len(trust)} trusted "
                                 f"key(s){' (' + ', '.join(trust.sources.values()) + ')' if len(trust) else ''}"), sig.key_id
    if not trust.verify(sig.key_id, sig.signature, manifest_b):
        return "bad_signature", f"the signature by key {_short(sig.key_id)} does not match manifest.json", sig.key_id
    return None


def _refused(status: str, detail: str, manifest: Manifest | None = None, kid: str | None = None,
             manifest_b: bytes | None = None) -> BundleResult:
    return BundleResult(status, detail, manifest.name if manifest else None, manifest.version if manifest else None,
                        kid, hashlib.sha256(manifest_b).hexdigest() if manifest_b else None)


def _evaluate(members: list[Member], trust: TrustStore | None, allow_unsigned: bool,
              read: Callable[[Manifest, set[str]], dict[str, bytes]],
              ignore_signature: bool = False) -> tuple[BundleResult, Verified | None]:
    """The checks after reading, in order."""
    firsts = {m.name: m for m in reversed(members) if m.kind == "file"}
    manifest_m = firsts.get(MANIFEST_NAME)
    sig_m = None if ignore_signature else firsts.get(SIGNATURE_NAME)
    allow_unsigned = allow_unsigned or ignore_signature
    # -- unsigned, untrusted_key, bad_signature
    if manifest_m is None:
        return _refused("unsigned", "no manifest.json in the bundle"), None
    if manifest_m.data is None:
        return _refused("too_large", f"manifest.json is {manifest_m.size} bytes, too large to be a manifest"), None
    manifest_b = manifest_m.data
    kid = None
    if sig_m is None:
        if not allow_unsigned:
            return _refused("unsigned", "manifest.json is not signed (no manifest.sig); sign it with "
                                        "k2edge bundle sign FILE --key PRIVATE.pem", manifest_b=manifest_b), None
    else:
        if sig_m.data is None:
            return _refused("bad_signature", f"manifest.sig is {sig_m.size} bytes, not a signature file"), None
        refusal = _signature_refusal(manifest_b, sig_m.data, trust)
        if refusal:
            status, detail, claimed = refusal
            return _refused(status, detail, kid=claimed, manifest_b=manifest_b), None
        kid = Signature.parse(sig_m.data).key_id
    # -- bad_manifest (only authenticated bytes are parsed)
    try:
        manifest = Manifest.parse(manifest_b)
    except ValueError as exc:
        return _refused("bad_manifest", str(exc), kid=kid, manifest_b=manifest_b), None

    def refuse(status: str, detail: str):
        return _refused(status, detail, manifest, kid, manifest_b), None

    # -- unsafe_path
    seen: dict[str, Member] = {}
    for m in members:
        problem = path_problem(m.name)
        if problem:
            return refuse("unsafe_path", f"member {m.name!r}: {problem}")
        if m.kind in ("symlink", "hardlink"):
            return refuse("unsafe_path", f"member {m.name!r} is a {'symbolic' if m.kind == 'symlink' else 'hard'} link "
                                         f"(to {m.linkname!r}); bundles hold regular files only")
        if m.kind not in ("file", "dir"):
            return refuse("unsafe_path", f"member {m.name!r} is a {m.kind}; bundles hold regular files only")
        if m.name in seen:
            return refuse("unsafe_path", f"member {m.name!r} appears twice")
        seen[m.name] = m
    files = {name for name, m in seen.items() if m.kind == "file"}
    for name in files:
        parent = name.rpartition("/")[0]
        while parent:
            if parent in files:
                return refuse("unsafe_path", f"member {parent!r} is a file and also the folder of {name!r}")
            parent = parent.rpartition("/")[0]
    for entry in manifest.files:
        problem = path_problem(entry.path)
        if problem:
            return refuse("unsafe_path", f"the manifest lists {entry.path!r}: {problem}")
    # -- unexpected_file, missing_file, hash_mismatch
    entries, dirs = manifest.file_map, manifest.directories()
    for name, m in seen.items():
        if name in _META:
            continue
        if (m.kind == "file" and name not in entries) or (m.kind == "dir" and name not in dirs):
            return refuse("unexpected_file", f"{name!r} is in the bundle but not in its manifest")
    for entry in manifest.files:
        if entry.path not in files:
            return refuse("missing_file", f"{entry.path} is in the manifest but not in the bundle")
    for entry in manifest.files:
        m = seen[entry.path]
        if m.size != entry.size:
            return refuse("hash_mismatch", f"{entry.path}: {m.size} bytes, the manifest says {entry.size}")
        if m.sha256 != entry.sha256:
            return refuse("hash_mismatch", f"{entry.path}: sha256 {m.sha256[:16]}... differs from the manifest's "
                                           f"{entry.sha256[:16]}...")
    # -- structure_mismatch
    try:
        problem = structure_refusal(manifest, read)
    except ArchiveProblem as exc:
        return refuse(exc.status, exc.detail)
    if problem:
        return refuse("structure_mismatch", problem)
    signer = f"signed by key {_short(kid)}" + (f" ({trust.sources[kid]})" if trust is not None and kid in trust.sources else "") \
        if kid else "unsigned (allowed)"
    result = BundleResult(VERIFIED, f"{signer}; {len(manifest.files)} files, {manifest.total_size} bytes",
                          manifest.name, manifest.version, kid, hashlib.sha256(manifest_b).hexdigest())
    return result, Verified(manifest, manifest_b, sig_m.data if sig_m else None, kid)


def structure_refusal(manifest: Manifest, read: Callable[[Manifest, set[str]], dict[str, bytes]]) -> str | None:
    """Why a device refuses the bundle's contents as ``structure_mismatch`` (the model, its card, labels and
    profiles against each other), or None. ``read(manifest, names)`` gives the named files' bytes.

    Raises:
        ArchiveProblem: ``read`` found a file missing or changed.
    """
    wanted = {manifest.model, *manifest.profiles} | {p for p in (manifest.card, manifest.labels) if p}
    data = read(manifest, wanted)
    try:
        io = model_io(data[manifest.model])
    except ValueError as exc:
        return f"{manifest.model}: {exc}"
    card = None
    if manifest.card:
        try:
            card = read_card(data[manifest.card].decode("utf-8"), manifest.card)
        except UnicodeDecodeError as exc:
            return f"{manifest.card}: not UTF-8 text ({exc})"
        except ValueError as exc:
            return str(exc)
    labels = parse_labels(data[manifest.labels]) if manifest.labels else None
    profiles = {}
    for path in manifest.profiles:
        try:
            profiles[path] = parse_profile(data[path], path)
        except ValueError as exc:
            return str(exc)
    return structure_problem(io, card, labels, profiles, manifest.model)


def verify_stream(f: BinaryIO, trust: TrustStore | None, limits: Limits, allow_unsigned: bool = False,
                  ignore_signature: bool = False) -> tuple[BundleResult, Verified | None]:
    """Verify an open bundle (see :func:`verify_bundle`); also returns what the store needs to extract.

    ``trust=None`` checks integrity only (signature format, paths, files, hashes, structure) and
    makes no trust decision: for ``inspect``, never for loading. ``ignore_signature`` treats
    ``manifest.sig`` as absent: for ``sign``, which replaces it.
    """
    members: list[Member] = []
    meta: dict[str, bytes | None] = {}
    try:
        for m in iter_members(f, limits):
            members.append(m)
            if m.kind == "file" and m.name in _META and m.name not in meta:
                meta[m.name] = m.data
                # both seen (first in bundles k2edge writes): judge the signature before reading on
                if len(meta) == 2 and all(v is not None for v in meta.values()) and not ignore_signature:
                    refusal = _signature_refusal(meta[MANIFEST_NAME], meta[SIGNATURE_NAME], trust)
                    if refusal:
                        status, detail, claimed = refusal
                        return _refused(status, detail, kid=claimed, manifest_b=meta[MANIFEST_NAME]), None
    except ArchiveProblem as exc:
        return _refused(exc.status, exc.detail), None

    def read(manifest: Manifest, names: set[str]) -> dict[str, bytes]:
        return read_files(f, manifest, names, limits)

    return _evaluate(members, trust, allow_unsigned, read, ignore_signature)


def verify_bundle(source: str | os.PathLike | bytes, trust: TrustStore, limits: Limits | None = None,
                  allow_unsigned: bool = False) -> BundleResult:
    """Verify a bundle file or payload without writing anything.

    Args:
        source: the bundle's path, or its bytes (an MQTT payload).
        trust: the trusted public keys (:func:`~k2edge.bundle.keys.load_trust`).
        limits: size limits (defaults: 64 MiB archive, 256 MiB unpacked, 4096 members).
        allow_unsigned: accept a bundle without ``manifest.sig`` (``[trust] allow_unsigned``); a
            signature that is present is still checked.

    Returns:
        ``status == "verified"`` with name, version and signer, or the first refusal with its detail.
        Never raises for a bad bundle.
    """
    limits = limits or Limits()
    try:
        with open_bundle(source, limits) as (f, _):
            return verify_stream(f, trust, limits, allow_unsigned)[0]
    except ArchiveProblem as exc:
        return _refused(exc.status, exc.detail)


def _walk(root: Path, limits: Limits) -> list[Member]:
    """An installed version folder as tar-like members (no link followed, every file hashed)."""
    members: list[Member] = []
    total = 0
    for folder, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            st = path.lstat()
            if len(members) >= limits.max_files:
                raise ArchiveProblem("too_large", f"more than {limits.max_files} entries (deploy.max_files)")
            if stat.S_ISLNK(st.st_mode):
                members.append(Member(rel, "symlink", 0, linkname=os.readlink(path)))
            elif stat.S_ISDIR(st.st_mode):
                members.append(Member(rel, "dir", 0))
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > limits.max_unpacked_bytes:
                    raise ArchiveProblem("too_large", f"the files add up to more than {limits.max_unpacked_bytes} bytes")
                data = path.read_bytes() if name in _META and rel == name else None
                h = hashlib.sha256()
                with open(path, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        h.update(chunk)
                members.append(Member(rel, "file", st.st_size, h.hexdigest(), data))
            else:
                members.append(Member(rel, "device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "other", 0))
    return members


def verify_directory(root: str | os.PathLike, trust: TrustStore, limits: Limits | None = None,
                     allow_unsigned: bool = False) -> BundleResult:
    """Verify an unpacked bundle (an installed version) with the same checks as the archive.

    Returns:
        As :func:`verify_bundle`; ``paths`` stays empty (the store fills it).
    """
    limits = limits or Limits()
    root = Path(root)
    try:
        members = _walk(root, limits)
    except ArchiveProblem as exc:
        return _refused(exc.status, exc.detail)
    except OSError as exc:
        return _refused("not_a_bundle", f"{root}: cannot read ({exc.strerror})")

    def read(manifest: Manifest, names: Iterable[str]) -> dict[str, bytes]:
        found = {}
        for n in names:
            data = root.joinpath(*n.split("/")).read_bytes()
            if hashlib.sha256(data).hexdigest() != manifest.file_map[n].sha256:
                raise ArchiveProblem("hash_mismatch", f"{n} changed while it was being read")
            found[n] = data
        return found

    return _evaluate(members, trust, allow_unsigned, read)[0]
