"""Model cards: the fixed contract loads as written, bad keys are refused with their path, the card
is found beside the model, and the layers (daemon settings > card > ONNX metadata > defaults) win
key by key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from k2edge.config import load_config
from k2edge.config.card import CardError, find_card, load_card, metadata_layer, resolve_card

ROOT = Path(__file__).resolve().parents[1]

CONTRACT = '''\
task = "detection"                 # classification | detection | tensor
labels = "labels.txt"              # one label per line, relative to the card
[input]
name = "images"                    # optional; default: the model's only input
size = [320, 320]                  # [height, width] of the model input
resize = "letterbox"               # stretch | letterbox (keep ratio, centred padding) | pad-right (keep ratio, pad right and bottom)
pad_value = 114                    # 0..255
color = "RGB"                      # RGB | BGR | L (one grey channel)
scale = 0.00392156862745098        # x = pixel * scale, then (x - mean) / std per channel
mean = [0.0, 0.0, 0.0]
std = [1.0, 1.0, 1.0]
[classification]
output = "logits"                  # logits | probabilities
[detection]
format = "yolov8"                  # yolov8: [N, 4 + classes, anchors], cx cy w h in input pixels, class scores already sigmoid, no objectness
                                   # yolov5: [N, anchors, 5 + classes], objectness x class score
score_threshold = 0.25
iou_threshold = 0.45
max_detections = 100
class_agnostic_nms = false
'''


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_contract_loads_exactly_as_written(tmp_path):
    """The issue's card loads unchanged, every value as written, labels relative to the card."""
    card = load_card(_write(tmp_path / "card.toml", CONTRACT))
    assert card.task == "detection"
    assert Path(card.labels) == tmp_path.resolve() / "labels.txt"
    i = card.input
    assert (i.name, i.size, i.resize, i.pad_value, i.color) == ("images", (320, 320), "letterbox", 114, "RGB")
    assert (i.scale, i.mean, i.std) == (0.00392156862745098, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert card.classification.output == "logits"
    d = card.detection
    assert (d.format, d.score_threshold, d.iou_threshold, d.max_detections, d.class_agnostic_nms) == (
        "yolov8", 0.25, 0.45, 100, False)
    assert d.max_candidates == 1000


@pytest.mark.parametrize("edit, message", [
    (('resize = "letterbox"', 'resize = "squash"'), "input.resize: must be one of 'stretch', 'letterbox', 'pad-right' or 'center-crop', got 'squash'"),
    (("std = [1.0, 1.0, 1.0]", "std = [0, 1, 1]"), "input.std: every value must be > 0 (it divides), got [0, 1, 1]"),
    (("size = [320, 320]", 'size = ["320", 320]'), "input.size: must be two whole numbers"),
    (("pad_value = 114", "pad_value = 300"), "input.pad_value: must be <= 255, got 300"),
    (('color = "RGB"', 'color = "RGBA"'), "input.color: must be one of"),
    (("mean = [0.0, 0.0, 0.0]", "mean = [0.0, 0.0]"), "input.mean: must be a list of 1 or 3 numbers"),
    (('format = "yolov8"', 'format = "ssd"'), "detection.format: must be one of 'yolov8', 'yolov5' or 'end2end', got 'ssd'"),
    (("iou_threshold = 0.45", "iou_threshold = 0"), "detection.iou_threshold: must be > 0"),
    (('task = "detection"', 'task = "depth"'), "task: must be one of"),
    (("max_detections = 100", "max_detections = 100\nmax_boxes = 3"), "detection.max_boxes: unknown key (known keys: format,"),
    (('task = "detection"', 'task = "detection"\nsource = "x"'), "source: unknown key (known keys: task, labels, input,"),
])
def test_bad_values_are_refused_with_the_key_path(tmp_path, edit, message):
    """Each bad key is refused with its dotted path and what is wrong."""
    old, new = edit
    path = _write(tmp_path / "card.toml", CONTRACT.replace(old, new, 1))
    with pytest.raises(CardError) as exc:
        load_card(path)
    assert str(exc.value).startswith(f"{path}: ") and message in str(exc.value), str(exc.value)


@pytest.mark.parametrize("key", ["mean", "std"])
def test_grey_card_with_three_means_is_refused(tmp_path, key):
    """color L takes one mean/std value, not three; the message reads as every other card error (no "(top level)")."""
    path = _write(tmp_path / "card.toml", f'[input]\ncolor = "L"\n{key} = [0.1, 0.2, 0.3]\n')
    with pytest.raises(CardError) as exc:
        load_card(path)
    assert str(exc.value) == f"{path}: input.{key}: color L has 1 channel(s); give 1 value, got 3"


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(CardError, match="not valid TOML"):
        load_card(_write(tmp_path / "card.toml", "task = \n"))
    with pytest.raises(CardError, match="does not exist"):
        load_card(tmp_path / "nope.toml")


def test_size_contradicting_a_static_input_is_refused(tmp_path):
    """A card whose size is not the model's static H x W is refused, naming the card and the dims."""
    card = load_card(_write(tmp_path / "card.toml", CONTRACT))
    assert resolve_card("images", (1, 3, 320, 320), {}, card, input_names=("images",)).input.size == (320, 320)
    with pytest.raises(CardError, match=r"input.size: \[320, 320\] \(\[height, width\]\) contradicts the model's static "
                                         r"input 'images' \[1, 3, 320, 640\] \(NCHW\): width is 640, not 320"):
        resolve_card("images", (1, 3, 320, 640), {}, card, input_names=("images",))
    with pytest.raises(CardError, match="input.color: RGB gives 3 channel"):
        resolve_card("images", (1, 1, 320, 320), {}, card, input_names=("images",))
    with pytest.raises(CardError, match="input.name: the model has no input 'images'"):
        resolve_card("x", (1, 3, 320, 320), {}, card, input_names=("x",))


def test_portrait_size_is_height_first(tmp_path):
    """size = [height, width]: [480, 320] fits an NCHW input of 480 rows and 320 columns."""
    card = load_card(_write(tmp_path / "card.toml", "[input]\nsize = [480, 320]\n"))
    assert resolve_card("x", (1, 3, 480, 320), {}, card).input.size == (480, 320)
    with pytest.raises(CardError, match="height is 320, not 480"):
        resolve_card("x", (1, 3, 320, 480), {}, card)


def test_metadata_size_is_width_first_and_converted():
    """The model's k2edge.preprocess metadata stores [width, height]; the card layer holds [height, width]."""
    md = {"k2edge.preprocess": json.dumps({"color": "RGB", "size": [640, 480], "mean": [0.5], "std": [0.25]})}
    assert metadata_layer(md)["input"]["size"] == (480, 640)
    card = resolve_card("x", (1, 3, 480, 640), md)
    assert card.input.size == (480, 640) and card.input.mean == (0.5,) and card.input.std == (0.25,)
    with pytest.raises(CardError, match="malformed"):
        metadata_layer({"k2edge.preprocess": "{not json"})


def test_layers_win_key_by_key(tmp_path):
    """overrides > card > metadata > defaults, each layer setting only the keys it names."""
    md = {"k2edge.preprocess": json.dumps({"color": "L", "size": [32, 32], "mean": [0.3], "std": [0.2]})}
    shape = (1, 1, 32, 32)
    defaults = resolve_card("x", (1, 3, 64, 48))
    assert (defaults.task, defaults.input.color, defaults.input.size, defaults.input.resize) == (
        "classification", "RGB", (64, 48), "stretch")
    assert defaults.input.scale == 1 / 255 and defaults.input.mean == (0.0,)
    from_md = resolve_card("x", shape, md)
    assert (from_md.input.color, from_md.input.mean, from_md.input.resize) == ("L", (0.3,), "stretch")
    card = load_card(_write(tmp_path / "card.toml", '[input]\nresize = "letterbox"\nmean = [0.5]\n'))
    carded = resolve_card("x", shape, md, card)
    assert (carded.input.resize, carded.input.mean, carded.input.std) == ("letterbox", (0.5,), (0.2,))
    over = resolve_card("x", shape, md, card, {"input": {"mean": [0.7]}, "detection": {"score_threshold": 0.5}})
    assert (over.input.resize, over.input.mean, over.input.std, over.detection.score_threshold) == (
        "letterbox", (0.7,), (0.2,), 0.5)


def test_tensor_model_has_no_image_size():
    """A model whose input is not an image batch gets no image preprocessing by default."""
    assert resolve_card("x", (1, 16)).input.size is None


def test_discovery_prefers_the_model_stem_card(tmp_path):
    """<model-stem>.card.toml is found before card.toml; neither -> None."""
    model = tmp_path / "yolo.onnx"
    assert find_card(model) is None
    _write(tmp_path / "card.toml", "task = \"classification\"\n")
    assert find_card(model) == tmp_path / "card.toml"
    _write(tmp_path / "yolo.card.toml", "task = \"detection\"\n")
    assert find_card(model) == tmp_path / "yolo.card.toml"
    assert find_card(tmp_path / "other.onnx") == tmp_path / "card.toml"


def test_digits_card_matches_its_metadata():
    """The digits model's card says what its ONNX metadata says (color L), so nothing changes."""
    import onnx

    model = ROOT / "models" / "digits" / "model.onnx"
    md = {p.key: p.value for p in onnx.load(str(model)).metadata_props}
    card = load_card(find_card(model))
    assert card.input.color == "L"
    with_card = resolve_card("input", (1, 1, 32, 32), md, card)
    without = resolve_card("input", (1, 1, 32, 32), md)
    assert with_card.input == without.input
    assert Path(with_card.labels) == model.parent.resolve() / "labels.txt"


def test_daemon_config_card_path_and_table(tmp_path):
    """[[models]] takes card = "FILE" (relative to the config) or a [models.card] table, validated with its path."""
    cfg = _write(tmp_path / "k.toml", '[[models]]\nname = "a"\nonnx = "m.onnx"\ncard = "m.card.toml"\n')
    assert load_config(cfg).models[0].card_args() == {"card": tmp_path.resolve() / "m.card.toml"}
    cfg = _write(tmp_path / "k.toml", '[[models]]\nname = "a"\nonnx = "m.onnx"\n[models.card]\ntask = "detection"\n'
                                      'labels = "l.txt"\n[models.card.detection]\nscore_threshold = 0.4\n')
    over = load_config(cfg).models[0].card_args()["card_overrides"]
    assert over.layer() == {"task": "detection", "labels": str(tmp_path.resolve() / "l.txt"),
                            "detection": {"score_threshold": 0.4}}
    cfg = _write(tmp_path / "k.toml", '[[models]]\nname = "a"\nonnx = "m.onnx"\n[models.card.input]\nresize = "squash"\n')
    with pytest.raises(Exception, match=r"models.0.card: input.resize: must be one of"):
        load_config(cfg)


def test_engine_layers_the_daemon_table_over_the_card_beside_the_model(tmp_path):
    """Engine.build(card_overrides=...) keeps the card beside the model and overrides only the keys given;
    labels given to the engine override the card's."""
    from k2edge import Engine

    model = ROOT / "models" / "digits" / "model.onnx"
    labels = tmp_path / "names.txt"
    labels.write_text("\n".join(f"digit {i}" for i in range(10)) + "\n")
    engine = Engine.build(model, "cpu-dev", card_overrides={"classification": {"output": "probabilities"}}, labels=labels)
    assert engine.card.classification.output == "probabilities"
    assert engine.card.input.color == "L" and engine.card.input.mean == (0.3058,)
    assert engine.labels[3] == "digit 3"
    rows = engine.top_k(np.array([[0.1, 0.7, 0.2] + [0.0] * 7]), 1)
    assert rows[0][0] == {"index": 1, "label": "digit 1", "score": 0.7}  # taken as probabilities, no softmax


DETECTOR = ROOT / "models" / "detector"


def _detector_card(tmp_path: Path, extra: str = "", labels: str | None = None) -> Path:
    """The demo detector's own card (and labels) copied to tmp_path, edited."""
    (tmp_path / "labels.txt").write_text(labels if labels is not None else (DETECTOR / "labels.txt").read_text())
    return _write(tmp_path / "det.card.toml", (DETECTOR / "card.toml").read_text() + extra)


def test_card_show_names_the_card_for_a_table_it_sets(tmp_path):
    """card show marks [quantization] tolerance, an inline table the card sets, with the card, not '# default'."""
    from test_cli import k2edge

    card = _detector_card(tmp_path, '\n[quantization]\ntolerance = { recall = 0.9, precision = 0.95, score_ratio = 0.8 }\n')
    shown = k2edge("card", "show", str(DETECTOR / "model.onnx"), "--card", str(card)).stdout
    assert f"tolerance = {{ recall = 0.9, precision = 0.95, score_ratio = 0.8 }}  # {card}" in shown.splitlines()
    assert 'float_head = "decoding"  # default' in shown.splitlines()
    sources = json.loads(k2edge("card", "show", str(DETECTOR / "model.onnx"), "--card", str(card), "--json").stdout)["sources"]
    assert sources["quantization.tolerance.recall"] == str(card)


def test_a_table_set_by_two_layers_names_each_keys_source():
    """An inline table whose keys come from different layers names each key's source."""
    from k2edge.cli.card_cmd import _with_sources

    toml = "[quantization]\ntolerance = { recall = 0.9, precision = 0.95 }\nmethod = \"max\"\n"
    sources = {"quantization.tolerance.recall": "card.toml", "quantization.tolerance.precision": "daemon config"}
    assert _with_sources(toml, sources).splitlines()[1:] == [
        "tolerance = { recall = 0.9, precision = 0.95 }  # recall: card.toml; precision: daemon config",
        'method = "max"  # default']


def _hint(stdout: str) -> list[str]:
    import shlex

    command = shlex.split(stdout.strip().rsplit("check it with ", 1)[1])
    assert command[:3] == ["k2edge", "card", "show"], command
    return command[1:]


def test_card_init_hint_shows_the_card_it_wrote(tmp_path):
    """The command card init ends with shows the card written: with --card for --out FILE, or when a
    <stem>.card.toml beside the model would be found first; bare for the card.toml that card show finds."""
    import shutil

    from test_cli import k2edge

    model = tmp_path / "my model" / "model.onnx"  # a space: the hint is quoted for the shell
    model.parent.mkdir()
    shutil.copy(ROOT / "models" / "digits" / "model.onnx", model)
    elsewhere = tmp_path / "cards" / "digits.toml"
    elsewhere.parent.mkdir()
    beside = model.with_name("card.toml")
    for out, bare in ((elsewhere, False), (beside, True)):
        hint = _hint(k2edge("card", "init", str(model), "--out", str(out)).stdout)
        assert ("--card" not in hint) == bare, hint
        assert k2edge(*hint).stdout.splitlines()[0] == f"# {out}"
    beside.unlink()
    _write(model.with_name("model.card.toml"), 'task = "classification"\n')  # found before card.toml
    hint = _hint(k2edge("card", "init", str(model)).stdout)
    assert hint[-2:] == ["--card", str(beside)]
    assert k2edge(*hint).stdout.splitlines()[0] == f"# {beside}"


def test_a_yolov8_output_read_as_yolov5_blames_the_format_not_the_labels(tmp_path):
    """format = "yolov5" on the demo detector (YOLOv8's [N, 4 + 10, 525]) names the shape and both layouts, not
    "10 label(s) for a detector of 520 class(es)"; labels that fit neither format are still blamed."""
    from test_cli import assert_one_line_error, k2edge

    model = str(DETECTOR / "model.onnx")
    card = _detector_card(tmp_path)
    _write(card, card.read_text().replace('format = "yolov8"', 'format = "yolov5"'))
    proc = k2edge("card", "show", model, "--card", str(card), check=False)
    assert_one_line_error(proc, f"{card}: detection.format: output 'output0' [1, 14, 525] looks like yolov8, not yolov5: "
                                "yolov8 is [N, 4 + classes, anchors] (10 class(es), as the 10 label(s)), "
                                "yolov5 is [N, anchors, 5 + classes] (520 class(es)); set format = \"yolov8\"")
    assert "label(s) for a detector" not in proc.stderr
    _write(tmp_path / "labels.txt", "a\nb\nc\n")
    assert_one_line_error(k2edge("card", "show", model, "--card", str(card), check=False),
                          "labels: 3 label(s) for a detector of 520 class(es) (output 'output0' [1, 14, 525])")
    _write(card, card.read_text().replace('format = "yolov5"', 'format = "yolov8"'))
    assert_one_line_error(k2edge("card", "show", model, "--card", str(card), check=False),
                          "labels: 3 label(s) for a detector of 10 class(es)")


def test_card_init_reads_a_softmax_output_as_probabilities(tmp_path):
    """A classifier whose graph ends in Softmax (PP-OCR's direction classifier, here its real export from the
    rapidocr wheel) gets output = "probabilities": a second softmax flattened its scores (1.000 read as 0.731)."""
    import shutil

    import rapidocr_onnxruntime
    from test_cli import k2edge

    model = tmp_path / "cls" / "cls.onnx"
    model.parent.mkdir()
    shutil.copy(Path(rapidocr_onnxruntime.__file__).parent / "models" / "ch_ppocr_mobile_v2.0_cls_infer.onnx", model)
    proc = k2edge("card", "init", str(model), "--input-shape", "x=1x3x48x192")
    assert "a Softmax makes it: probabilities" in proc.stdout, proc.stdout
    assert load_card(model.with_name("card.toml")).classification.output == "probabilities"
    digits = tmp_path / "digits" / "model.onnx"  # logits: no Softmax in the graph
    digits.parent.mkdir()
    shutil.copy(ROOT / "models" / "digits" / "model.onnx", digits)
    k2edge("card", "init", str(digits))
    assert load_card(digits.with_name("card.toml")).classification.output == "logits"


def test_a_detector_without_a_card_is_read_as_a_classifier_with_a_warning(tmp_path, caplog):
    """No card: a model is a classifier (its output flattened), as it always was; an output that is not [N, classes]
    (the demo detector's [1, 14, 525], 7,350 'classes') now says so and names `card init`, where it said nothing."""
    import logging

    from k2edge.config.card import ModelCard
    from k2edge.tasks import decoder
    from k2edge.tasks.decoder import TaskDecoder

    caplog.set_level(logging.WARNING, logger="k2edge.tasks.decoder")
    decoder._TOLD.clear()
    TaskDecoder(ModelCard(), [], {"output0": (1, 14, 525)})
    TaskDecoder(ModelCard(), [], {"output0": (4, 14, 525)})  # the same model's engine for another batch size
    said = [r.getMessage() for r in caplog.records]
    assert said == ["output 'output0' [1, 14, 525] is read as a classifier of 7350 classes (flattened), as no card says "
                    "the task; a detector, a segmenter or a pose model needs a card: `k2edge card init MODEL` suggests one"]
    caplog.clear()
    TaskDecoder(ModelCard(), [], {"logits": (1, 10)})  # a classifier's output: nothing to say
    TaskDecoder(ModelCard(), [], {"logits": (1, 10, 1, 1)})
    TaskDecoder(ModelCard(), [], {"logits": (1, 1, 1000)})
    assert caplog.records == []
