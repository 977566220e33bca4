"""``k2edge card init MODEL [--out FILE]`` / ``k2edge card show MODEL``: write or show a model card."""

from __future__ import annotations

COMMAND = "card"
HELP = "write a model card to edit (init), or show the card a model runs with (show)"
ORDER = 15

import os
from pathlib import Path

from ..errors import K2EdgeError
from .common import input_shapes_of, add_json, add_model, print_json

HEADER = """\
# Model card for {model}, written by `k2edge card init` ({why}).
# Check every value against how the model was trained; see README "Models and cards".
# size is [height, width]; labels is relative to this file.
"""


def register(p) -> None:
    sub = p.add_subparsers(dest="card_command", metavar="SUBCOMMAND", required=True)
    i = sub.add_parser("init", help="write a suggested card beside the model (or --out FILE) to edit",
                       description="Suggest a card from the model's input and output shapes and write it.")
    add_model(i)
    i.add_argument("--out", metavar="FILE", help="where to write it (default: card.toml beside the model)")
    i.add_argument("--force", action="store_true", help="overwrite an existing file")
    s = sub.add_parser("show", help="the card a model runs with: --card or the one beside it, over its metadata",
                       description="Resolve the card (--card or beside the model > ONNX metadata > defaults) and print it.")
    add_model(s)
    add_json(s)


def _model(args):
    from ..model import normalise

    nm = normalise(args.model, input_shapes=input_shapes_of(args))
    g = nm.graph
    if len(g.inputs) != 1:
        raise K2EdgeError(f"k2edge serves single-input models; this one has inputs {list(g.inputs)}")
    return nm, g.inputs[0], g.shape(g.inputs[0]), {o: g.shape(o) for o in g.outputs}


def _metadata_names(metadata: dict) -> tuple[str, ...]:
    from ..config.card import CardError
    from ..config.ultralytics import UltralyticsMetadataError, read_ultralytics

    try:
        return read_ultralytics(metadata).names or ()
    except UltralyticsMetadataError as exc:
        raise CardError(str(exc)) from None


def _source_of(key: str, sources: dict[str, str]) -> str:
    """Where the value of ``key`` comes from; an inline table (``tolerance = { recall = 0.9 }``) is sourced key by
    key, so it names its one source, or each of its keys' when the layers that set it differ."""
    if key in sources:
        return sources[key]
    # a table-valued key has no default of its own per key (it is unset as a whole): every key it shows was set
    inner = {k[len(key) + 1:]: s for k, s in sources.items() if k.startswith(key + ".")}
    if not inner:
        return "default"
    if len(set(inner.values())) == 1:
        return next(iter(inner.values()))
    return "; ".join(f"{k}: {s}" for k, s in inner.items())


def _with_sources(toml: str, sources: dict[str, str]) -> str:
    """The card's TOML with ``# <source>`` after each value someone set (the rest are defaults)."""
    lines, table = [], ""
    for line in toml.splitlines():
        if line.startswith("[") and line.endswith("]"):
            table = line[1:-1] + "."
        key = line.split(" = ", 1)[0] if " = " in line and not line.startswith("#") else None
        if key is not None:
            line = f"{line}  # {_source_of(table + key, sources)}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from ..tasks.suggest import softmax_outputs, suggest_card

    nm, name, shape, outputs = _model(args)
    if args.card_command == "show":
        from ..config.card import card_sources
        from ..config.resolve import card_file, load_labels, model_card
        from ..tasks import TaskDecoder

        card = model_card(Path(args.model), nm, args.card)

        TaskDecoder(card, load_labels(Path(args.model), nm, card=card), outputs)  # what infer would refuse, refused here
        sources = card_sources(shape, nm.metadata(), card_file(Path(args.model), args.card))
        if args.json:
            print_json({"card": card.source, **card.model_dump(mode="json", exclude={"source"}), "sources": sources})
        else:
            print(f"# {card.source or 'no card file: the model metadata and defaults'}")
            print(_with_sources(card.to_toml(), sources), end="")
        return 0
    card, why = suggest_card(name, shape, outputs, nm.metadata(), softmax_outputs(nm.graph))
    model = Path(args.model)
    out = Path(args.out) if args.out else model.with_name("card.toml")
    if out.exists() and not args.force:
        raise K2EdgeError(f"{out} exists; pass --force to overwrite it, or --out FILE")
    if not out.resolve().parent.is_dir():
        raise K2EdgeError(f"--out {str(out)!r}: its directory does not exist")
    labels = model.with_name("labels.txt")
    names = _metadata_names(nm.metadata())
    note = ""
    if names and labels.is_file():
        note = f"; kept the existing {labels} (the model's metadata names {len(names)} classes)"
    elif names:
        try:
            labels.write_text("".join(f"{n}\n" for n in names))
        except OSError as exc:
            raise K2EdgeError(f"cannot write {labels} ({exc.strerror or exc})") from None
        note = f"; wrote {labels} ({len(names)} class name(s) from the model's metadata)"
    updates = {"source": None, "labels": os.path.relpath(labels.resolve(), out.resolve().parent) if labels.is_file() else None}
    text = HEADER.format(model=model.name, why=why) + card.model_copy(update=updates).to_toml()
    if not labels.is_file() and card.task != "tensor":
        text = text.replace("\n\n[input]", '\n# labels = "labels.txt"   # one label per line\n\n[input]', 1)
    try:
        out.write_text(text)
    except OSError as exc:
        raise K2EdgeError(f"cannot write {out} ({exc.strerror or exc})") from None
    print(f"wrote {out}: {why}{note}; check it with {_show_command(model, out, args.input_shape)}")
    return 0


def _show_command(model: Path, card: Path, input_shapes: list) -> str:
    """The ``card show`` command that shows ``card``: bare when it is the card found beside the model, else with
    ``--card`` (a ``<stem>.card.toml`` beside the model wins over a ``card.toml`` written there), and with the
    ``--input-shape`` values ``card init`` was given."""
    import shlex

    from ..config.card import find_card

    found = find_card(model)
    flag = "" if found is not None and found.resolve() == card.resolve() else f" --card {shlex.quote(str(card))}"
    shapes = "".join(f" --input-shape {shlex.quote(name + '=' + 'x'.join(map(str, dims)))}" for name, dims in input_shapes)
    return f"k2edge card show {shlex.quote(str(model))}{flag}{shapes}"
