"""Options and helpers shared by the commands."""

from __future__ import annotations

import argparse
import json
import math
import sys

from .._json import json_default

BOARD_CHOICES = ("orin-agx", "orin-nx-16", "orin-nx-8", "orin-nano")


def count(minimum: int, maximum: int | None = None):
    """An argparse type: a whole number within [minimum, maximum]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"at least {minimum}" if maximum is None else f"within [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _finite(text: str, zero_allowed: bool | None) -> float:
    """``text`` as a finite number: above 0, or >= 0 with ``zero_allowed``, or any (None)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    in_range = True if zero_allowed is None else value >= 0 if zero_allowed else value > 0
    if not (in_range and math.isfinite(value)):
        bound = "" if zero_allowed is None else " >= 0" if zero_allowed else " above 0"
        raise argparse.ArgumentTypeError(f"must be a finite number{bound}, got {text}")
    return value


def finite_float(text: str) -> float:
    """An argparse type: any finite number (what it may be beyond that is the receiver's to judge)."""
    return _finite(text, zero_allowed=None)


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (a time in seconds, say)."""
    return _finite(text, zero_allowed=False)


def seconds_or_zero(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 allowed (it means "none" or "forever": the option says which)."""
    return _finite(text, zero_allowed=True)


def input_file(path: str):
    """The ``Path`` of an input file (an image, an .npy) a command reads.

    Raises:
        InputError: ``path`` is a directory, or no file.
    """
    from pathlib import Path

    from ..errors import InputError

    p = Path(path)
    if p.is_dir():
        raise InputError(f"input {path!r} is a directory; give an image or .npy file")
    if not p.is_file():
        raise InputError(f"input file {path!r} does not exist")
    return p


MAX_DIM = 65536  # inspect's --batch-size bound too
MAX_ELEMENTS = 2**31 - 1  # an input tensor larger than ONNX Runtime's and TensorRT's int32 volumes is not one to build


def input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """Parse ``NAME=1x3x224x224``."""
    name, sep, dims = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        shape = tuple(int(d) for d in dims.lower().split("x"))
        if any(d <= 0 for d in shape):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=DxDx..., e.g. data=1x3x224x224, got {text!r}") from None
    if any(d > MAX_DIM for d in shape) or math.prod(shape) > MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(f"{text!r}: each dimension must be at most {MAX_DIM} and the whole at most "
                                         f"{MAX_ELEMENTS:,} elements")
    return name, shape


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="ONNX model file")
    p.add_argument("--input-shape", type=input_shape, action="append", default=[], metavar="NAME=DxD...",
                   help="static shape for an input with dynamic non-batch dimensions (repeatable)")
    p.add_argument("--card", metavar="FILE", help="model card (TOML) saying what the model is and how to feed it "
                   "(default: <model-stem>.card.toml or card.toml beside the model)")


def input_shapes_of(args, batch_size: int = 1) -> dict | None:
    """``--input-shape``, else the static shape a dynamic export takes from its card's size or its
    metadata's (as ``infer`` and ``build`` do), else None."""
    from pathlib import Path

    from ..config.resolve import card_file, input_shapes
    from ..model.ingest import load_onnx

    if args.input_shape:
        return dict(args.input_shape)
    return input_shapes(load_onnx(args.model)[0], card_file(Path(args.model), args.card), batch_size)


def add_build(p: argparse.ArgumentParser, default_profile: tuple[str, str] | None = None) -> None:
    """The build options; ``--profile`` is required unless ``default_profile`` gives (name, what it is)."""
    default = f"; default: {default_profile[0]} ({default_profile[1]})" if default_profile else ""
    p.add_argument("--profile", "-p", required=default_profile is None, metavar="P",
                   default=default_profile[0] if default_profile else None,
                   help=f"profile file or name (c1..c6, cpu-dev){default}")
    p.add_argument("--calib", metavar="DATA", help="calibration set for INT8: ImageFolder directory or .npz "
                   "(default: calib/ or calib.npz beside the model)")
    p.add_argument("--check", metavar="DATA", help="run the INT8 accuracy check on this set (images folder, .npz "
                   "or COCO .json) instead of every fifth calibration sample")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8"),
                   help="replace the profile's precision chain; fp32 is the reference mode (int8 alone: no "
                        "layer falls back, the check only warns)")
    p.add_argument("--board", choices=BOARD_CHOICES, help="board to plan for (default: this board, else orin-agx)")
    p.add_argument("--cache", metavar="DIR", help="engine cache directory (default: ~/.cache/k2edge)")
    p.add_argument("--backend", choices=("auto", "onnxruntime", "tensorrt"), default="auto",
                   help="auto: TensorRT where it exists, else ONNX Runtime (default)")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def board_of(args) -> str:
    if getattr(args, "board", None):
        return args.board
    from ..dla.boards import DEFAULT_BOARD, detect_board

    found = detect_board()
    return found.key if found else DEFAULT_BOARD


def build_engine(args):
    """Build the engine the common options describe; the INT8 check's line goes to stderr."""
    from ..engine.engine import Engine

    progress = Progress(json_output=getattr(args, "json", False))
    try:
        engine = Engine.build(args.model, args.profile, args.calib, precision=args.precision, board=board_of(args),
                              backend=args.backend, cache_dir=args.cache, input_shapes=dict(args.input_shape) or None,
                              card=args.card, check=getattr(args, "check", None), progress=progress.update)
    finally:
        progress.close()
    if engine.info.int8_check is not None:
        print(engine.info.int8_check.line(), file=sys.stderr)
    elif not engine.plan.runs_int8:
        given = [flag for flag in ("--calib", "--check") if getattr(args, flag[2:], None) is not None]
        if given:
            print(f"note: {' and '.join(given)} given, but profile {engine.profile.name or args.profile} runs no layer in "
                  "INT8: nothing was calibrated or checked", file=sys.stderr)
    return engine


class Progress:
    """A long step's progress (calibration, the INT8 fallback, an evaluation): a bar on stderr when it is a
    terminal (``calibrating [#####     ] 24/48``); where the output is not a terminal, one plain line per
    finished step with the elapsed and the estimated remaining time (see :func:`k2edge.eta.progress_outputs`).

    A step is a tenth of a phase (``calibrating: 24/240``), or each of a phase of ten or fewer (the INT8
    fallback's trials); a phase's last step always has its line.

    Args:
        total / label: the phase :meth:`advance` counts (``eval`` over the evaluation set).
        json_output: the command's stdout is a ``--json`` document (no lines there).
    """

    WIDTH = 24
    STEPS = 10

    def __init__(self, total: int = 0, label: str = "", json_output: bool = False) -> None:
        from ..eta import StepLines, progress_outputs

        self.total, self.label, self.done = total, label, 0
        bar, lines = progress_outputs(json_output)
        self.bar = sys.stderr if bar else None
        self.lines = StepLines(lines) if lines is not None else None
        self.shown = False
        self._what: str | None = None
        self._lined = 0
        self._last = self.lines.clock() if self.lines is not None else 0.0  # when the last update came

    def advance(self, n: int = 1) -> None:
        """``n`` more of the ``total`` done."""
        self.done += n
        self.update(self.label, self.done, self.total)

    def update(self, what: str, done: int, total: int) -> None:
        """``done`` of ``total`` of ``what`` (``Engine.build``'s ``progress`` callback)."""
        total = max(total, done, 1)
        if what != self._what:
            if self.lines is not None and self._what is not None:
                self.lines.restart(self._last)  # the new phase began when the last one's last step ended
            self._what, self._lined = what, 0
        if self.lines is not None:
            self._last = self.lines.clock()
        if self.bar is not None:
            filled = int(self.WIDTH * done / total)
            self.bar.write(f"\r{what} [{'#' * filled}{' ' * (self.WIDTH - filled)}] {done}/{total}\033[K")
            self.bar.flush()
            self.shown = True
        if self.lines is not None and (done >= total or done - self._lined >= total / self.STEPS):
            self._lined = done
            self.lines.line(f"{what}: {done}/{total}", done / total)

    def close(self) -> None:
        if self.shown:
            self.bar.write("\n")
            self.shown = False


def print_json(data) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=json_default)
    sys.stdout.write("\n")


def table(rows: list[list], header: list[str]) -> str:
    """A plain aligned text table (no dependency, pipes well)."""
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
