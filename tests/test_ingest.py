"""ONNX ingest: classic exporter output (old opsets, initializers as inputs, constant subgraphs,
dynamic batch) normalises to static, folded graphs that compute the same outputs."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import graphs
import zoo
from k2edge import ModelError
from k2edge.model import normalise

FOLDED_OPS = {"Shape", "Gather", "Unsqueeze", "ConstantOfShape", "Constant", "Identity", "Dropout"}


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


@pytest.mark.parametrize("name", zoo.NAMES)
def test_zoo_models_normalise_and_match(name):
    """Each classic classifier exported at opset 9 normalises and still computes the same outputs."""
    original = zoo.load(name)
    assert original.opset_import[0].version == 9
    assert {i.name for i in original.graph.initializer} <= {i.name for i in original.graph.input}
    nm = normalise(original)
    g = nm.graph
    assert nm.opset == 17 and nm.original_opset == 9
    assert g.inputs == ("data",) and g.shape("data") == (1, 3, 224, 224)
    assert not {i.name for i in nm.model.graph.input} & set(g.initializers)
    assert not FOLDED_OPS & {n.op_type for n in g.nodes}, "constant subgraphs must be folded away"
    assert len({n.name for n in g.nodes}) == len(g.nodes) and all(n.name for n in g.nodes)
    for n in g.nodes:  # every tensor static
        for o in n.outputs:
            assert all(d > 0 for d in g.shape(o))
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    want, got = _run(original, x), _run(nm.model, x)
    assert np.abs(want - got).max() <= 1e-4 * max(np.abs(want).max(), 1e-30)


def test_shape_subgraph_is_folded_in_resnet18():
    """The exporter's Shape->Gather->Unsqueeze->Concat->Reshape flatten becomes one Reshape with a constant shape."""
    original_ops = [n.op_type for n in zoo.load("resnet18").graph.node]
    assert {"Shape", "Gather", "Unsqueeze", "Concat"} <= set(original_ops)
    g = normalise(zoo.load("resnet18")).graph
    reshape = [n for n in g.nodes if n.op_type == "Reshape"]
    assert len(reshape) == 1 and reshape[0].inputs[1] in g.initializers


def test_weights_from_constant_subgraph():
    """ConstantOfShape -> Mul weights are folded into an initializer the Conv reads."""
    model = graphs.constant_subgraph_weights()
    nm = normalise(model, batch_size=2)
    ops = [n.op_type for n in nm.graph.nodes]
    assert ops == ["Conv", "Relu"]
    conv = nm.graph.nodes[0]
    assert conv.inputs[1] in nm.graph.initializers
    np.testing.assert_allclose(nm.graph.constant(conv.inputs[1]), np.full((4, 3, 3, 3), 0.05, np.float32))
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(nm.model, x), _run(model, x), rtol=1e-5, atol=1e-6)


def test_dynamic_batch_gets_the_batch_size():
    """A dynamic first dimension takes the requested static batch size, and outputs follow."""
    nm = normalise(graphs.conv_chain(), batch_size=4)
    assert nm.graph.shape("x") == (4, 3, 16, 16) and nm.graph.shape("y") == (4, 10)


def test_dynamic_spatial_dims_need_a_shape():
    """A dynamic H/W is an error naming the input, unless --input-shape gives one."""
    model = graphs.conv_chain()
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "height"
    with pytest.raises(ModelError, match=r"input 'x' has a dynamic dimension 'height' at axis 2.*--input-shape "
                                         r"x=1x3xHx16 \(H: your size\)"):
        normalise(model)
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_param = "width"  # height and width: not one N twice
    with pytest.raises(ModelError, match=r"--input-shape x=1x3xHxW \(H, W: your size\)"):
        normalise(model)
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_value = 16
    nhwc = graphs.conv_chain()
    dims = nhwc.graph.input[0].type.tensor_type.shape.dim  # [1, 3, 16, 16] read as N, H, W, C: channels static last
    dims[1].dim_param, dims[2].dim_param, dims[3].dim_value = "height", "width", 3
    with pytest.raises(ModelError, match=r"--input-shape x=1xHxWx3 \(H, W: your size\)"):
        normalise(nhwc)
    nm = normalise(model, input_shapes={"x": (1, 3, 16, 16)})
    assert nm.graph.shape("x") == (1, 3, 16, 16)
    with pytest.raises(ModelError, match="names no input"):
        normalise(model, input_shapes={"image": (1, 3, 16, 16)})


def test_identity_and_dropout_removed_output_name_kept():
    """Pass-through nodes disappear; a graph output produced by one keeps its name."""
    nm = normalise(graphs.conv_chain(gap_head=False))
    assert "Identity" not in {n.op_type for n in nm.graph.nodes}
    assert nm.graph.outputs == ("y",) and nm.graph.producer["y"] == len(nm.graph.nodes) - 1


def test_custom_domain_names_the_node():
    """A node from a custom operator domain fails with one message naming it."""
    model = graphs.conv_chain()
    model.graph.node[1].domain = "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(ModelError, match=r"node 'relu0' \(com.example::Relu\) uses a custom operator domain"):
        normalise(model)


def test_broken_node_named_in_shape_error():
    """A node whose shapes cannot be inferred is named in the message."""
    model = graphs.single_node("Add", {"a": (1, 3, 8, 8), "b": (1, 4, 8, 8)}, (1, 3, 8, 8))
    with pytest.raises(ModelError, match="the_add"):
        normalise(model)


def test_unproduced_tensor_named():
    """A node reading a tensor nothing produces is named."""
    model = graphs.conv_chain()
    model.graph.node[3].input[0] = "ghost"
    with pytest.raises(ModelError, match=r"node 'relu1' \(Relu\) reads 'ghost', which nothing produces"):
        normalise(model)


def test_not_onnx_and_missing_file(tmp_path):
    """Garbage and missing files give one clear error."""
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\x01 definitely not protobuf \xff" * 10)
    with pytest.raises(ModelError, match="not an ONNX model"):
        normalise(junk)
    with pytest.raises(ModelError, match="does not exist"):
        normalise(tmp_path / "missing.onnx")


def test_sha256_is_stable():
    """Normalising twice gives byte-identical models (cache keys depend on it)."""
    assert normalise(zoo.load("squeezenet1_1")).sha256 == normalise(zoo.load("squeezenet1_1")).sha256


def test_opset9_upgrade_of_handmade_model():
    """An IR 3 / opset 9 model with initializers as inputs and a Constant-fed Reshape upgrades cleanly."""
    model = graphs.conv_chain(opset=9)
    model.ir_version = 3
    for init in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    nm = normalise(model)
    assert nm.opset == 17 and nm.model.ir_version >= 8
    assert nm.graph.inputs == ("x",)
    assert {i.data_type for i in nm.model.graph.initializer} == {TensorProto.FLOAT}
