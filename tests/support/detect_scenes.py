"""Scenes for the hand-weighted grid detector (tests/support/graphs.py): white and red squares on a dark,
slightly noisy background, with their COCO annotations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

LABELS = ("white", "red")
COLOURS = {0: (255, 255, 255), 1: (255, 0, 0)}


def scene(rng, width: int, height: int, n: int = 4, cell: int | None = None):
    """An image with ``n`` squares and their boxes [(x1, y1, x2, y2, class)]; squares on a ``cell`` grid if given."""
    arr = rng.integers(0, 40, (height, width, 3)).astype(np.uint8)
    boxes = []
    for _ in range(n):
        c = int(rng.integers(2))
        if cell:
            x, y = int(rng.integers(width // cell)) * cell, int(rng.integers(height // cell)) * cell
            side = cell
        else:
            side = int(rng.integers(max(8, min(width, height) // 8), max(9, min(width, height) // 3)))
            x, y = int(rng.integers(0, width - side)), int(rng.integers(0, height - side))
        if any(not (x + side <= b[0] or b[2] <= x or y + side <= b[1] or b[3] <= y) for b in boxes):
            continue
        arr[y:y + side, x:x + side] = COLOURS[c]
        boxes.append((x, y, x + side, y + side, c))
    return arr, boxes


def write_coco(folder: Path, images: list[tuple[str, np.ndarray, list]]) -> Path:
    """Save the images as PNG under ``folder/images`` and a COCO annotation file beside them."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    doc = {"images": [], "annotations": [], "categories": [{"id": 10 + i, "name": n} for i, n in enumerate(LABELS)]}
    for i, (name, arr, boxes) in enumerate(images, start=1):
        Image.fromarray(arr).save(folder / "images" / name)
        doc["images"].append({"id": i, "file_name": f"images/{name}", "width": arr.shape[1], "height": arr.shape[0]})
        for x1, y1, x2, y2, c in boxes:
            doc["annotations"].append({"id": len(doc["annotations"]) + 1, "image_id": i, "category_id": 10 + c,
                                       "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    path = folder / "annotations.json"
    path.write_text(json.dumps(doc))
    return path
