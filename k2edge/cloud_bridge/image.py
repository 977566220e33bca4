"""Images for the cloud: decode, downscale (pixels cost tokens), and wrap as a base64 data URL
with the MIME type of the bytes actually sent (sniffed, never trusted from the caller)."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

from .errors import CloudRejected

__all__ = ["PreparedImage", "prepare_image", "MIME_BY_FORMAT"]

MIME_BY_FORMAT = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
# Formats re-encoded as themselves after a resize; anything else (BMP, TIFF, a GIF's frames) becomes PNG.
_KEEP_FORMAT = {"PNG", "JPEG", "WEBP"}


@dataclass(frozen=True)
class PreparedImage:
    """An image ready to send."""

    data: bytes
    mime: str
    width: int
    height: int
    resized: bool
    original_width: int = 0
    original_height: int = 0

    def scale_boxes(self, boxes) -> list[list[float]]:
        """``x1 y1 x2 y2`` boxes in the original image's pixels -> in this (downscaled) image's pixels."""
        sx = self.width / (self.original_width or self.width)
        sy = self.height / (self.original_height or self.height)
        return [[round(b[0] * sx, 1), round(b[1] * sy, 1), round(b[2] * sx, 1), round(b[3] * sy, 1)] for b in boxes]

    @property
    def base64(self) -> str:
        return base64.b64encode(self.data).decode("ascii")

    @property
    def data_url(self) -> str:
        return f"data:{self.mime};base64,{self.base64}"


def prepare_image(data: bytes, max_side: int = 768) -> PreparedImage:
    """Decode ``data``, downscale it so its longer side is at most ``max_side``, and pick its MIME type.

    Images already small enough in PNG/JPEG/WEBP/GIF go as they are; larger ones are resized
    (Lanczos) and re-encoded in their own format (JPEG quality 90), other formats as PNG.

    Raises:
        CloudRejected: the bytes are not an image Pillow can decode.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise CloudRejected(f"the image could not be decoded ({type(exc).__name__}); send JPEG, PNG, WEBP or GIF") from None
    fmt = (img.format or "").upper()
    w, h = img.size
    if max(w, h) <= max_side and fmt in MIME_BY_FORMAT:
        return PreparedImage(bytes(data), MIME_BY_FORMAT[fmt], w, h, False, w, h)
    scale = min(1.0, max_side / max(w, h))
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    out_fmt = fmt if fmt in _KEEP_FORMAT else "PNG"
    if out_fmt == "JPEG" and img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    elif out_fmt in ("PNG", "WEBP") and img.mode not in ("RGB", "RGBA", "L", "LA"):
        img = img.convert("RGBA" if "transparency" in img.info or img.mode in ("P", "PA") else "RGB")
    if size != img.size:
        img = img.resize(size, Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format=out_fmt, **({"quality": 90} if out_fmt in ("JPEG", "WEBP") else {}))
    return PreparedImage(buf.getvalue(), MIME_BY_FORMAT[out_fmt], size[0], size[1], size != (w, h), w, h)
