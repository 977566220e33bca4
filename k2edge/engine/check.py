"""The INT8 accuracy check: FP32 against INT8 on held-out calibration samples, measured by the card's task.

Measures (all "higher is better" except ``mean_abs_dp`` and ``max_rel_error``):

* classification: ``agreement`` (top-1 of INT8 equals top-1 of FP32) and ``mean_abs_dp`` (mean |Δp| of the
  FP32 top-1 class's probability);
* detection: INT8 boxes matched to FP32 boxes (same label, IoU >= 0.5, greedy by score): ``precision``
  (matched / INT8 boxes), ``recall`` (matched / FP32 boxes) and ``score_ratio`` (mean INT8/FP32 score of the
  matches). Each run's boxes are matched against the other run's boxes decoded down to half the card's score
  threshold, so a box scored 0.26 by one run and 0.24 by the other is a score change, not a missed or an extra
  object;
* segmentation, pose, obb: the detection measures on their boxes (an oriented box by its bounds), and of the
  matched pairs the task's own, reported beside them: ``mask_iou`` (mean IoU of the two masks, at the
  input's size), ``keypoint_error`` (mean distance of the keypoints, in input pixels; lower is better) or
  ``rotated_iou`` (mean probabilistic IoU of the oriented boxes, as Ultralytics' rotated NMS measures overlap);
* tensor: ``cosine`` (mean cosine similarity per sample and output) and ``max_rel_error`` (largest |Δ| over
  the output's largest magnitude).

The result is data (:class:`Int8Check`): the build prints its :meth:`~Int8Check.line` on stderr, ``--json``
carries :meth:`~Int8Check.to_dict` as ``int8_check``, and it is stored in the engine cache with the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..config.card import BOX_TASKS
from ..errors import BuildError

MATCH_IOU = 0.5

DEFAULT_TOLERANCE = {
    "classification": {"agreement": 0.99},
    "detection": {"recall": 0.97, "precision": 0.97, "score_ratio": 0.9},
    "tensor": {"cosine": 0.999},
}
PAIR_MEASURE = {"segmentation": "mask_iou", "pose": "keypoint_error", "obb": "rotated_iou"}
# measure -> the count that resolves it: a share of n items cannot tell 1 - t from 1 with fewer than 1 / (1 - t)
_COUNTED = {"agreement": "samples", "recall": "reference_boxes", "precision": "int8_boxes"}


def tolerance_for(task: str, *layers: Mapping[str, float] | None) -> tuple[dict[str, float], bool]:
    """The tolerance for ``task``: the defaults, overridden by each layer in turn (profile, then card).

    Returns:
        (tolerance, whether any layer set it explicitly).

    Raises:
        BuildError: a layer names a measure the task does not have.
    """
    tol = dict(DEFAULT_TOLERANCE["detection"] if task in BOX_TASKS else DEFAULT_TOLERANCE.get(task, DEFAULT_TOLERANCE["tensor"]))
    explicit = False
    for layer in layers:
        for k, v in (layer or {}).items():
            if k not in tol:
                raise BuildError(f"int8 tolerance: {task} has measures {', '.join(tol)}; got {k!r}")
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
    if task == "classification":
        to_p = probabilities or (lambda outs: _softmax(np.asarray(_values(outs)[0]).reshape(_rows(outs), -1)))
        p = np.concatenate([to_p(o) for o in reference])
        q = np.concatenate([to_p(o) for o in int8])
        top = p.argmax(axis=1)
        rows = np.arange(len(p))
        return {"agreement": float(np.mean(top == q.argmax(axis=1))), "mean_abs_dp": float(np.mean(np.abs(p[rows, top] - q[rows, top]))),
                "samples": int(len(p))}
    if task in BOX_TASKS:
        relaxed = relaxed or detections
        found, kept, ref_n, test_n, ratios, pair_values = 0, 0, 0, 0, [], []
        for r_out, q_out in zip(reference, int8):
            rows = zip(detections(r_out), detections(q_out), relaxed(r_out), relaxed(q_out))
            for row, (r, q, r_low, q_low) in enumerate(rows):
                m, rs = match_detections(r_low, q)  # INT8 boxes that FP32 also sees
                kept += m
                ratios += rs
                found += match_detections(q_low, r)[0]  # FP32 boxes that INT8 also sees
                ref_n += len(r)
                test_n += len(q)
                if task in PAIR_MEASURE:  # the task's own measure, of the boxes both runs kept
                    both = (masks(r_out, row, r), masks(q_out, row, q)) if masks is not None else (None, None)
                    pair_values += pair_measure(task, r, q, match_pairs(r, q), *both)
        out = {"recall": found / ref_n if ref_n else 1.0, "precision": kept / test_n if test_n else 1.0,
               "score_ratio": float(np.mean(ratios)) if ratios else (1.0 if not ref_n else 0.0),
               "reference_boxes": ref_n, "int8_boxes": test_n, "samples": sum(_rows(r) for r in reference)}
        if task in PAIR_MEASURE and pair_values:
            out[PAIR_MEASURE[task]] = float(np.mean(pair_values))
        return out
    cosines, rel = [], 0.0
    for r_out, q_out in zip(reference, int8):
        for a, b in zip(_values(r_out), _values(q_out)):
            a = np.asarray(a, dtype=np.float64).reshape(len(a), -1)
            b = np.asarray(b, dtype=np.float64).reshape(len(b), -1)
            den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
            cosines.extend(np.where(den > 0, (a * b).sum(axis=1) / np.maximum(den, 1e-300), 1.0).tolist())
            rel = max(rel, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12)))
    return {"cosine": float(np.mean(cosines)) if cosines else 1.0, "max_rel_error": rel,
            "samples": sum(_rows(r) for r in reference)}


def meets(measures: Mapping[str, float], tolerance: Mapping[str, float]) -> bool:
    """Whether every measure of ``tolerance`` holds (each is "at least")."""
    return all(measures.get(k, 0.0) >= v for k, v in tolerance.items())


def resolvable(measures: Mapping[str, float], tolerance: Mapping[str, float]) -> dict[str, int]:
    """Measures whose tolerance needs more items than the check has: measure -> the minimum count."""
    short = {}
    for k, t in tolerance.items():
        count_key = _COUNTED.get(k)
        if count_key is None or t >= 1.0:
            continue
        need = int(np.ceil(1.0 / (1.0 - t) - 1e-9))
        if measures.get(count_key, 0) < need:
            short[k] = need
    return short


@dataclass(frozen=True)
class Int8Check:
    """One INT8 accuracy check, as data.

    Attributes:
        status: ``passed``; ``fallback`` (passed after moving layers to a higher precision); ``failed`` (the
            chain was exhausted or ``--precision int8`` forbade falling back: the best found is kept).
        source: ``held-out`` (every fifth calibration sample), ``in-sample`` (fewer than 16 calibration
            samples), or the path of a ``--check`` set.
        fallback: per layer kept out of INT8 by the check: ``{"node", "precision", "why", "sqnr_db"}``.
        before: the measures with every planned layer in INT8 (when a fallback changed them).
    """

    task: str
    status: str
    source: str
    samples: int
    measures: dict[str, float]
    tolerance: dict[str, float]
    fallback: tuple[dict, ...] = ()
    before: dict[str, float] | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return self.status in ("passed", "fallback")

    def to_dict(self) -> dict:
        return {"task": self.task, "status": self.status, "source": self.source, "samples": self.samples,
                "measures": {k: _round(v) for k, v in self.measures.items()}, "tolerance": dict(self.tolerance),
                "fallback": [dict(f) for f in self.fallback],
                "before": {k: _round(v) for k, v in self.before.items()} if self.before else None,
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict) -> "Int8Check":
        return cls(d["task"], d["status"], d["source"], d["samples"], d["measures"], d["tolerance"],
                   tuple(d.get("fallback", ())), d.get("before"), tuple(d.get("notes", ())))

    def summary(self) -> str:
        """The measures in words, e.g. ``38/40 top-1 agree (0.95), mean |Δp| 0.004``."""
        m = self.measures
        if self.task == "classification":
            n = int(m.get("samples", self.samples))
            return f"{round(m['agreement'] * n)}/{n} top-1 agree ({m['agreement']:.3f}), mean |Δp| {m['mean_abs_dp']:.4f}"
        if self.task in BOX_TASKS:
            words = {"mask_iou": "mask IoU {:.3f}", "keypoint_error": "keypoints {:.2f} px apart",
                     "rotated_iou": "rotated IoU {:.3f}"}
            own = "".join(f", {words[k].format(m[k])}" for k in words if k in m)
            return (f"recall {m['recall']:.3f}, precision {m['precision']:.3f} ({int(m['int8_boxes'])} INT8 / "
                    f"{int(m['reference_boxes'])} FP32 boxes), score ratio {m['score_ratio']:.3f}{own}")
        return f"cosine {m['cosine']:.5f}, max relative error {m['max_rel_error']:.4f}"

    def line(self) -> str:
        """The one line a person reads on stderr."""
        tol = ", ".join(f"{k} >= {v:g}" for k, v in self.tolerance.items())
        head = f"int8 check ({self.source}, {self.samples} sample(s)): {self.summary()}"
        if self.status == "passed":
            return f"{head} — within tolerance ({tol})"
        if self.status == "fallback":
            return f"{head} — within tolerance ({tol}) after {len(self.fallback)} layer(s) fell back to fp16"
        extra = f"; {len(self.fallback)} layer(s) in fp16 did not suffice" if self.fallback else ""
        return f"{head} — FAILED tolerance ({tol}){extra}" + (f" ({self.notes[-1]})" if self.notes else "")


def _round(v):
    return round(float(v), 6) if isinstance(v, float) else v
