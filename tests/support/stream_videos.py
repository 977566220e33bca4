"""Test videos for the stream tests: H.264 MP4s of handwritten digits moving across a plain light
background, with the ground truth of every frame (which digit, where) and of every line crossing.

The digits are rendered as tools/train_detector.py renders them for the demo detector
(models/detector): a 32x32 ink map resized bilinearly to the digit's size, the stroke made solid
where the blurred ink passes a weight threshold, a dark ink at 80-100 % opacity; the box is the
tight box of the ink (alpha > 0.5). Here the aspect, weight and ink are fixed (no slant) so a
digit looks the same in every frame.

``tests/fixtures/digit_sprites.npz`` holds the ink maps: ``x`` uint8 (50, 32, 32), ``y`` int64 (50,),
five per digit. They are the demo detector's own training digits (scikit-learn's ``load_digits``,
8x8 -> 32x32 as both training scripts do), taken from ``models/digits/calib.npz`` (20 training
digits per class) and picked as the five per class the detector finds best when rendered here:
``python tests/support/stream_videos.py --sprites`` remakes the file (needs onnxruntime, not scikit-learn).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SPRITES = Path(__file__).resolve().parents[1] / "fixtures" / "digit_sprites.npz"
DETECTOR = ROOT / "models" / "detector"

BACKGROUND = (228, 224, 212)  # light paper
INKS = ((25, 35, 110), (120, 20, 25), (20, 20, 20), (20, 80, 40))  # navy, dark red, black, dark green
ASPECT = 0.85   # width / height of the sprite image (training: 0.7-1.05)
WEIGHT = 0.375  # stroke weight threshold (training: 0.3-0.45)
OPACITY = 0.92  # (training: 0.8-1.0)


def digit_alpha(ink: np.ndarray, height: int) -> np.ndarray:
    """A sprite's alpha (height, round(height * ASPECT)) as train_detector.glyph_alpha makes it, unslanted."""
    width = max(6, round(height * ASPECT))
    a = np.asarray(Image.fromarray(ink).resize((width, height), Image.Resampling.BILINEAR), dtype=np.float32) / 255
    return np.clip((a - WEIGHT) / 0.25, 0, 1)


def load_sprites(path: Path = SPRITES) -> dict[str, list[np.ndarray]]:
    """label -> the sprites (uint8 32x32 ink maps) of that digit."""
    data = np.load(path)
    out: dict[str, list[np.ndarray]] = {}
    for x, y in zip(data["x"], data["y"]):
        out.setdefault(str(int(y)), []).append(x)
    return out


@dataclass(frozen=True)
class MovingDigit:
    """A digit moving in a straight line at constant speed.

    Attributes:
        label: the digit, ``"0"``..``"9"``.
        start: ``(x, y)`` centre of the sprite at frame ``first``, pixels.
        velocity: ``(dx, dy)`` pixels per frame.
        size: the sprite's height in pixels (the ink's box is a little smaller).
        sprite: which of the digit's sprites.
        ink: RGB of the ink (default: one of :data:`INKS` by object).
        first, last: the frames it is visible in (inclusive; ``last`` None: to the end).
    """

    label: str
    start: tuple[float, float]
    velocity: tuple[float, float]
    size: int = 52
    sprite: int = 0
    ink: tuple[int, int, int] | None = None
    first: int = 0
    last: int | None = None

    def centre(self, frame: int) -> tuple[float, float]:
        t = frame - self.first
        return self.start[0] + self.velocity[0] * t, self.start[1] + self.velocity[1] * t


@dataclass(frozen=True)
class Crossing:
    """A ground-truth line crossing: the object's anchor changed side in ``frame``."""

    object_id: int
    label: str
    frame: int
    direction: str  # "in" | "out", as k2edge.streams.analytics defines them


@dataclass
class GroundTruth:
    """Per frame, the visible objects as ``(object_id, label, (x1, y1, x2, y2))``; ids from 1 in
    the order of the ``objects`` given to :func:`make_video`."""

    size: tuple[int, int]
    fps: int
    frames: list[list[tuple[int, str, tuple[float, float, float, float]]]] = field(default_factory=list)

    def anchors(self) -> dict[int, list[tuple[int, float, float]]]:
        """object id -> [(frame, x, y)] of its box's bottom-centre, the analytics anchor."""
        out: dict[int, list[tuple[int, float, float]]] = {}
        for f, objs in enumerate(self.frames):
            for oid, _, (x1, _, x2, y2) in objs:
                out.setdefault(oid, []).append((f, (x1 + x2) / 2, y2))
        return out

    def labels(self) -> dict[int, str]:
        return {oid: label for objs in self.frames for oid, label, _ in objs}

    def crossings(self, start: tuple[float, float], end: tuple[float, float]) -> list[Crossing]:
        """The crossings of the segment ``start -> end`` by the objects' anchors, frame by frame:
        ``c = (end - start) x (anchor - start)`` changing sign between two frames where the path
        meets the segment; ``"in"`` from negative to positive. (The paths here never touch the
        line exactly, and the segment spans the frame, so the side change alone decides.)"""
        (sx, sy), (ex, ey) = start, end
        labels = self.labels()
        out = []
        for oid, path in self.anchors().items():
            side = [np.sign((ex - sx) * (y - sy) - (ey - sy) * (x - sx)) for _, x, y in path]
            for (f0, *_), (f1, *_), s0, s1 in zip(path, path[1:], side, side[1:]):
                assert s0 != 0 and s1 != 0, "a ground-truth anchor lies exactly on the line: move the scenario"
                if s0 != s1:
                    out.append(Crossing(oid, labels[oid], f1, "in" if s1 > 0 else "out"))
        return sorted(out, key=lambda c: (c.frame, c.object_id))


def render_frame(objects: Sequence[MovingDigit], alphas: Sequence[np.ndarray], frame: int,
                 size: tuple[int, int], noise: np.ndarray | None = None):
    """One RGB frame (H, W, 3) uint8 and its visible objects' ``(id, label, box)``."""
    width, height = size
    img = np.empty((height, width, 3), dtype=np.float32)
    img[:] = BACKGROUND
    if noise is not None:
        img += noise
    truth = []
    for oid, (obj, alpha) in enumerate(zip(objects, alphas), start=1):
        if frame < obj.first or (obj.last is not None and frame > obj.last):
            continue
        cx, cy = obj.centre(frame)
        gh, gw = alpha.shape
        ox, oy = int(round(cx - gw / 2)), int(round(cy - gh / 2))
        if ox < 0 or oy < 0 or ox + gw > width or oy + gh > height:
            raise ValueError(f"digit {oid} ({obj.label}) leaves the {width}x{height} frame at frame {frame}: "
                             f"sprite at x {ox}..{ox + gw}, y {oy}..{oy + gh}")
        ink = np.asarray(obj.ink or INKS[(oid - 1) % len(INKS)], dtype=np.float32)
        a = alpha[..., None] * OPACITY
        patch = img[oy:oy + gh, ox:ox + gw]
        img[oy:oy + gh, ox:ox + gw] = patch * (1 - a) + ink * a
        ys, xs = np.nonzero(alpha > 0.5)
        truth.append((oid, obj.label, (float(ox + xs.min()), float(oy + ys.min()),
                                       float(ox + xs.max() + 1), float(oy + ys.max() + 1))))
    return np.clip(np.round(img), 0, 255).astype(np.uint8), truth


def make_video(path: str | Path, *, size: tuple[int, int] = (320, 240), fps: int = 15, frames: int = 90,
               objects: Sequence[MovingDigit] = (), seed: int = 0, crf: int = 20, gop: int | None = None) -> GroundTruth:
    """Write an H.264 MP4 (yuv420p) of ``objects`` moving over a light background with faint grain;
    later objects are drawn over earlier ones (the ground truth keeps an occluded object's full box).
    ``gop``: a keyframe every ``gop`` frames exactly (default: libx264's choice, one at the start here).

    Raises:
        ValueError: an object leaves the frame (the ground truth would have to clip it).
    """
    import av

    rng = np.random.default_rng(seed)
    sprites = load_sprites()
    alphas = []
    for obj in objects:
        choices = sprites[str(obj.label)]
        alphas.append(digit_alpha(choices[obj.sprite % len(choices)], obj.size))
    width, height = size
    truth = GroundTruth(size=size, fps=fps)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast",
                          **({"g": str(gop), "keyint_min": str(gop), "sc_threshold": "0"} if gop else {})}
        for f in range(frames):
            noise = rng.normal(0, 2.0, (height, width, 1)).astype(np.float32)
            img, objs = render_frame(objects, alphas, f, size, noise)
            truth.frames.append(objs)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return truth


def read_frames(path: str | Path):
    """Decode a video with PyAV: yields RGB (H, W, 3) uint8 frames in order."""
    import av

    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            yield frame.to_ndarray(format="rgb24")


@dataclass
class CrossingScenario:
    """A canonical crossing video: its ground truth, the vertical line it is about, and the crossings."""

    path: Path
    truth: GroundTruth
    line: tuple[tuple[float, float], tuple[float, float]]
    crossings: list[Crossing]


# Five digits over 90 frames (6 s at 15 fps) around the line x = 200.25 (full height, start at the
# top, so moving left -> right is "out" and right -> left "in"; a quarter pixel off the grid, so no
# ground-truth anchor, on whole or half pixels, lies on it):
#   1 "3" left -> right along the top, crosses at about frame 62 (out);
#   2 "7" right -> left, drifting down, crosses at about frame 35 (in);
#   3 "5" left -> right, drifting down: its path crosses 2's (they overlap around frame 55, x 140,
#     left of the line), then it crosses the line at about frame 86 (out);
#   4 "8" sinks slowly at the top right and never crosses;
#   5 "4" appears at frame 20 on the right, bottom, and crosses right -> left at about frame 55 (in).
CROSSING_LINE = ((200.25, 0.0), (200.25, 240.0))
CROSSING_OBJECTS = (
    MovingDigit("3", (40, 42), (2.6, 0.0), sprite=0),
    MovingDigit("7", (292, 112), (-2.6, 0.3), sprite=0),
    MovingDigit("5", (28, 118), (2.0, 0.35), sprite=0),
    MovingDigit("8", (290, 40), (0.0, 0.5), sprite=0),
    MovingDigit("4", (280, 200), (-2.3, 0.0), sprite=0, first=20),
)


def scenario_crossing(path: str | Path, *, seed: int = 0, objects: Sequence[MovingDigit] = CROSSING_OBJECTS,
                      line=CROSSING_LINE, frames: int = 90, fps: int = 15, gop: int | None = None) -> CrossingScenario:
    """Write the canonical crossing video to ``path`` (320x240) and return what it should produce."""
    truth = make_video(path, size=(320, 240), fps=fps, frames=frames, objects=objects, seed=seed, gop=gop)
    return CrossingScenario(Path(path), truth, line, truth.crossings(*line))


# An identity switch (90 frames, 15 fps; the same line x = 200.25 and a zone, the frame's left part):
#   1 "3" left -> right along the top, born in the zone, leaves it and crosses the line at about frame 62 (out);
#   2 "7" right -> left, enters the zone and crosses at about frame 35 (in), and vanishes at frame 50 (x ~162);
#   3 "5" appears at frame 54 where the 7 vanished (0.27 s later: within a 1 s max_lost, after more than
#     the tracker's 2-update relabel gap), moves right and crosses at about frame 69 (out).
# A track labelled by its whole life reports the 5's crossing as a "7" and never sees the 5 enter the zone.
SWITCH_ZONE = ((0.0, 0.0), (200.25, 0.0), (200.25, 240.0), (0.0, 240.0))
SWITCH_OBJECTS = (
    MovingDigit("3", (40, 42), (2.6, 0.0), sprite=0),
    MovingDigit("7", (292, 112), (-2.6, 0.0), sprite=0, last=50),
    MovingDigit("5", (162, 112), (2.6, 0.0), sprite=0, first=54),
)


def scenario_identity_switch(path: str | Path, *, seed: int = 0, fps: int = 15) -> CrossingScenario:
    """Write the identity-switch video (above) to ``path`` (320x240) and return what it should produce."""
    return scenario_crossing(path, seed=seed, objects=SWITCH_OBJECTS, frames=90, fps=fps)


def zone_entries(truth: GroundTruth, points) -> dict[str, int]:
    """label -> how many objects' anchors were ever inside the polygon ``points`` (each enters once:
    the scenarios here never leave a zone and come back)."""
    from k2edge.streams.analytics import Zone

    zone = Zone("truth", points)
    labels = truth.labels()
    out: dict[str, int] = {}
    for oid, path in truth.anchors().items():
        if any(zone.contains((x, y)) for _, x, y in path):
            out[labels[oid]] = out.get(labels[oid], 0) + 1
    return dict(sorted(out.items()))


def _make_sprites(per_class: int = 5, heights: Sequence[int] = (36, 52, 72)) -> None:
    """Pick, from models/digits/calib.npz, the ``per_class`` sprites per digit the demo detector
    finds best when rendered here (mean over ``heights`` of the best right-label score of a box
    with IoU >= 0.7), and save them to :data:`SPRITES`."""
    import onnxruntime as ort

    from k2edge.config.card import load_card
    from k2edge.streams.tracker import box_iou
    from k2edge.tasks import Preprocess, decode

    card = load_card(DETECTOR / "card.toml")
    pre = Preprocess.from_card(card)
    session = ort.InferenceSession(str(DETECTOR / "model.onnx"), providers=["CPUExecutionProvider"])
    calib = np.load(ROOT / "models" / "digits" / "calib.npz")
    quality = []
    for ink, label in zip(calib["x"], calib["y"]):
        got = []
        for h in heights:
            obj = MovingDigit(str(int(label)), (80, 60), (0, 0), size=h)
            img, [(_, _, box)] = render_frame([obj], [digit_alpha(ink, h)], 0, (160, 120))
            x, geometry = pre.stage_mapped(img)
            dets = decode(session.run(None, {"images": x[None]})[0], card.detection, [geometry])[0]
            ok = (dets.classes == label) & (box_iou(dets.boxes, np.array([box]))[:, 0] >= 0.7)
            got.append(float(dets.scores[ok].max()) if ok.any() else 0.0)
        quality.append(np.mean(got))
    quality = np.array(quality)
    keep = []
    for digit in range(10):
        idx = np.flatnonzero(calib["y"] == digit)
        keep += sorted(idx[np.argsort(-quality[idx], kind="stable")[:per_class]].tolist())
        print(digit, np.round(np.sort(quality[idx])[::-1][:per_class], 3))
    SPRITES.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(SPRITES, x=calib["x"][keep], y=calib["y"][keep].astype(np.int64))
    print(f"wrote {SPRITES} ({SPRITES.stat().st_size} bytes)")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--sprites"]:
        _make_sprites()
    else:
        sys.exit("usage: python tests/support/stream_videos.py --sprites")
