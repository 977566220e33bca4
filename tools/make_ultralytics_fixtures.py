"""Rebuild tests/fixtures/ultralytics: Ultralytics exports of every task, and golden files of
Ultralytics' own post-processing and preprocessing for k2edge's parity tests.

Run it in its own venv (``ultralytics`` is AGPL-3.0: a dev tool here, never a dependency of k2edge
nor imported by its tests), the one ``tools/make_yolov8_fixture.py`` describes, plus scikit-image
for its sample photos:

    python3 -m venv .venv-yolo
    .venv-yolo/bin/pip install torch==2.14.1 torchvision==0.29.1 ultralytics onnx onnxruntime onnxslim scikit-image
    .venv-yolo/bin/python tools/make_ultralytics_fixtures.py [exports] [golden]

``exports``: each model built from the yaml inside the package with random weights
(``torch.manual_seed(0)``; a ``.yaml`` is a config, nothing is downloaded) and exported with
``imgsz=320`` (224 for the classifier), opset 17, static shapes (YOLOv10n with ``nms=False``: its
NMS-free head, ``[1, 300, 6]``); convolution and Linear weights stripped by
``tests/support/zoo.py`` as for the YOLOv8n fixtures (``zoo.load`` regenerates them). Checked: ONNX Runtime
on the full export matches the torch model; the stripped fixture runs.

``golden``: ``ultralytics_golden.npz``:

* post-processing: the synthetic raw outputs of ``tests/support/ultra_scenes.py`` (planted objects:
  overlapping boxes of several classes, masks, keypoints, angles; numpy only, so the tests make
  the same arrays) through Ultralytics' ``non_max_suppression``, ``scale_boxes``,
  ``process_mask_native`` and ``scale_coords``, as its predictors call them;
* preprocessing: scikit-image's sample photos through Ultralytics' ``LetterBox`` (BGR as OpenCV
  reads, ``cv2.resize`` ``INTER_LINEAR``, pad 114) and its tensor conversion (BGR -> RGB, / 255),
  stored as the uint8 values before ``/ 255``;
* the classifier's ``classify_transforms(112)`` (torchvision ``Resize`` + ``CenterCrop``) on the same
  photos;
* ``cv2.resize`` with ``INTER_LINEAR``, ``INTER_AREA`` and ``INTER_NEAREST`` on a small image,
  shrinking and enlarging (k2edge reimplements the three in numpy).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "tests" / "fixtures" / "ultralytics"
sys.path.insert(0, str(ROOT / "tests" / "support"))

SEED = 0
OPSET = 17
# name -> (yaml, imgsz, export options)
EXPORTS = {
    "yolov8n-seg": ("yolov8n-seg.yaml", 320, {}),
    "yolov8n-pose": ("yolov8n-pose.yaml", 320, {}),
    "yolov8n-cls": ("yolov8n-cls.yaml", 224, {}),
    "yolov8n-obb": ("yolov8n-obb.yaml", 320, {}),
    "yolo11n": ("yolo11n.yaml", 320, {}),
    "yolov10n": ("yolov10n.yaml", 320, {"nms": False}),  # nms=False: the NMS-free (end2end) head
}
# scikit-image's sample photo -> the [h, w] input it is letterboxed to: halved exactly, shrunk by a
# non-integer ratio into a non-square input, and a portrait-ish padding (one size each keeps the file small)
PHOTOS = {"astronaut": (256, 256), "coffee": (192, 320), "chelsea": (224, 320)}


def export(yaml: str, imgsz: int, options: dict, workdir: pathlib.Path):
    import onnx
    import torch
    from ultralytics import YOLO

    torch.manual_seed(SEED)
    yolo = YOLO(yaml)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        path = yolo.export(format="onnx", imgsz=imgsz, opset=OPSET, dynamic=False, batch=1, simplify=True,
                           verbose=False, **options)
    finally:
        os.chdir(cwd)
    return onnx.load(str(workdir / path)), yolo.model.eval()


def run_ort(model, x):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})


def make_exports(names) -> None:
    import numpy as np
    import onnx
    import torch

    import zoo

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in names:
        yaml, imgsz, options = EXPORTS[name]
        with tempfile.TemporaryDirectory() as work:
            full, torch_model = export(yaml, imgsz, options, pathlib.Path(work))
        x = np.random.default_rng(123).random((1, 3, imgsz, imgsz), dtype=np.float32)
        with torch.no_grad():
            ref = torch_model(torch.from_numpy(x))
        ref = ref[0] if isinstance(ref, (tuple, list)) else ref
        ref = (ref[0] if isinstance(ref, (tuple, list)) else ref).numpy()  # seg: (pred, protos)
        if isinstance(ref, dict):
            ref = None
        got = run_ort(full, x)
        if ref is not None and ref.shape == got[0].shape:
            np.testing.assert_allclose(got[0], ref, rtol=1e-3, atol=1e-3, err_msg=f"{name}: ORT vs torch")
        stripped = onnx.ModelProto()
        stripped.CopyFrom(full)
        # Conv weights, and the classifier's Linear (Gemm) weight
        weights = {n.input[1] for n in stripped.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")}
        n = zoo.strip(stripped, lambda t: t.name in weights)
        path = OUT_DIR / f"{name}.onnx"
        onnx.save(stripped, str(path))
        import importlib

        importlib.reload(zoo)
        m = zoo.load(name)
        onnx.checker.check_model(m, full_check=True)
        outs = run_ort(m, x)
        assert all(np.isfinite(o).all() for o in outs), name
        meta = {p.key: p.value[:60] for p in m.metadata_props if p.key in ("task", "imgsz", "stride", "kpt_shape",
                                                                           "end2end", "nms")}
        print(f"{name}: {path.stat().st_size} bytes, {n} stripped, inputs "
              f"{[list(d.dim_value for d in i.type.tensor_type.shape.dim) for i in m.graph.input]}, outputs "
              f"{[o.shape for o in outs]}, metadata {meta}")


def golden() -> None:
    import cv2
    import numpy as np
    import torch
    from skimage import data as skdata
    from ultralytics.data.augment import LetterBox
    from ultralytics.utils import nms, ops

    import ultra_scenes as sc

    out: dict[str, np.ndarray] = {}
    conf, iou = sc.CONF, sc.IOU

    def nms_(pred, **kw):
        return nms.non_max_suppression(torch.from_numpy(pred), conf, iou, max_det=sc.MAX_DET, **kw)[0]

    for h0, w0 in sc.ORIGINALS:
        key = f"{h0}x{w0}"
        # detection (YOLOv8 / YOLO11 layout)
        det = nms_(sc.detect_pred())
        det[:, :4] = ops.scale_boxes(sc.INPUT, det[:, :4], (h0, w0))
        out[f"detect/{key}"] = det.numpy()
        # end2end
        e2e = nms_(sc.end2end_pred(), end2end=True)
        e2e[:, :4] = ops.scale_boxes(sc.INPUT, e2e[:, :4], (h0, w0))
        out[f"end2end/{key}"] = e2e.numpy()
        # segmentation: as SegmentationPredictor with retina masks (process_mask_native)
        pred, protos = sc.seg_pred()
        seg = nms_(pred, nc=sc.NC)
        seg[:, :4] = ops.scale_boxes(sc.INPUT, seg[:, :4], (h0, w0))
        masks = ops.process_mask_native(torch.from_numpy(protos[0]), seg[:, 6:], seg[:, :4], (h0, w0))
        out[f"segment/{key}"] = seg[:, :6].numpy()
        out[f"segment_masks/{key}"] = np.packbits(masks.numpy().astype(bool), axis=-1)
        # pose: as PosePredictor
        pose = nms_(sc.pose_pred(), nc=sc.NC)
        kpts = pose[:, 6:].view(len(pose), sc.KPTS, 3)
        pose[:, :4] = ops.scale_boxes(sc.INPUT, pose[:, :4], (h0, w0))
        kpts = ops.scale_coords(sc.INPUT, kpts, (h0, w0))
        out[f"pose/{key}"] = pose[:, :6].numpy()
        out[f"pose_kpts/{key}"] = kpts.numpy()
        # obb: as OBBPredictor
        obb = nms_(sc.obb_pred(), nc=sc.NC, rotated=True)
        rboxes = torch.cat([obb[:, :4], obb[:, -1:]], dim=-1)
        rboxes[:, :4] = ops.scale_boxes(sc.INPUT, rboxes[:, :4], (h0, w0), xywh=True)
        out[f"obb/{key}"] = torch.cat([rboxes, obb[:, 4:6]], dim=-1).numpy()

    # preprocessing: LetterBox as the predictor builds it for a non-PyTorch model (auto=False)
    for photo, (h, w) in PHOTOS.items():
        rgb = getattr(skdata, photo)()
        bgr = np.ascontiguousarray(rgb[..., ::-1])
        if True:
            boxed = LetterBox((h, w), auto=False, stride=32)(image=bgr)
            out[f"letterbox/{photo}/{h}x{w}"] = np.ascontiguousarray(boxed[..., ::-1])  # RGB, before / 255
    # classifiers: Ultralytics' classify_transforms (torchvision Resize + CenterCrop on a PIL image), as
    # ClassificationPredictor applies them to an image read by OpenCV
    from PIL import Image
    from ultralytics.data.augment import classify_transforms

    for photo in PHOTOS:
        rgb = getattr(skdata, photo)()
        t = classify_transforms(112)(Image.fromarray(rgb))
        out[f"classify/{photo}/112"] = (t.numpy().transpose(1, 2, 0) * 255).round().astype(np.uint8)
    # cv2.resize itself for each interpolation k2edge reimplements, shrinking and enlarging
    small = (np.arange(37 * 53 * 3, dtype=np.int64).reshape(37, 53, 3) * 7919 % 251).astype(np.uint8)
    small[10:20, 5:40] = 255  # an edge
    out["resize/src"] = small
    for method, flag in (("linear", cv2.INTER_LINEAR), ("area", cv2.INTER_AREA), ("nearest", cv2.INTER_NEAREST)):
        for h, w in ((20, 31), (90, 70), (37, 20)):
            out[f"resize/{method}/{h}x{w}"] = cv2.resize(small, (w, h), interpolation=flag)
    import ultralytics

    out["scenes_sha256"] = np.array(sc.checksum())
    out["versions"] = np.array([f"ultralytics {ultralytics.__version__}", f"torch {torch.__version__}",
                                f"opencv {cv2.__version__}"])
    path = OUT_DIR / "ultralytics_golden.npz"
    np.savez_compressed(path, **out)
    print(f"{path}: {path.stat().st_size} bytes, {len(out)} arrays")


def main(args: list[str]) -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    os.environ["YOLO_OFFLINE"] = "1"
    settings = tempfile.mkdtemp(prefix="k2edge-yolo-settings-")
    os.environ["YOLO_CONFIG_DIR"] = settings
    try:
        what = [a for a in args if a in ("exports", "golden")] or ["exports", "golden"]
        names = [a for a in args if a in EXPORTS] or list(EXPORTS)
        if "exports" in what:
            make_exports(names)
        if "golden" in what:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            golden()
    finally:
        shutil.rmtree(settings, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
