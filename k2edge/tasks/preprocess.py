"""Input staging from the model card: decode, resize, pad and normalise an image (or take a tensor)
into one sample of the model input, and remember how to map boxes back to the original image.

Resizes (``[input] resize``):

* ``stretch``: to the input size, ignoring the aspect ratio (the default; what k2edge always did);
* ``letterbox``: keep the ratio, centre the image, pad both sides with ``pad_value`` (YOLO exports);
* ``pad-right``: keep the ratio, image at the top-left, pad right and bottom (text recognisers);
* ``center-crop``: the short side to the size, the centre cut out (torchvision's Resize + CenterCrop,
  as Ultralytics' classifiers).

Staging writes into a caller-provided buffer so a prefetch ring can reuse its memory. Pillow is
imported lazily; nothing here runs a model.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config.card import InputSpec, ModelCard
from ..errors import InputError

__all__ = ["Geometry", "Preprocess", "MAX_PIXELS"]

MAX_PIXELS = 64_000_000  # an input image larger than this is refused before it is decoded


@dataclass(frozen=True)
class Geometry:
    """Where an original image landed in the model input: ``input = original * scale + pad``.

    Attributes:
        width / height: the original image's size in pixels (for a tensor: the input's).
        scale_x / scale_y: input pixels per original pixel.
        pad_x / pad_y: input pixels left of / above the image.
    """

    width: int
    height: int
    scale_x: float = 1.0
    scale_y: float = 1.0
    pad_x: float = 0.0
    pad_y: float = 0.0

    @classmethod
    def identity(cls, width: int, height: int) -> "Geometry":
        """For a tensor input: boxes stay in input pixels."""
        return cls(width, height)

    def to_original(self, boxes: np.ndarray) -> np.ndarray:
        """Map (k, 4) ``x1 y1 x2 y2`` boxes in input pixels to the original image, clipped to it (float32)."""
        b = np.asarray(boxes, dtype=np.float32).reshape(-1, 4).copy()
        b[:, 0::2] -= self.pad_x
        b[:, 1::2] -= self.pad_y
        b[:, 0::2] /= self.scale_x
        b[:, 1::2] /= self.scale_y
        np.clip(b[:, 0::2], 0, self.width, out=b[:, 0::2])
        np.clip(b[:, 1::2], 0, self.height, out=b[:, 1::2])
        return b


def _reason(exc: BaseException) -> str:
    """A decoder's message without the Python object reprs some of them carry (``<_io.BytesIO object at 0x...>``)."""
    import re

    text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the data", str(exc))
    return text or type(exc).__name__


def image_error(exc: BaseException, path: str | os.PathLike | None = None) -> InputError:
    """The one message for an image Pillow refused (``exc``), naming the file when there is one."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(exc, Image.DecompressionBombError):
        return InputError(f"image refused: {_reason(exc)}")
    what = f" {str(path)!r}" if path is not None else ""
    reason = ("not in an image format Pillow reads (JPEG, PNG, BMP, WebP, ...)"
              if isinstance(exc, UnidentifiedImageError) else _reason(exc))
    return InputError(f"cannot decode image{what}: {reason}")


class Preprocess:
    """How to turn an image into one sample (C, H, W) or (H, W, C) of a model input.

    Args:
        spec: the resolved card's ``[input]`` (``size`` None: the model takes tensors only).
    """

    def __init__(self, spec: InputSpec) -> None:
        self.spec = spec
        self.color = spec.color or "RGB"
        self.height, self.width = spec.size or (0, 0)
        self.layout = spec.layout
        self.resize = spec.resize
        channels = 1 if self.color == "L" else 3
        self._scale = np.float32(spec.scale)
        self._mean = np.broadcast_to(np.asarray(spec.mean, np.float32), (channels,)).copy()
        self._std = np.broadcast_to(np.asarray(spec.std, np.float32), (channels,)).copy()

    @classmethod
    def from_card(cls, card: ModelCard) -> "Preprocess":
        return cls(card.input)

    @classmethod
    def for_model(cls, metadata: dict[str, str], input_shape: tuple, card: ModelCard | None = None) -> "Preprocess":
        """From a model's metadata and input shape (and a card over them): :func:`resolve_card`'s ``[input]``."""
        from ..config.card import resolve_card

        return cls.from_card(resolve_card("input", tuple(input_shape), metadata, card))

    @property
    def channels(self) -> int:
        return 1 if self.color == "L" else 3

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), Pillow's order."""
        return self.width, self.height

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        c, h, w = self.channels, self.height, self.width
        return (c, h, w) if self.layout == "NCHW" else (h, w, c)

    @property
    def takes_images(self) -> bool:
        return self.height > 0

    def fingerprint(self) -> str:
        """What staging depends on, for cache keys (INT8 ranges come from staged inputs)."""
        return self.spec.model_dump_json()

    def geometry(self, width: int, height: int) -> Geometry:
        """Where a ``width`` x ``height`` image lands in the input under this resize."""
        if self.resize == "stretch":
            return Geometry(width, height, self.width / width, self.height / height)
        if self.resize == "center-crop":
            # torchvision: Resize(int) scales the short side to it, the long side truncated; CenterCrop rounds
            if self.width == self.height:
                if width <= height:
                    new_w, new_h = self.width, int(self.width * height / width)
                else:
                    new_w, new_h = int(self.height * width / height), self.height
            else:  # Resize((h, w)) stretches, and the crop is the whole
                new_w, new_h = self.width, self.height
            left, top = int(round((new_w - self.width) / 2.0)), int(round((new_h - self.height) / 2.0))
            return Geometry(width, height, new_w / width, new_h / height, -left, -top)
        r = min(self.width / width, self.height / height)
        new_w, new_h = max(1, min(self.width, round(width * r))), max(1, min(self.height, round(height * r)))
        pad_x = pad_y = 0
        if self.resize == "letterbox":
            # centred; an odd padding puts the extra pixel right/bottom (as YOLO's letterbox does)
            pad_x, pad_y = (self.width - new_w) // 2, (self.height - new_h) // 2
        return Geometry(width, height, new_w / width, new_h / height, pad_x, pad_y)

    def stage(self, source, out: np.ndarray | None = None) -> np.ndarray:
        """Stage one sample into ``out`` (shape :attr:`sample_shape`, float32) and return it.

        Args:
            source: an image path, encoded image bytes, a PIL image, a uint8 image array (H, W) or
                (H, W, C), or a float tensor already shaped like one sample.

        Raises:
            InputError: the source cannot be decoded or does not fit the model.
        """
        return self.stage_mapped(source, out)[0]

    def stage_mapped(self, source, out: np.ndarray | None = None) -> tuple[np.ndarray, Geometry | None]:
        """:meth:`stage`, also returning where the image landed (None for a tensor-only model)."""
        if isinstance(source, np.ndarray) and source.dtype != np.uint8:
            if out is None:
                out = np.empty(self.sample_shape if self.takes_images else source.shape, dtype=np.float32)
            if source.shape != out.shape:
                raise InputError(f"tensor of shape {source.shape} does not fit the model sample shape {out.shape}")
            np.copyto(out, source, casting="same_kind")
            return out, (Geometry.identity(self.width, self.height) if self.takes_images else None)
        if not self.takes_images:
            raise InputError("this model takes tensors, not images")
        if out is None:
            out = np.empty(self.sample_shape, dtype=np.float32)
        placed = self._placed(source)
        if placed is None:
            pixels, geometry = self._pixels(source)
            self._normalise(pixels, out)
            return out, geometry
        # a decoded frame of the size it lands at (a camera at the model's aspect): straight into ``out``, the
        # padding written as the normalised pad value; the same float32 operations as through the canvas
        pixels, geometry = placed
        x, y = int(geometry.pad_x), int(geometry.pad_y)
        h, w = pixels.shape[:2]
        if self.layout == "NCHW":
            self._normalise(pixels, out[:, y:y + h, x:x + w])
            pads = (out[:, :y], out[:, y + h:], out[:, y:y + h, :x], out[:, y:y + h, x + w:])
        else:
            self._normalise(pixels, out[y:y + h, x:x + w])
            pads = (out[:y], out[y + h:], out[y:y + h, :x], out[y:y + h, x + w:])
        if any(p.size for p in pads):
            fill = np.empty(self.sample_shape[:1] + (1, 1) if self.layout == "NCHW" else (1, 1) + self.sample_shape[2:],
                            dtype=np.float32)
            self._normalise(np.full((1, 1, self.channels), self.spec.pad_value, dtype=np.uint8), fill)
            for p in pads:
                p[...] = fill
        return out, geometry

    def _normalise(self, pixels: np.ndarray, out: np.ndarray) -> None:
        """uint8 pixels (H, W[, C]) into ``out`` (float32, the layout's order): ``pixels * scale``, then ``- mean``
        and ``/ std`` where they are not 0 and 1 (those leave every float32 value as it is: the operations are skipped)."""
        if self.layout == "NCHW":
            np.multiply(pixels.reshape(pixels.shape[0], pixels.shape[1], -1).transpose(2, 0, 1), self._scale, out=out,
                        casting="unsafe")
            shape = (-1, 1, 1)
        else:
            np.multiply(pixels.reshape(out.shape), self._scale, out=out, casting="unsafe")
            shape = (-1,)
        if self._mean.any():
            out -= self._mean.reshape(shape)
        if (self._std != 1).any():
            out /= self._std.reshape(shape)

    def _placed(self, source) -> tuple[np.ndarray, Geometry] | None:
        """A uint8 array already in the card's colours and at the size it lands at (no resize, no conversion, no
        crop), in the card's channel order, and its geometry; None for anything else (staged through Pillow)."""
        if not isinstance(source, np.ndarray) or source.dtype != np.uint8 or self.resize == "center-crop":
            return None
        if not (source.ndim == 2 if self.color == "L" else source.ndim == 3 and source.shape[2] == 3):
            return None
        height, width = source.shape[:2]
        geometry = self.geometry(width, height)
        if (round(geometry.width * geometry.scale_x), round(geometry.height * geometry.scale_y)) != (width, height):
            return None
        return (source[..., ::-1] if self.color == "BGR" else source), geometry

    def _pixels(self, source) -> tuple[np.ndarray, Geometry]:
        """The image as uint8 (H, W[, C]) of the input size, resized and padded, and its geometry."""
        from PIL import Image, UnidentifiedImageError

        mode = "L" if self.color == "L" else "RGB"
        try:
            if isinstance(source, np.ndarray):
                if source.dtype != np.uint8 or not (source.ndim == 2 or (source.ndim == 3 and source.shape[2] in (1, 3, 4))):
                    raise InputError(f"an image array must be uint8 (H, W), (H, W, 1), (H, W, 3) or (H, W, 4); got "
                                     f"{source.dtype} {tuple(source.shape)}")
                img = Image.fromarray(source[:, :, 0] if source.ndim == 3 and source.shape[2] == 1 else source)
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
            geometry = self.geometry(*img.size)
            target = (round(geometry.width * geometry.scale_x), round(geometry.height * geometry.scale_y))
            if self.spec.draft and not isinstance(source, (np.ndarray, Image.Image)):
                # JPEG: let the decoder scale down in the DCT domain (up to 8x) before we resize.
                img.draft(mode, target)
            if img.mode != mode:
                img = img.convert(mode)
            if img.size != target and self.spec.interpolation == "antialias":
                img = img.resize(target, Image.Resampling.BILINEAR)
            arr = np.asarray(img)
            if arr.shape[1::-1] != target:
                from .resize import resize

                arr = resize(arr, target[0], target[1], self.spec.interpolation)
        except InputError:
            raise
        except (Image.DecompressionBombError, UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise image_error(exc, source if isinstance(source, (str, os.PathLike)) else None) from None
        if self.color == "BGR":
            arr = arr[..., ::-1]
        if self.resize == "center-crop":
            x, y = -int(geometry.pad_x), -int(geometry.pad_y)
            arr = np.ascontiguousarray(arr[y:y + self.height, x:x + self.width])
        elif target != (self.width, self.height):
            canvas = np.full((self.height, self.width, *arr.shape[2:]), self.spec.pad_value, dtype=np.uint8)
            x, y = int(geometry.pad_x), int(geometry.pad_y)
            canvas[y:y + target[1], x:x + target[0]] = arr
            arr = canvas
        return arr, geometry
