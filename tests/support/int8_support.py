"""INT8 through the production path for tests: :func:`k2edge.engine.int8.decide_int8`, the one entry point
``Engine.build`` calls, with a GPU-only plan and the model's card unless a test gives its own."""

from __future__ import annotations

from pathlib import Path

import onnx

from k2edge import load_profile
from k2edge.dla.planner import plan_partition
from k2edge.engine.cache import EngineCache
from k2edge.config.resolve import model_card
from k2edge.engine.int8 import decide_int8
from k2edge.engine.quantize import QuantSettings, calibration_statistics, dla_ties, variant_files

# a GPU-only ["int8", "fp16"] chain: one dict for every test that builds a public model with it, so that the
# tests building the same model with the same calibration share the session cache's decision
GPU_CHAIN = {"name": "gpu-int8-fp16", "edge_runtime": {"offload_ratio": 1.0, "precision_fallback": ["int8", "fp16"]}}

INT8_ONLY = {"edge_runtime": {"offload_ratio": 1.0, "precision_fallback": ["int8"]}}


def int8_decision(nm, dataset, preprocess, cache: EngineCache, plan=None, card=None, profile=None, model_path=None,
                  decoder=None, check_set=None):
    """The production INT8 decision (artefacts, plan, check) of ``nm``; default: a GPU-only ``["int8"]`` plan."""
    profile = load_profile(profile or INT8_ONLY)
    plan = plan if plan is not None else plan_partition(nm, profile)
    card = card if card is not None else model_card(Path(model_path) if model_path else None, nm)
    if decoder is None and card.task != "tensor":
        from k2edge.config.resolve import load_labels
        from k2edge.tasks import TaskDecoder

        labels = load_labels(Path(model_path) if model_path else None, nm, None, card)
        decoder = TaskDecoder(card, labels, {o: nm.graph.shape(o) for o in nm.graph.outputs})
    return decide_int8(nm, plan, dataset, preprocess, card, cache, profile.edge_runtime, decoder, check_set)


def forced_ties_qdq(nm, dataset, preprocess, cache: EngineCache, dest: Path, keep_float=(),
                    settings: QuantSettings | None = None) -> onnx.ModelProto:
    """The Q/DQ model with the DLA's ties forced onto every node, gates tied too (what k2edge did up to
    QUANT_VERSION 3): to show why the ties apply to DLA layers only. Not a production path."""
    stats, _, _ = calibration_statistics(nm, dataset, preprocess, cache)
    dest.mkdir(parents=True, exist_ok=True)
    ties = dla_ties(nm.graph, {n.name for n in nm.graph.nodes}, fuse_gates=False)
    variant_files(nm, stats, dest, settings or QuantSettings(), (), tuple(keep_float), ties)
    return onnx.load(str(dest / "qdq.onnx"))
