"""What the TensorRT backend builds, as data: one :class:`SegmentBuildSpec` per plan segment.

The planner decides; this module only translates a :class:`PartitionPlan` segment into builder
settings (default device, DLA core, GPU fallback, per-layer device types, precision flags, DLA
memory pools, I/O formats at segment boundaries, where INT8 comes from) and into the engine's
cache key. It is pure Python, so every mapping is unit-tested without TensorRT.

TensorRT facts relied on (see shared/platform-facts.md):

* the DLA runs FP16 and INT8 only; FP32 layers would move to the GPU ("DLA build and run");
* INT8 on the DLA goes through a calibration cache (implicit quantisation), the JetPack 6 route;
  the GPU takes the Q/DQ model (explicit quantisation);
* DLA memory pools are per loadable, powers of two, at least 4 KiB ("Customizing DLA Memory Pools");
* every GPU<->DLA boundary costs reformat kernels unless the tensor is exchanged in a format the DLA
  reads natively: ``kCHW16`` "maps to the native feature format for FP16", ``kCHW32`` "to the native
  feature format for INT8" [TensorRT 10.3 ``NvInferRuntimeBase.h``, ``TensorFormat``]; jetson_dla_tutorial
  measured reformats halving throughput. An INT8 DLA loadable given FP16 ``CHW16`` I/O needs a reformat
  (NVIDIA-AI-IOT/cuDLA-samples#36: "at least 1 reformatting nodes are needed");
* ``BuilderFlag.DIRECT_IO`` "Require[s] that no reformats be inserted between a layer and a network I/O
  tensor for which ITensor::setAllowedFormats was called. Build fails if a reformat is required" [NvInfer.h
  10.3]: the profile's ``direct_io`` turns a silent reformat at a cut into a build error;
* an INT8 network I/O tensor needs a scale: from Q/DQ layers next to it, or, in a network without Q/DQ,
  from the calibrator ("input/output with DataType Int8 in network without Q/DQ layers must have dynamic
  range set when no calibrator is used", NVIDIA/TensorRT#1973). The segment models end at float tensors,
  so an engine that exchanges an INT8 cut tensor is built by implicit quantisation from the calibration
  cache, the same cache (the same scale) on both sides of the cut.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..dla.planner import PartitionPlan, Segment
from ..errors import BuildError
from ..model.graph import Graph
from .cache import digest

BACKEND_VERSION = "2"  # 2: the key names the batch sizes of the engine's optimization profiles
"""Bumped whenever the way engines are built changes, so cached engines are rebuilt."""

POOLS = {"managed_sram": "DLA_MANAGED_SRAM", "local_dram": "DLA_LOCAL_DRAM", "global_dram": "DLA_GLOBAL_DRAM"}
FP16_CUT = ("fp16", "CHW16")  # DLA-native FP16 layout, also a GPU format: no reformat on either side
INT8_CUT = ("int8", "CHW32")  # DLA-native INT8 layout


@dataclass(frozen=True)
class TargetFacts:
    """What an engine is bound to: it runs only on the TensorRT version and device that built it.

    Attributes:
        tensorrt: ``trt.__version__`` (major.minor.patch.build).
        l4t: the L4T release (``R36.4.3``), None off a Jetson.
        compute_capability: the GPU's, e.g. ``8.7`` on Orin.
        cuda: the CUDA version pycuda was built against.
        dla_cores: DLA cores TensorRT reports on this device.
    """

    tensorrt: str
    l4t: str | None
    compute_capability: str
    cuda: str | None = None
    dla_cores: int = 0


@dataclass(frozen=True)
class SegmentBuildSpec:
    """The builder settings for one segment's engine.

    Attributes:
        index / device: the plan segment (``gpu``, ``dla0``, ``dla1``).
        default_device: ``GPU`` or ``DLA`` (``config.default_device_type``).
        dla_core: ``config.DLA_core`` for DLA engines, else None.
        gpu_fallback: set ``BuilderFlag.GPU_FALLBACK`` (DLA engines only).
        direct_io: set ``BuilderFlag.DIRECT_IO`` (engines with formats set at cuts, when the plan asks).
        gpu_layers: ONNX nodes forced onto the GPU inside a DLA engine (``config.set_device_type``).
        fp16 / int8: ``BuilderFlag.FP16`` / ``BuilderFlag.INT8``.
        int8_source: ``qdq`` (explicit, from the Q/DQ model), ``calibration-cache`` (implicit: the DLA
            route, and GPU engines that exchange an INT8 cut tensor) or None.
        layer_precision: per-node precision constraints, only where a segment mixes precisions.
        memory_pools: ``(MemoryPoolType name, bytes)`` for DLA engines.
        io_formats: ``(tensor, dtype, format)`` for tensors crossing a GPU<->DLA or DLA<->DLA cut.
        input_shapes: the static input shapes the engine is built for.
        planned: node -> ``gpu`` | ``dla``: where the plan expects each node to run.
    """

    index: int
    device: str
    default_device: str
    dla_core: int | None
    gpu_fallback: bool
    direct_io: bool
    gpu_layers: tuple[str, ...]
    fp16: bool
    int8: bool
    int8_source: str | None
    layer_precision: tuple[tuple[str, str], ...]
    memory_pools: tuple[tuple[str, int], ...]
    io_formats: tuple[tuple[str, str, str], ...]
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    planned: tuple[tuple[str, str], ...] = field(repr=False)

    @property
    def is_dla(self) -> bool:
        return self.default_device == "DLA"

    @property
    def precision_constraints(self) -> bool:
        """Ask TensorRT to honour per-layer precisions (``PREFER_PRECISION_CONSTRAINTS``)."""
        return bool(self.layer_precision)

    @property
    def source_model(self) -> str:
        """``qdq`` when the engine is built from the Q/DQ model, else ``float``."""
        return "qdq" if self.int8_source == "qdq" else "float"

    @property
    def precision_label(self) -> str:
        used = [p for p, on in (("int8", self.int8), ("fp16", self.fp16)) if on]
        return "+".join(used) or "fp32"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def segment_specs(plan: PartitionPlan, graph: Graph, have_quant: bool) -> tuple[SegmentBuildSpec, ...]:
    """Translate every segment of ``plan`` into builder settings.

    Args:
        plan: the partition plan (it carries GPU fallback, DIRECT_IO and the DLA memory pools).
        graph: the normalised model's graph (tensor ranks for I/O formats).
        have_quant: whether INT8 artefacts (Q/DQ model, calibration cache) exist.

    Raises:
        BuildError: FP32 layers planned on a DLA (reference mode), or INT8 without calibration.
    """
    formats = boundary_formats(plan, graph)
    pools = tuple((POOLS[key], size) for key, size in plan.dla_memory_pools)
    specs = []
    for seg in plan.segments:
        on_dla = seg.kind == "dla"
        fallback = set(seg.gpu_fallback_nodes)
        planned = tuple((n, "dla" if on_dla and n not in fallback else "gpu") for n in seg.nodes)
        dla_fp32 = [n for n, where in planned if where == "dla" and seg.layer_precision.get(n) == "fp32"]
        if dla_fp32:
            raise BuildError(
                f"segment {seg.index} puts {len(dla_fp32)} FP32 layer(s) on {seg.device} ({dla_fp32[0]} ...): a real DLA "
                f"runs FP16 and INT8 only. precision fp32 is the reference mode of --backend onnxruntime; "
                f"for TensorRT use fp16 or int8, or a profile with offload_ratio 1.0"
            )
        io_formats = tuple((t, *formats[t]) for t in (*seg.inputs, *seg.outputs) if t in formats)
        used = set(seg.layer_precision.values()) or {"fp32"}
        int8 = "int8" in used or any(dtype == "int8" for _, dtype, _ in io_formats)
        if int8 and not have_quant:
            raise BuildError(f"segment {seg.index} ({seg.device}) runs INT8 layers but no calibration artefacts were given")
        # The DLA has no FP32: an INT8 DLA engine needs FP16 too, for tensors without an INT8 scale.
        fp16 = "fp16" in used or (on_dla and int8)
        implicit = on_dla or any(dtype == "int8" for _, dtype, _ in io_formats)
        source = ("calibration-cache" if implicit else "qdq") if int8 else None
        mixed = len(used) > 1
        # Explicitly quantised (Q/DQ) layers take their precision from the Q/DQ nodes: no constraints on them.
        layer_precision = tuple(
            (n, p) for n, p in seg.layer_precision.items() if mixed and not (p == "int8" and source == "qdq")
        )
        specs.append(SegmentBuildSpec(
            index=seg.index,
            device=seg.device,
            default_device="DLA" if on_dla else "GPU",
            dla_core=int(seg.device[3:]) if on_dla else None,
            gpu_fallback=bool(on_dla and plan.gpu_fallback),
            direct_io=bool(plan.direct_io and io_formats),
            gpu_layers=tuple(n for n in seg.nodes if on_dla and n in fallback),
            fp16=fp16,
            int8=int8,
            int8_source=source,
            layer_precision=layer_precision,
            memory_pools=pools if on_dla else (),
            io_formats=io_formats,
            input_shapes=tuple((t, graph.shape(t)) for t in seg.inputs),
            planned=planned,
        ))
    return tuple(specs)


def boundary_formats(plan: PartitionPlan, graph: Graph) -> dict[str, tuple[str, str]]:
    """The I/O dtype and format of every 4-D tensor crossing a cut with a DLA on either side.

    Model inputs and outputs stay FP32 linear (the host reads and writes them). Producer and consumers
    take the same format, so the tensor moves between engines without a reformat kernel: INT8 ``CHW32``
    where the layer that writes it and every layer that reads it run INT8, else FP16 ``CHW16``.
    """
    if plan.is_model_wise:
        return {}
    segment_of, precision_of = {}, {}
    for seg in plan.segments:
        for node in seg.nodes:
            segment_of[node] = seg
            precision_of[node] = seg.layer_precision.get(node)
    out = {}
    for seg in plan.segments:
        for t in seg.inputs:
            if t in graph.inputs or t in graph.outputs or len(graph.shape(t)) != 4 or t in out:
                continue
            writer = [graph.nodes[graph.producer[t]].name] if t in graph.producer else []
            adjacent = writer + [graph.nodes[i].name for i in graph.consumers.get(t, [])]
            if not any(segment_of[n].kind == "dla" for n in adjacent):
                continue
            out[t] = INT8_CUT if all(precision_of[n] == "int8" for n in adjacent) else FP16_CUT
    return out


def expected_placement(seg: Segment) -> dict[str, str]:
    """Node -> ``gpu`` | ``dla`` as the plan has it."""
    fallback = set(seg.gpu_fallback_nodes)
    return {n: "dla" if seg.kind == "dla" and n not in fallback else "gpu" for n in seg.nodes}


def engine_key(segment_sha256: str, spec: SegmentBuildSpec, segment_plan: str, facts: TargetFacts,
               calibration_sha256: str = "", profile_batches: tuple[int, ...] = ()) -> str:
    """The cache key of one segment engine.

    An engine runs only on the TensorRT version and device that built it, so the key covers the
    segment model, its part of the plan, the builder settings (precision, DLA core, pools, formats),
    the calibration data, the TensorRT version, the L4T release, the GPU's compute capability and the batch sizes
    of its optimization profiles (empty: static shapes).
    """
    return digest("tensorrt", BACKEND_VERSION, segment_sha256, segment_plan, spec.to_json(), calibration_sha256,
                  facts.tensorrt, facts.l4t or "no-l4t", facts.compute_capability, spec.device, repr(tuple(profile_batches)))


def trt_version_code(version: str) -> int:
    """``NV_TENSORRT_VERSION`` for a version string: 10.3.0 -> 100300 (major*10000 from 10 on), 8.6.2 -> 8602."""
    parts = [int(p) for p in (version.split(".") + ["0", "0"])[:3] if p.isdigit()] + [0, 0, 0]
    major, minor, patch = parts[:3]
    return major * 10000 + minor * 100 + patch if major >= 10 else major * 1000 + minor * 100 + patch


def tensor_nbytes(shape: tuple[int, ...], bytes_per_component: int, vectorized_dim: int = -1, components: int = 1) -> int:
    """Bytes of a tensor buffer in a possibly vectorised format (``kCHW16`` pads C to a multiple of 16)."""
    dims = [max(int(d), 1) for d in shape]
    if vectorized_dim >= 0 and components > 1:
        dims[vectorized_dim] = -(-dims[vectorized_dim] // components) * components
    n = 1
    for d in dims:
        n *= d
    return n * bytes_per_component


DLA_LOADABLES_PER_CORE = 16
"""Loadables a DLA core holds at once [TensorRT "DLA Supported Layers and Restrictions"]."""


def engine_batches(spec: SegmentBuildSpec, batch_sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The engines a segment needs to run ``batch_sizes``, each as the batch sizes its optimization profiles fix.

    A GPU segment is one engine with one profile per batch size (min = opt = max each): the profiles share the
    engine's weights, and each has its own execution context. A DLA segment is one engine per batch size: the DLA
    takes no dynamic dimensions (a profile's min, opt and max must be equal, and run-time shapes must be the built
    ones), and a DLA loadable is compiled, weights included, for the shapes it was built at, so nothing of it is
    shared between batch sizes; each counts against the 16 loadables a core holds. Empty ``batch_sizes`` (a
    model whose batch is fixed): one engine at its static shapes, ``((),)``.
    """
    if not batch_sizes:
        return ((),)
    if spec.is_dla:
        return tuple((b,) for b in batch_sizes)
    return (tuple(batch_sizes),)


def dla_loadables(specs: tuple[SegmentBuildSpec, ...], batch_sizes: tuple[int, ...]) -> dict[int, int]:
    """DLA core -> engines it holds for ``batch_sizes`` (each at least one loadable; GPU fallback inside a segment
    splits it into more)."""
    out: dict[int, int] = {}
    for spec in specs:
        if spec.is_dla:
            out[spec.dla_core] = out.get(spec.dla_core, 0) + len(engine_batches(spec, batch_sizes))
    return out
