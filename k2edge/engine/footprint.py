"""What a plan's engines hold in memory for weights, per backend, before anything is built (pure).

A plan's weights are stored once per engine that holds them, at the precision each layer runs in (FP32 4 bytes a
value, FP16 2, INT8 1; integer constants as they are). What differs between backends is how many engines hold
them when a daemon runs every batch size up to ``max_batch``:

* ONNX Runtime: one session per segment with a dynamic batch axis, so every segment's weights once;
* TensorRT: a GPU segment is one engine with an optimization profile per batch size (the profiles share its
  weights); a DLA segment is one static engine per batch size (the DLA takes no dynamic shapes and each loadable
  holds its own weights), so a DLA segment's weights are held once per batch size.

Activations (ONNX Runtime's arena, TensorRT's per-context device memory) come on top; the daemon measures what its
activated engines hold (``ModelRuntime.memory``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dla.planner import PartitionPlan, device_kind
from ..model.batch_axis import profile_batch_sizes
from ..model.graph import Graph

_BYTES = {"fp32": 4, "fp16": 2, "int8": 1}


@dataclass(frozen=True)
class Footprint:
    """Weight bytes of a plan's engines: per segment as planned, and in all on each backend for ``batch_sizes``."""

    segment_bytes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    onnxruntime_bytes: int
    tensorrt_gpu_bytes: int
    tensorrt_dla_bytes: int  # every DLA engine of every batch size

    @property
    def tensorrt_bytes(self) -> int:
        return self.tensorrt_gpu_bytes + self.tensorrt_dla_bytes

    def to_dict(self) -> dict:
        return {"segment_weight_bytes": list(self.segment_bytes), "batch_sizes": list(self.batch_sizes),
                "onnxruntime_weight_bytes": self.onnxruntime_bytes, "tensorrt_weight_bytes": self.tensorrt_bytes,
                "tensorrt_gpu_weight_bytes": self.tensorrt_gpu_bytes, "tensorrt_dla_weight_bytes": self.tensorrt_dla_bytes}

    def lines(self) -> list[str]:
        """What a person reads in ``k2edge plan``."""
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        sizes = "/".join(map(str, self.batch_sizes))
        out = [f"weights for batches up to {self.batch_sizes[-1]}: onnxruntime {mib(self.onnxruntime_bytes)} "
               f"(one engine per segment for every batch size)"]
        dla_engines = len(self.batch_sizes)
        out.append(f"weights on tensorrt {mib(self.tensorrt_bytes)}: GPU segments {mib(self.tensorrt_gpu_bytes)} "
                   f"(one engine each, an optimization profile per batch size {sizes}, weights shared)"
                   + (f", DLA segments {mib(self.tensorrt_dla_bytes)} ({dla_engines} static engines each, one per "
                      f"batch size: the DLA takes no dynamic shapes and each loadable holds its weights)"
                      if self.tensorrt_dla_bytes else ""))
        return out


def plan_footprint(plan: PartitionPlan, graph: Graph, max_batch: int) -> Footprint:
    """The weight bytes ``plan``'s engines hold when they run every batch size up to ``max_batch``."""
    sizes = profile_batch_sizes(max_batch)
    per_segment = []
    gpu = dla = 0
    for seg in plan.segments:
        n = _segment_weights(seg, graph)
        per_segment.append(n)
        if device_kind(seg.device) == "dla":
            dla += n * len(sizes)
        else:
            gpu += n
    return Footprint(tuple(per_segment), sizes, sum(per_segment), gpu, dla)


def _segment_weights(seg, graph: Graph) -> int:
    seen: set[str] = set()
    total = 0
    for name in seg.nodes:
        node = graph.by_name[name]
        precision = seg.layer_precision.get(name, seg.precision)
        for t in node.inputs:
            init = graph.initializers.get(t)
            if init is None or t in seen:
                continue
            seen.add(t)
            count = int(np.prod(init.dims)) if init.dims else 1
            dtype = graph.tensors[t].dtype
            total += count * (_BYTES.get(precision, 4) if np.dtype(dtype).kind == "f" else np.dtype(dtype).itemsize)
    return total
