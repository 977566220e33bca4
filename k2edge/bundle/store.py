"""Installed model versions in the state directory: install, activate, roll back, load.

Layout (``STATE`` is the daemon's state directory, ``$STATE_DIRECTORY`` under systemd)::

    STATE/models/NAME/state.json      {"current": "1.3.0", "previous": "1.2.0"}
    STATE/models/NAME/1.3.0/          manifest.json, manifest.sig, model.onnx, card.toml, ...
    STATE/models/NAME/1.2.0/
    STATE/models/NAME/.staging-*/     a version being unpacked (removed when found later)

A version is unpacked into a staging folder, every file and folder fsynced, and renamed into
place; ``state.json`` is replaced the same way (write, fsync, rename, fsync the folder). A power
loss at any point leaves either the old pointer or the new one, each naming a complete folder,
so the version that ran before keeps running. Only the current and previous versions stay on disk;
a version is removed by renaming it to a staging name first, so a cut removal leaves no half version.
A version installed again with the same manifest is checked file by file: a damaged or incomplete
folder is replaced from the verified bundle, an intact one keeps its files and takes the bundle's
signature (a key rotation's re-signed release).

The daemon's order for a deploy: :meth:`ModelStore.install` (verify + unpack; nothing changes
for the running model), build the engines from ``result.paths``, swap, then
:meth:`ModelStore.activate`. After a restart, :meth:`ModelStore.load` re-verifies the current
version against today's trusted keys before it is loaded. Not safe for two deploys of one model at
once from different processes; one process serialises them (a lock covers threads).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Collection

from ..errors import K2EdgeError, first_line
from ..durable import fsync_dir, write_replacing
from .archive import ArchiveProblem, Limits, extract_verified, open_bundle
from .keys import Signature, TrustStore
from .manifest import Manifest
from .result import FAILED, BundleResult
from .semver import parse_version
from .verify import verify_directory, verify_stream

__all__ = ["DamagedState", "ModelStore"]

log = logging.getLogger(__name__)

POINTER = "state.json"
_STAGING = ".staging-"


class DamagedState(K2EdgeError):
    """A model's ``state.json`` exists but cannot be read: which version runs, and so what anti-rollback
    allows, is unknown. Nothing is installed, activated or rolled back until a person mends it."""


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
        ``name``; ``rollback`` names the request of the last rollback, if the last change was one.

        Raises:
            DamagedState: ``state.json`` exists but cannot be read, or does not hold a pointer.
        """
        path = self.root / name / POINTER
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return {"current": None, "previous": None, "rollback": None}
        except OSError as exc:
            raise DamagedState(self._damaged(name, path, exc.strerror or first_line(exc))) from None
        except ValueError as exc:
            raise DamagedState(self._damaged(name, path, f"not JSON: {first_line(exc)}")) from None
        if not isinstance(data, dict) or not _a_version(data.get("current")) or \
                not (data.get("previous") is None or _a_version(data["previous"])) or \
                not isinstance(data.get("rollback"), (str, type(None))):
            raise DamagedState(self._damaged(name, path, 'not {"current": VERSION, "previous": VERSION | null}'))
        return {"current": data["current"], "previous": data.get("previous"), "rollback": data.get("rollback")}

    def _damaged(self, name: str, path: Path, why: str) -> str:
        on_disk = self.versions(name)
        example = json.dumps({"current": on_disk[-1], "previous": on_disk[-2] if len(on_disk) > 1 else None}) \
            if on_disk else None
        return (f"{path} cannot be read ({why}); it says which version of {name} runs and what is older (anti-rollback), "
                f"so nothing is installed, activated or rolled back until it is mended: the versions on disk are "
                f"{', '.join(on_disk) or 'none'}" + (f"; e.g. write {example} into it" if example else ""))

    def current(self, name: str) -> str | None:
        """The version that runs, or None when none was ever activated.

        Raises:
            DamagedState: as :meth:`pointer`.
        """
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
            ``installed`` with ``paths`` and ``previous`` (the current version, which keeps running; also
            the version that runs when its folder did not verify and was replaced: what runs is built
            again); ``current`` when the bundle is the version that runs and its files check out (its
            signature now the bundle's); or the verification refusal, ``not_newer``,
            ``version_conflict`` or ``failed``, for which nothing is written.
        """
        with self._lock:
            result = None
            try:
                with open_bundle(source, self.limits) as (f, _):
                    result, verified = verify_stream(f, self.trust, self.limits, self.allow_unsigned)
                    if verified is None:
                        return result
                    m = verified.manifest
                    wrong = name_refusal(m.name, expected_name)
                    if wrong is not None:
                        return _with(result, status="bad_manifest", detail=wrong)
                    ptr = self.pointer(m.name)
                    refusal = self._admit(m, result, allow_downgrade, verified.manifest_bytes, ptr["current"])
                    if refusal is not None:
                        return refusal
                    target = self.root / m.name / m.version
                    placed, replaced = self._place(f, verified, target)
            except ArchiveProblem as exc:  # unreadable, too large, or changed since it was verified
                return _with(result or BundleResult(exc.status, exc.detail), status=exc.status, detail=exc.detail)
            except OSError as exc:
                return _with(result or BundleResult(FAILED, ""), status=FAILED,
                             detail=f"cannot install into {self.root}: {exc.strerror or first_line(exc)}")
            except DamagedState as exc:
                return _with(result or BundleResult(FAILED, ""), status=FAILED, detail=str(exc))
            if m.version == ptr["current"] and not replaced:
                return _with(result, status="current", paths=_role_paths(target, m), previous=ptr["previous"],
                             detail=f"{m.name} {m.version} runs already; {placed}")
            # the version that runs, whose folder did not verify, comes back as installed: what runs is built again from
            # the files now there (the folder may have held other content, which no manifest on disk could tell)
            return _with(result, status="installed", paths=_role_paths(target, m), previous=ptr["current"],
                         detail=f"{result.detail}; {placed}")

    def _admit(self, m: Manifest, result: BundleResult, allow_downgrade: bool, manifest_bytes: bytes,
               current: str | None) -> BundleResult | None:
        """The refusal of a bundle for this store's ``current`` version of its model, or None to install it."""
        target = self.root / m.name / m.version
        on_disk = _manifest_on_disk(target)
        if on_disk is not None and on_disk != manifest_bytes:
            return _with(result, status="version_conflict",
                         detail=f"version {m.version} is installed already with other content; give the bundle a new version")
        if current == m.version:  # the very version that runs: checked, mended and re-signed, never rebuilt
            return None
        if current is not None and not allow_downgrade and parse_version(m.version) <= parse_version(current):
            return _with(result, status="not_newer", detail=f"version {m.version} is not newer than the running {current} "
                                                           "(anti-rollback; a deploy may say allow_downgrade)")
        return None

    def _place(self, f, verified, target: Path) -> tuple[str, bool]:
        """Put the verified bundle's files at ``target``: what was done, and whether a folder there was replaced. A
        folder already there with the same manifest (checked by :meth:`_admit`) whose files still verify keeps them
        and takes the bundle's signature; one that does not (a file damaged on disk, a folder cut short) is replaced."""
        if target.exists():
            kept = verify_directory(target, self.trust, self.limits, self.allow_unsigned)
            if kept.ok:
                self._refresh_signature(target, verified.signature_bytes)
                return f"its files in {target} check out", False
            self._unpack(f, verified, target)
            return f"{target} did not verify ({kept.line}): replaced from the bundle", True
        self._unpack(f, verified, target)
        return f"unpacked into {target}", False

    def _unpack(self, f, verified, target: Path) -> None:
        folder = target.parent
        folder.mkdir(mode=0o750, parents=True, exist_ok=True)
        for stale in folder.glob(_STAGING + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=folder))
        aside = None
        try:
            os.chmod(staging, 0o750)
            extract_verified(f, verified.manifest, verified.manifest_bytes, verified.signature_bytes, staging, self.limits)
            if target.exists():  # a damaged copy: moved aside, the new one renamed in, then the old deleted
                aside = _aside(target)
                os.rename(target, aside)
            os.rename(staging, target)
            fsync_dir(folder)
        except BaseException:
            if aside is not None and not target.exists():
                os.rename(aside, target)  # as it was: damaged, but where the pointer says
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

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
            ``activated`` (``previous`` set; ``key_id`` and ``sha256`` of the version made current), ``not_installed``,
            or ``failed`` (the pointer is unchanged).
        """
        with self._lock:
            folder = self.root / name / version
            manifest = _manifest_on_disk(folder)
            if manifest is None:
                return BundleResult("not_installed", f"{name} {version} is not installed in {self.root}", name, version)
            try:
                old = self.pointer(name)
            except DamagedState as exc:
                return BundleResult(FAILED, str(exc), name, version)
            previous = old["current"] if old["current"] != version else old["previous"]
            try:
                self._write_pointer(name, version, previous)
            except OSError as exc:
                return BundleResult(FAILED, f"cannot write {folder.parent / POINTER}: {exc.strerror}", name, version)
            self._prune(name, {version, previous})
            return BundleResult("activated", f"{name} {version} is current" + (f"; {previous} kept for rollback" if previous else ""),
                                name, version, key_id=_signer(folder), sha256=hashlib.sha256(manifest).hexdigest(),
                                paths=_role_paths(folder, Manifest.parse(manifest)), previous=previous)

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
            try:
                ptr = self.pointer(name)
            except DamagedState as exc:
                return BundleResult(FAILED, str(exc), name)
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
        try:
            version = version or self.current(name)
        except DamagedState as exc:
            return BundleResult(FAILED, str(exc), name)
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
        """Delete what is not kept; never raises (it runs after the pointer moved: what it cannot delete now, a
        later one does)."""
        for p in (self.root / name).iterdir():
            try:
                if p.is_dir() and (p.name.startswith(_STAGING) or p.name not in keep):
                    _remove(p)
                elif p.is_file() and p.name.startswith((".sig-", ".state-")):  # a write that never got renamed
                    p.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("%s: cannot remove it now (%s); a later deploy will", p, exc.strerror or exc)


def _aside(folder: Path) -> Path:
    return folder.with_name(f"{_STAGING}removed-{folder.name}-{secrets.token_hex(4)}")


def _remove(folder: Path) -> None:
    """Delete a folder, renaming it to a staging name first: a power loss in the middle leaves a staging
    folder (removed at the next install or activation), never a version folder with half its files."""
    if not folder.name.startswith(_STAGING):
        aside = _aside(folder)
        os.rename(folder, aside)
        fsync_dir(folder.parent)
        folder = aside
    shutil.rmtree(folder, ignore_errors=True)


def _manifest_on_disk(folder: Path) -> bytes | None:
    """An installed version's manifest.json, or None where there is none to read (no folder, or one cut short)."""
    try:
        return (folder / "manifest.json").read_bytes()
    except OSError:
        return None


def _signer(folder: Path) -> str | None:
    """The key id in an installed version's manifest.sig (verified when it was installed), for its records."""
    try:
        return Signature.parse((folder / "manifest.sig").read_bytes()).key_id
    except (OSError, ValueError):
        return None


def _a_version(value) -> bool:
    try:
        parse_version(value)
    except (TypeError, ValueError):
        return False
    return True


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
