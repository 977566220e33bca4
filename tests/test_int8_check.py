"""The INT8 check at every build, the automatic precision fallback, and one INT8 decision per model."""

import json
import logging

import numpy as np
import onnx
import pytest

from k2edge import BuildError, Engine, load_profile
from k2edge.engine.check import Int8Check, compare_outputs, match_detections, meets, tolerance_for
from k2edge.tasks.detection import Detections
from test_cli import MODEL, ROOT, assert_one_line_error, k2edge

GPU_CHAIN = {"edge_runtime": {"offload_ratio": 1.0, "precision_fallback": ["int8", "fp16"]}}


@pytest.fixture(scope="module")
def silu(tmp_path_factory):
    """The small SiLU net (tensor task) with a strict cosine tolerance that INT8 alone misses; 100 samples hold out
    the 20 maps a verdict needs."""
    from graphs import silu_net, smooth_images

    d = tmp_path_factory.mktemp("silu-check")
    onnx.save(silu_net(), str(d / "silu.onnx"))
    np.savez(d / "calib.npz", x=smooth_images(100))
    (d / "silu.card.toml").write_text('task = "tensor"\n[input]\nscale = 0.00392156862745098\n'
                                      '[quantization]\ntolerance = { cosine = 0.99985 }\n')
    return d


def _qdq_tensors(path) -> set[str]:
    return {n.input[0] for n in onnx.load(str(path)).graph.node if n.op_type == "QuantizeLinear"}


# --- measures -----------------------------------------------------------------------------------------------

def test_detection_measures_match_boxes_by_label_and_iou():
    ref = Detections(np.array([[0, 0, 10, 10], [20, 20, 30, 30]], np.float32), np.array([0.9, 0.8], np.float32),
                     np.array([0, 1]))
    same_label = Detections(np.array([[1, 1, 10, 10], [20, 20, 30, 30]], np.float32), np.array([0.45, 0.8], np.float32),
                            np.array([0, 0]))
    assert match_detections(ref, same_label) == (1, [0.5])  # the second box has the wrong label
    one = {"output0": np.zeros((1, 6, 4))}
    m = compare_outputs("detection", [one], [one], detections=lambda o: [ref])
    assert m["recall"] == m["precision"] == m["score_ratio"] == 1.0 and m["reference_boxes"] == 2


def test_a_score_under_the_threshold_is_a_strict_miss_not_a_relaxed_one():
    """INT8 scores a box 0.2 that FP32 scores 0.3 (threshold 0.25): matched down to half the threshold it is found
    (recall 1.0) and the score ratio, of the INT8 boxes kept at the threshold, does not see it; as a user sees the
    boxes it is missed (strict recall 1/2), and a tolerance on strict_recall fails the check."""
    box = np.array([[0, 0, 10, 10], [20, 20, 30, 30]], np.float32)
    fp32 = Detections(box, np.array([0.9, 0.3], np.float32), np.array([0, 1]))
    low = Detections(box, np.array([0.9, 0.2], np.float32), np.array([0, 1]))  # INT8 down to half the threshold
    R, Q = {"r": np.zeros(1)}, {"q": np.zeros(1)}
    at_threshold = lambda o: [fp32 if "r" in o else Detections(box[:1], low.scores[:1], low.classes[:1])]  # noqa: E731
    m = compare_outputs("detection", [R], [Q], detections=at_threshold, relaxed=lambda o: [fp32 if "r" in o else low])
    assert m["recall"] == m["precision"] == m["score_ratio"] == 1.0
    assert (m["strict_found"], m["reference_boxes"], m["strict_kept"], m["int8_boxes"]) == (1, 2, 1, 1)
    assert m["strict_recall"] == 0.5 and m["strict_precision"] == 1.0 and m["bounds"]["strict_recall"][1] < 1.0
    check = Int8Check("detection", "failed", "held-out", 1, m, {"strict_recall": 0.9})
    assert not meets(m, {"strict_recall": 0.9}) and meets(m, {"recall": 0.97, "precision": 0.97})
    assert "at the threshold recall 1/2 0.500, precision 1/1 1.000" in check.line()
    profile = load_profile({"edge_runtime": {"int8_tolerance": {"strict_recall": 0.9}}})
    assert tolerance_for("detection", profile.edge_runtime.int8_tolerance)[0]["strict_recall"] == 0.9
    with pytest.raises(BuildError, match="got 'strict_recall'"):
        tolerance_for("classification", {"strict_recall": 0.9})


def test_segmentation_pose_and_obb_add_their_own_measure_of_the_matched_boxes():
    """Boxes matched as for detection; then mask IoU, keypoint distance or rotated IoU of each matched pair."""
    boxes, scores, classes = np.array([[0, 0, 10, 10], [20, 20, 30, 30]], np.float32), np.array([0.9, 0.8], np.float32), np.array([0, 1])
    R, Q = {"r": np.zeros(1)}, {"q": np.zeros(1)}  # one sample each: which run's outputs these are
    kp = np.zeros((2, 17, 3), np.float32)
    ref_pose, int8_pose = Detections(boxes, scores, classes, kp), Detections(boxes, scores, classes, kp + [3.0, 4.0, 0.0])
    m = compare_outputs("pose", [R], [Q], detections=lambda o: [ref_pose if "r" in o else int8_pose])
    assert m["recall"] == 1.0 and m["keypoint_error"] == pytest.approx(5.0)  # every keypoint 3-4-5 px away
    rb = np.array([[5, 5, 20, 5, 0.0], [25, 25, 20, 5, 0.3]], np.float32)  # oblong: turning one changes it
    ref_obb, int8_obb = Detections(boxes, scores, classes, rb), Detections(boxes, scores, classes, rb + [0, 0, 0, 0, 1.2])
    same = compare_outputs("obb", [R], [R], detections=lambda o: [ref_obb])
    turned = compare_outputs("obb", [R], [Q], detections=lambda o: [ref_obb if "r" in o else int8_obb])
    assert same["rotated_iou"] == pytest.approx(1.0, abs=1e-3) and 0 < turned["rotated_iou"] < 0.9
    square = np.ones((10, 10), bool)
    masks = {"r": [(square, (0, 0)), (square, (20, 20))], "q": [(square[:5], (0, 0)), (square, (20, 20))]}  # one half

    def seg_masks(out, row, dets):
        return masks[next(iter(out))]

    seg = compare_outputs("segmentation", [R], [Q], detections=lambda o: [ref_pose], masks=seg_masks)
    assert seg["mask_iou"] == pytest.approx((0.5 + 1.0) / 2)
    check = Int8Check("pose", "passed", "held-out", 1, m, {"recall": 0.97})
    assert "keypoints 5.00 px apart" in check.line() and tolerance_for("segmentation")[0] == tolerance_for("detection")[0]


def test_classification_and_tensor_measures():
    a = np.array([[5.0, 1.0, 0.0], [0.0, 3.0, 0.0]])
    b = np.array([[5.0, 1.0, 0.0], [3.0, 0.0, 0.0]])
    m = compare_outputs("classification", [[a]], [[b]])
    assert m["agreement"] == 0.5 and m["samples"] == 2 and m["mean_abs_dp"] > 0.1
    t = compare_outputs("tensor", [{"y": a}], [{"y": a * 1.01}])
    assert t["cosine"] == pytest.approx(1.0) and t["max_rel_error"] == pytest.approx(0.01)


@pytest.mark.parametrize("task", ["classification", "detection", "tensor"])
def test_a_candidate_stops_being_measured_only_once_it_cannot_meet_the_tolerance(task):
    """The fallback's search stops measuring a candidate at a certain miss (:meth:`Tally.cannot_meet`): on 300
    random runs of 40 batches (some starting worse than they go on), whenever it says so after some batch, the
    measures of all 40 miss the tolerance; and after the last batch it says so exactly when they miss (the counted
    measures, or the mean cosine). Added in another order, the batches give the same measures."""
    from k2edge.engine.check import Tally, rooms_after

    rng = np.random.default_rng(7)
    tol = {"classification": {"agreement": 0.9}, "tensor": {"cosine": 0.99},
           "detection": {"recall": 0.9, "precision": 0.9, "strict_recall": 0.85, "strict_precision": 0.85}}[task]

    def boxes(n: int) -> Detections:
        xy = rng.uniform(0, 100, (n, 2)).astype(np.float32)
        return Detections(np.concatenate([xy, xy + 10], axis=1), rng.uniform(0.3, 1.0, n).astype(np.float32),
                          rng.integers(0, 2, n))

    def batch(miss: float, extra: float) -> tuple[dict, dict]:
        """One batch of FP32 and INT8 outputs, INT8 wrong for about a share ``miss`` of the items (a box task: missing
        that share of FP32's boxes, and an extra box of its own at a rate ``extra``)."""
        if task == "classification":
            p = rng.normal(size=(4, 3))
            q = np.where((rng.random(4) < miss)[:, None], -p, p + rng.normal(scale=0.01, size=p.shape))
            return {"y": p}, {"y": q}
        if task == "tensor":
            a = rng.normal(size=(2, 50))
            return {"y": a}, {"y": a + rng.normal(scale=miss, size=a.shape)}
        ref, extra = boxes(int(rng.integers(0, 4))), boxes(int(rng.random() < extra))  # one sample: its boxes
        keep = rng.random(len(ref.scores)) >= miss
        scores = np.concatenate([ref.scores[keep] * rng.uniform(0.6, 1.1, int(keep.sum())), extra.scores])
        q = Detections(np.concatenate([ref.boxes[keep], extra.boxes]), scores.astype(np.float32),
                       np.concatenate([ref.classes[keep], extra.classes]))
        return {"y": [ref]}, {"y": [q]}

    def at_threshold(o: dict) -> list:
        d = o["y"][0]
        return [Detections(d.boxes[d.scores >= 0.5], d.scores[d.scores >= 0.5], d.classes[d.scores >= 0.5])]

    decoders = {"detections": at_threshold, "relaxed": lambda o: o["y"]} if task == "detection" else {}
    stopped = 0
    for _ in range(300):
        early, late = rng.choice([0.0, 0.02, 0.1, 0.3], size=2), rng.choice([0.0, 0.02, 0.1], size=2)
        k = int(rng.integers(0, 20))
        batches = [batch(*(early if i < k else late)) for i in range(40)]  # a bad start may yet meet it
        final = compare_outputs(task, [r for r, _ in batches], [q for _, q in batches], **decoders)
        tally = Tally(task, **decoders)
        rooms = rooms_after([tally.room(r) for r, _ in batches])
        for i, (r, q) in enumerate(batches):
            tally.add(r, q)
            if tally.cannot_meet(tol, rooms[i]):
                assert not meets(final, tol), (i, final)
                stopped += i < len(batches) - 1
                break
        else:
            assert meets(final, tol), final
        backwards = Tally(task, **decoders)
        for i in reversed(range(len(batches))):
            backwards.add(*batches[i], at=i)
        assert backwards.measures() == final  # to the last bit, in whatever order the batches come
    assert stopped > 30, stopped  # and it came early, often


@pytest.mark.parametrize("n", [9, 12, 48, 200])
def test_one_miss_allowed_holds_exactly(n):
    """With too few items for the default tolerance, (n - 1) / n is the bound, compared in integers: n - 1 hits of n
    hold, n - 2 do not (round(1 - 1/n, 6) was above (n - 1)/n at 9, 12, 48: one miss failed)."""
    from fractions import Fraction

    from k2edge.engine.check import holds, meets, one_miss, relaxed, resolvable

    default = {"agreement": 0.999}  # resolved by 1000 items only
    miss1 = {"agreement": (n - 1) / n, "agreed": n - 1, "samples": n}
    miss2 = {"agreement": (n - 2) / n, "agreed": n - 2, "samples": n}
    short = resolvable(miss1, default)
    assert short == {"agreement": 1000}
    tol = relaxed(default, miss1, short)
    assert tol["agreement"] == one_miss(n) == Fraction(n - 1, n)
    assert meets(miss1, tol) and not meets(miss2, tol)
    assert not meets(miss1, {"agreement": round(1 - 1 / n, 6)}) or n == 200  # the old rounding: one miss failed
    assert holds(180, 200, 0.9) and not holds(179, 200, 0.9)  # 0.9 is 9/10, not the float just above it
    assert resolvable({"agreement": 1.0, "agreed": 200, "samples": 200}, {"agreement": 0.99}) == {}


def test_a_check_on_too_few_items_is_inconclusive():
    """A tolerance met on fewer items than the minimum (200 samples, 50 FP32 boxes, 20 maps) is no verdict."""
    from k2edge.engine.check import verdict

    few = {"recall": 1.0, "found": 2, "reference_boxes": 2, "precision": 1.0, "kept": 2, "int8_boxes": 2}
    enough = {**few, "found": 50, "reference_boxes": 50, "kept": 50, "int8_boxes": 50}
    assert verdict("detection", few, True, False) == "inconclusive"
    assert verdict("detection", enough, True, False) == "passed" and verdict("detection", enough, True, True) == "fallback"
    assert verdict("detection", few, False, False) == "failed"
    assert verdict("tensor", {"samples": 19}, True, False) == "inconclusive" == verdict("classification", {"samples": 199}, True, False)
    check = Int8Check("detection", "inconclusive", "held-out", 8, {**few, "score_ratio": 1.0}, {"recall": 0.5})
    assert "INCONCLUSIVE" in check.line() and "at least 50 FP32 boxes" in check.line() and not check.passed
    assert Int8Check.from_dict(json.loads(json.dumps(check.to_dict()))) == check


# --- the check at every build: stderr, --json, cache --------------------------------------------------------

@pytest.mark.slow
def test_check_line_on_stderr_and_int8_check_in_json(tmp_path):
    """build/eval --json carry int8_check in their one document, infer --json in each line; the line is on stderr.
    40 held-out samples agree 40/40, fewer than the 200 a verdict needs: inconclusive, with what data to give."""
    cache = str(tmp_path / "cache")
    proc = k2edge("build", MODEL, "-p", "c2", "--json", "--cache", cache)
    d = json.loads(proc.stdout)
    check = d["int8_check"]
    assert check["status"] == "inconclusive" and check["source"] == "held-out" and check["samples"] == 40
    assert check["minimum"] == {"count": "samples", "judged": 40, "needed": 200} and "--check DATA" in check["advice"]
    assert check["measures"]["agreement"] == 1.0 and check["measures"]["agreed"] == 40 and d["plan"]["int8_fallback"] == []
    low, high = check["measures"]["bounds"]["agreement"]
    assert 0.9 < low < 0.95 and high == 1.0  # Wilson 95 % of 40/40: 0.912-1
    assert "int8 check (held-out, 40 sample(s)): 40/40 top-1 agree" in proc.stderr and "INCONCLUSIVE" in proc.stderr
    samples = sorted((ROOT / "models/digits/samples").glob("*.jpg"))[:2]
    proc = k2edge("infer", MODEL, "-p", "c2", *map(str, samples), "--json", "--cache", cache)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["int8_check"]["status"] == "inconclusive" for line in lines)
    assert proc.stderr.count("int8 check") == 1
    proc = k2edge("eval", MODEL, "-p", "c4", "--dataset", str(ROOT / "models/digits/eval.npz"), "--json", "--cache", cache)
    doc = json.loads(proc.stdout)
    assert doc["top1"] == pytest.approx(538 / 540) and doc["int8_check"]["fallback"] == []
    fp16 = k2edge("build", MODEL, "-p", "c5", "--json", "--cache", cache)
    assert json.loads(fp16.stdout)["int8_check"] is None and "int8 check" not in fp16.stderr


def test_check_on_a_given_set(tmp_path):
    """--check DATA measures on that set instead of the held-out samples: 512 samples give a verdict."""
    engine = Engine.build(MODEL, "c2", check=ROOT / "models/digits/eval.npz", cache_dir=tmp_path)
    check = engine.info.int8_check
    assert check.source.endswith("eval.npz (left out: 28 beyond the first 512 judged)") and check.samples == 512 and check.status == "passed"
    assert check.power == ("samples", 512, 200) and check.advice() == ""


def test_second_build_is_a_cache_hit_without_calibration(tmp_path, caplog):
    first = Engine.build(MODEL, "c2", cache_dir=tmp_path)
    caplog.set_level(logging.INFO, logger="k2edge")
    again = Engine.build(MODEL, "c2", cache_dir=tmp_path)
    assert again.info.cache_hits["int8"] and not any("calibrating" in r.getMessage() for r in caplog.records)
    assert again.info.int8_check == first.info.int8_check


def test_one_calibration_and_decision_shared_by_every_batch_size(silu, tmp_path):
    """Batch 1 and batch 2 engines of one model: one calibration, one check, the same layers fall back."""
    engines = [Engine.build(silu / "silu.onnx", {"edge_runtime": {**GPU_CHAIN["edge_runtime"], "batch_size": b}},
                            cache_dir=tmp_path) for b in (1, 2)]
    assert [e.batch_size for e in engines] == [1, 2]
    assert len(list((tmp_path / "int8-stats").iterdir())) == 1
    assert len(list((tmp_path / "int8-decision").iterdir())) == 1
    assert engines[1].info.cache_hits["int8"]
    assert engines[0].plan.int8_fallback == engines[1].plan.int8_fallback != ()


# --- fallback -----------------------------------------------------------------------------------------------

def test_fallback_moves_the_most_sensitive_layers_to_fp16_until_the_tolerance_holds(silu, tmp_path, monkeypatch):
    """The fallback moves learned layers (each with its SiLU epilogue) ranked by their measured effect on the output,
    most sensitive first; every learned layer not moved stays INT8 in the Q/DQ model (none de-quantised by
    accident), and the plan's FLOP shares are those of the Q/DQ model. (This ranking keeps under 90 % of this small
    model's INT8, where the second ranking runs and, here, keeps more: it is held off to test the first.)"""
    from k2edge.engine import int8 as decision
    from k2edge.engine.quantize import learned_layers, qdq_int8_layers

    monkeypatch.setattr(decision, "SECOND_RANKING_BELOW", 0.0)

    card = tmp_path / "silu.card.toml"  # a tolerance a few layers in FP16 meet (all-INT8: cosine 0.99952)
    card.write_text('task = "tensor"\n[input]\nscale = 0.00392156862745098\n[quantization]\ntolerance = { cosine = 0.9996 }\n')
    engine = Engine.build(silu / "silu.onnx", GPU_CHAIN, card=card, cache_dir=tmp_path)
    check = engine.info.int8_check
    assert check.status == "fallback" and check.before["cosine"] < 0.9996 <= check.measures["cosine"]
    moved = engine.plan.int8_fallback
    assert moved and all(f["precision"] == "fp16" and f["device"] == "gpu" and f["sensitivity"] >= 0 for f in moved)
    assert moved[0]["sensitivity"] > 0
    units = list(dict.fromkeys(f["unit"] for f in moved))
    by_unit = {f["unit"]: f["sensitivity"] for f in moved}
    assert [by_unit[u] for u in units] == sorted(by_unit.values(), reverse=True)  # most sensitive first
    names = {f["node"] for f in moved}
    learned = set(learned_layers(engine.model.graph))
    assert set(units) & learned and names - set(units)  # a learned layer moves with its epilogue (Sigmoid, Mul)
    assert all(f["unit"] in learned or f["node"] == f["unit"] for f in moved)  # anything else moves alone
    seg = engine.plan.segments[0]
    assert all(seg.layer_precision[n] == "fp16" for n in names)
    assert any("kept out of INT8" in n for n in engine.plan.notes)
    quant_dir = next(p for p in (tmp_path / "int8").iterdir()
                     if json.loads((p / "manifest.json").read_text())["meta"].get("fallback"))
    int8 = qdq_int8_layers(onnx.load(str(quant_dir / "qdq.onnx")), learned)
    assert int8 == learned - names and int8  # nothing else left INT8's Q/DQ
    shares = engine.plan.precision_flops
    assert shares["measured"] and 0 < shares["model"]["fp16"] < 1 and shares["model"]["int8"] + shares["model"]["fp16"] == pytest.approx(1, abs=1e-3)
    profile = tmp_path / "gpu.json"
    profile.write_text(json.dumps(GPU_CHAIN))
    shown = json.loads(k2edge("plan", str(silu / "silu.onnx"), "-p", str(profile), "--calib", str(silu / "calib.npz"),
                              "--card", str(card), "--cache", str(tmp_path), "--json").stdout)  # `plan` after the build
    assert [f["node"] for f in shown["int8_fallback"]] == [f["node"] for f in moved]
    assert shown["int8_check"]["status"] == "fallback" and shown["precision_flops"] == shares


def test_precision_int8_never_falls_back_but_warns(silu, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="k2edge")
    engine = Engine.build(silu / "silu.onnx", GPU_CHAIN, precision="int8", cache_dir=tmp_path)
    check = engine.info.int8_check
    assert check.status == "failed" and check.fallback == () and engine.plan.int8_fallback == ()
    assert "FAILED" in check.line() and any("forbids falling back" in r.getMessage() for r in caplog.records)


def test_exhausted_chain_warns_and_keeps_the_best(silu, tmp_path, caplog):
    card = silu / "impossible.toml"
    card.write_text('task = "tensor"\n[input]\nscale = 0.00392156862745098\n[quantization]\ntolerance = { cosine = 1.0 }\n')
    caplog.set_level(logging.WARNING, logger="k2edge")
    engine = Engine.build(silu / "silu.onnx", GPU_CHAIN, card=card, cache_dir=tmp_path)
    check = engine.info.int8_check
    assert check.status == "failed" and check.measures["cosine"] >= check.before["cosine"]
    assert any("keeping the best" in r.getMessage() for r in caplog.records)


def test_an_explicit_tolerance_the_check_cannot_resolve_is_refused(tmp_path):
    card = tmp_path / "card.toml"
    card.write_text((ROOT / "models/digits/card.toml").read_text().replace('labels = "labels.txt"', f'labels = "{ROOT}/models/digits/labels.txt"')
                    + "\n[quantization]\ntolerance = { agreement = 0.999 }\n")
    with pytest.raises(BuildError, match="agreement >= 0.999 needs at least 1000 \\(has 40\\)"):
        Engine.build(MODEL, "c2", card=card, cache_dir=tmp_path / "cache")


def test_tensorrt_route_gives_fallback_layers_fp16_and_keeps_the_ranges_int8_readers_need(silu, tmp_path, monkeypatch):
    """On the DLA route (test double of TensorRT 10) the fallback layers are constrained to FP16; a moved layer's
    output has a range only where an INT8 layer reads it (so that reader stays INT8), none inside a moved unit."""
    from trt_double import TrtDouble

    double = TrtDouble().install(monkeypatch)
    try:
        card = tmp_path / "silu.card.toml"  # a tolerance a few layers in FP16 meet (all-INT8 on the GPU: cosine 0.99952)
        card.write_text('task = "tensor"\n[input]\nscale = 0.00392156862745098\n[quantization]\ntolerance = { cosine = 0.9997 }\n')
        engine = Engine.build(silu / "silu.onnx", "c4", backend="tensorrt", card=card, cache_dir=tmp_path)
        moved = {f["node"] for f in engine.plan.int8_fallback}
        assert moved
        graph = engine.model.graph
        outputs = {o for n in graph.nodes if n.name in moved for o in n.outputs}
        inside = {o for o in outputs if all(graph.nodes[i].name in moved for i in graph.consumers.get(o, []))}
        precision = {n: p for s in engine.plan.segments for n, p in s.layer_precision.items()}
        int8_read = {o for o in outputs if any(precision.get(graph.nodes[i].name) == "int8" for i in graph.consumers.get(o, []))}
        dla = [b for b in double.builds if b["default_device"] == "DLA"]
        assert dla and inside
        ranged = set()
        for b in dla:
            tensors = {line.rpartition(": ")[0] for line in (b["calibration_cache"] or "").splitlines()[1:]}
            ranged |= tensors
            assert not inside & tensors
            assert all(b["layer_precision"].get(n) in (None, "HALF") for n in moved)
        assert any(b["layer_precision"].get(n) == "HALF" for b in dla for n in moved)
        # what TensorRT built, read from the engine inspector (each layer's input data type): a DLA loadable does not
        # report its layers' precisions (unobserved); on a GPU-only chain it matches the plan's shares
        from k2edge.engine.shares import observed_flop_shares

        observed = {s["index"]: s["placement"]["precision"] for s in engine.describe()["segments"]}
        assert observed_flop_shares(engine.plan, graph, observed)["unobserved"] == 1.0
        gpu = Engine.build(silu / "silu.onnx", GPU_CHAIN, backend="tensorrt", card=card, cache_dir=tmp_path)
        observed = {s["index"]: s["placement"]["precision"] for s in gpu.describe()["segments"]}
        built, planned = observed_flop_shares(gpu.plan, graph, observed), gpu.plan.precision_flops["model"]
        assert 0 < built["int8"] < 1 and built["fp16"] > 0 and built["unobserved"] == 0
        assert built["int8"] == pytest.approx(planned["int8"], abs=0.01)
        caches = [b["calibration_cache"] for b in double.builds if b.get("calibration_cache")]
        ranged |= {line.rpartition(": ")[0] for c in caches for line in c.splitlines()[1:]}
        assert int8_read <= ranged
    finally:
        from k2edge.engine.trt_cuda import release_primary_contexts

        double.gpu.resume()
        release_primary_contexts()
        double.shutdown()


# --- calibration sets ---------------------------------------------------------------------------------------

def test_calibration_set_errors_and_warnings(tmp_path, caplog):
    from PIL import Image

    from k2edge.errors import DatasetError
    from k2edge.model.datasets import open_calibration

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="no images found"):
        open_calibration(empty)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(DatasetError, match="1 of 1 image\\(s\\) unreadable"):
        open_calibration(bad)
    same = tmp_path / "same"
    same.mkdir()
    for i in range(10):
        Image.new("L", (32, 32), 128).save(same / f"{i}.png")
    caplog.set_level(logging.WARNING, logger="k2edge")
    engine = Engine.build(MODEL, "c2", calib=same, cache_dir=tmp_path / "cache")
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "fewer than 32" in text and "near-identical" in text
    assert engine.info.int8_check.source == "in-sample" and engine.info.int8_check.samples == 10


def test_a_tensor_set_that_does_not_fit_the_model_is_refused_before_calibrating(tmp_path):
    """A check set of the wrong shape is refused with its name before the calibration runs (it used to fail
    only after it, with no name); so are such a calibration set and an evaluation set."""
    good, wrong = tmp_path / "good.npz", tmp_path / "wrong.npz"
    np.savez(good, x=np.random.default_rng(0).random((40, 1, 32, 32), np.float32))
    np.savez(wrong, x=np.zeros((5, 3, 7, 7), np.float32))
    for calib, check, role in ((good, wrong, "check set"), (wrong, None, "calibration set")):
        proc = k2edge("build", str(MODEL), "-p", "c2", "--calib", str(calib), *(["--check", str(check)] if check else []),
                      "--cache", str(tmp_path / "cache"), check=False)
        assert_one_line_error(proc, f"{role} {wrong}: samples of shape (3, 7, 7) do not fit", "(1, 32, 32)")
    labelled = tmp_path / "labelled.npz"  # eval and pareto-sweep name the set too, before measuring anything
    np.savez(labelled, x=np.zeros((5, 3, 7, 7), np.float32), y=np.zeros(5, np.int64))
    for command in (("eval", str(MODEL), "-p", "cpu-dev"), ("pareto-sweep", str(MODEL), "--profiles", "cpu-dev",
                                                             "--out", str(tmp_path / "sweep"))):
        proc = k2edge(*command, "--dataset", str(labelled), "--cache", str(tmp_path / "cache"), check=False)
        assert_one_line_error(proc, f"evaluation set {labelled}: samples of shape (3, 7, 7) do not fit")


def test_coco_json_is_a_calibration_set(tmp_path):
    from k2edge.model.datasets import open_calibration

    ds = open_calibration(ROOT / "models/detector/eval/annotations.json")
    assert len(ds) == 200 and ds.labels is None and all(p.is_file() for p in ds.samples)


# --- the plan tells the truth about precision ---------------------------------------------------------------

def test_plan_shows_the_detector_head_in_float_and_inspect_counts_nodes():
    det = str(ROOT / "models/detector/model.onnx")
    data = json.loads(k2edge("plan", det, "-p", "c4", "--json").stdout)
    head = {f["node"] for f in data["int8_fallback"]}
    assert head and all(n.startswith("head/") for n in head)
    precision = {n: p for s in data["segments"] for n, p in s["layer_precision"].items()}
    assert all(precision[n] == "fp16" for n in head)
    text = k2edge("plan", det, "-p", "c4").stdout
    assert "kept out of INT8" in text
    shown = k2edge("inspect", det).stdout
    assert "> 99.9 % of FLOPs DLA-capable (42 of 59 nodes; 17 are not)" in shown
    # inspect: each node's precision under an INT8 profile, and the learned layers' INT8 share before the check
    assert "int8   19 learned layers; a profile that asks for INT8 runs 100.0" in shown and "17 node(s) the card keeps in float" in shown
    nodes = json.loads(k2edge("inspect", det, "--json").stdout)["nodes"]
    floats = {n["name"] for n in nodes if n["int8"] == "float (card)"}
    assert head <= floats and all(n.startswith("head/") for n in floats)
    assert all(n["int8"] == "int8" for n in nodes if n["op"] == "Conv" and n["name"] not in head)
    planned = data["precision_flops"]
    assert planned["measured"] is False and planned["model"]["int8"] > 0.99  # the head's learned FLOPs: none


def test_trust_require_int8_check_refuses_an_inconclusive_engine(tmp_path):
    """``[trust] require_int8_check = true``: the daemon refuses to serve digits on c2, whose check (40 held-out
    samples) is inconclusive, in one line that says why; without the key it would serve it."""
    import subprocess
    import sys

    from mqtt_support import free_port, write_config

    cfg = write_config(tmp_path / "d.toml", free_port(), [{"name": "digits", "onnx": MODEL, "profile": "c2", "top_k": 1}],
                       service={"cache_dir": str(tmp_path / "cache"), "max_batch": 1},
                       tables={"trust": {"allow_unsigned": True, "require_int8_check": True}})
    proc = subprocess.run([sys.executable, "-m", "k2edge", "serve", "--config", str(cfg)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "require_int8_check: the INT8 check is inconclusive" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "check = DATA in the model's [[models]] entry" in proc.stderr, proc.stderr


def test_a_models_check_set_makes_the_daemons_int8_check_conclusive(run_daemon, broker, tmp_path):
    """`check = ` in [[models]]: the daemon judges INT8 on it (digits' eval set, 512 of its 540 samples), so
    require_int8_check serves c2, whose 40 held-out samples alone are inconclusive."""
    from mqtt_support import Client

    model = {"name": "digits", "onnx": MODEL, "profile": "c2", "top_k": 1, "check": ROOT / "models/digits/eval.npz"}
    run_daemon(models=[model], service={"cache_dir": str(tmp_path / "cache"), "max_batch": 1},
               tables={"trust": {"allow_unsigned": True, "require_int8_check": True}})
    c = Client(broker.port).connect()
    try:
        c.wait_for(lambda c: any(s.get("state") == "online" for s in c.statuses), 10)
        check = [s for s in c.statuses if s.get("state") == "online"][-1]["models"][0]["int8_check"]
    finally:
        c.close()
    assert check["status"] == "passed" and check["samples"] == 512, check
    assert check["source"].endswith("eval.npz (left out: 28 beyond the first 512 judged)"), check


def test_a_check_set_is_judged_on_distinct_samples_that_did_not_calibrate(tmp_path):
    """250 copies of one sample are one sample (inconclusive, not passed); the calibration set given as the check set
    leaves only its held-out samples; what was left out is in the check's source."""
    from k2edge.engine.int8 import check_indices
    from k2edge.model.datasets import open_dataset
    from k2edge.engine.quantize import calibration_split

    calib = open_dataset(ROOT / "models/digits/calib.npz")
    x = np.load(ROOT / "models/digits/calib.npz")["x"]
    calibrating = calibration_split(len(calib))[0]
    np.savez(tmp_path / "one.npz", x=np.repeat(x[4:5], 250, 0))  # a held-out sample: it did not calibrate
    idx, note = check_indices(open_dataset(tmp_path / "one.npz"), calib, calibrating)
    assert idx == [0] and note == "left out: 249 repeated sample(s)"
    idx, note = check_indices(calib, calib, calibrating)
    assert idx == [i for i in range(len(calib)) if i not in set(calibrating)] and \
        note == f"left out: {len(calibrating)} calibration sample(s)"
    proc = k2edge("build", str(MODEL), "-p", "c2", "--check", str(tmp_path / "one.npz"), "--calib",
                  str(ROOT / "models/digits/calib.npz"), "--json")
    check = json.loads(proc.stdout)["int8_check"]
    assert check["status"] == "inconclusive" and check["samples"] == 1, check
    assert check["source"].endswith("one.npz (left out: 249 repeated sample(s))"), check
    np.savez(tmp_path / "fitted.npz", x=np.repeat(x[:1], 250, 0))
    assert_one_line_error(k2edge("build", str(MODEL), "-p", "c2", "--check", str(tmp_path / "fitted.npz"), "--calib",
                                 str(ROOT / "models/digits/calib.npz"), check=False),
                          "no sample is left to judge the INT8 check on (249 repeated sample(s) and 1 calibration sample(s))")


def test_the_fallback_search_finds_the_smallest_prefix_in_few_checks():
    """Doubling from below, then bisection: the smallest k that holds, in about 2 log2(k) checks; None when even all
    units do not suffice; a non-monotonic measure still gives a k that held."""
    from k2edge.engine.fallback import smallest_prefix

    for need, n in ((1, 95), (3, 95), (37, 95), (95, 95)):
        calls = []
        got = smallest_prefix(lambda k: calls.append(k) or k >= need, n)
        assert got == need and len(calls) <= 2 * max(1, need).bit_length() + 2, (need, calls)
    assert smallest_prefix(lambda k: False, 10) is None and smallest_prefix(lambda k: True, 0) is None
    odd = {1: False, 2: True, 3: False, 4: True}
    assert smallest_prefix(lambda k: odd.get(k, True), 8) == 2


def test_where_the_sensitivity_ranking_keeps_under_90_percent_the_ranking_keeping_more_int8_wins(silu, tmp_path,
                                                                                                monkeypatch):
    """The same model and tolerance as above: the sensitivity ranking's fallback keeps under 90 % of the INT8 FLOPs, so
    the cost-per-FLOP ranking runs too, and its fallback, which meets the tolerance keeping more INT8, is the one
    built (the check's note says so, and each moved layer gives that reason)."""
    from k2edge.engine import int8 as decision

    card = tmp_path / "silu.card.toml"
    card.write_text('task = "tensor"\n[input]\nscale = 0.00392156862745098\n[quantization]\ntolerance = { cosine = 0.9996 }\n')
    monkeypatch.setattr(decision, "SECOND_RANKING_BELOW", 0.0)
    first = Engine.build(silu / "silu.onnx", GPU_CHAIN, card=card, cache_dir=tmp_path / "first")
    monkeypatch.undo()
    both = Engine.build(silu / "silu.onnx", GPU_CHAIN, card=card, cache_dir=tmp_path / "both")
    kept = lambda e: e.plan.precision_flops["model"]["int8"]  # noqa: E731
    assert kept(first) < 0.9 and kept(both) > kept(first), (kept(first), kept(both))
    check = both.info.int8_check
    assert check.status == "fallback" and check.measures["cosine"] >= 0.9996, check.line()
    assert any(n.startswith("ranked by INT8-alone cost per FLOP") for n in check.notes), check.notes
    assert {f["reason"] for f in both.plan.int8_fallback} == {decision.COST_REASON}
    # each carries the figure its ranking judged it by, named for what it is (it was called a sensitivity)
    assert all(f.get("int8_alone_error") is not None and "sensitivity" not in f for f in both.plan.int8_fallback)
    from k2edge.engine.check import fallback_figure

    assert fallback_figure(both.plan.int8_fallback[0]).endswith("with it alone in INT8, ranked per FLOP")
    assert "% of all-INT8's output error goes away with it in float" in fallback_figure(first.plan.int8_fallback[-1])


def test_cost_per_flop_ranking_moves_flopless_units_first_then_the_costliest_per_flop():
    """The second ranking (INT8 alone, per FLOP): units with no learned FLOPs move first (moving them keeps every
    INT8 layer INT8), then the highest cost per FLOP; the cheapest per FLOP stay INT8; ties keep graph order."""
    from k2edge.engine.fallback import rank_by_cost_per_flop

    order = ["conv0", "add", "conv1", "conv2", "conv3"]
    costs = {"conv0": 0.02, "add": 0.0, "conv1": 0.001, "conv2": 0.004, "conv3": 0.004}
    flops = {"conv0": 100, "add": 0, "conv1": 1000, "conv2": 1000, "conv3": 1000}
    assert rank_by_cost_per_flop(costs, flops, order) == ["add", "conv0", "conv2", "conv3", "conv1"]


def test_a_method_closer_by_less_than_the_check_resolves_is_too_close_to_call():
    """auto keeps percentile over max on the all-INT8 check only when the check resolves the difference: percentile's
    margin above what max's binding measure reaches at the top of its 95 % interval. NudeNet's YOLOv8n on four seeds:
    the two a box or two apart (strict recall 0.736 and 0.736 of 235 boxes), and percentile's fallback kept 47-79 %
    INT8 where max's kept 92-94 %; the PP-OCR classifier: percentile 250/256 against max 245/256 [0.925, 0.976]."""
    from k2edge.engine.check import wilson
    from k2edge.engine.int8 import too_close

    tol = {"recall": 0.97, "strict_recall": 0.93}

    def boxes(found, strict, n=235):
        return {"recall": found / n, "strict_recall": strict / n,
                "bounds": {"recall": wilson(found, n), "strict_recall": wilson(strict, n)}}

    default = boxes(208, 173)  # strict recall 0.736, interval about 0.68..0.79
    assert too_close(default, tol, boxes(218, 175), tol)  # two boxes closer: within max's interval
    assert not too_close(default, tol, boxes(218, 173), tol)  # as close: max kept, no comparison
    assert not too_close(default, tol, boxes(218, 170), tol)  # further: max kept
    assert not too_close(default, tol, boxes(230, 200), tol)  # 0.851 > the interval's top: percentile resolved better
    agree = {"agreement": 0.99}
    cls = lambda k: {"agreement": k / 256, "bounds": {"agreement": wilson(k, 256)}}  # noqa: E731
    assert not too_close(cls(245), agree, cls(250), agree) and too_close(cls(245), agree, cls(248), agree)
    assert not too_close({"recall": 0.9}, tol, {"recall": 0.95}, tol)  # no interval: every difference resolved


def test_methods_too_close_to_call_each_fall_back_and_the_one_keeping_more_int8_is_kept(silu, tmp_path, monkeypatch):
    """When the all-INT8 check cannot tell max from percentile (forced here), each falls back (percentile only as far
    as it would keep more INT8 than max's fallback) and the decision keeps the one that keeps more INT8: the same
    share as the better of the two methods named alone, and a note that says why."""
    from k2edge.engine import int8 as decision

    def card(method):
        path = tmp_path / f"{method}.card.toml"
        path.write_text(f'task = "tensor"\n[input]\nscale = 0.00392156862745098\n[quantization]\nmethod = "{method}"\n'
                        'tolerance = { cosine = 0.9996 }\n')
        return path

    kept = lambda e: e.plan.precision_flops["model"]["int8"]  # noqa: E731
    alone = {m: Engine.build(silu / "silu.onnx", GPU_CHAIN, card=card(m), cache_dir=tmp_path / m) for m in ("max", "percentile")}
    assert all(e.info.int8_check.status == "fallback" for e in alone.values()), [e.info.int8_check.line() for e in alone.values()]
    monkeypatch.setattr(decision, "too_close", lambda *a: True)
    auto = Engine.build(silu / "silu.onnx", GPU_CHAIN, card=card("auto"), cache_dir=tmp_path / "auto")
    better = max(alone, key=lambda m: (kept(alone[m]), m == "max"))
    check = auto.info.int8_check
    assert check.calibration.split()[0] == better and kept(auto) == pytest.approx(kept(alone[better])), (
        check.calibration, kept(auto), {m: kept(e) for m, e in alone.items()})
    assert check.status == "fallback" and check.measures["cosine"] >= 0.9996, check.line()
    assert any("so each fell back" in n for n in check.notes), check.notes


def test_a_profile_that_asks_for_int8_and_runs_little_of_it_says_so_in_text_and_json(tmp_path):
    """A card keeping most learned layers in float under c2: build's note says how little runs in INT8, in the text and
    in --json's plan notes (where a machine reading the lanes' "int8" would otherwise never see it)."""
    card = (ROOT / "models/digits/card.toml").read_text().replace('labels = "labels.txt"',
                                                                   f'labels = "{ROOT / "models/digits/labels.txt"}"')
    convs = [n.name for n in onnx.load(str(MODEL)).graph.node if n.op_type == "Conv"][1:]  # all but the stem
    (tmp_path / "card.toml").write_text(card + "\n[quantization]\nkeep_float = " + json.dumps(convs) + "\n")
    args = ["build", str(MODEL), "-p", "c2", "--card", str(tmp_path / "card.toml"), "--calib",
            str(ROOT / "models/digits/calib.npz")]
    data = json.loads(k2edge(*args, "--json").stdout)
    notes = [n for n in data["plan"]["notes"] if n.startswith("the profile asks for INT8, but only ")]
    assert len(notes) == 1 and data["plan"]["precision_flops"]["model"]["int8"] < 0.5, data["plan"]
    assert f"note: {notes[0]}" in k2edge(*args).stdout


def test_a_tolerance_of_zero_says_it_holds_for_anything():
    """One sample relaxes the default agreement to (n - 1) / n = 0: the line says that bound vouches for nothing."""
    from fractions import Fraction

    check = Int8Check("classification", "inconclusive", "x.npz", 1, {"agreement": 1.0, "mean_abs_dp": 0.0},
                      {"agreement": Fraction(0)})
    assert "within tolerance (agreement >= 0, which any result holds)" in check.line(), check.line()
    assert "agreement >= 39/40" in Int8Check("classification", "inconclusive", "held-out", 40, {"agreement": 1.0,
                                            "mean_abs_dp": 0.0}, {"agreement": Fraction(39, 40)}).line()
