"""Which card a model without one probably needs, judged from its input and output shapes.

* one output ``[N, 4 + C, A]`` with many more anchors than rows: a YOLOv8-style detector
  (letterbox, pad 114, RGB, [0, 1]), as Ultralytics exports it;
* one output ``[N, A, 5 + C]`` with many anchors: a YOLOv5-style detector;
* an output ``[N, C]`` (or ``[N, C, 1, 1]``): a classifier of C classes;
* anything else: raw tensors.

An Ultralytics export's metadata (task, names, imgsz, stride, kpt_shape) says what it is: then the
card is what that metadata implies (see :mod:`k2edge.config.ultralytics`), whatever the shapes.

It is a suggestion to edit (``k2edge card init``), never applied silently.
"""

from __future__ import annotations

from typing import Collection, Mapping

from ..config.card import CardError, ModelCard, card_from_dict, resolve_card

__all__ = ["softmax_outputs", "suggest_card"]

_MIN_ANCHORS = 64  # fewer candidate boxes than this is not a YOLO grid (YOLOv8n at 320 has 2,100)


_SHAPE_ONLY = ("Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze")


def softmax_outputs(graph) -> set[str]:
    """The graph's outputs a Softmax makes (through ops that only reshape): they are probabilities already."""
    out = set()
    for name in graph.outputs:
        tensor = name
        while (i := graph.producer.get(tensor)) is not None and graph.nodes[i].op_type in _SHAPE_ONLY:
            tensor = graph.nodes[i].inputs[0]
        if i is not None and graph.nodes[i].op_type == "Softmax":
            out.add(name)
    return out


def suggest_card(input_name: str, input_shape: tuple, outputs: Mapping[str, tuple],
                 metadata: Mapping[str, str] | None = None, softmaxed: Collection[str] = ()) -> tuple[ModelCard, str]:
    """A card for a model and why: (card with every key resolved, one sentence). ``softmaxed``: the outputs a Softmax
    makes (:func:`softmax_outputs`), whose scores are probabilities, not logits."""
    shapes = {k: tuple(v) for k, v in outputs.items()}
    layer: dict = {}
    why = ""
    from ..config.ultralytics import UltralyticsMetadataError, read_ultralytics

    try:
        ultra = read_ultralytics(metadata)
    except UltralyticsMetadataError as exc:
        raise CardError(str(exc)) from None
    if ultra.task is not None:  # the export says what it is: its metadata is the card (resolve_card layers it)
        parts = [f"task {ultra.task}"]
        if ultra.names is not None:
            parts.append(f"{len(ultra.names)} class name(s)")
        if ultra.imgsz is not None:
            parts.append(f"imgsz {list(ultra.imgsz)}")
        if ultra.stride is not None:
            parts.append(f"stride {ultra.stride}")
        if ultra.kpt_shape is not None:
            parts.append(f"kpt_shape {list(ultra.kpt_shape)}")
        if ultra.end2end:
            parts.append("end2end (NMS in the graph)")
        why = "Ultralytics export metadata: " + ", ".join(parts)
        return resolve_card(input_name, input_shape, metadata or {}, None), why
    if len(shapes) == 1:
        (name, shape), = shapes.items()
        if len(shape) == 3 and all(isinstance(d, int) and d > 0 for d in shape[1:]):
            rows, cols = shape[1], shape[2]
            if 5 <= rows < cols and cols >= _MIN_ANCHORS:
                layer = {"task": "detection", "detection": {"format": "yolov8"}}
                why = (f"output {name!r} {list(shape)} looks like YOLOv8: [N, 4 + classes, anchors] with "
                       f"{rows - 4} class(es) and {cols} anchors")
            elif 6 <= cols < rows and rows >= _MIN_ANCHORS:
                layer = {"task": "detection", "detection": {"format": "yolov5"}}
                why = (f"output {name!r} {list(shape)} looks like YOLOv5: [N, anchors, 5 + classes] with "
                       f"{cols - 5} class(es) and {rows} anchors")
            if layer and len(input_shape) == 4:
                layer["input"] = {"resize": "letterbox", "pad_value": 114, "color": "RGB", "scale": 1 / 255,
                                  "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}
    if not layer:
        cls = [(n, s) for n, s in shapes.items() if len(s) == 2 or (len(s) == 4 and tuple(s[2:]) == (1, 1))]
        if cls:
            name, shape = cls[0]
            softmax = name in softmaxed  # a second softmax would flatten its scores (0.73 where the model says 1.00)
            layer = {"task": "classification", "classification": {"output": "probabilities" if softmax else "logits"}}
            why = (f"output {name!r} {list(shape)} looks like a classifier of {shape[1]} classes"
                   + ("; a Softmax makes it: probabilities" if softmax else " (check logits vs probabilities)"))
        else:
            layer = {"task": "tensor"}
            why = "no output looks like class scores or YOLO boxes: raw tensors"
    card = card_from_dict(layer, "suggestion")
    return resolve_card(input_name, input_shape, metadata or {}, card), why
