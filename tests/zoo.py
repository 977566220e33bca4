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

import numpy as np
import onnx
from onnx import helper

FIXTURE_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "zoo"

MARKER_KEY = "k2edge_fixture"
MARKER_VALUE = "regenerate"

NAMES: tuple[str, ...] = tuple(sorted(p.stem for p in FIXTURE_DIR.glob("*.onnx")))


def fixture_path(name: str) -> pathlib.Path:
    """Path of the committed (stripped) fixture file for ``name``."""
    if name not in NAMES:
        raise KeyError(f"unknown zoo fixture {name!r}; available: {', '.join(NAMES)}")
    return FIXTURE_DIR / f"{name}.onnx"


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
