"""tasks/: card-driven staging (stretch, letterbox, pad-right, colour orders) with the geometry to map
boxes back, classification scores, YOLOv8/YOLOv5 decoding + NMS against a loop-based reference,
raw tensor answers, and one answer shape per task."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from detect_reference import iou, letterbox_back, reference_decode
from k2edge.config.card import CardError, DetectionSpec, InputSpec, ModelCard
from k2edge.tasks import Geometry, Preprocess, TaskDecoder, decode, decode_output, encode_outputs, nms, probabilities
from k2edge.tasks.detection import decode_one, layout_classes


def _pre(**kw) -> Preprocess:
    return Preprocess(InputSpec(**{"color": "RGB", "size": (64, 96), "scale": 1.0, **kw}))


@pytest.mark.parametrize("resize", ["letterbox", "pad-right", "stretch"])
@pytest.mark.parametrize("orig", [(200, 100), (60, 150), (96, 64)])  # landscape, portrait, exact fit (w, h)
def test_geometry_round_trips(resize, orig):
    """A point of the original image lands in the input and maps back to itself."""
    pre = _pre(resize=resize)
    g = pre.geometry(*orig)
    pts = np.array([[0, 0, orig[0], orig[1]], [10.5, 20.25, 30, 40]], np.float32)
    into = pts.copy()
    into[:, 0::2] = pts[:, 0::2] * g.scale_x + g.pad_x
    into[:, 1::2] = pts[:, 1::2] * g.scale_y + g.pad_y
    assert 0 <= into[0, 0] and into[0, 2] <= 96 + 1e-3 and into[0, 3] <= 64 + 1e-3
    np.testing.assert_allclose(g.to_original(into), pts, atol=1e-3)


def test_letterbox_centres_and_pads_with_pad_value():
    """A wide white image letterboxed into 64x96 (HxW): grey bars above and below, the image centred."""
    pre = _pre(resize="letterbox", pad_value=114)
    sample, g = pre.stage_mapped(Image.new("RGB", (192, 64), (255, 255, 255)))
    assert sample.shape == (3, 64, 96)
    assert (g.scale_x, g.scale_y, g.pad_x, g.pad_y) == (0.5, 0.5, 0, 16)
    assert np.all(sample[:, :16] == 114) and np.all(sample[:, 48:] == 114) and np.all(sample[:, 16:48] == 255)


def test_pad_right_puts_the_image_top_left():
    pre = _pre(resize="pad-right", pad_value=0)
    sample, g = pre.stage_mapped(Image.new("RGB", (32, 64), (200, 100, 50)))
    assert (g.pad_x, g.pad_y, g.scale_x) == (0, 0, 1.0)
    assert np.all(sample[:, :, :32] == np.array([200, 100, 50]).reshape(3, 1, 1)) and np.all(sample[:, :, 32:] == 0)


def test_bgr_reverses_channels_and_normalisation_applies_per_channel():
    """color BGR feeds blue first; (pixel * scale - mean) / std per channel; NHWC layout too."""
    img = Image.new("RGB", (96, 64), (200, 100, 50))
    bgr = Preprocess(InputSpec(color="BGR", size=(64, 96), scale=1 / 255, mean=(0.5, 0.5, 0.5), std=(0.5, 0.25, 0.5)))
    s = bgr.stage(img)
    np.testing.assert_allclose(s[:, 0, 0], [(50 / 255 - 0.5) / 0.5, (100 / 255 - 0.5) / 0.25, (200 / 255 - 0.5) / 0.5], rtol=1e-5)
    nhwc = Preprocess(InputSpec(color="RGB", size=(64, 96), scale=1.0, layout="NHWC"))
    assert nhwc.stage(img).shape == (64, 96, 3) and tuple(nhwc.stage(img)[0, 0]) == (200, 100, 50)


@pytest.mark.parametrize("resize", ["letterbox", "pad-right", "stretch"])
@pytest.mark.parametrize("color,layout,mean,std", [("RGB", "NCHW", (0.0,), (1.0,)), ("BGR", "NHWC", (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
                                                   ("L", "NCHW", (0.5,), (0.25,)), ("L", "NHWC", (0.0,), (1.0,))])
def test_a_frame_at_its_landing_size_stages_as_through_pillow(resize, color, layout, mean, std):
    """A uint8 frame that needs no resize (a camera at the model's aspect) is written straight into the sample,
    padding included: the same float32 bytes as the same pixels staged as a Pillow image; one that needs a resize
    goes through Pillow."""
    pre = Preprocess(InputSpec(color=color, size=(64, 96), resize=resize, pad_value=114, mean=mean, std=std, scale=1 / 255))
    rng = np.random.default_rng(7)
    direct = 0
    for w, h in ((96, 48), (96, 64), (48, 64), (95, 64), (96, 41), (192, 96)):
        frame = rng.integers(0, 256, (h, w) if color == "L" else (h, w, 3), dtype=np.uint8)
        got, g = pre.stage_mapped(frame)
        want, g_want = pre.stage_mapped(Image.fromarray(frame))
        assert got.tobytes() == want.tobytes() and g == g_want, (w, h)
        direct += pre._placed(frame) is not None
    assert direct == (1 if resize == "stretch" else 5)  # (192, 96) is resized; stretch fits (96, 64) only


def test_tensor_source_keeps_input_pixels():
    """A float tensor is taken as staged; its geometry leaves boxes in input pixels."""
    pre = _pre()
    t = np.random.default_rng(0).random((3, 64, 96), dtype=np.float32)
    out, g = pre.stage_mapped(t)
    np.testing.assert_array_equal(out, t)
    assert g == Geometry(96, 64)


def test_probabilities_from_logits_or_as_given():
    logits = np.array([[1.0, 2.0, 3.0]])
    np.testing.assert_allclose(probabilities(logits).sum(), 1.0)
    np.testing.assert_array_equal(probabilities(np.array([[0.2, 0.5, 0.3]]), "probabilities"), [[0.2, 0.5, 0.3]])


def _scene(rng, n_obj=30, per_obj=10, anchors=8400, classes=80, size=640):
    """A YOLOv8-layout output: ``per_obj`` jittered candidate boxes around each of ``n_obj`` objects."""
    pred = np.zeros((4 + classes, anchors), np.float32)
    pred[:4] = rng.uniform(0, size, (4, anchors))
    pred[4:] = rng.uniform(0, 0.2, (classes, anchors))  # below the threshold
    slots = rng.choice(anchors, n_obj * per_obj, replace=False)
    for k in range(n_obj):
        cx, cy, w, h = rng.uniform(50, size - 50), rng.uniform(50, size - 50), rng.uniform(20, 80), rng.uniform(20, 80)
        c = rng.integers(classes)
        for j in slots[k * per_obj:(k + 1) * per_obj]:
            pred[:4, j] = (cx + rng.normal(0, 2), cy + rng.normal(0, 2), w * rng.uniform(0.9, 1.1), h * rng.uniform(0.9, 1.1))
            pred[4 + c, j] = rng.uniform(0.3, 0.95)
    return pred


@pytest.mark.parametrize("agnostic", [False, True])
def test_yolov8_decode_matches_the_reference(agnostic):
    """Vectorised decoding equals the loop reference box for box (same order, labels, scores)."""
    rng = np.random.default_rng(1)
    pred = _scene(rng, n_obj=12, anchors=2000, classes=5)
    spec = DetectionSpec(class_agnostic_nms=agnostic)
    got = decode_one(pred, spec)
    want = reference_decode(pred, "yolov8", 0.25, 0.45, 100, agnostic)
    assert len(got) == len(want) > 0
    for b, s, c, w in zip(got.boxes, got.scores, got.classes, want):
        assert c == w[5] and abs(s - w[4]) < 1e-6 and iou(b, w[:4]) > 0.999


def test_yolov5_decode_matches_the_reference():
    rng = np.random.default_rng(2)
    p8 = _scene(rng, n_obj=8, anchors=1500, classes=3)
    pred = np.concatenate([p8[:4].T, rng.uniform(0.5, 1.0, (1500, 1)).astype(np.float32), p8[4:].T], axis=1)
    got = decode_one(pred, DetectionSpec(format="yolov5"))
    want = reference_decode(pred, "yolov5")
    assert len(got) == len(want) > 0
    assert all(c == w[5] and iou(b, w[:4]) > 0.999 for b, c, w in zip(got.boxes, got.classes, want))


def test_batch_images_decode_independently():
    """Image 1's result does not depend on what else is in the batch."""
    rng = np.random.default_rng(3)
    a, b = _scene(rng, anchors=1000, classes=4, n_obj=5), _scene(rng, anchors=1000, classes=4, n_obj=7)
    alone = decode_one(b, DetectionSpec())
    batch = decode(np.stack([a, b]), DetectionSpec())
    np.testing.assert_array_equal(batch[1].boxes, alone.boxes)
    assert len(batch) == 2 and len(batch[0]) != len(batch[1])


def test_max_candidates_and_max_detections_bound_the_work():
    """Every anchor above the threshold: only max_candidates enter NMS (the best), max_detections come out."""
    rng = np.random.default_rng(4)
    pred = np.zeros((4 + 2, 3000), np.float32)
    pred[0:2] = rng.uniform(0, 640, (2, 3000))
    pred[2:4] = 4.0  # tiny boxes: nearly nothing overlaps
    pred[4] = rng.uniform(0.5, 1.0, 3000)
    capped = decode_one(pred, DetectionSpec(max_candidates=50, max_detections=1000))
    assert len(capped) <= 50 and capped.scores.min() >= np.sort(pred[4])[-50]
    assert len(decode_one(pred, DetectionSpec(max_detections=7))) == 7


def test_boxes_map_back_to_the_original_and_clip():
    """Through a letterbox geometry boxes land in original pixels, clipped to the image."""
    pred = np.zeros((5, 10), np.float32)
    pred[:, 0] = (48, 32, 20, 10, 0.9)   # centre of a 96x64 input
    pred[:, 1] = (2, 32, 20, 10, 0.8)    # runs off the left edge
    g = _pre(resize="letterbox").geometry(192, 64)   # scale 0.5, pad_y 16
    d = decode_one(pred, DetectionSpec(), g)
    np.testing.assert_allclose(d.boxes[0], [76, 22, 116, 42])
    assert d.boxes[1][0] == 0.0
    want = letterbox_back([(38, 27, 58, 37), (-8, 27, 12, 37)], 192, 64, 96, 64)
    np.testing.assert_allclose(d.boxes, np.array([w[:4] for w in want]), atol=1e-4)


def test_nms_per_class_and_agnostic():
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [0, 0, 10, 10]], np.float32)
    scores = np.array([0.9, 0.8, 0.7], np.float32)
    classes = np.array([0, 0, 1])
    assert list(nms(boxes, scores, 0.5, classes)) == [0, 2]
    assert list(nms(boxes, scores, 0.5, None)) == [0]


def test_layout_errors_say_what_fits():
    assert layout_classes((1, 84, 8400), "yolov8") == 80 and layout_classes((1, 25200, 85), "yolov5") == 80
    with pytest.raises(ValueError, match='format = "yolov5"'):
        layout_classes((1, 8400, 84), "yolov8")
    with pytest.raises(ValueError, match="5 \\+ classes"):
        layout_classes((1, 100, 4), "yolov5")


def test_tensor_answers_round_trip():
    out = {"a": np.arange(12, dtype=np.float32).reshape(2, 2, 3), "b": np.array([[1], [2]], np.int64)}
    enc = encode_outputs(out, 1)
    assert enc["a"]["shape"] == [2, 3] and enc["a"]["dtype"] == "float32"
    np.testing.assert_array_equal(decode_output(enc["a"]), out["a"][1])
    np.testing.assert_array_equal(decode_output(enc["b"]), [2])


def test_one_answer_shape_per_task():
    """classification -> top_k, detection -> detections (original pixels), tensor -> outputs."""
    cls = TaskDecoder(ModelCard(), ("a", "b"), {"y": (2, 2)})
    assert cls.answers({"y": np.array([[0.0, 1.0], [3.0, 0.0]])}, 1, k=1) == [
        {"top_k": [{"index": 1, "label": "b", "score": pytest.approx(0.7310586)}]}]
    pred = np.zeros((1, 6, 8), np.float32)
    pred[0, :, 0] = (48, 32, 20, 10, 0.1, 0.9)
    det = TaskDecoder(ModelCard(task="detection"), ("cat", "dog"), {"out": (1, 6, 8)})
    g = _pre(resize="letterbox").geometry(192, 64)
    assert det.answers({"out": pred}, 1, [g]) == [
        {"detections": [{"index": 1, "label": "dog", "score": 0.9, "box": [76.0, 22.0, 116.0, 42.0]}]}]
    assert det.answers({"out": pred}, 1)[0]["detections"][0]["box"] == [38.0, 27.0, 58.0, 37.0]
    raw = TaskDecoder(ModelCard(task="tensor"), (), {"out": (1, 6, 8)}).answers({"out": pred}, 1)
    np.testing.assert_array_equal(decode_output(raw[0]["outputs"]["out"]), pred[0])


def test_decoder_refuses_a_card_that_does_not_fit_the_model():
    with pytest.raises(CardError, match="labels: 3 label\\(s\\) for a detector of 2 class"):
        TaskDecoder(ModelCard(task="detection"), ("a", "b", "c"), {"out": (1, 6, 100)})
    with pytest.raises(CardError, match='detection.format: .*format = "yolov5"'):
        TaskDecoder(ModelCard(task="detection"), (), {"out": (1, 100, 6)})
    with pytest.raises(CardError, match="has no output 'boxes'"):
        TaskDecoder(ModelCard(task="detection", detection={"output_name": "boxes"}), (), {"out": (1, 6, 100)})


def test_nms_matrix_and_box_by_box_paths_agree(monkeypatch):
    """Many candidates take the box-by-box path; it keeps exactly what the IoU-matrix path keeps."""
    import k2edge.tasks.detection as det

    rng = np.random.default_rng(5)
    xy = rng.uniform(0, 300, (700, 2)).astype(np.float32)
    boxes = np.concatenate([xy, xy + rng.uniform(10, 60, (700, 2)).astype(np.float32)], axis=1)
    scores = rng.random(700).astype(np.float32)
    classes = rng.integers(0, 3, 700)
    by_box = nms(boxes, scores, 0.5, classes, 50)
    monkeypatch.setattr(det, "_MATRIX_NMS_MAX", 10_000)
    np.testing.assert_array_equal(nms(boxes, scores, 0.5, classes, 50), by_box)
    assert len(by_box) == 50
