"""Run a sweep: build every configuration through the engine cache, measure it, keep the record.

The sweep goes round by round: round ``r`` gives every configuration its ``r``-th run (see
:mod:`k2edge.sweep.measure` for why). ``results.json`` is rewritten (atomically) after every run,
so Ctrl-C keeps every finished run and ``resume=True`` adds only what is missing. A configuration
that cannot be built or run is recorded as failed with its reason and the sweep goes on.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..durable import make_dir
from ..errors import K2EdgeError, first_line
from ..config.resolve import find_calibration
from ..readfile import file_sha256
from .configs import SweepConfig
from .frontier import recommend
from .measure import MeasureSettings, measure_run, summarise
from .progress import SweepProgress
from .results import (MEASURED, SCHEMA, AGREEMENT_DOC, OBJECTIVES_DOC, accuracy_metric, accuracy_of, check_resumable,
                      int8_check_status, load_previous, machine_info, mark_front, now, point_of, set_recommendation,
                      write_json_atomic)
from .errors import SweepError
from .sampler import TelemetrySampler

log = logging.getLogger(__name__)

RESULTS = "results.json"


@dataclass
class SweepSpec:
    """What to sweep and how.

    Attributes:
        model: the ONNX model file.
        dataset: the labelled evaluation set (ImageFolder directory or ``.npz``).
        out: output directory (results.json, results.csv, pareto.png, recommended.json).
        calib: calibration set for INT8 (default: ``calib/`` beside the model).
        board: board to plan for (``orin-agx`` ...).
        backend: ``auto``, ``onnxruntime`` or ``tensorrt``.
        cache_dir: engine cache directory.
        input_shapes: static shapes for dynamic inputs.
        settings: runs, warm-up, requests, evaluation limit.
        goal / max_latency_ms / min_accuracy: what the recommendation optimises and requires.
        card: the model card (default: the one beside the model); a detector's accuracy axis is
            COCO mAP@0.5 on a COCO annotation file.
    """

    model: Path
    dataset: Path
    out: Path
    calib: str | None = None
    check: str | None = None  # the INT8 check's set (default: every fifth calibration sample)
    board: str | None = None
    backend: str = "auto"
    cache_dir: str | None = None
    input_shapes: dict | None = None
    settings: MeasureSettings = field(default_factory=MeasureSettings)
    card: str | None = None
    goal: str = "balanced"
    max_latency_ms: float | None = None
    min_accuracy: float | None = None


@dataclass
class SweepOutcome:
    """The document as written, and how the sweep ended."""

    doc: dict
    interrupted: bool
    reused: list[str]
    measured: list[str]


def _open_eval(spec: SweepSpec):
    """The evaluation set for the model's task: COCO annotations for a detector (the card says), else labelled."""
    from ..engine.cache import EngineCache
    from ..config.resolve import load_labels, model_card
    from ..engine.engine import load_model
    from ..model.datasets import check_fits, open_coco, open_labelled

    loaded = load_model(spec.model, EngineCache(spec.cache_dir), 1, spec.input_shapes, spec.card)
    card = model_card(loaded.path, loaded.normalised, loaded.card)
    labels = load_labels(loaded.path, loaded.normalised, None, card)
    if card.task in ("detection", "segmentation", "pose"):
        return open_coco(spec.dataset, labels, spec.settings.limit)
    dataset = open_labelled(spec.dataset, labels, spec.settings.limit)
    check_fits(dataset, loaded.normalised.graph.shape(loaded.normalised.graph.inputs[0])[1:], "evaluation set")
    if spec.min_accuracy is not None and spec.min_accuracy >= 1:
        # The rule below asks for 1 / (1 - minimum) samples: no finite set tells a bound of 100 %.
        raise SweepError(f"--min-accuracy 100 % cannot be told on any number of samples: a single miss in N moves top-1 by "
                         f"100/N points, so no evaluation set resolves it (here {len(dataset)} sample(s)); give a minimum "
                         "below 100 % (99.9 % needs at least 1000 samples)")
    need = math.ceil(1 / (1 - spec.min_accuracy) - 1e-9) if spec.min_accuracy is not None else 0
    if len(dataset) < need:
        raise SweepError(f"--min-accuracy {100 * spec.min_accuracy:.2f} % cannot be told on {len(dataset)} sample(s), where "
                         f"a single miss moves top-1 by {100 / len(dataset):.2g} points: not enough data; give at least "
                         f"{need} samples{' (a larger --limit)' if spec.settings.limit == len(dataset) else ''}")
    return dataset


def _check_paths(spec: SweepSpec) -> None:
    """A mistyped --calib or --check is told before anything is built (else every INT8 configuration fails)."""
    from ..model.datasets import existing

    for flag, path in (("--calib", spec.calib), ("--check", spec.check)):
        if path is not None:
            existing(path, flag)


def _tree_sha256(path: Path) -> str:
    """sha256 of a file, or of a folder's files (relative names and contents, in name order)."""
    if path.is_file():
        return file_sha256(path)
    h = hashlib.sha256()
    for f in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(f"{f.relative_to(path).as_posix()}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def sweep_inputs(spec: SweepSpec) -> dict:
    """The card, calibration and check sets the engines are built from (path and sha256; None: none)."""
    from ..config.card import find_card

    found = {"card": Path(spec.card) if spec.card else find_card(spec.model),
             "calib": Path(spec.calib) if spec.calib else find_calibration(Path(spec.model)),
             "check": Path(spec.check) if spec.check else None}
    return {k: None if p is None else {"path": str(p), "sha256": _tree_sha256(p)} for k, p in found.items()}


def _prepare_out(out: Path) -> None:
    """Create --out and prove it writable, before minutes of measuring.

    Raises:
        SweepError: naming --out and why.
    """
    problem = make_dir(out)
    if problem:
        raise SweepError(f"--out {os.fspath(out)!r} {problem}")
    try:
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise SweepError(f"--out {os.fspath(out)!r} is not writable: {exc.strerror or exc}") from None


def _reason(exc: BaseException) -> str:
    text = first_line(exc, default="")
    if isinstance(exc, K2EdgeError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _units(cfg: SweepConfig, settings: MeasureSettings, samples: int, with_accuracy: bool) -> float:
    bs = cfg.profile["edge_runtime"].get("batch_size", 1)
    return 2 * settings.requests + (math.ceil(samples / bs) if with_accuracy else 0)


def new_record(cfg: SweepConfig) -> dict:
    """An empty record for ``cfg``; ``status`` goes pending -> partial -> ok, or failed."""
    return {"key": cfg.key, "name": cfg.name, "source": cfg.source, "profile": cfg.profile, "status": "pending",
            "error": None, "runs": []}


def measure_once(record: dict, cfg: SweepConfig, spec: SweepSpec, dataset, sampler=None,
                 progress: SweepProgress | None = None) -> None:
    """Build ``cfg`` through the cache and add one run to ``record``; a failure marks it failed with the reason."""
    from ..engine.engine import Engine

    engine = None
    try:
        started = time.perf_counter()
        engine = Engine.build(spec.model, cfg.profile, spec.calib, board=spec.board, backend=spec.backend,
                              cache_dir=spec.cache_dir, input_shapes=spec.input_shapes, card=spec.card, check=spec.check)
        if not record["runs"]:
            desc = engine.describe()
            plan = engine.plan
            record.update({
                "devices": [lane.label for lane in engine.lanes()],
                "lanes": [{"device": lane.device, "label": lane.label, "precision": lane.precision,
                           "request_share": lane.request_share} for lane in engine.lanes()],
                "backend": {"name": desc.get("backend"), "version": desc.get("version"),
                            "threads_per_lane": desc.get("threads_per_lane")},
                "plan": {"granularity": plan.granularity, "requested_gpu_share": plan.requested_gpu_share,
                         "gpu_flop_share": round(plan.gpu_flop_share, 4), "transitions": plan.transitions,
                         "dla_cores": plan.dla_cores, "segments": len(plan.segments), "notes": list(plan.notes),
                         "precision_flops": (plan.precision_flops or {}).get("model")},
                "build": {"seconds": round(time.perf_counter() - started, 3), "cache_hits": dict(engine.info.cache_hits),
                          "engine_key": desc.get("engine_key"), "notes": list(engine.info.notes)},
                "int8_check": desc.get("int8_check"),
            })
        run = measure_run(engine, dataset, spec.settings, sampler, progress, with_accuracy=not record["runs"])
        accuracy = run.pop("accuracy", None)
        if accuracy:
            record.update(accuracy)
        record["runs"].append(run)
        record.update(summarise(record["runs"]))
        record["status"] = "ok" if len(record["runs"]) >= spec.settings.runs else "partial"
        record["measured_at"] = now()
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # one configuration failing must not stop the sweep
        log.debug("configuration %s failed", cfg.name, exc_info=True)
        record["status"] = "failed"
        record["error"] = _reason(exc)
    finally:
        if engine is not None and engine.active:
            engine.deactivate()


def finalise(doc: dict, spec: SweepSpec) -> None:
    """Mark the front and pick the recommendation from the records measured so far."""
    mark_front(doc)
    ok = [r for r in doc["configs"] if r["status"] in MEASURED]
    energy_reason = next((r.get("energy_reason") for r in ok if r.get("energy_reason")), None)
    metric = accuracy_metric(ok)
    # INT8 whose accuracy check failed stays on the front (its figures are measured) but is never recommended.
    check_failed = [r["name"] for r in ok if int8_check_status(r) == "failed"]
    eligible = [r for r in ok if r["name"] not in check_failed]
    rec = recommend([point_of(r) for r in eligible], spec.goal, max_latency_ms=spec.max_latency_ms,
                    min_accuracy=spec.min_accuracy, energy_unknown_reason=energy_reason, metric=metric)
    set_recommendation(doc, rec)
    if check_failed:
        why = (f"{', '.join(check_failed)} not considered: {'its' if len(check_failed) == 1 else 'their'} INT8 accuracy "
               "check failed (see int8_check in results.json)")
        doc["recommendation"]["int8_check_failed"] = check_failed
        doc["recommendation"]["reason"] = why if not eligible else f"{doc['recommendation']['reason']}; {why}"
    close = _within_spread([r for r in ok if r["name"] in rec.candidates], rec.name)
    doc["recommendation"]["within_spread"] = close
    if close:
        doc["recommendation"]["reason"] += (f"; {', '.join(close)} {'matches' if len(close) == 1 else 'match'} or "
                                            f"{'beats' if len(close) == 1 else 'beat'} its {metric} with per-run p50s "
                                            "overlapping its own (a latency difference this sweep cannot resolve)")


def _within_spread(records: list[dict], name: str | None) -> list[str]:
    """Configurations at least as accurate as ``name`` whose per-run p50 range overlaps its range."""
    chosen = next((r for r in records if r["name"] == name), None)
    if chosen is None or not (chosen.get("spread") or {}).get("latency_p50_ms"):
        return []
    lo, hi = chosen["spread"]["latency_p50_ms"]["min"], chosen["spread"]["latency_p50_ms"]["max"]
    close = []
    for r in records:
        sp = (r.get("spread") or {}).get("latency_p50_ms")
        if r is chosen or not sp or accuracy_of(r) is None or accuracy_of(r) < accuracy_of(chosen):
            continue
        if sp["min"] <= hi and sp["max"] >= lo:
            close.append(r["name"])
    return close


def run_sweep(spec: SweepSpec, configs: list[SweepConfig], *, resume: bool = False, overwrite: bool = False,
              telemetry=None, progress: SweepProgress | None = None) -> SweepOutcome:
    """Measure every configuration, round by round, and write ``results.json`` after every run.

    Round ``r`` gives each configuration its ``r``-th run, so a configuration's runs are spread over
    the whole sweep (see :mod:`k2edge.sweep.measure`).

    Args:
        spec: model, data, output directory, measurement settings and goal.
        configs: the configurations, in order.
        resume: continue from ``spec.out/results.json``: finished configurations (same key) are kept,
            partly measured ones get their remaining runs, failed ones are retried; a stored record whose
            name is now given to other settings is measured again.
        overwrite: replace an existing ``results.json`` (without it, or ``resume``, one is refused).
        telemetry: a telemetry source (tests pass a fake); None opens k2edge.telemetry's.
        progress: receives progress; default silent.

    Returns:
        A :class:`SweepOutcome`; ``interrupted`` is True after Ctrl-C (what was measured is written).

    Raises:
        SweepError: ``--resume`` on a sweep of another model, dataset, settings, card, calibration or check set;
            ``results.json`` already in ``spec.out`` without ``resume`` or ``overwrite``; ``spec.out`` not writable.
        K2EdgeError: the model, evaluation, calibration or check set cannot be opened.
    """
    from ..engine.backends import resolve_backend

    from .report import write_outputs

    progress = progress or SweepProgress()
    out = Path(spec.out)
    results_path = out / RESULTS
    _check_paths(spec)
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out {os.fspath(out)!r} is a file, not a directory")
    if results_path.exists() and not resume and not overwrite:
        raise SweepError(f"{results_path} exists: pass --resume to continue it, --overwrite to replace it, or another --out")
    backend = resolve_backend(spec.backend)
    dataset = _open_eval(spec)
    doc = {
        "schema": SCHEMA, "k2edge_version": __version__, "status": "running", "started": now(), "updated": now(),
        "model": {"path": str(spec.model), "sha256": file_sha256(spec.model)},
        "dataset": {"path": str(spec.dataset), "samples": len(dataset), "fingerprint": dataset.fingerprint()},
        "calibration": str(calib) if (calib := spec.calib or find_calibration(Path(spec.model))) else None,  # INT8's set
        "inputs": sweep_inputs(spec),
        "board": spec.board,
        "backend": {"requested": spec.backend, "name": backend, "version": None},
        "machine": machine_info(backend),
        "telemetry": None,
        "settings": {**spec.settings.to_dict(), "goal": spec.goal, "max_latency_ms": spec.max_latency_ms,
                     "min_accuracy": spec.min_accuracy},
        "objectives": OBJECTIVES_DOC, "agreement": AGREEMENT_DOC,
        "configs": [], "pareto_front": [], "recommendation": None,
    }
    records = {c.key: new_record(c) for c in configs}
    extra: list[dict] = []
    reused: list[str] = []
    if resume:
        previous = load_previous(results_path)
        if previous is None:
            progress.note(f"--resume: no {results_path} yet; starting a new sweep")
        else:
            check_resumable(previous, doc, results_path)
            doc["started"] = previous.get("started", doc["started"])
            asked = {c.name for c in configs}
            changed: list[str] = []
            for r in previous.get("configs", []):
                if r.get("status") not in MEASURED:
                    continue  # failed ones are retried from scratch
                if r["key"] in records:
                    records[r["key"]] = {**r, "name": records[r["key"]]["name"]}
                    reused.append(r["name"])
                elif r["name"] in asked:  # the name now means other settings: kept, two rows would share it
                    changed.append(r["name"])
                else:
                    extra.append(r)
            if changed:
                progress.note(f"--resume: {', '.join(changed)} now {'has' if len(changed) == 1 else 'have'} other settings "
                              "than were measured under that name; measuring again")
            todo_names = [c.name for c in configs if records[c.key]["status"] != "ok"]
            if reused:
                progress.note(f"--resume: keeping what was measured of {len(reused)} configuration(s) "
                              f"({', '.join(reused)}); {len(todo_names)} still to measure")
            if extra:
                progress.note(f"--resume: also keeping {len(extra)} stored configuration(s) not in this sweep: "
                              f"{', '.join(r['name'] for r in extra)}")
    sampler = TelemetrySampler(telemetry)
    try:
        if spec.goal == "energy" and (why := sampler.no_power()) is not None:  # before minutes of measuring in vain
            raise SweepError(f"--goal energy needs a power reading, and there is none here ({why}); sweep on the "
                             "device, or choose --goal latency, accuracy or balanced")
        _prepare_out(out)
    except BaseException:
        sampler.stop()  # a sensor (jtop, NVML) is not left open
        raise
    runs = spec.settings.runs

    def publish() -> None:
        doc["configs"] = [records[c.key] for c in configs if records[c.key]["status"] != "pending"] + extra
        doc["updated"] = now()
        doc["telemetry"] = {"state": sampler.state, "message": sampler.message}
        versions = [r["backend"]["version"] for r in doc["configs"] if r.get("backend")]
        doc["backend"]["version"] = versions[0] if versions else None
        finalise(doc, spec)

    def needs_run(c: SweepConfig) -> bool:
        r = records[c.key]
        return r["status"] in ("pending", "partial") and len(r["runs"]) < runs

    measured: list[str] = []
    interrupted = False
    steps = sum(runs - len(records[c.key]["runs"]) for c in configs if needs_run(c))
    total = sum(_units(c, spec.settings, len(dataset), not records[c.key]["runs"]) +
                (runs - len(records[c.key]["runs"]) - 1) * _units(c, spec.settings, len(dataset), False)
                for c in configs if needs_run(c))
    step = 0
    try:
        progress.start(total, steps, sum(1 for c in configs if needs_run(c)))
        sampler.start()
        while True:
            todo = [c for c in configs if needs_run(c)]
            if not todo:
                break
            for cfg in todo:
                record = records[cfg.key]
                label = f"[{step + 1}/{steps}] {cfg.name} run {len(record['runs']) + 1}/{runs}"
                progress.begin_step(label)
                tracker = _Tracker(progress)
                planned = _units(cfg, spec.settings, len(dataset), not record["runs"])
                measure_once(record, cfg, spec, dataset, sampler, tracker)
                step += 1
                if cfg.name not in measured:
                    measured.append(cfg.name)
                publish()
                write_json_atomic(results_path, doc)
                left = planned - tracker.units
                if record["status"] == "failed":  # its remaining runs will not happen
                    left += (runs - len(record["runs"]) - 1) * _units(cfg, spec.settings, len(dataset), False)
                    steps_left = runs - len(record["runs"]) - 1
                    step += steps_left
                progress.end_step(record, max(0.0, left))
                if record["status"] in ("ok", "failed"):
                    progress.config_done(record)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sampler.stop()
        progress.stop()
    doc["status"] = "interrupted" if interrupted else "complete"
    publish()
    write_outputs(doc, out, complete=not interrupted)
    return SweepOutcome(doc, interrupted, reused, measured)


class _Tracker(SweepProgress):
    """Counts the units one step reported, so a failure can fill the bar for the rest."""

    def __init__(self, inner: SweepProgress) -> None:
        self.inner = inner
        self.units = 0.0

    def advance(self, units: float, phase: str | None = None) -> None:
        self.units += units
        self.inner.advance(units, phase)
