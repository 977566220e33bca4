"""The TensorRT backend: contract tests against a recording test double of TensorRT 10 and pycuda
(tests/support/trt_double.py; no machine here has TensorRT, a GPU or a DLA), pure tests of the plan ->
builder-settings mapping and the placement reader, and ``gpu`` tests that run the prefetch ring on a
real CUDA device where pycuda and one exist."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from trt_double import TrtDouble
from k2edge import BackendUnavailable, BuildError, Engine, load_profile
from k2edge.dla.planner import plan_partition
from k2edge.engine.trt_placement import PlacementReport, observed_placement
from k2edge.engine.trt_spec import (TargetFacts, boundary_formats, engine_key, segment_specs, tensor_nbytes,
                                    trt_version_code)
from k2edge.model.ingest import normalise

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "digits" / "model.onnx"
SELFTEST = ROOT / "tools" / "jetson-selftest"


@pytest.fixture(scope="module")
def demo():
    return normalise(MODEL)


@pytest.fixture
def trt(monkeypatch):
    """The TensorRT/pycuda test double, installed in sys.modules for one test."""
    from k2edge.engine.trt_cuda import release_primary_contexts

    double = TrtDouble().install(monkeypatch)
    yield double
    double.gpu.resume()
    release_primary_contexts()  # what atexit does at the end of a process
    double.shutdown()


def profile(partition="layer-wise", ratio=0.35, chain=("fp16",), **extra):
    return load_profile({"edge_runtime": {"tensorrt_partition": partition, "offload_ratio": ratio,
                                          "precision_fallback": list(chain), **extra}})


def build(prof, cache_dir, **kw):
    return Engine.build(MODEL, prof, backend="tensorrt", cache_dir=cache_dir, **kw)


def batch(seed=0):
    return np.random.default_rng(seed).standard_normal((1, 1, 32, 32)).astype(np.float32)


def close(a, b, rel=1e-2):
    return np.abs(a - b).max() <= rel * max(np.abs(b).max(), 1e-30)


def builds_by_segment(double):
    """The last build configuration of each segment network (``segment<i>_<device>``)."""
    return {b["network"]: b for b in double.builds}


# ------------------------------------------------------------------------------------------------
# the plan -> builder settings mapping (pure)

def test_spec_dla_core_fallback_and_pools_follow_plan_and_profile(demo):
    """dla0 -> DLA_core 0, dla1 -> 1, GPU fallback and the profile's pool limits on DLA engines only."""
    pools = {"managed_sram": 1 << 19, "local_dram": 1 << 28, "global_dram": 1 << 27}
    prof = profile(dla_memory_pools=pools)
    specs = segment_specs(plan_partition(demo, prof), demo.graph, have_quant=False)
    assert [s.device for s in specs] == ["gpu", "dla0", "dla1", "gpu"]
    assert [(s.default_device, s.dla_core, s.gpu_fallback) for s in specs] == [
        ("GPU", None, False), ("DLA", 0, True), ("DLA", 1, True), ("GPU", None, False)]
    assert dict(specs[1].memory_pools) == {"DLA_MANAGED_SRAM": 1 << 19, "DLA_LOCAL_DRAM": 1 << 28, "DLA_GLOBAL_DRAM": 1 << 27}
    assert specs[0].memory_pools == () and specs[0].gpu_layers == ()
    off = profile(gpu_fallback=False)
    assert not any(s.gpu_fallback for s in segment_specs(plan_partition(demo, off), demo.graph, False))


def test_spec_model_wise_dla_engines_keep_planned_gpu_nodes_on_the_gpu(demo):
    """Model-wise DLA engines set the plan's gpu_fallback_nodes to the GPU, layer by layer."""
    prof = load_profile("c6")
    plan = plan_partition(demo, prof)
    specs = segment_specs(plan, demo.graph, False)
    assert specs[0].gpu_layers == ()
    for seg, spec in zip(plan.segments[1:], specs[1:]):
        assert spec.gpu_layers == seg.gpu_fallback_nodes and spec.gpu_layers
        assert all(dict(spec.planned)[n] == "gpu" for n in spec.gpu_layers)
        assert sum(1 for _, where in spec.planned if where == "dla") == len(seg.nodes) - len(seg.gpu_fallback_nodes)


def test_spec_precision_flags_and_int8_source(demo):
    """FP16/INT8 flags from the chain; INT8 from the calibration cache on the DLA and on a GPU engine that shares
    an INT8 cut with it (an INT8 I/O tensor needs the same scale on both sides), from Q/DQ on a GPU-only plan."""
    c2 = load_profile("c2")
    specs = segment_specs(plan_partition(demo, c2), demo.graph, have_quant=True)
    by_device = {s.device: s for s in specs}
    assert (by_device["dla0"].int8, by_device["dla0"].fp16, by_device["dla0"].int8_source) == (True, True, "calibration-cache")
    assert (by_device["gpu"].int8, by_device["gpu"].fp16, by_device["gpu"].int8_source) == (True, False, "calibration-cache")
    assert any(dtype == "int8" for _, dtype, _ in by_device["gpu"].io_formats)
    gpu_only = profile("layer-wise", 1.0, ("int8",))
    (alone,) = segment_specs(plan_partition(demo, gpu_only), demo.graph, have_quant=True)
    assert (alone.int8, alone.int8_source, alone.io_formats) == (True, "qdq", ())
    c5 = load_profile("c5")
    (gpu,) = segment_specs(plan_partition(demo, c5), demo.graph, False)
    assert (gpu.fp16, gpu.int8, gpu.int8_source, gpu.layer_precision) == (True, False, None, ())
    ref = plan_partition(demo, c5, precision="fp32")
    assert segment_specs(ref, demo.graph, False)[0].precision_label == "fp32"
    with pytest.raises(BuildError, match="no calibration"):
        segment_specs(plan_partition(demo, c2), demo.graph, have_quant=False)


def test_spec_refuses_fp32_reference_mode_on_a_dla(demo):
    """precision fp32 with DLA segments: a clear BuildError, a real DLA cannot run FP32."""
    prof = load_profile("c1")
    with pytest.raises(BuildError, match=r"runs FP16 and INT8 only.*reference mode of --backend onnxruntime"):
        segment_specs(plan_partition(demo, prof, precision="fp32"), demo.graph, False)


def test_spec_per_layer_precision_only_where_a_segment_mixes(demo):
    """Mixed segments get per-layer constraints; explicitly quantised INT8 layers are left to their Q/DQ nodes."""
    c2 = load_profile("c2")
    plan = plan_partition(demo, c2)
    segs = list(plan.segments)
    for i, seg in enumerate(segs):
        first = seg.nodes[-1]
        segs[i] = dataclasses.replace(seg, layer_precision={**seg.layer_precision, first: "fp16"})
    specs = segment_specs(dataclasses.replace(plan, segments=tuple(segs)), demo.graph, True)
    gpu = next(s for s in specs if s.device == "gpu")
    dla = next(s for s in specs if s.device == "dla0")
    assert gpu.layer_precision == ((segs[gpu.index].nodes[-1], "fp16"),) and gpu.precision_constraints and gpu.fp16
    assert len(dla.layer_precision) == len(segs[dla.index].nodes) and ("int8" in dict(dla.layer_precision).values())


def test_boundary_formats_are_dla_native_at_cuts_only(demo):
    """Cut tensors next to a DLA travel as FP16 kCHW16, or INT8 kCHW32 where every adjacent layer runs INT8
    (NvInferRuntimeBase.h: the DLA's native FP16 / INT8 formats); model I/O stays FP32 linear."""
    c1 = load_profile("c1")
    plan = plan_partition(demo, c1)
    formats = boundary_formats(plan, demo.graph)
    cuts = {t for s in plan.segments for t in s.inputs} - {"input"}
    assert set(formats) == cuts and set(formats.values()) == {("fp16", "CHW16")}
    c2 = plan_partition(demo, load_profile("c2"))
    assert set(boundary_formats(c2, demo.graph).values()) == {("int8", "CHW32")}
    # an adjacent layer that is not INT8 (here forced to FP16) keeps its cut FP16
    seg, t = next((s, t) for s in c2.segments if s.kind == "dla" for t in s.inputs if t != "input")
    reader = next(n for n in seg.nodes if t in demo.graph.by_name[n].inputs)
    mixed = dataclasses.replace(seg, layer_precision={**seg.layer_precision, reader: "fp16"})
    mixed_plan = dataclasses.replace(c2, segments=tuple(mixed if s.index == seg.index else s for s in c2.segments))
    assert boundary_formats(mixed_plan, demo.graph)[t] == ("fp16", "CHW16")
    assert boundary_formats(plan_partition(demo, load_profile("c3")), demo.graph) == {}
    assert boundary_formats(plan_partition(demo, load_profile("c5")), demo.graph) == {}


def test_engine_key_covers_model_plan_precision_tensorrt_l4t_and_device(demo):
    """The cache key changes with the TensorRT version, L4T release, compute capability, DLA core and precision."""
    prof = load_profile("c1")
    specs = segment_specs(plan_partition(demo, prof), demo.graph, False)
    facts = TargetFacts("10.3.0.30", "R36.4.3", "8.7")
    base = engine_key("a" * 64, specs[1], "{}", facts)
    assert base == engine_key("a" * 64, specs[1], "{}", TargetFacts("10.3.0.30", "R36.4.3", "8.7"))
    variants = [
        engine_key("b" * 64, specs[1], "{}", facts),
        engine_key("a" * 64, specs[1], '{"x": 1}', facts),
        engine_key("a" * 64, specs[1], "{}", dataclasses.replace(facts, tensorrt="10.3.0.31")),
        engine_key("a" * 64, specs[1], "{}", dataclasses.replace(facts, l4t="R36.4.4")),
        engine_key("a" * 64, specs[1], "{}", dataclasses.replace(facts, compute_capability="8.6")),
        engine_key("a" * 64, dataclasses.replace(specs[1], device="dla1", dla_core=1), "{}", facts),
        engine_key("a" * 64, dataclasses.replace(specs[1], int8=True), "{}", facts),
        engine_key("a" * 64, specs[1], "{}", facts, calibration_sha256="c" * 64),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_version_codes_and_vectorised_buffer_sizes():
    assert trt_version_code("10.3.0.30") == 100300 and trt_version_code("8.6.2") == 8602
    assert tensor_nbytes((1, 20, 8, 8), 2, vectorized_dim=1, components=16) == 1 * 32 * 8 * 8 * 2
    assert tensor_nbytes((1, 20, 8, 8), 4) == 20 * 8 * 8 * 4


# ------------------------------------------------------------------------------------------------
# the engine inspector's placement (pure)

ORDER = ["conv0", "relu0", "conv1", "relu1", "gap", "fc"]


@pytest.mark.parametrize("layers, dla_engine, want", [
    # TensorRT 10 metadata on fused GPU layers
    ([{"Name": "conv0 + relu0", "LayerType": "CaskConvolution", "Metadata": "[ONNX Layer: conv0]\x1f[ONNX Layer: relu0]"}],
     False, {"conv0": "gpu", "relu0": "gpu"}),
    # a DLA loadable named by its first and last layer, DLA memory reformats skipped
    ([{"Name": "x to nvm", "LayerType": "Reformat"}, {"Name": "{ForeignNode[conv0...relu1]}", "LayerType": "ForeignNode"},
      {"Name": "relu1 from nvm", "LayerType": "Reformat"}, {"Name": "gap", "LayerType": "Reduce"}],
     True, {"conv0": "dla", "relu0": "dla", "conv1": "dla", "relu1": "dla", "gap": "gpu"}),
    # Myelin also names GPU subgraphs ForeignNode
    ([{"Name": "{ForeignNode[gap...fc]}", "LayerType": "Myelin"}], True, {"gap": "gpu", "fc": "gpu"}),
    # LAYER_NAMES_ONLY: bare names, parser suffixes
    (["conv0", "fc_matmul"], False, {"conv0": "gpu", "fc": "gpu"}),
])
def test_observed_placement_reads_the_inspector(layers, dla_engine, want):
    assert observed_placement(json.dumps({"Layers": layers}), ORDER, dla_engine) == want


def test_placement_report_names_disagreements():
    report = PlacementReport(1, "dla0", {"conv0": "dla", "relu0": "dla", "gap": "gpu"},
                             {"conv0": "gpu", "relu0": "dla"}, cannot_run_on_dla=["conv0"])
    assert report.moved == {"conv0": ("dla", "gpu")} and report.unobserved == ["gap"] and not report.agrees
    text = " ".join(report.disagreements())
    assert "cannot run 1 node(s)" in text and "conv0" in text and "on the GPU that the plan put on the DLA" in text


# ------------------------------------------------------------------------------------------------
# the builder, against the test double

def test_builder_applies_a_layer_wise_plan(trt, cache_dir):
    """c1: one engine per segment with its device, DLA core, fallback, pools, FP16 and DLA-native cut formats."""
    engine = build("c1", cache_dir)
    got = builds_by_segment(trt)
    assert set(got) == {"segment0_gpu", "segment1_dla0", "segment2_dla1", "segment3_gpu"}
    pools = {"DLA_MANAGED_SRAM": 1 << 20, "DLA_LOCAL_DRAM": 1 << 30, "DLA_GLOBAL_DRAM": 1 << 29}
    for name, core in (("segment1_dla0", 0), ("segment2_dla1", 1)):
        b = got[name]
        assert (b["default_device"], b["dla_core"], b["pools"]) == ("DLA", core, pools)
        assert {"GPU_FALLBACK", "FP16"} <= set(b["flags"]) and "INT8" not in b["flags"]
        assert all(device == "DLA" for _, _, device in b["placement"])
    for name in ("segment0_gpu", "segment3_gpu"):
        b = got[name]
        assert (b["default_device"], b["dla_core"], b["pools"], b["flags"]) == ("GPU", None, {}, ["FP16"])
    cut = engine.plan.segments[1].inputs
    for t in cut:
        assert got["segment1_dla0"]["io"][t] | {"shape": None} == {"shape": None, "dtype": "HALF", "format": "CHW16", "mode": "INPUT"}
        assert got["segment0_gpu"]["io"][t]["format"] == "CHW16"
    assert got["segment0_gpu"]["io"]["input"]["dtype"] == "FLOAT" and got["segment3_gpu"]["io"]["logits"]["format"] == "LINEAR"
    assert all(b["verbosity"] == "DETAILED" for b in trt.builds)
    assert ("config.DLA_core", 1) in trt.calls and ("config.default_device_type", "DLA") in trt.calls
    assert [c for c in trt.find("config.set_flag") if c[1] == "GPU_FALLBACK"] == [("config.set_flag", "GPU_FALLBACK")] * 2


def test_model_wise_dla_engines_set_gpu_layers(trt, cache_dir):
    """c6: whole-model DLA engines hand the plan's fallback nodes to the GPU with set_device_type."""
    engine = build("c6", cache_dir)
    fallback = engine.plan.segments[1].gpu_fallback_nodes
    got = builds_by_segment(trt)
    assert got["segment0_gpu"]["gpu_layers"] == []
    for name, core in (("segment1_dla0", 0), ("segment2_dla1", 1)):
        assert got[name]["gpu_layers"] == sorted(fallback) and got[name]["dla_core"] == core
        placed = {n: dev for n, _, dev in got[name]["placement"]}
        assert {n for n, dev in placed.items() if dev == "GPU"} == set(fallback)
    assert len(trt.find("config.set_device_type")) == 2 * len(fallback)
    assert all(call[2] == "GPU" for call in trt.find("config.set_device_type"))


def test_int8_dla_takes_the_calibration_cache_gpu_takes_qdq(trt, cache_dir):
    """c2: DLA INT8 engines get a calibrator reading this TensorRT's cache of the segment's tensors, and so does the
    GPU engine that shares an INT8 CHW32 cut with them; a GPU-only INT8 plan takes the Q/DQ model."""
    engine = build("c2", cache_dir)
    got = builds_by_segment(trt)
    for name in ("segment0_dla0", "segment1_dla1", "segment2_gpu"):
        b = got[name]
        assert "INT8" in b["flags"]
        lines = b["calibration_cache"].splitlines()
        assert lines[0] == "TRT-100300-EntropyCalibration2"
        seg = engine.plan.segments[int(name[7])]
        tensors = {line.rpartition(": ")[0] for line in lines[1:]}
        assert set(seg.inputs) <= tensors and set(seg.outputs) <= tensors
    for name in ("segment0_dla0", "segment1_dla1"):
        assert "FP16" in got[name]["flags"] and not any(dev == "GPU" for _, _, dev in got[name]["placement"])
    cut = engine.plan.segments[2].inputs[0]
    for name in ("segment1_dla1", "segment2_gpu"):
        assert (got[name]["io"][cut]["dtype"], got[name]["io"][cut]["format"]) == ("INT8", "CHW32")
    assert [c[1] for c in trt.find("config.int8_calibrator")] == ["IInt8EntropyCalibrator2"] * 3
    trt.builds.clear()
    build(profile("layer-wise", 1.0, ("int8",)), cache_dir)
    (alone,) = trt.builds
    assert "INT8" in alone["flags"] and alone["calibration_cache"] is None
    assert any(kind == "QuantizeLinear" for _, kind, _ in alone["placement"])


def test_fp32_reference_mode_with_dla_segments_is_refused(trt, cache_dir):
    with pytest.raises(BuildError, match="a real DLA runs FP16 and INT8 only"):
        build("c1", cache_dir, precision="fp32")
    assert trt.builds == []


def test_placement_is_saved_and_a_disagreement_reported(trt, cache_dir, caplog):
    """A node TensorRT refuses on the DLA: the inspector shows it on the GPU, the build notes and log say so."""
    c1 = load_profile("c1")
    refused = plan_partition(normalise(MODEL), c1).segments[1].nodes[2]
    trt.dla_refuses = {refused}
    with caplog.at_level(logging.WARNING):
        engine = build(c1, cache_dir)
    notes = " ".join(engine.info.notes)
    assert f"cannot run 1 node(s) the plan puts on the DLA ({refused})" in notes
    assert "runs 1 node(s) on the GPU that the plan put on the DLA" in notes
    assert refused in caplog.text
    seg = engine.describe()["segments"][1]
    saved = json.loads((Path(seg["engine"]) / "placement.json").read_text())
    assert saved["moved"] == {refused: "dla->gpu"} and saved["observed_devices"][refused] == "gpu"
    assert seg["placement"]["cannot_run_on_dla"] == [refused]
    assert all((Path(s["engine"]) / "placement.json").is_file() for s in engine.describe()["segments"])


def test_a_dla_refusal_without_gpu_fallback_fails_clearly(trt, cache_dir):
    prof = profile(gpu_fallback=False)
    trt.dla_refuses = set(plan_partition(normalise(MODEL), prof).segments[1].nodes[:1])
    with pytest.raises(BuildError, match="gpu_fallback is off"):
        build(prof, cache_dir)


def test_plan_needing_more_dla_cores_than_present_fails(trt, cache_dir):
    trt.dla_cores = 1
    with pytest.raises(BuildError, match="uses dla1 but TensorRT reports 1 DLA core"):
        build("c1", cache_dir)


# ------------------------------------------------------------------------------------------------
# the runtime, against the test double

@pytest.mark.parametrize("prof", ["c1", "c5", "c6"])
def test_outputs_match_onnxruntime(trt, cache_dir, prof):
    """Split, GPU-only and model-wise plans compute the FP32 reference's outputs (FP16 at the cuts)."""
    with build(prof, cache_dir) as e, Engine.build(MODEL, "cpu-dev", backend="onnxruntime", cache_dir=cache_dir) as ref:
        for seed in range(3):
            x = batch(seed)
            want = ref.infer({"input": x})["logits"]
            assert close(e.infer({"input": x})["logits"], want)
        xs = [batch(s) for s in range(12)]
        futures = [e.submit({"input": x}) for x in xs]
        for x, f in zip(xs, futures):
            assert close(f.result(timeout=30)["logits"], ref.infer({"input": x})["logits"])
        assert {lane.label for lane in e.lanes()} >= {"gpu"}


@pytest.mark.parametrize("prefetch", [True, False])
def test_engine_stream_in_order(trt, cache_dir, demo_eval, prefetch):
    """Engine.stream, with the prefetch ring's buffers or staging inline, gets every result back in order."""
    with build("c1", cache_dir) as e, Engine.build(MODEL, "cpu-dev", backend="onnxruntime", cache_dir=cache_dir) as ref:
        items = list(demo_eval.samples[:10])
        got = [r.outputs["logits"] for r in e.stream(items, prefetch=prefetch)]
        want = [r.outputs["logits"] for r in ref.stream(items)]
    assert len(got) == 10 and all(close(g, w) for g, w in zip(got, want))


def _copy_events(calls, start=0):
    """(host buffer id, copy stream, event) per host-to-device copy, with the event recorded right after it."""
    out = []
    for i in range(start, len(calls)):
        if calls[i][0] == "cuda.memcpy_htod_async":
            rec = next(c for c in calls[i + 1:] if c[0] == "event.record")
            assert rec[2] == calls[i][3]
            out.append((calls[i][2], calls[i][3], rec[1], i))
    return out


def test_prefetch_copy_of_the_next_request_overlaps_compute(trt, cache_dir):
    """With the device held, request 2's copy is enqueued before request 1's compute has finished."""
    with build("c5", cache_dir) as e:
        trt.gpu.pause()
        mark = len(trt.calls)
        f1, f2 = e.submit({"input": batch(1)}), e.submit({"input": batch(2)})
        copies = _copy_events(trt.calls, mark)
        assert len(copies) == 2 and not trt.index(lambda c: c[:2] == ("done", "execute"))
        trt.gpu.resume()
        r1, r2 = f1.result(timeout=30), f2.result(timeout=30)
        first_compute_done = trt.index(lambda c: c[:2] == ("done", "execute"))[0]
        assert copies[1][3] < first_compute_done
        assert not np.allclose(r1["logits"], r2["logits"])


def test_compute_stream_waits_on_the_copy_event(trt, cache_dir):
    """Each request: copy on the copy stream, event recorded, compute stream waits on it, then executes."""
    with build("c5", cache_dir) as e:
        mark = len(trt.calls)
        for s in range(3):
            e.infer({"input": batch(s)})
        calls = trt.calls[mark:]
    for host, copy_stream, event, at in _copy_events(calls):
        wait = next(j for j in range(at, len(calls)) if calls[j][0] == "stream.wait_for_event" and calls[j][2] == event)
        execute = next(j for j in range(at, len(calls)) if calls[j][0] == "context.execute_async_v3")
        assert wait < execute and calls[wait][1] == calls[execute][2] != copy_stream


def test_host_slot_is_reused_only_after_its_copy_event(trt, cache_dir):
    """prefetch_depth 1: request 2 waits for request 1's copy event before reusing the staging buffer."""
    prof = profile("block-wise", 1.0, dma_prefetch=True, prefetch_depth=1)
    with build(prof, cache_dir) as e:
        trt.gpu.pause()
        mark = len(trt.calls)
        f1 = e.submit({"input": batch(1)})
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("f2", e.submit({"input": batch(2)})))
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and len(_copy_events(trt.calls, mark)) == 1  # held: the only staging slot is still copying
        trt.gpu.resume()
        t.join(timeout=30)
        calls = trt.calls[mark:]
        (h1, _, e1, at1), (h2, _, _, at2) = _copy_events(calls)
        assert h1 == h2
        sync = [j for j, c in enumerate(calls) if c == ("event.synchronize", e1) and j > at1]
        assert sync and sync[0] < at2
        assert close(f1.result(timeout=30)["logits"], e.infer({"input": batch(1)})["logits"], 1e-6)
        assert close(box["f2"].result(timeout=30)["logits"], e.infer({"input": batch(2)})["logits"], 1e-6)


def test_segments_run_on_their_device_streams_in_order(trt, cache_dir):
    """c1: GPU, DLA0, DLA1 streams; each segment waits on the previous segment's event."""
    with build("c1", cache_dir) as e:
        mark = len(trt.calls)
        e.infer({"input": batch()})
        calls = trt.calls[mark:]
    executes = [(i, c) for i, c in enumerate(calls) if c[0] == "context.execute_async_v3"]
    assert [c[1] for _, c in executes] == ["segment0_gpu", "segment1_dla0", "segment2_dla1", "segment3_gpu"]
    streams = [c[2] for _, c in executes]
    assert streams[0] == streams[3] and len(set(streams)) == 3
    for (i, prev), (j, cur) in zip(executes, executes[1:]):
        recorded = next(c for c in calls[i:j] if c[0] == "event.record" and c[2] == prev[2])
        assert ("stream.wait_for_event", cur[2], recorded[1]) in calls[i:j]


def test_without_prefetch_the_copy_runs_on_the_compute_stream(trt, cache_dir):
    with build(profile("block-wise", 1.0, dma_prefetch=False), cache_dir) as e:
        mark = len(trt.calls)
        e.infer({"input": batch()})
        calls = trt.calls[mark:]
    (_, copy_stream, _, _), = _copy_events(calls)
    assert copy_stream == next(c for c in calls if c[0] == "context.execute_async_v3")[2]


def test_zero_copy_maps_the_staging_buffers(trt, cache_dir, monkeypatch):
    """K2EDGE_TRT_ZERO_COPY: mapped page-locked inputs, read in place, no host-to-device copy."""
    monkeypatch.setenv("K2EDGE_TRT_ZERO_COPY", "1")
    with build("c5", cache_dir) as e, Engine.build(MODEL, "cpu-dev", backend="onnxruntime", cache_dir=cache_dir) as ref:
        assert e.describe()["prefetch"]["mode"] == "zero-copy"
        mark = len(trt.calls)
        for s in range(3):
            assert close(e.infer({"input": batch(s)})["logits"], ref.infer({"input": batch(s)})["logits"])
        calls = trt.calls[mark:]
    assert not [c for c in calls if c[0] == "cuda.memcpy_htod_async"]
    mapped = {c[1] for c in trt.find("host.get_device_pointer")}
    assert {c[3] for c in calls if c[0] == "context.set_tensor_address" and c[2] == "input"} <= mapped
    assert any(c[4] == 2 for c in trt.find("cuda.pagelocked_empty"))  # DEVICEMAP


# ------------------------------------------------------------------------------------------------
# the engine cache

def test_second_build_is_a_cache_hit(trt, cache_dir):
    build("c1", cache_dir)
    n = len(trt.builds)
    again = build("c1", cache_dir)
    assert again.info.cache_hits["engine"] is True and len(trt.builds) == n


def test_tensorrt_l4t_and_gpu_changes_rebuild(trt, cache_dir, monkeypatch, caplog):
    """A new TensorRT version, L4T release or GPU gives new keys, hence new engines, and the log says what changed."""
    build("c5", cache_dir)
    trt.tensorrt.__version__ = "10.3.0.31"
    with caplog.at_level(logging.INFO):
        assert build("c5", cache_dir).info.cache_hits["engine"] is False
    assert "tensorrt 10.3.0.30 -> 10.3.0.31" in caplog.text
    monkeypatch.setattr("k2edge.engine.probe.l4t_release", lambda root=None: "R36.4.4")
    with caplog.at_level(logging.INFO):
        assert build("c5", cache_dir).info.cache_hits["engine"] is False
    assert "l4t None -> R36.4.4" in caplog.text
    trt.compute_capability = (8, 6)
    assert build("c5", cache_dir).info.cache_hits["engine"] is False
    assert build("c5", cache_dir).info.cache_hits["engine"] is True
    assert len(trt.builds) == 4


def test_corrupted_engine_is_caught_by_checksum_before_deserialisation(trt, cache_dir, caplog):
    """A damaged engine file in the cache is rebuilt with a log line; TensorRT never sees its bytes."""
    engine = build("c5", cache_dir)
    plan_file = Path(engine.describe()["segments"][0]["engine"]) / "engine.plan"
    corrupted = bytearray(plan_file.read_bytes())
    corrupted[-10:] = b"\0" * 10
    plan_file.write_bytes(bytes(corrupted))
    import hashlib

    bad = hashlib.sha256(bytes(corrupted)).hexdigest()
    with caplog.at_level(logging.WARNING):
        again = build("c5", cache_dir)
        with again:
            again.infer({"input": batch()})
    assert "failed verification (engine.plan checksum mismatch); rebuilding" in caplog.text
    assert again.info.cache_hits["engine"] is False
    assert bad not in {c[1] for c in trt.find("runtime.deserialize_cuda_engine")}


def test_engine_changed_between_build_and_activate_is_rebuilt(trt, cache_dir, caplog):
    engine = build("c5", cache_dir)
    plan_file = Path(engine.describe()["segments"][0]["engine"]) / "engine.plan"
    changed = plan_file.read_bytes()[:-5] + b"xxxxx"
    plan_file.write_bytes(changed)
    import hashlib

    with caplog.at_level(logging.WARNING), engine:
        engine.infer({"input": batch()})
    assert "checksum mismatch" in caplog.text and "rebuilding" in caplog.text
    assert hashlib.sha256(changed).hexdigest() not in {c[1] for c in trt.find("runtime.deserialize_cuda_engine")}
    assert len(trt.builds) == 2


def test_version_tag_mismatch_rebuilds_with_a_log_line(trt, cache_dir, caplog):
    """An engine serialised by another TensorRT ("version tag does not match") is rebuilt, and the log says why."""
    engine = build("c5", cache_dir)
    trt.serialization_version += 1  # e.g. a JetPack upgrade the key did not see
    with caplog.at_level(logging.WARNING), engine:
        out = engine.infer({"input": batch()})
    assert "Version tag does not match" in caplog.text and "rebuilding it" in caplog.text
    assert len(trt.builds) == 2 and out["logits"].shape == (1, 10)


# ------------------------------------------------------------------------------------------------
# selection, imports, the self-test

def test_auto_prefers_tensorrt_where_it_exists(trt):
    from k2edge.engine.backends import resolve_backend

    assert resolve_backend("auto") == "tensorrt"


def test_backend_without_tensorrt_says_what_to_install(monkeypatch, demo, cache_dir):
    from k2edge.engine.cache import EngineCache
    from k2edge.engine.tensorrt_backend import create_backend

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    c5 = load_profile("c5")
    with pytest.raises(BackendUnavailable, match="python3-libnvinfer"):
        create_backend(demo, plan_partition(demo, c5), None, EngineCache(cache_dir), c5, (), ("logits",))


def _selftest():
    loader = importlib.machinery.SourceFileLoader("jetson_selftest", str(SELFTEST))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("jetson_selftest", loader))
    loader.exec_module(module)
    return module


def test_selftest_exits_2_without_tensorrt():
    proc = subprocess.run([sys.executable, str(SELFTEST)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "TensorRT and pycuda are not installed here" in proc.stderr and "Traceback" not in proc.stderr


def test_selftest_against_the_double(trt, cache_dir, capsys):
    """The self-test builds the profiles, compares with ONNX Runtime and prints the table; a mismatch exits 1."""
    rc = _selftest().main(["--profiles", "c5,c6", "--samples", "6", "--cache", str(cache_dir), "--skip-streams",
                           "--skip-pycuda-tests"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "gpu:fp16 dla0:fp16 dla1:fp16" in out and "as planned" in out and "p50 ms" in out
    for check in ("direct-io", "chw32-cuts", "batch-profiles", "event-flags"):
        assert f"check {check}: ok" in out, out
    rc = _selftest().main(["--profiles", "c2", "--samples", "6", "--cache", str(cache_dir), "--tolerance", "0", "--skip-streams",
                           "--skip-pycuda-tests"])
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH" in out
    # per INT8 profile: the INT8 share TensorRT built (the double's inspector reports each layer's input data type)
    # beside the plan's: the GPU segment's layers are INT8 as planned; the DLA loadables do not report their layers'
    # precisions (unobserved). A real engine is checked on a Jetson only.
    assert "INT8 share, k2edge plan" in out and "INT8 share, TensorRT built" in out
    row = next(line for line in out.splitlines() if line.startswith("c2 ") and "top-1 agree (" in line)
    assert "int8 100.0 %" in row and "unobserved" in row and "fp16" not in row.split("top-1")[0], row


# ------------------------------------------------------------------------------------------------
# the prefetch ring on a real CUDA device (pycuda without TensorRT)

def _cuda_or_skip():
    try:
        import pycuda.driver as cuda

        cuda.init()
        if cuda.Device.count() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:  # ImportError, or pycuda present without a driver or device
        pytest.skip(f"needs pycuda and a CUDA device: {exc}")
    return cuda


class _IdentityContext:
    """Stands in for an IExecutionContext: 'computes' y = x with a device-to-device copy on the given stream."""

    def __init__(self, cuda, nbytes):
        self.cuda, self.nbytes, self.addr, self.streams = cuda, nbytes, {}, {}

    def set_input_shape(self, name, shape):
        return True

    def set_tensor_address(self, name, ptr):
        self.addr[name] = ptr

    def execute_async_v3(self, handle):
        self.cuda.memcpy_dtod_async(self.addr["y"], self.addr["x"], self.nbytes, self.streams[handle])
        return True


@pytest.mark.gpu
@pytest.mark.parametrize("zero_copy", [False, True])
def test_real_prefetch_ring_keeps_requests_apart(zero_copy):
    """Many requests through the ring on a real GPU: every result is its own input (copies and compute ordered)."""
    cuda = _cuda_or_skip()
    from k2edge.engine.trt_runtime import BoundTensor, LoadedSegment, StreamPipeline

    shape = (64, 1024)
    nbytes = int(np.prod(shape)) * 4
    from k2edge.dla.planner import Routing
    from k2edge.engine.trt_cuda import primary_context

    ctx = primary_context(cuda)
    identity = _IdentityContext(cuda, nbytes)
    tensors = {n: BoundTensor(n, shape, np.dtype(np.float32), nbytes) for n in ("x", "y")}
    routing = Routing(((0,),), None, (0,), ("gpu",))
    pipe = StreamPipeline(cuda, ctx, [LoadedSegment(0, "gpu", None, identity, ("x",), ("y",))], routing, tensors,
                          ("x",), ("y",), depth=2, slots=3, zero_copy=zero_copy).start()
    identity.streams = {s.handle: s for s in pipe._streams.values()}
    try:
        futures = [pipe.submit({"x": np.full(shape, i, np.float32)}) for i in range(32)]
        for i, f in enumerate(futures):
            assert (f.result(timeout=30)["y"] == i).all()
    finally:
        pipe.stop()


# ------------------------------------------------------------------------------------------------
# what `k2edge doctor` reports for the backend

def test_doctor_reports_cuda_jetpack_and_tensorrt_dla_cores(tmp_path):
    from k2edge.engine.probe import cuda_version, doctor_report, jetpack_release

    (tmp_path / "usr/local/cuda").mkdir(parents=True)
    (tmp_path / "usr/local/cuda/version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "12.6.68"}}')
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.3, GCID: 1, BOARD: generic, EABI: aarch64\n")
    assert cuda_version(tmp_path) == "12.6.68" and cuda_version(tmp_path / "nowhere") is None
    assert jetpack_release("R36.4.3") == "6.2" and jetpack_release("R36.4") == "6.1" and jetpack_release(None) is None
    report = doctor_report(tmp_path)
    assert (report["cuda"], report["l4t"], report["jetpack"]) == ("12.6.68", "R36.4.3", "6.2")
    assert "dla_cores" in report["backends"]["tensorrt"]


# ------------------------------------------------------------------------------------------------
# what the stricter double refuses, and that the backend does not trip over it

def test_cuda_calls_need_the_context_pushed_in_their_thread(trt, cache_dir, monkeypatch):
    """Every pycuda call runs with the primary context current in its thread; without the push the double
    refuses the call as pycuda does (LogicError: invalid device context)."""
    with build("c1", cache_dir) as e:
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("out", e.infer({"input": batch()})))
        t.start()
        t.join(timeout=30)
        assert box["out"]["logits"].shape == (1, 10)
    assert trt.context_errors == []
    assert trt.find("cuda.Event")
    with pytest.raises(trt.driver.LogicError, match="invalid device context"):
        trt.driver.Event()
    with pytest.raises(trt.driver.LogicError, match="cannot pop"):
        trt.driver.Context.pop()

    import contextlib

    from k2edge.engine.trt_runtime import StreamPipeline

    monkeypatch.setattr(StreamPipeline, "current", lambda self: contextlib.nullcontext())
    with pytest.raises(trt.driver.LogicError, match="invalid device context"):
        build("c5", cache_dir).activate()  # a pipeline that forgot to push fails


def test_primary_context_is_retained_once_and_released_once(trt, cache_dir):
    """Activate and deactivate engines from different threads: one retain for the process, one release at exit
    (pycuda's detach() from a thread where the context is not current releases nothing)."""
    from k2edge.engine.trt_cuda import release_primary_contexts

    engines = [build(p, cache_dir) for p in ("c5", "c1")]
    for e in engines:
        e.activate()
    stoppers = [threading.Thread(target=e.deactivate) for e in engines]
    for s in stoppers:
        s.start()
    for s in stoppers:
        s.join(timeout=30)
    assert trt.primary_retains == 1 and len(trt.find("cuda.Device.retain_primary_context")) == 1
    assert release_primary_contexts() == 1
    assert trt.primary_retains == 0 and trt.find("cuda.primary_release") == [("cuda.primary_release",)]
    assert not trt.find("cuda.Context.detach.noop")


def test_events_do_not_time_and_waited_ones_block(trt, cache_dir):
    """DISABLE_TIMING on every event; BLOCKING_SYNC on those a host thread synchronises, so it does not spin."""
    flags = trt.driver.event_flags
    with build("c1", cache_dir) as e:
        for s in range(3):
            e.infer({"input": batch(s)})
    made = {c[1]: c[2] for c in trt.find("cuda.Event")}
    assert made and all(f & flags.DISABLE_TIMING for f in made.values())
    waited = {c[1] for c in trt.find("event.synchronize")}
    assert waited and all(made[i] & flags.BLOCKING_SYNC for i in waited)
    assert any(not f & flags.BLOCKING_SYNC for f in made.values())  # stream-ordering events stay light


def test_one_logger_for_every_builder_and_runtime(trt, cache_dir):
    """The same process-wide logger for each builder and runtime: TensorRT keeps the first and warns on others."""
    with build("c1", cache_dir) as e:
        e.infer({"input": batch()})
    build("c2", cache_dir)
    assert trt.other_loggers == 0 and trt.logger is not None
    trt.tensorrt.Builder(trt.tensorrt.ILogger())  # the double's own check: a second logger is noticed
    assert trt.other_loggers == 1


def test_direct_io_builds_with_native_cut_formats(trt, cache_dir):
    """direct_io: engines with cut tensors get BuilderFlag.DIRECT_IO and build, their cuts being DLA-native."""
    prof = profile("layer-wise", 0.35, ("fp16",), direct_io=True)
    engine = build(prof, cache_dir)
    for b in trt.builds:
        assert ("DIRECT_IO" in b["flags"]) is any(io["format"] != "LINEAR" for io in b["io"].values())
        assert not [t for t in b["reformats"] if b["io"][t]["format"] != "LINEAR"]
    assert any("DIRECT_IO" in b["flags"] for b in trt.builds) and engine.plan.direct_io


def test_direct_io_fails_the_build_on_a_reformat_at_a_cut(trt, cache_dir, monkeypatch):
    """An INT8 DLA layer next to an FP16 CHW16 cut needs a reformat: with DIRECT_IO the build fails, clearly.
    Here the dla0 -> dla1 cut turns FP16 because its reader on dla1 is forced to FP16; its INT8 writer on dla0
    would need a reformat."""
    from k2edge.engine import engine as engine_module

    real = engine_module.plan_partition
    prof = profile("layer-wise", 0.35, ("int8", "fp16"), direct_io=True)

    def mixed(*args, **kw):
        plan = real(*args, **kw)
        seg = next(s for s in plan.segments if s.device == "dla1")
        t = next(t for t in seg.inputs if t in plan.segments[seg.index - 1].outputs)
        assert plan.segments[seg.index - 1].device == "dla0"
        reader = next(n for n in seg.nodes if t in normalise(MODEL).graph.by_name[n].inputs)
        forced = dataclasses.replace(seg, layer_precision={**seg.layer_precision, reader: "fp16"})
        return dataclasses.replace(plan, segments=tuple(forced if s.index == seg.index else s for s in plan.segments))

    monkeypatch.setattr(engine_module, "plan_partition", mixed)
    with pytest.raises(BuildError, match="kDIRECT_IO specified but no conformant implementation"):
        build(prof, cache_dir)


def test_dla_engine_without_fallback_needs_dla_native_io(trt, cache_dir, monkeypatch):
    """The double refuses a DLA build without GPU_FALLBACK whose I/O is FP32 linear (#3438); the planner never
    makes one: without gpu_fallback the model's input and output stay on the GPU and the build succeeds."""
    from k2edge.engine import engine as engine_module

    off = profile("layer-wise", 0.35, gpu_fallback=False)
    engine = build(off, cache_dir)
    assert all("GPU_FALLBACK" not in b["flags"] for b in trt.builds) and engine.plan.segments[0].kind == "gpu"
    real = engine_module.plan_partition
    monkeypatch.setattr(engine_module, "plan_partition", lambda *a, **k: dataclasses.replace(real(*a, **k), gpu_fallback=False))
    with pytest.raises(BuildError, match="not a DLA-native format.*GPU fallback is off"):
        build(profile("layer-wise", 0.0), cache_dir)  # segment 0 on dla0 reads the FP32 model input


def test_managed_sram_above_one_mib_is_an_upper_bound(trt, cache_dir, caplog):
    """A 4 MiB managed SRAM pool is passed as asked; TensorRT uses at most the 1 MiB a core has and warns."""
    prof = profile(dla_memory_pools={"managed_sram": 1 << 22})
    with caplog.at_level(logging.WARNING):
        engine = build(prof, cache_dir)
    dla = [b for b in trt.builds if b["default_device"] == "DLA"]
    assert dla and all(b["pools"]["DLA_MANAGED_SRAM"] == 1 << 22 for b in dla)
    assert all(b["effective_pools"]["DLA_MANAGED_SRAM"] == 1 << 20 for b in dla)
    assert "exceeds the 1048576 bytes of SRAM" in caplog.text
    assert any("1 MiB of SRAM per DLA core" in n for n in engine.plan.notes)


def test_nothing_the_rules_accept_is_refused_by_the_dla_table():
    """k2edge's rules and the double's table (written separately from the 10.3 header) agree wherever k2edge
    puts a node on the DLA, on every zoo model and the demo model."""
    import zoo
    from k2edge.dla.rules import support_table
    from trt_double import _NodeView, dla_capable

    for name, model in [(n, zoo.load(n)) for n in zoo.NAMES] + [("digits", MODEL)]:
        nm = normalise(model)
        g = nm.model.graph
        shapes = {v.name: tuple(x.dim_value for x in v.type.tensor_type.shape.dim)
                  for v in list(g.input) + list(g.value_info) + list(g.output)}
        import onnx

        consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
        for node, support in zip(g.node, support_table(nm.graph)):
            if support.ok:
                assert dla_capable(_NodeView(node, shapes, consts)), (name, node.name, node.op_type)


def test_selftest_pycuda_check_fails_where_the_gpu_tests_only_skip():
    """Without pycuda and a CUDA device the checkout's gpu tests skip: the device check says so and fails."""
    name, ok, detail = _selftest().pycuda_claims_check()
    assert name == "pycuda-claims" and not ok
    assert "skipped" in detail and "needs pycuda and a CUDA device" in detail, detail


def test_selftest_stream_check_says_what_it_needs():
    """Off a Jetson the NVDEC check fails with what is missing (gi, or GStreamer's nvv4l2decoder), never a traceback."""
    checks = _selftest().stream_checks([])
    assert len(checks) == 1 and checks[0][0] == "nvdec-decode" and not checks[0][1]
    assert "gi" in checks[0][2] or "nvv4l2decoder" in checks[0][2]


# ------------------------------------------------------------------------------------------------
# one engine for every batch size

def test_every_batch_size_gpu_profiles_dla_engines_per_size(trt, cache_dir):
    """c1 (GPU, DLA0, DLA1, GPU) for batches up to 8: each GPU segment is one engine with a static profile per batch
    size 1, 2, 4, 8 and one execution context per profile; each DLA segment is one static engine per size; every
    size computes what the static engine of that size computes."""
    with build("c1", cache_dir, max_batch=8) as one:
        spec = one.backend.inputs[0]
        assert spec.batch_sizes == (1, 2, 4, 8) and spec.shape == (8, 1, 32, 32)
        gpu = [b for b in trt.builds if b["default_device"] == "GPU"]
        dla = [b for b in trt.builds if b["default_device"] == "DLA"]
        assert len(gpu) == 2 and all([p["input" if b["network"] == "segment0_gpu" else next(iter(p))][0][0]
                                      for p in b["profiles"]] == [[1, 1, 32, 32][0], 2, 4, 8] for b in gpu)
        assert len(dla) == 8 and all(len(b["profiles"]) == 1 for b in dla)
        for b in gpu + dla:
            for prof in b["profiles"]:
                assert all(lo == opt == hi for lo, opt, hi in prof.values())
        selected = trt.find("context.set_optimization_profile_async")
        assert sorted((c[1], c[2]) for c in selected if c[1] == "segment0_gpu") == [("segment0_gpu", k) for k in range(4)]
        assert sorted(c[2] for c in selected if c[1] == "segment1_dla0") == [0, 0, 0, 0]
        assert one.describe()["device_memory_bytes"] > 0
        assert any("dla0: 4 static engine(s)" in n for n in one.info.notes)
        for size in (1, 2, 4, 8):
            x = np.random.default_rng(size).standard_normal((size, 1, 32, 32)).astype(np.float32)
            with build(profile("layer-wise", 0.35, batch_size=size), cache_dir) as static:
                assert static.backend.inputs[0].batch_sizes == ()
                want = static.infer({"input": x})["logits"]
            got = one.infer({"input": x})["logits"]
            assert got.shape == want.shape and np.array_equal(got, want)


def test_every_batch_size_engines_have_keys_of_their_own(trt, cache_dir):
    """The profile engines' cache keys differ from the static engines' (an old cache is never taken for them)."""
    static = build("c1", cache_dir)
    one = build("c1", cache_dir, max_batch=4)
    assert {s.key for s in one.backend.build.segments}.isdisjoint(s.key for s in static.backend.build.segments)
    assert not one.backend.build.cached


def test_too_many_dla_engines_for_a_core_fail_clearly(trt, cache_dir):
    """Batches up to 65536 are 17 sizes, so 17 static engines on each DLA core of c1: refused, before any is built,
    with the reason."""
    with pytest.raises(BuildError, match="dla0 would hold 17 engines .* more than the 16 loadables a DLA core holds"):
        build("c1", cache_dir, max_batch=2**16)
    assert trt.builds == []
