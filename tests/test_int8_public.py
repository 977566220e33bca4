"""INT8 on public pretrained models (docs/int8.md, "Public models: INT8 share and accuracy").

A calibration set whose held-out part has too few FP32 boxes gives an inconclusive check. The share and accuracy
bounds of docs/int8.md are measured by ``bench/bench_int8_public.py``; they are not all met yet (see docs/int8.md),
so no test asserts them here.
"""

from __future__ import annotations

import pytest

from k2edge import Engine
from test_int8_fixtures import INT8, packaged_model

GPU_CHAIN = {"name": "gpu-int8-fp16", "edge_runtime": {"offload_ratio": 1.0, "precision_fallback": ["int8", "fp16"]}}


@pytest.mark.slow
def test_a_held_out_part_with_too_few_boxes_is_inconclusive(tmp_path):
    """The fixture's 48 scene crops hold out 9 images with about one face: whatever the fallback moved on so few
    items, the check is inconclusive, never passed, and says what data to give."""
    engine = Engine.build(packaged_model("nudenet-320n"), GPU_CHAIN, calib=INT8 / "calib",
                          card=INT8 / "nudenet-320n" / "card.toml", cache_dir=tmp_path)
    check = engine.info.int8_check
    assert check.status == "inconclusive" and check.power[1] < 50, check.line()
    assert "at least 50 FP32 boxes" in check.line() and not check.passed
    shares = engine.plan.precision_flops  # the automatic float head is the Detect module: at most about 63 % INT8
    assert shares["measured"] and shares["model"]["int8"] < 0.70 and shares["model"]["fp32"] == 0, shares
