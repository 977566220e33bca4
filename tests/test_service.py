"""Pure parts of the daemon: request parsing, topics, ack ordering, backoff, health, config."""

import base64
import json
import os
import threading
import time

import numpy as np
import pytest

from k2edge.config import load_config
from k2edge.config.schema import ConfigError, read_secret
from k2edge.service import topics
from k2edge.service.protocol import RequestError, parse_request
from k2edge.service.runtime import batch_sizes
from k2edge.backoff import backoff
from k2edge.service.transport import AckSequencer


def _parse(obj, ctype=None, props=None):
    payload = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return parse_request(payload, "m", ctype, props or {}, received=100.0)


def test_parse_json_image_and_tensor():
    r = _parse({"id": "a", "image": base64.b64encode(b"\xff\xd8jpeg").decode(), "top_k": 3, "deadline_ms": 250,
                "prompt": "what is it?", "allow_cloud": False, "deferrable": True, "attempt": 2})
    assert (r.id, r.image, r.top_k, r.deadline.at, r.prompt, r.allow_cloud, r.deferrable, r.attempt) == (
        "a", b"\xff\xd8jpeg", 3, 100.25, "what is it?", False, True, 2)
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = _parse({"tensor": {"dtype": "float32", "shape": [2, 3], "data": base64.b64encode(arr.tobytes()).decode()}})
    np.testing.assert_array_equal(t.tensor, arr)
    assert t.id is None


def test_parse_raw_image_with_user_properties():
    r = _parse(b"\x89PNG...", "image/png", {"id": "p1", "top_k": "2", "deadline_ms": "50", "allow_cloud": "false"})
    assert (r.id, r.image, r.top_k, r.deadline_ms, r.allow_cloud) == ("p1", b"\x89PNG...", 2, 50.0, False)
    with pytest.raises(RequestError, match="user property top_k must be a number"):
        _parse(b"x", "image/png", {"top_k": "lots"})
    assert _parse(b"x", "image/png", {"id": "p2", "attempt": "3"}).attempt == 3
    with pytest.raises(RequestError, match=r"unknown user properties \['colour'\]"):
        _parse(b"x", "image/jpeg", {"colour": "red"})


@pytest.mark.parametrize("bad, fragment", [
    ({"id": 5, "image": "AA=="}, "id: expected a string"),
    ({"id": "a/b", "image": "AA=="}, "cannot be a topic level"),
    ({"id": "a#", "image": "AA=="}, "cannot be a topic level"),
    ({"image": "AA==", "allow_cloud": "yes"}, "allow_cloud: expected true or false"),
    ({"tensor": {"dtype": "complex64", "shape": [1], "data": ""}}, "tensor.dtype"),
    ({"tensor": {"dtype": "float32", "shape": [0], "data": ""}}, "tensor.shape[0]: expected an integer >= 1"),
    ({"tensor": {"dtype": "float32", "shape": [1]}}, "tensor: missing field 'data'"),
])
def test_parse_errors_are_bad_request(bad, fragment):
    with pytest.raises(RequestError) as err:
        _parse(bad)
    assert err.value.code == "bad_request" and fragment in err.value.message


def test_topics():
    assert topics.model_of("k2edge/dev/infer/digits") == "digits"
    assert topics.model_of("k2edge/pool/infer/digits") == "digits"
    assert topics.model_of("k2edge/dev/status") is None
    assert topics.shared_filter("g") == "$share/g/k2edge/pool/infer/+"
    assert not topics.valid_level("") and not topics.valid_level("a+b") and topics.valid_level("req-1.x:y")


def test_acks_go_out_in_arrival_order_and_never_across_reconnects():
    sent = []
    seq = AckSequencer(sent.append)
    t1, t2, t3 = seq.received(1), seq.received(2), seq.received(3)
    seq.done(t2)
    assert sent == []  # 1 is not done: 2 must wait
    seq.done(t1)
    assert sent == [1, 2]
    seq.new_connection()
    seq.done(t3)  # packet id 3 belongs to the old connection: the broker redelivers it instead
    assert sent == [1, 2]


def test_backoff_is_jittered_and_capped():
    delays = [backoff(a, 0.5, 30.0) for a in range(12) for _ in range(50)]
    assert min(delays) >= 0.5 and max(delays) <= 30.0
    assert len({round(d, 3) for d in delays}) > 100
    assert backoff(20, 0.5, 30.0, rng=lambda: 1.0) == 30.0


def test_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(6) == [1, 2, 4, 6]


def _until(predicate, timeout=20.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


def test_a_runtime_is_activated_once_and_its_profile_views_share_the_activation(demo_model):
    """activate/deactivate out of order raise; the context manager pairs them; the warm view is the same version."""
    from k2edge.config.schema import ModelConfig
    from k2edge.service.runtime import ModelRuntime, RuntimeStateError

    rt = ModelRuntime(ModelConfig(name="m", onnx=demo_model, escalation={"warm_profile": "c2"}), 2, None, None, version="1.0.0")
    with pytest.raises(RuntimeStateError, match="not active"):
        rt.deactivate()
    with rt:
        with pytest.raises(RuntimeStateError, match="already active"):
            rt.activate()
        warm = rt.with_profile(True)
        assert warm is not rt and warm.shares_engines(rt) and warm.version == "1.0.0" and warm.profile_name == "c2"
        assert rt.with_profile(False) is rt and warm.with_profile(True) is warm and warm.active
        assert len(warm.infer([np.zeros(rt.sample_shape, dtype=rt.input_dtype)])) >= 1
    assert not rt.active and not warm.active
    with pytest.raises(RuntimeStateError):
        warm.deactivate()


def test_a_wedged_line_fails_the_health_check(demo_model, tmp_path, monkeypatch):
    """WATCHDOG=1 is only sent while every serving thread loops: a wedged batcher stops it, a free one resumes it."""
    from k2edge.config.schema import DaemonConfig, ModelConfig
    from k2edge.service.answer_book import AnswerBook
    from k2edge.service.batcher import Batcher
    from k2edge.service.escalation import Escalation
    from k2edge.service.metrics import AnswerStats
    from k2edge.service.replies import Replies
    from k2edge.service.request_path import Backlog, RequestPath, RequestQueue
    from k2edge.service.runtime import ModelRuntime
    from k2edge.telemetry import thermal_sampler

    cfg = DaemonConfig(models=(ModelConfig(name="m", onnx=demo_model),), service={"state_dir": tmp_path})
    rt = ModelRuntime(cfg.models[0], 1, None, None)
    rt.activate()
    release, entered = threading.Event(), threading.Event()
    real_stage = rt.stage

    def hung_decoder(*args):  # a decoder that hangs, as a corrupt image could make it
        entered.set()
        release.wait(30)
        return real_stage(*args)

    monkeypatch.setattr(rt, "stage", hung_decoder)
    published = []

    class Broker:  # the broker facade: acknowledges every publish at once
        def publish(self, topic, payload, correlation=None, on_delivered=None, user=()):
            published.append(payload)
            on_delivered()

        def done(self, token): ...
        def wake(self): ...
        def input_pending(self): return True
        def read_allowance(self): return 1

    book = AnswerBook(tmp_path, Broker(), 60)
    thermal = thermal_sampler(cfg.thermal)
    replies = Replies(cfg, book, AnswerStats(), thermal)
    backlog = Backlog(8, 80, Broker())
    cond = threading.Condition()
    queue = RequestQueue(cond, backlog, replies, Escalation(cfg, thermal, replies, book), None,
                         cfg.service.max_image_pixels)
    batcher = Batcher("m", rt, thermal, [queue], cond, 0.0)
    path = RequestPath(cfg, {"m": queue}, {"m": batcher}, book, replies, backlog, Broker(), threading.Event())
    batcher.start()
    _until(lambda: batcher.alive(max_age=1.0))

    class Msg:
        topic, payload, qos, mid, properties = "k2edge/x/infer/m", json.dumps({"id": "w", "tensor": {
            "dtype": "float32", "shape": [1, 32, 32], "data": base64.b64encode(bytes(4096)).decode()}}).encode(), 1, 1, None

    path.on_message(Msg, token=None)
    assert entered.wait(10)
    _until(lambda: not batcher.alive(max_age=1.0))
    release.set()
    _until(lambda: batcher.alive(max_age=1.0))
    _until(lambda: published)
    assert json.loads(published[0])["status"] == "ok"
    batcher.stop()
    rt.deactivate()


def _write(tmp_path, text):
    p = tmp_path / "k.toml"
    p.write_text(text)
    return p


def test_config_example_loads_and_resolves_paths():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / "config" / "k2edge.toml")
    assert cfg.device_id == "demo" and cfg.prefix == "k2edge/demo" and cfg.client_id == "k2edge-demo"
    assert cfg.models[0].onnx.is_file() and cfg.models[0].calib.is_dir()


@pytest.mark.parametrize("text, fragment", [
    ("models = []", "models: Value error, at least one"),
    ('[[models]]\nname = "a"\nonnx = "m.onnx"\nturbo = true', "models.0.turbo: unknown key"),
    ('[[models]]\nname = "a/b"\nonnx = "m.onnx"', "model name must be letters"),
    ('[mqtt]\nport = 0\n[[models]]\nname = "a"\nonnx = "m"', "mqtt.port: must be >= 1"),
    ('[mqtt]\npassword_file = "p"\n[[models]]\nname = "a"\nonnx = "m"', "a password needs a username"),
    ('[mqtt]\npassword = "hunter2"\n[[models]]\nname = "a"\nonnx = "m"', "mqtt.password: unknown key"),
    ("device_id = 'x'\n[service\n", "not valid TOML"),
    ('[mqtt]\nhost = ""\n[[models]]\nname = "a"\nonnx = "m"', "mqtt.host: is empty"),
    ('[mqtt]\nhost = "mqtt://u:hunter2@broker"\n[[models]]\nname = "a"\nonnx = "m"',
     "mqtt.host: must be a host name or address, not a URL or user:password@host (the user goes in mqtt.username"),
    ('[mqtt]\nhost = "broker one"\n[[models]]\nname = "a"\nonnx = "m"', "mqtt.host: holds spaces"),
    # TOML's true, inf and nan are not numbers a setting can take (true was a max_batch of 1)
    ('[service]\nmax_batch = true\n[[models]]\nname = "a"\nonnx = "m"', "service.max_batch: must be a number, not true"),
    ('[service]\nmax_batch = "8"\n[[models]]\nname = "a"\nonnx = "m"', "service.max_batch: must be a number, not the string '8'"),
    ('[[models]]\nname = "a"\nonnx = "m"\n[[streams]]\nname = "s"\nsource = "file:///x.mp4"\nmodel = "a"\nfps = "5"',
     "streams.0.fps: must be a number, not the string '5'"),
    ('[service]\ntelemetry_interval_s = inf\n[[models]]\nname = "a"\nonnx = "m"', "service.telemetry_interval_s: input should be a finite number"),
    ('[cloud]\ntimeout_s = nan\n[[models]]\nname = "a"\nonnx = "m"', "cloud.timeout_s: input should be a finite number"),
    ('[thermal]\nsoft_c = false\n[[models]]\nname = "a"\nonnx = "m"', "thermal.soft_c: must be a number, not false"),
    # where the file was read from is recorded by k2edge, never a key of the file
    ('source = "elsewhere.toml"\n[[models]]\nname = "a"\nonnx = "m"', "source: unknown key"),
    ('board = "foo"\n[[models]]\nname = "a"\nonnx = "m"', "board: must be one of 'orin-agx', 'orin-nx-16', "),
    # streams: each refusal names its key, none is "(top level)"
    ('[[models]]\nname = "a"\nonnx = "m"\n[[streams]]\nname = "s"\nsource = "file:///x.mp4"\nmodel = "nosuch"',
     "streams.0.model: 'nosuch' is not a model served here (stream 's'); served: ['a']"),
    ('[[models]]\nname = "a"\nonnx = "m"\n[[streams]]\nname = "s"\nsource = "file:///x.mp4"\nmodel = "a"\n[[streams]]\nname = "s"\nsource = "file:///y.mp4"\nmodel = "a"',
     "k.toml: streams: stream names must be unique, repeated: ['s']"),
    ('[[models]]\nname = "a"\nonnx = "m"\n[[streams]]\nname = "s"\nsource = "gst:videotestsrc ! appsink name=sink"\nmodel = "a"\nbackend = "pyav"',
     "streams.0: source 'gst:videotestsrc ! appsink name=sink': gst sources are read by GStreamer (backend = \"gstreamer\")"),
    ('[[models]]\nname = "a"\nonnx = "m"\n[[streams]]\nname = "s"\nsource = "csi://0"\nmodel = "a"\nbackend = "pyav"', "streams.0: source 'csi://0': csi sources"),
    ('[[models]]\nname = "a"\nonnx = "m"\n[[streams]]\nname = "s"\nsource = "file://clip.mp4"\nmodel = "a"',
     "streams.0.source: source 'file://clip.mp4': file:// takes an absolute path, file:///absolute/path.mp4"),
    ('[[models]]\nname = "a"\nonnx = "m"\n[[streams]]\nname = "s"\nsource = "file:///x.mp4"\nmodel = "a"\n[[streams.zones]]\nname = "z"\npoints = [[0, 0], [10, 0], [10, 0], [0, 10]]',
     "zone 'z' repeats the point [10.0, 0.0] (an edge of no length)"),
    # the known keys of a table that may be left out, and of a repeated one's items
    ('[tracing]\nsampler = 1\n[[models]]\nname = "a"\nonnx = "m"', "tracing.sampler: unknown key (known keys: endpoint, "),
    ('[[models]]\nname = "a"\nonnx = "m"\nturbo = 1', "models.0.turbo: unknown key (known keys: name, onnx, bundle, "),
    # a table written as an array of tables, or as a value, and the other way round (these were tracebacks)
    ('[[mqtt]]\nhost = "x"\n[[models]]\nname = "a"\nonnx = "m"', "mqtt: must be one table, got an array of tables (in TOML: [mqtt], not [[mqtt]])"),
    ('mqtt = "localhost"\n[[models]]\nname = "a"\nonnx = "m"', "mqtt: must be a table of keys (in TOML: a [mqtt] section), got 'localhost'"),
    ('http = 8080\n[[models]]\nname = "a"\nonnx = "m"', "http: must be a table of keys (in TOML: a [http] section), got 8080"),
    ('[[service]]\nmax_batch = 2\n[[models]]\nname = "a"\nonnx = "m"', "service: must be one table, got an array of tables"),
    ('[models]\nname = "a"\nonnx = "m"', "models: must be an array of tables, got one table (in TOML: [[models]], not [models])"),
    ('[[models]]\nname = "a"\nonnx = "m"\n[[models.escalation]]\nthreshold = 0.5',
     "models.0.escalation: must be one table, got an array of tables (in TOML: [models.escalation], not [[models.escalation]])"),
    ('models = [1]', "models.0: must be a table of keys (in TOML: a [[models]] entry), got 1"),
    ('[mqtt]\ntopic_prefix = "site/+"\n[[models]]\nname = "a"\nonnx = "m"', "mqtt.topic_prefix: must be topic levels of at most"),
])
def test_config_errors_name_the_key(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, text))
    assert fragment.replace("Value error, ", "") in str(err.value) and "hunter2" not in str(err.value)


@pytest.mark.parametrize("text, fragment", [
    ('[[models]]\nname = "a"\nonnx = "m"\nprofile = "c99"', "models.0.profile: profile 'c99' not found"),
    ('[[models]]\nname = "a"\nonnx = "m"\nprofile = "c2"\n[models.escalation]\nwarm_profile = "c99"',
     "models.0.escalation.warm_profile: profile 'c99' not found"),
    ('[[models]]\nname = "a"\nonnx = "m"\nprofile = "bad.json"', "models.0.profile: profile file"),
    ('[[models]]\nname = "a"\nonnx = "m"\nprofile = "c2"\ncalib = "nope"', "models.0.calib: "),
    ('[[models]]\nname = "a"\nonnx = "m"\nprofile = "c2"\ncheck = "nope.npz"', "models.0.check: "),
    ('[[models]]\nname = "a"\nonnx = "m"\n[[models]]\nname = "b"\nonnx = "modle.onnx"', "models.0.onnx: "),
])
def test_the_daemon_checks_every_profile_before_it_starts_anything(tmp_path, text, fragment):
    """check_profiles (the daemon's first step) names the key; reading the config alone does not need the profiles
    (watch --config and bundle verify --config read other keys, on a machine without the device's profiles)."""
    from k2edge.config.schema import check_profiles

    cfg = load_config(_write(tmp_path, text))
    with pytest.raises(ConfigError) as err:
        check_profiles(cfg)
    assert str(err.value).startswith(str(tmp_path / "k.toml")) and fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("broker, fragment", [
    ("mqtt://u:hunter2@127.0.0.1:1883", "--broker (not repeated: it may hold a password): the host must be a host name"),
    ("u:hunter2@127.0.0.1", "--broker (not repeated: it may hold a password): expected HOST[:PORT]"),
    ("127.0.0.1:x", "--broker '127.0.0.1:x': expected HOST[:PORT] with a port in 1..65535"),
    ("", "--broker is empty: give HOST[:PORT]"),
])
def test_a_broker_option_that_holds_a_password_is_refused_without_repeating_it(broker, fragment):
    """--broker, as serve, request, deploy and rollback read it: a URL or user:password@ is refused, unrepeated."""
    from k2edge.cli.control import broker_address
    from k2edge.errors import K2EdgeError

    with pytest.raises(K2EdgeError) as err:
        broker_address(broker)
    assert fragment in str(err.value) and "hunter2" not in str(err.value)
    assert broker_address("broker.local") == ("broker.local", 1883) and broker_address(":1884", "h") == ("h", 1884)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_secrets_from_file_and_credential(tmp_path, monkeypatch):
    (tmp_path / "pw").write_text("hunter2\n")
    assert read_secret(tmp_path / "pw") == "hunter2"
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert read_secret(credential="pw") == "hunter2"
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(ConfigError, match="CREDENTIALS_DIRECTORY is not set") as err:
        read_secret(credential="pw")
    assert "hunter2" not in str(err.value)
    (tmp_path / "latin").write_bytes("hünter2".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        read_secret(tmp_path / "latin", what="mqtt password")
    os.mkfifo(tmp_path / "pipe")  # no writer: read as empty at once, not waited on -- and an empty secret is refused
    with pytest.raises(ConfigError, match=r"mqtt password: .*pipe' is empty; put the secret in it"):
        read_secret(tmp_path / "pipe", what="mqtt password")
    for blank in ("", "\n", "  \n"):  # an empty token would let an empty Authorization header in
        (tmp_path / "token").write_text(blank)
        with pytest.raises(ConfigError, match="http.token_file: .* is empty"):
            read_secret(tmp_path / "token", what="http.token_file")
    with pytest.raises(ConfigError, match=r"mqtt password: cannot read .*a directory, not a file"):
        read_secret(tmp_path, what="mqtt password")


def test_the_drain_order_is_data_naming_the_daemons_steps():
    """Each drain step is a method of the daemon; requests are answered before answers are awaited and engines released last."""
    from k2edge.service.daemon import Daemon

    steps = list(Daemon.DRAIN)
    assert all(callable(getattr(Daemon, s, None)) for s in steps) and len(set(steps)) == len(steps)
    assert steps.index("_stop_admitting") < steps.index("_finish_requests") < steps.index("_wait_answers_delivered") \
        < steps.index("_say_offline") < steps.index("_disconnect")
    assert steps[-1] == "_deactivate_engines"


def test_a_request_is_told_from_an_acknowledgement_in_the_bytes_waiting():
    """input_pending's peek: PUBACKs alone are no reason to hand a lone request to its line; a PUBLISH is."""
    from k2edge.service.transport import publish_ahead

    puback, publish = bytes([0x40, 2, 0, 1]), bytes([0x32, 5, 0, 1, ord("t"), 0, 7])
    assert not publish_ahead(b"", False) and not publish_ahead(puback * 3, False)
    assert publish_ahead(publish, False) and publish_ahead(puback + publish, False)
    assert publish_ahead(puback + bytes([0x40]), True)  # cut off: more may wait, count it as a request
    assert not publish_ahead(bytes([0x40, 200, 1]), False) and publish_ahead(bytes([0x40, 200, 1]), True)


@pytest.mark.parametrize("content_type, correlation, user", [
    ("application/json", None, ()), ("application/json", b"\x00" * 16, ()), ("image/jpeg", b"c" * 300, ()),
    ("text/plain; charset=é", b"", ()), ("image/jpeg", None, (("event_id", "ab" * 16),)),
    ("image/jpeg", b"x", (("event_id", "0" * 32), ("stream", "gaté")))])
def test_publish_properties_pack_as_paho_packs_them(content_type, correlation, user):
    """The answers' properties, packed once by hand, are byte for byte what paho's Properties packs, and read the same."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from k2edge.service.transport import PublishProperties

    ref = Properties(PacketTypes.PUBLISH)
    ref.ContentType = content_type
    if correlation is not None:
        ref.CorrelationData = correlation
    if user:
        ref.UserProperty = list(user)
    ours = PublishProperties.make(content_type, correlation, user)
    assert isinstance(ours, Properties)
    assert ours.pack() == ref.pack()
    assert str(ours) == str(ref) and ours.json() == ref.json()
    unpacked = Properties(PacketTypes.PUBLISH)
    unpacked.unpack(ours.pack())
    assert unpacked.ContentType == content_type and getattr(unpacked, "CorrelationData", None) == correlation
    assert getattr(unpacked, "UserProperty", []) == list(user)
