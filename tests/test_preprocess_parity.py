"""Preprocessing parity with the pipeline Ultralytics trains and predicts with: scikit-image's sample
photos through Ultralytics' LetterBox (cv2.resize INTER_LINEAR, pad 114) and its tensor conversion,
stored by tools/make_ultralytics_fixtures.py, against k2edge's staging with interpolation = "linear":
max |difference| <= 2/255 and mean <= 0.25/255 per value. Also cv2.resize itself for linear, area and
nearest, shrinking and enlarging, against k2edge's numpy resize (OpenCV is never a dependency)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from PIL import Image

from k2edge.config.card import InputSpec
from k2edge.tasks import Preprocess
from k2edge.tasks.resize import resize

GOLDEN = pathlib.Path(__file__).resolve().parent / "fixtures" / "ultralytics" / "ultralytics_golden.npz"


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.is_file():
        pytest.skip("tests/fixtures/ultralytics/ultralytics_golden.npz is not here (tools/make_ultralytics_fixtures.py)")
    return dict(np.load(GOLDEN))


def _letterboxes(golden):
    for key in sorted(golden):
        if key.startswith("letterbox/"):
            _, photo, hw = key.split("/")
            yield photo, tuple(int(v) for v in hw.split("x")), golden[key]


def _spec(size, interpolation="linear"):
    return InputSpec(size=size, resize="letterbox", pad_value=114, color="RGB", interpolation=interpolation)


def test_linear_letterbox_matches_ultralytics_on_real_photos(golden, tmp_path):
    """Each photo, from an array and from a PNG file: max <= 2/255, mean <= 0.25/255; antialias does not match."""
    skdata = pytest.importorskip("skimage.data", reason="scikit-image ships the sample photos (pip install 'k2edge[dev]')")
    figures = []
    for photo, size, want in _letterboxes(golden):
        rgb = getattr(skdata, photo)()
        ref = want.astype(np.float32).transpose(2, 0, 1) / 255
        path = tmp_path / f"{photo}.png"
        Image.fromarray(rgb).save(path)
        for source in (rgb, path):
            diff = np.abs(Preprocess(_spec(size)).stage(source) - ref)
            assert diff.max() <= 2 / 255 and diff.mean() <= 0.25 / 255, (photo, diff.max() * 255, diff.mean() * 255)
        figures.append(diff.mean() * 255)
        old = np.abs(Preprocess(_spec(size, "antialias")).stage(rgb) - ref)
        assert old.max() > 10 / 255, photo  # what k2edge did before: Pillow's antialiased bilinear
    assert len(figures) == 3


def test_jpeg_draft_follows_the_interpolation(tmp_path):
    """Draft decoding (1/2..1/8 in the DCT) is on only for antialias unless the card says otherwise."""
    assert _spec((64, 64)).draft is False and _spec((64, 64), "antialias").draft is True
    assert InputSpec(size=(64, 64), interpolation="antialias", jpeg_draft=False).draft is False
    rng = np.random.default_rng(0)
    img = (np.kron(rng.integers(0, 255, (40, 60, 3)), np.ones((16, 16, 1)))).astype(np.uint8)  # 640x960
    path = tmp_path / "big.jpg"
    Image.fromarray(img).save(path, quality=95)
    full = np.asarray(Image.open(path).convert("RGB"))
    staged = Preprocess(_spec((64, 96))).stage(path)
    np.testing.assert_array_equal(staged, Preprocess(_spec((64, 96))).stage(full))  # decoded at full size


@pytest.mark.parametrize("method", ["linear", "area", "nearest"])
def test_numpy_resize_matches_cv2(golden, method):
    """Within 1 of 255 everywhere (OpenCV rounds its fixed-point weights), equal on average to 0.15."""
    src = golden["resize/src"]
    for key in sorted(k for k in golden if k.startswith(f"resize/{method}/")):
        h, w = (int(v) for v in key.split("/")[-1].split("x"))
        got = resize(src, w, h, method)
        diff = np.abs(got.astype(int) - golden[key].astype(int))
        assert got.shape == golden[key].shape and diff.max() <= 1 and diff.mean() <= 0.15, (key, diff.max(), diff.mean())


def test_area_and_nearest_reach_the_staging(golden):
    """The card's interpolation is what staging uses (stretch to the cv2 sizes)."""
    src = golden["resize/src"]
    for method in ("area", "nearest"):
        spec = InputSpec(size=(20, 31), resize="stretch", color="RGB", interpolation=method, scale=1.0)
        staged = Preprocess(spec).stage(src)
        np.testing.assert_allclose(staged.transpose(1, 2, 0), golden[f"resize/{method}/20x31"], atol=1)


def test_undecodable_images_say_what_is_wrong_without_object_reprs(tmp_path):
    """Bytes that are no image, a truncated JPEG (named when it is a file): one message, no '<... at 0x...>'."""
    from k2edge.errors import InputError

    p = Preprocess(InputSpec(size=(32, 32)))
    good = tmp_path / "good.jpg"
    Image.fromarray(np.zeros((64, 64, 3), np.uint8) + 90).save(good)
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(good.read_bytes()[:300])
    for source, fragment in ((b"not an image at all", "not in an image format Pillow reads"),
                             (bad.read_bytes(), "cannot decode image"), (bad, f"cannot decode image {str(bad)!r}")):
        with pytest.raises(InputError) as exc:
            p.stage(source)
        assert fragment in str(exc.value) and " at 0x" not in str(exc.value) and "BytesIO" not in str(exc.value)


def test_center_crop_matches_ultralytics_classifiers(golden):
    """A YOLOv8-cls card (center-crop, antialias: torchvision's Resize + CenterCrop on a PIL image)
    stages each photo exactly as Ultralytics' classify_transforms."""
    skdata = pytest.importorskip("skimage.data", reason="scikit-image ships the sample photos (pip install 'k2edge[dev]')")
    keys = sorted(k for k in golden if k.startswith("classify/"))
    assert len(keys) == 3
    for key in keys:
        _, photo, size = key.split("/")
        spec = InputSpec(size=(int(size), int(size)), resize="center-crop", color="RGB", interpolation="antialias",
                         jpeg_draft=False)
        diff = np.abs(Preprocess(spec).stage(getattr(skdata, photo)()) - golden[key].astype(np.float32).transpose(2, 0, 1) / 255)
        assert diff.max() <= 1 / 255, (photo, diff.max() * 255)
