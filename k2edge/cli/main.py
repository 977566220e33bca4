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


def _command_modules():
    """Every ``k2edge/cli/*_cmd.py`` module, ordered by its ``ORDER``.

    Each declares ``COMMAND`` (the name), ``HELP`` (one line), ``ORDER`` (position in --help),
    ``register(parser)`` and ``run(args)``; heavy imports live inside ``run``.
    """
    import pkgutil

    from . import __path__ as cli_path

    mods = [importlib.import_module(f".{m.name}", __package__) for m in pkgutil.iter_modules(cli_path) if m.name.endswith("_cmd")]
    return sorted(mods, key=lambda m: (m.ORDER, m.COMMAND))


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exits 1; every command under it, nested ones
    (``card show``) included, also takes ``-v`` and ``--debug`` after its name."""

    def __init__(self, *args, common: argparse.ArgumentParser | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._common = common

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_subparsers(self, **kwargs):
        action = super().add_subparsers(**kwargs)
        add = action.add_parser

        def add_parser(name, **kw):
            return add(name, parents=[*kw.pop("parents", ()), self._common], common=self._common, **kw)

        action.add_parser = add_parser
        return action


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    # the same flags after a command (`k2edge infer ... --debug`); unset there, they leave the top level's value
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, default=argparse.SUPPRESS)
    parser = _Parser(prog="k2edge", description="Edge inference runtime for NVIDIA Jetson Orin (GPU + DLA).",
                     common=common)
    parser.add_argument("--version", action="version", version=f"k2edge {__version__}")
    _add_common(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for mod in _command_modules():
        p = sub.add_parser(mod.COMMAND, help=mod.HELP, description=mod.HELP)
        mod.register(p)
        p.set_defaults(run=mod.run)
    return parser


def _add_common(parser: argparse.ArgumentParser, **kw) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each step does", **kw)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors", **kw)


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
    except OSError as exc:  # the system refused a path the user gave: too long, not a directory, no permission
        if args.debug:
            raise
        print(f"k2edge {args.command}: error: {_os_error(exc)}", file=sys.stderr)
        return 1


def _os_error(exc: OSError) -> str:
    """``exc`` as one line: what the system said and about which path (shortened: it may be what was wrong)."""
    what = exc.strerror or type(exc).__name__
    name = str(exc.filename) if exc.filename is not None else ""
    if len(name) > 80:
        name = name[:60] + "..." + name[-17:]
    return f"{what}: {name}" if name else what


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
