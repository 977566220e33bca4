"""Calibration and evaluation sets.

Two formats:

* an ImageFolder-style directory: one sub-directory per class holding images (the class names
  are matched against the model's labels, else sorted); a flat directory of images is unlabelled;
* an ``.npz`` file with ``x`` (uint8 images (N, H, W[, C]) or float tensors shaped like the model
  input samples) and optional integer labels ``y``.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..errors import DatasetError
from ..readfile import load_numpy

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm", ".pgm")


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

    def digests(self, indices: Sequence[int] | None = None) -> Iterator[bytes]:
        """A digest of each sample's data (the file's bytes, or the array row's), in order, read as they are taken:
        equal data, equal digest."""
        for i in range(len(self)) if indices is None else indices:
            sample = self.samples[i]
            data = np.ascontiguousarray(sample).tobytes() if isinstance(sample, np.ndarray) else Path(sample).read_bytes()
            yield hashlib.blake2b(data, digest_size=16).digest()

    def take_round_robin(self, n: int) -> "Dataset":
        """``n`` samples taken from each label in turn (each label's in their order): a subset with every class,
        from a set stored class by class. Without labels, the first ``n``."""
        if self.labels is None or n >= len(self):
            return self.take(n)
        by_label: dict[int, list[int]] = {}
        for i, y in enumerate(np.asarray(self.labels).tolist()):
            by_label.setdefault(int(y), []).append(i)
        queues = [by_label[k] for k in sorted(by_label)]
        order: list[int] = []
        for rank in range(max(len(q) for q in queues)):
            order += [q[rank] for q in queues if rank < len(q)]
        keep = order[:n]
        return Dataset(self.source, [self.samples[i] for i in keep], np.asarray(self.labels)[keep], self.class_names)

    def take(self, n: int) -> "Dataset":
        """The first ``n`` samples (all if fewer)."""
        labels = None if self.labels is None else self.labels[:n]
        return Dataset(self.source, self.samples[:n], labels, self.class_names)


def existing(path: str | os.PathLike, what: str = "dataset") -> Path:
    """``path``, which must name something (a file or a folder): told before a command builds an engine.

    Raises:
        DatasetError: nothing is there.
    """
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"{what} {os.fspath(path)!r} does not exist")
    return p


def open_dataset(path: str | os.PathLike, labels: Sequence[str] | None = None, what: str = "dataset") -> Dataset:
    """Open an ImageFolder directory or an ``.npz`` file.

    Args:
        path: the dataset.
        labels: the model's label names; class directories are matched against them.

    Raises:
        DatasetError: missing, empty or malformed.
    """
    p = existing(path, what)
    if p.is_file():
        if p.suffix != ".npz":
            coco = " (a COCO .json is a detector's evaluation set)" if is_coco(p) else ""
            raise DatasetError(f"{what} {str(p)!r}: expected a directory of images or an .npz file{coco}")
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
    if labels and isinstance(dataset.labels, np.ndarray) and len(dataset.labels):
        low, high = int(dataset.labels.min()), int(dataset.labels.max())
        if low < 0 or high >= len(labels):
            raise DatasetError(f"{os.fspath(path)}: 'y' holds labels {low}..{high}, but the model has {len(labels)} "
                               f"classes (0..{len(labels) - 1})")
    if not limit:
        return dataset
    # a folder lists class by class: its first N would all be class 0; take from each class in turn instead
    return dataset.take_round_robin(limit) if not isinstance(dataset.samples, np.ndarray) else dataset.take(limit)


def _open_npz(p: Path) -> Dataset:
    try:
        loaded = load_numpy(p)
        if isinstance(loaded, np.ndarray):
            raise DatasetError(f"{p}: a .npy array, not an .npz archive holding 'x' (and 'y'); save one with numpy.savez")
        with loaded as data:
            if "x" not in data:
                raise DatasetError(f"{p}: .npz has no 'x' array (found {sorted(data.files)})")
            x = data["x"]
            y = data["y"] if "y" in data else None
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"{p}: cannot read .npz ({exc})") from None
    if x.ndim == 0 or x.dtype.kind not in "uif":
        raise DatasetError(f"{p}: 'x' must be an array of samples (numbers, one per row), got {x.dtype} of shape "
                           f"{tuple(x.shape)}")
    if len(x) == 0:
        raise DatasetError(f"{p}: 'x' is empty")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = int((~np.isfinite(x.reshape(len(x), -1))).any(axis=1).sum())
        raise DatasetError(f"{p}: 'x' holds NaN or infinite values ({bad} of {len(x)} samples)")
    if y is not None:
        if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
            raise DatasetError(f"{p}: 'y' must hold one integer label per sample, {len(x)} in one row, got {y.dtype} "
                               f"of shape {tuple(y.shape)}")
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


@dataclass
class CocoDataset:
    """A COCO-format detection set: images (paths relative to the annotation file's folder) and
    ground truth, with category ids mapped to label indices by the order of ``categories``.

    Attributes:
        source: the annotation file.
        samples: image paths, in the file's ``images`` order.
        image_ids: the COCO image id of each sample.
        category_ids: the COCO category id of label index i (``categories`` order).
        class_names: the categories' names, in order.
        ground_truth: the annotation document, completed where COCO tools need it (area, iscrowd).
    """

    source: str
    samples: list
    image_ids: list[int]
    category_ids: list[int]
    class_names: tuple[str, ...]
    ground_truth: dict

    def __len__(self) -> int:
        return len(self.samples)

    def fingerprint(self) -> str:
        """sha256 of the images and the ground truth, for cache keys and resumable sweeps."""
        import json

        h = hashlib.sha256(json.dumps(self.ground_truth, sort_keys=True, default=str).encode())
        for p in self.samples:
            h.update(Path(p).read_bytes())
        return h.hexdigest()

    def take(self, n: int) -> "CocoDataset":
        """The first ``n`` images and their annotations."""
        keep = set(self.image_ids[:n])
        gt = dict(self.ground_truth)
        gt["images"] = [im for im in gt["images"] if im["id"] in keep]
        gt["annotations"] = [a for a in gt["annotations"] if a["image_id"] in keep]
        return CocoDataset(self.source, self.samples[:n], self.image_ids[:n], self.category_ids, self.class_names, gt)


def is_coco(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a COCO annotation file (a ``.json``)."""
    return Path(path).suffix.lower() == ".json"


def open_coco(path: str | os.PathLike, labels: Sequence[str] | None = None, limit: int | None = None) -> CocoDataset:
    """Open a COCO-format annotation file for detection evaluation.

    Args:
        path: the ``.json`` file; ``file_name``s are relative to its folder.
        labels: the model's labels; the categories' names must match them, in order.
        limit: keep the first ``limit`` images only.

    Raises:
        DatasetError: missing, not JSON, malformed, categories that do not match the labels, or
            missing image files.
    """
    import json

    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset {os.fspath(path)!r} does not exist")
    if p.suffix.lower() in (".npz", ".npy"):
        raise DatasetError(f"{p}: a detector is evaluated on a COCO annotation file (.json: images, annotations, "
                           "categories), not on labelled samples")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DatasetError(f"{p}: not a readable JSON annotation file ({exc})") from None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), list) for k in ("images", "annotations", "categories")):
        raise DatasetError(f"{p}: a COCO annotation file needs 'images', 'annotations' and 'categories' lists")
    try:
        categories = [(int(c["id"]), str(c["name"])) for c in doc["categories"]]
        images = [(int(im["id"]), str(im["file_name"])) for im in doc["images"]]
        anns = []
        for a in doc["annotations"]:
            x, y, w, h = (float(v) for v in a["bbox"])
            anns.append({**a, "id": int(a.get("id", len(anns) + 1)), "image_id": int(a["image_id"]),
                         "category_id": int(a["category_id"]), "bbox": [x, y, w, h], "area": float(a.get("area", w * h)),
                         "iscrowd": int(a.get("iscrowd", 0))})
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{p}: malformed COCO entry ({type(exc).__name__}: {exc})") from None
    if not categories or not images:
        raise DatasetError(f"{p}: no categories or no images")
    names = tuple(n for _, n in categories)
    if labels and tuple(labels) != names:
        differ = next((i for i, (a, b) in enumerate(zip(names, labels)) if a != b), min(len(names), len(labels)))
        raise DatasetError(f"{p}: its {len(names)} categories do not match the model's {len(labels)} labels from index "
                           f"{differ} ({list(names[differ:differ + 3])} against {list(labels[differ:differ + 3])}; category "
                           "ids map to label indices by the order of 'categories', and names must match)")
    known = {i for i, _ in categories}
    stray = sorted({a["category_id"] for a in anns} - known)
    if stray:
        raise DatasetError(f"{p}: annotations use category id(s) {stray[:5]} not listed in 'categories'")
    _check_coco_entries(p, images, anns)
    if limit:
        images = images[:limit]
    samples = [p.parent / name for _, name in images]
    missing = [s for s in samples if not s.is_file()]
    if missing:
        what = "name a folder, not an image" if all(s.is_dir() for s in missing) else "missing"
        raise DatasetError(f"{p}: {len(missing)} image file(s) {what}, e.g. {str(missing[0])!r} (file_name is relative to "
                           "the annotation file's folder)")
    keep = {i for i, _ in images}
    gt = {"images": [im for im in doc["images"] if int(im["id"]) in keep],
          "annotations": [a for a in anns if a["image_id"] in keep], "categories": doc["categories"]}
    if not gt["annotations"]:  # pycocotools gives -1 (undefined), which would read as an mAP of 0
        raise DatasetError(f"{p}: no ground-truth box on {'the first ' if limit else ''}{len(images)} image(s): mAP is "
                           "undefined without any; annotate the objects the model should find")
    return CocoDataset(str(p), samples, [i for i, _ in images], [i for i, _ in categories], names, gt)


def _check_coco_entries(p: Path, images: list[tuple[int, str]], anns: list[dict]) -> None:
    """Every image id once; every box finite with a positive width and height, on a listed image: a broken entry
    would change the mAP silently (pycocotools scores what it is given)."""
    ids = [i for i, _ in images]
    twice = sorted(i for i, n in Counter(ids).items() if n > 1)
    if twice:
        raise DatasetError(f"{p}: image id(s) {twice[:5]} appear more than once in 'images'")
    listed = set(ids)
    for n, a in enumerate(anns):
        x, y, w, h = a["bbox"]
        if not all(math.isfinite(v) for v in (x, y, w, h)) or w <= 0 or h <= 0:
            raise DatasetError(f"{p}: annotations[{n}] (id {a['id']}): bbox {[x, y, w, h]} must be finite [x, y, width, "
                               "height] with a width and height above 0")
        if a["image_id"] not in listed:
            raise DatasetError(f"{p}: annotations[{n}] (id {a['id']}): image_id {a['image_id']} is not in 'images'")


def open_calibration(path: str | os.PathLike, labels: Sequence[str] | None = None, what: str = "calibration set") -> Dataset:
    """Open a calibration (or INT8 check) set: a folder of images (flat or by class), an ``.npz`` with ``x``,
    or a COCO annotation ``.json`` (its images; the annotations are not needed).

    Raises:
        DatasetError: missing, empty, or with files that cannot be read -- one message naming them.
    """
    p = Path(path)
    if not is_coco(p):
        dataset = open_dataset(p, labels, what)
    else:
        if not p.is_file():
            raise DatasetError(f"{what} {os.fspath(path)!r} does not exist")
        import json

        try:
            doc = json.loads(p.read_text())
            names = [im["file_name"] for im in doc["images"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DatasetError(f"{p}: not a COCO annotation file with images[].file_name ({exc})") from None
        if not names:
            raise DatasetError(f"{p}: lists no images")
        dataset = Dataset(str(p), [p.parent / n for n in names], None)
    if isinstance(dataset.samples, np.ndarray):
        return dataset
    missing = [str(s) for s in dataset.samples if not Path(s).is_file()]
    unreadable = [] if missing else _unreadable_images(dataset.samples)
    bad = missing or unreadable
    if bad:
        folders = all(Path(s).is_dir() for s in missing)
        what = ("folders, not images" if folders else "missing") if missing else "unreadable (not an image)"
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise DatasetError(f"{dataset.source}: {len(bad)} of {len(dataset)} image(s) {what}: {', '.join(bad[:3])}{more}")
    return dataset


def check_fits(dataset: Dataset, sample_shape: tuple[int, ...], role: str) -> None:
    """Refuse a tensor set whose samples cannot feed the model, before any work is done on it (a calibration that
    takes minutes must not end in this). Images (and uint8 arrays, which are images) are resized when staged.

    Args:
        sample_shape: one sample of the model's input, the batch axis left out.
        role: what the set is for, in the message (``calibration set``, ``check set``).

    Raises:
        DatasetError: one message naming the set, its sample shape and the model's.
    """
    x = dataset.samples
    static = all(isinstance(d, int) and d > 0 for d in sample_shape)
    if static and isinstance(x, np.ndarray) and x.dtype != np.uint8 and tuple(x.shape[1:]) != tuple(sample_shape):
        raise DatasetError(f"{role} {dataset.source}: samples of shape {tuple(x.shape[1:])} do not fit the model's "
                           f"input, one sample of which is {tuple(sample_shape)}")


def _unreadable_images(paths) -> list[str]:
    """Paths whose header Pillow cannot read (cheap: ``Image.open`` reads only the header)."""
    from PIL import Image, UnidentifiedImageError

    bad = []
    for s in paths:
        try:
            with Image.open(s) as im:
                im.size
        except (OSError, UnidentifiedImageError):
            bad.append(str(s))
    return bad
