"""Input staging: decode, resize and normalise an image (or take a tensor) into a model input.

A model says how its inputs are prepared in its ONNX metadata under ``k2edge.preprocess``::

    {"color": "L", "size": [32, 32], "layout": "NCHW", "scale": 0.0039215686, "mean": [0.1], "std": [0.3]}

Models without it get a default derived from the input shape (3 channels -> RGB, 1 -> L; pixels
scaled to [0, 1]). Staging writes into a caller-provided buffer so a prefetch ring can reuse its
preallocated memory.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError, ModelError

METADATA_KEY = "k2edge.preprocess"
MAX_PIXELS = 64_000_000  # an input image larger than this is refused before it is decoded
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm", ".pgm")


@dataclass(frozen=True)
class Preprocess:
    """How to turn an image into one sample (C, H, W) of a model input."""

    color: str  # Pillow mode: "L" or "RGB"
    size: tuple[int, int]  # (width, height)
    scale: float = 1 / 255
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    layout: str = "NCHW"

    @property
    def channels(self) -> int:
        return 1 if self.color == "L" else 3

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        w, h = self.size
        return (self.channels, h, w) if self.layout == "NCHW" else (h, w, self.channels)

    @classmethod
    def for_model(cls, metadata: dict[str, str], input_shape: tuple[int, ...]) -> "Preprocess":
        """From the model's metadata, or a default fitting ``input_shape`` (N, C, H, W)."""
        raw = metadata.get(METADATA_KEY)
        if raw:
            try:
                spec = json.loads(raw)
                pre = cls(
                    color=spec.get("color", "RGB"),
                    size=tuple(spec["size"]),
                    scale=float(spec.get("scale", 1 / 255)),
                    mean=tuple(spec.get("mean", (0.0,))),
                    std=tuple(spec.get("std", (1.0,))),
                    layout=spec.get("layout", "NCHW"),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ModelError(f"model metadata {METADATA_KEY!r} is malformed: {exc}") from None
            if pre.color not in ("L", "RGB") or pre.layout not in ("NCHW", "NHWC"):
                raise ModelError(f"model metadata {METADATA_KEY!r}: color must be L or RGB, layout NCHW or NHWC")
            return pre
        if len(input_shape) != 4 or input_shape[1] not in (1, 3):
            return cls(color="RGB", size=(0, 0))  # not an image model: tensors only
        return cls(color="L" if input_shape[1] == 1 else "RGB", size=(input_shape[3], input_shape[2]))

    @property
    def takes_images(self) -> bool:
        return self.size != (0, 0)

    def stage(self, source, out: np.ndarray | None = None) -> np.ndarray:
        """Stage one sample into ``out`` (shape :attr:`sample_shape`, float32) and return it.

        Args:
            source: an image path, encoded image bytes, a PIL image, a uint8 image array (H, W) or
                (H, W, C), or a float tensor already shaped like one sample.

        Raises:
            InputError: the source cannot be decoded or does not fit the model.
        """
        if out is None:
            out = np.empty(self.sample_shape, dtype=np.float32)
        if isinstance(source, np.ndarray) and source.dtype != np.uint8:
            if source.shape != out.shape:
                raise InputError(f"tensor of shape {source.shape} does not fit the model sample shape {out.shape}")
            np.copyto(out, source, casting="same_kind")
            return out
        if not self.takes_images:
            raise InputError("this model takes tensors, not images")
        pixels = self._pixels(source)
        mean = np.asarray(self.mean, dtype=np.float32)
        std = np.asarray(self.std, dtype=np.float32)
        if self.layout == "NCHW":
            chw = pixels.reshape(pixels.shape[0], pixels.shape[1], -1).transpose(2, 0, 1)
            np.multiply(chw, np.float32(self.scale), out=out, casting="unsafe")
            out -= mean.reshape(-1, 1, 1)
            out /= std.reshape(-1, 1, 1)
        else:
            np.multiply(pixels.reshape(out.shape), np.float32(self.scale), out=out, casting="unsafe")
            out -= mean
            out /= std
        return out

    def _pixels(self, source) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        try:
            if isinstance(source, np.ndarray):
                img = Image.fromarray(source)
            elif isinstance(source, Image.Image):
                img = source
            else:
                if isinstance(source, (str, os.PathLike)):
                    path = Path(source)
                    if not path.is_file():
                        raise InputError(f"input file {str(path)!r} does not exist")
                    img = Image.open(path)
                elif isinstance(source, (bytes, bytearray, memoryview)):
                    img = Image.open(io.BytesIO(bytes(source)))
                else:
                    raise InputError(f"cannot stage an input of type {type(source).__name__}")
                if img.size[0] * img.size[1] > MAX_PIXELS:
                    raise InputError(f"image of {img.size[0]}x{img.size[1]} pixels exceeds the limit of {MAX_PIXELS:,}")
                # JPEG: let the decoder scale down in the DCT domain (up to 8x) before we resize.
                img.draft(self.color, self.size)
            if img.mode != self.color:
                img = img.convert(self.color)
            if img.size != self.size:
                img = img.resize(self.size, Image.Resampling.BILINEAR)
            return np.asarray(img)
        except InputError:
            raise
        except Image.DecompressionBombError as exc:
            raise InputError(f"image refused: {exc}") from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise InputError(f"cannot decode image: {exc}") from None
