"""The ONNX Runtime backend: split plans equal the unsplit model in FP32, lanes pipeline, the
prefetch ring stages ahead, the engine cache rebuilds anything corrupted."""

import logging
import threading

import numpy as np
import pytest

import graphs
import zoo
from k2edge import Engine, EngineStateError, InputError, load_profile
from k2edge.engine.pipeline import WeightedChooser

GRANULARITIES = ["layer-wise", "block-wise", "model-wise"]


def profile(partition="layer-wise", ratio=0.35, chain=("fp16", "int8"), prefetch=True, **extra):
    return load_profile({"edge_runtime": {"tensorrt_partition": partition, "offload_ratio": ratio,
                                          "precision_fallback": list(chain), "dma_prefetch": prefetch, **extra}})


def _close(a, b, rel=1e-4):
    scale = max(np.abs(a).max(), np.abs(b).max(), 1e-30)
    return np.abs(a - b).max() <= rel * scale


def test_api_example_from_the_issue(demo_model, demo_batch):
    """The README's Python example runs as written (c3: model-wise INT8 with a calibration directory)."""
    from k2edge import Engine, load_profile

    profile = load_profile("profiles/c3.json")
    calib = str(demo_model.parent / "calib")
    with Engine.build(demo_model, profile, calib=calib) as engine:
        outputs = engine.infer({"input": demo_batch[0]})
    assert set(outputs) == {"logits"} and outputs["logits"].shape == (1, 10)


@pytest.mark.parametrize("partition", GRANULARITIES)
@pytest.mark.parametrize("ratio", [0.0, 0.35, 0.7])
def test_split_equals_unsplit_fp32_demo(demo_model, demo_batch, partition, ratio):
    """Every granularity's split plan computes the unsplit model's outputs in FP32 (1e-4 of scale)."""
    with Engine.build(demo_model, "cpu-dev") as ref, Engine.build(demo_model, profile(partition, ratio), precision="fp32") as split:
        assert len(split.plan.segments) > 1
        for x in demo_batch:
            want = ref.infer({"input": x})["logits"]
            assert _close(split.infer({"input": x})["logits"], want)
            assert _close(split.submit({"input": x}).result(timeout=30)["logits"], want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "googlenet", "densenet121", "shufflenet_v2_x1_0"])
@pytest.mark.parametrize("partition", GRANULARITIES)
def test_split_equals_unsplit_fp32_zoo(name, partition, tmp_path):
    """Same on classic architectures (old-opset exports), at a ratio that cuts through the middle."""
    path = zoo.save(name, tmp_path / f"{name}.onnx")
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    with Engine.build(path, "cpu-dev") as ref, Engine.build(path, profile(partition, 0.5), precision="fp32") as split:
        assert len(split.plan.segments) > 1
        assert _close(split.infer({"data": x})["prob"], ref.infer({"data": x})["prob"])


def test_lanes_are_named_as_cpu_lanes(demo_model):
    engine = Engine.build(demo_model, profile("layer-wise", 0.35))
    labels = [lane.label for lane in engine.lanes()]
    assert sorted(labels) == ["dla0 (cpu lane)", "dla1 (cpu lane)", "gpu (cpu lane)"]


def test_pipeline_overlaps_requests_in_order(demo_model, demo_batch):
    """Many requests in flight come back complete, in submission order, equal to inline inference."""
    with Engine.build(demo_model, profile("layer-wise", 0.35), precision="fp32") as e:
        want = [e.infer({"input": x})["logits"] for x in demo_batch]
        futures = [e.submit({"input": x}) for x in demo_batch for _ in range(4)]
        got = [f.result(timeout=30)["logits"] for f in futures]
    for i, g in enumerate(got):
        assert _close(g, want[i // 4])


def test_model_wise_uses_every_lane_by_share(demo_model):
    """Model-wise plans split requests between whole-model lanes by the offload ratio."""
    chooser = WeightedChooser([0.5, 0.25, 0.25])
    picks = [chooser.pick() for _ in range(400)]
    assert [picks.count(i) for i in range(3)] == [200, 100, 100]
    engine = Engine.build(demo_model, profile("model-wise", 0.5, ("fp16",)))
    assert [(lane.device, lane.request_share) for lane in engine.lanes()] == [("gpu", 0.5), ("dla0", 0.25), ("dla1", 0.25)]


@pytest.mark.parametrize("prefetch", [True, False])
def test_stream_matches_infer_and_isolates_bad_inputs(demo_model, prefetch):
    """stream() with the prefetch ring (or inline staging) gives infer()'s answers; a bad image fails alone."""
    samples = sorted((demo_model.parent / "samples").glob("*.jpg"))
    items = [*samples[:3], b"not an image", *samples[3:]]
    with Engine.build(demo_model, profile("layer-wise", 0.35, prefetch=prefetch), precision="fp32") as e:
        want = [e.infer({"input": e.stage([s])})["logits"] for s in samples]
        results = list(e.stream(items))
    assert len(results) == len(items)
    assert isinstance(results[3].error, InputError) and results[3].outputs is None
    good = [r for i, r in enumerate(results) if i != 3]
    for r, w, s in zip(good, want, samples):
        assert r.error is None and r.items == [s]
        assert _close(r.outputs["logits"], w)
        assert int(np.argmax(r.outputs["logits"])) == int(s.name.split("-")[1])


def test_prefetch_ring_bounds_lookahead():
    """The staging thread never runs more than `depth` buffers ahead of the consumer."""
    from k2edge.engine.prefetch import PrefetchRing

    staged = []
    two = threading.Event()

    def stage(items, buf):
        staged.append(items[0])
        if len(staged) == 2:
            two.set()
        buf[...] = items[0]

    ring = PrefetchRing((1,), 2, stage).start([[i] for i in range(10)])
    it = iter(ring)
    first = next(it)
    assert two.wait(10)
    # slot 0 held by us, slot 1 staged: no slot is free, so the staging thread cannot stage a third
    assert ring._free.qsize() == 0 and staged == [0, 1]
    ring.release(first.slot)
    rest = []
    for item in it:
        rest.append(float(ring.buffers[item.slot][0]))
        ring.release(item.slot)
    ring.close()
    assert rest == [float(i) for i in range(1, 10)]


def test_input_validation_and_lifecycle(demo_model, demo_batch):
    e = Engine.build(demo_model, "cpu-dev")
    with pytest.raises(EngineStateError, match="not active"):
        e.infer({"input": demo_batch[0]})
    with e:
        with pytest.raises(InputError, match=r"expected float32 \(1, 1, 32, 32\), got float32 \(1, 1, 28, 28\)"):
            e.infer({"input": np.zeros((1, 1, 28, 28), np.float32)})
        with pytest.raises(InputError, match="got float64"):
            e.infer({"input": demo_batch[0].astype(np.float64)})
        with pytest.raises(InputError, match=r"missing \['input'\], unexpected \['image'\]"):
            e.infer({"image": demo_batch[0]})
        with pytest.raises(EngineStateError, match="already active"):
            e.activate()
    assert not e.active


def test_int8_needs_calibration(tmp_path):
    """An INT8 profile without a calibration set says what to pass."""
    from k2edge import BuildError

    model = graphs.conv_chain()
    with pytest.raises(BuildError, match="needs a calibration set: pass --calib"):
        Engine.build(model, profile("layer-wise", 1.0, ("int8",)))


def test_second_build_is_all_cache_hits(demo_model, cache_dir):
    first = Engine.build(demo_model, "c2", cache_dir=cache_dir)
    assert first.info.cache_hits == {"int8": False, "engine": False}
    second = Engine.build(demo_model, "c2", cache_dir=cache_dir)
    assert second.info.cache_hits == {"int8": True, "engine": True}


def test_corrupted_cache_entry_is_rebuilt_not_used(demo_model, demo_batch, cache_dir, caplog):
    """Flipping a byte in a cached segment is caught by its checksum; the entry is rebuilt."""
    with Engine.build(demo_model, "c5", cache_dir=cache_dir) as e:
        want = e.infer({"input": demo_batch[0]})["logits"]
    seg = next((cache_dir / "onnxruntime").glob("*/segment0.onnx"))
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="k2edge.engine.cache"):
        e2 = Engine.build(demo_model, "c5", cache_dir=cache_dir)
    assert e2.info.cache_hits["engine"] is False
    assert "failed verification (segment0.onnx checksum mismatch); rebuilding" in caplog.text
    with e2:
        assert _close(e2.infer({"input": demo_batch[0]})["logits"], want)


def test_mismatched_or_truncated_entries_are_rebuilt(demo_model, cache_dir, caplog):
    Engine.build(demo_model, "c5", cache_dir=cache_dir)
    entry = next((cache_dir / "onnxruntime").iterdir())
    (entry / "manifest.json").write_text("{ truncated")
    with caplog.at_level(logging.WARNING, logger="k2edge.engine.cache"):
        assert Engine.build(demo_model, "c5", cache_dir=cache_dir).info.cache_hits["engine"] is False
    assert "unreadable manifest" in caplog.text
    (entry / "segment0.onnx").unlink()
    assert Engine.build(demo_model, "c5", cache_dir=cache_dir).info.cache_hits["engine"] is False


def test_top_k_uses_labels(demo_model, demo_batch):
    with Engine.build(demo_model, "cpu-dev") as e:
        top = e.top_k(e.infer({"input": demo_batch[0]})["logits"], 3)[0]
    assert [t["label"] for t in top] == [e.labels[t["index"]] for t in top]
    assert top[0]["score"] >= top[1]["score"] >= top[2]["score"] and abs(sum(t["score"] for t in top)) <= 1.0 + 1e-6


def test_backend_failure_is_one_k2edge_error():
    """A model that normalises but that ONNX Runtime cannot run fails with InferenceError, not a traceback."""
    import onnx

    from k2edge import InferenceError

    model = graphs.conv_chain()
    # conv0's weight expects 5 input channels while x has 3: shape inference lets it through
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.zeros((8, 5, 3, 3), np.float32), "w0"))
    with Engine.build(model, "cpu-dev") as engine:
        x = np.zeros((1, 3, 16, 16), np.float32)
        with pytest.raises(InferenceError, match=r"segment 0 on gpu \(cpu lane\) failed"):
            engine.infer({"x": x})
        with pytest.raises(InferenceError):
            engine.submit({"x": x}).result(timeout=30)


def test_model_wise_engine_routes_requests_by_share(demo_model, demo_batch):
    """Through a real engine: 400 submitted requests land on the whole-model lanes 50/25/25."""
    engine = Engine.build(demo_model, profile("model-wise", 0.5, ("fp16",)), precision="fp32")
    with engine:
        futures = [engine.submit({"input": demo_batch[i % len(demo_batch)]}) for i in range(400)]
        for f in futures:
            f.result(timeout=60)
        assert {lane.device: lane.runs for lane in engine.lanes()} == {"gpu": 200, "dla0": 100, "dla1": 100}
