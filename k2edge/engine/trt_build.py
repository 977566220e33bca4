"""Build one segment engine: apply a :class:`SegmentBuildSpec` to a real TensorRT builder.

Thin on purpose: every decision is in the spec (``trt_spec``); this module only makes the calls,
written against the TensorRT 10 Python API (``tensorrt`` is passed in, never imported here at module
level). The API names used, as the TensorRT Python bindings spell them:

* ``trt.Builder(logger).create_network(0)``, ``trt.OnnxParser(network, logger).parse(bytes)``;
* ``config.default_device_type``, ``config.DLA_core`` (upper case), ``config.set_flag(BuilderFlag.GPU_FALLBACK)``,
  ``config.set_device_type(layer, DeviceType.GPU)``, ``config.can_run_on_DLA(layer)``;
* ``config.set_memory_pool_limit(MemoryPoolType.DLA_MANAGED_SRAM | DLA_LOCAL_DRAM | DLA_GLOBAL_DRAM, bytes)``;
* ``BuilderFlag.FP16`` / ``INT8`` / ``PREFER_PRECISION_CONSTRAINTS`` / ``DIRECT_IO``, ``layer.precision``;
* ``tensor.dtype`` and ``tensor.allowed_formats = 1 << int(TensorFormat.CHW16)`` on network I/O;
* ``config.int8_calibrator``: an ``IInt8EntropyCalibrator2`` whose ``read_calibration_cache`` returns the
  cache (``get_batch`` returns None: the ranges were computed once, in Python);
* ``config.profiling_verbosity = ProfilingVerbosity.DETAILED`` so that
  ``engine.create_engine_inspector().get_engine_information(LayerInformationFormat.JSON)`` names layers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import onnx

from ..errors import BuildError
from .quantize import read_trt_calibration_cache, write_trt_calibration_cache
from .trt_placement import PlacementReport, node_of_layer, observed_placement, observed_precision
from .trt_spec import SegmentBuildSpec, trt_version_code

log = logging.getLogger(__name__)

_PRECISION = {"fp32": "float32", "fp16": "float16", "int8": "int8"}


def make_cache_calibrator(trt, cache: bytes, batch_size: int):
    """An ``IInt8EntropyCalibrator2`` that only hands TensorRT an existing calibration cache."""

    class _CacheCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self):
            trt.IInt8EntropyCalibrator2.__init__(self)

        def get_batch_size(self):
            return batch_size

        def get_batch(self, names):
            return None  # nothing to calibrate: the cache covers every tensor we have ranges for

        def read_calibration_cache(self):
            return cache

        def write_calibration_cache(self, data):
            return None

    return _CacheCalibrator()


def segment_calibration_cache(source: Path, model: onnx.ModelProto, dest: Path, trt_version: str) -> None:
    """Write the calibration cache for one segment: its tensors only, headed with this TensorRT's version."""
    ranges = read_trt_calibration_cache(source)
    g = model.graph
    tensors = {i.name for i in g.input} | {o for n in g.node for o in n.output}
    write_trt_calibration_cache(dest, {t: a for t, a in ranges.items() if t in tensors}, str(trt_version_code(trt_version)))


def map_layers(network, nodes: set[str]) -> list[tuple[object, str | None]]:
    """Every network layer with the ONNX node it was parsed from (None for parser-made helpers)."""
    out = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        out.append((layer, node_of_layer(layer.name, getattr(layer, "metadata", "") or "", nodes)))
    return out


def apply_spec(trt, config, network, spec: SegmentBuildSpec, layers: list[tuple[object, str | None]], calibrator=None) -> None:
    """Apply ``spec`` to a ``trt.IBuilderConfig`` and the parsed network; nothing is decided here."""
    if spec.fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if spec.int8:
        config.set_flag(trt.BuilderFlag.INT8)
    if spec.precision_constraints:
        config.set_flag(trt.BuilderFlag.PREFER_PRECISION_CONSTRAINTS)
    if spec.direct_io:
        config.set_flag(trt.BuilderFlag.DIRECT_IO)
    if spec.is_dla:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = spec.dla_core
        if spec.gpu_fallback:
            config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
        for pool, size in spec.memory_pools:
            config.set_memory_pool_limit(getattr(trt.MemoryPoolType, pool), size)
    else:
        config.default_device_type = trt.DeviceType.GPU
    gpu_layers = set(spec.gpu_layers)
    precisions = dict(spec.layer_precision)
    for layer, node in layers:
        if node in gpu_layers:
            config.set_device_type(layer, trt.DeviceType.GPU)
        if node in precisions:
            layer.precision = getattr(trt, _PRECISION[precisions[node]])
    formats = {t: (dtype, fmt) for t, dtype, fmt in spec.io_formats}
    for tensor in _io_tensors(network):
        if tensor.name in formats:
            dtype, fmt = formats[tensor.name]
            tensor.dtype = getattr(trt, _PRECISION[dtype])
            tensor.allowed_formats = 1 << int(getattr(trt.TensorFormat, fmt))
    if calibrator is not None:
        config.int8_calibrator = calibrator
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED


def _io_tensors(network):
    return [network.get_input(i) for i in range(network.num_inputs)] + [network.get_output(i) for i in range(network.num_outputs)]


def dla_support(config, spec: SegmentBuildSpec, layers) -> tuple[list[str], list[str]]:
    """``can_run_on_DLA`` per node against the plan: (planned on the DLA but refused, kept on the GPU but able).

    A node made of several layers can run on the DLA only if each of its layers can.
    """
    if not spec.is_dla:
        return [], []
    able: dict[str, bool] = {}
    for layer, node in layers:
        if node is not None:
            able[node] = able.get(node, True) and bool(config.can_run_on_DLA(layer))
    planned = dict(spec.planned)
    cannot = [n for n, where in spec.planned if where == "dla" and able.get(n) is False]
    could = [n for n in spec.gpu_layers if able.get(n) is True and planned.get(n) == "gpu"]
    return cannot, could


def build_segment_engine(trt, logger, spec: SegmentBuildSpec, model: onnx.ModelProto, out: Path,
                         calibration_cache: bytes | None = None, batch_size: int = 1,
                         profile_batches: tuple[int, ...] = ()) -> dict:
    """Parse ``model``, apply ``spec``, build, save ``engine.plan`` and the placement report in ``out``.

    With ``profile_batches`` the model's inputs have a dynamic batch axis, and the engine gets one optimization
    profile per batch size, each static (min = opt = max): profile k runs batch ``profile_batches[k]``.

    Returns:
        metadata for the cache manifest: placement summary and notes.

    Raises:
        BuildError: the parser or the builder failed, or the network is not static.
    """
    logger.take_errors()  # this thread's errors from here on belong to this build
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString()):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"TensorRT cannot parse segment {spec.index}: {'; '.join(errors[:3]) or 'unknown parser error'}")
    nodes = [n.name for n in model.graph.node]
    want = dict(spec.input_shapes)
    inputs = {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        shape = tuple(int(d) for d in t.shape)
        fixed = shape[1:] if profile_batches else shape  # the batch axis is the only dynamic one
        expected = tuple(want[t.name])[1:] if profile_batches and t.name in want else want.get(t.name)
        if any(d < 0 for d in fixed) or (t.name in want and fixed != tuple(expected)):
            raise BuildError(f"segment {spec.index}: input {t.name!r} has shape {shape}, expected static {want.get(t.name)}"
                             + (" but for its batch" if profile_batches else ""))
        inputs[t.name] = shape
    config = builder.create_builder_config()
    profiles = []
    for b in profile_batches:
        profile = builder.create_optimization_profile()
        for name, shape in inputs.items():
            static = (b, *shape[1:])
            profile.set_shape(name, static, static, static)
        config.add_optimization_profile(profile)
        profiles.append(profile)
    layers = map_layers(network, set(nodes))
    calibrator = make_cache_calibrator(trt, calibration_cache, batch_size) if spec.int8_source == "calibration-cache" else None
    apply_spec(trt, config, network, spec, layers, calibrator)
    if calibrator is not None and profiles:
        # a network with run-time dimensions calibrates under a profile; the cache holds the ranges already
        config.set_calibration_profile(profiles[0])
    cannot, could = dla_support(config, spec, layers)
    if cannot and not spec.gpu_fallback:
        raise BuildError(f"segment {spec.index} ({spec.device}): TensorRT cannot run {', '.join(cannot[:3])} on the DLA "
                         f"and gpu_fallback is off; set edge_runtime.gpu_fallback to true")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        why = "; ".join(logger.take_errors()[-3:]) or "see the TensorRT log above"
        raise BuildError(f"TensorRT could not build segment {spec.index} ({spec.device}, {spec.precision_label}): {why}")
    data = bytes(serialized)
    (out / "engine.plan").write_bytes(data)
    info = inspect_engine(trt, logger, data, spec)
    (out / "inspector.json").write_text(info)
    report = PlacementReport(spec.index, spec.device, dict(spec.planned), observed_placement(info, nodes, spec.is_dla),
                             cannot, could)
    precision = observed_precision(info, nodes)
    (out / "placement.json").write_text(json.dumps({**report.summary(), "planned_devices": report.planned,
                                                    "observed_devices": report.observed, "observed_precision": precision},
                                                   indent=1, sort_keys=True))
    disagreements = report.disagreements()
    for note in report.notes():
        log.log(logging.WARNING if note in disagreements else logging.INFO, "%s", note)
    return {"placement": {**report.summary(), "precision": precision}, "notes": report.notes(), "bytes": len(data),
            "profile_batches": list(profile_batches)}


def inspect_engine(trt, logger, data: bytes, spec: SegmentBuildSpec) -> str:
    """The engine inspector's JSON for a serialized engine (deserialised on its own DLA core)."""
    runtime = trt.Runtime(logger)
    if spec.is_dla:
        runtime.DLA_core = spec.dla_core
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        return "{}"
    inspector = engine.create_engine_inspector()
    return inspector.get_engine_information(trt.LayerInformationFormat.JSON) or "{}"
