"""Ultralytics' export metadata as a card source: parsing (literals only, under a size cap), what it
implies per task, its place in the precedence (card > k2edge metadata > Ultralytics metadata >
defaults), provenance, and the stride / trained-size checks."""

from __future__ import annotations

import logging

import pytest

from k2edge.config.card import CardError, ModelCard, card_from_dict, card_sources, check_size, resolve_card
from k2edge.config.ultralytics import COCO_KEYPOINTS, COCO_SIGMAS, MAX_LITERAL_CHARS, read_ultralytics

SHAPE = (1, 3, "height", "width")


def _md(**extra):
    md = {"task": "detect", "stride": "32", "imgsz": "[320, 320]", "batch": "1",
          "names": "{0: 'person', 1: 'bicycle', 2: 'car'}", "description": "Ultralytics YOLOv8n model"}
    md.update(extra)
    return md


def test_the_metadata_makes_ultralytics_predictor_card():
    card = resolve_card("images", SHAPE, _md())
    assert card.task == "detection" and card.input.size == (320, 320) and card.input.resize == "letterbox"
    assert (card.input.interpolation, card.input.jpeg_draft, card.input.pad_value) == ("linear", False, 114)
    assert (card.detection.format, card.detection.iou_threshold, card.detection.max_detections) == ("yolov8", 0.7, 300)
    assert read_ultralytics(_md()).names == ("person", "bicycle", "car")


@pytest.mark.parametrize("task,extra,check", [
    ("segment", {}, lambda c: c.task == "segmentation"),
    ("classify", {"stride": "1", "imgsz": "[224, 224]"},
     lambda c: c.task == "classification" and c.classification.output == "probabilities" and c.input.resize == "center-crop"
     and c.input.interpolation == "antialias"),
    ("obb", {}, lambda c: c.task == "obb"),
    ("pose", {"kpt_shape": "[17, 3]"}, lambda c: c.pose.keypoints == COCO_KEYPOINTS and c.pose.sigmas == COCO_SIGMAS),
    ("pose", {"kpt_shape": "[5, 2]"}, lambda c: len(c.pose.keypoints) == 5 and c.pose.dims == 2 and c.pose.sigmas == (0.2,) * 5),
    ("detect", {"end2end": "True"}, lambda c: c.detection.format == "end2end"),
])
def test_each_task_reads_its_keys(task, extra, check):
    assert check(resolve_card("images", SHAPE, _md(task=task, **extra)))


def test_precedence_card_over_k2edge_metadata_over_ultralytics_over_defaults():
    md = _md(**{"k2edge.preprocess": '{"size": [256, 192], "color": "BGR"}'})  # k2edge's: [width, height]
    card = card_from_dict({"input": {"color": "RGB"}, "detection": {"score_threshold": 0.5}}, "card.toml")
    resolved = resolve_card("images", SHAPE, md, card)
    assert resolved.input.size == (192, 256) and resolved.input.color == "RGB" and resolved.input.resize == "letterbox"
    sources = card_sources(SHAPE, md, card)
    assert sources["input.size"] == "model metadata 'k2edge.preprocess'" and sources["input.color"] == "card.toml"
    assert sources["input.resize"] == "Ultralytics metadata" and sources["detection.score_threshold"] == "card.toml"
    assert "detection.class_agnostic_nms" not in sources  # a default


@pytest.mark.parametrize("key,value,message", [
    ("names", "__import__('os').system('true')", "model metadata 'names' is not a Python literal"),
    ("names", "{'a': 'person'}", "model metadata 'names' must map class indices to names"),
    ("names", "{0: 'a', 2: 'b'}", "class indices are not 0..N-1"),
    ("names", "{0: '" + "x" * MAX_LITERAL_CHARS + "'}", "more than the 1,000,000 read"),
    ("imgsz", "[320]", "model metadata 'imgsz' must be [height, width]"),
    ("task", "depth", "model metadata 'task'"),
    ("kpt_shape", "[17, 4]", "model metadata 'kpt_shape' must be [keypoints, 2 or 3]"),
])
def test_malformed_metadata_is_refused_naming_the_key(key, value, message):
    with pytest.raises(CardError) as exc:
        resolve_card("images", SHAPE, _md(**{key: value}))
    assert message in str(exc.value) and " at 0x" not in str(exc.value)


def test_size_off_the_stride_names_the_nearest_sizes_and_untrained_size_warns(caplog):
    with pytest.raises(CardError, match=r"\[320, 300\] \(\[height, width\]\) is not a multiple of the model's stride 32: "
                                        r"use height 320, width 288 or 320"):
        resolve_card("images", SHAPE, _md(), ModelCard.model_validate({"input": {"size": [320, 300]}}))
    with pytest.raises(CardError, match="use height 32, width 32"):
        check_size((20, 20), _md(), "card")
    with caplog.at_level(logging.WARNING):
        resolve_card("images", SHAPE, _md(), ModelCard.model_validate({"input": {"size": [640, 640]}}))
    assert "differs from the size the model was trained at, [320, 320]" in caplog.text
    check_size((224, 200), _md(stride="1", imgsz="[224, 200]"), "card")  # classifiers: stride 1


def test_a_model_without_ultralytics_metadata_is_unaffected():
    assert read_ultralytics({"k2edge.preprocess": "{}", "author": "me"}).present is False
    assert resolve_card("x", (1, 3, 32, 32), {}).input.interpolation == "antialias"


def test_escalation_judges_segmentation_pose_and_obb_by_their_boxes():
    from k2edge.config.cloud import EscalationSettings

    for task in ("segmentation", "pose", "obb"):
        assert EscalationSettings().for_task(task).measure == "max_box_score"
        with pytest.raises(ValueError, match="judges a classifier"):
            EscalationSettings(measure="entropy").for_task(task)
