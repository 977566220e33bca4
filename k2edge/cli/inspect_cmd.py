"""``k2edge inspect MODEL``: inputs, outputs, and every node with FLOPs and DLA support."""

from __future__ import annotations

COMMAND = "inspect"
HELP = "show a model's inputs, outputs and nodes with FLOPs and DLA support"
ORDER = 10

from .common import MAX_DIM, add_json, add_model, count, input_shapes_of, print_json, table


def register(p) -> None:
    add_model(p)
    p.add_argument("--batch-size", type=count(1, MAX_DIM), default=1, help="static batch for a dynamic batch dimension")
    add_json(p)


def _card(args, nm) -> dict:
    """The card in use (``--card`` or beside the model), else the one ``k2edge card init`` would suggest."""
    from pathlib import Path

    from ..config.card import find_card
    from ..tasks.suggest import softmax_outputs, suggest_card

    from ..config.card import card_sources, load_card

    g = nm.graph
    if len(g.inputs) != 1:
        return {"card": None, "suggested": None, "why": "several inputs: k2edge serves single-input models"}
    found = args.card or find_card(Path(args.model))
    shape = g.shape(g.inputs[0])
    if found:
        from ..config.resolve import model_card

        card = model_card(Path(args.model), nm, found)
        return {"card": str(found), "task": card.task, "suggested": None, "why": None,
                "sources": card_sources(shape, nm.metadata(), load_card(found))}
    card, why = suggest_card(g.inputs[0], shape, {o: g.shape(o) for o in g.outputs}, nm.metadata(), softmax_outputs(g))
    return {"card": None, "task": card.task, "suggested": card.model_dump(mode="json", exclude={"source"}), "why": why,
            "sources": card_sources(shape, nm.metadata())}


def _sources_line(sources: dict[str, str]) -> str:
    """``from Ultralytics metadata: task, input.size, ...; from card.toml: ...`` (defaults unnamed)."""
    by: dict[str, list[str]] = {}
    for key, source in sources.items():
        by.setdefault(source, []).append(key)
    return "; ".join(f"from {source}: {', '.join(keys)}" for source, keys in by.items() if source != "defaults")


def run(args) -> int:
    from ..dla.rules import support_table
    from ..model import model_costs, normalise

    nm = normalise(args.model, batch_size=args.batch_size, input_shapes=input_shapes_of(args, args.batch_size))
    g = nm.graph
    costs = model_costs(g)
    support = support_table(g)
    total = sum(c.flops for c in costs)
    card = _card(args, nm)
    precision = _int8_roles(nm, args, card)
    nodes = [
        {"index": n.index, "name": n.name, "op": n.op_type, "output_shape": list(g.shape(n.outputs[0])),
         "flops": c.flops, "param_bytes": c.param_bytes, "activation_bytes": c.activation_bytes,
         "dla": s.ok, "dla_reason": s.reason, "dla_source": s.source if not s.ok else None,
         "int8": precision.get(n.name)}
        for n, c, s in zip(g.nodes, costs, support)
    ]
    dla_flops = sum(c.flops for c, s in zip(costs, support) if s.ok)
    data = {
        "model": nm.source,
        "opset": nm.opset,
        "original_opset": nm.original_opset,
        "inputs": [{"name": i, "shape": list(g.shape(i)), "dtype": str(g.tensors[i].dtype)} for i in g.inputs],
        "outputs": [{"name": o, "shape": list(g.shape(o)), "dtype": str(g.tensors[o].dtype)} for o in g.outputs],
        "total_flops": total,
        "param_bytes": sum(t.nbytes for name, t in g.tensors.items() if name in g.initializers),
        "dla_capable_flop_share": dla_flops / total if total else 0.0,
        "dla_capable_nodes": sum(1 for s in support if s.ok),
        "card": card,
        "nodes": nodes,
    }
    from ..engine.quantize import learned_layers

    learned_names = set(learned_layers(g)) if precision else set()
    learned = {n["name"]: n["flops"] for n in nodes if n["name"] in learned_names}
    int8_flops = sum(f for name, f in learned.items() if precision[name] == "int8")
    data["int8_capable_learned_flop_share"] = int8_flops / sum(learned.values()) if learned else 0.0
    if args.json:
        print_json(data)
        return 0
    print(f"{nm.source}: opset {nm.original_opset}" + (f" (normalised to {nm.opset})" if nm.opset != nm.original_opset else ""))
    for kind in ("inputs", "outputs"):
        for t in data[kind]:
            print(f"  {kind[:-1]:6} {t['name']}  {t['dtype']} {tuple(t['shape'])}")
    print(f"  {len(nodes)} nodes, {total / 1e6:.2f} MFLOPs, {data['param_bytes'] / 1e6:.2f} MB of parameters, "
          f"{_share(dla_flops, total)} of FLOPs DLA-capable ({data['dla_capable_nodes']} of {len(nodes)} nodes"
          + (f"; {len(nodes) - data['dla_capable_nodes']} are not" if data['dla_capable_nodes'] < len(nodes) else "") + ")")
    card = data["card"]
    if card["card"]:
        print(f"  card   {card['card']} (task {card['task']})")
    elif card["suggested"]:
        print(f"  card   none; suggested: task {card['task']} ({card['why']}): k2edge card init {args.model}")
    else:
        print(f"  card   none ({card['why']})")
    if card.get("sources") and _sources_line(card["sources"]):
        print(f"  values {_sources_line(card['sources'])}")
    if learned:
        kept = sum(1 for v in precision.values() if v.startswith("float"))
        print(f"  int8   {len(learned)} learned layers; a profile that asks for INT8 runs "
              f"{_share(int8_flops, sum(learned.values()))} of their FLOPs in INT8 before its check "
              f"({kept} node(s) the card keeps in float: {'a detector head or keep_float' if kept else 'none'})")
    print()
    rows = [[n["index"], n["name"], n["op"], "x".join(map(str, n["output_shape"])), f"{n['flops'] / 1e6:.3f}",
             "yes" if n["dla"] else f"no: {n['dla_reason']}", n["int8"] or ""] for n in nodes]
    print(table(rows, ["#", "node", "op", "output", "MFLOPs", "DLA", "INT8"]))
    return 0


def _int8_roles(nm, args, card: dict) -> dict[str, str]:
    """Per node, its precision when a profile asks for INT8: ``int8`` (a learned layer), ``float (card)`` (what the
    card keeps out of INT8: a detector's head, ``keep_float``); nothing for other nodes (they follow their
    neighbours). The INT8 check may move more at build: ``k2edge build`` and ``plan`` then say so."""
    from pathlib import Path

    from ..config.card import ModelCard
    from ..engine.quantize import float_nodes, learned_layers

    if card.get("task") is None:
        return {}
    if card["card"]:
        from ..engine.engine import model_card

        the_card = model_card(Path(args.model), nm, Path(card["card"]))
    else:
        the_card = ModelCard.model_validate(card["suggested"])
    try:
        kept = float_nodes(nm.graph, the_card)
    except Exception:  # a keep_float naming an unknown node is reported by build and plan
        kept = set()
    roles = {n: "float (card)" for n in kept}
    roles.update({n: "int8" for n in learned_layers(nm.graph) if n not in kept})
    return roles


def _share(part: float, total: float) -> str:
    """A percentage that never rounds a missing part away: 99.99 % is "> 99.9 %", not "100.0 %"."""
    if not total:
        return "0.0 %"
    share = part / total
    if 0 < share < 0.001:
        return "< 0.1 %"
    if 0.999 < share < 1:
        return "> 99.9 %"
    return f"{share:.1%}"
