"""Loader for the classic image-classifier fixtures in tests/fixtures/zoo/.

The committed ``.onnx`` files hold the real exported graphs (torchvision
architectures written by torch's legacy TorchScript exporter: initializers
also listed as graph inputs, dynamic batch dimension ``N``, opset 9, constant
Shape/Gather/Unsqueeze/Concat/Reshape subgraphs) but large float initializers
(> 256 elements) are stored without data.  Their ``doc_string`` carries a JSON
marker ``{"k2edge_fixture": "regenerate", "mean": .., "std": .., "min": ..,
"max": ..}`` and :func:`load` refills them deterministically.

Only numpy and onnx are needed here (no torch).  The fixtures are rebuilt by
``tools/make_zoo_fixtures.py``; see tests/fixtures/zoo/README.md.
"""

from __future__ import annotations

import json
import pathlib
import zlib
from typing import Callable

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import helper

FIXTURE_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "zoo"
YOLOV8_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "yolov8"
ULTRALYTICS_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "ultralytics"

MARKER_KEY = "k2edge_fixture"
MARKER_VALUE = "regenerate"
STRIP_OVER = 256  # float initializers with more elements than this lose their data
FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)

NAMES: tuple[str, ...] = tuple(sorted(p.stem for p in FIXTURE_DIR.glob("*.onnx")))
"""The image classifiers (tests parametrise over these)."""
YOLOV8_NAMES: tuple[str, ...] = tuple(sorted(p.stem for p in YOLOV8_DIR.glob("*.onnx")))
"""The YOLOv8n exports: ``yolov8n-320`` (static) and ``yolov8n-dynamic``."""
ULTRALYTICS_NAMES: tuple[str, ...] = tuple(sorted(p.stem for p in ULTRALYTICS_DIR.glob("*.onnx")))
"""Ultralytics' other tasks and layouts (tests/fixtures/ultralytics): yolov8n-seg, -pose, -cls, -obb, yolo11n, yolov10n."""


def fixture_path(name: str) -> pathlib.Path:
    """Path of the committed (stripped) fixture file for ``name``."""
    if name in NAMES:
        return FIXTURE_DIR / f"{name}.onnx"
    if name in YOLOV8_NAMES:
        return YOLOV8_DIR / f"{name}.onnx"
    if name in ULTRALYTICS_NAMES:
        return ULTRALYTICS_DIR / f"{name}.onnx"
    raise KeyError(f"unknown fixture {name!r}; available: {', '.join(NAMES + YOLOV8_NAMES + ULTRALYTICS_NAMES)}")


def stable_hash(text: str) -> int:
    """Process-independent hash of a tensor name (``hash()`` is salted)."""
    return zlib.crc32(text.encode("utf-8"))


def _marker(tensor: onnx.TensorProto) -> dict | None:
    if not tensor.doc_string:
        return None
    try:
        meta = json.loads(tensor.doc_string)
    except ValueError:
        return None
    if isinstance(meta, dict) and meta.get(MARKER_KEY) == MARKER_VALUE:
        return meta
    return None


def _regenerate(tensor: onnx.TensorProto, meta: dict, seed: int) -> None:
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    shape = tuple(int(d) for d in tensor.dims)
    if "dims" in meta and tuple(meta["dims"]) != shape:
        raise ValueError(f"{tensor.name}: dims {shape} disagree with marker {meta['dims']}")
    mean, std = float(meta["mean"]), float(meta["std"])
    lo, hi = float(meta["min"]), float(meta["max"])
    if std == 0.0:
        values = np.full(shape, mean, dtype=np.float64)
    else:
        rng = np.random.default_rng(seed + stable_hash(tensor.name))
        values = rng.normal(mean, std, size=shape)
    values = np.clip(values, lo, hi).astype(dtype)
    del tensor.float_data[:]
    del tensor.double_data[:]
    del tensor.int32_data[:]  # float16 payloads may live here
    tensor.raw_data = values.astype(dtype.newbyteorder("<"), copy=False).tobytes()
    tensor.doc_string = ""


def strip(model: onnx.ModelProto, strippable: Callable[[onnx.TensorProto], bool] | None = None) -> int:
    """Remove the data of large float initializers in place, recording their statistics.

    Used by the scripts that write the fixtures; :func:`load` undoes it.

    Args:
        model: the exported model, changed in place.
        strippable: further condition an initializer must meet to be stripped
            (default: every float initializer with more than ``STRIP_OVER`` elements).

    Returns:
        The number of initializers stripped.
    """
    n = 0
    for t in model.graph.initializer:
        if t.data_type not in FLOAT_TYPES:
            continue
        arr = onnx.numpy_helper.to_array(t)
        if arr.size <= STRIP_OVER or (strippable is not None and not strippable(t)):
            continue
        a = arr.astype(np.float64)
        t.doc_string = json.dumps(
            {
                MARKER_KEY: MARKER_VALUE,
                "dims": list(arr.shape),
                "dtype": str(arr.dtype),
                "mean": float(a.mean()),
                "std": float(a.std()),
                "min": float(a.min()),
                "max": float(a.max()),
            }
        )
        t.raw_data = b""
        del t.float_data[:]
        del t.double_data[:]
        del t.int32_data[:]
        n += 1
    return n


def load(name: str, seed: int = 0) -> onnx.ModelProto:
    """Load fixture ``name`` with its stripped weights regenerated from ``seed``.

    Everything but the regenerated tensors is exactly as exported.
    """
    model = onnx.load(str(fixture_path(name)))
    for tensor in model.graph.initializer:
        meta = _marker(tensor)
        if meta is not None:
            _regenerate(tensor, meta, seed)
    return model


def save(name: str, path, seed: int = 0) -> pathlib.Path:
    """Write the materialised fixture ``name`` to the file ``path``; return it."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(load(name, seed), str(path))
    return path
