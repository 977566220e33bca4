"""Rebuild tests/fixtures/zoo/*.onnx: classic image classifiers, old-exporter style.

Run with the separate torch venv (not the project venv):

    /work/.venv-zoo/bin/python tools/make_zoo_fixtures.py [name ...]

(/work/.venv-zoo: ``pip install torch==2.14.1 torchvision==0.29.1 onnx onnxruntime``.)

Each torchvision architecture is built with ``weights=None`` (random init, seeded;
nothing is downloaded) and exported by torch's legacy TorchScript exporter
(``dynamo=False``) the way the old ONNX model-zoo exporters wrote models:
initializers also listed as graph inputs, dynamic batch dimension, opset 9,
no constant folding (BatchNormalization kept, Shape/Gather/... subgraphs kept).
Float initializers with more than 256 elements then have their data removed;
their statistics go into the tensor's doc_string and tests/support/zoo.py regenerates
them.  Finally each fixture is checked: torch vs onnxruntime on the full export,
and checker + onnxruntime (batch 1 and 2) on the regenerated model.
"""

from __future__ import annotations

import collections
import importlib
import io
import pathlib
import sys
import tempfile
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torchvision
from torchvision import models as tvm
from torchvision.models.resnet import BasicBlock

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "tests" / "fixtures" / "zoo"
sys.path.insert(0, str(ROOT / "tests" / "support"))

import zoo  # noqa: E402  (tests/support/zoo.py: strip() writes the markers that zoo.load() reads)

OPSET = 9  # the legacy exporter accepts 9 for all six models (checked with torch 2.14.1)
SEED = 0


class ResNet18ViewFlatten(tvm.ResNet):
    """torchvision's resnet18 with the flatten written as old torchvision had it.

    Current torchvision uses ``torch.flatten(x, 1)``, which opset 9 exports as a
    single Flatten node.  torchvision <= 0.2 wrote ``x.view(x.size(0), -1)``,
    which exports as Shape->Gather->Unsqueeze->Concat->Reshape -- the constant
    subgraph the fixtures are meant to contain.  Same modules and parameter
    names (conv1.weight, fc.bias, ...) and same init as tvm.resnet18(weights=None);
    only the forward's flatten differs.
    """

    def __init__(self) -> None:
        super().__init__(BasicBlock, [2, 2, 2, 2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        x = x.reshape(x.size(0), -1)
        return self.fc(x)


MODELS = {
    "resnet18": ResNet18ViewFlatten,
    "squeezenet1_1": lambda: tvm.squeezenet1_1(weights=None),
    "googlenet": lambda: tvm.googlenet(weights=None, aux_logits=False, init_weights=True),
    "mobilenet_v2": lambda: tvm.mobilenet_v2(weights=None),
    "densenet121": lambda: tvm.densenet121(weights=None),
    "shufflenet_v2_x1_0": lambda: tvm.shufflenet_v2_x1_0(weights=None),
}


def export(name: str) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """Export model ``name``; return (model, input, torch output) for checking."""
    torch.manual_seed(SEED)
    model = MODELS[name]().eval()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            buf,
            dynamo=False,
            opset_version=OPSET,
            keep_initializers_as_inputs=True,
            do_constant_folding=False,
            input_names=["data"],
            output_names=["prob"],
            dynamic_axes={"data": {0: "N"}, "prob": {0: "N"}},
        )
    with torch.no_grad():
        ref = model(x).numpy()
    return onnx.load_from_string(buf.getvalue()), x.numpy(), ref


def run_ort(model_or_path, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3  # silence "initializer is also a graph input" warnings
    src = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return sess.run(["prob"], {"data": x})[0]


def verify(name: str, full: onnx.ModelProto, x: np.ndarray, ref: np.ndarray) -> None:


    # 1. the full (unstripped) export matches torch
    got = run_ort(full, x)
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4, err_msg=f"{name}: ORT vs torch")

    # 2. the regenerated fixture: checker, ORT at batch 1 and 2, finite outputs
    m = zoo.load(name)
    onnx.checker.check_model(m)
    assert all(not t.doc_string for t in m.graph.initializer), name
    for t in m.graph.initializer:  # BN running_var must stay positive
        if t.name.endswith("running_var"):
            assert (onnx.numpy_helper.to_array(t) > 0).all(), t.name
    rng = np.random.default_rng(123)
    for batch in (1, 2):
        xb = rng.standard_normal((batch, 3, 224, 224), dtype=np.float32)
        with tempfile.TemporaryDirectory() as d:
            out = run_ort(zoo.save(name, pathlib.Path(d) / f"{name}.onnx"), xb)
        assert out.shape == (batch, 1000), (name, out.shape)
        assert np.isfinite(out).all(), f"{name}: non-finite output at batch {batch}"
    # determinism
    a, b = zoo.load(name, seed=0), zoo.load(name, seed=0)
    assert a.SerializeToString() == b.SerializeToString(), name


def summary(m: onnx.ModelProto) -> str:
    hist = collections.Counter(n.op_type for n in m.graph.node)
    init_names = {t.name for t in m.graph.initializer}
    in_names = {i.name for i in m.graph.input}
    return (
        f"opset={m.opset_import[0].version} ir={m.ir_version} nodes={len(m.graph.node)} "
        f"inits={len(init_names)} inits_as_inputs={init_names <= in_names} "
        f"ops={dict(sorted(hist.items(), key=lambda kv: -kv[1]))}"
    )


def main(names: list[str]) -> None:
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, onnx {onnx.__version__}, "
          f"onnxruntime {ort.__version__}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in names or list(MODELS):
        full, x, ref = export(name)
        stripped = onnx.ModelProto()
        stripped.CopyFrom(full)
        n = zoo.strip(stripped)
        path = OUT_DIR / f"{name}.onnx"
        onnx.save(stripped, str(path))
        size = path.stat().st_size
        assert size < 1 << 20, f"{name}: fixture is {size} bytes"
        importlib.reload(zoo)  # NAMES is read from the directory at import
        verify(name, full, x, ref)
        print(f"{name}: {size} bytes, {n} initializers stripped, {summary(stripped)}")


if __name__ == "__main__":
    main(sys.argv[1:])
