"""One engine for every batch size: its answers equal the per-batch engines' at every size, its cache entry is
its own, and a model whose computation depends on its batch keeps static engines per batch size."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import zoo
from k2edge import Engine, load_profile
from k2edge.config.schema import ModelConfig
from k2edge.errors import ModelError
from k2edge.model.batch_axis import with_batch_axis
from k2edge.model.ingest import normalise
from k2edge.service.runtime import ModelRuntime

MAX_BATCH = 8
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _profile(batch: int, partition="layer-wise", ratio=1.0):
    chain = ["fp32"] if ratio == 1.0 else ["fp16"]  # the DLA lanes of a split plan run FP16
    return load_profile({"edge_runtime": {"tensorrt_partition": partition, "offload_ratio": ratio,
                                          "precision_fallback": chain, "dma_prefetch": False, "batch_size": batch}})


def _inputs(engine: Engine, n: int, seed: int) -> np.ndarray:
    shape = (n, *engine.input_shape[1:])
    return np.random.default_rng(seed).random(shape, dtype=np.float32)


def _assert_same_at_every_size(source, ratio=1.0, input_shapes=None, max_batch=MAX_BATCH):
    shapes = lambda b: {k: (b, *v[1:]) for k, v in input_shapes.items()} if input_shapes else None  # noqa: E731
    with Engine.build(source, _profile(1, ratio=ratio), max_batch=max_batch, input_shapes=shapes(1)) as one:
        assert one.backend.inputs[0].batch_axis and one.batch_size == max_batch
        assert (len(one.plan.segments) > 1) == (ratio < 1.0)
        for b in range(1, max_batch + 1):
            with Engine.build(source, _profile(b, ratio=ratio), input_shapes=shapes(b)) as static:
                x = _inputs(static, b, seed=b)
                got, want = one.infer({one.input_name: x}), static.infer({static.input_name: x})
                assert set(got) == set(want)
                for name in want:
                    assert got[name].shape == want[name].shape and np.array_equal(got[name], want[name]), (b, name)


def test_digits_same_answers_at_every_batch_size():
    """The demo classifier: the one engine's outputs are bit-identical to the batch-b engine's for b = 1..8."""
    _assert_same_at_every_size(ROOT / "models" / "digits" / "model.onnx")


def test_digits_split_plan_same_answers_at_every_batch_size():
    """A layer-wise FP16 plan over three lanes (four segments): every segment takes the batch axis, outputs bit-identical at b = 1..8."""
    _assert_same_at_every_size(ROOT / "models" / "digits" / "model.onnx", ratio=0.35)


def test_detector_same_answers_at_every_batch_size():
    """The demo detector (its head reshapes to [batch, 14, -1]): bit-identical at b = 1..8."""
    _assert_same_at_every_size(ROOT / "models" / "detector" / "model.onnx")


@pytest.mark.slow
def test_yolov8_same_answers_at_every_batch_size(tmp_path):
    """The YOLOv8n export with a dynamic batch at 320 x 320 (its DFL reshapes carry the batch): bit-identical at
    b = 1..8 (about 15 s here)."""
    path = zoo.save("yolov8n-dynamic", tmp_path / "yolov8n.onnx")
    _assert_same_at_every_size(path, input_shapes={"images": (1, 3, 320, 320)})


def test_fixed_batch_export_keeps_its_batch(tmp_path):
    """A YOLOv8n exported with batch 1: the engine says it takes batch 1 only, and the runtime forms batches of 1."""
    path = zoo.save("yolov8n-320", tmp_path / "yolov8n.onnx")
    with Engine.build(path, _profile(1), max_batch=MAX_BATCH) as engine:
        assert not engine.backend.inputs[0].batch_axis and engine.batch_size == 1
    rt = ModelRuntime(ModelConfig(name="y", onnx=path), MAX_BATCH, None, None)
    assert sorted(rt.engines) == [1] and rt.max_batch == 1


def test_cache_key_is_its_own(demo_model, cache_dir):
    """The one engine is built under a key no per-batch engine has, so no entry of theirs is ever read for it."""
    keys = set()
    for b in (1, 2, 4, 8):
        keys.add(Engine.build(demo_model, _profile(b), cache_dir=cache_dir).backend.build.key)
    one = Engine.build(demo_model, _profile(1), cache_dir=cache_dir, max_batch=MAX_BATCH)
    assert one.backend.build.key not in keys and not one.backend.build.cached
    again = Engine.build(demo_model, _profile(1), cache_dir=cache_dir, max_batch=MAX_BATCH)
    assert again.backend.build.key == one.backend.build.key and again.backend.build.cached


def _batch_dependent_values(path) -> None:
    """x + ones(shape(x)): normalising folds the ones into a float constant as large as the batch."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("ConstantOfShape", ["s"], ["ones"], name="ones",
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("Add", ["x", "ones"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 8, 8])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_batch_dependent_values_refused(tmp_path):
    """A float constant that grows with the batch is no shape vector: with_batch_axis names it."""
    path = tmp_path / "m.onnx"
    _batch_dependent_values(path)
    small, large = (normalise(path, batch_size=b).model for b in (2, 3))
    with pytest.raises(ModelError, match="'ones'.*changes with the batch size"):
        with_batch_axis(small, large, (2, 3), "m.onnx")


def test_runtime_falls_back_to_engines_per_batch_size(tmp_path):
    """The runtime keeps one static engine per batch size when no batch axis can be built, and runs each batch on
    the engine of its padded size."""
    path = tmp_path / "m.onnx"
    _batch_dependent_values(path)
    rt = ModelRuntime(ModelConfig(name="m", onnx=path), 4, None, None)
    assert sorted(rt.engines) == [1, 2, 4] and len({id(e) for e in rt.engines.values()}) == 3
    with rt:
        samples = [np.full((3, 8, 8), i, np.float32) for i in range(3)]
        out = rt.infer(samples)["y"]
        assert out.shape[0] == 4 and np.array_equal(out[:3], np.stack(samples) + 1)


def test_plan_footprint_counts_dla_weights_per_batch_size():
    """c1 on the demo detector: ONNX Runtime holds each segment's weights once; TensorRT the GPU segments' once and
    the DLA segments' once per batch size 1, 2, 4, 8; FP16 layers at 2 bytes a weight."""
    from k2edge.dla.planner import plan_partition
    from k2edge.engine.footprint import plan_footprint

    nm = normalise(ROOT / "models" / "detector" / "model.onnx")
    plan = plan_partition(nm, load_profile("c1"))
    fp = plan_footprint(plan, nm.graph, 8)
    floats = sum(int(np.prod(t.dims)) for t in nm.model.graph.initializer if t.data_type == TensorProto.FLOAT)
    assert fp.batch_sizes == (1, 2, 4, 8) and fp.onnxruntime_bytes == sum(fp.segment_bytes)
    assert floats * 2 <= fp.onnxruntime_bytes < floats * 2 + 4096  # every float weight once, in FP16 (+ int shapes)
    dla = sum(n for s, n in zip(plan.segments, fp.segment_bytes) if s.device.startswith("dla"))
    assert dla > 0 and fp.tensorrt_dla_bytes == 4 * dla and fp.tensorrt_gpu_bytes == fp.onnxruntime_bytes - dla
    assert any("4 static engines each" in line for line in fp.lines())
