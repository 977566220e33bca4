"""Train and export k2edge's demo detector: a small anchor-free YOLO-style network for digit scenes.

Builds everything under ``models/detector/`` from scikit-learn's bundled copy of
the UCI handwritten digits (no download), composed into cluttered colour scenes:

    model.onnx            input ``images`` float32 [N,3,160,160] (RGB / 255, letterboxed),
                          output ``output0`` float32 [N,14,525] in the YOLOv8 layout:
                          cx cy w h in input pixels, then 10 sigmoid class scores, no objectness
    card.toml             the model card (task = "detection", letterbox 160x160, yolov8 format)
    labels.txt            0 .. 9
    calib/                calibration scenes (JPEG, unlabelled, from the training digits)
    eval/annotations.json held-out scenes in COCO format; eval/images/*.jpg
    samples/              a few scenes for demos, landscape, portrait and square

Torch is only needed here, not by k2edge, so it lives in its own venv.
Run from the repository root:

    python -m venv .venv-train
    .venv-train/bin/pip install torch==2.13.0 numpy onnx onnxruntime scikit-learn pillow pycocotools
    .venv-train/bin/python tools/train_detector.py --out models/detector

The SiLU variant in tests/fixtures/detector-silu/ (see its README) is trained with
``--activation silu --data models/detector``: the same network with SiLU (exported as
Sigmoid + Mul), measured on the demo detector's own eval/ and samples/.

Deterministic (seed 0 everywhere, deterministic torch algorithms, a fixed
thread count). The script ends with its own check of the written files: a
plain numpy reference decode of the onnxruntime output (score threshold, per
class NMS, letterbox undone) scored by pycocotools, the reference mAP
implementation. k2edge's own decoder and ``k2edge eval`` measure the same
files independently.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SEED = 0
NUM_CLASSES = 10
INPUT = 160  # model input, square
STRIDES = (8, 16, 32)
PAD_VALUE = 114
OPSET = 17

# scenes
SCENE_SIZES = ((160, 160), (160, 160), (192, 128), (224, 144), (128, 192), (144, 208))  # (width, height)
DIGITS_PER_SCENE = (2, 6)              # inclusive
DIGIT_HEIGHT = (20, 64)                # px at a 160-pixel scene side, log-uniform
MAX_IOU = 0.35                         # between two digits of a scene: some overlap, none hidden
MAX_COVERED = 0.5                      # share of an earlier digit a later one may cover
MIN_CONTRAST = 45                      # a digit's ink is at least this much darker (grey level) than under it
BACKGROUND_LEVELS = (90, 255)          # background colour channels: mostly light, like paper, walls, signs
DISTRACTORS = "xkmwvnhuAEFHKMNPRTWXY#%&@+*"
JPEG_QUALITY_EVAL = 85
JPEG_QUALITY_TRAIN = (60, 95)

# data set sizes
TRAIN_SCENES = 8000
EVAL_SCENES = 200
CALIB_SCENES = 64
EVAL_FRACTION = 0.3  # digit split, as tools/train_digits.py

# training
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 5e-4
CENTER_RADIUS = 2.5                    # positives: anchors within this many strides of a box centre
LEVEL_RANGES = ((0, 20), (14, 40), (30, 1e9))  # max(l, t, r, b) in px each level regresses
BOX_LOSS_WEIGHT = 2.0

# reference decode (the card's [detection] values)
SCORE_THRESHOLD = 0.25
IOU_THRESHOLD = 0.45
MAX_DETECTIONS = 100
MAX_CANDIDATES = 1000


# ----------------------------------------------------------------------------- digits


def load_glyphs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """sklearn's 1,797 digits as 32x32 float ink maps (0..1), split as tools/train_digits.py splits them."""
    digits = load_digits()
    ink = np.stack([
        np.asarray(Image.fromarray(np.round(d * 255 / 16).astype(np.uint8)).resize((32, 32), Image.Resampling.BILINEAR),
                   dtype=np.float32) / 255
        for d in digits.images
    ])
    labels = digits.target.astype(np.int64)
    train_idx, eval_idx = train_test_split(np.arange(len(labels)), test_size=EVAL_FRACTION, stratify=labels,
                                           random_state=SEED)
    return ink[train_idx], labels[train_idx], ink[eval_idx], labels[eval_idx]


def glyph_alpha(ink: np.ndarray, height: int, rng: np.random.Generator) -> np.ndarray:
    """A digit's alpha mask at ``height`` px: varied aspect, slant and stroke weight."""
    aspect = rng.uniform(0.7, 1.05)
    width = max(6, round(height * aspect))
    img = Image.fromarray(np.round(ink * 255).astype(np.uint8))
    shear = rng.uniform(-0.25, 0.25)
    img = img.transform((32, 32), Image.Transform.AFFINE, (1, shear, -16 * shear, 0, 1, 0),
                        resample=Image.Resampling.BILINEAR)
    img = img.resize((width, height), Image.Resampling.BILINEAR)
    a = np.asarray(img, dtype=np.float32) / 255
    lo = rng.uniform(0.3, 0.45)  # stroke weight: where the blurry upscaled ink becomes solid
    return np.clip((a - lo) / 0.25, 0, 1)


# ----------------------------------------------------------------------------- scenes


@dataclass
class Scene:
    image: np.ndarray   # uint8 (H, W, 3)
    boxes: np.ndarray   # float32 (M, 4) x1 y1 x2 y2, pixels
    labels: np.ndarray  # int64 (M,)


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    x1 = np.maximum(box[0], boxes[:, 0])
    y1 = np.maximum(box[1], boxes[:, 1])
    x2 = np.minimum(box[2], boxes[:, 2])
    y2 = np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return inter / (area + areas - inter), inter / areas


def _background(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """Two-colour gradient, blotches of low-frequency colour noise, fine grain."""
    c0, c1 = rng.uniform(BACKGROUND_LEVELS[0], BACKGROUND_LEVELS[1], (2, 3))
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    t = (np.cos(angle) * xx / width + np.sin(angle) * yy / height + 1) / 2
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    blotches = rng.normal(0, rng.uniform(10, 40), (4, 4, 3)).astype(np.float32)
    blotches = np.stack([np.asarray(Image.fromarray(blotches[..., c]).resize((width, height), Image.Resampling.BICUBIC))
                         for c in range(3)], axis=-1)
    img = img + blotches + rng.normal(0, rng.uniform(1, 4), img.shape)
    return np.clip(img, 0, 255)


def _clutter(img: Image.Image, scale: float, rng: np.random.Generator) -> None:
    """Lines, outlines, filled shapes and letters that are not digits."""
    draw = ImageDraw.Draw(img)
    w, h = img.size

    def colour():
        return tuple(int(v) for v in rng.integers(0, 256, 3))

    for _ in range(rng.integers(2, 9)):
        pts = [tuple(rng.uniform(-10, [w + 10, h + 10])) for _ in range(2)]
        draw.line(pts, fill=colour(), width=int(rng.integers(1, 4)))
    for _ in range(rng.integers(1, 5)):
        x0, y0 = rng.uniform(-20, w), rng.uniform(-20, h)
        x1, y1 = x0 + rng.uniform(8, 60) * scale, y0 + rng.uniform(8, 60) * scale
        shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
        if rng.random() < 0.5:
            shape((x0, y0, x1, y1), fill=colour())
        else:
            shape((x0, y0, x1, y1), outline=colour(), width=int(rng.integers(1, 3)))
    for _ in range(rng.integers(0, 4)):
        font = ImageFont.load_default(size=float(rng.uniform(12, 36) * scale))
        char = DISTRACTORS[rng.integers(len(DISTRACTORS))]
        draw.text((rng.uniform(0, w - 10), rng.uniform(0, h - 10)), char, font=font, fill=colour())


def compose_scene(glyphs: np.ndarray, labels: np.ndarray, width: int, height: int,
                  rng: np.random.Generator) -> Scene:
    """Digits of varied size, colour and weight, some overlapping, on a cluttered background."""
    scale = min(width, height) / INPUT
    canvas = Image.fromarray(_background(width, height, rng).astype(np.uint8))
    _clutter(canvas, scale, rng)
    img = np.asarray(canvas, dtype=np.float32).copy()
    grey = img.mean(axis=2)
    boxes: list[np.ndarray] = []
    classes: list[int] = []
    wanted = int(rng.integers(DIGITS_PER_SCENE[0], DIGITS_PER_SCENE[1] + 1))
    for _ in range(wanted * 15):
        if len(boxes) == wanted:
            break
        k = int(rng.integers(len(glyphs)))
        size = round(math.exp(rng.uniform(*np.log(DIGIT_HEIGHT))) * scale)
        alpha = glyph_alpha(glyphs[k], size, rng)
        ys, xs = np.nonzero(alpha > 0.5)
        if len(xs) == 0:
            continue
        gh, gw = alpha.shape
        if gw >= width or gh >= height:
            continue
        ox, oy = int(rng.integers(0, width - gw + 1)), int(rng.integers(0, height - gh + 1))
        box = np.array([ox + xs.min(), oy + ys.min(), ox + xs.max() + 1, oy + ys.max() + 1], dtype=np.float32)
        if boxes:
            iou, covered = _iou(box, np.stack(boxes))
            if iou.max() > MAX_IOU or covered.max() > MAX_COVERED:
                continue
        under = grey[oy:oy + gh, ox:ox + gw][alpha > 0.5].mean()
        for _ in range(20):  # ink darker than what is under the digit, by a margin
            ink = rng.integers(0, 256, 3).astype(np.float32)
            if ink.mean() <= under - MIN_CONTRAST:
                break
        else:
            ink = np.clip(rng.normal(under - 2 * MIN_CONTRAST, 10, 3), 0, 255).astype(np.float32)
        a = alpha[..., None] * rng.uniform(0.8, 1.0)
        patch = img[oy:oy + gh, ox:ox + gw]
        img[oy:oy + gh, ox:ox + gw] = patch * (1 - a) + ink * a
        grey[oy:oy + gh, ox:ox + gw] = img[oy:oy + gh, ox:ox + gw].mean(axis=2)
        boxes.append(box)
        classes.append(int(labels[k]))
    return Scene(np.clip(np.round(img), 0, 255).astype(np.uint8),
                 np.array(boxes, dtype=np.float32).reshape(-1, 4), np.array(classes, dtype=np.int64))


def jpeg(image: np.ndarray, quality: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def letterbox(image: np.ndarray, size: int = INPUT) -> tuple[np.ndarray, float, float, float, float]:
    """Keep the ratio, centre, pad with 114 (YOLO's letterbox): (pixels, sx, sy, pad_x, pad_y)."""
    h, w = image.shape[:2]
    r = min(size / w, size / h)
    nw, nh = max(1, min(size, round(w * r))), max(1, min(size, round(h * r)))
    px, py = (size - nw) // 2, (size - nh) // 2
    out = np.full((size, size, 3), PAD_VALUE, dtype=np.uint8)
    resized = image if (nw, nh) == (w, h) else np.asarray(
        Image.fromarray(image).resize((nw, nh), Image.Resampling.BILINEAR))
    out[py:py + nh, px:px + nw] = resized
    return out, nw / w, nh / h, float(px), float(py)


def training_set(glyphs, labels, n: int, rng: np.random.Generator):
    """``n`` scenes, JPEG round trip, letterboxed: uint8 (n, 160, 160, 3) and per-scene boxes/labels in input px."""
    x = np.empty((n, INPUT, INPUT, 3), dtype=np.uint8)
    targets = []
    for i in range(n):
        w, h = SCENE_SIZES[rng.integers(len(SCENE_SIZES))]
        scene = compose_scene(glyphs, labels, w, h, rng)
        image = decode(jpeg(scene.image, int(rng.integers(*JPEG_QUALITY_TRAIN, endpoint=True))))
        x[i], sx, sy, px, py = letterbox(image)
        boxes = scene.boxes * np.array([sx, sy, sx, sy], dtype=np.float32) + np.array([px, py, px, py], dtype=np.float32)
        targets.append((boxes, scene.labels))
    return x, targets


# ------------------------------------------------------------------------------ model


ACTIVATIONS = {
    "relu": lambda: nn.ReLU(inplace=True),
    # SiLU as YOLOv8 uses it: the opset-17 export writes it as Sigmoid + Mul (x * sigmoid(x))
    "silu": lambda: nn.SiLU(),
}
ACTIVATION = "relu"  # set by --activation before the model is built


def conv(cin: int, cout: int, k: int = 3, s: int = 1) -> nn.Sequential:
    """Conv + BN + activation: BN folds into the Conv at export, ReLU (or Sigmoid and Mul) runs on the DLA."""
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout),
                         ACTIVATIONS[ACTIVATION]())


class Backbone(nn.Module):
    """Conv/ReLU/MaxPool only; features at strides 8, 16 and 32."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv(3, 16, s=2), conv(16, 32, s=2))                           # /4
        self.c3 = nn.Sequential(nn.MaxPool2d(2), conv(32, 48), conv(48, 48))                     # /8
        self.c4 = nn.Sequential(nn.MaxPool2d(2), conv(48, 64), conv(64, 64))                     # /16
        self.c5 = nn.Sequential(nn.MaxPool2d(2), conv(64, 80), conv(80, 80))                     # /32

    def forward(self, x):
        c3 = self.c3(self.stem(x))
        c4 = self.c4(c3)
        return c3, c4, self.c5(c4)


class Neck(nn.Module):
    """Top-down FPN: nearest (asymmetric) x2 upsampling and channel Concat, as the DLA runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.p5 = conv(80, 48, k=1)
        self.p4 = nn.Sequential(conv(48 + 64, 48, k=1), conv(48, 48))
        self.p3 = nn.Sequential(conv(48 + 48, 48, k=1), conv(48, 48))

    def forward(self, c3, c4, c5):
        p5 = self.p5(c5)
        p4 = self.p4(torch.cat([self.up(p5), c4], 1))
        p3 = self.p3(torch.cat([self.up(p4), c3], 1))
        return p3, p4, p5


class Predictor(nn.Module):
    """Per level: a 3x3 conv, then 4 box-distance and 10 class-logit maps (one 1x1 conv)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = conv(channels, channels)
        self.out = nn.Conv2d(channels, 4 + NUM_CLASSES, 1)
        nn.init.zeros_(self.out.weight)
        with torch.no_grad():
            self.out.bias[:4] = 0.5                              # softplus(0.5) ~ one stride each side
            self.out.bias[4:] = -math.log((1 - 0.01) / 0.01)     # 1 % prior for every class

    def forward(self, x):
        return self.out(self.body(x))


def anchor_grid(size: int = INPUT) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor centres (A, 2) in input pixels and strides (A,): stride 8 first, row-major (x fastest), as YOLOv8."""
    points, strides = [], []
    for s in STRIDES:
        n = size // s
        gy, gx = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        points.append(torch.stack([gx.reshape(-1), gy.reshape(-1)], 1).float().add(0.5).mul(s))
        strides.append(torch.full((n * n,), float(s)))
    return torch.cat(points), torch.cat(strides)


class Head(nn.Module):
    """Decoding only, no weights: raw maps -> YOLOv8 layout [N, 4 + classes, anchors].

    Box distances are softplus(raw) strides from the anchor centre (left, top, right, bottom);
    class scores are sigmoids; no objectness. Its nodes are named ``head/...`` in the ONNX.
    """

    def __init__(self) -> None:
        super().__init__()
        points, strides = anchor_grid()
        self.register_buffer("points", points.t().unsqueeze(0), persistent=False)     # [1, 2, A]
        self.register_buffer("strides", strides.view(1, 1, -1), persistent=False)     # [1, 1, A]

    def raw(self, maps) -> torch.Tensor:
        return torch.cat([m.flatten(2) for m in maps], 2)                              # [N, 14, A]

    def distances(self, raw: torch.Tensor) -> torch.Tensor:
        return F.softplus(raw[:, :4]) * self.strides                                   # [N, 4, A] l t r b

    def forward(self, maps) -> torch.Tensor:
        raw = self.raw(maps)
        d = self.distances(raw)
        x1y1 = self.points - d[:, :2]
        x2y2 = self.points + d[:, 2:]
        return torch.cat([(x1y1 + x2y2) / 2, x2y2 - x1y1, torch.sigmoid(raw[:, 4:])], 1)


class DigitDetector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.neck = Neck()
        self.pred = nn.ModuleList([Predictor(48) for _ in STRIDES])
        self.head = Head()

    def maps(self, x):
        return [p(f) for p, f in zip(self.pred, self.neck(*self.backbone(x)))]

    def forward(self, x):
        return self.head(self.maps(x))


# ------------------------------------------------------------------------------ training


def seed_everything(threads: int) -> None:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)


def box_iou_pairs(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IoU and GIoU of matching rows of two (K, 4) xyxy tensors."""
    lt = torch.max(a[:, :2], b[:, :2])
    rb = torch.min(a[:, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(1)
    area_a = (a[:, 2:] - a[:, :2]).clamp(min=0).prod(1)
    area_b = (b[:, 2:] - b[:, :2]).clamp(min=0).prod(1)
    union = area_a + area_b - inter + 1e-7
    iou = inter / union
    hull = (torch.max(a[:, 2:], b[:, 2:]) - torch.min(a[:, :2], b[:, :2])).clamp(min=0).prod(1) + 1e-7
    return iou, iou - (hull - union) / hull


def assign(boxes: np.ndarray, points: torch.Tensor, strides: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """FCOS-style centre sampling: for each anchor the index of its box, -1 for background.

    An anchor is positive for a box when its centre lies inside the box, within CENTER_RADIUS strides
    of the box centre, and the box's largest side distance falls in the anchor level's range; where
    several boxes qualify the smallest wins.
    """
    if len(boxes) == 0:
        return torch.full((len(points),), -1, dtype=torch.long)
    b = torch.from_numpy(boxes)
    px, py = points[:, 0:1], points[:, 1:2]
    ltrb = torch.stack([px - b[:, 0], py - b[:, 1], b[:, 2] - px, b[:, 3] - py], 2)          # [A, M, 4]
    inside = ltrb.min(2).values > 0
    cx, cy = (b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2
    radius = CENTER_RADIUS * strides[:, None]
    near = ((px - cx).abs() < radius) & ((py - cy).abs() < radius)
    reach = ltrb.max(2).values
    in_range = (reach >= ranges[:, 0:1]) & (reach <= ranges[:, 1:2])
    ok = inside & near & in_range
    area = ((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])).expand_as(ok)
    area = torch.where(ok, area, torch.full_like(area, float("inf")))
    best = area.min(1)
    return torch.where(torch.isfinite(best.values), best.indices, torch.full_like(best.indices, -1))


def loss_fn(model: DigitDetector, maps, targets, points, strides, ranges) -> tuple[torch.Tensor, dict]:
    """Quality focal loss on IoU-aware class targets + GIoU box loss on the positives."""
    head = model.head
    raw = head.raw(maps)                                                  # [N, 14, A]
    d = head.distances(raw).transpose(1, 2)                               # [N, A, 4]
    pred_boxes = torch.cat([points - d[..., :2], points + d[..., 2:]], 2)  # [N, A, 4]
    logits = raw[:, 4:].transpose(1, 2)                                   # [N, A, C]
    cls_target = torch.zeros_like(logits)
    pos_pred, pos_gt = [], []
    correct = 0
    for i, (boxes, labels) in enumerate(targets):
        idx = assign(boxes, points, strides, ranges)
        pos = torch.nonzero(idx >= 0).squeeze(1)
        if len(pos) == 0:
            continue
        gt = torch.from_numpy(boxes)[idx[pos]]
        iou, _ = box_iou_pairs(pred_boxes[i, pos].detach(), gt)
        classes = torch.from_numpy(labels)[idx[pos]]
        cls_target[i, pos, classes] = iou.clamp(min=0.05)
        correct += (logits[i, pos].argmax(1) == classes).sum().item()
        pos_pred.append(pred_boxes[i, pos])
        pos_gt.append(gt)
    n_pos = max(1, sum(len(p) for p in pos_pred))
    prob = logits.sigmoid()
    qfl = (F.binary_cross_entropy_with_logits(logits, cls_target, reduction="none")
           * (prob - cls_target).abs().pow(2)).sum() / n_pos
    if pos_pred:
        _, giou = box_iou_pairs(torch.cat(pos_pred), torch.cat(pos_gt))
        box = (1 - giou).sum() / n_pos
    else:
        box = raw.sum() * 0
    return qfl + BOX_LOSS_WEIGHT * box, {"cls": qfl.item(), "box": box.item(), "pos": n_pos, "correct": correct}


def level_ranges(strides: torch.Tensor) -> torch.Tensor:
    table = {s: r for s, r in zip(STRIDES, LEVEL_RANGES)}
    return torch.tensor([table[int(s)] for s in strides.tolist()], dtype=torch.float32)


def train(model: DigitDetector, x: np.ndarray, targets: list, epochs: int) -> None:
    points, strides = anchor_grid()
    ranges = level_ranges(strides)
    generator = torch.Generator().manual_seed(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    steps = epochs * math.ceil(len(x) / BATCH_SIZE)
    warmup = max(1, min(300, steps // 10))  # at least one step (tiny smoke runs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: min(1.0, (k + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps)))
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        model.train()
        totals = {"loss": 0.0, "cls": 0.0, "box": 0.0, "pos": 0, "correct": 0}
        batches = torch.randperm(len(x), generator=generator).split(BATCH_SIZE)
        for batch in batches:
            images = torch.from_numpy(x[batch.numpy()]).permute(0, 3, 1, 2).float().div(255)
            loss, parts = loss_fn(model, model.maps(images), [targets[i] for i in batch.tolist()],
                                  points, strides, ranges)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            totals["loss"] += loss.item()
            totals["cls"] += parts["cls"]
            totals["box"] += parts["box"]
            totals["pos"] += parts["pos"]
            totals["correct"] += parts["correct"]
        n = len(batches)
        print(f"epoch {epoch:3d}/{epochs}  lr {scheduler.get_last_lr()[0]:.5f}  loss {totals['loss'] / n:.4f}  "
              f"(cls {totals['cls'] / n:.4f}, box {totals['box'] / n:.4f})  "
              f"class right at positives {totals['correct'] / max(1, totals['pos']):.3f}  ({time.perf_counter() - start:.0f}s)",
              flush=True)


# ------------------------------------------------------------------------------ export


def export_onnx(model: DigitDetector, path: Path) -> None:
    """Legacy TorchScript export (folds BN into the convs); the head's nodes renamed ``head/...``."""
    model.eval()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using the legacy", DeprecationWarning)
        torch.onnx.export(
            model, (torch.zeros(1, 3, INPUT, INPUT),), str(path), dynamo=False, do_constant_folding=True,
            opset_version=OPSET, input_names=["images"], output_names=["output0"],
            dynamic_axes={"images": {0: "N"}, "output0": {0: "N"}},
        )
    proto = onnx.load(str(path))
    for node in proto.graph.node:
        # scope names come out as "/backbone/c3/c3.1/Conv": drop the leading "/" so that the
        # decoding is findable by the prefix "head/" (INT8 keeps it out; see the README)
        node.name = node.name.lstrip("/")
    tidy(proto)
    onnx.helper.set_model_props(proto, {"k2edge.labels": "labels.txt"})
    onnx.checker.check_model(proto, full_check=True)
    ops = {n.op_type for n in proto.graph.node}
    assert "BatchNormalization" not in ops, f"BatchNorm was not folded: {sorted(ops)}"
    body = [n for n in proto.graph.node if not n.name.startswith("head/")]
    if ACTIVATION == "silu":
        # every activation is x * sigmoid(x): one Sigmoid feeding one Mul whose other input is the Sigmoid's input
        producers = {o: n for n in body for o in n.output}
        sigmoids = [n for n in body if n.op_type == "Sigmoid"]
        muls = [n for n in body if n.op_type == "Mul"]
        assert "Relu" not in ops and len(sigmoids) == len(muls) == 16, (sorted(ops), len(sigmoids), len(muls))
        for mul in muls:
            sig = next(producers[i] for i in mul.input if producers.get(i) is not None
                       and producers[i].op_type == "Sigmoid")
            assert set(mul.input) == {sig.input[0], sig.output[0]}, (mul.name, list(mul.input))
    else:
        assert "Sigmoid" not in {n.op_type for n in body}, sorted(ops)
    assert all(o.domain in ("", "ai.onnx") for o in proto.opset_import), proto.opset_import
    onnx.save(proto, str(path))


def tidy(proto: onnx.ModelProto) -> None:
    """Constant nodes become initializers and ``output0`` gets its static shape [N, 14, anchors].

    The exporter leaves the Resize scales and the head's Slice bounds as Constant nodes and names
    the output's dims after the Concat; neither changes what the model computes.
    """
    nodes = []
    for node in proto.graph.node:
        if node.op_type == "Constant" and [a.name for a in node.attribute] == ["value"]:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
            proto.graph.initializer.append(tensor)
        else:
            nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    dims = proto.graph.output[0].type.tensor_type.shape.dim
    dims[1].dim_value = 4 + NUM_CLASSES
    dims[2].dim_value = sum((INPUT // s) ** 2 for s in STRIDES)
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    assert inferred.graph.output[0] == proto.graph.output[0], inferred.graph.output[0]


CARD = f"""\
# Model card of the demo detector (see README.md). The format is k2edge's model card.
task = "detection"
labels = "labels.txt"

[input]
name = "images"
size = [{INPUT}, {INPUT}]
resize = "letterbox"
pad_value = {PAD_VALUE}
color = "RGB"
scale = 0.00392156862745098
mean = [0.0, 0.0, 0.0]
std = [1.0, 1.0, 1.0]

[detection]
format = "yolov8"
score_threshold = {SCORE_THRESHOLD}
iou_threshold = {IOU_THRESHOLD}
max_detections = {MAX_DETECTIONS}
class_agnostic_nms = false
"""


# --------------------------------------------------------------------------- data files


def coco_annotations(scenes: list[Scene], names: list[str]) -> dict:
    images, annotations = [], []
    for image_id, (scene, name) in enumerate(zip(scenes, names), start=1):
        h, w = scene.image.shape[:2]
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
        for (x1, y1, x2, y2), c in zip(scene.boxes.tolist(), scene.labels.tolist()):
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": c + 1,
                                "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
    categories = [{"id": c + 1, "name": str(c)} for c in range(NUM_CLASSES)]
    return {"images": images, "annotations": annotations, "categories": categories}


SAMPLES = (("landscape", 256, 160), ("portrait", 150, 240), ("wide", 320, 176), ("square", 160, 160))


def save_dataset_files(out: Path, train_glyphs, train_labels, eval_glyphs, eval_labels) -> None:
    """labels.txt, card.toml, calib/ (training digits), eval/ (held-out digits, COCO), samples/."""
    (out / "labels.txt").write_text("".join(f"{c}\n" for c in range(NUM_CLASSES)))
    (out / "card.toml").write_text(CARD)

    rng = np.random.default_rng(SEED + 1)
    shutil.rmtree(out / "calib", ignore_errors=True)
    (out / "calib").mkdir()
    for i in range(CALIB_SCENES):
        w, h = SCENE_SIZES[rng.integers(len(SCENE_SIZES))]
        scene = compose_scene(train_glyphs, train_labels, w, h, rng)
        (out / "calib" / f"{i:03d}.jpg").write_bytes(jpeg(scene.image, JPEG_QUALITY_EVAL))

    rng = np.random.default_rng(SEED + 2)
    shutil.rmtree(out / "eval", ignore_errors=True)
    (out / "eval" / "images").mkdir(parents=True)
    scenes, names = [], []
    for i in range(EVAL_SCENES):
        w, h = SCENE_SIZES[rng.integers(len(SCENE_SIZES))]
        scene = compose_scene(eval_glyphs, eval_labels, w, h, rng)
        name = f"images/{i:04d}.jpg"
        (out / "eval" / name).write_bytes(jpeg(scene.image, JPEG_QUALITY_EVAL))
        scenes.append(scene)
        names.append(name)
    (out / "eval" / "annotations.json").write_text(json.dumps(coco_annotations(scenes, names)))

    rng = np.random.default_rng(SEED + 3)
    shutil.rmtree(out / "samples", ignore_errors=True)
    (out / "samples").mkdir()
    sample_scenes, sample_names = [], []
    for kind, w, h in SAMPLES:
        scene = compose_scene(eval_glyphs, eval_labels, w, h, rng)
        name = f"{kind}-{w}x{h}.jpg"
        (out / "samples" / name).write_bytes(jpeg(scene.image, JPEG_QUALITY_EVAL))
        sample_scenes.append(scene)
        sample_names.append(name)
    (out / "samples" / "annotations.json").write_text(json.dumps(coco_annotations(sample_scenes, sample_names)))


# ------------------------------------------------------------------- reference decode


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> list[int]:
    order = np.argsort(-scores, kind="stable")
    keep = []
    while len(order):
        i = order[0]
        keep.append(int(i))
        if len(order) == 1:
            break
        iou, _ = _iou(boxes[i], boxes[order[1:]])
        order = order[1:][iou <= iou_threshold]
    return keep


def reference_decode(output: np.ndarray, sx: float, sy: float, px: float, py: float, width: int, height: int,
                     score_threshold: float = SCORE_THRESHOLD) -> list[tuple[np.ndarray, float, int]]:
    """One image's YOLOv8-layout output [4 + C, A] -> (box x1y1x2y2 in original pixels, score, class)."""
    cx, cy, w, h = output[:4]
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
    anchor, cls = np.nonzero(output[4:].T >= score_threshold)
    scores = output[4:].T[anchor, cls]
    top = np.argsort(-scores, kind="stable")[:MAX_CANDIDATES]
    anchor, cls, scores = anchor[top], cls[top], scores[top]
    found = []
    for c in np.unique(cls):
        sel = np.flatnonzero(cls == c)
        for k in nms(boxes[anchor[sel]], scores[sel], IOU_THRESHOLD):
            found.append((boxes[anchor[sel[k]]], float(scores[sel[k]]), int(c)))
    found.sort(key=lambda f: -f[1])
    out = []
    for box, score, c in found[:MAX_DETECTIONS]:
        b = (box - np.array([px, py, px, py])) / np.array([sx, sy, sx, sy])
        b = np.clip(b, 0, [width, height, width, height])
        out.append((b, score, c))
    return out


def coco_map(annotations: dict, results: list[dict]) -> tuple[float, float]:
    """(mAP@0.5, mAP@0.5:0.95) by pycocotools."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    if not results:
        return 0.0, 0.0
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = annotations
        gt.createIndex()
        ev = COCOeval(gt, gt.loadRes(results), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return float(ev.stats[1]), float(ev.stats[0])


def evaluate(session: ort.InferenceSession, folder: Path, score_threshold: float = SCORE_THRESHOLD) -> tuple[float, float]:
    """Decode every image of ``folder/annotations.json`` through the ONNX model and score it."""
    annotations = json.loads((folder / "annotations.json").read_text())
    results = []
    for info in annotations["images"]:
        image = np.asarray(Image.open(folder / info["file_name"]).convert("RGB"))
        pixels, sx, sy, px, py = letterbox(image)
        x = pixels.transpose(2, 0, 1)[None].astype(np.float32) / np.float32(255)
        output = session.run(["output0"], {"images": x})[0][0]
        for box, score, c in reference_decode(output, sx, sy, px, py, info["width"], info["height"], score_threshold):
            results.append({"image_id": info["id"], "category_id": c + 1,
                            "bbox": [float(box[0]), float(box[1]), float(box[2] - box[0]), float(box[3] - box[1])],
                            "score": score})
    return coco_map(annotations, results)


def verify(out: Path, model: DigitDetector, data: Path) -> None:
    """Check the written files with onnxruntime alone and print the reference mAP on ``data``'s eval/ and samples/."""
    proto = onnx.load(str(out / "model.onnx"))
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    anchors = sum((INPUT // s) ** 2 for s in STRIDES)
    x = np.random.default_rng(0).random((2, 3, INPUT, INPUT), dtype=np.float32)
    got = session.run(["output0"], {"images": x})[0]
    assert got.shape == (2, 4 + NUM_CLASSES, anchors), got.shape
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    print(f"max |torch - onnxruntime| output difference: {np.abs(want - got).max():.2e}")
    head = [n for n in proto.graph.node if n.name.startswith("head/")]
    assert head and proto.graph.node[-1].name.startswith("head/") and proto.graph.node[-1].op_type == "Concat"
    assert not any(n.op_type in ("Conv", "Gemm", "MatMul") for n in head)
    print(f"nodes: {len(proto.graph.node)} ({len(head)} under head/), "
          f"parameters: {sum(int(np.prod(t.dims)) for t in proto.graph.initializer):,}, "
          f"{(out / 'model.onnx').stat().st_size:,} bytes")
    for folder in ("eval", "samples"):
        map50, map_ = evaluate(session, data / folder)
        print(f"{folder}: FP32 mAP@0.5 {map50:.4f}  mAP@0.5:0.95 {map_:.4f}  "
              f"(onnxruntime, reference decode, score >= {SCORE_THRESHOLD}, pycocotools)")
    map50, map_ = evaluate(session, data / "eval", score_threshold=0.001)
    print(f"eval: FP32 mAP@0.5 {map50:.4f}  mAP@0.5:0.95 {map_:.4f}  (score >= 0.001, COCO's usual setting)")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {total:,} bytes in all")


# ------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/detector"), help="output directory")
    parser.add_argument("--epochs", type=int, default=24, help="training epochs")
    parser.add_argument("--scenes", type=int, default=TRAIN_SCENES, help="training scenes")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it)")
    parser.add_argument("--activation", choices=sorted(ACTIVATIONS), default="relu",
                        help="activation after every Conv but the predictors' last (silu exports as Sigmoid + Mul)")
    parser.add_argument("--data", type=Path, default=None,
                        help="an existing folder with calib/, eval/ and samples/ to measure on instead of writing "
                             "them under --out (e.g. models/detector: the same seeded scenes); default: --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out if args.data is None else args.data
    if args.data is not None:
        for folder in ("calib", "eval/annotations.json", "samples/annotations.json"):
            if not (data / folder).exists():
                parser.error(f"--data {data}: no {folder}")
    global ACTIVATION
    ACTIVATION = args.activation

    seed_everything(args.threads)
    train_glyphs, train_labels, eval_glyphs, eval_labels = load_glyphs()
    start = time.perf_counter()
    x, targets = training_set(train_glyphs, train_labels, args.scenes, np.random.default_rng(SEED))
    objects = sum(len(t[1]) for t in targets)
    print(f"{args.scenes} training scenes, {objects} digits ({time.perf_counter() - start:.0f}s); "
          f"digits: {len(train_labels)} train, {len(eval_labels)} held out")

    model = DigitDetector()
    print(f"activation: {ACTIVATION}, parameters: {sum(p.numel() for p in model.parameters()):,}")
    start = time.perf_counter()
    train(model, x, targets, args.epochs)
    print(f"training took {time.perf_counter() - start:.0f}s")

    export_onnx(model, args.out / "model.onnx")
    if args.data is None:
        save_dataset_files(args.out, train_glyphs, train_labels, eval_glyphs, eval_labels)
    else:
        (args.out / "labels.txt").write_text("".join(f"{c}\n" for c in range(NUM_CLASSES)))
        (args.out / "card.toml").write_text(CARD)
    verify(args.out, model, data)


if __name__ == "__main__":
    main()
