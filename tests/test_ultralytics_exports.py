"""Real Ultralytics exports of every task (tests/fixtures/ultralytics, random weights, made by
tools/make_ultralytics_fixtures.py from the yaml; tests never import ultralytics): their layouts and
metadata, `card init` from the metadata then `infer` with no other step, labels written from the
metadata's names, where each card value comes from, dynamic exports without --input-shape, and
the stride / trained-size checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

import zoo
from test_cli import assert_one_line_error, k2edge

if "yolov8n-seg" not in zoo.ULTRALYTICS_NAMES:
    pytest.skip("tests/fixtures/ultralytics is not here", allow_module_level=True)

# name -> (metadata task, k2edge task, format, output shapes)
LAYOUTS = {
    "yolov8n-seg": ("segment", "segmentation", "yolov8", [[1, 116, 2100], [1, 32, 80, 80]]),
    "yolov8n-pose": ("pose", "pose", "yolov8", [[1, 56, 2100]]),
    "yolov8n-cls": ("classify", "classification", None, [[1, 1000]]),
    "yolov8n-obb": ("obb", "obb", "yolov8", [[1, 85, 2100]]),
    "yolo11n": ("detect", "detection", "yolov8", [[1, 84, 2100]]),
    "yolov10n": ("detect", "detection", "end2end", [[1, 300, 6]]),
}
ANSWER_KEYS = {"segmentation": {"box", "mask"}, "pose": {"box", "keypoints"}, "obb": {"rbox"}, "detection": {"box"}}


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "street.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)).save(path)
    return path


def _export(name: str, tmp_path):
    return zoo.save(name, tmp_path / name / "model.onnx")


def test_every_export_has_the_layout_and_metadata_the_cards_read():
    import onnx
    import onnxruntime as ort

    for name, (task, _, _, shapes) in LAYOUTS.items():
        m = zoo.load(name)
        meta = {p.key: p.value for p in m.metadata_props}
        assert meta["task"] == task and "names" in meta and meta["imgsz"] in ("[320, 320]", "[224, 224]"), name
        assert ("kpt_shape" in meta) == (task == "pose") and (meta["end2end"] == "True") == (name == "yolov10n")
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        assert [list(o.shape) for o in sess.get_outputs()] == shapes, name
        onnx.checker.check_model(m)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_card_init_then_infer_needs_no_other_step(name, tmp_path, image):
    """card init writes a complete card (task, format, size, interpolation) and labels.txt; infer answers."""
    model = _export(name, tmp_path)
    out = k2edge("card", "init", str(model)).stdout
    _, task, fmt, _ = LAYOUTS[name]
    card = (model.parent / "card.toml").read_text()
    assert f'task = "{task}"' in card and 'labels = "labels.txt"' in card and "jpeg_draft = false" in card
    if task == "classification":  # Ultralytics' classify_transforms: torchvision on a PIL image
        assert 'resize = "center-crop"' in card and 'interpolation = "antialias"' in card
    else:
        assert 'resize = "letterbox"' in card and 'interpolation = "linear"' in card
    assert ("size = [224, 224]" if task == "classification" else "size = [320, 320]") in card
    assert fmt is None or f'format = "{fmt}"' in card
    labels = (model.parent / "labels.txt").read_text().splitlines()
    assert len(labels) == (1 if task == "pose" else 1000 if task == "classification" else 80), out
    as_written = json.loads(k2edge("infer", str(model), "-p", "cpu-dev", str(image), "--json").stdout)
    assert ("top_k" if task == "classification" else "detections") in as_written  # the card as written serves
    if task != "classification":  # random weights score about 1e-4: lower the threshold to see answers
        (model.parent / "card.toml").write_text(card.replace("score_threshold = 0.25", "score_threshold = 0.0")
                                                .replace("max_detections = 300", "max_detections = 3"))
    answer = json.loads(k2edge("infer", str(model), "-p", "cpu-dev", str(image), "--json").stdout)
    if task == "classification":
        assert len(answer["top_k"]) == 5 and answer["top_k"][0]["label"] in labels
        return
    dets = answer["detections"]
    assert 1 <= len(dets) <= 3 and all(set(d) == {"index", "label", "score"} | ANSWER_KEYS[task] for d in dets)
    d = dets[0]
    if task == "segmentation":
        assert d["mask"]["size"] == [480, 640] and isinstance(d["mask"]["counts"], str)
    if task == "pose":
        assert len(d["keypoints"]) == 17 and all(0 <= x <= 640 and 0 <= y <= 480 for x, y, _ in d["keypoints"])
    if task == "obb":
        assert len(d["rbox"]) == 5


def test_card_init_keeps_an_existing_labels_file(tmp_path):
    model = _export("yolo11n", tmp_path)
    (model.parent / "labels.txt").write_text("mine\n" * 80)
    out = k2edge("card", "init", str(model)).stdout
    assert "kept the existing" in out and (model.parent / "labels.txt").read_text() == "mine\n" * 80


def test_infer_save_annotated_and_save_input_for_every_box_task(tmp_path, image):
    """--save-annotated draws each task's answer; --save-input writes the staged batch [N, 3, H, W]."""
    for name in ("yolov8n-seg", "yolov8n-pose", "yolov8n-obb"):
        model = _export(name, tmp_path)
        k2edge("card", "init", str(model))
        card = model.parent / "card.toml"
        card.write_text(card.read_text().replace("score_threshold = 0.25", "score_threshold = 0.0"))
        out, staged = tmp_path / f"{name}.png", tmp_path / f"{name}.npy"
        k2edge("infer", str(model), "-p", "cpu-dev", str(image), "--save-annotated", str(out), "--save-input", str(staged))
        assert Image.open(out).size == (640, 480)
        x = np.load(staged)
        assert x.shape == (1, 3, 320, 320) and x.dtype == np.float32
        assert np.allclose(x[0, :, :40], 114 / 255)  # letterbox padding above the 640x480 image


def test_sources_are_named_by_inspect_and_card_show(tmp_path):
    model = _export("yolov8n-pose", tmp_path)
    data = json.loads(k2edge("inspect", str(model), "--json").stdout)["card"]
    assert data["task"] == "pose" and data["sources"]["task"] == "Ultralytics metadata"
    assert data["sources"]["input.size"] == "Ultralytics metadata"
    assert "from Ultralytics metadata: " in k2edge("inspect", str(model)).stdout
    (model.parent / "card.toml").write_text('[detection]\nscore_threshold = 0.5\n')
    shown = k2edge("card", "show", str(model)).stdout
    assert "score_threshold = 0.5  # " in shown and "card.toml" in shown.split("score_threshold = 0.5  # ")[1].split("\n")[0]
    assert 'task = "pose"  # Ultralytics metadata' in shown and "max_candidates = 1000  # default" in shown
    sources = json.loads(k2edge("card", "show", str(model), "--json").stdout)["sources"]
    assert sources["detection.iou_threshold"] == "Ultralytics metadata" and sources["detection.score_threshold"].endswith("card.toml")


def test_dynamic_export_needs_no_input_shape(tmp_path):
    """inspect, card init, card show and plan take a dynamic export's size from the card, else the metadata."""
    model = zoo.save("yolov8n-dynamic", tmp_path / "dyn" / "model.onnx")
    data = json.loads(k2edge("inspect", str(model), "--json").stdout)
    assert data["inputs"][0]["shape"] == [1, 3, 320, 320]  # the metadata's imgsz
    k2edge("card", "init", str(model))
    k2edge("card", "show", str(model))
    plan = json.loads(k2edge("plan", str(model), "-p", "c3", "--json").stdout)
    assert plan["segments"]
    (model.parent / "card.toml").write_text((model.parent / "card.toml").read_text().replace("size = [320, 320]", "size = [256, 384]"))
    data = json.loads(k2edge("inspect", str(model), "--json").stdout)
    assert data["inputs"][0]["shape"] == [1, 3, 256, 384] and data["outputs"][0]["shape"] == [1, 84, 2016]


def test_a_size_off_the_stride_is_refused_and_an_untrained_size_warned(tmp_path):
    model = zoo.save("yolov8n-dynamic", tmp_path / "dyn" / "model.onnx")
    card = model.parent / "card.toml"
    card.write_text('task = "detection"\n[input]\nsize = [320, 300]\n')
    proc = k2edge("card", "show", str(model), check=False)
    assert_one_line_error(proc, "input.size: [320, 300]", "not a multiple of the model's stride 32",
                          "width 288 or 320")
    card.write_text('task = "detection"\n[input]\nsize = [640, 640]\n')
    proc = k2edge("card", "show", str(model))
    assert "differs from the size the model was trained at, [320, 320]" in proc.stderr


@pytest.mark.parametrize("name,metric", [("yolov8n-seg", "segm"), ("yolov8n-pose", "keypoints")])
def test_eval_measures_masks_and_keypoints_end_to_end(name, metric, tmp_path, image):
    """k2edge eval on a segmentation / pose export reports the mask / keypoint mAP beside the boxes'."""
    model, annotations = _instance_eval_set(name, tmp_path, image)
    result = json.loads(k2edge("eval", str(model), "-p", "cpu-dev", "--dataset", str(annotations), "--json").stdout)
    assert result["metric"] == metric and result["task"] in ("segmentation", "pose")
    assert 0 <= result["map"] <= 1 and 0 <= result["box_map"] <= 1 and result["images"] == 1


def _instance_eval_set(name: str, tmp_path, image):
    """An export with the card `card init` writes, and a one-image COCO set with a box, a mask and 17 keypoints."""
    model = _export(name, tmp_path)
    k2edge("card", "init", str(model))
    labels = (model.parent / "labels.txt").read_text().splitlines()
    data = model.parent / "eval"
    data.mkdir()
    (data / "a.jpg").write_bytes(image.read_bytes())
    box = [100.0, 80.0, 200.0, 160.0]
    ann = {"id": 1, "image_id": 1, "category_id": 0, "bbox": box, "area": box[2] * box[3], "iscrowd": 0,
           "segmentation": [[100, 80, 300, 80, 300, 240, 100, 240]],
           "keypoints": [v for i in range(17) for v in (120.0 + 5 * i, 100.0 + 3 * i, 2)], "num_keypoints": 17}
    doc = {"images": [{"id": 1, "file_name": "a.jpg", "width": 640, "height": 480}], "annotations": [ann],
           "categories": [{"id": i, "name": n} for i, n in enumerate(labels)]}
    (data / "annotations.json").write_text(json.dumps(doc))
    return model, data / "annotations.json"


@pytest.mark.parametrize("name,metric", [("yolov8n-seg", "segm"), ("yolov8n-pose", "keypoints")])
def test_cloud_curve_measures_masks_and_keypoints(name, metric, tmp_path, image):
    """cloud curve on a segmentation / pose model: the task's mAP, from the edge's (random weights: about 0) to
    the ground truth's (1.0) when every image goes to the cloud."""
    model, annotations = _instance_eval_set(name, tmp_path, image)
    out = json.loads(k2edge("cloud", "curve", str(model), "-p", "cpu-dev", "--dataset", str(annotations),
                            "--shares", "0,100", "--json").stdout)
    assert out["metric"] == metric
    first, last = out["points"]
    assert first["escalated"] == 0 and first["map"] < 0.5 and last["escalated"] == 1
    assert last["map"] == pytest.approx(1.0) and last["map50"] == pytest.approx(1.0)


def test_the_sweep_measures_a_pose_model_by_its_keypoints(tmp_path, image):
    """pareto-sweep's accuracy axis for pose (and segmentation) is the task's own mAP."""
    from k2edge import Engine
    from k2edge.engine.evaluate import open_eval_set
    from k2edge.sweep.measure import _accuracy
    from k2edge.sweep.results import accuracy_of

    model = _export("yolov8n-pose", tmp_path)
    k2edge("card", "init", str(model))
    (tmp_path / "a.jpg").write_bytes(image.read_bytes())
    doc = {"images": [{"id": 1, "file_name": "a.jpg", "width": 640, "height": 480}],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 0, "bbox": [10, 10, 50, 80], "area": 4000, "iscrowd": 0,
                            "keypoints": [20.0, 20.0, 2] * 17, "num_keypoints": 17}],
           "categories": [{"id": 0, "name": (model.parent / "labels.txt").read_text().split()[0]}]}
    (tmp_path / "ann.json").write_text(json.dumps(doc))
    with Engine.build(model, "cpu-dev") as engine:
        record = _accuracy(engine, open_eval_set(engine, tmp_path / "ann.json"))
    assert record["accuracy_metric"] == "keypoint mAP@0.5" and accuracy_of(record) == record["map50"]


def test_eval_says_obb_is_not_evaluated(tmp_path, image):
    model = _export("yolov8n-obb", tmp_path)
    k2edge("card", "init", str(model))
    (tmp_path / "a.json").write_text("{}")
    proc = k2edge("eval", str(model), "-p", "cpu-dev", "--dataset", str(tmp_path / "a.json"), check=False)
    assert_one_line_error(proc, "oriented boxes (task obb) is not done yet")


def test_infer_names_an_image_that_does_not_decode(tmp_path, image):
    model = _export("yolo11n", tmp_path)
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(image.read_bytes()[:500])
    proc = k2edge("infer", str(model), "-p", "cpu-dev", str(bad), check=False)
    assert_one_line_error(proc, f"cannot decode image {str(bad)!r}")


def test_int8_keeps_the_segmentation_pose_and_obb_heads_in_float():
    """The head kept out of INT8 covers each task's extra values (mask coefficients and prototypes, keypoint
    decoding, the angle): by default their decoding, with ``float_head = "branches"`` exactly the export's last module
    found from the graph alone (the Detect/Segment/Pose/OBB module with its box, class, mask, keypoint and angle
    branches); the branches are what a check too small for a verdict moves out of INT8 first (QUANT_VERSION 11)."""
    from k2edge.config.card import ModelCard, QuantizationSpec
    from k2edge.engine.quantize import float_nodes, head_branches
    from k2edge.model import normalise

    for name, task, module in (("yolov8n-seg", "segmentation", 22), ("yolov8n-pose", "pose", 22),
                               ("yolov8n-obb", "obb", 22), ("yolo11n", "detection", 23),
                               ("yolov10n", "detection", 23)):
        g = normalise(zoo.load(name)).graph
        decoding, branches = float_nodes(g, ModelCard(task=task)), head_branches(g, ModelCard(task=task))
        keep = float_nodes(g, ModelCard(task=task, quantization=QuantizationSpec(float_head="branches")))
        for out in g.outputs:  # whatever produces each output is float
            assert g.nodes[g.producer[out]].name in decoding, (name, out)
        assert keep == {n.name for n in g.nodes if n.name.startswith(f"/model.{module}/")}, name
        assert decoding | branches == keep and not decoding & branches, name
        assert not {n.name for n in g.nodes if n.op_type == "Conv" and "dfl" not in n.name} & decoding, name
        if task == "pose":  # class scores and keypoint visibility
            assert sum(1 for n in g.nodes if n.name in decoding and n.op_type == "Sigmoid") >= 2


def test_without_metadata_the_stride_comes_from_the_graph(tmp_path):
    """An export stripped of Ultralytics' metadata: a detector's size off the graph's stride (32) is refused."""
    import onnx

    from k2edge.model.stride import graph_stride

    m = zoo.load("yolov8n-dynamic")
    del m.metadata_props[:]
    assert graph_stride(m) == 32 and graph_stride(zoo.load("yolov8n-seg")) == 32
    path = tmp_path / "bare" / "model.onnx"
    path.parent.mkdir()
    onnx.save(m, str(path))
    (path.parent / "card.toml").write_text('task = "detection"\n[input]\nsize = [320, 300]\nresize = "letterbox"\n')
    proc = k2edge("inspect", str(path), check=False)
    assert_one_line_error(proc, "stride 32 (the largest downsampling its graph shows): use height 320, width 288 or 320")


def test_the_readme_recipe_works_command_by_command(tmp_path, image):
    """The README's "Bring your own Ultralytics export" commands, as written, on a dynamic YOLOv8n export."""
    import pathlib
    import re
    import shlex

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("**Bring your own Ultralytics export.**", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert len(commands) == 4 and all(c.startswith("k2edge ") for c in commands)
    zoo.save("yolov8n-dynamic", tmp_path / "yolov8n.onnx")
    (tmp_path / "street.jpg").write_bytes(image.read_bytes())
    for command in commands:
        args = [str(tmp_path / a) if a in ("yolov8n.onnx", "street.jpg", "out.png") else a
                for a in shlex.split(command)[1:]]
        k2edge(*args)
    assert (tmp_path / "card.toml").is_file() and len((tmp_path / "labels.txt").read_text().splitlines()) == 80
    assert (tmp_path / "out.png").is_file()
