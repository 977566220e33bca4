"""Streaming INT8 calibration: per-tensor statistics, one batch at a time.

ONNX Runtime's histogram calibrators keep every intermediate output of every calibration batch in
memory before histogramming (``onnxruntime/quantization/calibrate.py``, ``HistogramCalibrater.collect_data``
appends each batch's outputs to ``intermediate_outputs``): gigabytes for a YOLOv8n at 640. Here each
batch's activations are folded into a fixed-size state per tensor (its largest magnitude and a
``BINS``-bin histogram of magnitudes) and dropped, so memory is bounded by the number of tensors,
not of samples.

Methods (symmetric, as TensorRT takes INT8: amax = the range, scale = amax / 127):

* ``max``: the largest magnitude seen. It is what ONNX Runtime's ``MinMax`` gives with symmetric
  activations (``max(|min|, |max|)`` over all batches, no moving average), so with the same settings
  k2edge's Q/DQ scales equal plain ``quantize_static``'s.
* ``percentile``: the magnitude below which ``percentile`` % of the values lie (default 99.99),
  from the histogram; never more than the maximum.
* ``mse``: the range whose INT8 rounding of this tensor's own values costs the least squared error (values
  inside the range rounded to steps of range / 127, an error of step^2 / 12 each; values outside clipped), from
  the histogram. It is the start of the range search (:mod:`.range_search`), which judges ranges by the model's
  output instead.

The histogram never re-bins approximately: its bin width only ever doubles (pairs of bins merge
exactly) when a batch brings a larger magnitude, so the result does not depend on batch order
beyond that width. Padding samples of a short last batch are not counted, so the statistics are
the same at every batch size.

Every ONNX Runtime pass of the INT8 build (statistics, checks, sensitivities, the range search) runs its samples
with :func:`runs`: a single-threaded session, one sample per core at a time, results in order. On a small model
one run's intra-op threads scale poorly: YOLOv8n at 320 as Q/DQ took 1.02-1.28 s for 40 samples on both cores'
threads and 0.62 s as two single-threaded runs side by side (1.6-2.1x; its FP32 1.4-1.5x).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import onnx

from ..errors import BuildError

log = logging.getLogger(__name__)

BINS = 2048  # as ONNX Runtime's percentile default and TensorRT's entropy calibrator
METHODS = ("max", "percentile", "mse")
DEFAULT_PERCENTILE = 99.99


@dataclass
class _TensorState:
    amax: float = 0.0
    width: float = 0.0  # histogram bin width; 0 until the first non-zero value
    hist: np.ndarray | None = None

    def add(self, values: np.ndarray, histogram: bool) -> None:
        mags = np.abs(values.reshape(-1))
        if not mags.size:
            return
        top = float(mags.max())
        if not np.isfinite(top):
            mags = mags[np.isfinite(mags)]
            top = float(mags.max()) if mags.size else 0.0
        self.amax = max(self.amax, top)
        if not histogram or top == 0.0:
            return
        if self.hist is None:
            self.hist = np.zeros(BINS, dtype=np.int64)
            self.width = top / BINS
        while top > self.width * BINS:  # double the width: merge pairs of bins, exactly
            merged = self.hist.reshape(BINS // 2, 2).sum(axis=1)
            self.hist = np.concatenate([merged, np.zeros(BINS // 2, dtype=np.int64)])
            self.width *= 2.0
        mags *= np.float32(1.0 / self.width)  # in place, in float32: a quarter of the float64 path's time
        # bincount takes intp (an int32 index is converted again), and a value at the top edge (bin BINS) belongs to
        # the last bin: folded after counting instead of clipping every index (YOLOv8n at 320: 27 ms a sample, not 34)
        counts = np.bincount(mags.astype(np.intp), minlength=BINS + 1)
        self.hist += counts[:BINS]
        self.hist[-1] += counts[BINS:].sum()

    def percentile(self, p: float) -> float:
        if self.hist is None:
            return self.amax
        cdf = np.cumsum(self.hist)
        k = int(np.searchsorted(cdf, cdf[-1] * p / 100.0, side="left"))
        return min(self.amax, (k + 1) * self.width)

    def mse(self, levels: int = 127) -> float:
        """The range with the least squared INT8 error over the histogram (bin centres; every bin edge a
        candidate), vectorised: the clipped tail's error from suffix sums of h, h*c and h*c^2."""
        if self.hist is None:
            return self.amax
        h = self.hist.astype(np.float64)
        c = (np.arange(BINS) + 0.5) * self.width
        c[-1] = min(c[-1], self.amax)
        top = min(BINS, max(1, int(np.ceil(self.amax / self.width))))
        edges = np.arange(1, top + 1) * self.width  # candidate k clips at edge k: bins >= k are outside
        edges[-1] = self.amax
        s0, s1, s2 = (np.concatenate([np.cumsum(v[::-1])[::-1], [0.0]]) for v in (h, h * c, h * c * c))
        k = np.arange(1, top + 1)
        inside = s0[0] - s0[k]
        tail = s2[k] - 2 * edges * s1[k] + edges * edges * s0[k]
        err = inside * (edges / levels) ** 2 / 12.0 + tail
        return float(min(self.amax, edges[int(np.argmin(err))]))


class TensorStatistics:
    """Per-tensor magnitude statistics of a calibration pass (streaming; bounded memory)."""

    def __init__(self, histogram: bool = True) -> None:
        self.histogram = histogram
        self.samples = 0
        self._state: dict[str, _TensorState] = {}

    def add(self, outputs: dict[str, np.ndarray], count: int) -> None:
        """Fold one batch's activations in; only the first ``count`` rows are real samples."""
        for name, value in outputs.items():
            self._state.setdefault(name, _TensorState()).add(value[:count] if value.ndim else value, self.histogram)
        self.samples += count

    def ranges(self, method: str = "max", percentile: float = DEFAULT_PERCENTILE) -> dict[str, float]:
        """amax per tensor under ``method`` (``max``, ``percentile`` or ``mse``)."""
        if method == "max":
            return {k: s.amax for k, s in self._state.items()}
        if method in ("percentile", "mse"):
            if not self.histogram:
                raise BuildError(f"{method} calibration needs the histogram statistics")
            if method == "mse":
                return {k: s.mse() for k, s in self._state.items()}
            return {k: s.percentile(percentile) for k, s in self._state.items()}
        raise BuildError(f"calibration method must be one of {', '.join(METHODS)}, got {method!r}")

    def save(self, path: Path) -> None:
        names = sorted(self._state)
        arrays = {"names": np.array(names), "amax": np.array([self._state[n].amax for n in names]),
                  "width": np.array([self._state[n].width for n in names]), "samples": np.array(self.samples)}
        if self.histogram:
            arrays["hist"] = np.stack([self._state[n].hist if self._state[n].hist is not None
                                       else np.zeros(BINS, dtype=np.int64) for n in names]) if names else np.zeros((0, BINS))
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: Path) -> "TensorStatistics":
        with np.load(path) as z:  # each z[key] reads and decompresses that array again: once each
            stats = cls(histogram="hist" in z)
            stats.samples = int(z["samples"])
            names, amax, width = z["names"].tolist(), z["amax"], z["width"]
            hists = z["hist"].astype(np.int64) if stats.histogram else None
        for i, name in enumerate(names):
            w = float(width[i])
            hist = hists[i] if hists is not None and w > 0 else None
            stats._state[name] = _TensorState(float(amax[i]), w, hist)
        return stats


def activation_tensors(model: onnx.ModelProto) -> list[str]:
    """Float activations worth a range: the model's float inputs and every float node output."""
    from ..model.graph import Graph

    graph = Graph(model)
    names = list(graph.inputs) + [o for n in graph.nodes for o in n.outputs if o]
    return [t for t in dict.fromkeys(names) if t in graph.tensors and graph.tensors[t].dtype == np.float32]


def observed_model(model: onnx.ModelProto, tensors: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph outputs are ``tensors`` (every activation observed in one run)."""
    from ..model.graph import Graph

    graph = Graph(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.output[:]
    for t in tensors:
        info = graph.tensors[t]
        out.graph.output.append(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, list(info.shape)))
    return out


def session(model: onnx.ModelProto, threads: int | None = 1, optimise: bool = False):
    """A CPU ONNX Runtime session for calibration and checks: single-threaded by default, for :func:`runs` (``None``:
    ONNX Runtime's own thread count); by default no graph optimisation: fusions would hide the tensors we observe."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    if not optimise:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Q/DQ stays Q/DQ (float arithmetic of exactly the rounding TensorRT applies): fused into ONNX Runtime's own
    # integer kernels, an x86 CPU without VNNI saturates their 16-bit intermediate sums (AVX2 VPMADDUBSW), and the
    # check then measures that CPU, not INT8: the demo detector's INT8 scores off by up to 0.84 (0.037 unfused)
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    return ort.InferenceSession(model.SerializeToString(), sess_options=opts, providers=["CPUExecutionProvider"])


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def batched(items: Iterable, n: int) -> Iterator[list]:
    """``items`` in lists of ``n`` (the last may be shorter), taken lazily (``itertools.batched`` from Python 3.12)."""
    group: list = []
    for item in items:
        group.append(item)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group


def runs(sess, outputs: list[str] | None, feeds: Iterable[dict], run: Callable | None = None) -> Iterator[list]:
    """``sess.run(outputs, feed)`` (or ``run(feed)``) for each feed, yielded in the feeds' order, with one run per core
    in flight (``sess`` single-threaded: :func:`session`'s default). At most that many feeds are taken ahead, so a
    caller that folds each result as it comes (the statistics) holds a few samples' activations, not the set's."""
    run = run or (lambda feed: sess.run(outputs, feed))
    workers = cores()
    if workers == 1:
        yield from (run(f) for f in feeds)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="k2edge-calib") as pool:
        pending: deque = deque()
        for feed in feeds:
            pending.append(pool.submit(run, feed))
            if len(pending) >= workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def collect_statistics(model: onnx.ModelProto, batches: Iterable[tuple[np.ndarray, int]], histogram: bool = True,
                       progress: Callable[[int], None] | None = None) -> TensorStatistics:
    """Run ``model`` over ``batches`` ((input batch, real sample count) pairs) and fold every float activation's
    magnitudes into :class:`TensorStatistics`, one batch at a time.

    Raises:
        BuildError: ONNX Runtime cannot run the model.
    """
    tensors = activation_tensors(model)
    sess = session(observed_model(model, tensors))
    input_name = sess.get_inputs()[0].name
    stats = TensorStatistics(histogram)
    counts: deque = deque()

    def feeds():
        for batch, count in batches:
            counts.append(count)
            yield {input_name: batch}

    def run(feed: dict) -> list:
        try:
            return sess.run(tensors, feed)
        except Exception as exc:
            raise BuildError(f"INT8 calibration failed: {type(exc).__name__}: {exc}") from exc

    for values in runs(sess, tensors, feeds(), run):
        count = counts.popleft()
        stats.add(dict(zip(tensors, values)), count)
        if progress is not None:
            progress(count)
    return stats
