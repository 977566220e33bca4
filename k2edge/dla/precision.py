"""Per-layer precision from the profile's chain and the device.

Placement never depends on precision; precision is assigned afterwards, per segment, from the
chain (``precision_fallback``) filtered by what the device runs: the GPU runs fp32, fp16 and int8,
the DLA fp16 and int8 only. Each layer takes the first precision in the filtered chain that it
supports; a layer that supports none runs in the device's native precision and the plan says so.
"""

from __future__ import annotations

from ..errors import PlanError

DEVICE_PRECISIONS = {"gpu": ("fp32", "fp16", "int8"), "dla": ("fp16", "int8")}
NATIVE = {"gpu": "fp32", "dla": "fp16"}

# Layers with INT8 implementations in TensorRT (and Q/DQ support in ONNX Runtime's quantiser).
INT8_OPS = frozenset({
    "Conv", "ConvTranspose", "Gemm", "MatMul", "MaxPool", "AveragePool", "GlobalAveragePool",
    "Add", "Mul", "Relu", "Clip", "LeakyRelu", "Concat", "Reshape", "Flatten", "Transpose",
    "Resize", "Squeeze", "Unsqueeze", "Split", "Slice", "Pad", "BatchNormalization", "Sigmoid",
})


def device_kind(device: str) -> str:
    """``gpu`` for the GPU, ``dla`` for ``dla0``/``dla1``."""
    return "dla" if device.startswith("dla") else "gpu"


def usable_chain(chain: tuple[str, ...], device: str) -> tuple[str, ...]:
    """The chain filtered by what ``device`` runs.

    Raises:
        PlanError: a DLA device and a chain with neither fp16 nor int8.
    """
    kind = device_kind(device)
    usable = tuple(p for p in chain if p in DEVICE_PRECISIONS[kind])
    if not usable and kind == "dla":
        raise PlanError(
            f"precision_fallback {list(chain)} has neither fp16 nor int8, but the plan puts layers on {device}; "
            f"the DLA runs FP16 and INT8 only (add \"fp16\" or \"int8\", or set offload_ratio to 1.0)"
        )
    return usable


def layer_precision(op_type: str, chain: tuple[str, ...], device: str) -> str:
    """The precision one layer runs in on ``device`` given the (already filtered) chain."""
    for p in chain:
        if p != "int8" or op_type in INT8_OPS:
            return p
    return NATIVE[device_kind(device)]
