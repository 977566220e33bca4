"""Decoding parity with Ultralytics' own post-processing, for every task: the synthetic raw outputs of
tests/support/ultra_scenes.py (planted objects) decoded by k2edge against what Ultralytics'
non_max_suppression, scale_boxes, process_mask_native and scale_coords made of the same arrays
(stored by tools/make_ultralytics_fixtures.py; tests never import ultralytics). Same boxes within
0.5 px, same classes, mask IoU >= 0.99, keypoints within 0.5 px."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import ultra_scenes as sc
from k2edge.config.card import DetectionSpec, InputSpec, ModelCard, PoseSpec
from k2edge.config.ultralytics import COCO_KEYPOINTS
from k2edge.tasks import Preprocess, TaskDecoder
from k2edge.tasks.segmentation import rle_decode

# pycocotools' decode trips numpy 2's copy-keyword deprecation on every call: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

GOLDEN = pathlib.Path(__file__).resolve().parent / "fixtures" / "ultralytics" / "ultralytics_golden.npz"
LABELS = ("a", "b", "c")


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.is_file():
        pytest.skip("tests/fixtures/ultralytics/ultralytics_golden.npz is not here (tools/make_ultralytics_fixtures.py)")
    return dict(np.load(GOLDEN))


def _card(task: str, fmt: str = "yolov8") -> ModelCard:
    return ModelCard(task=task, input=InputSpec(size=sc.INPUT, resize="letterbox", color="RGB"),
                     detection=DetectionSpec(format=fmt, score_threshold=sc.CONF, iou_threshold=sc.IOU,
                                             max_detections=sc.MAX_DET),
                     pose=PoseSpec(keypoints=COCO_KEYPOINTS) if task == "pose" else PoseSpec())


def _decode(task: str, outputs: dict, original: tuple[int, int], fmt: str = "yolov8"):
    card = _card(task, fmt)
    dec = TaskDecoder(card, LABELS, {k: v.shape for k, v in outputs.items()})
    geometry = Preprocess(card.input).geometry(original[1], original[0])
    return dec, dec.detections(outputs, [geometry])[0], dec.answers(outputs, 1, [geometry])[0]["detections"]


def _same_boxes(dets, want: np.ndarray) -> None:
    assert len(dets) == len(want), (len(dets), len(want))
    np.testing.assert_array_equal(dets.classes, want[:, 5].astype(np.int64))
    np.testing.assert_allclose(dets.scores, want[:, 4], atol=1e-5)
    np.testing.assert_allclose(dets.boxes, want[:, :4], atol=0.5)


def test_the_scenes_are_the_ones_the_golden_file_was_made_from(golden):
    """ultra_scenes builds the same arrays as when the golden file was made (no drift, no RNG)."""
    assert str(golden["scenes_sha256"]) == sc.checksum()
    assert golden["detect/480x640"].shape[0] >= 6  # the planted objects are found at all


@pytest.mark.parametrize("original", sc.ORIGINALS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_detection_and_end2end_match_ultralytics(golden, original):
    key = f"{original[0]}x{original[1]}"
    _, dets, _ = _decode("detection", {"output0": sc.detect_pred()}, original)
    _same_boxes(dets, golden[f"detect/{key}"])
    _, dets, _ = _decode("detection", {"output0": sc.end2end_pred()}, original, "end2end")
    _same_boxes(dets, golden[f"end2end/{key}"])


@pytest.mark.parametrize("original", sc.ORIGINALS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_segmentation_matches_process_mask_native(golden, original):
    """Boxes as NMS gives them, masks as COCO RLE at the original size with IoU >= 0.99 each."""
    from pycocotools import mask as mask_utils

    key = f"{original[0]}x{original[1]}"
    pred, protos = sc.seg_pred()
    _, dets, answer = _decode("segmentation", {"output0": pred, "output1": protos}, original)
    want = golden[f"segment/{key}"]
    _same_boxes(dets, want)
    masks = np.unpackbits(golden[f"segment_masks/{key}"], axis=-1)[..., : original[1]].astype(bool)
    assert len(answer) == len(masks)
    for item, ref in zip(answer, masks):
        rle = item["mask"]
        assert rle["size"] == list(original)
        got = rle_decode(rle)
        coco = mask_utils.decode({"size": rle["size"], "counts": rle["counts"].encode()}).astype(bool)
        np.testing.assert_array_equal(got, coco)  # our RLE string is pycocotools' own
        iou = (got & ref).sum() / max((got | ref).sum(), 1)
        assert ref.sum() > 100 and iou >= 0.99, iou


@pytest.mark.parametrize("original", sc.ORIGINALS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pose_matches_scale_coords(golden, original):
    key = f"{original[0]}x{original[1]}"
    _, dets, answer = _decode("pose", {"output0": sc.pose_pred()}, original)
    _same_boxes(dets, golden[f"pose/{key}"])
    want = golden[f"pose_kpts/{key}"]
    got = np.array([d["keypoints"] for d in answer], np.float32)
    assert got.shape == want.shape == (len(dets), 17, 3)
    np.testing.assert_allclose(got[..., :2], want[..., :2], atol=0.5)
    np.testing.assert_allclose(got[..., 2], want[..., 2], atol=1e-3)


@pytest.mark.parametrize("original", sc.ORIGINALS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_obb_matches_rotated_nms(golden, original):
    """Rotated NMS by probiou keeps the same boxes; rbox [cx, cy, w, h, angle] in original pixels."""
    key = f"{original[0]}x{original[1]}"
    _, dets, answer = _decode("obb", {"output0": sc.obb_pred()}, original)
    want = golden[f"obb/{key}"]  # cx cy w h angle score class
    assert len(answer) == len(want)
    np.testing.assert_array_equal(dets.classes, want[:, 6].astype(np.int64))
    got = np.array([d["rbox"] for d in answer], np.float32)
    np.testing.assert_allclose(got[:, :4], want[:, :4], atol=0.5)
    np.testing.assert_allclose(got[:, 4], want[:, 4], atol=1e-4)
    assert all("box" not in d for d in answer)
