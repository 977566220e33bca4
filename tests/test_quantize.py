"""INT8 calibration (Q/DQ model + TensorRT calibration cache) and FP16: accuracy on the demo set."""

import numpy as np
import onnx
import pytest

from k2edge import Engine, load_profile
from k2edge.engine.cache import EngineCache
from k2edge.engine.quantize import read_trt_calibration_cache, write_trt_calibration_cache
from k2edge.model.datasets import open_dataset
from k2edge.model.ingest import normalise
from k2edge.tasks.preprocess import Preprocess
from int8_support import forced_ties_qdq, int8_decision


def _accuracy(engine, dataset) -> float:
    from k2edge.cli.eval_cmd import evaluate

    with engine:
        return evaluate(engine, dataset)["top1"]


@pytest.fixture(scope="module")
def fp32_top1(demo_model, demo_eval):
    return _accuracy(Engine.build(demo_model, "cpu-dev"), demo_eval)


def test_int8_within_one_point_of_fp32(demo_model, demo_eval, fp32_top1):
    p = load_profile({"edge_runtime": {"tensorrt_partition": "layer-wise", "offload_ratio": 0.35, "precision_fallback": ["int8"]}})
    top1 = _accuracy(Engine.build(demo_model, p, calib=demo_model.parent / "calib"), demo_eval)
    assert fp32_top1 - top1 <= 0.010, (fp32_top1, top1)


def test_fp16_within_03_points_of_fp32(demo_model, demo_eval, fp32_top1):
    top1 = _accuracy(Engine.build(demo_model, "c5"), demo_eval)
    assert fp32_top1 - top1 <= 0.003, (fp32_top1, top1)


def test_qdq_model_and_trt_cache(demo_model, cache_dir):
    """Calibration writes a symmetric Q/DQ model and a TensorRT cache with one scale per tensor; cached."""
    nm = normalise(demo_model)
    pre = Preprocess.for_model(nm.metadata(), nm.graph.shape("input"))
    ds = open_dataset(demo_model.parent / "calib.npz")
    cache = EngineCache(cache_dir)
    q = int8_decision(nm, ds, pre, cache, model_path=demo_model).quant
    assert not q.cached and q.samples == 160  # every fifth of 200 is held out for the check
    qdq = onnx.load(str(q.qdq_model))
    ops = [n.op_type for n in qdq.graph.node]
    assert ops.count("QuantizeLinear") > 10 and ops.count("DequantizeLinear") > 10
    zero_points = [i for i in qdq.graph.initializer if i.name.endswith("zero_point")]
    assert zero_points and all(not np.any(onnx.numpy_helper.to_array(z)) for z in zero_points), "TensorRT needs symmetric INT8"
    lines = q.trt_calibration_cache.read_text().splitlines()
    assert lines[0].startswith("TRT-") and lines[0].endswith("-EntropyCalibration2")
    back = read_trt_calibration_cache(q.trt_calibration_cache)
    assert "input" in back and set(back) == set(q.dynamic_ranges)
    for name, amax in q.dynamic_ranges.items():
        assert back[name] == pytest.approx(amax, rel=1e-6)
    again = int8_decision(nm, ds, pre, cache, model_path=demo_model).quant
    assert again.cached and again.key == q.key


def test_calibration_cache_roundtrip(tmp_path):
    f = tmp_path / "calib.cache"
    write_trt_calibration_cache(f, {"a": 127.0, "b": 2.54})
    assert f.read_text().splitlines()[1] == "a: 3f800000"  # scale 1.0 as big-endian float32
    assert read_trt_calibration_cache(f) == pytest.approx({"a": 127.0, "b": 2.54})


def test_imagefolder_and_npz_calibration_agree(demo_model, cache_dir):
    """The PNG directory and calib.npz hold the same images, so they give the same ranges."""
    nm = normalise(demo_model)
    pre = Preprocess.for_model(nm.metadata(), nm.graph.shape("input"))
    cache = EngineCache(cache_dir)
    a = int8_decision(nm, open_dataset(demo_model.parent / "calib"), pre, cache, model_path=demo_model).quant
    b = int8_decision(nm, open_dataset(demo_model.parent / "calib.npz"), pre, cache, model_path=demo_model).quant
    for name in a.dynamic_ranges:
        assert a.dynamic_ranges[name] == pytest.approx(b.dynamic_ranges[name], rel=1e-5)


def _qdq_scales(path) -> dict[str, float]:
    qdq = onnx.load(str(path))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in qdq.graph.initializer}
    return {n.input[0]: float(inits[n.input[1]]) for n in qdq.graph.node
            if n.op_type == "QuantizeLinear" and inits[n.input[1]].size == 1 and n.input[0] not in inits}


def test_ranges_the_dla_ties_are_equal_for_dla_layers_only(demo_model, tmp_path):
    """Pooling in/out and elementwise inputs share one INT8 range (the largest) where the plan puts the layer
    on a DLA, in TensorRT's calibration cache and the Q/DQ model alike; a GPU-only plan ties nothing."""
    from k2edge.dla.planner import plan_partition
    from k2edge.engine.quantize import dla_ties, plan_dla_nodes

    nm = normalise(demo_model)
    pre = Preprocess.for_model(nm.metadata(), nm.graph.shape("input"))
    ds = open_dataset(demo_model.parent / "calib.npz")
    dla_plan = plan_partition(nm, load_profile("c4"))
    dla_nodes, _ = plan_dla_nodes(dla_plan)
    quant = int8_decision(nm, ds, pre, EngineCache(tmp_path), plan=dla_plan, profile="c4", model_path=demo_model).quant
    ties = dla_ties(nm.graph, dla_nodes)
    adds = [n for n in nm.graph.nodes if n.op_type == "Add" and n.name in dla_nodes]
    assert adds and all(any(set(n.inputs) <= g for g in ties.groups) for n in adds)
    cache = read_trt_calibration_cache(quant.trt_calibration_cache)
    scale = _qdq_scales(quant.qdq_model)
    for group in ties.groups:
        assert len({round(cache[t], 4) for t in group}) == 1, group
        assert len({round(scale[t], 7) for t in group if t in scale}) == 1, group
    gpu = int8_decision(nm, ds, pre, EngineCache(tmp_path), plan=plan_partition(nm, load_profile("cpu-dev"), precision="int8"),
                        model_path=demo_model).quant
    assert gpu.dla_nodes == frozenset() and dla_ties(nm.graph, gpu.dla_nodes).groups == ()
    untied = read_trt_calibration_cache(gpu.trt_calibration_cache)
    assert any(len({round(untied[t], 4) for t in g}) > 1 for g in ties.groups)  # the GPU keeps its own ranges


# --- a SiLU model: the DLA's ties on the GPU break it ------------------------------------------------------------

@pytest.fixture(scope="module")
def silu(tmp_path_factory):
    """The small SiLU net, a tensor card and a calibration set of 40 photo-like images."""
    from graphs import silu_net, smooth_images

    d = tmp_path_factory.mktemp("silu")
    onnx.save(silu_net(), str(d / "silu.onnx"))
    np.savez(d / "calib.npz", x=smooth_images(40))
    np.savez(d / "check.npz", x=smooth_images(10, seed=5))
    (d / "silu.card.toml").write_text('task = "tensor"\n[input]\nscale = 0.00392156862745098\n')
    return d


def _plain_ort_qdq(nm, dataset, pre, calib_idx, dest):
    """Plain onnxruntime quantize_static with k2edge's settings (symmetric, per-channel, MinMax), no equalisation."""
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    from k2edge.engine.quantize import ort_settings, stage_batches

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = ({"images": b} for b, _ in stage_batches(dataset, pre, nm.graph.shape("images"), calib_idx))

        def get_next(self):
            return next(self.it, None)

    src = dest.parent / "plain_in.onnx"
    src.write_bytes(nm.serialized)
    quantize_static(str(src), str(dest), Reader(), **ort_settings())
    return dest


def test_silu_gpu_plan_matches_plain_onnxruntime_and_keeps_its_answers(silu, tmp_path):
    """GPU-only plan, method max: k2edge's Q/DQ scales are plain quantize_static's, and INT8 meets the cosine
    tolerance; the same model with the DLA's ties forced onto the GPU (k2edge up to QUANT_VERSION 3) fails it."""
    from k2edge.dla.planner import plan_partition
    from k2edge.engine.check import compare_outputs
    from k2edge.engine.calibration import session
    from k2edge.config.resolve import model_card
    from k2edge.engine.quantize import QuantSettings, calibration_split

    nm = normalise(str(silu / "silu.onnx"))
    card = model_card(silu / "silu.onnx", nm)
    pre = Preprocess.from_card(card)
    ds = open_dataset(silu / "calib.npz")
    plan = plan_partition(nm, load_profile({"edge_runtime": {"offload_ratio": 1.0, "precision_fallback": ["int8", "fp16"]}}))
    cache = EngineCache(tmp_path / "cache")
    q = int8_decision(nm, ds, pre, cache, plan=plan, card=card).quant
    assert q.dla_nodes == frozenset()
    calib_idx, _, _ = calibration_split(len(ds))
    plain = _plain_ort_qdq(nm, ds, pre, calib_idx, tmp_path / "plain.onnx")
    ours, theirs = _qdq_scales(q.qdq_model), _qdq_scales(plain)
    out = {f"{o}_QuantizeLinear_Input" for o in nm.graph.outputs}  # plain also rounds the model's output to INT8
    assert out <= set(theirs) and not out & set(ours)
    assert set(ours) == set(theirs) - out and "m1/sig" in ours
    for t in ours:
        assert ours[t] == pytest.approx(theirs[t], rel=1e-6), t
    assert ours["m1/sig"] < ours["m1/conv"] / 5  # the sigmoid keeps its own fine step

    check = open_dataset(silu / "check.npz")
    from k2edge.engine.quantize import stage_batches

    batches = [b for b, _ in stage_batches(check, pre, nm.graph.shape("images"))]
    ref = session(nm.model)

    def measures(qdq):
        s = session(qdq)
        return compare_outputs("tensor", [ref.run(None, {"images": b}) for b in batches],
                               [s.run(None, {"images": b}) for b in batches])

    good = measures(onnx.load(str(q.qdq_model)))
    bad = measures(forced_ties_qdq(nm, ds, pre, cache, tmp_path / "forced", settings=QuantSettings("max")))
    assert good["cosine"] >= 0.999 > bad["cosine"], (good, bad)


def test_silu_on_the_dla_fuses_the_gate(silu, tmp_path):
    """On a DLA plan each Sigmoid->Mul is one unit: no Q/DQ on the gate in the emulation, range 1.0 (qdq-translator)
    in the calibration cache, the Mul's other input keeps its own range; the residual Add's inputs are tied."""
    from k2edge.dla.planner import plan_partition

    nm = normalise(str(silu / "silu.onnx"))
    from k2edge.config.resolve import model_card

    pre = Preprocess.from_card(model_card(silu / "silu.onnx", nm))
    plan = plan_partition(nm, load_profile("c4"), precision="int8")  # the artefacts, no fallback
    q = int8_decision(nm, open_dataset(silu / "calib.npz"), pre, EngineCache(tmp_path), plan=plan, profile="c4",
                      model_path=silu / "silu.onnx").quant
    assert "m1/act/Mul" in q.dla_nodes
    cache = read_trt_calibration_cache(q.trt_calibration_cache)
    assert cache["m1/sig"] == pytest.approx(1.0, rel=1e-6) and cache["m1/conv"] > 2.0
    scales = _qdq_scales(q.qdq_model)
    assert "m1/sig" not in scales and "m1/conv" in scales
    assert cache["m0/act"] == pytest.approx(cache["m2/act"], rel=1e-6)  # Add inputs tied
    assert cache["res"] == pytest.approx(cache["pool"], rel=1e-6)  # MaxPool in/out tied


def test_model_wise_plan_gets_gpu_and_dla_artefacts(silu, tmp_path):
    """A model-wise plan running the same nodes on the GPU and the DLAs: two artefacts, both cached."""
    from k2edge.dla.planner import plan_partition
    from k2edge.config.resolve import model_card

    nm = normalise(str(silu / "silu.onnx"))
    pre = Preprocess.from_card(model_card(silu / "silu.onnx", nm))
    plan = plan_partition(nm, load_profile({"edge_runtime": {"tensorrt_partition": "model-wise", "offload_ratio": 0.5,
                                                             "precision_fallback": ["int8"]}}))
    cache = EngineCache(tmp_path)
    q = int8_decision(nm, open_dataset(silu / "calib.npz"), pre, cache, plan=plan, model_path=silu / "silu.onnx").quant
    assert q.dla is not None and q.dla_nodes == frozenset() and q.dla.dla_nodes
    assert q.for_device("gpu") is q and q.for_device("dla1") is q.dla
    gpu, dla = read_trt_calibration_cache(q.trt_calibration_cache), read_trt_calibration_cache(q.dla.trt_calibration_cache)
    assert gpu["m1/sig"] < 1.0 and dla["m1/sig"] == pytest.approx(1.0)
    again = int8_decision(nm, open_dataset(silu / "calib.npz"), pre, cache, plan=plan, model_path=silu / "silu.onnx").quant
    assert again.cached and again.dla.cached


# --- calibration methods -------------------------------------------------------------------------------------

def test_streaming_statistics_max_and_percentile():
    """Batches folded one at a time: max is exact, percentile within one bin of numpy's, state per tensor fixed."""
    from k2edge.engine.calibration import BINS, TensorStatistics

    rng = np.random.default_rng(0)
    data = [rng.standard_normal((4, 64)) * s for s in (1.0, 3.0, 0.5, 7.0)]  # the range grows mid-way
    stats = TensorStatistics()
    for d in data:
        stats.add({"t": d.astype(np.float32)}, 3)  # the 4th row is padding: not counted
    real = np.abs(np.concatenate([d[:3] for d in data]).astype(np.float32))
    assert stats.samples == 12
    assert stats.ranges("max")["t"] == pytest.approx(real.max())
    amax = stats.ranges("percentile", 99.0)["t"]
    assert abs(amax - np.percentile(real, 99.0)) <= 2 * real.max() / BINS * 2
    assert stats._state["t"].hist.shape == (BINS,)


def test_statistics_saved_and_loaded_are_the_same(tmp_path):
    """What the cache keeps is what was collected: every tensor's range, bin width and histogram (none for a tensor
    that never saw a non-zero value), and the sample count; ranges from the loaded copy equal the original's."""
    from k2edge.engine.calibration import TensorStatistics

    rng = np.random.default_rng(1)
    stats = TensorStatistics()
    for _ in range(3):
        stats.add({f"t{i}": (rng.standard_normal((2, 32)) * (i + 1)).astype(np.float32) for i in range(40)}
                  | {"zeros": np.zeros((2, 8), np.float32)}, 2)
    stats.save(tmp_path / "s.npz")
    loaded = TensorStatistics.load(tmp_path / "s.npz")
    assert loaded.samples == stats.samples == 6 and sorted(loaded._state) == sorted(stats._state)
    for name, want in stats._state.items():
        got = loaded._state[name]
        assert (got.amax, got.width) == (want.amax, want.width), name
        assert (got.hist is None) == (want.hist is None) and (want.hist is None or np.array_equal(got.hist, want.hist))
    assert loaded._state["zeros"].hist is None
    for method in ("max", "percentile"):
        assert loaded.ranges(method, 99.9) == stats.ranges(method, 99.9)


def test_card_overrides_the_profile_calibration():
    from k2edge.config.card import ModelCard
    from k2edge.engine.quantize import QuantSettings, quant_settings

    p = load_profile({"edge_runtime": {"calibration": {"method": "percentile", "percentile": 99.9}}})
    assert quant_settings(p.edge_runtime, None) == QuantSettings("percentile", 99.9)
    card = ModelCard.model_validate({"quantization": {"method": "max"}})
    assert quant_settings(p.edge_runtime, card) == QuantSettings("max", 99.9)
    assert quant_settings(load_profile("c2").edge_runtime, ModelCard()) == QuantSettings("auto", 99.99)


def test_auto_calibration_keeps_the_method_closer_to_fp32(tmp_path):
    """method auto (the default): a rare glint in a few calibration frames stretches max's input range; max misses
    the cosine tolerance, the check tries percentile (99.99 clips the glint), keeps it and says so; the kept method's
    Q/DQ model is the one built. With method max named, max it is."""
    from graphs import silu_net, smooth_images

    onnx.save(silu_net(), str(tmp_path / "silu.onnx"))
    x = smooth_images(100).astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    for i in [i for i in range(100) if i % 5 != 4][::20]:  # calibration frames only: the held-out check has none
        x[i, :, 5, 5] = 10.0
    np.savez(tmp_path / "calib.npz", x=x)
    from k2edge.config.card import load_card

    nm = normalise(str(tmp_path / "silu.onnx"))
    data = open_dataset(tmp_path / "calib.npz")
    checks = {}
    for method in ("auto", "max"):
        path = tmp_path / f"{method}.toml"
        path.write_text(f'task = "tensor"\n[input]\nscale = 0.00392156862745098\n[quantization]\nmethod = "{method}"\n'
                        'tolerance = { cosine = 0.999 }\n')
        card = load_card(path)
        decision = int8_decision(nm, data, Preprocess.from_card(card), EngineCache(tmp_path / "cache"), card=card)
        checks[method] = decision.check, decision.check.to_dict()
        if method == "auto":
            scales = _qdq_scales(decision.quant.qdq_model)
    auto, as_dict = checks["auto"]
    assert auto.status == "passed" and auto.calibration == "percentile 99.99" and as_dict["calibration"] == "percentile 99.99"
    assert "percentile 99.99 ranges" in auto.line() and any("calibration method percentile 99.99 kept" in n for n in auto.notes)
    assert checks["max"][0].status == "failed" and checks["max"][0].calibration == "max"
    assert checks["max"][0].measures["cosine"] < 0.999 <= auto.measures["cosine"]
    assert scales["images"] < 5.0 / 127  # the kept artefact clips the glint (max's input range would be 10)


def test_mse_range_is_the_least_squared_error_clip():
    """mse: of every clip at a bin edge, the one whose INT8 error (step^2 / 12 inside, the excess outside) over the
    tensor's own values is least: a lone far outlier is clipped, a heavier far tail is kept."""
    from k2edge.engine.calibration import TensorStatistics

    rng = np.random.default_rng(0)
    for outliers, clipped in (([60.0], True), ([60.0] * 400 + [-55.0] * 400, False)):
        values = np.concatenate([rng.laplace(0, 1, 200000), outliers]).astype(np.float32)
        stats = TensorStatistics()
        stats.add({"t": values[None]}, 1)
        amax = stats.ranges("mse")["t"]
        mags = np.abs(values).astype(np.float64)

        def err(a):
            inside = mags <= a
            return inside.sum() * (a / 127) ** 2 / 12 + ((mags[~inside] - a) ** 2).sum()

        brute = min(np.linspace(0.5, 60, 1200), key=err)
        assert err(amax) <= err(brute) * 1.01, (amax, brute)  # the histogram's bins are finer than the grid
        assert (amax < 30) == clipped, amax


def test_range_search_lowers_the_output_error_and_its_ranges_are_built(tmp_path):
    """method search: per tensor, the candidate range that costs the model's output least; the check says
    "search", the decision carries the searched ranges, the built Q/DQ model has exactly them, and a rebuild
    takes them from the cache."""
    from graphs import silu_net, smooth_images

    from k2edge.config.card import load_card
    from k2edge.engine.calibration import collect_statistics
    from k2edge.engine.fallback import OutputProbe
    from k2edge.engine.quantize import QuantSettings, base_qdq, dla_ties, finish_qdq
    from k2edge.engine.range_search import activation_scales, candidate_ranges, search_ranges

    onnx.save(silu_net(), str(tmp_path / "silu.onnx"))
    x = smooth_images(60).astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    for i in range(0, 60, 7):
        x[i, :, 5, 5] = 10.0  # glints: max's input range is four times what most frames need
    np.savez(tmp_path / "calib.npz", x=x)
    nm = normalise(str(tmp_path / "silu.onnx"))
    stats = collect_statistics(nm.model, [(x[i:i + 1], 1) for i in range(0, 60, 2)])
    start = QuantSettings("mse").ranges(stats)
    base = finish_qdq(base_qdq(nm, stats, QuantSettings("mse"), (), (), dla_ties(nm.graph, set()), tmp_path / "b.onnx"), nm)
    probe = OutputProbe(nm.model, nm.graph.inputs[0], [(x[i:i + 1], 1) for i in (1, 9, 17, 33)])
    fixed = frozenset({nm.graph.inputs[0]})
    ranges, before, after = search_ranges(base, start, candidate_ranges(stats), probe, fixed)
    assert after <= before and ranges[nm.graph.inputs[0]] == start[nm.graph.inputs[0]]
    assert set(ranges) == set(start)

    card_path = tmp_path / "card.toml"
    card_path.write_text('task = "tensor"\n[input]\nscale = 0.00392156862745098\n[quantization]\nmethod = "search"\n'
                         'tolerance = { cosine = 0.99 }\n')
    card = load_card(card_path)
    data = open_dataset(tmp_path / "calib.npz")
    decision = int8_decision(nm, data, Preprocess.from_card(card), EngineCache(tmp_path / "cache"), card=card)
    check = decision.check
    assert check.calibration == "search" and check.ranges and check.to_dict()["ranges"] == check.ranges
    qdq = onnx.load(str(decision.quant.qdq_model))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in qdq.graph.initializer}
    own = {t: s for t, s in activation_scales(qdq).items() if t in check.ranges}
    assert own and all(inits[s] == pytest.approx(check.ranges[t] / 127, rel=1e-6) for t, s in own.items())
    again = int8_decision(nm, data, Preprocess.from_card(card), EngineCache(tmp_path / "cache"), card=card)
    assert again.cached and again.quant.key == decision.quant.key


@pytest.mark.parametrize("bad, message", [
    ({"calibration": {"method": "entropy"}}, "edge_runtime.calibration.method"),
    ({"calibration": {"percentile": 30}}, "edge_runtime.calibration.percentile: must be a number within (50, 100]"),
    ({"int8_tolerance": {"agreemnt": 0.9}}, "unknown measure 'agreemnt'"),
])
def test_bad_calibration_settings_name_the_field(bad, message):
    from k2edge.errors import ProfileError

    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_profile({"edge_runtime": bad})


def test_conv_then_batchnorm_is_one_layer_in_the_emulation(tmp_path):
    """TensorRT fuses Conv + BatchNormalization: the tensor between them gets no Q/DQ in the emulation."""
    from onnx import TensorProto, helper, numpy_helper

    from k2edge.engine.calibration import TensorStatistics
    from k2edge.engine.quantize import QuantSettings, conv_bn_outputs, dla_ties, variant_files

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")]
    inits += [numpy_helper.from_array(v.astype(np.float32), n) for n, v in
              (("g", rng.uniform(0.5, 2, 4)), ("b", rng.standard_normal(4)), ("m", rng.standard_normal(4)), ("v", rng.uniform(0.5, 2, 4)))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2")]
    inits.append(numpy_helper.from_array(rng.standard_normal((2, 4, 1, 1)).astype(np.float32), "w2"))
    g = helper.make_graph(nodes, "cbn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])], inits)
    nm = normalise(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    assert conv_bn_outputs(nm.graph) == {"c"}
    stats = TensorStatistics()
    from k2edge.engine.calibration import collect_statistics

    stats = collect_statistics(nm.model, [(rng.standard_normal((1, 3, 8, 8)).astype(np.float32), 1)])
    variant_files(nm, stats, tmp_path, QuantSettings(), (), (), dla_ties(nm.graph, set()))
    quantised = {n.input[0] for n in onnx.load(str(tmp_path / "qdq.onnx")).graph.node if n.op_type == "QuantizeLinear"}
    assert "c" not in quantised and "x" in quantised


def test_fp16_conversion_folds_a_batchnorm_variance_beyond_fp16(tmp_path):
    """A BatchNorm running variance above FP16's 65504 (PP-OCRv4's DBNet has 9.8e7) is clamped when its parameters
    are converted one by one; the FP16 model k2edge runs folds them into scale and shift first, as TensorRT does."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from k2edge.engine.quantize import to_fp16

    rng = np.random.default_rng(0)
    params = {"g": [1e4, 1.0, 2.0, 0.5], "b": [0.1, -0.2, 0.3, 0.0], "m": [0.0, 0.1, -0.1, 0.2], "v": [1e8, 1.0, 0.5, 2.0]}
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in params.items()]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "bn_range", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    model = normalise(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])).model
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    ref = run(model)
    assert np.abs(ref[0, 0]).max() > 0.1  # the channel with the large variance carries a signal
    clamped = run(convert_float_to_float16(model, keep_io_types=True))
    assert np.abs(clamped[0, 0] - ref[0, 0]).max() > 10 * np.abs(ref[0, 0]).max()  # what the folding prevents
    for kept in ((), ["relu"]):
        got = run(to_fp16(model, kept))
        np.testing.assert_allclose(got, ref, rtol=0.02, atol=0.02)
    assert [n.op_type for n in to_fp16(model).graph.node if n.op_type != "Cast"] == ["Conv", "BatchNormalization", "Relu"]


def test_no_qdq_only_float_nodes_read_nor_on_a_model_output(tmp_path):
    """ONNX Runtime's quantiser rounds an INT8 Add's output even when only a float node (here a HardSigmoid the plan
    keeps out of INT8) reads it: once the fallback moves the Add, that pair goes; and a final Sigmoid's output is not
    rounded. A model with every learned layer moved out of INT8 has no INT8 rounding left (PP-OCRv4's DBNet was
    held at cosine 0.95 by such pairs)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from k2edge.engine.calibration import collect_statistics
    from k2edge.engine.quantize import QuantSettings, base_qdq, dla_ties, finish_qdq, learned_layers, qdq_int8_layers

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("w1", (4, 3, 3, 3)), ("w2", (2, 4, 1, 1)), ("k", (1, 4, 1, 1)))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Add", ["a", "k"], ["s"], name="add"),
             helper.make_node("HardSigmoid", ["s"], ["h"], name="hsig"),
             helper.make_node("Mul", ["a", "h"], ["m"], name="gate"),
             helper.make_node("Conv", ["m", "w2"], ["y"], name="conv2"),
             helper.make_node("Sigmoid", ["y"], ["out"], name="sigmoid")]
    g = helper.make_graph(nodes, "float_readers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2, 8, 8])], inits)
    nm = normalise(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    xs = [(rng.standard_normal((1, 3, 8, 8)).astype(np.float32), 1) for _ in range(4)]
    stats = collect_statistics(nm.model, xs)
    base = base_qdq(nm, stats, QuantSettings(), ["hsig"], (), dla_ties(nm.graph, set()), tmp_path / "base.onnx")

    def quantised(m):
        return {n.input[0] for n in m.graph.node if n.op_type == "QuantizeLinear"}

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": xs[0][0]})[0]

    assert "s" in quantised(base) and any(n.op_type == "DequantizeLinear" and n.output[0] == "out" for n in base.graph.node)
    qdq = finish_qdq(base, nm, (), ["hsig"])
    assert qdq_int8_layers(qdq, learned_layers(nm.graph)) == {"conv1", "conv2"}
    assert "out" in next(n for n in qdq.graph.node if n.name == "sigmoid").output  # the map leaves the Sigmoid in float
    assert {"s", "a", "h", "m"} <= quantised(qdq)  # the INT8 Add writes s in INT8
    moved = finish_qdq(base, nm, ("add",), ["hsig"])
    assert not {"s", "s/fp16_rounded"} & quantised(moved) and {"a", "h", "m"} <= quantised(moved)  # s: only hsig reads it
    every = finish_qdq(base, nm, ("conv1", "add", "gate", "conv2", "sigmoid"), ["hsig"])
    assert not quantised(every), quantised(every)
    np.testing.assert_allclose(run(every), run(nm.model), atol=2e-3)


def test_runs_answers_in_order_as_one_single_threaded_session_does_taking_only_a_core_count_ahead(demo_model, monkeypatch):
    """The INT8 build's ONNX Runtime passes (statistics, checks, sensitivities) run one sample per core at a time:
    the results come in the feeds' order, equal to one session's run after run, and the feeds are taken no further
    ahead than there are cores (so the statistics hold a few samples' activations, not the set's)."""
    from k2edge.engine import calibration
    from k2edge.engine.calibration import runs, session

    monkeypatch.setattr(calibration, "cores", lambda: 3)
    nm = normalise(str(demo_model))
    name = nm.graph.inputs[0]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(nm.graph.shape(name)).astype(np.float32) for _ in range(17)]
    one = session(nm.model)
    want = [one.run(None, {name: x})[0] for x in inputs]
    taken, ahead = [], []

    def feeds():
        for x in inputs:
            taken.append(x)
            yield {name: x}

    got = []
    for out in runs(session(nm.model), None, feeds()):
        ahead.append(len(taken) - len(got))
        got.append(out[0])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert max(ahead) == 3, ahead


def test_an_fp16_segment_reads_what_the_int8_segment_before_it_gives_out_rounded_to_int8():
    """An FP16 segment between INT8 ones (c4: PP-OCR's HardSwish ``Div`` on the GPU between DLA segments) is cut from
    the FP32 model; its entry is quantised as the Q/DQ model quantises that tensor on its way to the segment (the
    INT8 segment before gives it out as INT8), so the engine computes what the INT8 check measured."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from k2edge.engine.quantize import quantised_at_entry, to_fp16

    scale = np.float32(0.05)
    six = numpy_helper.from_array(np.array(6.0, dtype=np.float32), "six")
    io = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 8])  # noqa: E731
    div = helper.make_node("Div", ["y", "six"], ["z"], name="div")
    segment = helper.make_model(helper.make_graph([div], "seg", [io("y")], [io("z")], [six]),
                                opset_imports=[helper.make_opsetid("", 17)])
    qdq = helper.make_model(helper.make_graph(
        [helper.make_node("QuantizeLinear", ["y", "s", "zp"], ["yq"], name="q"),
         helper.make_node("DequantizeLinear", ["yq", "s", "zp"], ["ydq"], name="dq"),
         helper.make_node("Div", ["ydq", "six"], ["z"], name="div")], "qdq", [io("y")], [io("z")],
        [six, numpy_helper.from_array(np.array(scale), "s"), numpy_helper.from_array(np.array(0, dtype=np.int8), "zp")]),
        opset_imports=[helper.make_opsetid("", 17)])
    y = np.array([[0.01, 0.026, 0.124, 1.0, -2.33, 3.07, 5.0, 7.3]], dtype=np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"y": y})[0]  # noqa: E731
    fp16 = to_fp16(segment)
    entered = quantised_at_entry(fp16, qdq)
    want = np.clip(np.round(y / scale), -128, 127) * scale / 6.0
    np.testing.assert_allclose(run(entered), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(run(qdq), want, rtol=1e-6, atol=1e-7)
    assert np.abs(run(fp16) - want).max() > 1e-3  # without it: the unrounded value
    assert quantised_at_entry(fp16, segment) is fp16  # nothing quantised before the segment: unchanged
