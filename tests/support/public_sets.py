"""Calibration and check sets for the public INT8 models, made at run time from the installed packages only
(scikit-image's photos and its bundled LFW faces, matplotlib's photos and fonts; nothing downloaded).

* :func:`detector_set`: scenes with people: a scene photo (scikit-image's chelsea, coffee, rocket, ... or
  matplotlib's) with one to three face photos pasted in (the astronaut, the cameraman, Grace Hopper: random crops,
  scales, mirror images, light) and LFW faces (25 x 25 grey, scaled up), for NudeNet's face and body classes;
* :func:`textline_set`: rendered text lines, half turned 180 degrees (an ImageFolder ``0`` / ``180``), with the
  fixture builder's renderer (``tools/make_int8_fixtures.py``: matplotlib's fonts, plain, gradient and photo
  backgrounds);
* :func:`page_set`: 480 x 480 "pages" for a text detector: several rendered lines placed on a light background
  or a faded photo.

Every set is a pure function of its size and seed.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
FACE_PHOTOS = (("skimage", "astronaut.png"), ("skimage", "camera.png"), ("matplotlib", "grace_hopper.jpg"))
SCENES = (("skimage", f) for f in ("chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "horse.png",
                                   "hubble_deep_field.jpg", "coins.png", "moon.png", "clock_motion.png", "brick.png",
                                   "grass.png", "gravel.png", "retina.jpg", "ihc.png"))


@lru_cache(maxsize=1)
def _fixtures():
    """tools/make_int8_fixtures.py as a module (its sample-file locator and text-line renderer)."""
    spec = importlib.util.spec_from_file_location("make_int8_fixtures", ROOT / "tools" / "make_int8_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=4)
def _photos(which: str) -> tuple:
    fx = _fixtures()
    files = FACE_PHOTOS if which == "faces" else tuple(SCENES)
    return tuple(fx.rgb(fx.sample_file(p, f)).convert("RGB") for p, f in files)


@lru_cache(maxsize=1)
def _lfw() -> np.ndarray:
    import skimage.data

    return np.load(Path(skimage.data.__file__).parent / "lfw_subset.npy")[:100]  # the first 100 are faces


def _crop(rng: np.random.Generator, img: Image.Image, low: float) -> Image.Image:
    w, h = img.size
    cw, ch = int(w * rng.uniform(low, 1.0)), int(h * rng.uniform(low, 1.0))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    return img.crop((x, y, x + cw, y + ch))


def detector_image(rng: np.random.Generator) -> Image.Image:
    """One scene with faces (see the module docstring)."""
    scenes, faces = _photos("scenes"), _photos("faces")
    side = int(rng.integers(320, 481))
    back = _crop(rng, scenes[rng.integers(len(scenes))], 0.4).resize((side, int(side * rng.uniform(0.6, 1.0))))
    for _ in range(int(rng.integers(1, 4))):
        if rng.random() < 0.7:
            face = _crop(rng, faces[rng.integers(len(faces))], 0.5)
            size = int(side * rng.uniform(0.3, 0.7))
        else:
            face = Image.fromarray((_lfw()[rng.integers(100)] * 255).astype(np.uint8)).convert("RGB")
            size = int(rng.integers(60, 140))
        if rng.random() < 0.5:
            face = face.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        face = face.resize((size, max(1, int(size * face.height / face.width))))
        face = Image.fromarray(np.clip(np.asarray(face, dtype=np.float32) * rng.uniform(0.7, 1.2), 0, 255).astype(np.uint8))
        x = int(rng.integers(0, max(1, back.width - face.width)))
        y = int(rng.integers(0, max(1, back.height - face.height)))
        back.paste(face, (x, y))
    return back


def detector_set(dest: Path, n: int, seed: int) -> Path:
    """``n`` scenes with faces as JPEGs in ``dest`` (a calibration or check directory)."""
    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        detector_image(rng).save(dest / f"{i:04d}.jpg", quality=90)
    return dest


def textline_set(dest: Path, n: int, seed: int) -> Path:
    """``n`` rendered lines, every second turned 180 degrees, as an ImageFolder (``0``, ``180``) in ``dest``."""
    import matplotlib

    fx = _fixtures()
    fonts = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    vocabulary = fx.words()
    backgrounds = list(_photos("scenes"))
    rng = np.random.default_rng(seed)
    for label in ("0", "180"):
        (dest / label).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        line = fx.text_line(rng, vocabulary, fonts, backgrounds)
        label = "0" if i % 2 == 0 else "180"
        (line if label == "0" else line.rotate(180)).save(dest / label / f"{i:04d}.jpg", quality=92)
    return dest


def page_image(rng: np.random.Generator, size: int = 480) -> Image.Image:
    """A page of 3 to 8 rendered text lines on a light plain background or a faded photo."""
    import matplotlib

    fx = _fixtures()
    fonts = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    backgrounds = list(_photos("scenes"))
    if rng.random() < 0.5:
        page = Image.new("RGB", (size, size), tuple(int(c) for c in rng.integers(200, 256, 3)))
    else:
        photo = _crop(rng, backgrounds[rng.integers(len(backgrounds))], 0.5).resize((size, size))
        page = Image.blend(photo, Image.new("RGB", (size, size), (255, 255, 255)), float(rng.uniform(0.4, 0.7)))
    vocabulary = fx.words()
    y = int(rng.integers(5, 40))
    for _ in range(int(rng.integers(3, 9))):
        line = fx.text_line(rng, vocabulary, fonts, backgrounds)
        if line.width > size - 10:
            line = line.resize((size - 10, max(1, int(line.height * (size - 10) / line.width))))
        if y + line.height > size:
            break
        page.paste(line, (int(rng.integers(0, size - line.width + 1)), y))
        y += line.height + int(rng.integers(4, 30))
    return page


DBNET_RESOURCE = ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx")
DBNET_CARD = ROOT / "tests" / "fixtures" / "int8" / "ppocrv4-det" / "card.toml"


def dbnet_model() -> Path | None:
    """PP-OCRv4's DBNet text detector inside the installed ``rapidocr_onnxruntime`` (None when it is not installed)."""
    package, resource = DBNET_RESOURCE
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / resource
    return path if path.is_file() else None


def page_set(dest: Path, n: int, seed: int) -> Path:
    """``n`` pages (:func:`page_image`) as JPEGs in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        page_image(rng).save(dest / f"{i:04d}.jpg", quality=90)
    return dest
