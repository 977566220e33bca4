"""Raw tensor answers (``task = "tensor"``): each output of one sample as dtype, shape and base64 bytes."""

from __future__ import annotations

import base64
from typing import Mapping

import numpy as np

__all__ = ["encode_outputs", "decode_output"]


def encode_outputs(outputs: Mapping[str, np.ndarray], index: int = 0) -> dict[str, dict]:
    """``{name: {"dtype", "shape", "data"}}`` for sample ``index`` of a batch's outputs.

    ``shape`` is the sample's (the batch dimension dropped); ``data`` is the C-order bytes,
    little-endian, base64-encoded (the request's ``tensor`` format).
    """
    out = {}
    for name, batch in outputs.items():
        arr = np.ascontiguousarray(np.asarray(batch)[index])
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        out[name] = {"dtype": str(arr.dtype.name), "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode("ascii")}
    return out


def decode_output(item: Mapping) -> np.ndarray:
    """The array back from one entry of :func:`encode_outputs` (for clients and tests)."""
    data = base64.b64decode(item["data"])
    return np.frombuffer(data, dtype=np.dtype(item["dtype"]).newbyteorder("<")).reshape(item["shape"])
