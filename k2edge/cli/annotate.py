"""Drawing detections on an image for ``k2edge infer --save-annotated`` (Pillow, imported lazily)."""

from __future__ import annotations

from pathlib import Path

_COLOURS = ((230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
            (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212))


def annotate(image_path: Path, detections: list[dict], out: Path) -> None:
    """Write ``image_path`` with each detection's box and ``label score`` drawn on it to ``out``."""
    from PIL import Image, ImageDraw

    img = Image.open(image_path).convert("RGB")
    draw = ImageDraw.Draw(img)
    width = max(1, round(max(img.size) / 300))
    for d in detections:
        colour = _COLOURS[d["index"] % len(_COLOURS)]
        x1, y1, x2, y2 = d["box"]
        draw.rectangle((x1, y1, x2, y2), outline=colour, width=width)
        text = f"{d['label']} {d['score']:.2f}"
        left, top, right, bottom = draw.textbbox((x1, y1), text)
        top_y = y1 - (bottom - top) - 2 if y1 - (bottom - top) - 2 >= 0 else y1
        draw.rectangle((x1, top_y, x1 + (right - left) + 4, top_y + (bottom - top) + 2), fill=colour)
        draw.text((x1 + 2, top_y), text, fill=(0, 0, 0))
    img.save(out)
