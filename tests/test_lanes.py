"""Lanes sized to the cores: the layout ``threads_per_lane = 0`` / ``"auto"`` chooses, workers of one device running
batches at once on one set of sessions, and the memory a model's engines hold reported per kind."""

import os
import threading

import numpy as np
import pytest

from k2edge.config.schema import ConfigError, ModelConfig, ServiceConfig, load_config
from k2edge.dla.planner import Routing
from k2edge.engine.pipeline import LaneSet, lane_layout
from k2edge.service.metrics import PrometheusMetrics
from k2edge.service.runtime import ModelRuntime


@pytest.mark.parametrize("cores, devices, threads, prefetch, want", [
    (2, 1, 0, False, (2, 1)),      # auto, one device: a single-threaded worker per core
    (8, 1, 0, False, (8, 1)),
    (4, 1, 0, True, (3, 1)),       # the prefetch ring's staging thread keeps a core
    (1, 1, 0, True, (1, 1)),
    (6, 3, 0, False, (1, 2)),      # a plan naming devices keeps a lane per device, the cores shared
    (2, 3, 0, False, (1, 1)),
    (8, 1, 2, False, (1, 2)),      # an explicit threads_per_lane keeps its meaning
    (4, 1, None, False, (1, 4)),   # the Engine API's default: one worker, the device's share of the cores
    (4, 2, None, True, (1, 1)),
])
def test_lane_layout(cores, devices, threads, prefetch, want):
    """Workers and intra-op threads per lane for each kind of plan and setting."""
    layout = lane_layout(cores, devices, threads, prefetch)
    assert (layout.workers, layout.threads) == want and layout.cores == cores and layout.why


def test_threads_per_lane_auto_and_default(tmp_path):
    """"auto" reads as 0, and 0 is the default; anything else is refused with the key named."""
    assert ServiceConfig().threads_per_lane == 0
    assert ServiceConfig(threads_per_lane="auto").threads_per_lane == 0
    cfg = tmp_path / "k2edge.toml"
    cfg.write_text('[[models]]\nname = "m"\nonnx = "m.onnx"\n[service]\nthreads_per_lane = "many"\n')
    with pytest.raises(ConfigError, match="service.threads_per_lane"):
        load_config(cfg)


def test_workers_of_a_device_run_batches_at_once():
    """Two workers of one device: a second batch starts while the first is still running (both wait for each other)."""
    both_in = threading.Barrier(2, timeout=20)

    def run(index, tensors):
        both_in.wait()  # raises BrokenBarrierError unless the other batch runs at the same time
        return {"y": tensors["x"] + 1}

    lanes = LaneSet(Routing(((0,),), None, (0,), ("gpu",)), run, ("y",), workers=2)
    lanes.start()
    try:
        futures = [lanes.submit({"x": np.full(2, i)}, None, None) for i in range(2)]
        outs = [f.result(timeout=30)["y"] for f in futures]
    finally:
        lanes.stop()
    assert [o.tolist() for o in outs] == [[1, 1], [2, 2]]
    assert sorted(lanes.runs()["gpu"]) == [1, 1]


def test_memory_metric_per_model_and_kind():
    """k2edge_model_memory_bytes carries each kind a model reports; a new version replaces them, forgetting drops them."""
    m = PrometheusMetrics()
    m.set_model("digits", "1.0.0", "c5", memory={"host": 1000, "device": 2000})
    text = m.render().decode()
    assert 'k2edge_model_memory_bytes{kind="host",model="digits"} 1000.0' in text
    assert 'k2edge_model_memory_bytes{kind="device",model="digits"} 2000.0' in text
    m.set_model("digits", "1.1.0", "cpu-dev", memory={"host": 500})
    text = m.render().decode()
    assert 'k2edge_model_memory_bytes{kind="host",model="digits"} 500.0' in text and 'kind="device"' not in text
    m.forget_model("digits")
    assert "k2edge_model_memory_bytes{" not in m.render().decode()


def test_runtime_reports_the_memory_its_activation_took(demo_model):
    """Before activation no figure; after, the host bytes activating the one engine and its runs added; the lanes are
    the auto layout's (a worker per core)."""
    rt = ModelRuntime(ModelConfig(name="m", onnx=demo_model), 8, None, None, threads_per_lane=0)
    assert rt.memory == {} and len({id(e) for e in rt.engines.values()}) == 1
    with rt:
        assert set(rt.memory) == {"host"} and rt.memory["host"] >= 0
        assert len(rt.lanes()) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("alone, together, batch, want", [
    (0.130, 0.578, 4, 1),    # YOLOv8n at 640 here, busy cores: 1.11x the CPU a sample in a batch of 4
    (0.121, 0.2418, 2, 1),   # the same at batch 2, calmer: 0.999x, a saving of 0.1 %
    (0.00086, 0.0032, 4, 8),  # the digits model: a batch saves per-run cost
    (0.0019, 0.0080, 4, 8),  # a small model whose batch saves nothing in the engine: the daemon's per-batch work still
    (0.020, 0.0780, 4, 8),   # a large model whose batch saves 2.5 %: batches stay
    (0.020, 0.0790, 4, 1),   # 1.25 %: not worth it
    (0.010, 0.050, 1, 8),    # nothing measured in a batch: no change
])
def test_batch_limit_from_the_measured_cpu(alone, together, batch, want):
    """Batches of one where a costly sample saves under 2 % of its CPU in a batch; otherwise the largest batch."""
    from k2edge.service.runtime import batch_limit

    assert batch_limit(alone, together, batch, 8) == want
