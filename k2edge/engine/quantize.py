"""INT8 calibration and FP16 conversion, computed once in Python and reused by both backends.

INT8 produces, from one streaming calibration pass (:mod:`.calibration`) over a calibration set:

* a Q/DQ ONNX model (symmetric INT8, per-channel weights) that ONNX Runtime runs and that
  TensorRT takes for explicit quantisation;
* per-tensor dynamic ranges and a TensorRT calibration cache (``calib.cache``) for the DLA's
  implicit-quantisation route.

The statistics are cached by the model's batch-free identity, the calibration data and the card's
preprocessing, so every batch size of a model shares one calibration; the artefacts are cached by the
statistics, the method and the nodes each applies to.

Range constraints the DLA imposes apply to the layers the plan puts on a DLA, and only there
(:func:`dla_ties`): a GPU or CPU layer keeps its own ranges. Tying them everywhere (what k2edge did up to
QUANT_VERSION 3) gave SiLU's sigmoid the step of its input and broke SiLU detectors.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from ..config.card import ModelCard
from ..errors import BuildError
from ..model.datasets import Dataset
from ..model.graph import Graph
from ..model.ingest import NormalisedModel
from ..tasks.preprocess import Preprocess
from .cache import EngineCache, digest
from .calibration import DEFAULT_PERCENTILE, METHODS, TensorStatistics, collect_statistics

log = logging.getLogger(__name__)

# 2: ranges tied by DLA pooling and elementwise layers are equalised; 3: + card preprocessing, heads kept float;
# 4: ties only for DLA layers, fused Sigmoid/HardSigmoid->Mul gates, streaming statistics, held-out check samples;
# 5: a decoupled detection head's branches (YOLOv8's Detect cv2/cv3) kept in float with the decoding
# 6: only the decoding in float; fallback by sensitivity, learned layers with their quantisers; exact tolerance
# 7: the calibration method picked per model by the check (``auto``); 8: the emulation keeps Q/DQ unfused (a
# decision cached before measured ONNX Runtime's saturating integer kernels, not INT8); 9: a moved layer's output is
# quantised only where an INT8 node reads it, no model output is; 10: the ``mse`` and ``search`` methods (ranges
# searched against the model's output, kept in the decision), artefacts keyed by the settings' own key; 11: a detector's
# float head is its decoding (its branches INT8 unless the check moves them, first when it cannot vouch for them), the
# first fallback ranking searched only as far as it keeps half the INT8 where the second may run, the second run
# where the first keeps under 90 % (was 50 %), runs one per core
QUANT_VERSION = "11"
TRT_CACHE_VERSION = "100300"  # TensorRT 10.3 (JetPack 6.1/6.2) writes this in the cache header
MAX_CALIBRATION_SAMPLES = 512
MAX_SPLIT_SAMPLES = 1280  # of a calibration set, the first 1280 are split: 256 held out, 512 of the rest calibrate
MIN_HELD_OUT_SPLIT = 16  # fewer samples than this: the check runs on the calibration samples themselves

POOLING_OPS = ("MaxPool", "AveragePool")
ELEMENTWISE_OPS = ("Add", "Sub", "Mul", "Max", "Min")
GATE_OPS = ("Sigmoid", "HardSigmoid")
GATE_RANGE = 1.0  # a sigmoid's output range, as qdq-translator gives a Sigmoid feeding a Mul


AUTO = "auto"  # the INT8 check picks the method per model (:func:`candidate_settings`)
SEARCH = "search"  # per-tensor ranges searched against the model's output (:mod:`.range_search`)


@dataclass(frozen=True)
class QuantSettings:
    """How ranges come from the statistics: ``max``, ``percentile`` (of magnitudes, default 99.99) or ``mse``;
    ``search``: per tensor, the candidate that costs the model's output least (:mod:`.range_search`; ``searched``
    holds the result once the search ran); or ``auto``: the INT8 check picks max or percentile per model."""

    method: str = "max"
    percentile: float = DEFAULT_PERCENTILE
    searched: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        if self.method not in METHODS + (SEARCH, AUTO):
            raise BuildError(f"calibration method must be one of {', '.join(METHODS + (SEARCH, AUTO))}, "
                             f"got {self.method!r}")
        if not 50.0 < self.percentile <= 100.0:
            raise BuildError(f"calibration percentile must be within (50, 100], got {self.percentile}")

    def ranges(self, stats: TensorStatistics) -> dict[str, float]:
        """amax per tensor: the statistics' under the method; a search's own ranges over ``max``'s."""
        if self.method == SEARCH:
            if not self.searched:
                raise BuildError("the search method's ranges come from the INT8 check's search, which has not run")
            return {**stats.ranges("max"), **dict(self.searched)}
        return stats.ranges(self.method, self.percentile)

    @property
    def key(self) -> str:
        """What of the settings the artefacts depend on (the cache keys)."""
        return digest(self.method, repr(self.percentile), json.dumps(self.searched))


@dataclass(frozen=True)
class QuantArtefacts:
    """What INT8 calibration produced for one set of devices.

    Attributes:
        dla_nodes: the nodes whose DLA ties these artefacts carry (empty: GPU/CPU ranges only).
        dla: for a model-wise plan with GPU and DLA engines, the DLA engines' artefacts (tied ranges).
    """

    key: str
    qdq_model: Path
    dynamic_ranges: dict[str, float]
    trt_calibration_cache: Path
    samples: int
    cached: bool
    dla_nodes: frozenset = frozenset()
    dla: "QuantArtefacts | None" = None

    def for_device(self, device: str) -> "QuantArtefacts":
        """The artefacts a segment on ``device`` uses."""
        return self.dla if (self.dla is not None and device.startswith("dla")) else self

    @property
    def keys(self) -> str:
        """Every artefact's key, for the keys of what is built from them."""
        return self.key + (f"+{self.dla.key}" if self.dla is not None else "")


# Ops with learned weights end a detector's head (walking back from its output); everything after
# them decodes boxes and must not share one per-tensor INT8 scale with the scores.
_LEARNED_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul"}


def detection_head(graph: Graph, output: str) -> set[str]:
    """The nodes of a detector's head: walking back from ``output`` to the last learned layers.

    A YOLO-style output concatenates box coordinates (0..input size) and class scores (0..1) in
    one tensor, so per-tensor INT8 there destroys the scores, and the box decoding (grid offsets,
    strides, DFL's integral) needs finer steps than INT8 gives. The head is every node from which
    ``output`` is reached without passing a Conv/Gemm/MatMul with weights; a Conv fed by a Softmax
    is YOLOv8's DFL (a fixed integral over the distance bins), part of the decoding.
    """
    head: set[str] = set()
    stack = [output]
    seen: set[str] = set()
    while stack:
        tensor = stack.pop()
        if tensor in seen or tensor not in graph.producer:
            continue
        seen.add(tensor)
        node = graph.nodes[graph.producer[tensor]]
        if node.op_type in _LEARNED_OPS and not _is_dfl(graph, node):
            continue
        head.add(node.name)
        stack.extend(i for i in node.inputs if i and i not in graph.initializers)
    return head


def _is_dfl(graph: Graph, node) -> bool:
    src = graph.producer.get(node.inputs[0])
    return node.op_type == "Conv" and src is not None and graph.nodes[src].op_type == "Softmax"


# Layers a Detect branch is made of between its fork and its last Conv (besides the learned ops and SiLU-like gates).
_BRANCH_UNARY_OPS = {"Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Clip", "Elu", "Selu",
                     "BatchNormalization", "Identity"}
MAX_BRANCH_DEPTH = 16  # steps walked back from a branch's last Conv looking for the fork it shares with a sibling


def _branch_walk(graph: Graph, node) -> tuple[list[str], list[set[str]]]:
    """Walk back from a head's last learned layer along its single activation input: the tensors passed
    (``tensors[i]``) and the node(s) that produce each (``nodes[i]``; a SiLU's Sigmoid and Mul together)."""
    tensors: list[str] = []
    nodes: list[set[str]] = []
    current = node
    for _ in range(MAX_BRANCH_DEPTH):
        inputs = [i for i in current.inputs if i and i not in graph.initializers]
        if len(inputs) != 1:
            break
        tensor = inputs[0]
        tensors.append(tensor)
        if tensor not in graph.producer or tensor in graph.outputs:
            nodes.append(set())
            break
        src = graph.nodes[graph.producer[tensor]]
        if src.op_type in _LEARNED_OPS or src.op_type in _BRANCH_UNARY_OPS:
            nodes.append({src.name})
            current = src
            continue
        gate = _gated(graph, src)
        if gate is None:
            nodes.append(set())
            break
        nodes.append({src.name, gate.name})
        current = gate
    return tensors, nodes


def _gated(graph: Graph, mul):
    """For ``Mul(x, Sigmoid(x))`` (SiLU; HardSwish as HardSigmoid), the gate node; else None."""
    if mul.op_type != "Mul" or len(mul.inputs) != 2:
        return None
    for a, b in (mul.inputs, mul.inputs[::-1]):
        src = graph.producer.get(b)
        if src is not None and graph.nodes[src].op_type in GATE_OPS and graph.nodes[src].inputs[0] == a:
            return graph.nodes[src]
    return None


def detect_branches(graph: Graph, head: set[str]) -> set[str]:
    """The branches of a decoupled detection head (YOLOv8's Detect: ``cv2`` boxes, ``cv3`` classes, per scale),
    found from the graph: the learned layers that feed ``head`` (:func:`detection_head`), each with the chain of
    Conv / activation layers behind it back to the tensor it forks from together with a sibling branch (the
    neck's feature map both the box and the class branch read). A coupled head (one branch per scale, sharing no
    fork with another) gets nothing.

    Kept in float, this is the whole Detect module of an Ultralytics export (``/model.22/`` of YOLOv8n),
    what onnxruntime's ``quantize_static`` gives with that module excluded -- the reference of
    ``tests/fixtures/int8/reference.json`` (NudeNet's YOLOv8n). With the branches in INT8 the weak face of
    ``camera.jpg`` falls from 0.54 to 0.32.
    """
    last = set()
    for name in head:
        node = next(n for n in graph.nodes if n.name == name)
        for t in node.inputs:
            src = graph.producer.get(t)
            if src is not None and graph.nodes[src].name not in head and graph.nodes[src].op_type in _LEARNED_OPS:
                last.add(src)
    walks = {i: _branch_walk(graph, graph.nodes[i]) for i in sorted(last)}
    out: set[str] = set()
    for i, (tensors, nodes) in walks.items():
        others = {t for j, (ts, _) in walks.items() if j != i for t in ts}
        fork = next((k for k, t in enumerate(tensors) if t in others), None)
        if fork is None:
            continue
        out.add(graph.nodes[i].name)
        for group in nodes[:fork]:
            out |= group
    return out


def float_nodes(graph: Graph, card: ModelCard) -> set[str]:
    """Nodes the card keeps out of INT8: a detector's float head (automatically) and ``[quantization] keep_float``.

    The head is the decoding (:func:`detection_head`: DFL, box arithmetic, the final concat, the class sigmoid; of a
    segmentation, pose or obb model, that of every output); with ``float_head = "branches"`` also the decoupled
    branches behind it (:func:`detect_branches`: the whole Detect module of an Ultralytics export, 37 % of
    YOLOv8n's FLOPs). The decoding alone is the default: the branches run INT8 unless the check moves them, and a
    check without the power for a verdict moves them first (:func:`head_branches`; docs/int8.md, "A float head
    only where it pays").

    Raises:
        BuildError: ``keep_float`` names a node the model does not have.
    """
    names = {n.name for n in graph.nodes}
    unknown = [n for n in card.quantization.keep_float if n not in names]
    if unknown:
        raise BuildError(f"{card.source or 'card'}: quantization.keep_float: the model has no node(s) "
                         f"{', '.join(map(repr, unknown[:5]))} (k2edge inspect MODEL lists the node names)")
    head = _decoding(graph, card)
    if card.quantization.float_head == "branches":
        head |= detect_branches(graph, head)
    return set(card.quantization.keep_float) | head


def head_branches(graph: Graph, card: ModelCard) -> set[str]:
    """The decoupled branches of a detection head that the default ``float_head = "decoding"`` plans in INT8, and that
    the build keeps out of INT8 when its check has too few FP32 boxes to vouch for them (empty otherwise)."""
    if card.quantization.float_head != "decoding":
        return set()
    return detect_branches(graph, _decoding(graph, card))


def _decoding(graph: Graph, card: ModelCard) -> set[str]:
    """A box task's decoding: :func:`detection_head` of the card's output (of every output for segmentation, pose and
    obb: mask coefficients, keypoints, angles); empty for other tasks."""
    if card.task == "detection":
        outputs = [card.detection.output_name or graph.outputs[0]]
    elif card.task in ("segmentation", "pose", "obb"):
        outputs = list(graph.outputs)
    else:
        return set()
    head: set[str] = set()
    for output in outputs:
        head |= detection_head(graph, output)
    return head


def calibration_split(n_available: int) -> tuple[list[int], list[int], bool]:
    """Which samples calibrate and which check: (calibration indices, check indices, in_sample).

    Of the first :data:`MAX_SPLIT_SAMPLES`, every fifth (indices 4, 9, 14, ...) is held out for the accuracy
    check (at most 256: enough for a classifier's verdict, which needs 200) and at most
    :data:`MAX_CALIBRATION_SAMPLES` of the others calibrate. With fewer than :data:`MIN_HELD_OUT_SPLIT` the check
    runs in-sample.
    """
    n = min(n_available, MAX_SPLIT_SAMPLES)
    if n < MIN_HELD_OUT_SPLIT:
        every = list(range(n))
        return every, every, True
    return [i for i in range(n) if i % 5 != 4][:MAX_CALIBRATION_SAMPLES], [i for i in range(n) if i % 5 == 4], False


def stage_batches(dataset: Dataset, preprocess: Preprocess, input_shape: tuple[int, ...],
                  indices: list[int] | None = None):
    """Yield (input batch of exactly ``input_shape``, real sample count): a short last batch is padded by
    repeating its last sample, and the count says how many rows are real."""
    batch = input_shape[0]
    samples = [dataset.samples[i] for i in (range(len(dataset)) if indices is None else indices)]
    for start in range(0, len(samples), batch):
        chunk = samples[start:start + batch]
        count = len(chunk)
        chunk += [chunk[-1]] * (batch - len(chunk))
        out = np.empty(input_shape, dtype=np.float32)
        for i, sample in enumerate(chunk):
            preprocess.stage(sample, out=out[i])
        yield out, count


def statistics_key(model: NormalisedModel, dataset: Dataset, preprocess: Preprocess) -> str:
    """The cache key of a model's calibration statistics: the same at every batch size."""
    import onnxruntime

    calib_idx, _, _ = calibration_split(len(dataset))
    return digest("int8-stats", QUANT_VERSION, model.identity, dataset.fingerprint(), repr(calib_idx),
                  preprocess.fingerprint(), onnxruntime.__version__)


def calibration_statistics(model: NormalisedModel, dataset: Dataset, preprocess: Preprocess, cache: EngineCache,
                           progress=None) -> tuple[TensorStatistics, str, int]:
    """Per-tensor statistics of the calibration samples (cached): (statistics, key, samples).

    Keyed by the model's batch-free identity, so every batch size of one model shares one calibration.
    """
    if len(model.graph.inputs) != 1:
        raise BuildError(f"INT8 calibration supports single-input models; this one has {list(model.graph.inputs)}")
    calib_idx, _, _ = calibration_split(len(dataset))
    key = statistics_key(model, dataset, preprocess)

    def build(tmp: Path) -> dict:
        log.info("calibrating INT8 on %d samples from %s", len(calib_idx), dataset.source)
        shape = model.graph.shape(model.graph.inputs[0])
        signatures: list[np.ndarray] = []

        def batches():
            for batch, count in stage_batches(dataset, preprocess, shape, calib_idx):
                signatures.extend(_signature(x) for x in batch[:count])
                yield batch, count

        stats = collect_statistics(model.model, batches(), progress=progress)
        stats.save(tmp / "statistics.npz")
        return {"samples": len(calib_idx), "dataset": dataset.source, "distinct": _distinct(signatures)}

    entry = cache.get_or_build("int8-stats", key, build, what=f"INT8 statistics of {model.source}")
    _warn_about(dataset, len(calib_idx), entry.meta.get("distinct"))
    return TensorStatistics.load(entry.file("statistics.npz")), key, entry.meta.get("samples", len(calib_idx))


MIN_CALIBRATION_SAMPLES = 32  # fewer: ranges from too few scenes (a warning, not an error)


def _signature(sample: np.ndarray) -> np.ndarray:
    """A coarse fingerprint of one staged input (4x4 mean per channel) for spotting near-identical samples."""
    x = np.asarray(sample, dtype=np.float32)
    if x.ndim != 3:
        return np.round(x.reshape(-1)[:64], 2)
    c, h, w = x.shape
    hh, ww = max(h // 4, 1), max(w // 4, 1)
    pooled = x[:, : hh * 4, : ww * 4].reshape(c, 4, hh, 4, ww).mean(axis=(2, 4)) if h >= 4 and w >= 4 else x
    scale = float(np.abs(x).max()) or 1.0
    return np.round(pooled / scale, 2)


def _distinct(signatures: list[np.ndarray]) -> int:
    return len({s.tobytes() for s in signatures})


def _warn_about(dataset: Dataset, n: int, distinct: int | None) -> None:
    """Warn about calibration sets that give untrustworthy ranges (too few, or near-identical samples)."""
    if n < MIN_CALIBRATION_SAMPLES:
        log.warning("calibration set %s: %d sample(s) calibrate INT8 (fewer than %d): ranges from so few scenes may "
                    "clip what the cameras see later; give 100-500 images from the deployment's own cameras",
                    dataset.source, n, MIN_CALIBRATION_SAMPLES)
    if distinct is not None and n >= 4 and distinct <= n // 2:
        log.warning("calibration set %s: only %d of %d calibration samples differ noticeably (near-identical "
                    "frames): the ranges fit one scene; draw frames from varied scenes, light and times of day",
                    dataset.source, distinct, n)


@dataclass(frozen=True)
class DlaTies:
    """What the DLA constrains for the layers a plan puts on it.

    Attributes:
        groups: tensors whose ranges must be equal (pooling input/output; both activation inputs of an
            elementwise layer), each group given its largest range.
        fused: Sigmoid/HardSigmoid -> Mul pairs the DLA runs as one unit (node names): the emulation puts no
            Q/DQ inside the pair, and the calibration cache gives the gate's output range 1.0.
        gates: the gate tensors (the Sigmoid/HardSigmoid outputs) of ``fused``.
    """

    groups: tuple[frozenset[str], ...]
    fused: frozenset[str]
    gates: frozenset[str]


def dla_ties(graph: Graph, dla_nodes: set[str] | frozenset[str], fuse_gates: bool = True) -> DlaTies:
    """The range constraints of the DLA for the nodes in ``dla_nodes`` only (GPU/CPU layers keep their own ranges).

    TensorRT 10.3 ``NvInfer.h``: ``IPoolingLayer`` -- "When running pooling layer with DeviceType::kDLA in Int8
    mode, the dynamic ranges for input and output tensors must be equal"; ``IElementWiseLayer`` -- "When running
    this layer on the DLA with Int8 data type, the dynamic ranges of two input tensors shall be equal. If the
    dynamic ranges are generated using calibrator, the largest value shall be used." No 10.3 source ties a
    Concat's inputs, so Concat is left alone.

    A Sigmoid (or HardSigmoid) whose output feeds only Muls on the DLA (SiLU, HardSwish, squeeze-excite
    gates) is one fused unit there: the DLA has no SiLU and runs it as Sigmoid + elementwise product, fused
    internally at higher precision. Its gate tensor is never held in INT8, so the Mul's tie does not apply to
    it; the cache gives the gate what NVIDIA's Q/DQ-to-DLA translator gives it (Deep-Learning-Accelerator-SW
    ``tools/qdq-translator/qdq_translator.py``, ``infer_unchanged_scales``: a Sigmoid output feeding a Mul gets
    scale 1/127, i.e. range 1.0), and the Mul's other input keeps its own range. We follow qdq-translator rather
    than cuDLA-samples' one scale across Conv, Sigmoid and Mul: it is the tool that turns a Q/DQ model into a
    DLA calibration cache -- k2edge's route -- and 1.0 is the gate's true range whatever the calibration data,
    while one shared scale rounds the gate to the Conv's step (which broke SiLU detectors up to QUANT_VERSION 3).
    """
    dla_nodes = set(dla_nodes)
    fused: set[str] = set()
    gates: set[str] = set()
    for node in graph.nodes:
        if not fuse_gates or node.name not in dla_nodes or node.op_type not in GATE_OPS:
            continue
        users = [graph.nodes[i] for i in graph.consumers.get(node.outputs[0], [])]
        if users and node.outputs[0] not in graph.outputs and all(u.op_type == "Mul" and u.name in dla_nodes for u in users):
            fused.add(node.name)
            fused.update(u.name for u in users)
            gates.add(node.outputs[0])
    parent: dict[str, str] = {}

    def find(t: str) -> str:
        while parent.setdefault(t, t) != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    def tie(tensors) -> None:
        tensors = [t for t in tensors if graph.is_activation(t)]
        for t in tensors[1:]:
            parent[find(t)] = find(tensors[0])

    for node in graph.nodes:
        if node.name not in dla_nodes:
            continue
        if node.op_type in POOLING_OPS:
            tie([node.inputs[0], node.outputs[0]])
        elif node.op_type in ELEMENTWISE_OPS and not (node.name in fused and gates & set(node.inputs)):
            tie(list(node.inputs))
    groups: dict[str, set[str]] = {}
    for t in parent:
        groups.setdefault(find(t), set()).add(t)
    return DlaTies(tuple(frozenset(g) for g in groups.values() if len(g) > 1), frozenset(fused), frozenset(gates))


def tie_ranges(ranges: dict[str, float], ties: DlaTies) -> dict[str, float]:
    """``ranges`` with every tied group at its largest range and every fused gate at 1.0 (the DLA cache's view)."""
    out = dict(ranges)
    for group in ties.groups:
        present = [t for t in group if t in out]
        if len(present) > 1:
            amax = max(out[t] for t in present)
            out.update({t: amax for t in present})
    out.update({t: GATE_RANGE for t in ties.gates if t in out})
    return out


def quantize_qdq(model: NormalisedModel, ranges: dict[str, float], exclude_nodes, dest: Path) -> None:
    """Write the Q/DQ model of ``model`` with exactly ``ranges`` (symmetric, per-channel weights) to ``dest``.

    ONNX Runtime's ``quantize_static`` does the rewriting; its calibration step is replaced by our ranges
    through its JSON range cache (``calibration_cache_path``), so both agree on how a range becomes a scale.
    """
    from onnxruntime.quantization import CalibrationMethod, quantize_static
    from onnxruntime.quantization.calibrate import TensorData, TensorsData, save_tensors_data

    tmp = dest.parent
    ranges_file = tmp / "ort_ranges.json"
    data = {t: TensorData(lowest=np.array(-a, dtype=np.float32), highest=np.array(a, dtype=np.float32))
            for t, a in ranges.items()}
    save_tensors_data(TensorsData(CalibrationMethod.MinMax, data), ranges_file)
    source = tmp / "input.onnx"
    # quantize_static rewrites a ModelProto it is given to external data in a temporary directory;
    # hand it a file so the normalised model in memory stays intact.
    source.write_bytes(model.serialized)
    quiet = logging.getLogger()
    level = quiet.level
    quiet.setLevel(max(level, logging.ERROR))  # the quantiser warns about pre-processing we already did
    try:
        quantize_static(str(source), str(dest), None, **ort_settings(), nodes_to_exclude=sorted(exclude_nodes),
                        calibration_cache_path=str(ranges_file))
    except Exception as exc:
        raise BuildError(f"INT8 quantisation failed: {type(exc).__name__}: {exc}") from exc
    finally:
        quiet.setLevel(level)
        source.unlink(missing_ok=True)
        ranges_file.unlink(missing_ok=True)


def drop_qdq(model: onnx.ModelProto, tensors) -> onnx.ModelProto:
    """``model`` without the QuantizeLinear -> DequantizeLinear pairs on ``tensors`` (a tensor TensorRT never
    materialises): their readers read the tensor itself again."""
    tensors = set(tensors)
    graph_outputs = {o.name for o in model.graph.output}
    nodes = list(model.graph.node)
    readers: dict[str, list] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    drop = set()
    for q in nodes:
        if q.op_type != "QuantizeLinear" or q.input[0] not in tensors:
            continue
        dqs = readers.get(q.output[0], [])
        if not dqs or any(d.op_type != "DequantizeLinear" or d.output[0] in graph_outputs for d in dqs):
            continue
        for dq in dqs:
            for r in readers.get(dq.output[0], []):
                for k, name in enumerate(r.input):
                    if name == dq.output[0]:
                        r.input[k] = q.input[0]
            drop.add(id(dq))
        drop.add(id(q))
    kept = [n for n in nodes if id(n) not in drop]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model


LEARNED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def learned_layers(graph: Graph) -> list[str]:
    """The layers with learned weights (a Conv, ConvTranspose, Gemm or MatMul with an initializer weight), in
    graph order: what runs as an INT8 kernel when its input and weight are quantised."""
    return [n.name for n in graph.nodes if n.op_type in LEARNED_OPS and len(n.inputs) > 1 and n.inputs[1] in graph.initializers]


# pointwise layers TensorRT fuses into the learned layer before them (its epilogue): their Q/DQ belong to it
_EPILOGUE_OPS = {"BatchNormalization", "Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Elu",
                 "Selu", "Tanh", "Identity"}


def fallback_units(graph: Graph, candidates) -> dict[str, tuple[str, ...]]:
    """What moves out of INT8 together: each learned layer in ``candidates`` with its epilogue (the BatchNorm and
    activation after it, a SiLU's Sigmoid and Mul, a HardSwish's Add/Clip/Mul/Div by constants), and each other
    candidate that reads an activation alone. Key: the unit's first node."""
    candidates = [c for c in candidates]
    wanted = set(candidates)
    nodes = {n.name: n for n in graph.nodes}
    taken: set[str] = set()
    units: dict[str, tuple[str, ...]] = {}
    learned = set(learned_layers(graph))
    for name in candidates:
        if name in learned:
            unit = [name] + [n for n in _epilogue(graph, nodes[name]) if n in wanted]
            units[name] = tuple(unit)
            taken.update(unit)
    for name in candidates:
        if name not in taken and any(graph.is_activation(i) for i in nodes[name].inputs if i):
            units[name] = (name,)
    return units


def _epilogue(graph: Graph, node) -> list[str]:
    """The pointwise chain after a learned layer that only it feeds (see :func:`fallback_units`)."""
    out: list[str] = []
    tensor = node.outputs[0]
    for _ in range(8):
        readers = [graph.nodes[i] for i in graph.consumers.get(tensor, [])]
        if tensor in graph.outputs or not readers:
            break
        if len(readers) == 1 and _pointwise(graph, readers[0]):
            taken = [readers[0]]
        elif len(readers) == 2 and any(r.op_type == "Mul" for r in readers):  # x * g(x): SiLU, HardSwish
            mul = next(r for r in readers if r.op_type == "Mul")
            other = next(r for r in readers if r is not mul)
            chain = _chain_to(graph, other, mul)
            if chain is None or set(mul.inputs) != {tensor, graph.by_name[chain[-1]].outputs[0]}:
                break
            taken = [graph.by_name[n] for n in chain] + [mul]
        else:
            break
        out += [r.name for r in taken]
        tensor = taken[-1].outputs[0]
    return out


def _pointwise(graph: Graph, node) -> bool:
    """One activation input, elementwise: an activation, a BatchNorm, or arithmetic with a constant."""
    acts = [i for i in node.inputs if i and graph.is_activation(i)]
    return len(acts) == 1 and (node.op_type in _EPILOGUE_OPS or node.op_type in ("Add", "Sub", "Mul", "Div"))


def _chain_to(graph: Graph, start, end) -> list[str] | None:
    """Single-reader pointwise nodes from ``start`` to the one that feeds ``end`` (a SiLU's Sigmoid; a HardSwish's
    Add, Clip and Div), or None."""
    chain = []
    node = start
    for _ in range(4):
        if not _pointwise(graph, node):
            return None
        chain.append(node.name)
        readers = [graph.nodes[i] for i in graph.consumers.get(node.outputs[0], [])]
        if readers == [end]:
            return chain
        if len(readers) != 1:
            return None
        node = readers[0]
    return None


def qdq_int8_layers(qdq: onnx.ModelProto, names) -> set[str]:
    """Of the learned layers ``names``, those the Q/DQ model ``qdq`` runs in INT8: every input -- the activation
    and the weight -- comes out of a DequantizeLinear (what TensorRT fuses into an INT8 kernel; a bias is
    folded whatever it is)."""
    dq_out = {o for n in qdq.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    wanted = set(names)
    return {n.name for n in qdq.graph.node
            if n.name in wanted and all(i in dq_out for i in list(n.input)[:2] if i)}


def unquantise_layers(qdq: onnx.ModelProto, original: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of ``qdq`` with the learned layers ``names`` back in float together with their quantisers: each
    reads its activation before the Q/DQ pair (other readers of that pair keep it) and its weight and bias as the
    original float initializers. Its output keeps whatever Q/DQ its readers put on it. Fast: a graph edit, not a
    new quantisation (the fallback's sensitivity measures one model per learned layer)."""
    names = set(names)
    out = onnx.ModelProto()
    out.CopyFrom(qdq)
    producer = {o: n for n in out.graph.node for o in n.output}
    floats = {t.name: t for t in original.graph.initializer}
    have = {t.name for t in out.graph.initializer}
    for node in out.graph.node:
        if node.name not in names:
            continue
        for k, name in enumerate(node.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            src = dq.input[0]
            q = producer.get(src)
            if q is not None and q.op_type == "QuantizeLinear":
                node.input[k] = q.input[0]  # the activation as the layer before wrote it
                continue
            orig = src[: -len("_quantized")] if src.endswith("_quantized") else None
            if orig in floats:  # a quantised weight or bias: the float original, under a name of its own
                fname = f"{orig}/float"
                if fname not in have:
                    t = onnx.TensorProto()
                    t.CopyFrom(floats[orig])
                    t.name = fname
                    out.graph.initializer.append(t)
                    have.add(fname)
                node.input[k] = fname
    return _without_orphans(out)


def round_fp16(model: onnx.ModelProto, tensors) -> onnx.ModelProto:
    """``model`` with each of ``tensors`` rounded to FP16 as a layer running FP16 stores it: a Cast(float16) ->
    Cast(float) pair after its producer feeds every reader (Q/DQ readers included: they quantise the rounded
    value). The arithmetic stays FP32 on a CPU."""
    tensors = set(tensors) - {o.name for o in model.graph.output}
    nodes = list(model.graph.node)
    readers: dict[str, list] = {}
    for r in nodes:
        for k, name in enumerate(r.input):
            if name in tensors:
                readers.setdefault(name, []).append((r, k))
    out = []
    for n in nodes:
        out.append(n)
        for t in n.output:
            if t not in tensors:
                continue
            half, back = f"{t}/fp16", f"{t}/fp16_rounded"
            for r, k in readers.get(t, ()):
                r.input[k] = back
            out.append(onnx.helper.make_node("Cast", [t], [half], to=onnx.TensorProto.FLOAT16, name=f"{t}/to_fp16"))
            out.append(onnx.helper.make_node("Cast", [half], [back], to=onnx.TensorProto.FLOAT, name=f"{t}/from_fp16"))
    del model.graph.node[:]
    model.graph.node.extend(out)
    return model


def _without_orphans(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without Q/DQ nodes nothing reads any more."""
    outputs = {o.name for o in model.graph.output}
    while True:
        read = {i for n in model.graph.node for i in n.input} | outputs
        dead = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
                and not any(o in read for o in n.output)]
        if not dead:
            return model
        for n in dead:
            model.graph.node.remove(n)


def conv_bn_outputs(graph: Graph) -> set[str]:
    """Convolution outputs read only by a BatchNormalization: TensorRT fuses the two ("Convolution and Scale" in its
    layer-fusion catalogue; the ONNX parser imports BatchNormalization as a scale layer), so the tensor between them
    is never rounded to INT8 on the device, and the emulation must not round it either."""
    out = set()
    for node in graph.nodes:
        if node.op_type not in ("Conv", "ConvTranspose"):
            continue
        t = node.outputs[0]
        readers = [graph.nodes[i] for i in graph.consumers.get(t, [])]
        if readers and t not in graph.outputs and all(r.op_type == "BatchNormalization" for r in readers):
            out.add(t)
    return out


def ort_settings():
    """The quantize_static settings k2edge uses (for tests that compare with plain ONNX Runtime)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

    return dict(
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
        # TensorRT takes symmetric INT8 only (zero point 0), for activations and weights.
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )


def base_qdq(model: NormalisedModel, stats: TensorStatistics, settings: QuantSettings, exclude_nodes, keep_float,
             ties: "DlaTies", dest: Path) -> onnx.ModelProto:
    """The all-INT8 Q/DQ model of one variant (no fallback yet): tied ranges, each fused gate pair left in float
    (the DLA does not round inside it), the planned non-INT8 and the card's float nodes excluded."""
    emulated = {t: a for t, a in tie_ranges(settings.ranges(stats), ties).items()
                if t not in ties.gates}
    quantize_qdq(model, emulated, set(exclude_nodes) | set(keep_float) | set(ties.fused), dest)
    return onnx.load(str(dest))


def finish_qdq(base: onnx.ModelProto, model: NormalisedModel, fallback_nodes=(), float_nodes=()) -> onnx.ModelProto:
    """``base`` (:func:`base_qdq`, left intact) with ``fallback_nodes`` moved out of INT8 with their quantisers
    (:func:`unquantise_layers`), their outputs rounded to FP16 and quantised only where an INT8 node reads them
    (:func:`float_read_tensors`; ``float_nodes``: the plan's non-INT8 nodes and the card's float ones), no Q/DQ
    between a Conv and the BatchNorm TensorRT fuses into it (:func:`conv_bn_outputs`), and none on a model output.
    An INT8 node's output keeps the Q/DQ the quantiser gave it: TensorRT writes it in INT8."""
    graph = model.graph
    qdq = unquantise_layers(base, model.model, fallback_nodes)  # a copy, even with nothing to move
    moved = {o for node in graph.nodes if node.name in set(fallback_nodes) for o in node.outputs}
    if fallback_nodes:
        qdq = round_fp16(qdq, moved)
    moved |= {f"{o}/fp16_rounded" for o in moved}
    float_read = float_read_tensors(qdq, set(float_nodes) | set(fallback_nodes)) & moved
    return _without_output_qdq(drop_qdq(qdq, conv_bn_outputs(graph) | float_read))


def float_read_tensors(qdq: onnx.ModelProto, float_nodes) -> set[str]:
    """The tensors whose Q/DQ pair only ``float_nodes`` read.

    ``quantize_static`` quantises the output of an INT8 elementwise node whoever reads it. When the fallback moves
    that node out of INT8, the pair kept rounding its output before the nodes the plan keeps in float (a
    HardSwish's division, a HardSigmoid), and TensorRT, which honours every Q/DQ it is given, would round it too:
    on PP-OCRv4's DBNet, 34 such pairs held the map's cosine to FP32 at 0.95 with every learned layer moved out
    of INT8, so no fallback could reach the check's tolerance.
    """
    float_nodes = set(float_nodes)
    readers: dict[str, list] = {}
    for n in qdq.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    out = set()
    for q in qdq.graph.node:
        if q.op_type != "QuantizeLinear":
            continue
        dqs = readers.get(q.output[0], [])
        final = [r for d in dqs for r in readers.get(d.output[0], [])]
        if dqs and final and all(d.op_type == "DequantizeLinear" for d in dqs) and all(r.name in float_nodes for r in final):
            out.add(q.input[0])
    return out


def _without_output_qdq(qdq: onnx.ModelProto) -> onnx.ModelProto:
    """``qdq`` without a Q/DQ pair that ends in a model output (the output of PP-OCRv4's DBNet's final Sigmoid, its
    probability map, came out rounded to INT8 steps of 1/127): the producer writes the output itself, as a layer
    the plan ends with writes its output in float."""
    outputs = {o.name for o in qdq.graph.output}
    producer = {o: n for n in qdq.graph.node for o in n.output}
    drop = set()
    for dq in qdq.graph.node:
        if dq.op_type != "DequantizeLinear" or dq.output[0] not in outputs:
            continue
        q = producer.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear" or q.input[0] not in producer:
            continue
        inner = q.input[0]
        if sum(inner in n.input for n in qdq.graph.node) != 1 or sum(q.output[0] in n.input for n in qdq.graph.node) != 1:
            continue  # the inner tensor or the quantised one has other readers: keep the pair
        src = producer[inner]
        src.output[list(src.output).index(inner)] = dq.output[0]
        drop |= {id(q), id(dq)}
    if drop:
        kept = [n for n in qdq.graph.node if id(n) not in drop]
        del qdq.graph.node[:]
        qdq.graph.node.extend(kept)
    return qdq


def variant_files(model: NormalisedModel, stats: TensorStatistics, dest: Path, settings: QuantSettings,
                  exclude_nodes, keep_float, ties: "DlaTies", fallback_nodes=()) -> dict:
    """Write one variant's ``qdq.onnx``, ``dynamic_ranges.json`` and ``calib.cache`` into ``dest``.

    Args:
        ties: the DLA's constraints on this variant's DLA layers (:func:`dla_ties`; none for a GPU/CPU variant).
        keep_float: nodes the card keeps out of INT8 (a detector's decoding): excluded, and their outputs get no
            range (TensorRT runs them in FP16, and so does the DLA).
        fallback_nodes: layers the INT8 check moved out of INT8, each with its quantisers (:func:`finish_qdq`):
            float weight, float input; an output keeps its range and its Q/DQ wherever an INT8 reader needs them,
            so the next Conv stays INT8.

    Returns:
        what the variant holds, for the cache's metadata.
    """
    graph = model.graph
    base = base_qdq(model, stats, settings, exclude_nodes, keep_float, ties, dest / "qdq.onnx")
    onnx.save(finish_qdq(base, model, fallback_nodes, set(exclude_nodes) | set(keep_float)), str(dest / "qdq.onnx"))
    moved = set(keep_float) | set(fallback_nodes)
    # no range where no INT8 layer reads: the card's float layers' outputs, and a moved layer's unless an INT8
    # layer reads it (then the range keeps that reader INT8)
    float_tensors = {o for node in graph.nodes if node.name in set(keep_float) for o in node.outputs}
    float_tensors |= {o for node in graph.nodes if node.name in set(fallback_nodes) for o in node.outputs
                      if all(graph.nodes[i].name in moved for i in graph.consumers.get(o, []))}
    trt = {k: v for k, v in tie_ranges(settings.ranges(stats), ties).items()
           if k not in float_tensors}
    (dest / "dynamic_ranges.json").write_text(json.dumps(trt, indent=1, sort_keys=True))
    write_trt_calibration_cache(dest / "calib.cache", trt)
    return {"tied_groups": len(ties.groups), "fused_gates": len(ties.gates), "fallback": sorted(fallback_nodes)}


def quant_variant(model: NormalisedModel, stats: TensorStatistics, stats_key: str, cache: EngineCache,
                  settings: QuantSettings, exclude_nodes, keep_float, dla_nodes, samples: int,
                  fallback_nodes=()) -> QuantArtefacts:
    """One set of INT8 artefacts from shared statistics, through the cache (see :func:`variant_files`); the DLA's
    ties apply to ``dla_nodes`` only."""
    import onnxruntime

    excluded = sorted(set(exclude_nodes) | set(keep_float))
    scope = set(dla_nodes)
    key = digest("int8", QUANT_VERSION, model.sha256, stats_key, settings.key,
                 ",".join(excluded), ",".join(sorted(keep_float)), digest(*sorted(scope)), ",".join(sorted(fallback_nodes)),
                 onnxruntime.__version__)

    def build(tmp: Path) -> dict:
        meta = variant_files(model, stats, tmp, settings, exclude_nodes, keep_float, dla_ties(model.graph, scope),
                             fallback_nodes)
        return {"samples": samples, "dla_nodes": len(scope), **meta}

    what = f"Q/DQ INT8 of {model.source}" + (f" ({len(scope)} DLA node(s) tied)" if scope else "")
    entry = cache.get_or_build("int8", key, build, what=what)
    ranges = json.loads(entry.file("dynamic_ranges.json").read_text())
    return QuantArtefacts(key, entry.file("qdq.onnx"), ranges, entry.file("calib.cache"), samples, entry.hit,
                          frozenset(scope))


def plan_dla_nodes(plan) -> tuple[frozenset[str], bool]:
    """The nodes a plan runs on a DLA (minus what a DLA engine hands to the GPU), and whether the same nodes
    also run on the GPU (a model-wise plan with both a GPU and DLA engines: two artefacts)."""
    dla = set()
    gpu_too = False
    for seg in plan.segments:
        if seg.kind == "dla":
            dla.update(set(seg.nodes) - set(seg.gpu_fallback_nodes))
    if plan.is_model_wise:
        gpu_too = any(s.kind == "gpu" for s in plan.segments) and bool(dla)
    return frozenset(dla), gpu_too


def write_trt_calibration_cache(path: Path, dynamic_ranges: dict[str, float], version: str = TRT_CACHE_VERSION) -> None:
    """Write a TensorRT INT8 calibration cache: one ``name: <big-endian float32 scale hex>`` per tensor.

    The scale is amax / 127 (symmetric INT8), the form IInt8EntropyCalibrator2 caches and the DLA
    route reads back through ``read_calibration_cache``.
    """
    lines = [f"TRT-{version}-EntropyCalibration2"]
    for name in sorted(dynamic_ranges):
        scale = max(dynamic_ranges[name], 1e-12) / 127.0
        lines.append(f"{name}: {struct.pack('!f', scale).hex()}")
    path.write_text("\n".join(lines) + "\n")


def read_trt_calibration_cache(path: Path) -> dict[str, float]:
    """Parse a calibration cache back into per-tensor amax values."""
    out = {}
    for line in Path(path).read_text().splitlines()[1:]:
        name, _, hexscale = line.rpartition(": ")
        if name:
            out[name] = struct.unpack("!f", bytes.fromhex(hexscale.strip()))[0] * 127.0
    return out


FP16_MAX = 65504.0


def quantised_at_entry(fp16: onnx.ModelProto, qdq: onnx.ModelProto) -> onnx.ModelProto:
    """``fp16`` (a segment of the FP32 model converted by :func:`to_fp16`, FP32 at its inputs) with each input that
    ``qdq`` quantises on its way to the segment's nodes quantised the same way on entry (a QuantizeLinear /
    DequantizeLinear pair with ``qdq``'s scale and zero point, before the cast to FP16).

    Why: an FP16 segment between two INT8 ones (under c4, PP-OCR's HardSwish ``Div`` on the GPU between DLA segments)
    reads a tensor the INT8 segment before it gives out as INT8 -- what the Q/DQ model and so the INT8 check compute.
    Extracted from the FP32 model alone it read the unrounded value, and the c4 engine agreed with the check's
    emulation on 0.9875 of 400 text lines instead of all of them.
    """
    g = qdq.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    names = {n.name for n in fp16.graph.node}
    entries = {i.name for i in fp16.graph.input}
    found: dict[str, onnx.NodeProto] = {}  # segment input -> the QuantizeLinear qdq applies to it
    for node in g.node:
        if node.name not in names:
            continue
        for t in node.input:
            dq = producer.get(t)
            q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            if q is not None and q.op_type == "QuantizeLinear" and q.input[0] in entries:
                found[q.input[0]] = q
    if not found:
        return fp16
    out = onnx.ModelProto()
    out.CopyFrom(fp16)
    added, have = [], {i.name for i in out.graph.initializer}
    for t, q in sorted(found.items()):
        for node in out.graph.node:
            node.input[:] = [f"{t}/entry_dq" if i == t else i for i in node.input]
        added += [onnx.helper.make_node("QuantizeLinear", list(q.input), [f"{t}/entry_q"], name=f"{t}/entry_QuantizeLinear"),
                  onnx.helper.make_node("DequantizeLinear", [f"{t}/entry_q"] + list(q.input[1:]), [f"{t}/entry_dq"],
                                        name=f"{t}/entry_DequantizeLinear")]
        for name in q.input[1:]:
            if name and name not in have:
                out.graph.initializer.append(inits[name])
                have.add(name)
    nodes = added + list(out.graph.node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def to_fp16(model: onnx.ModelProto, keep_fp32=()) -> onnx.ModelProto:
    """FP16 weights and activations inside (except the nodes of ``keep_fp32``), FP32 at the model's inputs and
    outputs; every BatchNormalization's parameters folded first (:func:`fold_batch_norm_params`)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = fold_batch_norm_params(model)
    if keep_fp32:
        return convert_float_to_float16(model, keep_io_types=True, node_block_list=list(keep_fp32))
    return convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False)


def fold_batch_norm_params(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each BatchNormalization's four parameters folded, in float64, into a scale and a shift (as
    ``scale``/``B``, with mean 0, variance 1 and epsilon 0): the same function, node for node.

    Why: converting the parameters to FP16 one by one clamps any above 65504. PP-OCRv4's DBNet has a running
    variance of 9.8e7 in its head; clamped, that channel came out 39 times too large and the FP16 engine's map
    had a cosine of 0.38-0.81 to FP32's. TensorRT folds a BatchNorm into its Conv in FP32 before it converts
    the weights; this does the same for the BatchNorm alone. A BatchNorm whose parameters are not initializers
    is left as it is.
    """
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, int] = {}
    for n in graph.node:
        for t in n.input:
            readers[t] = readers.get(t, 0) + 1
    added, dropped = [], set()
    for node in graph.node:
        if node.op_type != "BatchNormalization" or len(node.output) != 1 or any(t not in inits for t in node.input[1:5]):
            continue
        gamma, beta, mean, var = (numpy_helper.to_array(inits[t]).astype(np.float64) for t in node.input[1:5])
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        scale = gamma / np.sqrt(var + eps)
        shift = beta - mean * scale
        names = [f"{node.name or node.output[0]}/folded_{k}" for k in ("scale", "shift", "mean", "var")]
        for name, value in zip(names, (scale, shift, np.zeros_like(mean), np.ones_like(var))):
            added.append(numpy_helper.from_array(value.astype(np.float32), name))
        for t in node.input[1:5]:
            readers[t] -= 1
            if readers[t] == 0:
                dropped.add(t)
        node.input[1:5] = names
        for a in node.attribute:
            if a.name == "epsilon":
                a.f = 0.0
        if not any(a.name == "epsilon" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("epsilon", 0.0))
    keep = [i for i in graph.initializer if i.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(keep + added)
    return out


def candidate_settings(settings: QuantSettings) -> tuple[QuantSettings, ...]:
    """The methods a check tries, in order: ``auto`` tries ``max`` first and ``percentile`` when max misses the
    tolerance (a tie keeps max); a named method is the only one. The range search is not part of ``auto``: on
    NudeNet's YOLOv8n with its Detect module in float it added about 400 s to the build and ``auto`` still kept
    percentile (docs/int8.md, "Range search")."""
    if settings.method != AUTO:
        return (settings,)
    return replace(settings, method="max"), replace(settings, method="percentile")


def quant_settings(edge_runtime=None, card: ModelCard | None = None) -> QuantSettings:
    """The calibration settings: the card's ``[quantization]`` over the profile's ``edge_runtime.calibration``."""
    method, percentile = AUTO, DEFAULT_PERCENTILE
    for layer in (getattr(edge_runtime, "calibration", None), getattr(card, "quantization", None)):
        if layer is None:
            continue
        method = getattr(layer, "method", None) or method
        percentile = getattr(layer, "percentile", None) or percentile
    return QuantSettings(method, percentile)
