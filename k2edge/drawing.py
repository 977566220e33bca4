"""Drawing on an image (Pillow, imported lazily), for ``k2edge infer --save-annotated``, ``k2edge watch``,
stream snapshots and the live view: answers (boxes and labels; a segmentation's masks tinted in; a
pose's keypoints (visible ones) and skeleton-free dots; an obb's rotated boxes as polygons), and a
stream's zones and lines."""

from __future__ import annotations

import math
from pathlib import Path

_COLOURS = ((230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
            (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212))


def _corners(cx: float, cy: float, w: float, h: float, angle: float) -> list[tuple[float, float]]:
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + dx * c - dy * s, cy + dx * s + dy * c) for dx, dy in
            ((-w / 2, -h / 2), (w / 2, -h / 2), (w / 2, h / 2), (-w / 2, h / 2))]


def annotate(image_path: Path, detections: list[dict], out: Path) -> None:
    """Write ``image_path`` with each detection drawn on it (box or rbox, mask, keypoints, ``label score``) to ``out``."""
    from PIL import Image

    draw_detections(Image.open(image_path).convert("RGB"), detections).save(out)


def draw_detections(img, detections: list[dict]):
    """``img`` (a PIL RGB image) with each detection drawn on it; a ``track_id`` is shown as ``#id``."""
    import numpy as np
    from PIL import Image, ImageDraw

    if any("mask" in d for d in detections):
        from .tasks.segmentation import rle_decode

        arr = np.asarray(img).copy()
        for d in detections:
            m = rle_decode(d["mask"])
            if m.shape == arr.shape[:2]:
                colour = np.array(_COLOURS[d["index"] % len(_COLOURS)], np.float32)
                arr[m] = (arr[m] * 0.5 + colour * 0.5).astype(np.uint8)
        img = Image.fromarray(arr)
    draw = ImageDraw.Draw(img)
    width = max(1, round(max(img.size) / 300))
    for d in detections:
        colour = _COLOURS[d["index"] % len(_COLOURS)]
        if "rbox" in d:
            pts = _corners(*d["rbox"])
            draw.polygon(pts, outline=colour, width=width)
            x1, y1 = min(p[0] for p in pts), min(p[1] for p in pts)
        else:
            x1, y1, x2, y2 = d["box"]
            draw.rectangle((x1, y1, x2, y2), outline=colour, width=width)
        for x, y, score in d.get("keypoints", ()):
            if score >= 0.5:
                r = width + 1
                draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
        text = f"{d['label']} {d['score']:.2f}" + (f" #{d['track_id']}" if d.get("track_id") is not None else "")
        left, top, right, bottom = draw.textbbox((x1, y1), text)
        top_y = y1 - (bottom - top) - 2 if y1 - (bottom - top) - 2 >= 0 else y1
        draw.rectangle((x1, top_y, x1 + (right - left) + 4, top_y + (bottom - top) + 2), fill=colour)
        draw.text((x1 + 2, top_y), text, fill=(0, 0, 0))
    return img


ZONE_COLOUR = (255, 200, 0)
LINE_COLOUR = (0, 220, 255)
HIGHLIGHT = (255, 120, 0)  # the zone or line an event is about (orange: apart from the snapshot box)


def draw_zones_and_lines(img, zones, lines, highlight: str | None = None):
    """``img`` (a PIL RGB image) with ``zones`` (``(name, points)``) outlined and ``lines`` (``(name, start,
    end)``) drawn, each named; the one called ``highlight`` in :data:`HIGHLIGHT`."""
    from PIL import ImageDraw

    draw = ImageDraw.Draw(img)
    width = max(1, round(max(img.size) / 320))
    for name, points in zones:
        colour = HIGHLIGHT if name == highlight else ZONE_COLOUR
        pts = [tuple(map(float, p)) for p in points]
        draw.line(pts + pts[:1], fill=colour, width=width)
        draw.text((pts[0][0] + 3, pts[0][1] + 2), name, fill=colour)
    for name, start, end in lines:
        colour = HIGHLIGHT if name == highlight else LINE_COLOUR
        draw.line([tuple(map(float, start)), tuple(map(float, end))], fill=colour, width=width + 1)
        draw.text((float(start[0]) + 3, float(start[1]) + 2), name, fill=colour)
    return img
