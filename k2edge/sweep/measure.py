"""Measure one built engine, one run at a time: latency, throughput, accuracy, curve, energy.

Procedure (the runner calls :func:`measure_run` once per run and :func:`summarise` on the runs):

* every run builds (through the cache) and activates the engine afresh (new sessions and lane
  threads), and the runner interleaves the configurations round by round (run 1 of each, then
  run 2 of each, ...), so each configuration's runs are spread over the whole sweep: the spread
  between runs covers activation-to-activation variation and drift in the machine's load, and load
  bursts fall on every configuration alike instead of on whichever was running;
* warm-up: ``warmup`` requests through ``infer`` and as many samples through ``stream``, never timed;
* latency: ``requests`` batch requests through ``Engine.infer`` one after another, on inputs staged
  beforehand (the engine's latency, without decoding);
* throughput: ``requests`` batches of evaluation samples through ``Engine.stream`` with several
  requests in flight, staging included (with the profile's prefetch setting); samples per second;
* accuracy and the confidence curve: one pass over the evaluation set, in the first run;
* energy per inference: total power integrated over the throughput window, divided by the samples
  (J per sample at full load); peak temperature over the run.

Headline numbers are the median over runs of each run's value (p50, p90, p99, mean, throughput,
energy); ``spread`` gives min, max, range and stdev of the per-run values.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import InferenceError


@dataclass(frozen=True)
class MeasureSettings:
    """How much to measure per configuration.

    Attributes:
        runs: independent runs (engine activations); the spread is taken between them.
        warmup: untimed requests before each run.
        requests: timed batch requests per run, for latency and again for throughput.
        limit: evaluate the first ``limit`` samples of the evaluation set only.
    """

    runs: int = 5
    warmup: int = 50
    requests: int = 500
    limit: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def latency_stats(latencies_ms: Sequence[float]) -> dict:
    """Mean, p50, p90, p99, min and max (ms) of request latencies."""
    a = np.asarray(latencies_ms, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "min": float(a.min()), "max": float(a.max()), "requests": int(a.size)}


def spread(values: Sequence[float | None]) -> dict | None:
    """Min, max, range and sample stdev of per-run values (None when no run has one)."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return None
    return {"min": min(v), "max": max(v), "range": max(v) - min(v),
            "stdev": statistics.stdev(v) if len(v) > 1 else 0.0, "runs": len(v)}


def confidence_curve(confidence: Sequence[float], correct: Sequence[bool], step_pct: int = 5) -> list[dict]:
    """Accuracy when the least confident x % of requests go to the cloud (assumed answered correctly).

    Samples are sorted by max-softmax confidence, ascending (stable, so ties keep dataset order);
    at each step the ``round(x % of n)`` least confident are escalated.

    Returns:
        One entry per step from 0 to 100 %: ``escalated_pct``, ``escalated`` (count), ``accuracy``
        (overall, escalated ones counted correct), ``edge_accuracy`` (on the requests kept at the
        edge; None when none are kept) and ``max_confidence_escalated`` (the highest confidence that
        was escalated: a threshold of about that value sends that share to the cloud; None at 0 %).
    """
    conf = np.asarray(confidence, dtype=np.float64)
    ok = np.asarray(correct, dtype=bool)
    if conf.shape != ok.shape or conf.ndim != 1:
        raise ValueError("confidence and correct must be 1-D and equally long")
    n = conf.size
    if n == 0:
        return []
    order = np.argsort(conf, kind="stable")
    conf_sorted, ok_sorted = conf[order], ok[order]
    kept_correct = np.concatenate([np.cumsum(ok_sorted[::-1])[::-1], [0]])  # [k]: correct among sorted[k:]
    curve = []
    for pct in range(0, 101, step_pct):
        k = min(n, int(math.floor(pct * n / 100 + 0.5)))
        kept = n - k
        curve.append({
            "escalated_pct": pct,
            "escalated": k,
            "accuracy": float((k + kept_correct[k]) / n),
            "edge_accuracy": float(kept_correct[k] / kept) if kept else None,
            "max_confidence_escalated": float(conf_sorted[k - 1]) if k else None,
        })
    return curve


def _median(values: Sequence[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return float(statistics.median(v)) if v else None


class _Silent:
    def advance(self, units: float, phase: str | None = None) -> None:
        pass


def _stream_count(engine, items: list, collect: Callable | None = None) -> int:
    done = 0
    for result in engine.stream(items):
        if result.error is not None:
            if isinstance(result.error, Exception):
                raise result.error
            raise InferenceError(str(result.error))
        if collect:
            collect(result)
        done += len(result.items)
    return done


def _accuracy(engine, dataset) -> dict:
    if engine.card.task in ("segmentation", "pose"):  # the masks' / keypoints' mAP, as k2edge eval reports it
        from ..engine.evaluate import evaluate_instances

        result = evaluate_instances(engine, dataset)
        what = "mask" if engine.card.task == "segmentation" else "keypoint"
        return {"accuracy_metric": f"{what} mAP@0.5", "map50": result["map50"], "map": result["map"],
                "samples": result["images"], "detections": result["detections"]}
    if engine.card.task == "detection":
        from ..engine.evaluate import evaluate_detector

        result = evaluate_detector(engine, dataset)
        return {"accuracy_metric": "mAP@0.5", "map50": result["map50"], "map": result["map"], "samples": result["images"],
                "detections": result["detections"]}
    confidence: list[float] = []
    predicted: list[int] = []

    def collect(result) -> None:
        logits = np.asarray(result.outputs[engine.output_names[0]])[: len(result.items)]
        for best in engine.top_k(logits.reshape(len(result.items), -1), 1):
            predicted.append(best[0]["index"])
            confidence.append(best[0]["score"])

    samples = _stream_count(engine, list(dataset.samples), collect)
    correct = np.asarray(predicted) == np.asarray(dataset.labels[:samples])
    return {"top1": float(correct.mean()), "correct": int(correct.sum()), "samples": int(samples),
            "mean_confidence": float(np.mean(confidence)),
            "confidence_curve": confidence_curve(confidence, correct.tolist())}


def measure_run(engine, dataset, settings: MeasureSettings, sampler=None, progress=None,
                with_accuracy: bool = False) -> dict:
    """One run on a built (inactive) engine: activate, warm up, measure, deactivate.

    Args:
        engine: a built :class:`~k2edge.engine.engine.Engine`, not active.
        dataset: the labelled evaluation set (already limited).
        settings: warm-up and request counts.
        sampler: a started :class:`~k2edge.sweep.sampler.TelemetrySampler`, or None.
        progress: an object with ``advance(units, phase)``; one unit per request (or per batch of the
            accuracy pass).
        with_accuracy: also run the accuracy pass (the first run of a configuration).

    Returns:
        The run's record: latency percentiles, throughput, energy, peak temperature, and with
        ``with_accuracy`` an ``accuracy`` block (top1, correct, samples, confidence_curve).

    Raises:
        K2EdgeError: the engine fails to activate or to run.
    """
    progress = progress or _Silent()
    bs = engine.batch_size
    samples = dataset.samples
    count = len(samples)
    items = [samples[i % count] for i in range(settings.requests * bs)]
    staged = [engine.stage([samples[(b * bs + j) % count] for j in range(bs)]) for b in range(min(16, settings.requests))]
    warm_items = [samples[i % count] for i in range(max(settings.warmup, 1) * bs)]
    name = engine.input_name
    record: dict = {"load_average": _loadavg()}
    started = time.monotonic()
    with engine:
        progress.advance(0, "warm-up")
        for i in range(settings.warmup):
            engine.infer({name: staged[i % len(staged)]})
        _stream_count(engine, warm_items)
        if with_accuracy:
            progress.advance(0, f"accuracy on {count} samples")
            record["accuracy"] = _accuracy(engine, dataset)
            progress.advance(math.ceil(count / bs))
        progress.advance(0, "latency")
        lat = []
        clock = time.perf_counter
        for i in range(settings.requests):
            x = staged[i % len(staged)]
            t = clock()
            engine.infer({name: x})
            lat.append((clock() - t) * 1e3)
        progress.advance(settings.requests, "throughput")
        t0 = time.monotonic()
        done = _stream_count(engine, items)
        t1 = time.monotonic()
        progress.advance(settings.requests)
    finished = time.monotonic()
    energy, energy_reason = sampler.energy_per_inference(t0, t1, done) if sampler else (None, "no telemetry source")
    peak, sensor = sampler.peak_temperature(started, finished) if sampler else (None, "no telemetry source")
    stats = latency_stats(lat)
    record.update({
        "latency_p50_ms": stats["p50"], "latency_p90_ms": stats["p90"], "latency_p99_ms": stats["p99"],
        "latency_mean_ms": stats["mean"], "latency_min_ms": stats["min"], "latency_max_ms": stats["max"],
        "requests": stats["requests"], "throughput_per_s": done / (t1 - t0), "throughput_samples": done,
        "energy_j_per_inference": energy, "energy_reason": energy_reason,
        "peak_temperature_c": peak, "peak_temperature_sensor": sensor if peak is not None else None,
        "temperature_reason": None if peak is not None else sensor, "seconds": finished - started,
    })
    return record


def summarise(runs: Sequence[dict]) -> dict:
    """The headline numbers of a configuration from its runs (medians) and their spread."""
    def med(key):
        return _median([r.get(key) for r in runs])

    energy = med("energy_j_per_inference")
    reasons = [r["energy_reason"] for r in runs if r.get("energy_reason")]
    peaks = [r for r in runs if r.get("peak_temperature_c") is not None]
    hottest = max(peaks, key=lambda r: r["peak_temperature_c"]) if peaks else None
    out = {
        "latency_ms": {"mean": med("latency_mean_ms"), "p50": med("latency_p50_ms"), "p90": med("latency_p90_ms"),
                       "p99": med("latency_p99_ms"), "min": min(r["latency_min_ms"] for r in runs),
                       "max": max(r["latency_max_ms"] for r in runs), "requests": sum(r["requests"] for r in runs)},
        "throughput_per_s": med("throughput_per_s"),
        "energy_j_per_inference": energy,
        "energy_reason": None if energy is not None else (reasons[0] if reasons else "unknown"),
        "peak_temperature_c": hottest["peak_temperature_c"] if hottest else None,
        "peak_temperature_sensor": hottest["peak_temperature_sensor"] if hottest else None,
        "temperature_reason": None if hottest else next((r.get("temperature_reason") for r in runs
                                                         if r.get("temperature_reason")), "unknown"),
        "spread": {
            "latency_p50_ms": spread([r["latency_p50_ms"] for r in runs]),
            "latency_p99_ms": spread([r["latency_p99_ms"] for r in runs]),
            "throughput_per_s": spread([r["throughput_per_s"] for r in runs]),
            "energy_j_per_inference": spread([r.get("energy_j_per_inference") for r in runs]),
        },
        "measure_seconds": sum(r.get("seconds", 0.0) for r in runs),
    }
    return out


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None
