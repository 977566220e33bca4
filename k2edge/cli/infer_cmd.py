"""``k2edge infer MODEL --profile P INPUT...``: classify images or ``.npy`` tensors."""

from __future__ import annotations

COMMAND = "infer"
HELP = "classify images or .npy tensors"
ORDER = 40

import json
import time
from pathlib import Path

from ..errors import InputError
from .common import add_build, add_json, add_model, build_engine


def register(p) -> None:
    add_model(p)
    add_build(p)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="image files (JPEG, PNG, ...) or .npy tensors")
    p.add_argument("--top-k", type=int, default=5, metavar="K", help="classes to show per input (default 5)")
    p.add_argument("--save-output", metavar="OUT.npy", help="write the first output tensor of every input, stacked")
    add_json(p)


def _load(engine, path: str):
    """One input batch from an image or an .npy file (a sample, or a whole batch)."""
    import numpy as np

    p = Path(path)
    if p.is_dir():
        raise InputError(f"input {path!r} is a directory; give image or .npy files")
    if not p.is_file():
        raise InputError(f"input file {path!r} does not exist")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except Exception as exc:
            raise InputError(f"{path}: not a readable .npy file ({exc})") from None
        sample = tuple(engine.input_shape[1:])
        if tuple(arr.shape) == sample:
            arr = arr[None]
        if tuple(arr.shape[1:]) != sample or not 1 <= arr.shape[0] <= engine.batch_size:
            raise InputError(f"{path}: array of shape {tuple(arr.shape)} fits neither a sample {sample} "
                             f"nor a batch {tuple(engine.input_shape)} of input {engine.input_name!r}")
        if arr.dtype != np.float32:
            raise InputError(f"{path}: array dtype {arr.dtype}; input {engine.input_name!r} takes float32")
        return engine.stage(list(arr)), len(arr)
    return engine.stage([p]), 1


def run(args) -> int:
    import numpy as np

    if args.top_k < 1:
        raise InputError("--top-k must be at least 1")
    if args.save_output and not Path(args.save_output).resolve().parent.is_dir():
        raise InputError(f"--save-output {args.save_output!r}: its directory does not exist")
    engine = build_engine(args)
    first_outputs = []
    with engine:
        for path in args.inputs:
            t0 = time.perf_counter()
            batch, n = _load(engine, path)
            t1 = time.perf_counter()
            outputs = engine.infer({engine.input_name: batch})
            t2 = time.perf_counter()
            first = outputs[engine.output_names[0]][:n]  # drop the rows that only padded the batch
            first_outputs.append(first)
            top = engine.top_k(first, args.top_k)[0]
            record = {"input": path, "top_k": top, "latency_ms": round((t2 - t1) * 1e3, 3),
                      "stage_ms": round((t1 - t0) * 1e3, 3), "profile": engine.profile.name,
                      "precision": "+".join(sorted({lane.precision for lane in engine.lanes()}))}
            if args.json:
                print(json.dumps(record))
            else:
                best = ", ".join(f"{t['label']} {t['score']:.3f}" for t in top)
                print(f"{path}: {best}  ({record['latency_ms']:.2f} ms, staging {record['stage_ms']:.2f} ms)")
    if args.save_output:
        try:
            np.save(args.save_output, np.concatenate(first_outputs, axis=0))
        except OSError as exc:
            raise InputError(f"--save-output {args.save_output!r}: cannot write ({exc.strerror or exc})") from None
    return 0
