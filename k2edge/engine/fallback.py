"""Which learned layers leave INT8 when the check misses its tolerance: ranked by what each costs the model's output.

Sensitivity (:func:`sensitivity`): with every planned layer in INT8, each learned layer (Conv, ConvTranspose,
Gemm, MatMul with a weight) is put back in float alone, together with its quantisers (its input's Q/DQ and its
weight's, :func:`~.quantize.unquantise_layers`), and the model's outputs are compared with FP32 on calibration
samples (not the check's: the check judges the result). A layer's sensitivity is the output error that goes
away with it in float: the error of all-INT8 minus the error with that layer alone in float, as a share of the
all-INT8 error (1.0: that layer alone is the whole loss). The output error is the mean, over output channels, of
the squared error relative to the FP32 channel's energy, so a detector's box coordinates (0..640) do not drown
its class scores (0..1).

A learned layer moves with its epilogue (the BatchNorm and activation TensorRT fuses into it) and the quantisers
of both; a non-learned layer outside any epilogue (a residual Add, a Concat, a pooling) moves alone. Moving a
unit only makes it read float: its output keeps its Q/DQ where an INT8 reader needs it, so the next Conv is never
left in float by accident. The search (:func:`smallest_prefix`) finds the fewest of the most sensitive units that
meet the tolerance on the check set.

Where the loss is many small ones, that ranking gives up most of the INT8 before the tolerance holds (PP-OCRv4's
DBNet: every layer). The second ranking (:func:`int8_alone_costs`, :func:`rank_by_cost_per_flop`) measures the
reverse -- each unit alone in INT8, every other out -- and keeps INT8 the units with the least error per FLOP.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

import numpy as np
import onnx

from .calibration import batched, runs, session
from .quantize import unquantise_layers
from .suffix import SharedPrefix, Suffix

SENSITIVITY_SAMPLES = 6  # calibration samples each candidate runs on (one ORT session per unit)
PROBE_CHUNK = 16  # variants probed per run of their base; the values held for them: +267 MiB peak on DBNet 480


def output_error(reference: list[np.ndarray], got: list[np.ndarray]) -> float:
    """Mean over every output channel of ``sum((a - b)^2) / sum(a^2)`` (batch and positions pooled)."""
    errors = []
    for a, b in zip(reference, got):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.ndim >= 2:
            a = np.moveaxis(a, 1, 0).reshape(a.shape[1], -1)
            b = np.moveaxis(b, 1, 0).reshape(b.shape[1], -1)
        else:
            a, b = a.reshape(1, -1), b.reshape(1, -1)
        energy = (a * a).sum(axis=1)
        errors.extend(((a - b) ** 2).sum(axis=1) / np.maximum(energy, 1e-12))
    return float(np.mean(errors)) if errors else 0.0


class OutputProbe:
    """FP32 outputs of a few staged calibration batches, and the error of a Q/DQ model's outputs against them."""

    def __init__(self, model: onnx.ModelProto, input_name: str, batches: list[tuple[np.ndarray, int]]):
        self.input_name = input_name
        self.batches = batches
        self.reference = self._run(model)

    def _run(self, model: onnx.ModelProto) -> list[np.ndarray]:
        got = list(runs(session(model, optimise=True), None, ({self.input_name: b} for b, _ in self.batches)))
        return self._joined(got)

    def _joined(self, got: list) -> list[np.ndarray]:
        return [np.concatenate([r[k][:n] for r, (_, n) in zip(got, self.batches)]) for k in range(len(got[0]))]

    def error(self, model: onnx.ModelProto) -> float:
        return output_error(self.reference, self._run(model))

    def errors(self, models: Iterable[onnx.ModelProto], base: onnx.ModelProto | None = None) -> Iterator[float]:
        """:meth:`error` of each of ``models``, in order, a model per core at a time: its session is made and its
        samples run on that core (a unit's session costs about what its six samples do, so made one after another
        they left the other core idle: YOLOv8n's 191 sessions, 9 of the fallback's 28 s).

        With ``base`` (the model each of ``models`` is a variant of), each runs only the part the base does not
        compute (:mod:`.suffix`), fed with the base's values, ``PROBE_CHUNK`` models to one run of the base."""
        prefix = SharedPrefix(base) if base is not None else None

        def whole(model: onnx.ModelProto) -> list[list[np.ndarray]]:
            sess = session(model, optimise=True)
            return [sess.run(None, {self.input_name: b}) for b, _ in self.batches]

        for chunk in batched(models, PROBE_CHUNK):
            cuts = [prefix.suffix(m) if prefix is not None else None for m in chunk]
            values = self._base_values(base, {n for c in cuts if c is not None for n in c.needs()})

            def one(k: int) -> float:
                got = whole(chunk[k]) if cuts[k] is None else self._suffix_run(cuts[k], values)
                return output_error(self.reference, self._joined(got))

            yield from runs(None, None, range(len(chunk)), one)

    def _base_values(self, base: onnx.ModelProto | None, names: set[str]) -> list[dict[str, np.ndarray]]:
        """Per batch, the base's values of ``names`` (its input's among them): one run of the base over the batches."""
        if base is None or not names:
            return [{} for _ in self.batches]
        inputs = {i.name for i in base.graph.input}
        wanted = sorted(names - inputs)
        observed = onnx.ModelProto()
        observed.CopyFrom(base)
        del observed.graph.output[:]
        observed.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in wanted)
        got = runs(session(observed, optimise=True), wanted, ({self.input_name: b} for b, _ in self.batches)) \
            if wanted else ([] for _ in self.batches)
        return [{**dict(zip(wanted, values)), **{n: b for n in names & inputs}} for values, (b, _) in zip(got, self.batches)]

    def _suffix_run(self, cut: Suffix, values: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        """A variant's outputs on each batch: its suffix run on the base's values, its other outputs the base's."""
        model = cut.model({name: onnx.helper.np_dtype_to_tensor_dtype(values[0][src].dtype) for name, src in cut.feeds.items()})
        sess = session(model, optimise=True) if model is not None else None
        order = [o.name for o in model.graph.output] if model is not None else []
        out = []
        for held in values:
            ran = dict(zip(order, sess.run(order, {name: held[src] for name, src in cut.feeds.items()}))) if sess else {}
            out.append([ran[name] if kind == "suffix" else held[name] for kind, name in cut.outputs])
        return out


def sensitivity(probe: OutputProbe, qdq: onnx.ModelProto, original: onnx.ModelProto, units: dict[str, tuple[str, ...]],
                progress: Callable[[str, int, int], None] | None = None) -> dict[str, float]:
    """Per unit (:func:`~.quantize.fallback_units`: a learned layer with its epilogue): the share of all-INT8's
    output error that goes away with that unit alone back in float (with its quantisers); see the module docstring."""
    base = probe.error(qdq)
    out = {}
    errors = probe.errors((unquantise_layers(qdq, original, unit) for unit in units.values()), base=qdq)
    for i, (name, err) in enumerate(zip(units, errors)):
        out[name] = (base - err) / base if base > 0 else 0.0
        if progress:
            progress("int8 sensitivity", i + 1, len(units))
    return out


def int8_alone_costs(probe: OutputProbe, alone: Callable[[str], onnx.ModelProto], units: dict[str, tuple[str, ...]],
                     progress: Callable[[str, int, int], None] | None = None,
                     none: onnx.ModelProto | None = None) -> dict[str, float]:
    """Per unit: the output error with that unit alone in INT8 and every other unit out of it (``alone(unit)`` makes
    that model; ``none``, every unit out: what each differs from, run once for the probes). The reverse of
    :func:`sensitivity`: where the loss is many small ones (PP-OCRv4's DBNet: after the four most sensitive layers the
    map's cosine stays at 0.981 down to 48 % INT8), what each layer costs on its own ranks them better than what each
    removes from the whole."""
    out = {}
    for i, (name, err) in enumerate(zip(units, probe.errors((alone(name) for name in units), base=none))):
        out[name] = err
        if progress:
            progress("int8 cost alone", i + 1, len(units))
    return out


def rank_by_cost_per_flop(costs: dict[str, float], flops: dict[str, int], order: list[str]) -> list[str]:
    """The units to move first: those without learned FLOPs (moving them keeps every INT8 layer INT8), then the
    highest INT8-alone cost per FLOP (so the units kept INT8 are the most FLOPs for the least error); ties in graph
    order."""
    position = {n: i for i, n in enumerate(order)}
    return sorted(order, key=lambda u: (flops.get(u, 0) > 0, -costs.get(u, 0.0) / max(flops.get(u, 0), 1), position[u]))


def rank(sensitivities: dict[str, float], order: list[str]) -> list[str]:
    """Most sensitive first; ties (and layers whose float copy does not help) in graph order."""
    position = {n: i for i, n in enumerate(order)}
    return sorted(sensitivities, key=lambda n: (-sensitivities[n], position.get(n, 0)))


def smallest_prefix(holds: Callable[[int], bool], n: int) -> int | None:
    """The smallest k in 1..n for which ``holds(k)`` (the k most sensitive units in float meet the tolerance), or
    None when even all n do not.

    Doubling from below (1, 2, 4, ... then n), then a bisection between the last miss and the first hit: about
    2 log2(k) checks when k units suffice, so a fallback of a few layers costs a few checks. The measures are not
    monotonic in k on a check set of a few hundred items; the smallest k that held wins.
    """
    tried: dict[int, bool] = {}

    def check(k: int) -> bool:
        if k not in tried:
            tried[k] = holds(k)
        return tried[k]

    lo, k = 0, 1
    while k < n and not check(k):
        lo, k = k, k * 2
    k = min(k, n)
    if n == 0 or not check(k):
        return None
    while k - lo > 1:
        mid = (lo + k) // 2
        if check(mid):
            k = mid
        else:
            lo = mid
    return min(j for j, ok in tried.items() if ok)


def search_budget(n: int) -> int:
    """About how many checks :func:`smallest_prefix` runs for ``n`` candidates (for progress)."""
    return max(2, 2 * math.ceil(math.log2(n + 1)))
