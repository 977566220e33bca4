"""COCO mAP of a detector's answers (boxes, and a segmentation's masks or a pose model's keypoints),
computed by pycocotools (the reference implementation).

pycocotools is the optional extra ``detection`` (``pip install 'k2edge[detection]'``), imported
only here and only when a detector is evaluated.
"""

from __future__ import annotations

import contextlib
import io
from typing import Sequence

from ..errors import K2EdgeError
from .detection import Detections

__all__ = ["coco_map", "coco_results", "coco_answer_results"]


def coco_results(image_ids: Sequence[int], detections: Sequence[Detections], category_ids: Sequence[int]) -> list[dict]:
    """Detections as COCO results (``bbox`` = x, y, w, h in original-image pixels)."""
    out = []
    for image_id, det in zip(image_ids, detections):
        for (x1, y1, x2, y2), s, c in zip(det.boxes.tolist(), det.scores.tolist(), det.classes.tolist()):
            out.append({"image_id": int(image_id), "category_id": int(category_ids[c]),
                        "bbox": [x1, y1, x2 - x1, y2 - y1], "score": float(s)})
    return out


def coco_answer_results(image_ids: Sequence[int], answers: Sequence[Sequence[dict]], category_ids: Sequence[int]) -> list[dict]:
    """Task answers (``{"detections": [...]}`` items: ``box`` plus ``mask`` RLE or ``keypoints``) as
    COCO results carrying ``bbox`` and ``segmentation`` / ``keypoints`` (x, y, score flattened)."""
    out = []
    for image_id, dets in zip(image_ids, answers):
        for d in dets:
            x1, y1, x2, y2 = d["box"]
            r = {"image_id": int(image_id), "category_id": int(category_ids[d["index"]]),
                 "bbox": [x1, y1, x2 - x1, y2 - y1], "score": float(d["score"])}
            if "mask" in d:
                r["segmentation"] = {"size": list(d["mask"]["size"]), "counts": d["mask"]["counts"]}
            if "keypoints" in d:
                r["keypoints"] = [float(v) for kp in d["keypoints"] for v in kp]
            out.append(r)
    return out


def coco_map(ground_truth: dict, results: list[dict], iou_type: str = "bbox", sigmas: Sequence[float] | None = None) -> dict:
    """``{"map": mAP@[.5:.95], "map50": mAP@.5}`` as fractions (COCOeval ``stats[0]`` and ``stats[1]``).

    Args:
        ground_truth: the COCO annotation document.
        results: COCO results.
        iou_type: ``bbox``, ``segm`` (masks, RLE or polygons) or ``keypoints`` (OKS with ``sigmas``,
            one per keypoint; pycocotools' COCO sigmas when None).

    Raises:
        K2EdgeError: pycocotools is not installed (the message says how to install it).
    """
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        raise K2EdgeError("evaluating a detector needs pycocotools: pip install 'k2edge[detection]' "
                          "(or pip install pycocotools)") from None
    if not results:
        return {"map": 0.0, "map50": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress; our stdout may be JSON
        gt = COCO()
        gt.dataset = {"info": {}, **ground_truth}
        gt.createIndex()
        if iou_type == "segm":  # loadRes computes areas from the masks: RLE, its counts as bytes
            def rle(r: dict) -> dict:
                seg = r["segmentation"]
                if isinstance(seg, list):  # polygons: a ground-truth annotation standing in for an answer
                    seg = gt.annToRLE(r)
                elif isinstance(seg.get("counts"), str):
                    seg = {**seg, "counts": seg["counts"].encode()}
                return {**{k: v for k, v in r.items() if k != "bbox"}, "segmentation": seg}

            results = [rle(r) for r in results]
        dt = gt.loadRes(results)
        ev = COCOeval(gt, dt, iou_type)
        if iou_type == "keypoints" and sigmas is not None:
            import numpy as np

            ev.params.kpt_oks_sigmas = np.asarray(sigmas, dtype=np.float64)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    stats = [max(0.0, float(s)) for s in ev.stats[:2]]  # -1 means "no ground truth": report 0
    return {"map": stats[0], "map50": stats[1]}
