"""One answer shape per task: a batch's outputs -> one JSON-ready fragment per sample.

* classification: ``{"top_k": [{"index", "label", "score"}]}`` (scores are probabilities);
* detection: ``{"detections": [{"index", "label", "score", "box": [x1, y1, x2, y2]}]}`` in
  original-image pixels (input pixels for a tensor input);
* segmentation: each detection also carries ``mask``, COCO RLE ``{"size": [h, w], "counts": "..."}``
  at the original image's resolution;
* pose: each detection also carries ``keypoints`` ``[[x, y, score], ...]`` in original-image pixels
  (in the order of the card's ``[pose] keypoints``);
* obb: each detection carries ``rbox`` ``[cx, cy, w, h, angle]`` (radians) instead of ``box``;
* tensor: ``{"outputs": {name: {"dtype", "shape", "data"}}}``.

The CLI prints these; the daemon puts them in its answers. :class:`TaskDecoder` is built once per
model from its resolved card, labels and outputs, and checks they agree.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np

from ..config.card import BOX_TASKS, CardError, ModelCard
from .classification import probabilities, top_k
from .detection import Detections, decode, layout_classes, layout_text
from .preprocess import Geometry
from .tensor import encode_outputs

log = logging.getLogger(__name__)
_TOLD: set = set()  # (output, shape) of the models read as classifiers for want of a card, already warned about

__all__ = ["TaskDecoder"]


class TaskDecoder:
    """Turns model outputs into answers by the card's task.

    Args:
        card: the resolved card.
        labels: label names (index i is line i of the labels file).
        outputs: the model's output names and shapes, in order.

    Raises:
        CardError: the card names an output the model lacks, or a detection output does not fit
            its format, or the labels disagree with the classes (naming the format instead when the labels
            fit another format's reading of the output).
    """

    def __init__(self, card: ModelCard, labels: Sequence[str], outputs: Mapping[str, tuple]) -> None:
        self.card = card
        self.task = card.task
        self.labels = tuple(labels)
        self.output_names = tuple(outputs)
        where = card.source or "the card"
        wanted = {"classification": card.classification.output_name, "detection": card.detection.output_name}.get(card.task)
        if wanted is not None and wanted not in outputs:
            raise CardError(f"{where}: {card.task}.output_name: the model has no output {wanted!r} "
                            f"(outputs: {', '.join(outputs)})")
        self.output = wanted or self.output_names[0]
        if card.task == "classification":
            self._check_classes(outputs[self.output], where)
        self.protos: str | None = None
        self.extra = 0
        if card.task in BOX_TASKS:
            shapes = {k: tuple(v) for k, v in outputs.items()}
            if card.task != "detection" and card.detection.output_name is None:
                # YOLO heads: the predictions are the 3-D output (the 4-D one holds mask prototypes)
                three = [k for k, v in shapes.items() if len(v) == 3]
                self.output = three[0] if three else self.output
            if card.task == "segmentation":
                protos = [k for k, v in shapes.items() if len(v) == 4 and k != self.output]
                if not protos:
                    raise CardError(f"{where}: task segmentation needs a prototype output [N, masks, h, w]; "
                                    f"the model has {', '.join(f'{k} {list(v)}' for k, v in shapes.items())}")
                self.protos = protos[0]
                self.extra = int(shapes[self.protos][1])
            elif card.task == "pose":
                self.extra = self._pose_values(shapes[self.output], where)
            elif card.task == "obb":
                self.extra = 1
            try:
                self.classes = layout_classes(outputs[self.output], card.detection.format, self.extra)
            except ValueError as exc:
                raise CardError(f"{where}: detection.format: output {self.output!r}: {exc}") from None
            if self.labels and self.classes and len(self.labels) != self.classes:
                self._check_format(outputs[self.output], where)
                what = "detector" if card.task == "detection" else f"{card.task} model"
                raise CardError(f"{where}: labels: {len(self.labels)} label(s) for a {what} of {self.classes} "
                                f"class(es) (output {self.output!r} {list(outputs[self.output])})")

    def _check_format(self, shape, where: str) -> None:
        """Labels that disagree with the card's format but match another format's reading of the output blame the
        format: a YOLOv8 output [1, 14, 525] read as yolov5 holds 520 classes, not the labels' 10."""
        fmt = self.card.detection.format
        for other in ("yolov8", "yolov5"):
            if other == fmt:
                continue
            try:
                classes = layout_classes(shape, other, self.extra)
            except ValueError:
                continue
            if classes == len(self.labels):
                raise CardError(
                    f"{where}: detection.format: output {self.output!r} {list(shape)} looks like {other}, not {fmt}: "
                    f"{other} is {layout_text(other, self.extra)} ({classes} class(es), as the {len(self.labels)} "
                    f"label(s)), {fmt} is {layout_text(fmt, self.extra)} ({self.classes} class(es)); "
                    f"set format = \"{other}\"")

    def _check_classes(self, shape, where: str) -> None:
        """A classifier's output is [N, classes] (trailing 1s allowed: [N, classes, 1, 1]), as many as the labels."""
        dims = list(shape)[1:]
        while len(dims) > 1 and dims[-1] == 1:
            dims.pop()
        while len(dims) > 1 and dims[0] == 1:  # [N, 1, classes] too
            dims.pop(0)
        # a model without a card is a classifier by default, and runs on its flattened output as before; a card that
        # says classification is held to it
        if len(dims) > 1 and all(isinstance(d, int) for d in dims) and "task" in self.card.model_fields_set:
            raise CardError(f"{where}: task classification reads one score per class, [N, classes]; output "
                            f"{self.output!r} is {list(shape)} (a detector's or a map's: give the card its task)")
        if len(dims) > 1 and all(isinstance(d, int) for d in dims) and (self.output, tuple(shape[1:])) not in _TOLD:
            _TOLD.add((self.output, tuple(shape[1:])))  # once a process: a model's engines each make a decoder
            log.warning("output %r %s is read as a classifier of %d classes (flattened), as no card says the task; "
                        "a detector, a segmenter or a pose model needs a card: `k2edge card init MODEL` suggests one",
                        self.output, list(shape), int(np.prod(dims)))
        if len(dims) == 1 and isinstance(dims[0], int) and self.labels and len(self.labels) != dims[0]:
            raise CardError(f"{where}: labels: {len(self.labels)} label(s) for a classifier of {dims[0]} class(es) "
                            f"(output {self.output!r} {list(shape)})")

    def _pose_values(self, shape: tuple, where: str) -> int:
        """Keypoint values per box: from ``[pose] keypoints`` x ``dims``, else what the labels leave."""
        pose = self.card.pose
        if pose.keypoints is not None:
            return len(pose.keypoints) * pose.dims
        rows = shape[-1] - 6 if self.card.detection.format == "end2end" else shape[1] - 4 - len(self.labels)
        if not self.labels and self.card.detection.format != "end2end" or rows <= 0 or rows % pose.dims:
            raise CardError(f"{where}: pose.keypoints: name the model's keypoints (how many values of output "
                            f"{self.output!r} {list(shape)} are keypoints cannot be told otherwise)")
        return rows

    def probabilities(self, outputs: Mapping[str, np.ndarray], n: int | None = None) -> np.ndarray:
        """Classification: (n, classes) probabilities of the first ``n`` samples."""
        out = np.asarray(outputs[self.output])
        return probabilities(out[:n] if n is not None else out, self.card.classification.output)

    def detections(self, outputs: Mapping[str, np.ndarray], geometries: Sequence[Geometry | None]) -> list[Detections]:
        """Detection (and the boxes of segmentation, pose, obb): one :class:`Detections` per geometry
        (per sample); ``extra`` holds mask coefficients (input units), keypoints (original pixels,
        (k, K, 3)) or rboxes (original pixels, (k, 5))."""
        if self.task == "obb":
            from .obb import decode_obb

            pred = np.asarray(outputs[self.output])
            return [decode_obb(pred[i], self.card.detection, g) for i, g in enumerate(geometries)]
        dets = decode(outputs[self.output], self.card.detection, geometries, extra=self.extra)
        if self.task == "pose":
            from dataclasses import replace

            from .pose import keypoints_to_original

            dets = [replace(d, extra=keypoints_to_original(d.extra, self.card.pose.dims, g))
                    for d, g in zip(dets, geometries)]
        return dets

    def masks(self, outputs: Mapping[str, np.ndarray], dets: Sequence[Detections],
              geometries: Sequence[Geometry | None], input_size: tuple[int, int]) -> list[list[dict]]:
        """Segmentation: per sample, each detection's mask as COCO RLE at the original image's size."""
        from .segmentation import box_masks, rle_from_box_mask

        protos = np.asarray(outputs[self.protos])
        out = []
        for i, (d, g) in enumerate(zip(dets, geometries)):
            h, w = (g.height, g.width) if g is not None else input_size
            found = box_masks(protos[i], d.extra, d.boxes, g, input_size)
            out.append([rle_from_box_mask(m, origin, h, w) for m, origin in found])
        return out

    def answers(self, outputs: Mapping[str, np.ndarray], n: int, geometries: Sequence[Geometry | None] | None = None,
                k: int = 5) -> list[dict]:
        """One answer fragment per sample for the first ``n`` samples of a batch.

        Args:
            outputs: output name -> batch array.
            n: how many samples are real (the rest padded the batch).
            geometries: per sample, where its image landed (detection); None: input pixels.
            k: classes per classification answer.
        """
        if self.task == "classification":
            return [{"top_k": top_k(row, self.labels, k)} for row in self.probabilities(outputs, n)]
        if self.task in BOX_TASKS:
            geoms = (list(geometries) if geometries is not None else [None] * n)[:n]
            dets = self.detections(outputs, geoms)
            answers = [{"detections": d.to_list(self.labels)} for d in dets]
            if self.task == "segmentation":
                mh, mw = np.asarray(outputs[self.protos]).shape[2:]
                size = tuple(self.card.input.size) if self.card.input.size else (mh * 4, mw * 4)  # protos: 1/4 input
                for a, rles in zip(answers, self.masks(outputs, dets, geoms, size)):
                    for item, rle in zip(a["detections"], rles):
                        item["mask"] = rle
            elif self.task == "pose":
                for a, d in zip(answers, dets):
                    for item, kp in zip(a["detections"], d.extra):
                        item["keypoints"] = [[round(float(x), 2), round(float(y), 2), round(float(s), 4)] for x, y, s in kp]
            elif self.task == "obb":
                for a, d in zip(answers, dets):
                    for item, rb in zip(a["detections"], d.extra):
                        del item["box"]
                        item["rbox"] = [round(float(v), 2) for v in rb[:4]] + [round(float(rb[4]), 5)]
            return answers
        return [{"outputs": encode_outputs(outputs, i)} for i in range(n)]
