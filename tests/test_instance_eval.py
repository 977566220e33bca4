"""Evaluation of segmentation (COCO ``segm``) and pose (COCO ``keypoints``, OKS) with pycocotools on
synthetic predictions against synthetic annotations: a perfect prediction scores 1.0, a shifted one
less; the answers go through the same converter `k2edge eval` uses (coco_answer_results)."""

from __future__ import annotations

import numpy as np
import pytest

from k2edge.config.ultralytics import COCO_SIGMAS
from k2edge.tasks.coco_eval import coco_answer_results, coco_map
from k2edge.tasks.segmentation import rle_encode

pytest.importorskip("pycocotools", reason="evaluation needs pycocotools (pip install 'k2edge[detection]')")

H, W = 120, 160
# image id -> objects (x1, y1, x2, y2, class index)
OBJECTS = {1: [(10, 20, 60, 90, 0), (70, 10, 150, 60, 1)], 2: [(30, 30, 110, 100, 0)]}


def _mask(x1, y1, x2, y2, dx=0):
    m = np.zeros((H, W), bool)
    yy, xx = np.mgrid[0:H, 0:W]
    cx, cy, rx, ry = (x1 + x2) / 2 + dx, (y1 + y2) / 2, (x2 - x1) / 2, (y2 - y1) / 2
    m[((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1] = True
    return m


def _keypoints(x1, y1, x2, y2, dx=0.0):
    return [[x1 + (x2 - x1) * ((i * 7) % 17) / 16 + dx, y1 + (y2 - y1) * ((i * 5) % 17) / 16, 2.0] for i in range(17)]


def _ground_truth():
    anns, n = [], 0
    for image_id, objs in OBJECTS.items():
        for x1, y1, x2, y2, c in objs:
            n += 1
            m = _mask(x1, y1, x2, y2)
            rle = rle_encode(m)
            anns.append({"id": n, "image_id": image_id, "category_id": 10 + c, "bbox": [x1, y1, x2 - x1, y2 - y1],
                         "area": float(m.sum()), "iscrowd": 0, "segmentation": rle,
                         "keypoints": [v for kp in _keypoints(x1, y1, x2, y2) for v in kp], "num_keypoints": 17})
    return {"images": [{"id": i, "width": W, "height": H, "file_name": f"{i}.png"} for i in OBJECTS],
            "annotations": anns, "categories": [{"id": 10, "name": "a"}, {"id": 11, "name": "b"}]}


def _answers(dx: float = 0.0):
    """What TaskDecoder.answers gives (box, mask RLE, keypoints) for each image, shifted by dx pixels."""
    return [[{"index": c, "label": "ab"[c], "score": 0.9, "box": [x1 + dx, y1, x2 + dx, y2],
              "mask": rle_encode(_mask(x1, y1, x2, y2, dx)),
              "keypoints": [[x, y, 0.9] for x, y, _ in _keypoints(x1, y1, x2, y2, dx)]}
             for x1, y1, x2, y2, c in objs] for objs in OBJECTS.values()]


@pytest.mark.parametrize("iou_type", ["segm", "keypoints"])
def test_a_perfect_prediction_scores_one_and_a_shifted_one_less(iou_type):
    gt = _ground_truth()
    if iou_type == "segm":  # pycocotools takes RLE counts as bytes in annotations
        for a in gt["annotations"]:
            a["segmentation"] = {**a["segmentation"], "counts": a["segmentation"]["counts"].encode()}
    sigmas = COCO_SIGMAS if iou_type == "keypoints" else None
    perfect = coco_map(gt, coco_answer_results(list(OBJECTS), _answers(), [10, 11]), iou_type, sigmas)
    assert perfect["map"] == pytest.approx(1.0) and perfect["map50"] == pytest.approx(1.0)
    shifted = coco_map(gt, coco_answer_results(list(OBJECTS), _answers(dx=6.0), [10, 11]), iou_type, sigmas)
    assert shifted["map"] < 0.9, shifted
    far = coco_map(gt, coco_answer_results(list(OBJECTS), _answers(dx=40.0), [10, 11]), iou_type, sigmas)
    assert far["map"] < shifted["map"], (far, shifted)


def test_box_map_of_the_same_answers_is_one():
    results = [{k: v for k, v in r.items() if k not in ("segmentation", "keypoints")}
               for r in coco_answer_results(list(OBJECTS), _answers(), [10, 11])]
    assert coco_map(_ground_truth(), results)["map"] == pytest.approx(1.0)


def test_rle_strings_are_pycocotools_own():
    """rle_encode gives byte for byte what pycocotools' encode gives: random, empty, full, edge-touching masks."""
    from pycocotools import mask as mask_utils

    from k2edge.tasks.segmentation import rle_area, rle_decode

    rng = np.random.default_rng(0)
    for t in range(120):
        m = rng.random((37, 53)) < rng.random()
        if t % 3 == 0:
            m[:] = False
        if t % 7 == 0:
            m[:] = True
        if t % 5 == 0:
            m = np.zeros((300, 400), bool)
            a, b = sorted(rng.integers(0, 300, 2))
            m[a:b, 50:300] = True
        rle = rle_encode(m)
        assert rle["counts"] == mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))["counts"].decode(), t
        assert (rle_decode(rle) == m).all() and rle_area(rle) == m.sum()
