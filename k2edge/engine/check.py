"""The INT8 accuracy check: FP32 against INT8 on held-out calibration samples, measured by the card's task.

Measures (all "higher is better" except ``mean_abs_dp`` and ``max_rel_error``):

* classification: ``agreement`` (top-1 of INT8 equals top-1 of FP32) and ``mean_abs_dp`` (mean |Δp| of the
  FP32 top-1 class's probability);
* detection: INT8 boxes matched to FP32 boxes (same label, IoU >= 0.5, greedy by score): ``precision``
  (matched / INT8 boxes), ``recall`` (matched / FP32 boxes) and ``score_ratio`` (mean INT8/FP32 score of the
  matches). Each run's boxes are matched against the other run's boxes decoded down to half the card's score
  threshold, so a box scored 0.26 by one run and 0.24 by the other is a score change, not a missed or an extra
  object (matched strictly, at the card's threshold, FP16 itself misses a few per hundred: the threshold's
  jitter, not INT8's loss); ``score_ratio`` measures the scores; ``strict_recall`` and ``strict_precision`` are
  the same matched as a user sees the boxes, both runs at the card's threshold: a score that drops under it is a
  missed box there;
* segmentation, pose, obb: the detection measures on their boxes (an oriented box by its bounds), and of the
  matched pairs the task's own, reported beside them: ``mask_iou`` (mean IoU of the two masks, at the
  input's size), ``keypoint_error`` (mean distance of the keypoints, in input pixels; lower is better) or
  ``rotated_iou`` (mean probabilistic IoU of the oriented boxes, as Ultralytics' rotated NMS measures overlap);
* tensor: ``cosine`` (mean cosine similarity per sample and output) and ``max_rel_error`` (largest |Δ| over
  the output's largest magnitude).

A share of n items is a count: ``agreement``, ``recall`` and ``precision`` carry the count of hits beside the
count of items (``agreed``/``samples``, ``found``/``reference_boxes``, ``kept``/``int8_boxes``) and are compared
with their tolerance exactly, in integers (:func:`holds`), never through a rounded float. Each carries a 95 %
Wilson interval (:func:`wilson`); a mean (``cosine``, ``score_ratio``, the pair measures) carries a normal one.

A check knows its power: below :data:`MIN_CHECK` items (200 classifier samples, 50 FP32 boxes, 20 maps) its
verdict is ``inconclusive``, never ``passed``, and its line says what data to give.

The result is data (:class:`Int8Check`): the build prints its :meth:`~Int8Check.line` on stderr, ``--json``
carries :meth:`~Int8Check.to_dict` as ``int8_check``, and it is stored in the engine cache with the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from ..config.card import BOX_TASKS
from ..errors import BuildError

MATCH_IOU = 0.5

DEFAULT_TOLERANCE = {
    "classification": {"agreement": 0.99},
    # strict_*: a score that drops under the card's threshold is a box the user loses; relaxed matching and the
    # score ratio of the boxes kept do not see it (YOLOv8n: relaxed recall 0.95 with 0.72 at the threshold)
    "detection": {"recall": 0.97, "precision": 0.97, "score_ratio": 0.9, "strict_recall": 0.93, "strict_precision": 0.93},
    "tensor": {"cosine": 0.999},
}
PAIR_MEASURE = {"segmentation": "mask_iou", "pose": "keypoint_error", "obb": "rotated_iou"}
# measure -> (its count of hits, its count of items): a share of n items cannot tell 1 - t from 1 with fewer
# than 1 / (1 - t) items
COUNTED = {"agreement": ("agreed", "samples"), "recall": ("found", "reference_boxes"), "precision": ("kept", "int8_boxes"),
           "strict_recall": ("strict_found", "reference_boxes"), "strict_precision": ("strict_kept", "int8_boxes")}
# the fewest items a verdict stands on, per task: (the count, its minimum). Fewer: ``inconclusive``. At these sizes
# a 95 % Wilson interval of a share near 0.98 is about +-0.02 (200) and near 0.95 about +-0.06 (50).
MIN_CHECK = {"classification": ("samples", 200), "detection": ("reference_boxes", 50), "tensor": ("samples", 20)}
Z95 = 1.959963984540054


def min_check(task: str) -> tuple[str, int]:
    """The count a ``task``'s verdict needs and its minimum (box tasks count FP32 boxes)."""
    return MIN_CHECK["detection"] if task in BOX_TASKS else MIN_CHECK.get(task, MIN_CHECK["tensor"])


def exact(t) -> Fraction:
    """A tolerance as an exact fraction: ``0.9`` is 9/10 (the decimal written), not the binary float's value."""
    return t if isinstance(t, Fraction) else Fraction(repr(float(t)))


def holds(hits: int, n: int, t) -> bool:
    """Whether ``hits / n >= t`` exactly (integers; n = 0 holds: nothing to miss)."""
    f = exact(t)
    return n == 0 or int(hits) * f.denominator >= f.numerator * int(n)


def one_miss(n: int) -> Fraction:
    """The strictest tolerance ``n`` items can show short of all of them: (n - 1) / n (0 for one item or none)."""
    return Fraction(n - 1, n) if n > 1 else Fraction(0)


def needed(t) -> int:
    """The fewest items whose one miss still meets ``t``: the smallest n with (n - 1) / n >= t."""
    f = exact(t)
    return 1 if f <= 0 else math.ceil(1 / (1 - f)) if f < 1 else 0


def wilson(hits: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a share ``hits / n`` (95 % by default); (0, 1) with no items."""
    if n <= 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_bound(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """A normal 95 % interval of a mean (a single value: itself)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        m = float(v.mean()) if v.size else 0.0
        return m, m
    half = z * float(v.std(ddof=1)) / math.sqrt(v.size)
    return float(v.mean()) - half, float(v.mean()) + half


def tolerance_for(task: str, *layers: Mapping[str, float] | None) -> tuple[dict[str, float], bool]:
    """The tolerance for ``task``: the defaults, overridden by each layer in turn (profile, then card).

    Returns:
        (tolerance, whether any layer set it explicitly).

    Raises:
        BuildError: a layer names a measure the task does not have.
    """
    tol = dict(DEFAULT_TOLERANCE["detection"] if task in BOX_TASKS else DEFAULT_TOLERANCE.get(task, DEFAULT_TOLERANCE["tensor"]))
    known = list(tol)
    explicit = False
    for layer in layers:
        for k, v in (layer or {}).items():
            if k not in known:
                raise BuildError(f"int8 tolerance: {task} has measures {', '.join(known)}; got {k!r}")
            tol[k] = float(v)
            explicit = True
    return tol, explicit


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    x1 = np.maximum(box[0], boxes[:, 0])
    y1 = np.maximum(box[1], boxes[:, 1])
    x2 = np.minimum(box[2], boxes[:, 2])
    y2 = np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = lambda b: np.clip(b[..., 2] - b[..., 0], 0, None) * np.clip(b[..., 3] - b[..., 1], 0, None)  # noqa: E731
    return inter / np.maximum(area(box) + area(boxes) - inter, 1e-12)


def match_pairs(ref, test) -> list[tuple[int, int]]:
    """:func:`match_detections`' matches as (``test`` index, ``ref`` index) pairs."""
    used = np.zeros(len(ref), dtype=bool)
    pairs = []
    for i, (box, cls) in enumerate(zip(test.boxes, test.classes)):
        if not len(ref):
            break
        iou = _iou(np.asarray(box), np.asarray(ref.boxes))
        iou[(ref.classes != cls) | used] = -1.0
        j = int(np.argmax(iou))
        if iou[j] >= MATCH_IOU:
            used[j] = True
            pairs.append((i, j))
    return pairs


def pair_measure(task: str, ref, test, pairs: Sequence[tuple[int, int]], ref_masks=None, test_masks=None) -> list[float]:
    """The task's own measure of each matched pair (see the module docstring); a segmentation's masks are given
    as ``(mask, origin)`` per detection (:func:`~k2edge.tasks.segmentation.box_masks`)."""
    if not pairs:
        return []
    if task == "pose":  # extra: (k, keypoints, 3) x, y, score
        return [float(np.linalg.norm(np.asarray(test.extra[i])[:, :2] - np.asarray(ref.extra[j])[:, :2], axis=1).mean())
                for i, j in pairs]
    if task == "obb":  # extra: (k, 5) cx cy w h angle
        from ..tasks.obb import probiou

        return [float(probiou(np.asarray(test.extra[i:i + 1]), np.asarray(ref.extra[j:j + 1]))[0, 0]) for i, j in pairs]
    if task == "segmentation" and ref_masks is not None and test_masks is not None:
        return [_mask_iou(*test_masks[i], *ref_masks[j]) for i, j in pairs]
    return []


def _mask_iou(a: np.ndarray, a_at: tuple[int, int], b: np.ndarray, b_at: tuple[int, int]) -> float:
    """IoU of two boolean masks that start at ``a_at`` and ``b_at`` (x, y) of one image."""
    x0, y0 = min(a_at[0], b_at[0]), min(a_at[1], b_at[1])
    x1 = max(a_at[0] + a.shape[1], b_at[0] + b.shape[1])
    y1 = max(a_at[1] + a.shape[0], b_at[1] + b.shape[0])
    canvas = np.zeros((2, y1 - y0, x1 - x0), dtype=bool)
    canvas[0, a_at[1] - y0:a_at[1] - y0 + a.shape[0], a_at[0] - x0:a_at[0] - x0 + a.shape[1]] = a
    canvas[1, b_at[1] - y0:b_at[1] - y0 + b.shape[0], b_at[0] - x0:b_at[0] - x0 + b.shape[1]] = b
    union = np.logical_or(canvas[0], canvas[1]).sum()
    return float(np.logical_and(canvas[0], canvas[1]).sum() / union) if union else 1.0


def match_detections(ref, test) -> tuple[int, list[float]]:
    """Greedy matching of ``test`` detections (best first) to ``ref`` ones: same class, IoU >= 0.5.

    Returns:
        (matches, INT8/FP32 score ratio per match).
    """
    ratios = [float(test.scores[i]) / max(float(ref.scores[j]), 1e-12) for i, j in match_pairs(ref, test)]
    return len(ratios), ratios


def _values(outputs) -> list[np.ndarray]:
    return list(outputs.values()) if isinstance(outputs, Mapping) else list(outputs)


def _rows(outputs) -> int:
    return len(_values(outputs)[0])


def compare_outputs(task: str, reference: Sequence, int8: Sequence, *, probabilities=None, detections=None,
                    relaxed=None, masks=None) -> dict[str, float]:
    """Measure INT8 outputs against FP32 ones, per batch (each the model's outputs, by name or in order, real rows only).

    Args:
        probabilities: classification: outputs -> (n, classes) probabilities (default softmax of the first output).
        detections: box tasks: outputs -> a list of :class:`~k2edge.tasks.detection.Detections` per sample.
        relaxed: box tasks: the same at half the card's score threshold (default: ``detections``).
        masks: segmentation: (outputs, sample row, detections) -> each detection's ``(mask, origin)``.
    """
    tally = Tally(task, probabilities=probabilities, detections=detections, relaxed=relaxed, masks=masks)
    for r_out, q_out in zip(reference, int8):
        tally.add(r_out, q_out)
    return tally.measures()


class Tally:
    """:func:`compare_outputs` one batch at a time, in any order, and whether a tolerance can still be met
    (:meth:`cannot_meet`): the fallback's search stops measuring a candidate as soon as it has certainly missed, and
    measures first the batches where a miss is likeliest (:attr:`losses`)."""

    def __init__(self, task: str, *, probabilities=None, detections=None, relaxed=None, masks=None) -> None:
        self.task, self.masks = task, masks
        self.to_p = probabilities or (lambda outs: _softmax(np.asarray(_values(outs)[0]).reshape(_rows(outs), -1)))
        self.detections, self.relaxed = detections, relaxed or detections
        self.n = dict.fromkeys(("agreed", "found", "kept", "strict_found", "strict_kept", "reference_boxes",
                                "int8_boxes", "samples"), 0)
        # per batch, by its place among the batches: what the measures average (so they come out the same, to the
        # last bit, in whatever order the batches are added), and what it lost
        self.parts: dict[int, dict] = {}
        self.losses: dict[int, float] = {}
        self.cosine_sum, self.cosine_count, self.rel = 0.0, 0, 0.0

    def room(self, r_out) -> dict[str, int]:
        """The most a reference batch can add to each count: its samples, its FP32 boxes at the card's threshold
        (``reference_boxes``) and at the relaxed one (``relaxed_boxes``: an INT8 box is kept only matched to one)."""
        if self.task not in BOX_TASKS:
            return {"samples": _rows(r_out)}
        return {"samples": _rows(r_out), "reference_boxes": sum(len(r) for r in self.detections(r_out)),
                "relaxed_boxes": sum(len(r) for r in self.relaxed(r_out))}

    def add(self, r_out, q_out, at: int | None = None) -> None:
        """Fold in one batch: the reference's outputs and INT8's; ``at``: its place among the batches (default: after
        those added so far)."""
        n, before = self.n, dict(self.n)
        at = len(self.parts) if at is None else at
        part = self.parts[at] = {"p": [], "q": [], "ratios": [], "pairs": [], "cosines": []}
        n["samples"] += _rows(r_out)
        if self.task == "classification":
            p, q = self.to_p(r_out), self.to_p(q_out)
            part["p"], part["q"] = [p], [q]
            n["agreed"] += int(np.sum(p.argmax(axis=1) == q.argmax(axis=1)))
        elif self.task in BOX_TASKS:
            rows = zip(self.detections(r_out), self.detections(q_out), self.relaxed(r_out), self.relaxed(q_out))
            for row, (r, q, r_low, q_low) in enumerate(rows):
                m, rs = match_detections(r_low, q)  # INT8 boxes that FP32 also sees
                n["kept"] += m
                part["ratios"] += rs
                n["found"] += match_detections(q_low, r)[0]  # FP32 boxes that INT8 also sees
                n["strict_kept"] += match_detections(r, q)[0]  # both at the card's threshold, as a user sees them
                n["strict_found"] += match_detections(q, r)[0]
                n["reference_boxes"] += len(r)
                n["int8_boxes"] += len(q)
                if self.task in PAIR_MEASURE:  # the task's own measure, of the boxes both runs kept
                    both = (self.masks(r_out, row, r), self.masks(q_out, row, q)) if self.masks is not None else (None, None)
                    part["pairs"] += pair_measure(self.task, r, q, match_pairs(r, q), *both)
        else:
            for a, b in zip(_values(r_out), _values(q_out)):
                a = np.asarray(a, dtype=np.float64).reshape(len(a), -1)
                b = np.asarray(b, dtype=np.float64).reshape(len(b), -1)
                den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
                part["cosines"] += np.where(den > 0, (a * b).sum(axis=1) / np.maximum(den, 1e-300), 1.0).tolist()
                self.rel = max(self.rel, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12)))
            self.cosine_sum += math.fsum(part["cosines"])
            self.cosine_count += len(part["cosines"])
        self.losses[at] = self._loss({k: n[k] - before[k] for k in n}, part)

    def _loss(self, d: dict[str, int], part: dict) -> float:
        """What one batch (its counts ``d``) lost: top-1 disagreements; FP32 boxes missed and INT8 boxes extra, as the
        check matches and at the threshold; or 1 - cosine, summed."""
        if self.task == "classification":
            return float(d["samples"] - d["agreed"])
        if self.task in BOX_TASKS:
            return float(2 * (d["reference_boxes"] + d["int8_boxes"]) - d["found"] - d["strict_found"] - d["kept"]
                         - d["strict_kept"])
        return math.fsum(1.0 - c for c in part["cosines"])

    def _joined(self, key: str) -> list:
        return [v for at in sorted(self.parts) for v in self.parts[at][key]]

    def cannot_meet(self, tolerance: Mapping, room: Mapping[str, int]) -> bool:
        """Whether no outputs of the batches still to come (``room``: the sum of their :meth:`room`) can bring the
        measures up to ``tolerance``: every one of them right (each INT8 box kept matched to a relaxed FP32 one, at
        most one per FP32 box), and still a counted share misses, or a mean of cosines (each at most 1). A mean
        without an upper bound (``score_ratio``, the pair measures) never decides it."""
        n = self.n
        if self.task == "classification":
            best = {"agreement": (n["agreed"] + room["samples"], n["samples"] + room["samples"])}
        elif self.task in BOX_TASKS:
            ref, low = room["reference_boxes"], room["relaxed_boxes"]
            best = {"recall": (n["found"] + ref, n["reference_boxes"] + ref),
                    "strict_recall": (n["strict_found"] + ref, n["reference_boxes"] + ref),
                    "precision": (n["kept"] + low, n["int8_boxes"] + low),  # more perfect INT8 boxes only raise it
                    "strict_precision": (n["strict_kept"] + ref, n["int8_boxes"] + ref)}
        else:
            total = self.cosine_count + room["samples"]
            top = (self.cosine_sum + room["samples"] * (1.0 + 1e-9)) / total if total else 1.0
            return "cosine" in tolerance and top < float(tolerance["cosine"]) - 1e-12  # a mean's last bit decides nothing
        return any(not holds(hits, count, tolerance[k]) for k, (hits, count) in best.items() if k in tolerance)

    def measures(self) -> dict[str, float]:
        """The measures of every batch folded in (:func:`compare_outputs`'s)."""
        n = self.n
        if self.task == "classification":
            p = np.concatenate(self._joined("p")) if self.parts else np.zeros((0, 1))
            q = np.concatenate(self._joined("q")) if self.parts else np.zeros((0, 1))
            top, agreed = p.argmax(axis=1), n["agreed"]
            rows = np.arange(len(p))
            return {"agreement": agreed / len(p) if len(p) else 1.0, "agreed": agreed,
                    "mean_abs_dp": float(np.mean(np.abs(p[rows, top] - q[rows, top]))), "samples": int(len(p)),
                    "bounds": {"agreement": wilson(agreed, len(p))}}
        if self.task in BOX_TASKS:
            ref_n, test_n, ratios, pairs = n["reference_boxes"], n["int8_boxes"], self._joined("ratios"), self._joined("pairs")
            found, kept, strict_found, strict_kept = n["found"], n["kept"], n["strict_found"], n["strict_kept"]
            out = {"recall": found / ref_n if ref_n else 1.0, "precision": kept / test_n if test_n else 1.0,
                   "score_ratio": float(np.mean(ratios)) if ratios else (1.0 if not ref_n else 0.0),
                   "strict_recall": strict_found / ref_n if ref_n else 1.0,
                   "strict_precision": strict_kept / test_n if test_n else 1.0,
                   "found": found, "kept": kept, "strict_found": strict_found, "strict_kept": strict_kept,
                   "reference_boxes": ref_n, "int8_boxes": test_n, "samples": n["samples"],
                   "bounds": {"recall": wilson(found, ref_n), "precision": wilson(kept, test_n),
                              "score_ratio": mean_bound(ratios), "strict_recall": wilson(strict_found, ref_n),
                              "strict_precision": wilson(strict_kept, test_n)}}
            if self.task in PAIR_MEASURE and pairs:
                out[PAIR_MEASURE[self.task]] = float(np.mean(pairs))
                out["bounds"][PAIR_MEASURE[self.task]] = mean_bound(pairs)
            return out
        cosines = self._joined("cosines")
        return {"cosine": float(np.mean(cosines)) if cosines else 1.0, "max_rel_error": self.rel,
                "samples": n["samples"], "bounds": {"cosine": mean_bound(cosines)}}


def rooms_after(rooms: Sequence[Mapping[str, int]]) -> list[dict[str, int]]:
    """Per batch of ``rooms`` (each a :meth:`Tally.room`, in the order measured), what the batches after it can still
    add to each count: the ``room`` :meth:`Tally.cannot_meet` takes after that batch (after the last: nothing)."""
    out, left = [], {k: 0 for k in (rooms[0] if rooms else {})}
    for room in reversed(rooms):
        out.append(dict(left))
        left = {k: left[k] + room[k] for k in left}
    return out[::-1]


def meets(measures: Mapping, tolerance: Mapping) -> bool:
    """Whether every measure of ``tolerance`` holds (each is "at least"; a counted share exactly, in integers). A
    ``partial`` measure (a candidate whose measuring stopped at a certain miss) never holds."""
    if measures.get("partial"):
        return False
    for k, t in tolerance.items():
        if k in COUNTED and COUNTED[k][0] in measures:
            hit, count = COUNTED[k]
            if not holds(measures[hit], measures[count], t):
                return False
        elif measures.get(k, 0.0) < t:
            return False
    return True


def resolvable(measures: Mapping, tolerance: Mapping) -> dict[str, int]:
    """Measures whose tolerance needs more items than the check has: measure -> the minimum count."""
    short = {}
    for k, t in tolerance.items():
        if k not in COUNTED or exact(t) >= 1:
            continue
        need = needed(t)
        if measures.get(COUNTED[k][1], 0) < need:
            short[k] = need
    return short


def relaxed(tolerance: Mapping, measures: Mapping, short: Mapping[str, int]) -> dict:
    """``tolerance`` with each unresolvable measure as strict as its count resolves: one miss allowed, exactly."""
    out = dict(tolerance)
    for k in short:
        out[k] = one_miss(int(measures.get(COUNTED[k][1], 0)))
    return out


def verdict(task: str, measures: Mapping, met: bool, fell_back: bool) -> str:
    """``passed`` / ``fallback`` when the tolerance holds on enough items, ``inconclusive`` when it holds on too
    few, ``failed`` when it does not hold."""
    if not met:
        return "failed"
    count, need = min_check(task)
    if int(measures.get(count, 0)) < need:
        return "inconclusive"
    return "fallback" if fell_back else "passed"


@dataclass(frozen=True)
class Int8Check:
    """One INT8 accuracy check, as data.

    Attributes:
        status: ``passed``; ``fallback`` (passed after moving layers to a higher precision); ``inconclusive`` (the
            tolerance held, on fewer items than :data:`MIN_CHECK` asks: no verdict); ``failed`` (the chain was
            exhausted or ``--precision int8`` forbade falling back: the best found is kept).
        source: ``held-out`` (every fifth calibration sample), ``in-sample`` (fewer than 16 calibration
            samples), or the path of a ``--check`` set.
        measures: the task's measures, their counts, and ``bounds`` (measure -> 95 % interval).
        tolerance: measure -> its bound; a relaxed share is an exact :class:`~fractions.Fraction` ((n - 1) / n).
        fallback: per layer kept out of INT8 by the check: ``{"node", "device", "precision", "reason", "unit"}`` and
            the figure its ranking judged it by (:func:`fallback_figure`): ``sensitivity`` (the share of all-INT8's
            output error that goes away with its unit back in float) or ``int8_alone_error`` (the output error with
            its unit alone in INT8, ranked per FLOP), see :mod:`.fallback`.
        before: the measures with every planned layer in INT8 (when a fallback changed them).
        calibration: the calibration method the ranges came from (``max``, ``percentile 99.99``, ``search``).
        ranges: the searched tensors' ranges when ``calibration`` is ``search`` (tensor -> amax), else None.
    """

    task: str
    status: str
    source: str
    samples: int
    measures: dict
    tolerance: dict
    fallback: tuple[dict, ...] = ()
    before: dict | None = None
    notes: tuple[str, ...] = field(default=())
    calibration: str = "max"
    ranges: dict | None = None

    @property
    def passed(self) -> bool:
        return self.status in ("passed", "fallback")

    @property
    def power(self) -> tuple[str, int, int]:
        """(the count a verdict stands on, how many the check judged, the minimum)."""
        count, need = min_check(self.task)
        return count, int(self.measures.get(count, self.samples if count == "samples" else 0)), need

    def advice(self) -> str:
        """What data makes an inconclusive check conclusive (empty otherwise)."""
        if self.status != "inconclusive":
            return ""
        count, have, need = self.power
        what = "FP32 boxes" if count == "reference_boxes" else "samples"
        head = (f"{have} {what} judged, fewer than the {need} a verdict needs: give a check set (build --check DATA, or "
                f"check = DATA in the model's [[models]] entry) with at least {need} {what} (distinct, and not the "
                "calibration samples)")
        if self.source in ("held-out", "in-sample"):
            return head + ", or a larger calibration set (its every fifth sample is held out for the check)"
        return head

    def to_dict(self) -> dict:
        return {"task": self.task, "status": self.status, "source": self.source, "samples": self.samples,
                "measures": _round(self.measures), "tolerance": {k: float(v) for k, v in self.tolerance.items()},
                "tolerance_exact": {k: str(exact(v)) for k, v in self.tolerance.items()},
                "minimum": dict(zip(("count", "judged", "needed"), self.power)),
                "fallback": [dict(f) for f in self.fallback],
                "before": _round(self.before) if self.before else None, "notes": list(self.notes),
                "advice": self.advice() or None, "calibration": self.calibration, "ranges": self.ranges}

    @classmethod
    def from_dict(cls, d: dict) -> "Int8Check":
        exact_tol = d.get("tolerance_exact") or {}
        tol = {k: (Fraction(exact_tol[k]) if k in exact_tol and isinstance(v, float) and exact(v) != Fraction(exact_tol[k])
                   else v) for k, v in d["tolerance"].items()}
        return cls(d["task"], d["status"], d["source"], d["samples"], d["measures"], tol,
                   tuple(d.get("fallback", ())), d.get("before"), tuple(d.get("notes", ())), d.get("calibration", "max"),
                   d.get("ranges"))

    def _bound(self, k: str) -> str:
        b = (self.measures.get("bounds") or {}).get(k)
        digits = 5 if k == "cosine" else 3
        return f", 95 % CI {b[0]:.{digits}f}-{b[1]:.{digits}f}" if b is not None else ""

    def summary(self) -> str:
        """The measures in words, e.g. ``38/40 top-1 agree (0.950, 95 % CI 0.835-0.986), mean |Δp| 0.004``."""
        m = self.measures
        if self.task == "classification":
            n = int(m.get("samples", self.samples))
            agreed = int(m.get("agreed", round(m["agreement"] * n)))
            return f"{agreed}/{n} top-1 agree ({m['agreement']:.3f}{self._bound('agreement')}), mean |Δp| {m['mean_abs_dp']:.4f}"
        if self.task in BOX_TASKS:
            words = {"mask_iou": "mask IoU {:.3f}", "keypoint_error": "keypoints {:.2f} px apart",
                     "rotated_iou": "rotated IoU {:.3f}"}
            own = "".join(f", {words[k].format(m[k])}" for k in words if k in m)
            found = f"{int(m['found'])}/{int(m['reference_boxes'])} " if "found" in m else ""
            kept = f"{int(m['kept'])}/{int(m['int8_boxes'])} " if "kept" in m else ""
            strict = (f", at the threshold recall {int(m['strict_found'])}/{int(m['reference_boxes'])} "
                      f"{m['strict_recall']:.3f}, precision {int(m['strict_kept'])}/{int(m['int8_boxes'])} "
                      f"{m['strict_precision']:.3f}" if "strict_found" in m else "")
            return (f"recall {found}{m['recall']:.3f}{self._bound('recall')}, precision {kept}{m['precision']:.3f}"
                    f"{self._bound('precision')} ({int(m['int8_boxes'])} INT8 / {int(m['reference_boxes'])} FP32 boxes), "
                    f"score ratio {m['score_ratio']:.3f}{strict}{own}")
        return f"cosine {m['cosine']:.5f}{self._bound('cosine')}, max relative error {m['max_rel_error']:.4f}"

    def tolerance_text(self) -> str:
        def one(k, v) -> str:
            if v == 0:  # one miss allowed ((n - 1) / n) of a single item, or set so: it vouches for nothing
                return f"{k} >= 0, which any result holds"
            return f"{k} >= {v}" if isinstance(v, Fraction) and v.denominator != 1 else f"{k} >= {float(v):g}"

        return ", ".join(one(k, v) for k, v in self.tolerance.items())

    def line(self) -> str:
        """The one line a person reads on stderr."""
        tol = self.tolerance_text()
        ranges = "" if self.calibration == "max" else f", {self.calibration} ranges"
        head = f"int8 check ({self.source}, {self.samples} sample(s){ranges}): {self.summary()}"
        moved = f" after {len(self.fallback)} layer(s) fell back" if self.fallback else ""
        if self.status == "passed":
            return f"{head} — within tolerance ({tol})"
        if self.status == "fallback":
            return f"{head} — within tolerance ({tol}){moved}"
        if self.status == "inconclusive":
            held = "within tolerance" if meets(self.measures, self.tolerance) else "misses its tolerance"
            return f"{head} — INCONCLUSIVE: {held} ({tol}){moved}, but {self.advice()}"
        extra = f"; {len(self.fallback)} layer(s) out of INT8 did not suffice" if self.fallback else ""
        return f"{head} — FAILED tolerance ({tol}){extra}" + (f" ({self.notes[-1]})" if self.notes else "")


def _round(v):
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_round(x) for x in v]
    return round(float(v), 6) if isinstance(v, float) else v


def refused(checks: Sequence["Int8Check | None"]) -> "Int8Check | None":
    """The first of these checks that refuses its engines where a passed check is required (None: none does; an
    engine without INT8 layers has no check and is not refused)."""
    return next((c for c in checks if c is not None and not c.passed), None)


def refusal(check: "Int8Check") -> str:
    """Why ``check`` (:func:`refused`) refuses its engines."""
    return f"[trust] require_int8_check: the INT8 check is {check.status}: {check.line()}"


def fallback_figure(entry: dict) -> str:
    """What a fallback entry was judged by, as a clause for a person (empty when it carries no figure)."""
    if entry.get("sensitivity") is not None:
        return f"{100 * entry['sensitivity']:.3g} % of all-INT8's output error goes away with it in float"
    if entry.get("int8_alone_error") is not None:
        return f"output error {entry['int8_alone_error']:.3g} with it alone in INT8, ranked per FLOP"
    return ""
