"""The sweep's record: ``results.json`` (rewritten atomically after every configuration),
``results.csv`` and ``recommended.json``.

``results.json`` keys:

* ``schema``, ``k2edge_version``, ``status`` (``running``, ``interrupted``, ``complete``),
  ``started``, ``updated`` (UTC, ISO 8601);
* ``model`` (path, sha256 of the file), ``dataset`` (path, samples, fingerprint), ``calibration``,
  ``inputs`` (``card``, ``calib``, ``check``: path and sha256 of what was given or found, each null when
  there is none; ``--resume`` refuses a change),
  ``board`` (planned for), ``backend`` (requested, name, version), ``machine`` (host, OS, CPU,
  cores, detected Jetson board, L4T, CUDA devices, and ``accelerators``: what really ran),
  ``telemetry`` (state, message), ``settings`` (runs, warmup, requests, limit, goal, constraints);
* ``objectives`` and ``agreement``: how the front and the spread are defined;
* ``configs``: one record per configuration (see :func:`config_record`), ``pareto_front`` (names),
  ``recommendation`` (name or null, goal, reason, candidates, costs: the balanced goal's cost of each front point).
"""

from __future__ import annotations

import csv
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from .._json import json_default
from ..durable import replace_file
from .errors import SweepError
from .frontier import Point, Recommendation, pareto_front

SCHEMA = "k2edge.pareto-sweep/2"  # 2: recommendation.costs (balanced's cost in accuracy points) replaced scores
RESUMABLE = (SCHEMA, "k2edge.pareto-sweep/1")  # what --resume continues: the records are the same
MEASURED = ("ok", "partial")  # partial: interrupted before all its runs; its numbers come from fewer runs

OBJECTIVES_DOC = {
    "latency": "latency_ms.p50, lower is better",
    "accuracy": "top1 on the evaluation set (classifiers) or map50, COCO mAP@0.5 (detectors: accuracy_metric "
                "'mAP@0.5'), higher is better",
    "energy": "energy_j_per_inference at full load, lower is better; null where no power rail exists",
    "dominance": "a dominates b when it is at least as good on every objective known for both and strictly "
                 "better on one; a missing energy value leaves energy out of that comparison; equal points are "
                 "both on the front",
    "max_latency_ms": "constrains latency_ms.p99",
    "headline": "latency_ms.{mean,p50,p90,p99}, throughput_per_s and energy_j_per_inference are medians over the "
                "runs of each run's value; latency_ms.min/max are over every request",
}
AGREEMENT_DOC = ("each run builds and activates the engine afresh, and runs are interleaved round by round across "
                 "the configurations, so each configuration's runs span the whole sweep; spread gives min, max, "
                 "range and stdev of the per-run values; two sweeps of a configuration agree when their headline "
                 "values differ by no more than the larger of their two ranges")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def machine_info(backend: str) -> dict:
    """What this machine is and what really ran the lanes (``accelerators``)."""
    from ..dla.boards import detect_board
    from ..engine.probe import cuda_devices, l4t_release

    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    board = detect_board()
    accel = ("every device (gpu, dla0, dla1) ran as a CPU lane: ONNX Runtime on the CPU; these are not GPU or DLA numbers"
             if backend == "onnxruntime" else f"{backend} engines on the GPU and DLA cores")
    return {"hostname": platform.node(), "os": platform.platform(), "arch": platform.machine(), "cpu": cpu,
            "cores": os.cpu_count(), "python": platform.python_version(),
            "jetson_board": board.key if board else None, "l4t": l4t_release(), "cuda_devices": cuda_devices(),
            "accelerators": accel}


def point_of(record: dict) -> Point:
    """The frontier's view of a successful record."""
    lat = record.get("latency_ms") or {}
    return Point(record["name"], lat.get("p50"), accuracy_of(record), record.get("energy_j_per_inference"), lat.get("p99"))


def accuracy_of(record: dict) -> float | None:
    """The accuracy axis of a record: top-1 for a classifier, COCO mAP@0.5 (``map50``) for a detector."""
    return record.get("map50") if str(record.get("accuracy_metric", "")).endswith("mAP@0.5") else record.get("top1")


def accuracy_metric(records) -> str:
    """``top-1``, or ``mAP@0.5`` when the sweep measured a detector."""
    return next((r["accuracy_metric"] for r in records if r.get("accuracy_metric")), "top-1")


def mark_front(doc: dict) -> list[str]:
    """Set ``on_front`` on every record and ``pareto_front`` on the document; returns the front's names."""
    ok = [r for r in doc["configs"] if r.get("status") in MEASURED]
    front = {p.name for p in pareto_front([point_of(r) for r in ok])}
    for r in doc["configs"]:
        r["on_front"] = r["name"] in front
    doc["pareto_front"] = [r["name"] for r in doc["configs"] if r["on_front"]]
    return doc["pareto_front"]


def set_recommendation(doc: dict, rec: Recommendation) -> None:
    doc["recommendation"] = rec.to_dict()
    for r in doc["configs"]:
        r["recommended"] = r["name"] == rec.name


def write_json_atomic(path: Path, data: dict) -> None:
    """Replace ``path`` with JSON, whole or not at all (:func:`k2edge.durable.replace_file`)."""
    with replace_file(path, text=True) as f:
        json.dump(data, f, indent=2, default=json_default)
        f.write("\n")


def load_previous(path: Path) -> dict | None:
    """A stored results.json, or None when there is none.

    Raises:
        SweepError: it exists but is unreadable or not a pareto-sweep record.
    """
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        raise SweepError(f"--resume: cannot read {path} ({exc}); remove it or choose another --out") from None
    if not isinstance(doc, dict) or doc.get("schema") not in RESUMABLE:
        raise SweepError(f"--resume: {path} is not a k2edge pareto-sweep result ({SCHEMA})")
    damaged = _damage(doc)
    if damaged:
        raise SweepError(f"--resume: {path} is damaged ({damaged}); remove it or choose another --out")
    return doc


def _damage(doc: dict) -> str | None:
    """What in a stored result a resume cannot use (None: nothing)."""
    for key in ("model", "dataset", "settings"):
        if not isinstance(doc.get(key, {}), dict):
            return f"{key!r} is not an object"
    configs = doc.get("configs", [])
    if not isinstance(configs, list):
        return "'configs' is not a list"
    for i, r in enumerate(configs):
        if not isinstance(r, dict) or not isinstance(r.get("key"), str) or not isinstance(r.get("name"), str):
            return f"configs[{i}] has no 'key' and 'name'"
        if r.get("status") in MEASURED and (missing := _missing_figures(r)):
            return f"configs[{i}] ({r['name']}) is {r['status']} but has no {missing}"
    return None


def _missing_figures(r: dict) -> str | None:
    """The first figure a measured record lacks that the resume, the table or the plot reads (None: none)."""
    if not isinstance(r.get("runs"), list) or not all(isinstance(run, dict) for run in r["runs"]):
        return "'runs' list"
    lat = r.get("latency_ms")
    if not isinstance(lat, dict):
        return "'latency_ms'"
    for k in ("mean", "p50", "p90", "p99"):
        if not isinstance(lat.get(k), (int, float)):
            return f"'latency_ms.{k}'"
    if not isinstance(r.get("throughput_per_s"), (int, float)):
        return "'throughput_per_s'"
    if not isinstance(accuracy_of(r), (int, float)):
        return "accuracy ('top1' or 'map50')"
    return None


def check_resumable(previous: dict, current: dict, path: Path) -> None:
    """Fail clearly when the stored sweep measured another model, dataset or settings.

    Raises:
        SweepError: naming what differs.
    """
    pm, cm = previous.get("model", {}), current["model"]
    if pm.get("sha256") != cm["sha256"]:
        raise SweepError(f"--resume: {path} is a sweep of another model ({pm.get('path')}, sha256 {str(pm.get('sha256'))[:12]}), "
                         f"not {cm['path']} (sha256 {cm['sha256'][:12]}); choose another --out or drop --resume")
    pd, cd = previous.get("dataset", {}), current["dataset"]
    if pd.get("fingerprint") != cd["fingerprint"]:
        raise SweepError(f"--resume: {path} was measured on another evaluation set ({pd.get('path')}, {pd.get('samples')} samples); "
                         "use the same --dataset and --limit, or another --out")
    diffs = []
    for key in ("runs", "warmup", "requests"):
        if previous.get("settings", {}).get(key) != current["settings"][key]:
            diffs.append(f"--{key} {previous.get('settings', {}).get(key)} (now {current['settings'][key]})")
    for key in ("board",):
        if previous.get(key) != current[key]:
            diffs.append(f"--{key} {previous.get(key)} (now {current[key]})")
    if previous.get("backend", {}).get("name") != current["backend"]["name"]:
        diffs.append(f"backend {previous.get('backend', {}).get('name')} (now {current['backend']['name']})")
    before = previous.get("inputs") or {}  # a result written before inputs were recorded cannot be compared
    for key, now_input in (current.get("inputs") or {}).items():
        if key in before and _sha(before[key]) != _sha(now_input):
            diffs.append(f"--{key} {_input_text(before[key])} (now {_input_text(now_input)})")
    if diffs:
        raise SweepError(f"--resume: {path} was measured with {', '.join(diffs)}; rerun with the same settings or another --out")


def _sha(entry) -> str | None:
    return entry.get("sha256") if isinstance(entry, dict) else None


def _input_text(entry) -> str:
    if not isinstance(entry, dict) or not entry.get("path"):
        return "none"
    return f"{entry['path']} (sha256 {str(entry.get('sha256'))[:12]})"


def int8_check_status(r: dict) -> str | None:
    """The INT8 accuracy check's status (``passed``, ``fallback``, ``inconclusive``, ``failed``); None: no INT8."""
    check = r.get("int8_check")
    return check.get("status") if isinstance(check, dict) else None


def int8_flop_share(r: dict) -> float | None:
    """The share of the learned-layer FLOPs that run in INT8 (``k2edge build``'s figure); None when unknown."""
    shares = (r.get("plan") or {}).get("precision_flops") or {}
    return shares.get("int8") if isinstance(shares, dict) else None


CSV_FIELDS = (
    "name", "key", "status", "error", "runs", "on_front", "recommended", "lanes", "partition", "offload_ratio", "gpu_flop_share",
    "prefetch", "precision_chain", "batch_size", "int8_check", "int8_flop_share", "latency_mean_ms", "latency_p50_ms", "latency_p90_ms", "latency_p99_ms",
    "latency_p50_min_ms", "latency_p50_max_ms", "throughput_per_s", "throughput_min_per_s", "throughput_max_per_s",
    "top1", "correct", "samples", "map50", "map", "energy_j_per_inference", "energy_reason", "peak_temperature_c", "build_seconds",
)


def csv_row(r: dict) -> dict:
    er = r.get("profile", {}).get("edge_runtime", {})
    lat = r.get("latency_ms") or {}
    sp = r.get("spread") or {}
    p50s = sp.get("latency_p50_ms") or {}
    thr = sp.get("throughput_per_s") or {}
    return {
        "name": r["name"], "key": r["key"], "status": r["status"], "error": r.get("error") or "",
        "runs": len(r.get("runs") or []),
        "on_front": r.get("on_front", False), "recommended": r.get("recommended", False),
        "lanes": "; ".join(f"{lane['label']} [{lane['precision']}]" for lane in r.get("lanes", [])),
        "partition": er.get("tensorrt_partition"), "offload_ratio": er.get("offload_ratio"),
        "gpu_flop_share": (r.get("plan") or {}).get("gpu_flop_share"), "prefetch": er.get("dma_prefetch"),
        "precision_chain": "+".join(er.get("precision_fallback", [])), "batch_size": er.get("batch_size"),
        "int8_check": int8_check_status(r), "int8_flop_share": int8_flop_share(r),
        "latency_mean_ms": lat.get("mean"), "latency_p50_ms": lat.get("p50"), "latency_p90_ms": lat.get("p90"),
        "latency_p99_ms": lat.get("p99"), "latency_p50_min_ms": p50s.get("min"), "latency_p50_max_ms": p50s.get("max"),
        "throughput_per_s": r.get("throughput_per_s"), "throughput_min_per_s": thr.get("min"),
        "throughput_max_per_s": thr.get("max"), "top1": r.get("top1"), "correct": r.get("correct"),
        "map50": r.get("map50"), "map": r.get("map"),
        "samples": r.get("samples"), "energy_j_per_inference": r.get("energy_j_per_inference"),
        "energy_reason": r.get("energy_reason") or "", "peak_temperature_c": r.get("peak_temperature_c"),
        "build_seconds": (r.get("build") or {}).get("seconds"),
    }


def write_csv(path: Path, doc: dict) -> None:
    with replace_file(path, text=True) as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in doc["configs"]:
            w.writerow({k: ("" if v is None else v) for k, v in csv_row(r).items()})


def recommended_profile(doc: dict) -> dict | None:
    """The recommended configuration as a profile document ``load_profile`` accepts, or None."""
    rec = doc.get("recommendation") or {}
    record = next((r for r in doc["configs"] if r["name"] == rec.get("name")), None)
    if record is None:
        return None
    profile = json.loads(json.dumps(record["profile"]))
    origin = f" Based on {record['source']}" + (f": {profile['description']}" if profile.get("description") else ".")
    profile["description"] = (
        f"Recommended by k2edge pareto-sweep (goal {rec['goal']}) for {Path(doc['model']['path']).name}: {rec['reason']}. "
        f"Measured with the {doc['backend']['name']} backend on {doc['machine']['cpu'] or doc['machine']['arch']}"
        f"{' (CPU lanes, not GPU/DLA)' if doc['backend']['name'] == 'onnxruntime' else ''}.{origin}"
    )
    return profile
