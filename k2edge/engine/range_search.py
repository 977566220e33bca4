"""Per-tensor INT8 ranges chosen by their effect on the model's output, not on the tensor alone.

A range that suits a tensor's own values (``max``, a percentile, the least-squared-error ``mse`` range) is not
the one that costs the model's output least: the first layers' inputs feed everything after them, a tensor
whose rare large values carry the answer must not clip them, and one whose tail is noise should. The search
starts from every tensor at its ``mse`` range and, tensor by tensor in graph order, keeps whichever of its
candidate ranges (:data:`CANDIDATES`, from the same statistics) lowers the error of the model's outputs against
FP32 on a few calibration samples (:func:`~.fallback.output_error`, the measure the fallback ranks layers by).
One pass, greedy; the check, not the search, judges the result.

To be cheap enough to run at build, the Q/DQ scales become inputs of one ONNX Runtime session (no session per
trial) and candidates within 2 % of the current range are skipped. It is still one run of the search samples
per candidate: about 470 s for NudeNet's YOLOv8n at 320 and 500 s for PP-OCRv4's DBNet at 480 on 2 shared cores,
so it is a method a card or profile names, not part of ``auto``. On that YOLOv8n (only the decoding in float,
8 samples) the output error fell from 0.27 (``mse``; ``max`` 0.53) to 0.08 and the recall at the card's threshold
on 100 held-out scenes from 0.73 to 0.87 (docs/int8.md, "Range search").
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from .calibration import TensorStatistics, runs, session
from .fallback import OutputProbe, output_error

SEARCH_SAMPLES = 8  # calibration samples each trial runs on (spread over the calibration set)
START = "mse"
CANDIDATES = (("max", None), ("percentile", 99.999), ("percentile", 99.99), ("percentile", 99.9), ("mse", None))
MIN_STEP = 0.02  # candidates closer than this (relative) to the current range are not tried


def candidate_ranges(stats: TensorStatistics) -> dict[str, list[float]]:
    """Per tensor, the distinct candidate ranges of :data:`CANDIDATES` (ascending)."""
    per = [stats.ranges(m, p) if p is not None else stats.ranges(m) for m, p in CANDIDATES]
    return {t: sorted({float(r[t]) for r in per if r[t] > 0}) for t in per[0]}


def activation_scales(qdq: onnx.ModelProto) -> dict[str, str]:
    """Activation tensor -> the scale initializer its QuantizeLinear (and DequantizeLinear) read, one tensor per
    scale: ONNX Runtime's quantiser gives a MaxPool's output its input's scale, so the first tensor in graph order
    owns it (the other's range is not the artefact's)."""
    inits = {i.name for i in qdq.graph.initializer}
    out: dict[str, str] = {}
    for n in qdq.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in inits and n.input[1] in inits \
                and n.input[1] not in out.values():
            out.setdefault(n.input[0], n.input[1])
    return out


def _scales_as_inputs(qdq: onnx.ModelProto, scale_names) -> onnx.ModelProto:
    """A copy of ``qdq`` whose activation scales are graph inputs (fed per trial; one session for the search)."""
    names = set(scale_names)
    out = onnx.ModelProto()
    out.CopyFrom(qdq)
    kept = [i for i in out.graph.initializer if i.name not in names]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    for s in sorted(names):
        out.graph.input.append(onnx.helper.make_tensor_value_info(s, onnx.TensorProto.FLOAT, []))
    return out


def search_ranges(qdq: onnx.ModelProto, start: dict[str, float], candidates: dict[str, list[float]],
                  probe: OutputProbe, fixed=frozenset(),
                  progress: Callable[[str, int, int], None] | None = None) -> tuple[dict[str, float], float, float]:
    """Greedy per-tensor range search (see the module docstring).

    Args:
        qdq: the all-INT8 Q/DQ model (its activation scales are replaced per trial; their values do not matter).
        start: every tensor's range to start from.
        candidates: per tensor, the ranges to try (:func:`candidate_ranges`).
        probe: FP32 outputs of the samples the trials run on.
        fixed: tensors whose range the search must not change (the DLA's tied groups and fused gates).

    Returns:
        (the ranges of ``start`` with the searched tensors changed, the output error at the start, at the end).
    """
    scales = {t: s for t, s in activation_scales(qdq).items() if t in start}
    run = session(_scales_as_inputs(qdq, scales.values()), optimise=True)
    name = probe.input_name
    current = {t: float(start[t]) for t in scales}

    def error(ranges: dict[str, float]) -> float:
        feeds = {scales[t]: np.array(max(a, 1e-12) / 127.0, dtype=np.float32) for t, a in ranges.items()}
        outs = list(runs(run, None, ({name: b, **feeds} for b, _ in probe.batches)))
        got = [np.concatenate([o[k][:n] for o, (_, n) in zip(outs, probe.batches)]) for k in range(len(outs[0]))]
        return output_error(probe.reference, got)

    before = best = error(current)
    order = [t for t in scales if t not in fixed]
    for i, t in enumerate(order):
        here = current[t]
        for a in sorted(candidates.get(t, ()), key=lambda a: abs(np.log(a / here)) if here > 0 else 0.0):
            if here > 0 and abs(a - current[t]) <= MIN_STEP * current[t]:
                continue
            trial = dict(current)
            trial[t] = a
            e = error(trial)
            if e < best:
                best, current = e, trial
        if progress:
            progress("int8 range search", i + 1, len(order))
    return {**start, **current}, before, best
