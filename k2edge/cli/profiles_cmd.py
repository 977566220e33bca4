"""``k2edge profiles list|show|validate``."""

from __future__ import annotations

COMMAND = "profiles"
HELP = "list, show or validate profiles"
ORDER = 80

import json
import sys

from ..errors import ProfileError
from .common import add_json, print_json, table


def register(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(p))
    ls = sub.add_parser("list", help="profiles on the search path")
    add_json(ls)
    show = sub.add_parser("show", help="one profile with every default spelled out")
    show.add_argument("profile", metavar="P")
    val = sub.add_parser("validate", help="check profile files; exit 1 if any is invalid")
    val.add_argument("files", nargs="+", metavar="FILE")


def run(args) -> int:
    from ..profile import load_profile, profile_search_path

    if args.action == "show":
        print(json.dumps(load_profile(args.profile).to_dict(), indent=2))
        return 0
    if args.action == "validate":
        bad = 0
        for f in args.files:
            try:
                load_profile(f)
                print(f"{f}: ok")
            except ProfileError as exc:
                print(f"{exc}", file=sys.stderr)
                bad += 1
        return 1 if bad else 0
    rows, found = [], []
    seen = set()
    for folder in profile_search_path():
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            if path.stem in seen:
                continue
            seen.add(path.stem)
            try:
                p = load_profile(path)
            except ProfileError as exc:
                rows.append([path.stem, "invalid", "", "", "", str(exc)])
                continue
            er = p.edge_runtime
            found.append({"name": p.name, "path": str(path), **p.to_dict()})
            rows.append([p.name, er.tensorrt_partition, f"{er.offload_ratio:.2f}", ",".join(er.precision_fallback),
                         "on" if er.dma_prefetch else "off", p.description or "(its file has none)"])
    if args.json:
        print_json(found)
    else:
        print(table(rows, ["name", "partition", "gpu share", "precision", "prefetch", "description"]))
    return 0
