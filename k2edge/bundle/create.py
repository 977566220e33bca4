"""Making bundles: collect a model folder's files, write the archive, sign it.

What goes in, from ``MODEL_DIR`` (or the folder of a given ``.onnx``): the ONNX model (the only
``*.onnx`` there), its card (``<model-stem>.card.toml``, else ``card.toml``), its labels (the card's
``labels``, else the model's ``k2edge.labels`` metadata, else ``labels.txt``), its calibration set
(``calib/`` or ``calib.npz``, as the engine finds it) and the profiles given, stored as
``profiles/NAME.json`` (the first is the bundle's default). Everything but the profiles must lie
inside the folder, so the card's relative paths mean the same inside the bundle.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pydantic import ValidationError

from ..errors import first_line
from ..profile.validation import describe_validation_error
from ..readfile import file_sha256
from .archive import ArchiveProblem, Limits, file_streams, is_gzip, open_bundle, write_bundle
from .keys import load_private_key, sign_manifest
from .manifest import MANIFEST_NAME, SIGNATURE_NAME, FileEntry, Manifest
from .result import BundleError, BundleResult
from .semver import parse_version
from .verify import structure_refusal, verify_stream

__all__ = ["BundleContents", "collect_contents", "create_bundle", "sign_bundle"]


@dataclass
class BundleContents:
    """The files of a bundle to be: name in the bundle -> file on disk, and their roles."""

    model: str
    files: dict[str, Path] = field(default_factory=dict)
    card: str | None = None
    labels: str | None = None
    calib: str | None = None
    profiles: list[str] = field(default_factory=list)


def _find_model(model_dir: Path) -> tuple[Path, Path]:
    if model_dir.is_file():
        if model_dir.suffix != ".onnx":
            raise BundleError(f"{model_dir} is not an .onnx file or a model folder")
        return model_dir.parent, _loadable(model_dir)
    if not model_dir.is_dir():
        raise BundleError(f"model folder {str(model_dir)!r} does not exist")
    models = sorted(model_dir.glob("*.onnx"))
    if len(models) != 1:
        found = ", ".join(p.name for p in models) or "none"
        raise BundleError(f"{model_dir} must hold exactly one .onnx model (found: {found}); "
                          "give the .onnx file instead of the folder")
    return model_dir, _loadable(models[0])


def _loadable(model: Path) -> Path:
    """``model``, once it loads as an ONNX model: a fleet is never sent a file no device could build."""
    from ..errors import ModelError
    from ..model.ingest import load_onnx

    try:
        load_onnx(model)
    except ModelError as exc:
        raise BundleError(str(exc)) from None
    return model


def _inside(folder: Path, path: Path, what: str) -> str:
    try:
        return path.resolve().relative_to(folder.resolve()).as_posix()
    except ValueError:
        raise BundleError(f"the {what} {path} lies outside {folder}; copy it into the model folder") from None


def _card_labels(card: Path) -> Path | None:
    """The labels file the card names (resolved against the card's folder), after validating the card."""
    from ..config.card import CardError, load_card

    try:
        return load_card(card).labels_path
    except CardError as exc:
        raise BundleError(str(exc)) from None


def collect_contents(model_dir: str | os.PathLike, profiles: list[str] = ()) -> BundleContents:
    """Decide what a bundle of ``model_dir`` holds (see the module docstring).

    Raises:
        BundleError: no model or several, a file outside the folder, a missing or invalid profile.
    """
    import onnx

    from ..config.card import find_card
    from ..config.resolve import find_calibration
    from ..errors import ProfileError
    from ..profile import find_profile, load_profile

    folder, model = _find_model(Path(model_dir))
    c = BundleContents(model=model.name)
    c.files[model.name] = model
    card = find_card(model)
    if card is not None:
        c.card = _inside(folder, card, "card")
        c.files[c.card] = card
    labels = None
    if card is not None and (labels := _card_labels(card)) is not None and not labels.is_file():
        raise BundleError(f"the card {card} names labels {str(labels)!r}, which does not exist")
    if labels is None:
        try:
            meta = {p.key: p.value for p in onnx.load(str(model), load_external_data=False).metadata_props}
        except Exception as exc:  # protobuf raises several kinds
            raise BundleError(f"{model}: not an ONNX model ({first_line(exc)})") from None
        for name in filter(None, (meta.get("k2edge.labels"), "labels.txt")):
            if (folder / name).is_file():
                labels = folder / name
                break
    if labels is not None:
        c.labels = _inside(folder, labels, "labels file")
        c.files[c.labels] = labels
    calib = find_calibration(model)
    if calib is not None:
        c.calib = _inside(folder, calib, "calibration set")
        members = [calib] if calib.is_file() else sorted(p for p in calib.rglob("*") if p.is_file() and not p.name.startswith("."))
        for p in members:
            c.files[_inside(folder, p, "calibration file")] = p
    for ref in profiles:
        try:
            path = find_profile(ref)
            load_profile(path)
        except ProfileError as exc:
            raise BundleError(str(exc)) from None
        name = f"profiles/{path.stem}.json"
        if name in c.files:
            raise BundleError(f"two profiles named {path.stem!r}; rename one")
        c.files[name] = path
        c.profiles.append(name)
    return c


def _created() -> tuple[str, int]:
    # SOURCE_DATE_EPOCH (reproducible-builds.org): the same inputs make the same bundle bytes
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or time.time())
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), epoch


def create_bundle(model_dir: str | os.PathLike, out: str | os.PathLike, version: str = "1.0.0",
                  profiles: list[str] = (), name: str | None = None, key: str | os.PathLike | None = None,
                  compress: bool = True, check: bool = True) -> Manifest:
    """Write a bundle of ``model_dir`` to ``out``, signed when ``key`` is given.

    Args:
        model_dir: the model folder, or the ``.onnx`` file in it.
        out: the bundle file to write (``.k2b``); replaced atomically.
        version: semver of this release of the model.
        profiles: profile names or files; the first is the default.
        name: the model's name (default: the folder's name); it must match the daemon config's entry.
        key: an Ed25519 private key (PKCS#8 PEM) to sign with.
        compress: gzip the archive.
        check: refuse contents that every device would refuse as ``structure_mismatch`` (the model, card,
            labels and profiles against each other), as they are checked on a device; False makes such a
            bundle anyway (tests of that refusal).

    Raises:
        BundleError: bad version or name, contents a device would refuse, or as :func:`collect_contents`.
    """
    from .. import __version__

    try:
        parse_version(version)
    except ValueError as exc:
        raise BundleError(f"--version {exc}") from None
    contents = collect_contents(model_dir, list(profiles))
    folder = Path(model_dir) if Path(model_dir).is_dir() else Path(model_dir).parent
    created, epoch = _created()
    entries = [FileEntry(path=p, size=src.stat().st_size, sha256=file_sha256(src)) for p, src in sorted(contents.files.items())]
    try:
        manifest = Manifest(name=name or folder.resolve().name, version=version, created=created, k2edge_version=__version__,
                            model=contents.model, card=contents.card, labels=contents.labels, calib=contents.calib,
                            profiles=tuple(contents.profiles), files=tuple(entries))
    except ValidationError as exc:
        raise BundleError(f"cannot make a manifest: {describe_validation_error(exc)}") from None
    problem = structure_refusal(manifest, lambda m, names: {n: contents.files[n].read_bytes() for n in names}) \
        if check else None
    if problem:
        raise BundleError(f"{folder}: devices would refuse this bundle (structure_mismatch): {problem}")
    data = manifest.to_bytes()
    signature = sign_manifest(data, load_private_key(key)).to_bytes() if key else None
    try:
        write_bundle(Path(out), data, signature, [(e.path, contents.files[e.path]) for e in entries], compress, epoch)
    except OSError as exc:
        raise BundleError(f"cannot write {out}: {exc.strerror or first_line(exc)}") from None
    return manifest


def sign_bundle(path: str | os.PathLike, key: str | os.PathLike, limits: Limits | None = None) -> BundleResult:
    """Sign (or re-sign) a bundle in place after checking its content against its manifest.

    Returns:
        A ``verified`` result naming the new signer.

    Raises:
        BundleError: the key is unusable, or the bundle fails a check other than its signature
            (the message is the check's ``STATUS: detail`` line): a tampered bundle is never signed.
    """
    limits = limits or Limits()
    private = load_private_key(key)
    path = Path(path)
    try:
        with open_bundle(path, limits) as (f, _):
            result, verified = verify_stream(f, None, limits, ignore_signature=True)
            if verified is None:
                raise BundleError(f"{path}: not signed: {result.line}")
            signature = sign_manifest(verified.manifest_bytes, private)
            epoch = int(datetime.fromisoformat(verified.manifest.created.replace("Z", "+00:00")).timestamp())
            write_bundle(path, verified.manifest_bytes, signature.to_bytes(),
                         file_streams(f, limits, frozenset({MANIFEST_NAME, SIGNATURE_NAME})), is_gzip(f), epoch)
    except ArchiveProblem as exc:
        raise BundleError(f"{path}: {exc.status}: {exc.detail}") from None
    except (OSError, ValueError) as exc:  # ValueError: a 'created' that is not ISO 8601
        raise BundleError(f"cannot sign {path}: {first_line(exc)}") from None
    return BundleResult("verified", f"signed by key {signature.key_id[:16]}", verified.manifest.name,
                        verified.manifest.version, signature.key_id, result.sha256)
