"""Calibration and evaluation sets.

Two formats:

* an ImageFolder-style directory: one sub-directory per class holding images (the class names
  are matched against the model's labels, else sorted); a flat directory of images is unlabelled;
* an ``.npz`` file with ``x`` (uint8 images (N, H, W[, C]) or float tensors shaped like the model
  input samples) and optional integer labels ``y``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..errors import DatasetError
from .preprocess import IMAGE_SUFFIXES


@dataclass
class Dataset:
    """Samples (image paths or arrays) and optional labels."""

    source: str
    samples: Sequence  # paths or np.ndarray rows
    labels: np.ndarray | None
    class_names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator:
        return iter(self.samples)

    @property
    def labelled(self) -> bool:
        return self.labels is not None

    def fingerprint(self) -> str:
        """sha256 of the data itself (file contents or array bytes), for cache keys."""
        h = hashlib.sha256()
        if isinstance(self.samples, np.ndarray):
            h.update(str(self.samples.shape).encode())
            h.update(str(self.samples.dtype).encode())
            h.update(np.ascontiguousarray(self.samples).tobytes())
        else:
            for p in self.samples:
                h.update(str(Path(p).name).encode())
                h.update(Path(p).read_bytes())
        if self.labels is not None:
            h.update(np.asarray(self.labels, dtype=np.int64).tobytes())
        return h.hexdigest()

    def take(self, n: int) -> "Dataset":
        """The first ``n`` samples (all if fewer)."""
        labels = None if self.labels is None else self.labels[:n]
        return Dataset(self.source, self.samples[:n], labels, self.class_names)


def open_dataset(path: str | os.PathLike, labels: Sequence[str] | None = None) -> Dataset:
    """Open an ImageFolder directory or an ``.npz`` file.

    Args:
        path: the dataset.
        labels: the model's label names; class directories are matched against them.

    Raises:
        DatasetError: missing, empty or malformed.
    """
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"dataset {os.fspath(path)!r} does not exist")
    if p.is_file():
        if p.suffix != ".npz":
            raise DatasetError(f"dataset {str(p)!r}: expected a directory of images or an .npz file")
        return _open_npz(p)
    return _open_folder(p, labels)


def open_labelled(path: str | os.PathLike, labels: Sequence[str] | None = None, limit: int | None = None) -> Dataset:
    """:func:`open_dataset` for measuring accuracy: it must have labels; cut to ``limit`` samples.

    Raises:
        DatasetError: missing, malformed, or without labels.
    """
    dataset = open_dataset(path, labels)
    if not dataset.labelled:
        raise DatasetError(f"{os.fspath(path)}: has no labels (need class directories or 'y' in the .npz); "
                           "accuracy cannot be measured")
    return dataset.take(limit) if limit else dataset


def _open_npz(p: Path) -> Dataset:
    try:
        with np.load(p, allow_pickle=False) as data:
            if "x" not in data:
                raise DatasetError(f"{p}: .npz has no 'x' array (found {sorted(data.files)})")
            x = data["x"]
            y = data["y"] if "y" in data else None
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"{p}: cannot read .npz ({exc})") from None
    if len(x) == 0:
        raise DatasetError(f"{p}: 'x' is empty")
    if y is not None:
        if len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
            raise DatasetError(f"{p}: 'y' must hold one integer label per sample ({len(x)}), got {y.dtype} x {len(y)}")
        y = y.astype(np.int64)
    return Dataset(str(p), x, y)


def _open_folder(p: Path, labels: Sequence[str] | None) -> Dataset:
    classes = sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise DatasetError(f"{p}: no images found (expected class sub-directories or image files)")
        return Dataset(str(p), files, None)
    if labels:
        index = {name: i for i, name in enumerate(labels)}
        unknown = [c for c in classes if c not in index]
        if unknown:
            raise DatasetError(f"{p}: class directories {unknown[:5]} match no label of the model")
    else:
        index = {name: i for i, name in enumerate(classes)}
    samples, ys = [], []
    for c in classes:
        for f in sorted((p / c).iterdir()):
            if f.suffix.lower() in IMAGE_SUFFIXES:
                samples.append(f)
                ys.append(index[c])
    if not samples:
        raise DatasetError(f"{p}: class directories hold no images")
    return Dataset(str(p), samples, np.asarray(ys, dtype=np.int64), tuple(classes))
