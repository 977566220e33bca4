"""COCO mAP of a detector's answers, computed by pycocotools (the reference implementation).

pycocotools is the optional extra ``detection`` (``pip install 'k2edge[detection]'``), imported
only here and only when a detector is evaluated.
"""

from __future__ import annotations

import contextlib
import io
from typing import Sequence

from ..errors import K2EdgeError
from .detection import Detections

__all__ = ["coco_map", "coco_results"]


def coco_results(image_ids: Sequence[int], detections: Sequence[Detections], category_ids: Sequence[int]) -> list[dict]:
    """Detections as COCO results (``bbox`` = x, y, w, h in original-image pixels)."""
    out = []
    for image_id, det in zip(image_ids, detections):
        for (x1, y1, x2, y2), s, c in zip(det.boxes.tolist(), det.scores.tolist(), det.classes.tolist()):
            out.append({"image_id": int(image_id), "category_id": int(category_ids[c]),
                        "bbox": [x1, y1, x2 - x1, y2 - y1], "score": float(s)})
    return out


def coco_map(ground_truth: dict, results: list[dict]) -> dict:
    """``{"map": mAP@[.5:.95], "map50": mAP@.5}`` as fractions (COCOeval ``stats[0]`` and ``stats[1]``).

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
        dt = gt.loadRes(results)
        ev = COCOeval(gt, dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    stats = [max(0.0, float(s)) for s in ev.stats[:2]]  # -1 means "no ground truth": report 0
    return {"map": stats[0], "map50": stats[1]}
