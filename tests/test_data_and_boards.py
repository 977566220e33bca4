"""Datasets, input staging, board detection and the doctor's probes (on fake Jetson trees)."""

import io

import numpy as np
import pytest
from PIL import Image

from k2edge import DatasetError, InputError
from k2edge.dla.boards import detect_board
from k2edge.engine.probe import cuda_devices, jtop_service, l4t_release
from k2edge.model.datasets import open_dataset
from k2edge.config.card import InputSpec
from k2edge.tasks.preprocess import Preprocess


def test_imagefolder_labels_follow_the_model_labels(tmp_path):
    for cls in ("cat", "ant"):
        (tmp_path / cls).mkdir()
        Image.new("L", (4, 4)).save(tmp_path / cls / "a.png")
    ds = open_dataset(tmp_path, labels=["dog", "cat", "ant"])
    assert list(ds.labels) == [2, 1]  # ant, cat sorted; indices from the model's labels
    assert list(open_dataset(tmp_path).labels) == [0, 1]
    with pytest.raises(DatasetError, match="match no label"):
        open_dataset(tmp_path, labels=["dog"])


def test_flat_folder_is_unlabelled_and_empty_folder_fails(tmp_path):
    Image.new("L", (4, 4)).save(tmp_path / "a.png")
    assert not open_dataset(tmp_path).labelled
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="no images found"):
        open_dataset(empty)


def test_npz_checks(tmp_path):
    np.savez(tmp_path / "nox.npz", y=np.arange(3))
    with pytest.raises(DatasetError, match="has no 'x' array"):
        open_dataset(tmp_path / "nox.npz")
    np.savez(tmp_path / "bady.npz", x=np.zeros((3, 4, 4), np.uint8), y=np.arange(2))
    with pytest.raises(DatasetError, match="one integer label per sample"):
        open_dataset(tmp_path / "bady.npz")
    # a scalar 'y' (len() of an unsized object) and one of shape (N, 2) (more hits than samples) were tracebacks
    for name, y in (("y0d", np.int64(3)), ("y2d", np.zeros((3, 2), np.int64))):
        np.savez(tmp_path / f"{name}.npz", x=np.zeros((3, 4, 4), np.uint8), y=y)
        with pytest.raises(DatasetError, match=r"one integer label per sample, 3 in one row, got int64 of shape"):
            open_dataset(tmp_path / f"{name}.npz")
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(DatasetError, match="cannot read"):
        open_dataset(tmp_path / "junk.npz")
    np.savez(tmp_path / "scalar.npz", x=np.uint8(3), y=np.int64(1))
    with pytest.raises(DatasetError, match=r"'x' must be an array of samples .* got uint8 of shape \(\)"):
        open_dataset(tmp_path / "scalar.npz")
    x = np.zeros((4, 1, 8, 8), np.float32)
    x[2, 0, 3, 3] = np.inf
    np.savez(tmp_path / "inf.npz", x=x, y=np.arange(4))
    with pytest.raises(DatasetError, match=r"'x' holds NaN or infinite values \(1 of 4 samples\)"):
        open_dataset(tmp_path / "inf.npz")


def test_an_image_array_of_another_shape_is_refused_and_a_single_channel_axis_taken():
    """uint8 (H, W, 1) stages as (H, W); a 4-D array or two channels is an InputError naming what fits."""
    pre = Preprocess(InputSpec(color="L", size=(8, 8)))
    pixels = (np.arange(64, dtype=np.uint8) * 4).reshape(8, 8)
    np.testing.assert_array_equal(pre.stage(pixels[:, :, None]), pre.stage(pixels))
    for bad in (np.zeros((2, 8, 8, 1), np.uint8), np.zeros((8, 8, 2), np.uint8)):
        with pytest.raises(InputError, match=r"an image array must be uint8 \(H, W\)"):
            pre.stage(bad)


def test_stage_png_jpeg_bytes_array_agree():
    pre = Preprocess(InputSpec(color="L", size=(8, 8), mean=(0.5,), std=(0.25,)))
    pixels = (np.arange(64, dtype=np.uint8) * 4).reshape(8, 8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    a = pre.stage(pixels)
    b = pre.stage(png.getvalue())
    np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(a[0], (pixels / 255.0 - 0.5) / 0.25, atol=1e-6)
    rgb = Preprocess(InputSpec(color="RGB", size=(4, 4)))
    assert rgb.stage(Image.new("RGB", (16, 16), (255, 0, 0))).shape == (3, 4, 4)


def test_stage_errors():
    pre = Preprocess(InputSpec(color="L", size=(8, 8)))
    with pytest.raises(InputError, match="cannot decode image"):
        pre.stage(b"\x89PNG but not really")
    with pytest.raises(InputError, match="does not fit the model sample shape"):
        pre.stage(np.zeros((1, 4, 4), np.float32))
    with pytest.raises(InputError, match="does not exist"):
        pre.stage("/no/such/image.jpg")


def test_preprocess_from_demo_metadata(demo_model):
    from k2edge.model.ingest import normalise

    nm = normalise(demo_model)
    pre = Preprocess.for_model(nm.metadata(), nm.graph.shape("input"))
    assert pre.color == "L" and pre.size == (32, 32) and pre.sample_shape == (1, 32, 32)
    default = Preprocess.for_model({}, (1, 3, 224, 224))
    assert default.color == "RGB" and default.size == (224, 224)


def _jetson_tree(root, model: str, mem_kib: int):
    (root / "proc/device-tree").mkdir(parents=True)
    (root / "proc/device-tree/model").write_bytes(model.encode() + b"\x00")
    (root / "proc/meminfo").write_text(f"MemTotal:       {mem_kib} kB\n")
    (root / "etc").mkdir()
    (root / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n")
    (root / "dev").mkdir()
    (root / "dev/nvhost-gpu").write_text("")
    return root


@pytest.mark.parametrize("model, mem_kib, key, cores", [
    ("NVIDIA Jetson AGX Orin Developer Kit", 64 * 1024 * 1024, "orin-agx", 2),
    ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit", 15 * 1024 * 1024, "orin-nx-16", 2),
    ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit", 7 * 1024 * 1024, "orin-nx-8", 1),
    ("NVIDIA Jetson Orin Nano Developer Kit", 7 * 1024 * 1024, "orin-nano", 0),
])
def test_board_detection_on_fake_trees(tmp_path, model, mem_kib, key, cores):
    root = _jetson_tree(tmp_path, model, mem_kib)
    board = detect_board(root)
    assert board.key == key and board.dla_cores == cores
    assert l4t_release(root) == "R36.4.3"
    assert cuda_devices(root) == ["Tegra integrated GPU (nvgpu)"]
    state = jtop_service(root)
    assert state["socket"] is False and "systemctl enable --now jtop.service" in state["hint"]
    (root / "run").mkdir()
    (root / "run/jtop.sock").write_text("")
    assert jtop_service(root)["socket"] is True


def test_not_a_jetson(tmp_path):
    assert detect_board(tmp_path) is None and l4t_release(tmp_path) is None
    assert jtop_service(tmp_path)["hint"] == "not expected here: jtop runs on a Jetson"  # no Jetson advice off one


def test_a_limit_on_an_image_folder_takes_every_class():
    """--limit N on an ImageFolder (listed class by class) takes from each class in turn: its first 10 files were all
    class "0", so eval --limit 10 measured one class; an .npz keeps its own order."""
    from pathlib import Path

    from k2edge.model.datasets import open_labelled

    ROOT = Path(__file__).resolve().parents[1]
    labels = [str(i) for i in range(10)]
    folder = open_labelled(ROOT / "models" / "digits" / "calib", labels, limit=10)
    assert sorted(folder.labels.tolist()) == list(range(10)) and len(folder) == 10
    assert [Path(p).parent.name for p in folder.samples] == labels  # the first of each class, in class order
    npz = open_labelled(ROOT / "models" / "digits" / "eval.npz", labels, limit=10)
    full = open_labelled(ROOT / "models" / "digits" / "eval.npz", labels)
    assert npz.labels.tolist() == full.labels[:10].tolist()


def test_a_detectors_evaluation_set_given_as_npz_says_what_it_needs(tmp_path):
    """pareto-sweep on a detector with an .npz said "not a readable JSON annotation file ('utf-8' codec can't decode
    byte ...)"; eval said it clearly. Both open the set through open_coco, which now says what a detector needs."""
    from k2edge.model.datasets import open_coco

    np.savez(tmp_path / "eval.npz", x=np.zeros((2, 1, 8, 8), np.float32), y=np.arange(2))
    with pytest.raises(DatasetError, match=r"eval.npz: a detector is evaluated on a COCO annotation file \(.json"):
        open_coco(tmp_path / "eval.npz")
