"""What a person reads: the terminal table (rich), ``pareto.png`` (matplotlib), and writing every output.

The table and the plot are drawn from the same ``results.json`` document, so they show the same
points; the PNG also carries the plotted points (name, data values, pixel position) in its
``k2edge.points`` text chunk, which the tests compare with the document and the pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

from dataclasses import replace

from .frontier import pareto_front
from .results import (MEASURED, accuracy_metric, accuracy_of, int8_check_status, int8_flop_share, point_of,
                      recommended_profile, write_csv, write_json_atomic)

FRONT_COLOUR = "#1a9850"
OTHER_COLOUR = "#7f7f7f"
RECOMMENDED_COLOUR = "#d62728"


def write_outputs(doc: dict, out: Path, complete: bool = True) -> dict[str, Path]:
    """Write results.json, results.csv, pareto.png and (when complete and one was chosen) recommended.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"results": out / "results.json", "csv": out / "results.csv", "png": out / "pareto.png"}
    write_json_atomic(paths["results"], doc)
    write_csv(paths["csv"], doc)
    plot_pareto(doc, paths["png"])
    rec_path = out / "recommended.json"
    profile = recommended_profile(doc) if complete else None
    if profile is not None:
        write_json_atomic(rec_path, profile)
        paths["recommended"] = rec_path
    elif rec_path.exists():
        rec_path.unlink()  # a stale recommendation from an earlier sweep in this directory would mislead
    return paths


def _lanes_text(record: dict) -> str:
    """``gpu fp16, dla0+dla1 int8 (cpu lanes)``: devices grouped by precision, and what really ran them."""
    lanes = record.get("lanes") or []
    if not lanes:
        return ""
    groups: dict[str, list[str]] = {}
    for lane in lanes:
        groups.setdefault(lane["precision"], []).append(lane["device"])
    text = ", ".join(f"{'+'.join(devices)} {precision}" for precision, devices in groups.items())
    cpu = all(lane["label"].endswith("(cpu lane)") for lane in lanes)
    return text + (f" ({'cpu lanes' if len(lanes) > 1 else 'cpu lane'})" if cpu else "")


def _check_text(record: dict) -> str:
    """``failed (int8 72 %)``: the INT8 check's status and the INT8 share of the learned-layer FLOPs; ``-`` without INT8."""
    status = int8_check_status(record)
    if status is None:
        return "-"
    share = int8_flop_share(record)
    return status if share is None else f"{status} (int8 {100 * share:.0f} %)"


def _num(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _range_text(value: float, sp: dict, fmt: str, compact: bool) -> str:
    if not sp:
        return format(value, fmt)
    if compact:
        return f"{format(value, fmt)} ±{format((sp['max'] - sp['min']) / 2, fmt)}"
    return f"{format(value, fmt)} ({format(sp['min'], fmt)}–{format(sp['max'], fmt)})"


def render_table(doc: dict, compact: bool = False):
    """A rich Table of every configuration, front rows highlighted, the recommendation marked.

    ``compact`` (narrow terminals) keeps p50, p99, throughput, top-1 and energy, with the spread as
    ± half the runs' range, and lets the lanes column wrap.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    machine = doc.get("machine", {})
    backend = doc.get("backend", {})
    title = (f"pareto-sweep of {Path(doc['model']['path']).name} on {doc['dataset']['samples']} samples: "
             f"{backend.get('name')} {backend.get('version') or ''}".rstrip())
    settings = doc.get("settings", {})
    table = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left", caption_justify="left",
                  padding=(0, 1 if not compact else 0), collapse_padding=compact)
    runs = "±" if compact else "(runs)"
    metric = accuracy_metric(doc["configs"])
    columns = [("", True), ("config", True), ("lanes", True), (f"p50 ms {runs}", True), ("p90 ms", False),
               ("p99 ms", True), ("mean ms", False), (f"inf/s {runs}", True), (metric, True), ("J/inf", True),
               ("peak °C", False)]
    if any(int8_check_status(r) for r in doc["configs"]):
        columns.append(("INT8 check", True))
    columns = [name for name, keep in columns if keep or not compact]
    for name in columns:
        table.add_column(name, justify="left" if name in ("", "config", "lanes") else "right",
                         no_wrap=not (compact and name == "lanes"), min_width=12 if compact and name == "lanes" else None)
    rec = (doc.get("recommendation") or {}).get("name")
    for r in doc["configs"]:
        mark = ("★" if r.get("on_front") else " ") + ("▶" if r["name"] == rec else " ")
        if r["status"] not in MEASURED:
            table.add_row(mark, r["name"], Text("failed (below)" if compact else "failed (reason below)", style="red"),
                          *[""] * (len(columns) - 3))
            continue
        lat = r["latency_ms"]
        sp = r.get("spread") or {}
        cells = {
            "": mark, "config": r["name"] + ("" if r["status"] == "ok" else f" ({len(r['runs'])} run(s))"),
            "lanes": _lanes_text(r),
            f"p50 ms {runs}": _range_text(lat["p50"], sp.get("latency_p50_ms") or {}, ".3f", compact),
            "p90 ms": f"{lat['p90']:.3f}", "p99 ms": f"{lat['p99']:.3f}", "mean ms": f"{lat['mean']:.3f}",
            f"inf/s {runs}": _range_text(r["throughput_per_s"], sp.get("throughput_per_s") or {}, ",.0f", compact),
            metric: f"{100 * accuracy_of(r):.2f} %", "J/inf": _num(r.get("energy_j_per_inference"), "#.3g", "n/a"),
            "peak °C": _num(r.get("peak_temperature_c"), ".1f", "n/a"),
            "INT8 check": Text(_check_text(r), style="red") if int8_check_status(r) == "failed" else _check_text(r),
        }
        style = "bold green" if r.get("on_front") else None
        if r["name"] == rec:
            style = "bold green reverse" if r.get("on_front") else "bold reverse"
        table.add_row(*(cells[c] for c in columns), style=style)
    ok = [r for r in doc["configs"] if r["status"] in MEASURED]
    spread_text = "± = half the range" if compact else "(runs) = min–max"
    partial = any(r["status"] == "partial" for r in ok)
    lines = [f"★ Pareto front (p50 latency ↓, {metric} ↑, energy ↓ where known); {spread_text} over "
             f"{'up to ' if partial else ''}{settings.get('runs')} runs of {settings.get('requests')} requests each"
             f"{' (fewer where a row says how many)' if partial else ''}, warm-up excluded."]
    recd = doc.get("recommendation") or {}
    if recd.get("name") and doc.get("status") == "interrupted":
        lines.append(f"▷ provisional, from an incomplete sweep (no recommended.json is written until it completes), for goal "
                     f"{recd['goal']}: {recd['name']}: {recd['reason']}.")
    elif recd.get("name"):
        lines.append(f"▶ recommended for goal {recd['goal']}: {recd['name']}: {recd['reason']}.")
    elif recd:
        lines.append(f"no recommendation for goal {recd.get('goal')}: {recd.get('reason')}.")
    energy_reason = next((r.get("energy_reason") for r in ok if r.get("energy_reason")), None)
    if ok and all(r.get("energy_j_per_inference") is None for r in ok):
        lines.append(f"energy n/a: {energy_reason or 'unknown'}.")
    if ok and all(r.get("peak_temperature_c") is None for r in ok):
        lines.append(f"temperature n/a: {next((r.get('temperature_reason') for r in ok if r.get('temperature_reason')), 'unknown')}.")
    if machine.get("accelerators"):
        lines.append(f"{machine['accelerators']} ({machine.get('cpu') or machine.get('arch')}, {machine.get('cores')} cores).")
    for r in doc["configs"]:
        if r["status"] not in MEASURED:
            lines.append(f"{r['name']} failed: {r.get('error')}")
    if doc.get("status") == "interrupted":
        lines.append("interrupted: the sweep is incomplete (continue with --resume).")
    table.caption = "\n".join(lines)
    return table


def print_table(doc: dict, file=None) -> str:
    """Print the table (to stdout by default; colour, and compact when narrow, on a terminal); return it as text."""
    import io
    import sys

    from rich.console import Console

    file = file or sys.stdout
    console = Console(file=file, highlight=False)
    width = console.width if console.is_terminal else 230
    compact = width < 150
    if console.is_terminal:
        console.print(render_table(doc, compact))
    plain = Console(file=io.StringIO(), width=width, record=True, highlight=False, color_system=None)
    plain.print(render_table(doc, compact))
    text = "\n".join(line.rstrip() for line in plain.export_text().splitlines()) + "\n"
    if not console.is_terminal:
        file.write(text)
    return text


def _label_offsets():
    """Candidate label offsets (points): close around the marker first, then further out."""
    for radius in (8, 20, 34, 50, 70, 95):
        for dx, dy in ((1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1.4), (0, -1.4), (1.4, 0), (-1.4, 0)):
            yield round(dx * radius), round(dy * radius)


def plot_pareto(doc: dict, path: Path) -> list[dict]:
    """Draw latency (p50, runs' min–max as error bars) against top-1, label every point, draw the front.

    Returns:
        The plotted points (also stored in the PNG's ``k2edge.points`` text chunk): name, latency_ms,
        top1_pct, on_front, recommended and the marker's pixel position (x, y from the top left).
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    ok = [r for r in doc["configs"] if r["status"] in MEASURED]
    metric = accuracy_metric(ok)
    failed = [r for r in doc["configs"] if r["status"] not in MEASURED]
    rec = (doc.get("recommendation") or {}).get("name")
    settings = doc.get("settings", {})
    backend = doc.get("backend", {})
    machine = doc.get("machine", {})
    notes = []
    if ok and all(r.get("energy_j_per_inference") is None for r in ok):
        notes.append(f"energy unknown: {next((r.get('energy_reason') for r in ok if r.get('energy_reason')), 'no reading')}")
    if failed:
        notes.append("failed: " + "; ".join(f"{r['name']} ({_short(r.get('error'))})" for r in failed))
    if doc.get("status") == "interrupted":
        notes.append("interrupted: incomplete sweep")
    lines = [line for note in notes for line in textwrap.wrap(note, 170)][:8]

    fig, ax = plt.subplots(figsize=(10, 6.5), dpi=110)
    try:
        fig.subplots_adjust(left=0.1, right=0.97, bottom=0.1 + 0.022 * len(lines), top=0.88)
        if lines:
            fig.text(0.01, 0.01, "\n".join(lines), fontsize=7.5, color="#444444", va="bottom")
        xs = [r["latency_ms"]["p50"] for r in ok]
        ys = [100 * accuracy_of(r) for r in ok]
        for r, x, y in zip(ok, xs, ys):
            sp = (r.get("spread") or {}).get("latency_p50_ms") or {}
            colour = FRONT_COLOUR if r.get("on_front") else OTHER_COLOUR
            if sp:
                ax.errorbar([x], [y], xerr=[[max(0.0, x - sp["min"])], [max(0.0, sp["max"] - x)]], fmt="none",
                            ecolor=colour, alpha=0.6, capsize=3, lw=1.2, zorder=2)
            # Front markers above dominated ones, the recommendation's ring below both, so a close
            # neighbour stays visible.
            ax.scatter([x], [y], s=110 if r.get("on_front") else 60, color=colour, edgecolors="black",
                       linewidths=0.6, zorder=3.5 if r.get("on_front") else 3)
            if r["name"] == rec:
                ax.scatter([x], [y], s=420, facecolors="none", edgecolors=RECOMMENDED_COLOUR, linewidths=2, zorder=2.5)
        # The line is the front of what the plot shows (latency, top-1); with energy known, a point can be
        # on the full front (green) through its energy alone, off this line.
        flat = {p.name for p in pareto_front([replace(point_of(r), energy_j=None) for r in ok])}
        front = sorted((p for p in zip(ok, xs, ys) if p[0]["name"] in flat), key=lambda p: (p[1], -p[2]))
        if len(front) > 1:
            ax.plot([p[1] for p in front], [p[2] for p in front], drawstyle="steps-post", color=FRONT_COLOUR, lw=1.5,
                    alpha=0.8, zorder=1)
        with_energy = any(r.get("energy_j_per_inference") is not None for r in ok)
        spans = [((r.get("spread") or {}).get("latency_p50_ms") or {}) for r in ok]
        _axes_limits(ax, xs + [sp["min"] for sp in spans if sp] + [sp["max"] for sp in spans if sp], ys)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2f} %"))
        ax.ticklabel_format(axis="x", useOffset=False, style="plain")
        ax.set_xlabel("latency p50 (ms per request through Engine.infer); bars: min–max of the per-run p50")
        ax.set_ylabel("top-1 accuracy on the evaluation set" if metric == "top-1" else
                      "COCO mAP@0.5 on the evaluation set (pycocotools): the accuracy axis of a detector")
        ax.grid(True, alpha=0.3)
        where = ("every device a CPU lane: not GPU/DLA numbers" if backend.get("name") == "onnxruntime"
                 else "GPU + DLA engines")
        ax.set_title(f"{Path(doc['model']['path']).name}: latency vs {metric}, {len(ok)} configuration(s)\n"
                     f"{backend.get('name')} {backend.get('version') or ''} on {machine.get('cpu') or machine.get('arch')} "
                     f"({machine.get('cores')} cores), {where}; {settings.get('runs')} runs x {settings.get('requests')} requests",
                     fontsize=10)
        front_label = f"on the Pareto front (latency, {metric}, energy)" if with_energy else "on the Pareto front"
        handles = [Line2D([], [], marker="o", ls="none", color=FRONT_COLOUR, mec="black", ms=9, label=front_label),
                   Line2D([], [], marker="o", ls="none", color=OTHER_COLOUR, mec="black", ms=7, label="dominated"),
                   Line2D([], [], marker="o", ls="none", mfc="none", mec=RECOMMENDED_COLOUR, mew=2, ms=16,
                          label=f"recommended ({(doc.get('recommendation') or {}).get('goal')})")]
        if len(front) > 1:
            handles.append(Line2D([], [], color=FRONT_COLOUR, lw=1.5, label=f"front of latency and {metric}"))
        legend = ax.legend(handles=handles, loc="best", fontsize=8, framealpha=0.9)
        fig.canvas.draw()
        points = _place_labels(fig, ax, ok, xs, ys, rec, legend)
        points = _pixel_points(fig, ax, points)
        fig.savefig(path, dpi=fig.dpi, metadata={"k2edge.points": json.dumps(points)})
    finally:
        plt.close(fig)
    return points


def _short(text: str | None, n: int = 70) -> str:
    text = text or "unknown"
    return text if len(text) <= n else text[: n - 1] + "…"


def _axes_limits(ax, xs: list[float], ys: list[float]) -> None:
    """Limits that hold every point and spread bar (``xs`` includes the bars' ends)."""
    if not xs:
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 100)
        ax.text(0.5, 0.5, "no configuration was measured", ha="center", va="center", transform=ax.transAxes)
        return
    lo, hi = min(xs), max(xs)
    pad = max((hi - lo) * 0.15, hi * 0.05, 1e-3)
    ax.set_xlim(max(0.0, lo - pad), hi + pad * 2.5)
    ylo, yhi = min(ys), max(ys)
    ypad = max((yhi - ylo) * 0.2, 0.5)
    ax.set_ylim(max(0.0, ylo - ypad), min(100.0 + ypad / 4, yhi + ypad))
    ax.set_yticks([t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= 100.0 + 1e-9])  # no accuracy above 100 %


def _place_labels(fig, ax, ok: list[dict], xs: list[float], ys: list[float], rec: str | None, legend=None) -> list[dict]:
    """Label every point where the label overlaps no marker and no earlier label (pixel boxes)."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    marker_px = 9 * fig.dpi / 72
    blocked = []
    for r, x, y in zip(ok, xs, ys):
        px, py = ax.transData.transform((x, y))
        half = marker_px * (1.5 if r["name"] == rec else 1.0)  # the recommendation's ring is wider
        blocked.append(Bbox.from_extents(px - half, py - half, px + half, py + half))
    if legend is not None:
        blocked.append(legend.get_window_extent(renderer))
    axes_box = ax.get_window_extent(renderer)
    points = []
    order = sorted(range(len(ok)), key=lambda i: (not ok[i].get("on_front"), xs[i], -ys[i]))
    for i in order:
        r = ok[i]
        text = r["name"]
        if r.get("energy_j_per_inference") is not None:
            text += f"\n{r['energy_j_per_inference']:#.3g} J"
        choice = fallback = None
        for dx, dy in _label_offsets():
            box = _text_box(ax, renderer, text, xs[i], ys[i], dx, dy).padded(3)
            if not (box.x0 >= axes_box.x0 and box.x1 <= axes_box.x1 and box.y0 >= axes_box.y0 and box.y1 <= axes_box.y1):
                continue
            fallback = fallback or (dx, dy)
            if not any(box.overlaps(b) for b in blocked):
                choice = (dx, dy)
                break
        dx, dy = choice or fallback or (8, 8)
        ann = ax.annotate(text, (xs[i], ys[i]), xytext=(dx, dy), textcoords="offset points", fontsize=8.5,
                          ha="left" if dx >= 0 else "right", va="bottom" if dy >= 0 else "top",
                          fontweight="bold" if r.get("on_front") else "normal",
                          color=FRONT_COLOUR if r.get("on_front") else "#333333", zorder=5,
                          arrowprops={"arrowstyle": "-", "color": "#aaaaaa", "lw": 0.6, "shrinkA": 0, "shrinkB": 5}
                          if abs(dx) + abs(dy) > 20 else None)
        ann.update_positions(renderer)
        blocked.append(Text.get_window_extent(ann, renderer))  # the text only, not its leader line
        points.append({"name": r["name"], "latency_ms": xs[i], "top1_pct": ys[i], "on_front": bool(r.get("on_front")),
                       "recommended": r["name"] == rec})
    return points


def _text_box(ax, renderer, text: str, x: float, y: float, dx: float, dy: float):
    """Pixel box of a label at offset (dx, dy) points from (x, y), measured without drawing it."""
    probe = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=8.5, fontweight="bold",
                        ha="left" if dx >= 0 else "right", va="bottom" if dy >= 0 else "top")
    try:
        from matplotlib.text import Text

        probe.update_positions(renderer)
        return Text.get_window_extent(probe, renderer)
    finally:
        probe.remove()


def _pixel_points(fig, ax, points: list[dict]) -> list[dict]:
    height = fig.bbox.height
    for p in points:
        px, py = ax.transData.transform((p["latency_ms"], p["top1_pct"]))
        p["pixel"] = [round(float(px), 1), round(float(height - py), 1)]
    return points
