"""Installed model versions in the state directory: install, activate, roll back, load.

Layout (``STATE`` is the daemon's state directory, ``$STATE_DIRECTORY`` under systemd)::

    STATE/models/NAME/state.json      {"current": "1.3.0", "previous": "1.2.0"}
    STATE/models/NAME/1.3.0/          manifest.json, manifest.sig, model.onnx, card.toml, ...
    STATE/models/NAME/1.2.0/
    STATE/models/NAME/.staging-*/     a version being unpacked (removed when found later)

A version is unpacked into a staging folder, every file and folder fsynced, and renamed into
place; ``state.json`` is replaced the same way (write, fsync, rename, fsync the folder). A power
loss at any point leaves either the old pointer or the new one, each naming a complete folder,
so the version that ran before keeps running. Only the current and previous versions stay on disk.

The daemon's order for a deploy: :meth:`ModelStore.install` (verify + unpack; nothing changes
for the running model), build the engines from ``result.paths``, swap, then
:meth:`ModelStore.activate`. After a restart, :meth:`ModelStore.load` re-verifies the current
version against today's trusted keys before it is loaded. Not safe for two deploys of one model at
once from different processes; one process serialises them (a lock covers threads).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Collection

from ..errors import first_line
from ..durable import fsync_dir, write_replacing
from .archive import ArchiveProblem, Limits, extract_verified, open_bundle
from .keys import TrustStore
from .manifest import Manifest
from .result import FAILED, BundleResult
from .semver import parse_version
from .verify import verify_directory, verify_stream

__all__ = ["ModelStore"]

POINTER = "state.json"
_STAGING = ".staging-"


class ModelStore:
    """The versions of every model under ``STATE/models``.

    Args:
        state_dir: the daemon's state directory.
        trust: the trusted public keys.
        limits: bundle size limits (``[deploy]``).
        allow_unsigned: accept bundles without a signature (``[trust] allow_unsigned``).
    """

    def __init__(self, state_dir: str | os.PathLike, trust: TrustStore, limits: Limits | None = None,
                 allow_unsigned: bool = False) -> None:
        self.root = Path(state_dir) / "models"
        self.trust, self.limits, self.allow_unsigned = trust, limits or Limits(), allow_unsigned
        self._lock = threading.Lock()

    # -- reading the pointer ------------------------------------------------------------------

    def pointer(self, name: str) -> dict:
        """``{"current": VERSION | None, "previous": VERSION | None, "rollback": REQUEST | None}`` for
        ``name``; ``rollback`` names the request of the last rollback, if the last change was one."""
        try:
            data = json.loads((self.root / name / POINTER).read_text())
        except (OSError, ValueError):
            return {"current": None, "previous": None, "rollback": None}
        return {"current": data.get("current"), "previous": data.get("previous"), "rollback": data.get("rollback")}

    def current(self, name: str) -> str | None:
        """The version that runs, or None when none was ever activated."""
        return self.pointer(name)["current"]

    def versions(self, name: str) -> list[str]:
        """The complete version folders on disk, oldest first by semver."""
        folder = self.root / name
        found = []
        for p in folder.iterdir() if folder.is_dir() else ():
            if p.is_dir() and not p.name.startswith("."):
                try:
                    found.append((parse_version(p.name), p.name))
                except ValueError:
                    continue
        return [v for _, v in sorted(found)]

    def paths(self, name: str, version: str) -> dict:
        """Where each role's file of an installed version lies."""
        folder = self.root / name / version
        manifest = Manifest.parse((folder / "manifest.json").read_bytes())
        return _role_paths(folder, manifest)

    # -- changing it ----------------------------------------------------------------------------

    def install(self, source: str | os.PathLike | bytes, allow_downgrade: bool = False,
                expected_name: str | Collection[str] | None = None) -> BundleResult:
        """Verify a bundle and unpack it as a new version folder; the current version stays current.

        Args:
            source: the bundle's path or bytes.
            allow_downgrade: install a version that is not newer than the current one.
            expected_name: refuse a bundle for another model: the config's entry name, or the names
                a daemon serves.

        Returns:
            ``installed`` with ``paths`` and ``previous`` (the current version, which keeps running),
            or the verification refusal, ``not_newer``, ``version_conflict`` or ``failed``; nothing
            is written for a refusal.
        """
        with self._lock:
            result = None
            try:
                with open_bundle(source, self.limits) as (f, _):
                    result, verified = verify_stream(f, self.trust, self.limits, self.allow_unsigned)
                    if verified is None:
                        return result
                    m = verified.manifest
                    refusal = self._admit(m, result, allow_downgrade, expected_name, verified.manifest_bytes)
                    if refusal is not None:
                        return refusal
                    current = self.current(m.name)
                    target = self.root / m.name / m.version
                    if not target.exists():
                        self._unpack(f, verified, target)
                    else:  # the same manifest, installed before (checked by _admit); perhaps re-signed
                        self._refresh_signature(target, verified.signature_bytes)
            except ArchiveProblem as exc:  # unreadable, too large, or changed since it was verified
                return _with(result or BundleResult(exc.status, exc.detail), status=exc.status, detail=exc.detail)
            except OSError as exc:
                return _with(result or BundleResult(FAILED, ""), status=FAILED,
                             detail=f"cannot install into {self.root}: {exc.strerror or first_line(exc)}")
            return _with(result, status="installed", paths=_role_paths(target, m), previous=current,
                         detail=f"{result.detail}; unpacked into {target}")

    def _admit(self, m: Manifest, result: BundleResult, allow_downgrade: bool, expected_name: str | Collection[str] | None,
               manifest_bytes: bytes) -> BundleResult | None:
        wrong = name_refusal(m.name, expected_name)
        if wrong is not None:
            return _with(result, status="bad_manifest", detail=wrong)
        current = self.current(m.name)
        if current is not None and not allow_downgrade and parse_version(m.version) <= parse_version(current):
            return _with(result, status="not_newer", detail=f"version {m.version} is not newer than the running {current} "
                                                           "(anti-rollback; a deploy may say allow_downgrade)")
        target = self.root / m.name / m.version
        if target.exists():
            try:
                same = (target / "manifest.json").read_bytes() == manifest_bytes
            except OSError:
                same = False
            if not same:
                return _with(result, status="version_conflict",
                             detail=f"version {m.version} is installed already with other content; give the bundle a new version")
        return None

    def _unpack(self, f, verified, target: Path) -> None:
        folder = target.parent
        folder.mkdir(mode=0o750, parents=True, exist_ok=True)
        for stale in folder.glob(_STAGING + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=folder))
        try:
            os.chmod(staging, 0o750)
            extract_verified(f, verified.manifest, verified.manifest_bytes, verified.signature_bytes, staging, self.limits)
            os.rename(staging, target)
            fsync_dir(folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    @staticmethod
    def _refresh_signature(target: Path, signature: bytes | None) -> None:
        """Keep the signature just verified: after a key rotation the re-signed bundle's signature
        must be the one checked at the next load, not the old key's."""
        sig = target / "manifest.sig"
        if signature is None or (sig.is_file() and sig.read_bytes() == signature):
            return
        # the temporary file lies beside the version folder, not in it: if we die before the rename,
        # a stray file inside would make the version fail its next verification (unexpected_file)
        write_replacing(sig, signature, 0o640, tmp_dir=target.parent, prefix=".sig-")

    def activate(self, name: str, version: str) -> BundleResult:
        """Make an installed version current (the old current becomes previous) and delete the rest.

        Returns:
            ``activated`` (``previous`` set), ``not_installed``, or ``failed`` (the pointer is unchanged).
        """
        with self._lock:
            folder = self.root / name / version
            if not (folder / "manifest.json").is_file():
                return BundleResult("not_installed", f"{name} {version} is not installed in {self.root}", name, version)
            old = self.pointer(name)
            previous = old["current"] if old["current"] != version else old["previous"]
            try:
                self._write_pointer(name, version, previous)
            except OSError as exc:
                return BundleResult(FAILED, f"cannot write {folder.parent / POINTER}: {exc.strerror}", name, version)
            self._prune(name, {version, previous})
            return BundleResult("activated", f"{name} {version} is current" + (f"; {previous} kept for rollback" if previous else ""),
                                name, version, paths=_role_paths(folder, Manifest.parse((folder / "manifest.json").read_bytes())),
                                previous=previous)

    def rollback(self, name: str, request: str | None = None) -> BundleResult:
        """Make the previous version current again, after re-verifying it (the two swap places).

        Args:
            name: the model.
            request: what identifies the rollback request (a digest of the MQTT message). It is written
                into the pointer with the change, in the same atomic replace, so the same request
                seen again (a redelivery after a crash) changes nothing and reports the rollback done.

        Returns:
            ``rolled_back`` with ``paths`` and ``previous`` (the version rolled back from; the detail
            says "already" for a repeated request), ``no_previous``, a verification refusal of the
            previous version, or ``failed``.
        """
        with self._lock:
            ptr = self.pointer(name)
            if request is not None and ptr["rollback"] == request and ptr["current"] is not None:
                done = self._verify_installed(name, ptr["current"])
                return _with(done, status="rolled_back", previous=ptr["previous"],
                             detail=f"{name} was rolled back to {ptr['current']} by this request already") if done.ok else done
            prev = ptr["previous"]
            if prev is None or not (self.root / name / prev).is_dir():
                return BundleResult("no_previous", f"{name} has no previous version to roll back to"
                                    + (f" (current {ptr['current']})" if ptr["current"] else ""), name, ptr["current"])
            checked = self._verify_installed(name, prev)
            if not checked.ok:
                return checked
            try:
                self._write_pointer(name, prev, ptr["current"], rollback=request)
            except OSError as exc:
                return BundleResult(FAILED, f"cannot write {self.root / name / POINTER}: {exc.strerror}", name, prev)
            return _with(checked, status="rolled_back", previous=ptr["current"],
                         detail=f"{name} rolled back from {ptr['current']} to {prev}; {checked.detail}")

    def load(self, name: str, version: str | None = None) -> BundleResult:
        """Re-verify an installed version (default: the current one) before loading it.

        Returns:
            ``loaded`` with ``paths``, ``not_installed``, or the refusal that version now earns
            (a file changed on disk, its key no longer trusted, ...).
        """
        version = version or self.current(name)
        if version is None:
            return BundleResult("not_installed", f"no version of {name} in {self.root}", name)
        return self._verify_installed(name, version)

    # -- helpers ------------------------------------------------------------------------------

    def _verify_installed(self, name: str, version: str) -> BundleResult:
        folder = self.root / name / version
        if not folder.is_dir():
            return BundleResult("not_installed", f"{name} {version} is not in {self.root}", name, version)
        result = verify_directory(folder, self.trust, self.limits, self.allow_unsigned)
        if not result.ok:
            return _with(result, detail=f"installed {name} {version}: {result.detail}")
        if (result.name, result.version) != (name, version):
            return _with(result, status="bad_manifest",
                         detail=f"{folder} holds {result.name} {result.version}, not {name} {version}")
        manifest = Manifest.parse((folder / "manifest.json").read_bytes())
        return _with(result, status="loaded", paths=_role_paths(folder, manifest))

    def _write_pointer(self, name: str, current: str, previous: str | None, rollback: str | None = None) -> None:
        folder = self.root / name
        state = {"current": current, "previous": previous}
        if rollback is not None:
            state["rollback"] = rollback
        write_replacing(folder / POINTER, (json.dumps(state, indent=2) + "\n").encode(), 0o640, tmp_dir=folder, prefix=".state-")

    def _prune(self, name: str, keep: set) -> None:
        for p in (self.root / name).iterdir():
            if p.is_dir() and (p.name.startswith(_STAGING) or p.name not in keep):
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_file() and p.name.startswith((".sig-", ".state-")):  # a write that never got renamed
                p.unlink(missing_ok=True)


def _role_paths(folder: Path, m: Manifest) -> dict:
    def at(rel):
        return folder.joinpath(*rel.split("/")) if rel else None

    return {"dir": folder, "manifest": folder / "manifest.json", "model": at(m.model), "card": at(m.card),
            "labels": at(m.labels), "calib": at(m.calib), "profiles": [at(p) for p in m.profiles]}


def name_refusal(name: str, expected: str | Collection[str] | None) -> str | None:
    """Why a bundle for model ``name`` is refused (``bad_manifest``) where ``expected`` names the model, or the
    models served (a config's ``[[models]]`` names); None when it fits or nothing is expected."""
    if isinstance(expected, str):
        return None if name == expected else f"the bundle is for model {name!r}, not {expected!r}"
    if expected is None or name in expected:
        return None
    return f"the bundle is for model {name!r}, which is not served here (served: {', '.join(sorted(expected))})"


def _with(result: BundleResult, **changes) -> BundleResult:
    from dataclasses import replace

    return replace(result, **changes)
