"""``k2edge <command>``: dispatch to one module per command.

User errors (any K2EdgeError, bad arguments) print one line and exit 1; no traceback unless
``--debug``. Command modules import their heavy dependencies inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..errors import K2EdgeError

COMMANDS = (
    ("inspect", "inspect_cmd", "show a model's inputs, outputs and nodes with FLOPs and DLA support"),
    ("plan", "plan_cmd", "plan the GPU/DLA partition of a model under a profile"),
    ("build", "build_cmd", "build (or load from the cache) a model's engine for a profile"),
    ("infer", "infer_cmd", "classify images or .npy tensors"),
    ("eval", "eval_cmd", "measure top-1 accuracy on a labelled dataset"),
    ("profiles", "profiles_cmd", "list, show or validate profiles"),
    ("doctor", "doctor_cmd", "report backends, TensorRT/CUDA/L4T versions, DLA cores and the jtop service"),
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exits 1."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog="k2edge", description="Edge inference runtime for NVIDIA Jetson Orin (GPU + DLA).")
    parser.add_argument("--version", action="version", version=f"k2edge {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each step does")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module, help_text in COMMANDS:
        mod = importlib.import_module(f".{module}", __package__)
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.register(p)
        p.set_defaults(run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 1
    try:
        return args.run(args) or 0
    except K2EdgeError as exc:
        if args.debug:
            raise
        print(f"k2edge {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"k2edge {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
