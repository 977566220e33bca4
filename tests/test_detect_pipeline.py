"""Detection end to end on a hand-weighted YOLOv8-layout detector (tests/support/graphs.grid_detector):
``k2edge infer --card --json`` equals a reference pipeline written out by hand (Pillow resize and
padding, onnxruntime, a loop decode, boxes mapped back) for every resize and image orientation and
for .npy tensors; COCO eval through pycocotools; INT8 keeps the head in float; annotated images;
the suggested card."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from PIL import Image

from detect_reference import iou, reference_decode, reference_pipeline
from detect_scenes import LABELS, scene, write_coco
from graphs import grid_detector
from test_cli import assert_one_line_error, k2edge

H, W = 64, 96


def _card(resize: str, extra: str = "") -> str:
    return (f'task = "detection"\nlabels = "labels.txt"\n[input]\nsize = [{H}, {W}]\nresize = "{resize}"\npad_value = 114\n'
            f'color = "RGB"\nscale = 0.00392156862745098\n[detection]\nscore_threshold = 0.5\n{extra}')


@pytest.fixture(scope="module")
def det_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("det")
    onnx.save(grid_detector(H, W), str(d / "det.onnx"))
    (d / "labels.txt").write_text("\n".join(LABELS) + "\n")
    for resize in ("letterbox", "pad-right", "stretch"):
        (d / f"{resize}.toml").write_text(_card(resize))
    rng = np.random.default_rng(7)
    for name, (w, h) in {"landscape": (300, 170), "portrait": (150, 260), "exact": (W, H)}.items():
        arr, _ = scene(rng, w, h, n=5)
        Image.fromarray(arr).save(d / f"{name}.png")
    return d


def _reference(det_dir, image, resize: str) -> list[tuple]:
    """Resize and pad by hand, run onnxruntime on the ONNX file, decode with loops, map back."""
    from k2edge.config.card import load_card

    return reference_pipeline(det_dir / "det.onnx", image, load_card(det_dir / f"{resize}.toml"))


def _assert_same(got: list[dict], want: list[tuple]):
    assert len(got) == len(want) > 0
    for g, w in zip(sorted(got, key=lambda d: d["box"]), sorted(want, key=lambda t: t[:4])):
        assert g["label"] == LABELS[w[5]] and iou(g["box"], w[:4]) >= 0.95, (g, w)


@pytest.mark.parametrize("resize", ["letterbox", "pad-right", "stretch"])
def test_infer_json_equals_the_reference_decode(det_dir, resize):
    """Landscape, portrait and exact-size images: same boxes (IoU >= 0.95) and labels as the reference."""
    images = [det_dir / f"{n}.png" for n in ("landscape", "portrait", "exact")]
    proc = k2edge("infer", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(det_dir / f"{resize}.toml"), "--json",
                  *map(str, images))
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["input"] for r in records] == [str(i) for i in images]
    for image, record in zip(images, records):
        assert "top_k" not in record
        _assert_same(record["detections"], _reference(det_dir, image, resize))
        w, h = Image.open(image).size
        assert all(0 <= d["box"][0] <= d["box"][2] <= w and 0 <= d["box"][1] <= d["box"][3] <= h for d in record["detections"])


def test_npy_tensor_boxes_are_in_input_pixels(det_dir, tmp_path):
    """A staged .npy tensor decodes to boxes in input pixels, as the reference decodes the raw output."""
    import onnxruntime as ort

    rng = np.random.default_rng(3)
    arr, boxes = scene(rng, W, H, n=4, cell=8)
    x = (arr.astype(np.float32) / 255).transpose(2, 0, 1)
    np.save(tmp_path / "x.npy", x)
    proc = k2edge("infer", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(det_dir / "letterbox.toml"), "--json",
                  str(tmp_path / "x.npy"))
    got = json.loads(proc.stdout)["detections"]
    out = ort.InferenceSession(str(det_dir / "det.onnx")).run(None, {"x": x[None]})[0][0]
    _assert_same(got, reference_decode(out, "yolov8", conf=0.5))
    assert sorted(tuple(d["box"]) for d in got) == sorted(tuple(float(v) for v in b[:4]) for b in boxes)


def test_human_table_and_annotated_image(det_dir, tmp_path):
    """The human output is a table of boxes; --save-annotated draws them on the image."""
    out = tmp_path / "ann.png"
    proc = k2edge("infer", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(det_dir / "letterbox.toml"),
                  str(det_dir / "landscape.png"), "--save-annotated", str(out))
    assert "detection(s)" in proc.stdout and "label" in proc.stdout and "x1" in proc.stdout
    drawn = np.asarray(Image.open(out).convert("RGB")).astype(int)
    plain = np.asarray(Image.open(det_dir / "landscape.png").convert("RGB")).astype(int)
    assert drawn.shape == plain.shape and (np.abs(drawn - plain).sum(axis=2) > 0).sum() > 100
    many = tmp_path / "many"
    k2edge("infer", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(det_dir / "letterbox.toml"),
           str(det_dir / "landscape.png"), str(det_dir / "portrait.png"), "--save-annotated", str(many))
    assert sorted(p.name for p in many.iterdir()) == ["landscape.annotated.png", "portrait.annotated.png"]
    proc = k2edge("infer", str(ROOT_MODEL), "-p", "cpu-dev", str(det_dir / "landscape.png"), "--save-annotated",
                  str(tmp_path / "x.png"), check=False)
    assert_one_line_error(proc, "--save-annotated draws detections", "'classification'")


from test_cli import MODEL as ROOT_MODEL  # noqa: E402  (the digits classifier)


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    """Squares on the detector's cell grid at its input size: every square is exactly one anchor's box."""
    d = tmp_path_factory.mktemp("coco")
    rng = np.random.default_rng(11)
    images = [(f"{i:03d}.png", *scene(rng, W, H, n=6, cell=8)) for i in range(12)]
    return write_coco(d, images)


def test_eval_reports_coco_map(det_dir, coco_set):
    """k2edge eval on a COCO file: map50 and map from pycocotools, categories mapped by order."""
    data = json.loads(k2edge("eval", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(det_dir / "stretch.toml"),
                             "--dataset", str(coco_set), "--json").stdout)
    assert data["task"] == "detection" and data["images"] == 12
    assert data["map50"] == pytest.approx(1.0) and data["map"] == pytest.approx(1.0)


def test_eval_refuses_mismatched_categories_and_wrong_kind(det_dir, coco_set, tmp_path):
    doc = json.loads(coco_set.read_text())
    doc["categories"] = doc["categories"][::-1]
    bad = coco_set.parent / "swapped.json"
    bad.write_text(json.dumps(doc))
    proc = k2edge("eval", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(det_dir / "stretch.toml"),
                  "--dataset", str(bad), check=False)
    assert_one_line_error(proc, "categories do not match the model's", "labels from index 0 (")
    proc = k2edge("eval", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(det_dir / "stretch.toml"),
                  "--dataset", str(ROOT_MODEL.replace("model.onnx", "eval.npz")), check=False)
    assert_one_line_error(proc, "is evaluated on a COCO annotation file")


def test_a_broken_coco_entry_is_refused_not_scored(coco_set):
    """A NaN or negative-size box, an annotation on an image not listed, an image id twice: each one line naming the
    entry, where pycocotools would have scored it and changed the mAP."""
    from k2edge.errors import DatasetError
    from k2edge.model.datasets import open_coco

    def broken(change):
        doc = json.loads(coco_set.read_text())
        change(doc)
        out = coco_set.parent / "broken.json"
        out.write_text(json.dumps(doc))
        return out

    def bbox(value):
        return lambda d: d["annotations"][0].update(bbox=value)

    cases = [(bbox([float("nan")] * 4), r"annotations\[0\] \(id \d+\): bbox \[nan, nan, nan, nan\] must be finite"),
             (bbox([10, 10, -5, -5]), r"annotations\[0\] .*with a width and height above 0"),
             (lambda d: d["annotations"][0].update(image_id=999), r"annotations\[0\] .*image_id 999 is not in 'images'"),
             (lambda d: d["images"][1].update(id=d["images"][0]["id"]), r"image id\(s\) \[\d+\] appear more than once"),
             (lambda d: d["images"][0].update(file_name="."), r"1 image file\(s\) name a folder, not an image"),
             (lambda d: d["images"][0].update(file_name="gone.jpg"), r"1 image file\(s\) missing, e.g. '.*gone.jpg'"),
             (lambda d: d.update(annotations=[]), r"no ground-truth box on \d+ image\(s\): mAP is undefined")]
    for change, message in cases:
        with pytest.raises(DatasetError, match=message):
            open_coco(broken(change))


def test_int8_keeps_the_head_in_float_and_the_boxes(det_dir, coco_set, cache_dir):
    """INT8 through the card: the head (decode, concat) gets no Q/DQ and no TensorRT range; mAP holds."""
    from k2edge.engine.cache import EngineCache
    from k2edge.config.resolve import model_card
    from k2edge.engine.quantize import detection_head
    from int8_support import int8_decision
    from k2edge.model import normalise
    from k2edge.model.datasets import open_dataset
    from k2edge.tasks import Preprocess

    nm = normalise(str(det_dir / "det.onnx"))
    head = detection_head(nm.graph, "output0")
    assert head == {"slice_xy", "slice_wh", "slice_cls", "xy_sigmoid", "xy_grid", "xy_stride", "wh_sigmoid",
                    "wh_scale_mul", "cls_sigmoid", "head_concat", "head_reshape"}
    card = model_card(det_dir / "det.onnx", nm, det_dir / "stretch.toml")
    calib = coco_set.parent / "images"
    q = int8_decision(nm, open_dataset(calib), Preprocess.from_card(card), EngineCache(cache_dir), card=card).quant
    qdq = onnx.load(str(q.qdq_model))
    producers = {o: n.name for n in qdq.graph.node for o in n.output}
    assert len([n for n in qdq.graph.node if n.name in head]) == len(head)
    # the last conv's output is quantised once (logits, one range); nothing the head computes is
    quantised = [producers.get(n.input[0]) for n in qdq.graph.node if n.op_type == "QuantizeLinear"]
    assert "head_conv" in quantised and not head & set(quantised)
    assert any(n.op_type == "QuantizeLinear" for n in qdq.graph.node)  # the convs are quantised
    assert "output0" not in q.dynamic_ranges and "cat" not in q.dynamic_ranges and "f" in q.dynamic_ranges
    data = json.loads(k2edge("eval", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--precision", "int8", "--calib", str(calib),
                             "--card", str(det_dir / "stretch.toml"), "--dataset", str(coco_set), "--json").stdout)
    assert data["map50"] >= 0.99 and any("int8" in lane for lane in data["lanes"])


def test_keep_float_names_must_exist(det_dir, coco_set):
    card = det_dir / "keep.toml"
    card.write_text(_card("stretch", '[quantization]\nkeep_float = ["no_such_node"]\n'))
    proc = k2edge("eval", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--precision", "int8", "--calib",
                  str(coco_set.parent / "images"), "--card", str(card), "--dataset", str(coco_set), check=False)
    assert_one_line_error(proc, "quantization.keep_float: the model has no node(s) 'no_such_node'")


def test_card_init_suggests_yolov8_and_inspect_says_so(det_dir, tmp_path):
    out = tmp_path / "det.card.toml"
    proc = k2edge("card", "init", str(det_dir / "det.onnx"), "--out", str(out))
    assert "looks like YOLOv8" in proc.stdout
    text = out.read_text()
    assert 'task = "detection"' in text and 'resize = "letterbox"' in text and "size = [64, 96]" in text
    assert 'format = "yolov8"' in text and 'labels = "' in text
    from k2edge.config.card import load_card

    card = load_card(out)
    assert card.task == "detection" and card.labels.endswith("labels.txt")
    data = json.loads(k2edge("inspect", str(det_dir / "det.onnx"), "--json").stdout)
    assert data["card"]["suggested"]["task"] == "detection" and "YOLOv8" in data["card"]["why"]
    proc = k2edge("card", "init", str(det_dir / "det.onnx"), "--out", str(out), check=False)
    assert_one_line_error(proc, "exists; pass --force")


def test_cloud_curve_on_a_detection_set(det_dir, coco_set, tmp_path):
    """Share sent vs mAP: 0 % is the edge's mAP, 100 % is perfect (the cloud fixes what it sees)."""
    # a threshold that drops the white squares (score 0.993) and keeps the red ones (0.99995): the cloud has work
    card = det_dir / "strict.toml"
    card.write_text(_card("stretch").replace("score_threshold = 0.5", "score_threshold = 0.999"))
    data = json.loads(k2edge("cloud", "curve", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(card),
                             "--dataset", str(coco_set), "--shares", "0,50,100", "--json").stdout)
    points = data["points"]
    assert data["measure"] == "max_box_score" and [p["escalated"] for p in points] == [0, 6, 12]
    assert points[0]["map50"] < points[1]["map50"] <= points[2]["map50"] == pytest.approx(1.0)
    proc = k2edge("cloud", "curve", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(card), "--dataset",
                  str(coco_set), "--measure", "entropy", check=False)
    assert_one_line_error(proc, "is a classifier measure")
    text = k2edge("cloud", "curve", str(det_dir / "det.onnx"), "-p", "cpu-dev", "--card", str(card), "--dataset",
                  str(coco_set), "--measure", "uncertain_boxes", "--band", "0.3,0.99999", "--shares", "0,100").stdout
    assert "mAP@0.5" in text and "uncertain_boxes in [0.3, 0.99999)" in text


def test_pareto_sweep_uses_map50_for_a_detector(det_dir, coco_set, tmp_path):
    """A detector's sweep measures COCO mAP@0.5 as its accuracy axis and says so in the table and results."""
    out = tmp_path / "sweep"
    proc = k2edge("pareto-sweep", str(det_dir / "det.onnx"), "--card", str(det_dir / "stretch.toml"), "--dataset",
                  str(coco_set), "--profiles", "cpu-dev", "c5", "--runs", "1", "--warmup", "2", "--requests", "20",
                  "--goal", "accuracy", "--out", str(out))
    assert "mAP@0.5" in proc.stdout
    doc = json.loads((out / "results.json").read_text())
    ok = [r for r in doc["configs"] if r["status"] == "ok"]
    assert len(ok) == 2 and all(r["accuracy_metric"] == "mAP@0.5" and r["map50"] == pytest.approx(1.0) for r in ok)
    assert "mAP@0.5" in doc["recommendation"]["reason"] and (out / "pareto.png").stat().st_size > 0
    assert "map50" in (out / "results.csv").read_text().splitlines()[0]
