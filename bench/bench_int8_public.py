"""INT8 on a public pretrained HardSwish classifier: PP-OCR's text-direction classifier (0 / 180 degrees).

The model is ``ch_ppocr_mobile_v2.0_cls_infer.onnx`` as shipped inside the ``rapidocr-onnxruntime`` wheel
(PaddleOCR's MobileNetV3-small: HardSwish activations written as x * Clip(x + 3, 0, 6) / 6, squeeze-excite gates
of HardSigmoid -> Mul, depthwise convolutions; Apache-2.0). It is not trained here and not committed: give the
wheel or an unpacked copy (``pip download rapidocr-onnxruntime==1.4.4 --no-deps``).

Data: text lines rendered with Pillow's bundled font (random words, sizes, colours, blur and noise), half of
them rotated 180 degrees: 120 calibration lines, 400 evaluation lines and 200 lines for ``--check``, each set
from its own seed. They are not the
photographed text lines the model was trained on, so FP32 top-1 is about 81 %: what matters here is INT8
against FP32 on the same images.

    python bench/bench_int8_public.py --model path/to/rapidocr_onnxruntime-1.4.4-py3-none-any.whl [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MEMBER = "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"
# rapidocr's cls preprocessing, as the INT8 fixtures' card spells it (tools/make_int8_fixtures.py)
FIXTURE = ROOT / "tests" / "fixtures" / "int8" / "ppocr-cls"
WORDS = ["invoice", "total", "amount", "date", "street", "order", "number", "payment", "receipt", "customer", "the",
         "and", "Warehouse", "Station", "EXIT", "Platform", "Monday", "2024", "No.", "price", "$12.50", "Hello",
         "World", "parking", "zone", "open", "closed", "ticket", "route", "delivery"]
RUNS = [
    ("FP32", "cpu-dev", None, None),
    ("INT8 max, GPU only, no fallback", {"name": "gpu-int8-only", "edge_runtime": {"precision_fallback": ["int8"]}}, None, None),
    ("INT8 percentile 99.99, GPU only, no fallback",
     {"name": "gpu-int8-pct", "edge_runtime": {"precision_fallback": ["int8"], "calibration": {"method": "percentile"}}}, None, None),
    ("INT8 + fp16 fallback, GPU only", {"name": "gpu-int8", "edge_runtime": {"precision_fallback": ["int8", "fp16"]}}, None, None),
    ("c2", "c2", None, None), ("c3", "c3", None, None), ("c4", "c4", None, None),
    ("INT8 + fp16 fallback, GPU only, --check 200 other lines",
     {"name": "gpu-int8", "edge_runtime": {"precision_fallback": ["int8", "fp16"]}}, "check", None),
    ("c4, --check 200 other lines", "c4", "check", None),
]


def render(root: Path, n: int, seed: int) -> None:
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    rng = np.random.default_rng(seed)
    for cls in ("0", "180"):
        (root / cls).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        text = " ".join(rng.choice(WORDS, size=rng.integers(2, 5)))
        size = int(rng.integers(18, 34))
        font = ImageFont.load_default(size=size)
        bg = tuple(int(v) for v in rng.integers(170, 256, 3))
        fg = tuple(int(v) for v in rng.integers(0, 90, 3))
        w, h = int(font.getlength(text)) + int(rng.integers(8, 30)), size + int(rng.integers(8, 20))
        im = Image.new("RGB", (w, h), bg)
        ImageDraw.Draw(im).text((int(rng.integers(2, 8)), int(rng.integers(1, 6))), text, fill=fg, font=font)
        if rng.random() < 0.5:
            im = im.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.0))))
        arr = np.asarray(im).astype(np.float32) + rng.normal(0, 6, (h, w, 3))
        im = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
        cls = "0" if i % 2 == 0 else "180"
        (im.rotate(180) if cls == "180" else im).save(root / cls / f"{i:04d}.png")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the rapidocr-onnxruntime wheel, or the .onnx itself")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()

    from k2edge import Engine
    from k2edge.engine.evaluate import evaluate_classifier
    from k2edge.model.datasets import open_dataset

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "cls.onnx"
        if args.model.endswith(".whl"):
            with zipfile.ZipFile(args.model) as z:
                model.write_bytes(z.read(MEMBER))
        else:
            model.write_bytes(Path(args.model).read_bytes())
        (tmp / "cls.card.toml").write_text((FIXTURE / "card.toml").read_text())
        (tmp / "labels.txt").write_text((FIXTURE / "labels.txt").read_text())
        render(tmp / "calib", 120, 1)
        render(tmp / "eval", 400, 2)
        render(tmp / "check", 200, 3)
        dataset = open_dataset(tmp / "eval", ["0", "180"])
        reference = None
        for label, profile, check, _ in RUNS:
            engine = Engine.build(model, profile, calib=tmp / "calib", cache_dir=tmp / "cache",
                                  check=tmp / check if check else None)
            with engine:
                result = evaluate_classifier(engine, dataset)
            preds = np.array(result["predictions"])
            reference = preds if reference is None else reference
            check = engine.info.int8_check
            row = {"run": label, "top1": result["top1"], "agreement_with_fp32": float((preds == reference).mean()),
                   "int8_check": check.summary() if check else None, "status": check.status if check else None,
                   "layers_to_fp16": len(check.fallback) if check else 0}
            rows.append(row)
            print(f"{label}: top-1 {row['top1']:.4f}, agrees with FP32 on {row['agreement_with_fp32']:.3f}"
                  + (f"; check {row['status']} ({row['int8_check']}), {row['layers_to_fp16']} layers to fp16" if check else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
