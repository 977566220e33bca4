"""Reading, writing and extracting bundle archives (tar, optionally gzip), with bounded work.

Every read is one forward pass over a stream whose decompressed size is capped, so neither a gzip
bomb nor a huge tar header (``tarfile`` reads pax and GNU long-name headers into memory) can cost
more than the limits allow. Extraction writes only the files the verified manifest lists, each
re-hashed as it is written, beneath the target directory and nowhere else.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from ..durable import fsync_dir, replace_file
from ..errors import first_line
from .manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, member_name, path_problem

__all__ = ["ArchiveProblem", "Limits", "Member", "extract_verified", "file_streams", "is_gzip",
           "iter_members", "open_bundle", "read_files", "write_bundle"]

MIB = 1 << 20
_CHUNK = MIB
_GZIP_MAGIC = b"\x1f\x8b"
# manifest.json of a few thousand files is well under this; manifest.sig is ~150 bytes
_KEEP_LIMIT = {MANIFEST_NAME: 8 * MIB, SIGNATURE_NAME: 64 * 1024}


@dataclass(frozen=True)
class Limits:
    """How much one bundle may cost to read.

    Attributes:
        max_bundle_bytes: the archive as received (compressed when gzip).
        max_unpacked_bytes: the files' sizes added up once unpacked.
        max_files: members of the archive, folders included.
    """

    max_bundle_bytes: int = 64 * MIB
    max_unpacked_bytes: int = 256 * MIB
    max_files: int = 4096

    @classmethod
    def most(cls) -> "Limits":
        """The largest limits a device may be set to (an operator's tools read any bundle some device could take)."""
        from ..config.deploy import MOST_BUNDLE_BYTES, MOST_FILES, MOST_UNPACKED_BYTES

        return cls(MOST_BUNDLE_BYTES, MOST_UNPACKED_BYTES, MOST_FILES)

    @classmethod
    def from_settings(cls, deploy) -> "Limits":
        """From the daemon config's ``[deploy]`` table (:class:`~k2edge.config.deploy.DeploySettings`)."""
        return cls(deploy.max_bundle_bytes, deploy.max_unpacked_bytes, deploy.max_files)

    @property
    def stream_cap(self) -> int:
        # tar headers and padding: up to 1.5 KiB a member (header + padding + a pax record), plus the end blocks
        return self.max_unpacked_bytes + self.max_files * 1536 + MIB


class ArchiveProblem(Exception):
    """Reading stopped: ``status`` is ``not_a_bundle`` or ``too_large`` (or, while extracting, the
    check the archive failed on a second reading)."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclass(frozen=True)
class Member:
    """One tar member as seen in the stream.

    Attributes:
        name: the name normalised by :func:`member_name`.
        kind: ``file``, ``dir``, ``symlink``, ``hardlink``, ``device``, ``fifo``, ``sparse`` or ``other``.
        size: bytes of data (files).
        sha256: of the data (files only).
        data: the bytes, for members the caller asked to keep.
    """

    name: str
    kind: str
    size: int
    sha256: str | None = None
    data: bytes | None = None
    linkname: str = ""


def _kind(info: tarfile.TarInfo) -> str:
    if info.issparse():
        return "sparse"
    if info.isreg():
        return "file"
    if info.isdir():
        return "dir"
    if info.issym():
        return "symlink"
    if info.islnk():
        return "hardlink"
    if info.ischr() or info.isblk():
        return "device"
    if info.isfifo():
        return "fifo"
    return "other"


class _Capped(io.RawIOBase):
    """A read-only stream that refuses to yield more than ``cap`` bytes (``too_large`` past it)."""

    def __init__(self, inner: BinaryIO, cap: int, what: str) -> None:
        self._inner, self._left, self._what = inner, cap, what

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        want = self._left + 1 if n is None or n < 0 else min(n, self._left + 1)
        data = self._inner.read(want)
        self._left -= len(data)
        if self._left < 0:
            raise ArchiveProblem("too_large", self._what)
        return data

    def readinto(self, b) -> int:  # pragma: no cover - tarfile and gzip use read()
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


@contextlib.contextmanager
def open_bundle(source: str | os.PathLike | bytes, limits: Limits) -> Iterator[tuple[BinaryIO, int]]:
    """Open a bundle given as a path or as bytes (an MQTT payload), checking its size first.

    Yields:
        (a binary file object positioned at 0, its size in bytes).

    Raises:
        ArchiveProblem: ``not_a_bundle`` (missing, unreadable) or ``too_large``.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        size = len(source)
        f: BinaryIO = io.BytesIO(bytes(source))
    else:
        try:
            f = open(source, "rb")  # noqa: SIM115 - closed below
            size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            raise ArchiveProblem("not_a_bundle", f"{source} does not exist") from None
        except IsADirectoryError:
            raise ArchiveProblem("not_a_bundle", f"{source} is a folder, not a bundle file") from None
        except OSError as exc:
            raise ArchiveProblem("not_a_bundle", f"{source}: cannot read ({exc.strerror})") from None
    try:
        if size > limits.max_bundle_bytes:
            raise ArchiveProblem("too_large", f"the bundle is {size} bytes; the limit is {limits.max_bundle_bytes} "
                                 "(deploy.max_bundle_bytes)")
        yield f, size
    finally:
        f.close()


@contextlib.contextmanager
def _tar_stream(f: BinaryIO, limits: Limits) -> Iterator[tarfile.TarFile]:
    """A forward-only tar reader over ``f`` (plain or gzip by its magic), decompressed bytes capped."""
    f.seek(0)
    magic = f.read(2)
    f.seek(0)
    inner: BinaryIO = gzip.GzipFile(fileobj=f, mode="rb") if magic == _GZIP_MAGIC else f
    capped = _Capped(inner, limits.stream_cap,
                     f"the archive unpacks to more than {limits.stream_cap} bytes (deploy.max_unpacked_bytes "
                     f"is {limits.max_unpacked_bytes})")
    try:
        tar = tarfile.open(fileobj=capped, mode="r|")
    except ArchiveProblem:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise ArchiveProblem("not_a_bundle", f"not a tar archive (plain or gzip): {first_line(exc)}") from None
    try:
        yield tar
    except ArchiveProblem:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise ArchiveProblem("not_a_bundle", f"corrupt or truncated archive: {first_line(exc)}") from None
    finally:
        tar.close()


def iter_members(f: BinaryIO, limits: Limits, keep: frozenset[str] = frozenset(_KEEP_LIMIT)) -> Iterator[Member]:
    """Every member of the archive in order, files hashed, the ``keep`` ones with their bytes.

    Raises:
        ArchiveProblem: ``not_a_bundle`` (not tar, corrupt) or ``too_large`` (a limit passed).
    """
    count = unpacked = 0
    with _tar_stream(f, limits) as tar:
        for info in tar:
            count += 1
            if count > limits.max_files:
                raise ArchiveProblem("too_large", f"more than {limits.max_files} members (deploy.max_files)")
            kind, name = _kind(info), member_name(info.name)
            if kind != "file":
                yield Member(name, kind, 0, linkname=info.linkname)
                continue
            unpacked += info.size
            if unpacked > limits.max_unpacked_bytes:
                raise ArchiveProblem("too_large", f"the files add up to more than {limits.max_unpacked_bytes} bytes "
                                     "(deploy.max_unpacked_bytes)")
            keep_this = name in keep and info.size <= _KEEP_LIMIT.get(name, limits.max_unpacked_bytes)
            digest, data = _hash(tar.extractfile(info), keep_this)
            yield Member(name, kind, info.size, digest, data)


def _hash(stream, keep: bool) -> tuple[str, bytes | None]:
    h, parts = hashlib.sha256(), []
    while chunk := stream.read(_CHUNK):
        h.update(chunk)
        if keep:
            parts.append(chunk)
    return h.hexdigest(), b"".join(parts) if keep else None


def read_files(f: BinaryIO, manifest: Manifest, names: set[str], limits: Limits) -> dict[str, bytes]:
    """The bytes of the manifest files ``names`` (for the structure check), each re-checked
    against the manifest, since the archive is read again.

    Raises:
        ArchiveProblem: a file changed since the first reading (``hash_mismatch``), or as :func:`iter_members`.
    """
    entries = manifest.file_map
    found = {}
    for m in iter_members(f, limits, keep=frozenset(names)):
        if m.name in names and m.kind == "file":
            entry = entries[m.name]
            if m.sha256 != entry.sha256 or m.data is None:
                raise ArchiveProblem("hash_mismatch", f"{m.name} changed while it was being read")
            found[m.name] = m.data
    missing = sorted(names - set(found))
    if missing:
        raise ArchiveProblem("missing_file", f"{missing[0]} disappeared while the bundle was being read")
    return found


def extract_verified(f: BinaryIO, manifest: Manifest, manifest_bytes: bytes, signature_bytes: bytes | None,
                     dest: Path, limits: Limits) -> None:
    """Write the verified bundle's files into the empty folder ``dest``, member by member.

    Only names the manifest lists are written, through ``tarfile``'s ``data`` extraction filter
    (no absolute paths, ``..``, links or devices) and our own no-follow, exclusive-create open
    beneath ``dest``; each file is hashed as it is written and fsynced. ``manifest.json`` and
    ``manifest.sig`` must be byte-identical to those verified.

    Raises:
        ArchiveProblem: the archive no longer matches what was verified (status of the check it
            fails), or ``failed`` on an I/O error. ``dest`` may then hold partial files: the caller
            removes it.
    """
    entries = manifest.file_map
    expect_meta = {MANIFEST_NAME: manifest_bytes}
    if signature_bytes is not None:
        expect_meta[SIGNATURE_NAME] = signature_bytes
    allowed_dirs = manifest.directories()
    written: set[str] = set()
    with _tar_stream(f, limits) as tar:
        for info in tar:
            name, kind = member_name(info.name), _kind(info)
            if kind == "dir" and name in allowed_dirs:
                continue
            if kind != "file" or (name not in entries and name not in expect_meta) or name in written:
                raise ArchiveProblem("unexpected_file", f"{info.name!r} appeared on a second reading of the bundle")
            problem = path_problem(name)
            if problem:  # verified before; a second line of defence costs nothing
                raise ArchiveProblem("unsafe_path", f"{info.name!r}: {problem}")
            try:
                tarfile.data_filter(info, str(dest))
            except tarfile.FilterError as exc:
                raise ArchiveProblem("unsafe_path", f"{info.name!r}: {exc}") from None
            size, digest = (len(expect_meta[name]), hashlib.sha256(expect_meta[name]).hexdigest()) if name in expect_meta \
                else (entries[name].size, entries[name].sha256)
            _write_member(tar.extractfile(info), dest, name, size, digest)
            written.add(name)
    missing = sorted((set(entries) | set(expect_meta)) - written)
    if missing:
        raise ArchiveProblem("missing_file", f"{missing[0]} disappeared on a second reading of the bundle")
    _fsync_tree(dest)


def file_streams(f: BinaryIO, limits: Limits, skip: frozenset[str]) -> Iterator[tuple[str, tuple[int, BinaryIO]]]:
    """(name, (size, stream)) for each regular file of the archive not in ``skip``, in order, for
    :func:`write_bundle` to copy (folders are dropped: the writer lists files only)."""
    with _tar_stream(f, limits) as tar:
        for info in tar:
            name = member_name(info.name)
            if _kind(info) == "file" and name not in skip:
                yield name, (info.size, tar.extractfile(info))


def _write_member(stream, dest: Path, name: str, size: int, digest: str) -> None:
    target = dest.joinpath(*name.split("/"))
    try:
        folder = dest
        for part in name.split("/")[:-1]:  # one by one: mkdir(parents=True) ignores mode for the parents
            folder = folder / part
            folder.mkdir(mode=0o750, exist_ok=True)
        if not target.parent.resolve().is_relative_to(dest.resolve()):
            raise ArchiveProblem("unsafe_path", f"{name!r} would be written outside the target folder")
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
        h, written = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            while chunk := stream.read(_CHUNK):
                written += len(chunk)
                if written > size:
                    break
                h.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    except ArchiveProblem:
        raise
    except OSError as exc:
        raise ArchiveProblem("failed", f"cannot write {name}: {exc.strerror or first_line(exc)}") from None
    if written != size or h.hexdigest() != digest:
        raise ArchiveProblem("hash_mismatch", f"{name} changed on a second reading of the bundle")


def _fsync_tree(root: Path) -> None:
    """fsync every folder under ``root`` (files were fsynced as written), so their entries are durable."""
    for folder, _, _ in os.walk(root):
        fsync_dir(Path(folder))


def write_bundle(out: Path, manifest_bytes: bytes, signature_bytes: bytes | None, files: Iterable[tuple[str, object]],
                 compress: bool, mtime: int) -> None:
    """Write a bundle: ``manifest.json``, ``manifest.sig`` (when given), then the files in order.

    Members are regular files with mode 0644, owner 0/0 and ``mtime``, and gzip gets a fixed
    header, so the same content makes the same bytes. The archive is written beside ``out``,
    fsynced and renamed over it, so a reader never sees half a bundle.

    Args:
        files: (name in the bundle, a Path to copy, or a (size, binary stream) pair), consumed in
            order (a generator reading another archive works).
    """
    with replace_file(out, 0o644) as raw:
        sink = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=mtime) if compress else raw
        with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar:
            meta = [(MANIFEST_NAME, manifest_bytes)] + ([(SIGNATURE_NAME, signature_bytes)] if signature_bytes else [])
            for name, data in meta:
                tar.addfile(_info(name, len(data), mtime), io.BytesIO(data))
            for name, src in files:
                if isinstance(src, Path):
                    with open(src, "rb") as stream:
                        tar.addfile(_info(name, os.fstat(stream.fileno()).st_size, mtime), stream)
                else:
                    size, stream = src
                    tar.addfile(_info(name, size, mtime), stream)
        if compress:
            sink.close()


def _info(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, mtime, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def is_gzip(f: BinaryIO) -> bool:
    f.seek(0)
    magic = f.read(2)
    f.seek(0)
    return magic == _GZIP_MAGIC
