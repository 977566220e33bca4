"""Helpers for bundle tests: keys, a signed bundle of the demo model, and tar surgery to tamper with it."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "digits"

Members = list[tuple[tarfile.TarInfo, "bytes | None"]]


def read_members(path: Path) -> Members:
    """Every member of a bundle, in order, with its data (None for non-files)."""
    out = []
    with tarfile.open(path, "r:*") as tar:
        for info in tar.getmembers():
            out.append((info, tar.extractfile(info).read() if info.isreg() else None))
    return out


def write_members(path: Path, members: Members, compress: bool = True) -> Path:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info = _copy(info)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path.write_bytes(gzip.compress(raw.getvalue()) if compress else raw.getvalue())
    return path


def _copy(info: tarfile.TarInfo) -> tarfile.TarInfo:
    new = tarfile.TarInfo(info.name)
    for attr in ("size", "mtime", "mode", "type", "linkname", "uid", "gid", "uname", "gname", "devmajor", "devminor"):
        setattr(new, attr, getattr(info, attr))
    return new


def file_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    return info, data


def special_member(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, 0o644
    return info, None


def rebuild(src: Path, dst: Path, edit) -> Path:
    """Copy a bundle with ``edit(members) -> members`` applied (gzip kept)."""
    return write_members(dst, edit(read_members(src)), compress=src.read_bytes()[:2] == b"\x1f\x8b")


def replace_data(members: Members, name: str, fn) -> Members:
    return [(i, fn(d) if i.name == name else d) for i, d in members]


def flip_byte(data: bytes, at: int | None = None) -> bytes:
    at = len(data) // 2 if at is None else at
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


def small_model_dir(dest: Path, card: str | None = None, labels: str | None = None) -> Path:
    """The demo model with its labels and calib.npz (not the 200 PNGs), plus an optional card."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEMO / "model.onnx", dest / "model.onnx")
    shutil.copy(DEMO / "calib.npz", dest / "calib.npz")
    (dest / "labels.txt").write_text(labels if labels is not None else (DEMO / "labels.txt").read_text())
    if card is not None:
        (dest / "card.toml").write_text(card)
    return dest


DIGITS_CARD = """\
task = "classification"
labels = "labels.txt"
[input]
name = "input"
size = [{h}, {w}]
resize = "stretch"
color = "L"
scale = 0.00392156862745098
mean = [0.3058]
std = [0.3236]
[classification]
output = "logits"
"""
