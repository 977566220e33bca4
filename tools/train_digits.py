"""Train and export k2edge's bundled demo model: a small residual CNN for digits.

Builds everything under ``models/digits/`` from scikit-learn's bundled copy of
the UCI "Optical Recognition of Handwritten Digits" data (no download):

    model.onnx        residual CNN, opset 17, input ``input`` [N,1,32,32] float32,
                      output ``logits`` [N,10]; preprocessing in metadata_props
    labels.txt        class labels, one per line
    eval.npz          held-out 32x32 uint8 images ``x`` and int64 labels ``y``
    calib/<label>/    ImageFolder-style calibration set (20 PNGs per class,
                      taken from the training split)
    calib.npz         the same calibration images as ``x``/``y`` arrays
    samples/          one JPEG per digit from the held-out split, for demos

Torch is only needed here, not by k2edge, so it lives in its own venv.
Run from the repository root:

    python -m venv .venv-train
    .venv-train/bin/pip install torch==2.13.0 numpy onnx onnxruntime scikit-learn pillow
    .venv-train/bin/python tools/train_digits.py --out models/digits --epochs 40

The run is deterministic (fixed seed, deterministic torch algorithms) and
takes about two minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SEED = 0
IMAGE_SIZE = 32
NUM_CLASSES = 10
EVAL_FRACTION = 0.3
CALIB_PER_CLASS = 20
SCALE = 1 / 255
OPSET = 17

BATCH_SIZE = 64
LEARNING_RATE = 0.05
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4

MAX_SHIFT_PX = 2
SCALE_RANGE = (0.9, 1.1)
JPEG_PROBABILITY = 0.5
JPEG_QUALITY_RANGE = (70, 95)


# --------------------------------------------------------------------------- data


def digit_to_image(digit: np.ndarray) -> np.ndarray:
    """Turn one 8x8 sklearn digit (values 0..16) into a 32x32 uint8 grayscale image."""
    pixels = np.round(digit * 255 / 16).astype(np.uint8)
    image = Image.fromarray(pixels).resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8)


def load_images() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 digits as (N, 32, 32) uint8 images and int64 labels."""
    digits = load_digits()
    images = np.stack([digit_to_image(d) for d in digits.images])
    return images, digits.target.astype(np.int64)


def split_indices(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic stratified train/eval split of dataset indices."""
    return train_test_split(
        np.arange(len(labels)),
        test_size=EVAL_FRACTION,
        stratify=labels,
        random_state=SEED,
    )


def preprocess(images: np.ndarray, mean: float, std: float) -> np.ndarray:
    """uint8 (N, 32, 32) -> float32 (N, 1, 32, 32), exactly as documented in the metadata."""
    x = (images.astype(np.float32) * np.float32(SCALE) - np.float32(mean)) / np.float32(std)
    return x[:, None, :, :]


def augment(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random shift (+-2 px) and scale about the centre, sometimes a JPEG round trip."""
    dx, dy = rng.integers(-MAX_SHIFT_PX, MAX_SHIFT_PX + 1, size=2)
    s = rng.uniform(*SCALE_RANGE)
    c = IMAGE_SIZE / 2
    # PIL's affine maps output coordinates to input coordinates.
    coeffs = (1 / s, 0, c - (c + dx) / s, 0, 1 / s, c - (c + dy) / s)
    out = Image.fromarray(image).transform(
        image.shape[::-1], Image.Transform.AFFINE, coeffs,
        resample=Image.Resampling.BILINEAR, fillcolor=0,
    )
    if rng.random() < JPEG_PROBABILITY:
        buffer = io.BytesIO()
        quality = int(rng.integers(*JPEG_QUALITY_RANGE, endpoint=True))
        out.save(buffer, format="JPEG", quality=quality)
        out = Image.open(buffer).convert("L")
    return np.asarray(out, dtype=np.uint8)


# -------------------------------------------------------------------------- model


class BasicBlock(nn.Module):
    """ResNet basic block; a 1x1 conv projection when the shape changes."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class DigitsResNet(nn.Module):
    """Stem conv, three stages of two basic blocks (16, 32/2, 64/2), global pool, linear."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), blocks_per_stage: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks = []
        in_ch = widths[0]
        for stage, out_ch in enumerate(widths):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(in_ch, out_ch, stride))
                in_ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)  # GlobalAveragePool in ONNX, kept on purpose
        self.fc = nn.Linear(in_ch, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(x, 1))


# ----------------------------------------------------------------------- training


def seed_everything() -> None:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)


def train(model: nn.Module, images: np.ndarray, labels: np.ndarray,
          mean: float, std: float, epochs: int) -> None:
    rng = np.random.default_rng(SEED)
    generator = torch.Generator().manual_seed(SEED)
    y = torch.from_numpy(labels)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM,
                                nesterov=True, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        augmented = np.stack([augment(img, rng) for img in images])
        x = torch.from_numpy(preprocess(augmented, mean, std))
        model.train()
        total_loss, correct = 0.0, 0
        for batch in torch.randperm(len(y), generator=generator).split(BATCH_SIZE):
            logits = model(x[batch])
            loss = F.cross_entropy(logits, y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(batch)
            correct += (logits.argmax(1) == y[batch]).sum().item()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        print(f"epoch {epoch:3d}/{epochs}  lr {lr:.4f}  loss {total_loss / len(y):.4f}  "
              f"train acc {correct / len(y):.4f}  ({time.perf_counter() - start:.1f}s)", flush=True)


# ------------------------------------------------------------------------- export


def export_onnx(model: nn.Module, path: Path, mean: float, std: float) -> None:
    """Legacy TorchScript export: its constant folding folds BatchNorm into the convs."""
    model.eval()
    with warnings.catch_warnings():
        # The legacy exporter is chosen on purpose; silence its deprecation notice.
        warnings.filterwarnings("ignore", "You are using the legacy", DeprecationWarning)
        torch.onnx.export(
            model,
            (torch.zeros(1, 1, IMAGE_SIZE, IMAGE_SIZE),),
            str(path),
            dynamo=False,
            do_constant_folding=True,
            opset_version=OPSET,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}},
        )
    proto = onnx.load(str(path))
    preprocess_meta = {
        "color": "L",
        "size": [IMAGE_SIZE, IMAGE_SIZE],
        "layout": "NCHW",
        "scale": SCALE,
        "mean": [mean],
        "std": [std],
    }
    onnx.helper.set_model_props(proto, {
        "k2edge.preprocess": json.dumps(preprocess_meta),
        "k2edge.labels": "labels.txt",
    })
    onnx.checker.check_model(proto, full_check=True)
    ops = {node.op_type for node in proto.graph.node}
    assert "BatchNormalization" not in ops, f"BatchNorm was not folded: {sorted(ops)}"
    assert all(o.domain in ("", "ai.onnx") for o in proto.opset_import), proto.opset_import
    onnx.save(proto, str(path))


# ------------------------------------------------------------------ dataset files


def save_dataset_files(out: Path, images: np.ndarray, labels: np.ndarray,
                       train_idx: np.ndarray, eval_idx: np.ndarray) -> None:
    """labels.txt, eval.npz, calib/ + calib.npz (train split), samples/ (eval split)."""
    (out / "labels.txt").write_text("".join(f"{c}\n" for c in range(NUM_CLASSES)))
    np.savez_compressed(out / "eval.npz", x=images[eval_idx], y=labels[eval_idx])

    # Calibration: 20 random training images per class. Files are named by their
    # index in sklearn's dataset, zero-padded so that sorted(ImageFolder) order
    # equals the order of calib.npz.
    rng = np.random.default_rng(SEED)
    calib_idx = np.concatenate([
        np.sort(rng.choice(train_idx[labels[train_idx] == c], CALIB_PER_CLASS, replace=False))
        for c in range(NUM_CLASSES)
    ])
    shutil.rmtree(out / "calib", ignore_errors=True)
    for i in calib_idx:
        class_dir = out / "calib" / str(labels[i])
        class_dir.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).save(class_dir / f"{i:04d}.png")
    np.savez_compressed(out / "calib.npz", x=images[calib_idx], y=labels[calib_idx])

    # Samples: the first image of each class in eval.npz order; <n> is its eval.npz index.
    shutil.rmtree(out / "samples", ignore_errors=True)
    (out / "samples").mkdir()
    eval_labels = labels[eval_idx]
    for c in range(NUM_CLASSES):
        n = int(np.flatnonzero(eval_labels == c)[0])
        Image.fromarray(images[eval_idx[n]]).save(
            out / "samples" / f"digit-{c}-{n}.jpg", quality=95)


# ------------------------------------------------------------------- verification


def read_image(path: Path, meta: dict) -> np.ndarray:
    """Decode an image file as documented: grayscale, bilinear resize to (width, height)."""
    image = Image.open(path).convert(meta["color"])
    image = image.resize(tuple(meta["size"]), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8)


def verify(out: Path, model: nn.Module) -> float:
    """Check the written files with onnxruntime alone; return eval top-1 accuracy."""
    proto = onnx.load(str(out / "model.onnx"))
    meta = json.loads({p.key: p.value for p in proto.metadata_props}["k2edge.preprocess"])
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])

    def run(images: np.ndarray) -> np.ndarray:
        x = (images.astype(np.float32) * np.float32(meta["scale"]) - np.float32(meta["mean"][0])) \
            / np.float32(meta["std"][0])
        return session.run(["logits"], {"input": x[:, None]})[0]

    data = np.load(out / "eval.npz")
    logits = np.concatenate([run(data["x"][i:i + 8]) for i in range(0, len(data["x"]), 8)])
    accuracy = float((logits.argmax(1) == data["y"]).mean())
    assert run(data["x"][:1]).shape == (1, NUM_CLASSES)

    with torch.no_grad():
        reference = model(torch.from_numpy(preprocess(data["x"], meta["mean"][0], meta["std"][0])))
    difference = np.abs(reference.numpy() - logits).max()
    print(f"max |torch - onnxruntime| logit difference: {difference:.2e}")

    calib = np.load(out / "calib.npz")
    pngs = sorted((out / "calib").glob("*/*.png"))
    assert np.array_equal(np.stack([read_image(p, meta) for p in pngs]), calib["x"])
    assert np.array_equal(np.array([int(p.parent.name) for p in pngs]), calib["y"])

    for jpeg in sorted((out / "samples").glob("*.jpg")):
        predicted = int(run(read_image(jpeg, meta)[None]).argmax())
        expected = int(jpeg.stem.split("-")[1])
        verdict = "ok" if predicted == expected else "WRONG"
        print(f"sample {jpeg.name}: predicted {predicted} ({verdict})")
    return accuracy


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/digits"), help="output directory")
    parser.add_argument("--epochs", type=int, default=40, help="training epochs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    seed_everything()
    images, labels = load_images()
    train_idx, eval_idx = split_indices(labels)
    train_pixels = images[train_idx].astype(np.float64) * SCALE
    mean, std = round(train_pixels.mean(), 4), round(train_pixels.std(), 4)
    print(f"train {len(train_idx)}  eval {len(eval_idx)}  mean {mean}  std {std}")

    model = DigitsResNet()
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    start = time.perf_counter()
    train(model, images[train_idx], labels[train_idx], mean, std, args.epochs)
    print(f"training took {time.perf_counter() - start:.0f}s")

    export_onnx(model, args.out / "model.onnx", mean, std)
    save_dataset_files(args.out, images, labels, train_idx, eval_idx)
    accuracy = verify(args.out, model)
    print(f"eval top-1 (onnxruntime, FP32, {len(eval_idx)} images): {accuracy:.4f}")


if __name__ == "__main__":
    main()
