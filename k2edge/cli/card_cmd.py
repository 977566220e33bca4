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


def run(args) -> int:
    from ..tasks.suggest import suggest_card

    nm, name, shape, outputs = _model(args)
    if args.card_command == "show":
        from ..engine.engine import model_card

        card = model_card(Path(args.model), nm, args.card)
        if args.json:
            print_json({"card": card.source, **card.model_dump(mode="json", exclude={"source"})})
        else:
            print(f"# {card.source or 'no card file: the model metadata and defaults'}")
            print(card.to_toml(), end="")
        return 0
    card, why = suggest_card(name, shape, outputs, nm.metadata())
    model = Path(args.model)
    out = Path(args.out) if args.out else model.with_name("card.toml")
    if out.exists() and not args.force:
        raise K2EdgeError(f"{out} exists; pass --force to overwrite it, or --out FILE")
    if not out.resolve().parent.is_dir():
        raise K2EdgeError(f"--out {str(out)!r}: its directory does not exist")
    labels = model.with_name("labels.txt")
    updates = {"source": None, "labels": os.path.relpath(labels.resolve(), out.resolve().parent) if labels.is_file() else None}
    text = HEADER.format(model=model.name, why=why) + card.model_copy(update=updates).to_toml()
    if not labels.is_file() and card.task != "tensor":
        text = text.replace("\n\n[input]", '\n# labels = "labels.txt"   # one label per line\n\n[input]', 1)
    try:
        out.write_text(text)
    except OSError as exc:
        raise K2EdgeError(f"cannot write {out} ({exc.strerror or exc})") from None
    print(f"wrote {out}: {why}; edit it, then run k2edge card show {args.model}")
    return 0
