"""The fallback's probes run only what each variant of the all-INT8 (or all-float) model changed (engine/suffix.py):
the same outputs as running each variant whole, on a real Q/DQ model of a small SiLU net."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from k2edge.engine.calibration import collect_statistics, session
from k2edge.engine.fallback import OutputProbe
from k2edge.engine.quantize import QuantSettings, base_qdq, dla_ties, fallback_units, finish_qdq, unquantise_layers
from k2edge.engine.suffix import SharedPrefix, signatures
from k2edge.model.ingest import normalise


@pytest.fixture(scope="module")
def silu_qdq(tmp_path_factory):
    """The SiLU net, its all-INT8 Q/DQ model, its fallback units and a probe on four samples."""
    from graphs import silu_net, smooth_images

    tmp = tmp_path_factory.mktemp("suffix")
    onnx.save(silu_net(), str(tmp / "silu.onnx"))
    x = smooth_images(40).astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    nm = normalise(str(tmp / "silu.onnx"))
    stats = collect_statistics(nm.model, [(x[i:i + 1], 1) for i in range(0, 40, 2)])
    base = base_qdq(nm, stats, QuantSettings("max"), (), (), dla_ties(nm.graph, set()), tmp / "b.onnx")
    units = fallback_units(nm.graph, [n.name for n in nm.graph.nodes])
    probe = OutputProbe(nm.model, nm.graph.inputs[0], [(x[i:i + 1], 1) for i in (1, 9, 17, 33)])
    return nm, base, units, probe


def _whole(model: onnx.ModelProto, probe: OutputProbe) -> list[np.ndarray]:
    sess = session(model)  # unoptimised: no fusion at any cut either side
    return probe._joined([sess.run(None, {probe.input_name: b}) for b, _ in probe.batches])


def test_each_variant_runs_only_its_suffix_and_gives_the_whole_runs_outputs(silu_qdq):
    """Each learned layer back in float (the sensitivity's variants): the suffix starts at that layer (fewer nodes the
    later the layer), and its outputs equal a whole run of the variant; the errors equal the whole runs' errors."""
    nm, base, units, probe = silu_qdq
    qdq = finish_qdq(base, nm)
    variants = [unquantise_layers(qdq, nm.model, unit) for unit in units.values()]
    prefix = SharedPrefix(qdq)
    cuts = [prefix.suffix(v) for v in variants]
    assert len(units) >= 4 and all(c is not None for c in cuts)
    sizes = [len(c.nodes) for c in cuts]
    assert sizes[-1] < sizes[0] < len(qdq.graph.node), sizes  # the last layer's suffix is the shortest
    values = probe._base_values(qdq, {n for c in cuts for n in c.needs()})
    for v, c in zip(variants, cuts):
        got, want = probe._joined(probe._suffix_run(c, values)), _whole(v, probe)
        # equal, or an ulp apart (a float layer fused with its epilogue on one side of a cut and not the other)
        assert all(np.abs(g - w).max() <= 1e-6 * np.abs(w).max() for g, w in zip(got, want))
    by_suffix = list(probe.errors(variants, base=qdq))
    whole = [float(e) for e in probe.errors(variants)]
    assert by_suffix == pytest.approx(whole, rel=1e-3, abs=1e-9)
    assert len(set(np.round(by_suffix, 9))) > 1  # the variants differ: the comparison judged something


def test_a_variant_the_base_computes_whole_needs_no_run_and_a_subgraph_runs_whole(silu_qdq):
    """A variant equal to its base (another copy) is all base values; a model with an If runs whole (its branches
    read tensors its node does not list); a changed weight is a changed signature."""
    from onnx import TensorProto, helper

    nm, base, _, probe = silu_qdq
    qdq = finish_qdq(base, nm)
    copy = onnx.ModelProto()
    copy.CopyFrom(qdq)
    cut = SharedPrefix(qdq).suffix(copy)
    assert cut is not None and cut.nodes == [] and all(kind == "base" for kind, _ in cut.outputs)
    assert list(probe.errors([copy], base=qdq)) == pytest.approx([probe.error(qdq)], rel=1e-6)

    changed = onnx.ModelProto()
    changed.CopyFrom(qdq)
    w = next(t for t in changed.graph.initializer if len(t.dims) == 4)  # a Conv's weight (INT8)
    arr = onnx.numpy_helper.to_array(w).copy()
    arr.flat[0] += 1
    w.CopyFrom(onnx.numpy_helper.from_array(arr, w.name))
    assert signatures(changed)[w.name] != signatures(qdq)[w.name]
    assert SharedPrefix(qdq).suffix(changed) is not None and SharedPrefix(qdq).suffix(changed).nodes

    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y1"])], "b", [],
                               [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [1])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)], "g",
                          [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    with_if = helper.make_model(g)
    assert SharedPrefix(with_if).suffix(with_if) is None


def test_cuts_the_graphs_edges_need_run_as_the_whole_variant():
    """A node kept for an output the base lacks (MaxPool's Indices) with its other output read downstream, a changed
    initializer that is a graph output, and a variant input of another type (run whole): each variant's outputs by
    the probe equal a whole run."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    def init(name, a):
        return nh.from_array(np.asarray(a), name)

    def model(nodes, inits, outputs, shape=(1, 4)):
        g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, list(shape))],
                         [h.make_tensor_value_info(o, T.FLOAT, None) for o in outputs], inits)
        return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])

    def pooled(indices: bool, w: float, extra: float | None = None, shape=(1, 4)):
        nodes = [h.make_node("Unsqueeze", ["x", "ax"], ["x4"]),
                 h.make_node("MaxPool", ["x4"], ["p", "i"] if indices else ["p"], kernel_shape=[1]),
                 h.make_node("Mul", ["p", "W"], ["y"])]
        inits = [init("ax", np.array([0], np.int64)), init("W", np.full(4, w, np.float32))]
        outputs = ["y"]
        if indices:
            nodes.append(h.make_node("Cast", ["i"], ["yi"], to=T.FLOAT))
            outputs.append("yi")
        if extra is not None:
            inits.append(init("W3", np.full(4, extra, np.float32)))
            outputs.append("W3")
        return model(nodes, inits, outputs, shape)

    base = pooled(False, 1.0, extra=1.0)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    probe = OutputProbe(base, "x", [(x, 1), (x + 1, 1)])
    variants = [pooled(True, 2.0, extra=1.0), pooled(False, 1.0, extra=3.0), pooled(False, 2.0, 1.0, shape=(1, "n"))]
    cuts = [SharedPrefix(base).suffix(v) for v in variants]
    assert cuts[0] is not None and cuts[1] is not None and cuts[2] is None
    assert [n.op_type for n in cuts[0].nodes] == ["MaxPool", "Mul", "Cast"] and not cuts[1].nodes
    values = probe._base_values(base, cuts[0].needs() | cuts[1].needs())
    for v, cut in zip(variants, cuts[:2]):
        got, want = probe._joined(probe._suffix_run(cut, values)), _whole(v, probe)
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    # the base's outputs as the reference: the second variant by its suffix, the third run whole
    assert list(probe.errors(variants[1:], base=base)) == pytest.approx([probe.error(v) for v in variants[1:]])
