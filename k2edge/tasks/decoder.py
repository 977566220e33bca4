"""One answer shape per task: a batch's outputs -> one JSON-ready fragment per sample.

* classification: ``{"top_k": [{"index", "label", "score"}]}`` (scores are probabilities);
* detection: ``{"detections": [{"index", "label", "score", "box": [x1, y1, x2, y2]}]}`` in
  original-image pixels (input pixels for a tensor input);
* tensor: ``{"outputs": {name: {"dtype", "shape", "data"}}}``.

The CLI prints these; the daemon puts them in its answers. :class:`TaskDecoder` is built once per
model from its resolved card, labels and outputs, and checks they agree.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..config.card import CardError, ModelCard
from .classification import probabilities, top_k
from .detection import Detections, decode, layout_classes
from .preprocess import Geometry
from .tensor import encode_outputs

__all__ = ["TaskDecoder"]


class TaskDecoder:
    """Turns model outputs into answers by the card's task.

    Args:
        card: the resolved card.
        labels: label names (index i is line i of the labels file).
        outputs: the model's output names and shapes, in order.

    Raises:
        CardError: the card names an output the model lacks, or a detection output does not fit
            its format, or the labels disagree with the classes.
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
        if card.task == "detection":
            try:
                self.classes = layout_classes(outputs[self.output], card.detection.format)
            except ValueError as exc:
                raise CardError(f"{where}: detection.format: output {self.output!r}: {exc}") from None
            if self.labels and len(self.labels) != self.classes:
                raise CardError(f"{where}: labels: {len(self.labels)} label(s) for a detector of {self.classes} class(es) "
                                f"(output {self.output!r} {list(outputs[self.output])})")

    def probabilities(self, outputs: Mapping[str, np.ndarray], n: int | None = None) -> np.ndarray:
        """Classification: (n, classes) probabilities of the first ``n`` samples."""
        out = np.asarray(outputs[self.output])
        return probabilities(out[:n] if n is not None else out, self.card.classification.output)

    def detections(self, outputs: Mapping[str, np.ndarray], geometries: Sequence[Geometry | None]) -> list[Detections]:
        """Detection: one :class:`Detections` per geometry (per sample)."""
        return decode(outputs[self.output], self.card.detection, geometries)

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
        if self.task == "detection":
            geoms = list(geometries) if geometries is not None else [None] * n
            return [{"detections": d.to_list(self.labels)} for d in self.detections(outputs, geoms[:n])]
        return [{"outputs": encode_outputs(outputs, i)} for i in range(n)]
