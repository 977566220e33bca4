"""``k2edge infer MODEL --profile P INPUT...``: classify or detect on images or ``.npy`` tensors."""

from __future__ import annotations

COMMAND = "infer"
HELP = "run a model on images or .npy tensors: top-k classes, detections or raw outputs, by its card"
ORDER = 40

import json
import time
from pathlib import Path

from ..errors import InputError
from .common import add_build, add_json, add_model, build_engine, input_file, table


def register(p) -> None:
    add_model(p)
    add_build(p)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="image files (JPEG, PNG, ...) or .npy tensors")
    p.add_argument("--top-k", type=int, default=5, metavar="K", help="classes to show per input (default 5)")
    p.add_argument("--save-output", metavar="OUT.npy", help="write the first output tensor of every input, stacked")
    p.add_argument("--save-annotated", metavar="OUT",
                   help="detection, segmentation, pose, obb: draw the boxes (masks, keypoints, rotated boxes) and labels "
                        "on each image; OUT is a directory (created), or an image file when there is one input")
    p.add_argument("--save-input", metavar="FILE.npy",
                   help="write the staged input batch [N, ...] of every input, stacked (to compare preprocessing)")
    add_json(p)


def _load(engine, path: str):
    """One input batch from an image or an .npy file (a sample, or a whole batch), with each sample's geometry."""
    import numpy as np

    p = input_file(path)
    if p.suffix == ".npy":
        from ..readfile import load_numpy

        try:
            arr = load_numpy(p)
        except (OSError, ValueError) as exc:
            raise InputError(f"{path}: not a readable .npy file ({exc})") from None
        if not isinstance(arr, np.ndarray):
            arr.close()
            raise InputError(f"{path}: an .npz archive, not a .npy array; save one with numpy.save")
        sample = tuple(engine.input_shape[1:])
        if tuple(arr.shape) == sample:
            arr = arr[None]
        if tuple(arr.shape[1:]) != sample or not 1 <= arr.shape[0] <= engine.batch_size:
            raise InputError(f"{path}: array of shape {tuple(arr.shape)} fits neither a sample {sample} "
                             f"nor a batch {tuple(engine.input_shape)} of input {engine.input_name!r}")
        if arr.dtype != np.float32:
            raise InputError(f"{path}: array dtype {arr.dtype}; input {engine.input_name!r} takes float32")
        if not np.isfinite(arr).all():  # the daemon refuses them too: no answer can be read from them
            raise InputError(f"{path}: the array holds NaN or infinite values")
        batch, geometries = engine.stage_mapped(list(arr))
        return batch, geometries, len(arr)
    batch, geometries = engine.stage_mapped([p])
    return batch, geometries, 1


def _annotated_path(out: Path, image: Path, single: bool) -> Path:
    if single and out.suffix.lower() in (".png", ".jpg", ".jpeg", ".bmp", ".webp"):
        return out
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{image.stem}.annotated.png"


def _print_human(path: str, record: dict, task: str) -> None:
    timing = f"({record['latency_ms']:.2f} ms, staging {record['stage_ms']:.2f} ms)"
    if task == "classification":
        best = ", ".join(f"{t['label']} {t['score']:.3f}" for t in record["top_k"])
        print(f"{path}: {best}  {timing}")
    elif "detections" in record:
        dets = record["detections"]
        print(f"{path}: {len(dets)} detection(s)  {timing}")
        if dets and task == "obb":
            rows = [[d["label"], f"{d['score']:.3f}", *(f"{v:.1f}" for v in d["rbox"][:4]), f"{d['rbox'][4]:.3f}"]
                    for d in dets]
            print("  " + table(rows, ["label", "score", "cx", "cy", "w", "h", "angle"]).replace("\n", "\n  "))
        elif dets:
            extra = {"segmentation": "mask", "pose": "keypoints"}.get(task)
            rows = [[d["label"], f"{d['score']:.3f}", *(f"{v:.1f}" for v in d["box"])]
                    + ([_extra(d, extra)] if extra else []) for d in dets]
            print("  " + table(rows, ["label", "score", "x1", "y1", "x2", "y2"] + ([extra] if extra else []))
                  .replace("\n", "\n  "))
    else:
        outs = ", ".join(f"{name} {o['dtype']} {o['shape']}" for name, o in record["outputs"].items())
        print(f"{path}: {outs}  {timing}")


def _extra(d: dict, what: str) -> str:
    if what == "mask":
        from ..tasks.segmentation import rle_area

        return f"{rle_area(d['mask'])} px"
    return f"{sum(1 for k in d['keypoints'] if k[2] >= 0.5)}/{len(d['keypoints'])} visible"


def run(args) -> int:
    import numpy as np

    if args.top_k < 1:
        raise InputError("--top-k must be at least 1")
    for option, value in (("--save-output", args.save_output), ("--save-input", args.save_input)):
        if value and Path(value).is_dir():
            raise InputError(f"{option} {value!r} is a directory: name the .npy file to write")
        if value and not Path(value).resolve().parent.is_dir():
            raise InputError(f"{option} {value!r}: its directory does not exist")
    annotated = Path(args.save_annotated) if args.save_annotated else None
    if annotated is not None and not annotated.resolve().parent.is_dir():
        raise InputError(f"--save-annotated {args.save_annotated!r}: its directory does not exist")
    from ..model.ingest import model_file

    model_file(args.model)  # the model, then the inputs: a mistyped path is told before a build that may take minutes
    for path in args.inputs:
        input_file(path)
    engine = build_engine(args)
    task = engine.card.task
    from ..config.card import BOX_TASKS

    if annotated is not None and task not in BOX_TASKS:
        raise InputError(f"--save-annotated draws detections; this model's task is {task!r} (a card with "
                         "task = \"detection\" makes it a detector)")
    first_outputs, staged = [], []
    check = engine.info.int8_check.to_dict() if engine.info.int8_check is not None else None
    with engine:
        for path in args.inputs:
            t0 = time.perf_counter()
            batch, geometries, n = _load(engine, path)
            t1 = time.perf_counter()
            outputs = engine.infer({engine.input_name: batch})
            t2 = time.perf_counter()
            first_outputs.append(outputs[engine.output_names[0]][:n])  # drop the rows that only padded the batch
            if args.save_input:
                staged.append(np.array(batch[:n]))
            answer = engine.answers(outputs, 1, geometries, args.top_k)[0]
            record = {"input": path, **answer, "latency_ms": round((t2 - t1) * 1e3, 3),
                      "stage_ms": round((t1 - t0) * 1e3, 3), "profile": engine.profile.name,
                      "precision": "+".join(sorted({lane.precision for lane in engine.lanes()}))}
            if check is not None:
                record["int8_check"] = check
            if annotated is not None and not path.endswith(".npy"):
                target = _annotated_path(annotated, Path(path), len(args.inputs) == 1)
                from ..drawing import annotate

                try:
                    annotate(Path(path), record["detections"], target)
                except OSError as exc:
                    raise InputError(f"--save-annotated: cannot write {target} ({exc.strerror or exc})") from None
                record["annotated"] = str(target)
            if args.json:
                print(json.dumps(record))
            else:
                _print_human(path, record, task)
    if args.save_input:
        _save_npy("--save-input", args.save_input, np.concatenate(staged, axis=0))
    if args.save_output:
        _save_npy("--save-output", args.save_output, np.concatenate(first_outputs, axis=0))
    return 0


def _save_npy(option: str, path: str, array) -> None:
    """``array`` as .npy at exactly ``path`` (numpy.save given a name would add '.npy' to one without it)."""
    import numpy as np

    try:
        with open(path, "wb") as f:
            np.save(f, array)
    except OSError as exc:
        raise InputError(f"{option} {path!r}: cannot write ({exc.strerror or exc})") from None
