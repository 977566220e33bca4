"""The command line, run as a user runs it: a subprocess of the installed entry point."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "models" / "digits" / "model.onnx")


def k2edge(*args, check=True):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "k2edge", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"k2edge {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_help_lists_every_command():
    out = k2edge("--help").stdout
    for cmd in ("inspect", "plan", "build", "infer", "eval", "pareto-sweep", "cloud", "profiles", "doctor", "serve", "request"):
        assert cmd in out


def test_inspect_json():
    data = json.loads(k2edge("inspect", MODEL, "--json").stdout)
    assert data["inputs"] == [{"name": "input", "shape": [1, 1, 32, 32], "dtype": "float32"}]
    gap = next(n for n in data["nodes"] if n["op"] == "GlobalAveragePool")
    assert gap["dla"] is False and "GlobalAveragePool" in gap["dla_reason"]
    assert sum(n["flops"] for n in data["nodes"]) == data["total_flops"] > 0


def test_plan_json_with_ratio_and_board():
    data = json.loads(k2edge("plan", MODEL, "--offload-ratio", "0.5", "--partition", "block-wise", "--board", "orin-nx-8", "--json").stdout)
    assert data["requested_gpu_share"] == 0.5 and abs(data["gpu_flop_share"] - 0.5) <= 0.05
    assert {s["device"] for s in data["segments"]} == {"gpu", "dla0"}
    assert all({"device", "nodes", "flops", "precision", "inputs", "outputs"} <= set(s) for s in data["segments"])
    assert data["memory"]["batch_sizes"] == [1, 2, 4, 8] and data["memory"]["tensorrt_dla_weight_bytes"] > 0
    text = k2edge("plan", MODEL, "-p", "c1").stdout
    assert "requested GPU share 0.350" in text and "note:" in text
    assert "memory: weights for batches up to 8: onnxruntime" in text and "4 static engines each" in text


def test_infer_json_and_save_output(tmp_path):
    samples = sorted((ROOT / "models/digits/samples").glob("*.jpg"))[:3]
    out = tmp_path / "out.npy"
    proc = k2edge("infer", MODEL, "-p", "c5", *map(str, samples), "--json", "--top-k", "3", "--save-output", str(out))
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == 3
    for rec, path in zip(records, samples):
        assert len(rec["top_k"]) == 3 and {"index", "label", "score"} == set(rec["top_k"][0])
        assert rec["top_k"][0]["label"] == path.name.split("-")[1]
        assert rec["latency_ms"] > 0
    saved = np.load(out)
    assert saved.shape == (3, 10)
    assert [int(i) for i in saved.argmax(axis=1)] == [int(p.name.split("-")[1]) for p in samples]
    # the very file named, not 'outputs.txt.npy' (numpy.save adds the suffix to a name without it)
    k2edge("infer", MODEL, "-p", "c5", str(samples[0]), "--save-output", str(tmp_path / "outputs.txt"))
    assert np.load(tmp_path / "outputs.txt").shape == (1, 10) and not (tmp_path / "outputs.txt.npy").exists()


def test_infer_npy_input(tmp_path):
    x = np.zeros((1, 32, 32), np.float32)
    np.save(tmp_path / "x.npy", x)
    rec = json.loads(k2edge("infer", MODEL, "-p", "cpu-dev", str(tmp_path / "x.npy"), "--json").stdout)
    assert len(rec["top_k"]) == 5


def test_eval_json():
    data = json.loads(k2edge("eval", MODEL, "-p", "cpu-dev", "--dataset", str(ROOT / "models/digits/eval.npz"), "--json").stdout)
    assert data["samples"] == 540 and data["top1"] >= 0.97
    low, high = data["top1_ci95"]  # how much a share on 540 samples says
    assert low < data["top1"] <= high and high - low < 0.05
    text = k2edge("eval", MODEL, "-p", "cpu-dev", "--dataset", str(ROOT / "models/digits/eval.npz"), "--limit", "1").stdout
    assert "(1/1, 95 % CI 0.2065-1.0000)" in text, text  # one sample says little, and the line says so


def test_an_int8_build_and_an_eval_piped_print_one_line_per_step(tmp_path):
    """Output that is not a terminal: calibration in tenths, then the evaluation in tenths, each line with the
    elapsed and the remaining time and the last one done; --json keeps stdout one document."""
    import re

    proc = k2edge("eval", MODEL, "-p", "c4", "--dataset", str(ROOT / "models/digits/eval.npz"), "--limit", "30",
                  "--cache", str(tmp_path / "cache"), "--json")
    assert json.loads(proc.stdout)["precision_flops"]["model"]["int8"] > 0.5  # what runs in INT8, beside the lanes' asks
    steps = [x for x in proc.stderr.splitlines() if re.match(r"(calibrating|eval): \d+/\d+ \(\d+:\d\d elapsed", x)]
    calibrating = [x for x in steps if x.startswith("calibrating")]
    evaluating = [x for x in steps if x.startswith("eval")]
    assert 5 <= len(calibrating) <= 10 and all("left)" in x for x in calibrating[:-1]), proc.stderr
    assert len(evaluating) == 10 and evaluating[-1].startswith("eval: 30/30 ") and evaluating[-1].endswith("done)"), proc.stderr


def test_profiles_commands(tmp_path):
    listing = k2edge("profiles", "list").stdout
    for name in ("c1", "c2", "c3", "c4", "c5", "c6", "cpu-dev"):
        assert name in listing
    c1 = next(line for line in listing.splitlines() if line.startswith("c1 "))
    assert c1.rstrip().endswith("(its file has none)"), c1  # the design's seed, verbatim: no description key
    shown = json.loads(k2edge("profiles", "show", "c1").stdout)
    assert shown["edge_runtime"]["offload_ratio"] == 0.35 and shown["edge_runtime"]["batch_size"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"edge_runtime": {"offload_ratio": 1.7}}')
    proc = k2edge("profiles", "validate", str(bad), check=False)
    assert_one_line_error(proc, "edge_runtime.offload_ratio: must be within [0, 1], got 1.7")


def test_doctor_runs_here():
    data = json.loads(k2edge("doctor", "--json").stdout)
    assert data["backends"]["onnxruntime"]["version"]
    assert "jtop" in data and "dla_cores" in data
    assert data["notes"] == (["no DLA here; the ONNX Runtime backend runs each device of a plan as a CPU lane"]
                             if data["dla_cores"] == 0 else [])  # the text's notes, in --json too
    import av

    video = data["video"]
    assert video["pyav"]["version"] == av.__version__ and video["pyav"]["h264"] is True
    assert video["pyav"]["ffmpeg"].startswith("libavcodec ")
    gst = video["gstreamer"]
    assert set(gst) == {"gi", "version", "elements"} and (gst["version"] is None or set(gst["elements"]) == {
        "nvv4l2decoder", "nvvidconv"})
    text = k2edge("doctor").stdout
    assert f"PyAV         {av.__version__}" in text and "GStreamer" in text


@pytest.mark.parametrize("args, fragments", [
    (["inspect", "nope.onnx"], ["does not exist"]),
    (["inspect", "pyproject.toml"], ["not an ONNX model"]),
    (["plan", MODEL], ["give --profile P"]),
    (["plan", MODEL, "-p", "no-such"], ["profile 'no-such' not found"]),
    (["infer", MODEL, "-p", "cpu-dev", "missing.jpg"], ["input file 'missing.jpg' does not exist"]),
    (["infer", MODEL, "-p", "cpu-dev", "pyproject.toml"], ["cannot decode image"]),
    (["eval", MODEL, "-p", "cpu-dev", "--dataset", "nowhere/"], ["dataset 'nowhere/' does not exist"]),
    (["build", MODEL, "-p", "c2", "--calib", "models/digits/labels.txt"], ["expected a directory of images or an .npz"]),
    (["build", MODEL, "-p", "c2", "--check", "nope.npz"], ["check set 'nope.npz' does not exist"]),
    (["eval", MODEL, "-p", "c5", "--dataset", "models/detector/eval/annotations.json"], ["COCO annotations evaluate detectors"]),
    (["plan", MODEL, "--offload-ratio", "x", "--partition", "layer-wise"], ["invalid float value"]),
    (["plan", MODEL, "-p", "c1", "--max-batch", "0"], ["--max-batch: must be within [1, 65536], got 0"]),
    (["frobnicate"], ["invalid choice"]),
    (["inspect", "models"], ["'models' is a directory; expected an ONNX model file"]),
    (["infer", MODEL, "-p", "cpu-dev", "models"], ["input 'models' is a directory"]),
    (["infer", MODEL, "-p", "cpu-dev", "models/digits/samples/digit-0-9.jpg", "--save-output", "/nonexistent/o.npy"],
     ["its directory does not exist"]),
    (["infer", MODEL, "-p", "cpu-dev", "models/digits/samples/digit-0-9.jpg", "--save-input", "models"],
     ["--save-input 'models' is a directory: name the .npy file to write"]),
    (["build", MODEL, "-p", "cpu-dev", "--cache", "/proc/k2edge-cache"], ["is not a writable directory"]),
    (["inspect", MODEL, "--input-shape", "input=1x3x32x32"], ["gives 'input' 3 at axis 1, but the model fixes it at 1"]),
    (["pareto-sweep", MODEL, "--dataset", "models/digits/eval.npz", "--out", "pyproject.toml"], ["is a file, not a directory"]),
    (["inspect", "\u00e9" * 300 + ".onnx"], ["File name too long: "]),
    (["inspect", MODEL, "--batch-size", "0"], ["--batch-size: must be within [1, 65536], got 0"]),
    (["request", "--broker", "127.0.0.1:1", "--model", "digits", "--timeout", "nan", "x.jpg"],
     ["--timeout: must be a finite number above 0, got nan"]),
    (["cloud", "check", "--base-url", "http://127.0.0.1:abc/v1"], ["cloud.base_url: not a URL"]),
    (["cloud", "curve", MODEL, "-p", "cpu-dev", "--dataset", "models/digits/eval.npz", "--limit", "-1"],
     ["--limit: must be at least 1, got -1"]),
    (["rollback", "--broker", "127.0.0.1:1", "--device", "d", "--model", "m", "--reply-prefix", "a/#"],
     ["--reply-prefix 'a/#' must be topic levels", "without the wildcards"]),
    (["deploy", "pyproject.toml", "--broker", "127.0.0.1:1", "--device", "d"], ["not_a_bundle: not a tar archive"]),
    (["keys", "show", "nope.pub"], ["public key 'nope.pub' does not exist"]),
    (["plan", MODEL, "-p", "cpu-dev", "--input-shape", "input=99999999999999999999x1x32x32"],
     ["each dimension must be at most 65536"]),
    (["build", MODEL, "-p", "cpu-dev", "--input-shape", "input=65536x1x32x32x32"], ["at most 2,147,483,647 elements"]),
    (["plan", MODEL, "-p", "models/digits"], ["profile file 'models/digits' is a directory"]),
    (["plan", MODEL, "-p", "./models"], ["profile file './models' is a directory"]),
    (["request", "--broker", "127.0.0.1:1", "--model", "digits", "missing.jpg"],  # the input before the broker
     ["input file 'missing.jpg' does not exist"]),
    (["request", "--broker", "127.0.0.1:1", "--model", "digits", "models"], ["input 'models' is a directory"]),
    (["request", "--broker", "127.0.0.1:1", "--model", "digits", "--retries", "-1", "x.jpg"],
     ["--retries: must be at least 0, got -1"]),
    (["request", "--broker", "127.0.0.1:1", "--model", "digits", "--deadline-ms", "nan", "x.jpg"],
     ["--deadline-ms: must be a finite number, got nan"]),
    (["request", "--broker", "127.0.0.1:1", "--model", "digits", "--deadline-ms", "inf", "x.jpg"],
     ["--deadline-ms: must be a finite number, got inf"]),
    (["watch", MODEL, "models"], ["source 'models' is a directory"]),
])
def test_bad_input_is_one_line_exit_1(args, fragments):
    assert_one_line_error(k2edge(*args, check=False), *fragments)


@pytest.mark.parametrize("args, fragment", [
    (["infer", MODEL, "-p", "c2", "models/digits/samples/digit-0-9.jpg", "missing.jpg"], "input file 'missing.jpg' does not exist"),
    (["eval", MODEL, "-p", "c2", "--dataset", "nowhere/"], "dataset 'nowhere/' does not exist"),
    (["cloud", "curve", MODEL, "-p", "c2", "--dataset", "nowhere.npz"], "dataset 'nowhere.npz' does not exist"),
])
def test_a_missing_input_is_told_before_the_engine_is_built(tmp_path, args, fragment):
    """c2 is INT8: from an empty cache its build calibrates and checks (a line on stderr, minutes on a large model);
    a mistyped input path is the one line, and nothing was built into the cache."""
    cache = tmp_path / "cache"
    proc = k2edge(*args, "--cache", str(cache), check=False)
    assert_one_line_error(proc, fragment)
    assert not cache.exists() or not any(cache.rglob("*.onnx")), sorted(cache.rglob("*"))


def test_wrong_tensor_shape_is_one_line(tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros((3, 28, 28), np.float32))
    assert_one_line_error(k2edge("infer", MODEL, "-p", "cpu-dev", str(tmp_path / "bad.npy"), check=False),
                          "fits neither a sample (1, 32, 32) nor a batch (1, 1, 32, 32)")
    np.save(tmp_path / "nan.npy", np.full((1, 32, 32), np.nan, np.float32))
    assert_one_line_error(k2edge("infer", MODEL, "-p", "cpu-dev", str(tmp_path / "nan.npy"), check=False),
                          "the array holds NaN or infinite values")


def test_a_card_that_does_not_fit_the_model_is_one_line(tmp_path):
    """Labels that are fewer than the classifier's classes, an empty labels file, labels that name a directory, and a
    classification card on a detector (output [1, 4 + C, anchors]): refused, not answered with made-up classes, by
    infer and by card show."""
    sample = str(ROOT / "models" / "digits" / "samples" / "digit-0-9.jpg")
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "folder").mkdir()
    cases = [("three.txt", MODEL, "labels: 3 label(s) for a classifier of 10 class(es) (output 'logits' [1, 10])"),
             ("empty.txt", MODEL, "is empty: one label a line"),
             ("folder", MODEL, "labels: file '" + str(tmp_path / "folder") + "' is a directory"),
             (None, str(ROOT / "models" / "detector" / "model.onnx"), "task classification reads one score per class")]
    for labels, model, fragment in cases:
        card = tmp_path / "card.toml"
        card.write_text('task = "classification"\n' + (f'labels = "{labels}"\n' if labels else ""))
        assert_one_line_error(k2edge("infer", model, "-p", "cpu-dev", "--card", str(card), sample, check=False), fragment)
        # card show, which card init sends the user to, refuses what infer refuses
        assert_one_line_error(k2edge("card", "show", model, "--card", str(card), check=False), fragment)


def test_pipes_and_devices_are_read_without_waiting_or_reading_them_whole(tmp_path):
    """A named pipe no one writes to used to wait in open() forever, and /dev/zero was read until memory ran out:
    now the pipe reads as empty (one line about what is missing), a pipe with a writer is read (the shell's
    `--config <(envsubst < k2edge.toml.in)`), and a device is read only up to the file's limit."""
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert_one_line_error(k2edge("serve", "--config", str(fifo), check=False), "pipe: models: required")
    assert_one_line_error(k2edge("plan", MODEL, "-p", str(fifo), check=False), "not valid JSON")
    assert_one_line_error(k2edge("infer", MODEL, "-p", "cpu-dev", "--card", "/dev/zero", "models/digits/samples/digit-0-9.jpg",
                                 check=False), "/dev/zero: cannot read (larger than 4 MiB)")

    def write_profile():
        with open(fifo, "w") as f:
            f.write((ROOT / "profiles" / "c4.json").read_text())

    writer = threading.Thread(target=write_profile)
    writer.start()
    try:
        proc = k2edge("plan", MODEL, "-p", str(fifo), check=False)
    finally:
        writer.join(timeout=60)
    assert proc.returncode == 0 and "layer-wise" in proc.stdout, proc.stderr
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (4 * 1024 * 1024 + 1))
    assert_one_line_error(k2edge("serve", "--config", str(big), check=False), "larger than 4 MiB")


def test_files_that_are_not_what_they_claim_are_one_line(tmp_path):
    """A profile or labels file that is not UTF-8 text, a model folder whose .onnx is not a model, and a bundle
    without a manifest: each refused in one line, before anything is built or sent."""
    (tmp_path / "p.json").write_bytes(b"\x94\xff{not text")
    assert_one_line_error(k2edge("plan", MODEL, "-p", str(tmp_path / "p.json"), check=False), "not UTF-8 text")
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "model.onnx").write_bytes(Path(MODEL).read_bytes())
    (tmp_path / "lab" / "card.toml").write_text((ROOT / "models" / "digits" / "card.toml").read_text())
    (tmp_path / "lab" / "labels.txt").write_bytes(b"\xff\xfe\x00zero")
    assert_one_line_error(k2edge("infer", str(tmp_path / "lab" / "model.onnx"), "-p", "cpu-dev",
                                 "models/digits/samples/digit-0-9.jpg", check=False), "labels.txt' is not UTF-8 text")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.onnx").write_bytes(Path(MODEL).read_bytes()[:100])
    assert_one_line_error(k2edge("bundle", "create", str(tmp_path / "m"), "--out", str(tmp_path / "m.k2b"), check=False),
                          "not an ONNX model")
    assert not (tmp_path / "m.k2b").exists()
    import tarfile

    with tarfile.open(tmp_path / "x.k2b", "w") as tar:
        tar.add(MODEL, arcname="model.onnx")
    assert_one_line_error(k2edge("deploy", str(tmp_path / "x.k2b"), "--broker", "127.0.0.1:1", "--device", "d", check=False),
                          "is not a k2edge bundle: no manifest.json")
    with np.load(ROOT / "models" / "digits" / "eval.npz") as data:
        np.savez(tmp_path / "y.npz", x=data["x"][:4], y=np.array([0, 1, 99, -1]))
    assert_one_line_error(k2edge("eval", MODEL, "-p", "cpu-dev", "--dataset", str(tmp_path / "y.npz"), check=False),
                          "'y' holds labels -1..99, but the model has 10 classes (0..9)")


def test_bad_profile_file_is_one_line(tmp_path):
    p = tmp_path / "p.json"
    p.write_text('{"edge_runtime": {"offload_ratio": 0.5, "partition": "layer-wise"}}')
    assert_one_line_error(k2edge("plan", MODEL, "-p", str(p), check=False), "edge_runtime.partition: unknown key")


def test_infer_with_a_batched_profile_saves_only_real_rows(tmp_path):
    """With batch_size 3, two inputs give two rows (padding never leaks out), and a lone sample .npy fits."""
    prof = tmp_path / "b3.json"
    prof.write_text('{"edge_runtime": {"offload_ratio": 1.0, "precision_fallback": ["fp32"], "batch_size": 3}}')
    samples = sorted((ROOT / "models/digits/samples").glob("*.jpg"))[:2]
    np.save(tmp_path / "one.npy", np.zeros((1, 1, 32, 32), np.float32))
    out = tmp_path / "o.npy"
    k2edge("infer", MODEL, "-p", str(prof), *map(str, samples), str(tmp_path / "one.npy"), "--save-output", str(out))
    assert np.load(out).shape == (3, 10)


def test_request_refuses_an_npy_file_of_pickled_objects(tmp_path):
    """``k2edge request`` sends a .npy as a tensor: one of pickled Python objects is refused, not loaded."""
    from k2edge.cli.client import build_payload
    from k2edge.errors import InputError

    np.save(tmp_path / "objects.npy", np.array([{"not": "a tensor"}], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match=r"not a numeric .npy array .it holds Python objects \(pickled\)"):
        build_payload(str(tmp_path / "objects.npy"))
    np.save(tmp_path / "ok.npy", np.zeros((1, 32, 32), np.float32))
    assert json.loads(build_payload(str(tmp_path / "ok.npy"))[0])["tensor"]["shape"] == [1, 32, 32]


def test_a_file_that_is_not_numpys_is_called_that_not_a_pickle(tmp_path):
    """NumPy takes any file that is neither .npy nor .npz for a pickle; infer, eval and request say what it is not,
    and an archive where an array goes (or the other way round) is named as such."""
    from k2edge.cli.client import build_payload
    from k2edge.errors import InputError

    noise = np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes()
    noise = b"\x00" + noise[1:]  # neither NumPy's magic nor a zip's
    (tmp_path / "noise.npy").write_bytes(noise)
    (tmp_path / "noise.npz").write_bytes(noise)
    assert_one_line_error(k2edge("infer", MODEL, "-p", "cpu-dev", str(tmp_path / "noise.npy"), check=False),
                          "not a NumPy file: neither a .npy array")
    assert_one_line_error(k2edge("eval", MODEL, "-p", "cpu-dev", "--data", str(tmp_path / "noise.npz"), check=False),
                          "cannot read .npz (not a NumPy file")
    with pytest.raises(InputError, match="not a NumPy file"):
        build_payload(str(tmp_path / "noise.npy"))
    (tmp_path / "torn.npz").write_bytes(b"PK\x03\x04" + noise)  # a zip's magic, then nothing of a zip
    assert_one_line_error(k2edge("eval", MODEL, "-p", "cpu-dev", "--data", str(tmp_path / "torn.npz"), check=False),
                          "a damaged .npz archive")
    np.savez(tmp_path / "archive.npz", x=np.zeros((1, 1, 32, 32), np.float32))
    (tmp_path / "archive.npy").write_bytes((tmp_path / "archive.npz").read_bytes())
    assert_one_line_error(k2edge("infer", MODEL, "-p", "cpu-dev", str(tmp_path / "archive.npy"), check=False),
                          "an .npz archive, not a .npy array")
    with pytest.raises(InputError, match="is an .npz archive, not a .npy array"):
        build_payload(str(tmp_path / "archive.npy"))


def test_watch_refuses_an_annotated_output_that_is_not_a_video(tmp_path):
    av = pytest.importorskip("av")
    with av.open(str(tmp_path / "v.mp4"), "w") as c:
        s = c.add_stream("libx264", rate=5)
        s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
        for i in range(3):
            c.mux(s.encode(av.VideoFrame.from_ndarray(np.full((64, 64, 3), 40 * i, np.uint8), format="rgb24")))
        c.mux(s.encode())
    proc = k2edge("watch", str(ROOT / "models" / "detector" / "model.onnx"), str(tmp_path / "v.mp4"), "-p", "cpu-dev",
                  "--save-annotated", str(tmp_path / "out.txt"), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
    assert "--save-annotated" in line and "give a video file such as out.mp4" in line, line


def test_serve_with_a_model_that_is_no_model_says_that_alone(tmp_path):
    """A model file that is not ONNX: its own error, with no warning before it about the batch axis (the per-batch
    fallback is what fails, and only a fallback that works is worth a warning)."""
    (tmp_path / "m.onnx").write_bytes(b"junk")
    (tmp_path / "state").mkdir()
    cfg = tmp_path / "k2edge.toml"
    cfg.write_text(f'[mqtt]\nport = 1\n[service]\nstate_dir = "{tmp_path / "state"}"\n'
                   f'[[models]]\nname = "digits"\nonnx = "{tmp_path / "m.onnx"}"\nprofile = "cpu-dev"\n')
    proc = k2edge("serve", "--config", str(cfg), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("k2edge serve: error: ") and "not an ONNX model" in proc.stderr
    assert "one engine for every batch size" not in proc.stderr, proc.stderr


def test_serve_refuses_a_state_dir_it_cannot_use(tmp_path):
    """Before any broker or engine: a file where the state folder should be, or a folder that cannot be made."""
    (tmp_path / "a-file").write_text("")
    for state, fragment in ((tmp_path / "a-file", "is a file, not a directory"),
                            (tmp_path / "a-file" / "below", "cannot be created: Not a directory")):
        cfg = tmp_path / "k2edge.toml"
        cfg.write_text(f'[mqtt]\nport = 1\n[service]\nstate_dir = "{state}"\n'
                       f'[[models]]\nname = "digits"\nonnx = "{MODEL}"\nprofile = "cpu-dev"\n')
        proc = k2edge("serve", "--config", str(cfg), check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == f"k2edge serve: error: service.state_dir '{state}' {fragment}", proc.stderr


def test_debug_shows_the_traceback_before_or_after_the_command():
    missing = ["infer", "models/digits/nothere.onnx", "-p", "c2", "x.jpg"]
    assert_one_line_error(k2edge(*missing, check=False), "model file 'models/digits/nothere.onnx' does not exist")
    nested = ["card", "show", "models/digits/nothere.onnx"]  # a command's own subcommand takes them too
    for args in (["--debug", *missing], [*missing, "--debug"], [*nested, "--debug"], ["card", "--debug", *nested[1:]]):
        proc = k2edge(*args, check=False)
        assert proc.returncode == 1 and "Traceback" in proc.stderr and "ModelError" in proc.stderr, (args, proc.stderr)


def test_request_sends_what_it_is_given_for_the_daemon_to_judge(run_daemon, broker, tmp_path):
    """0 is a value (the daemon refuses it, naming the field), not "leave it out"; a timeout names where it asked."""
    run_daemon()
    np.save(tmp_path / "x.npy", np.zeros((1, 32, 32), np.float32))
    base = ["request", "--broker", f"127.0.0.1:{broker.port}", "--model", "digits", str(tmp_path / "x.npy")]
    for flag, field in (("--top-k", "top_k"), ("--deadline-ms", "deadline_ms")):
        proc = k2edge(*base, "--device", "t1", flag, "0", check=False)
        assert proc.returncode == 1 and "the daemon answered error bad_request" in proc.stderr, proc.stderr
        assert field in proc.stderr, proc.stderr
    assert k2edge(*base, "--device", "t1", "--top-k", "2", "--json").returncode == 0
    proc = k2edge(*base, "--device", "nobody", "--timeout", "1", check=False)
    assert_one_line_error(proc, "no answer to k2edge/nobody/infer/digits within 1 s")
    assert_one_line_error(k2edge(*base, "--raw", check=False), "--raw sends a JPEG or PNG as it is")


def test_a_data_set_for_int8_on_a_profile_without_int8_is_noted():
    """--calib / --check with a profile that runs nothing in INT8: a note says they did nothing (they were ignored
    silently)."""
    proc = k2edge("build", MODEL, "-p", "c5", "--calib", "models/digits/calib", "--check", "models/digits/eval.npz")
    assert "note: --calib and --check given, but profile c5 runs no layer in INT8: nothing was calibrated or checked" \
        in proc.stderr, proc.stderr
    assert "note:" not in k2edge("build", MODEL, "-p", "c5").stderr


def test_request_waits_and_deadlines():
    """Without --deadline-ms the wait less a margin is the deadline, never over the contract's hour; a deadline alone
    waits 2 s longer; a wait shorter than the deadline given is refused."""
    from k2edge.cli.request_cmd import wait_and_deadline
    from k2edge.errors import K2EdgeError
    from k2edge.service.protocol import MAX_DEADLINE_MS

    assert wait_and_deadline(None, None) == (10.0, 9500.0)
    assert wait_and_deadline(1.0, None) == (1.0, 900.0)
    assert wait_and_deadline(4000.0, None) == (4000.0, MAX_DEADLINE_MS)
    assert wait_and_deadline(None, 30_000) == (32.0, 30_000) and wait_and_deadline(None, 500) == (10.0, 500)
    with pytest.raises(K2EdgeError, match="--timeout 2 s is shorter than --deadline-ms 5000"):
        wait_and_deadline(2.0, 5000)
