"""A snapshot: the frame an event was raised on, as JPEG, with the stream's zones and lines, the
event's zone or line highlighted, and the track's box and label drawn (Pillow, imported lazily)."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

BOX_COLOUR = (255, 0, 255)  # the event's track: one colour, whatever its class, so a reader finds it
JPEG_QUALITY = 85


@dataclass(frozen=True)
class Snapshot:
    """An encoded snapshot.

    Attributes:
        jpeg: the JPEG bytes.
        width / height: its size in pixels (the source frame's).
    """

    jpeg: bytes
    width: int
    height: int


def render_snapshot(image: np.ndarray, event: dict, zones=(), lines=(), quality: int = JPEG_QUALITY) -> Snapshot:
    """Draw and encode one event's snapshot.

    Args:
        image: the frame, (H, W, 3) uint8 RGB (not modified).
        event: the event (``track_id``, ``label``, ``box``; ``zone`` or ``line``).
        zones: the stream's ``(name, points)``.
        lines: the stream's ``(name, start, end)``.
        quality: JPEG quality.

    Raises:
        ValueError: ``image`` is not an RGB frame.
    """
    from PIL import Image, ImageDraw

    from ...drawing import draw_zones_and_lines

    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"a snapshot needs an (H, W, 3) uint8 frame, got {image.dtype} {image.shape}")
    img = Image.fromarray(image)  # a copy: the frame itself stays as it was
    draw_zones_and_lines(img, zones, lines, highlight=event.get("zone") or event.get("line"))
    box = event.get("box")
    if box is not None:
        draw = ImageDraw.Draw(img)
        width = max(2, round(max(img.size) / 240))
        x1, y1, x2, y2 = (float(v) for v in box)
        draw.rectangle((x1, y1, x2, y2), outline=BOX_COLOUR, width=width)
        text = f"{event.get('label')} #{event.get('track_id')}"
        left, top, right, bottom = draw.textbbox((0, 0), text)
        ty = y1 - (bottom - top) - 3 if y1 - (bottom - top) - 3 >= 0 else y2 + 1
        draw.rectangle((x1, ty, x1 + (right - left) + 4, ty + (bottom - top) + 2), fill=BOX_COLOUR)
        draw.text((x1 + 2, ty), text, fill=(255, 255, 255))
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=quality)
    return Snapshot(out.getvalue(), img.width, img.height)
