"""``k2edge cloud check|curve``: reach the K2 server; the escalation-rate vs accuracy curve."""

from __future__ import annotations

COMMAND = "cloud"
HELP = "check the K2 cloud endpoint; print the escalation-rate vs accuracy curve"
ORDER = 70

import time
from pathlib import Path

from ..errors import K2EdgeError
from .common import Progress, add_build, add_json, add_model, build_engine, count, positive_float, print_json, table

MEASURES = ("max_softmax", "margin", "entropy", "max_box_score", "uncertain_boxes")
CHECK_PROMPT = "Reply with the single word OK."


def register(p) -> None:
    sub = p.add_subparsers(dest="cloud_command", metavar="SUBCOMMAND", required=True)
    c = sub.add_parser("check", help="reachability, models listed, round-trip latency of a tiny chat completion",
                       description="Check the K2 endpoint: GET /v1/models, then one tiny chat completion.")
    c.add_argument("--config", metavar="PATH", help="daemon config (TOML); its [cloud] table is used")
    c.add_argument("--base-url", metavar="URL", help="OpenAI-compatible base URL (default https://api.moonshot.ai/v1)")
    c.add_argument("--model", "-m", metavar="M", help="model id to test")
    c.add_argument("--mode", choices=("openai", "anthropic"), help="API flavour (default openai)")
    key = c.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", metavar="F", help="file holding the API key")
    key.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    key.add_argument("--api-key-credential", metavar="NAME", help="systemd credential name ($CREDENTIALS_DIRECTORY/NAME)")
    c.add_argument("--timeout", type=positive_float, metavar="S", help="seconds per call (default: the config's timeout_s)")
    c.add_argument("--image", metavar="FILE", help="also send this image (checks the model takes images)")
    add_json(c)

    k = sub.add_parser("curve", help="escalation rate vs accuracy on an evaluation set (cloud assumed right)",
                       description="For each share of traffic sent to the cloud (least confident first), the accuracy "
                                   "it buys, assuming the cloud answers every escalated request correctly, and the "
                                   "confidence threshold that sends that share.")
    add_model(k)
    add_build(k)
    k.add_argument("--dataset", required=True, metavar="EVAL",
                   help="labelled ImageFolder directory or .npz with x and y; for a detector a COCO annotation .json")
    k.add_argument("--measure", choices=MEASURES,
                   help="confidence measure (default max_softmax; detectors: max_box_score, or uncertain_boxes with --band)")
    k.add_argument("--band", type=_band, default=(0.25, 0.6), metavar="LOW,HIGH",
                   help="uncertain_boxes: escalate images with a box scoring within [LOW, HIGH) (default 0.25,0.6)")
    k.add_argument("--step", type=int, default=5, metavar="PCT", help="share step in percent (default 5)")
    k.add_argument("--shares", type=_percent_list, metavar="P,P,...", help="shares in percent instead of steps, e.g. 0,1,2,5,10,50,100")
    k.add_argument("--limit", type=count(1), metavar="N", help="use N samples only: the first N; of an image folder, N taken from each class in turn")
    add_json(k)


def run(args) -> int:
    return _check(args) if args.cloud_command == "check" else _curve(args)


# check ---------------------------------------------------------------------------------------------
def _settings(args):
    from ..config.cloud import CloudSettings
    from ..config.tables import validate_settings

    table_ = {}
    if args.config:
        from ..config.schema import read_config

        path = Path(args.config)
        doc = read_config(path, K2EdgeError)  # api_key_file relative to the config's folder, as the daemon reads it
        table_ = doc.get("cloud") or {}
        if not isinstance(table_, dict):
            raise K2EdgeError(f"config {str(path)!r}: cloud must be a table ([cloud]), got {type(table_).__name__}")
        table_ = dict(table_)
        if not table_:
            raise K2EdgeError(f"config {str(path)!r} has no [cloud] table")
    overrides = {"base_url": args.base_url, "model": args.model, "mode": args.mode, "timeout_s": args.timeout}
    table_.update({k: v for k, v in overrides.items() if v is not None})
    for name in ("api_key_file", "api_key_env", "api_key_credential"):
        if getattr(args, name):
            for other in ("api_key_file", "api_key_env", "api_key_credential"):
                table_.pop(other, None)
            table_[name] = getattr(args, name)
    return validate_settings(CloudSettings, table_, "cloud")


def _check(args) -> int:
    from ..cloud_bridge.client import K2Client
    from ..cloud_bridge.errors import CloudError

    settings = _settings(args)
    image = _image(args.image) if args.image else None  # a bad path is refused before the network is
    # With --image the image must go: vision "auto" would quietly send the text instead when the server refuses it.
    check = settings.model_copy(update={"max_tokens": 16, "max_retries": 0, **({"vision": "on"} if image else {})})
    client = K2Client(check)
    report: dict = {"endpoint": settings.base_url, "mode": settings.mode, "key": settings.key_source(),
                    "model": settings.model, "reachable": False, "models": None, "model_listed": None,
                    "round_trip_ms": None, "answer": None, "ok": False, "error": None}
    try:
        client.wire  # import the SDK and build the HTTP client before timing anything
        t0 = time.perf_counter()
        try:
            models = client.list_models()
        except CloudError as exc:
            if exc.status != 404 or not settings.model:
                raise
            models = None  # some endpoints (Anthropic-compatible ones) list no models; the chat still tells
        report.update({"reachable": True, "models": models, "list_ms": round((time.perf_counter() - t0) * 1e3, 1)})
        report["model_listed"] = settings.model in models if settings.model and models is not None else None
        if not settings.model:
            raise K2EdgeError(f"no model configured: pass --model, one of {', '.join(models) or '(none listed)'}")
        ans = client.complete(image, None, CHECK_PROMPT, None, check.timeout_s)
        report.update({"round_trip_ms": round(ans.latency_ms, 1), "answer": ans.text, "answered_by": ans.model, "ok": True})
    except (CloudError, K2EdgeError, OSError) as exc:
        report["error"] = str(exc)
    finally:
        client.close()
    if args.json:
        print_json(report)
        return 0 if report["ok"] else 1
    print(f"endpoint    {report['endpoint']} ({report['mode']} mode), key: {report['key']}")
    if report["reachable"] and report["models"] is None:
        print("reachable   yes, but GET /v1/models is not offered here (404): no model list")
    elif report["reachable"]:
        print(f"reachable   yes: {len(report['models'])} model(s) listed by GET /v1/models in {report['list_ms']:.0f} ms")
        for m in report["models"]:
            print(f"            {m}{'   <- configured' if m == settings.model else ''}")
        if settings.model and not report["model_listed"]:
            print(f"model       {settings.model} is NOT among the listed models")
    if report["ok"]:
        print(f"round trip  {report['round_trip_ms']:.0f} ms for a tiny chat completion{' with an image' if args.image else ''}; "
              f"{report['answered_by']} answered {report['answer']!r}")
        return 0
    raise K2EdgeError(report["error"] or "the check failed")


def _image(path: str) -> bytes:
    p = Path(path)
    if p.is_dir():
        raise K2EdgeError(f"--image {path!r} is a directory; give an image file")
    if not p.is_file():
        raise K2EdgeError(f"--image {path!r} does not exist")
    return p.read_bytes()


# curve ---------------------------------------------------------------------------------------------
def _percent_list(text: str) -> list[float]:
    import argparse

    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected percentages like 0,5,10,100, got {text!r}") from None
    if not values or any(not 0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentages must be within [0, 100], got {text!r}")
    return [v / 100 for v in values]


def _band(text: str) -> tuple[float, float]:
    import argparse

    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH such as 0.25,0.6, got {text!r}") from None
    if not 0 <= low < high <= 1:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW < HIGH <= 1, got {text!r}")
    return low, high


def _detection_curve(args, engine) -> int:
    """Detection, segmentation or pose: mAP by the task's own measure (boxes, masks, keypoints)."""
    from ..cloud_bridge.curve import detection_curve
    from ..engine.evaluate import instance_metric, open_eval_set, run_detector, run_instances

    measure = args.measure or "max_box_score"
    if measure not in ("max_box_score", "uncertain_boxes"):
        raise K2EdgeError(f"--measure {measure} is a classifier measure; a detector takes max_box_score or uncertain_boxes")
    dataset = open_eval_set(engine, args.dataset, args.limit)
    progress = Progress(len(dataset), "curve", json_output=args.json)
    iou_type, sigmas = instance_metric(engine.card) if engine.card.task != "detection" else ("bbox", None)
    with engine:
        run = run_detector if iou_type == "bbox" else run_instances
        detections = run(engine, list(dataset.samples), progress.advance)
    progress.close()
    shares = args.shares or [p / 100 for p in range(0, 100, args.step)] + [1.0]
    points = detection_curve(dataset, detections, measure, shares, args.band, iou_type, sigmas)
    info = {"model": engine.model.source, "profile": engine.profile.name, "dataset": dataset.source, "images": len(dataset),
            "metric": iou_type, "measure": measure, "band": list(args.band) if measure == "uncertain_boxes" else None,
            "lanes": [lane.label + f" [{lane.precision}]" for lane in engine.lanes()], "points": [p.to_dict() for p in points]}
    if args.json:
        print_json(info)
        return 0
    how = f"{measure} in [{args.band[0]:g}, {args.band[1]:g})" if measure == "uncertain_boxes" else measure
    print(f"escalation curve: {info['model']}, profile {info['profile']}, {info['images']} images of {info['dataset']}, "
          f"least confident first by {how}; the cloud is assumed to fix what it sees (its images count as ground truth)")
    body = [[f"{p.share * 100:.0f} %", p.escalated, f"{p.map50:.4f}", f"{p.map:.4f}",
             "-" if p.threshold is None else f"{p.threshold:.6g}"] for p in points]
    of = {"bbox": "", "segm": "mask ", "keypoints": "keypoint "}[iou_type]
    print(table(body, ["to cloud", "images", f"{of}mAP@0.5", f"{of}mAP@0.5:0.95", "threshold (escalate if best box <)"]))
    return 0


def _curve(args) -> int:
    import numpy as np

    from ..cloud_bridge.curve import escalation_curve
    from ..model.datasets import existing, open_labelled
    from ..model.ingest import model_file

    if not 1 <= args.step <= 100:
        raise K2EdgeError(f"--step must be within [1, 100], got {args.step}")
    model_file(args.model)  # the model, then the dataset: a mistyped path is told before a build that may take minutes
    existing(args.dataset)
    engine = build_engine(args)
    if engine.card.task == "obb":
        raise K2EdgeError("cloud curve needs an evaluation of the model's answers, and oriented boxes have none yet "
                          "(k2edge eval does not measure obb models either)")
    if engine.card.task in ("detection", "segmentation", "pose"):
        return _detection_curve(args, engine)
    args.measure = args.measure or "max_softmax"
    if args.measure not in MEASURES[:3]:
        raise K2EdgeError(f"--measure {args.measure} is a detector measure; a classifier takes max_softmax, margin or entropy")
    dataset = open_labelled(args.dataset, engine.labels, args.limit)
    progress = Progress(len(dataset), "curve", json_output=args.json)
    rows = []
    with engine:
        for result in engine.stream(list(dataset.samples)):
            if result.error is not None:
                raise result.error
            out = np.asarray(result.outputs[engine.output_names[0]])[: len(result.items)]
            rows.append(out.reshape(len(result.items), -1))
            progress.advance(len(result.items))
    progress.close()
    logits = np.concatenate(rows)
    shares = args.shares or [p / 100 for p in range(0, 100, args.step)] + [1.0]
    points = escalation_curve(logits, dataset.labels, args.measure, shares)
    info = {"model": engine.model.source, "profile": engine.profile.name, "dataset": dataset.source, "samples": len(dataset),
            "measure": args.measure, "lanes": [lane.label + f" [{lane.precision}]" for lane in engine.lanes()],
            "points": [p.to_dict() for p in points]}
    if args.json:
        print_json(info)
        return 0
    print(f"escalation curve: {info['model']}, profile {info['profile']}, {info['samples']} samples of {info['dataset']}, "
          f"confidence by {args.measure}; the cloud is assumed to answer every escalated request correctly")
    body = []
    for p in points:
        thr = "-" if p.threshold is None else f"{p.threshold:.6f}"
        if p.threshold is not None and p.escalated == info["samples"]:
            thr = f"{thr} (all)"
        body.append([f"{p.share * 100:.0f} %", p.escalated, f"{p.accuracy * 100:.2f} %",
                     "-" if p.local_accuracy is None else f"{p.local_accuracy * 100:.2f} %", thr,
                     f"{p.threshold_share * 100:.1f} %"])
    print(table(body, ["to cloud", "requests", "accuracy", "edge-kept accuracy", "threshold (escalate if <)",
                       "threshold sends"]))
    return 0
