"""INT8 calibration and FP16 conversion, computed once in Python and reused by both backends.

INT8 produces, from one calibration pass over a calibration set:

* a Q/DQ ONNX model (symmetric INT8, per-channel weights) that ONNX Runtime runs and that
  TensorRT takes for explicit quantisation;
* per-tensor dynamic ranges and a TensorRT calibration cache (``calib.cache``) for the DLA's
  implicit-quantisation route.

Both are stored in the engine cache keyed by the model, the calibration data and the settings,
so a second build does no calibration.

Ranges the DLA needs equal are made equal before either artefact is written: "When running pooling
layer with DeviceType::kDLA in Int8 mode, the dynamic ranges for input and output tensors must be
equal", and for an elementwise layer "the dynamic ranges of two input tensors shall be equal. If the
dynamic ranges are generated using calibrator, the largest value shall be used" [TensorRT 10.3
``NvInfer.h``, ``IPoolingLayer`` / ``IElementWiseLayer``]. The largest range of each group of tied tensors
goes to all of them, in the calibration cache and in the Q/DQ model's scales alike, so the CPU path
measures the accuracy the DLA will have.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
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

log = logging.getLogger(__name__)

QUANT_VERSION = "3"  # 2: ranges tied by DLA pooling and elementwise layers are equalised; 3: + card preprocessing, heads kept float
TRT_CACHE_VERSION = "100300"  # TensorRT 10.3 (JetPack 6.1/6.2) writes this in the cache header
MAX_CALIBRATION_SAMPLES = 512


@dataclass(frozen=True)
class QuantArtefacts:
    """What INT8 calibration produced."""

    key: str
    qdq_model: Path
    dynamic_ranges: dict[str, float]
    trt_calibration_cache: Path
    samples: int
    cached: bool


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


def float_nodes(graph: Graph, card: ModelCard) -> set[str]:
    """Nodes the card keeps out of INT8: a detector's head (automatically) and ``[quantization] keep_float``.

    Raises:
        BuildError: ``keep_float`` names a node the model does not have.
    """
    names = {n.name for n in graph.nodes}
    unknown = [n for n in card.quantization.keep_float if n not in names]
    if unknown:
        raise BuildError(f"{card.source or 'card'}: quantization.keep_float: the model has no node(s) "
                         f"{', '.join(map(repr, unknown[:5]))} (k2edge inspect MODEL lists the node names)")
    keep = set(card.quantization.keep_float)
    if card.task == "detection":
        keep |= detection_head(graph, card.detection.output_name or graph.outputs[0])
    elif card.task in ("segmentation", "pose", "obb"):  # every output: mask coefficients, keypoints, angles
        for output in graph.outputs:
            keep |= detection_head(graph, output)
    return keep


def stage_batches(dataset: Dataset, preprocess: Preprocess, input_shape: tuple[int, ...], limit: int | None = None):
    """Yield input batches of exactly ``input_shape`` (the last one padded by repeating samples)."""
    batch = input_shape[0]
    samples = list(dataset.samples[: limit or len(dataset)])
    if not samples:
        return
    for start in range(0, len(samples), batch):
        chunk = samples[start:start + batch]
        chunk += [chunk[-1]] * (batch - len(chunk))
        out = np.empty(input_shape, dtype=np.float32)
        for i, sample in enumerate(chunk):
            preprocess.stage(sample, out=out[i])
        yield out


def calibrate_int8(
    model: NormalisedModel,
    dataset: Dataset,
    preprocess: Preprocess,
    cache: EngineCache,
    exclude_nodes: tuple[str, ...] = (),
    keep_float: tuple[str, ...] = (),
) -> QuantArtefacts:
    """Calibrate ``model`` on ``dataset`` and quantise it to Q/DQ INT8 (cached).

    Inputs are staged by ``preprocess`` (the model card's), exactly as at inference.

    Args:
        exclude_nodes: nodes the plan keeps out of INT8 (they stay float in the Q/DQ model).
        keep_float: nodes the card keeps out of INT8 (:func:`float_nodes`): also excluded, and
            their outputs get no range in the TensorRT calibration cache, so the DLA route runs
            them in FP16 as well.

    Raises:
        BuildError: the model has more than one input, or calibration fails.
    """
    import onnxruntime

    inputs = model.graph.inputs
    if len(inputs) != 1:
        raise BuildError(f"INT8 calibration supports single-input models; this one has {list(inputs)}")
    input_name = inputs[0]
    input_shape = model.graph.shape(input_name)
    n = min(len(dataset), MAX_CALIBRATION_SAMPLES)
    excluded = sorted(set(exclude_nodes) | set(keep_float))
    float_tensors = {o for node in model.graph.nodes if node.name in set(keep_float) for o in node.outputs}
    key = digest("int8", QUANT_VERSION, model.sha256, dataset.fingerprint(), str(n), ",".join(excluded),
                 ",".join(sorted(keep_float)), preprocess.fingerprint(), onnxruntime.__version__)

    def build(tmp: Path) -> dict:
        from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

        log.info("calibrating INT8 on %d samples from %s", n, dataset.source)

        class _Reader(CalibrationDataReader):
            def __init__(self):
                self._it = ({input_name: b} for b in stage_batches(dataset, preprocess, input_shape, n))

            def get_next(self):
                return next(self._it, None)

        ranges_file = tmp / "ort_ranges.json"
        quiet = logging.getLogger()
        level = quiet.level
        quiet.setLevel(max(level, logging.ERROR))  # the quantiser warns about pre-processing we already did
        # quantize_static rewrites a ModelProto it is given to external data in a temporary
        # directory; hand it a file so the normalised model in memory stays intact.
        source = tmp / "input.onnx"
        source.write_bytes(model.serialized)
        settings = dict(
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=excluded,
            calibrate_method=CalibrationMethod.MinMax,
            calibration_cache_path=str(ranges_file),
            # TensorRT takes symmetric INT8 only (zero point 0), for activations and weights.
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
        )
        try:
            # pass 1 calibrates and writes the ranges; they are equalised; pass 2 quantises from the cache
            quantize_static(str(source), str(tmp / "unequalised.onnx"), _Reader(), **settings)
            equalise_ort_ranges(ranges_file, tied_tensors(model.graph))
            quantize_static(str(source), str(tmp / "qdq.onnx"), None, **settings)
        except Exception as exc:
            raise BuildError(f"INT8 calibration failed: {type(exc).__name__}: {exc}") from exc
        finally:
            quiet.setLevel(level)
            source.unlink(missing_ok=True)
            (tmp / "unequalised.onnx").unlink(missing_ok=True)
        ranges = {k: v for k, v in _amax_from_ort_ranges(ranges_file).items() if k not in float_tensors}
        (tmp / "dynamic_ranges.json").write_text(json.dumps(ranges, indent=1, sort_keys=True))
        write_trt_calibration_cache(tmp / "calib.cache", ranges)
        return {"samples": n, "dataset": dataset.source}

    entry = cache.get_or_build("int8", key, build, what=f"Q/DQ INT8 of {model.source}")
    ranges = json.loads(entry.file("dynamic_ranges.json").read_text())
    return QuantArtefacts(key, entry.file("qdq.onnx"), ranges, entry.file("calib.cache"), entry.meta.get("samples", n), entry.hit)


POOLING_OPS = ("MaxPool", "AveragePool")
ELEMENTWISE_OPS = ("Add", "Sub", "Mul", "Max", "Min")


def tied_tensors(graph) -> list[set[str]]:
    """Groups of activations whose INT8 ranges the DLA needs equal (pooling in/out, elementwise inputs).

    Args:
        graph: the normalised model's :class:`~k2edge.model.graph.Graph`.
    """
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
        if node.op_type in POOLING_OPS:
            tie([node.inputs[0], node.outputs[0]])
        elif node.op_type in ELEMENTWISE_OPS:
            tie(list(node.inputs))
    groups: dict[str, set[str]] = {}
    for t in parent:
        groups.setdefault(find(t), set()).add(t)
    return [g for g in groups.values() if len(g) > 1]


def equalise_ort_ranges(path: Path, groups: list[set[str]]) -> int:
    """Give every tensor of each group the group's largest symmetric range, in ONNX Runtime's range cache.

    Returns:
        how many tensors got a wider range.
    """
    from onnxruntime.quantization.calibrate import TensorData, TensorsData, load_tensors_data, save_tensors_data

    data = load_tensors_data(path)
    ranges = dict(data.data)
    widened = 0
    for group in groups:
        present = [t for t in group if t in ranges]
        if len(present) < 2:
            continue
        amax = max(float(np.abs(np.asarray(v, dtype=np.float64)).max()) for t in present for v in ranges[t].range_value)
        for t in present:
            lo, hi = ranges[t].range_value
            dtype = np.asarray(hi).dtype
            if float(np.abs(np.asarray(lo)).max()) < amax or float(np.abs(np.asarray(hi)).max()) < amax:
                widened += 1
            ranges[t] = TensorData(lowest=np.array(-amax, dtype=dtype), highest=np.array(amax, dtype=dtype))
    save_tensors_data(TensorsData(data.calibration_method, ranges), path)
    return widened


def _amax_from_ort_ranges(path: Path) -> dict[str, float]:
    from onnxruntime.quantization.calibrate import load_tensors_data

    data = load_tensors_data(path)
    out = {}
    for name, td in data.data.items():
        lo, hi = (np.asarray(v, dtype=np.float64).reshape(-1) for v in td.range_value)
        out[name] = float(max(np.abs(lo).max(), np.abs(hi).max()))
    return out


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


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """FP16 weights and activations inside, FP32 at the model's inputs and outputs."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False)
