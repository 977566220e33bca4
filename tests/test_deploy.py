"""The pure pieces of over-the-air deployment: config entries, control messages, topics, answers as the
CLI prints them, a version's build config, and fetching over HTTPS (a real local server)."""

from __future__ import annotations

import hashlib
import io
import ssl
import subprocess
import tarfile
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from k2edge.config import load_config
from k2edge.config.schema import ConfigError
from k2edge.service import topics
from k2edge.service.deploy import version_config
from k2edge.service.deploy_protocol import (ControlError, answer_body, message_digest, parse_deploy,
                                            parse_rollback)


def _cfg(tmp_path, text):
    p = tmp_path / "k.toml"
    p.write_text(text)
    return load_config(p)


@pytest.mark.parametrize("text, fragment", [
    ('[[models]]\nname = "a"\n', "models.0: give exactly one of onnx (a model file) or bundle"),
    ('[[models]]\nname = "a"\nonnx = "m.onnx"\nbundle = "a.k2b"\n', "give exactly one of onnx"),
    ('[[models]]\nname = "a"\nbundle = "a.k2b"\n', "models: model 'a' names a bundle, which is loaded only with a [trust]"),
    ('[trust]\nallow_unsigned = true\n[[models]]\nname = "a"\nbundle = "a.k2b"\nlabels = "l.txt"\n',
     "models.0: labels: a bundle brings its own"),
    ('[trust]\nallow_unsigned = true\n[[models]]\nname = "a"\nbundle = "a.k2b"\ncard = "c.toml"\n',
     "models.0: card (a file): a bundle brings its own"),
])
def test_a_model_entry_names_one_source(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, text)
    assert fragment in str(err.value)


def test_bundle_entries_resolve_and_remember_whether_the_profile_was_set(tmp_path):
    cfg = _cfg(tmp_path, '[trust]\nallow_unsigned = true\n[[models]]\nname = "a"\nbundle = "b/a.k2b"\n'
                         '[[models]]\nname = "b"\nbundle = "/opt/k2edge/bundles/b.k2b"\nprofile = "c3"\n'
                         '[models.card]\ninput = {scale = 0.5}\n')
    a, b = cfg.models
    assert a.bundle == tmp_path / "b" / "a.k2b" and a.onnx is None and not a.profile_set
    assert b.profile_set and b.profile == "c3" and b.card.input.scale == 0.5


def _paths(root: Path, card: str | None = "card.toml", profiles=("profiles/c2.json",)) -> dict:
    return {"dir": root, "model": root / "model.onnx", "card": root / card if card else None, "labels": root / "labels.txt",
            "calib": root / "calib.npz", "profiles": [root / p for p in profiles]}


def test_a_versions_build_config_takes_the_bundles_files_and_keeps_the_configs_choices(tmp_path):
    cfg = _cfg(tmp_path, '[trust]\nallow_unsigned = true\n[[models]]\nname = "a"\nbundle = "a.k2b"\ntop_k = 2\n'
                         '[[models]]\nname = "b"\nbundle = "b.k2b"\nprofile = "c5"\n[models.card]\ninput = {scale = 0.5}\n')
    root = tmp_path / "state" / "1.2.0"
    root.mkdir(parents=True)
    (root / "card.toml").write_text('task = "classification"\n')
    a = version_config(cfg.models[0], _paths(root))
    assert (a.onnx, a.labels, a.calib, a.card) == (root / "model.onnx", root / "labels.txt", root / "calib.npz", root / "card.toml")
    assert a.profile == str(root / "profiles" / "c2.json") and a.top_k == 2  # the bundle's first profile
    assert version_config(cfg.models[0], _paths(root, profiles=())).profile == "cpu-dev"  # no profile shipped: the default
    b = version_config(cfg.models[1], _paths(root))
    assert b.profile == "c5" and b.card.input.scale == 0.5  # the config's profile and card table win
    (root / "extra").mkdir()
    (root / "extra" / "other.toml").write_text('task = "classification"\n')
    with pytest.raises(ConfigError, match="does not lie beside its model"):
        version_config(cfg.models[1], _paths(root, card="extra/other.toml"))


def _tar(gz: bool = False) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz" if gz else "w") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    return raw.getvalue()


def test_deploy_messages_parse_by_content_type_or_by_their_bytes():
    tar, gz = _tar(), _tar(gz=True)
    assert parse_deploy(tar, "application/x-tar", {}).bundle == tar
    assert parse_deploy(gz, "application/gzip", {"allow_downgrade": "true"}).allow_downgrade
    assert parse_deploy(gz, None, {}).bundle == gz and parse_deploy(tar, "", {}).bundle == tar
    sha = hashlib.sha256(b"x").hexdigest()
    url = parse_deploy(f'{{"url": "https://h/b.k2b", "sha256": "{sha.upper()}", "allow_downgrade": true}}'.encode(),
                       "application/json", {})
    assert (url.url, url.sha256, url.allow_downgrade, url.bundle) == ("https://h/b.k2b", sha, True, None)
    assert parse_deploy(f'{{"url": "https://h/b", "sha256": "{sha}"}}'.encode(), None, {}).url == "https://h/b"
    assert parse_rollback(b'{"model": "digits"}').model == "digits"


@pytest.mark.parametrize("payload, ctype, props, fragment", [
    (b"", "application/gzip", {}, "empty"),
    (b"hello", "text/plain", {}, "content type 'text/plain' is not a bundle"),
    (b"hello", None, {}, "neither a bundle"),
    (_tar(), "application/x-tar", {"allow_downgrade": "yes"}, "allow_downgrade must be true or false"),
    (b'{"url": "http://h/b.k2b", "sha256": "' + b"0" * 64 + b'"}', "application/json", {}, "url must be https://"),
    (b'{"url": "https://h/b.k2b", "sha256": "abc"}', "application/json", {}, "sha256 must be 64 hex digits"),
    (b'{"url": "https://h/b.k2b"}', "application/json", {}, "missing required field `sha256`"),
    (b'{"url": "https://h/b.k2b", "sha256": "' + b"0" * 64 + b'", "force": 1}', "application/json", {}, "unknown field"),
])
def test_bad_deploy_messages_say_what_is_wrong(payload, ctype, props, fragment):
    with pytest.raises(ControlError) as err:
        parse_deploy(payload, ctype, props)
    assert fragment in str(err.value)


@pytest.mark.parametrize("payload, fragment", [
    (b"[]", "a rollback is"), (b'{"model": 3}', "a rollback is"), (b'{"model": "a/b"}', "is not a model name"),
    (b'{"model": "a", "to": "1.0.0"}', "unknown field"),
])
def test_bad_rollback_messages(payload, fragment):
    with pytest.raises(ControlError) as err:
        parse_rollback(payload)
    assert fragment in str(err.value)


def test_topics_and_message_identity():
    assert topics.deploy_topic("k2edge/j7") == "k2edge/j7/models/deploy"
    assert topics.group_deploy_topic("line-3") == "k2edge/group/line-3/models/deploy"
    assert topics.group_rollback_topic("line-3") == "k2edge/group/line-3/models/rollback"
    assert topics.audit_topic("k2edge/j7") == "k2edge/j7/audit"
    assert topics.control_kind("k2edge/group/g/models/rollback") == "rollback"
    assert topics.control_kind("k2edge/j7/infer/models") is None
    assert topics.model_of(topics.deploy_topic("k2edge/j7")) is None  # never mistaken for a request
    a = message_digest("rollback", b'{"model": "d"}', "r/1", b"c1")
    assert a == message_digest("rollback", b'{"model": "d"}', "r/1", b"c1")  # a redelivery: the same message
    assert len({a, message_digest("rollback", b'{"model": "d"}', "r/1", b"c2"),
                message_digest("deploy", b'{"model": "d"}', "r/1", b"c1"),
                message_digest("rollback", b'{"model": "d"}', "r/11", b"")}) == 4


def test_answers_and_how_the_cli_prints_them():
    from k2edge.cli.control import broker_address, describe

    ok = answer_body("deployed", "j7", "digits", "1.3.0", "digits 1.3.0 is current", "activated", "1.3.0", "1.2.0",
                     {"digits": "1.3.0"})
    assert describe(ok) == "j7: deployed digits 1.3.0 (was 1.2.0)"
    refused = answer_body("refused", "j7", "digits", "1.0.0", "version 1.0.0 is not newer", "not_newer", "1.2.0",
                          running={"digits": "1.2.0", "faces": None})
    assert describe(refused) == ("j7: refused digits 1.0.0: not_newer: version 1.0.0 is not newer "
                                 "[running: digits 1.2.0, faces unversioned]")
    untrusted = answer_body("refused", "j7", reason="signed by key 4c12", check="untrusted_key", running={"digits": "1.2.0"})
    assert describe(untrusted) == "j7: refused untrusted_key: signed by key 4c12 [running: digits 1.2.0]"
    with pytest.raises(ValueError):
        answer_body("maybe", "j7")
    assert broker_address("broker.example:8883") == ("broker.example", 8883)
    assert broker_address("10.0.0.2") == ("10.0.0.2", 1883)


def test_the_cli_refuses_bad_targets_in_one_line(tmp_path):
    import os
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}

    def k2edge(*args):
        return subprocess.run([sys.executable, "-m", "k2edge", *args], capture_output=True, text=True, env=env, cwd=root)

    bundle = tmp_path / "b.k2b"
    bundle.write_bytes(_tar(gz=True))
    for args, fragment in [
        (("deploy", str(bundle), "--broker", "h:0", "--device", "d"), "port in 1..65535"),
        (("deploy", str(bundle), "--broker", "h", "--device", "a/b"), "cannot be a topic level"),
        (("deploy", str(bundle), "--broker", "h", "--device", "d", "--url", "http://x"), "--url must be https://"),
        (("deploy", str(tmp_path / "none.k2b"), "--broker", "h", "--group", "g"), "does not exist"),
        (("deploy", str(bundle), "--broker", "h", "--device", "d", "--expect", "2"), "--expect N takes a number >= 1, with --group"),
        (("rollback", "--broker", "127.0.0.1:1", "--group", "g", "--model", "m"), "cannot reach the broker"),
    ]:
        proc = k2edge(*args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and fragment in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = k2edge("deploy", str(bundle), "--broker", "h", "--device", "d", "--group", "g")
    assert proc.returncode == 1 and "not allowed with argument" in proc.stderr


# fetching over HTTPS -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca", "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "srv.key", "-out", "srv.csr")
    (d / "san.ext").write_text("subjectAltName = IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
            "-extfile", "san.ext", "-out", "srv.crt")
    return d


class _Handler(BaseHTTPRequestHandler):
    body = b"k2b" * 1000

    def do_GET(self):  # noqa: N802 - http.server's API
        if self.path == "/missing":
            self.send_error(404)
            return
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/b.k2b")
            self.end_headers()
            return
        self.send_response(200)
        if self.path != "/no-length":
            self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def https(pki):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki / "srv.crt", pki / "srv.key")
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_fetch_checks_the_ca_the_size_and_the_hash(https, pki):
    from k2edge.bundle.fetch import FetchError, fetch_bundle

    body = _Handler.body
    sha = hashlib.sha256(body).hexdigest()
    fetch = partial(fetch_bundle, ca_file=pki / "ca.crt", timeout_s=10)
    assert fetch(f"{https}/b.k2b", sha, 1 << 20) == body
    assert fetch(f"{https}/no-length", sha, 1 << 20) == body
    for call, status, fragment in [
        (lambda: fetch(f"{https}/b.k2b", "0" * 64, 1 << 20), "hash_mismatch", "differs from the request's"),
        (lambda: fetch(f"{https}/b.k2b", sha, 1024), "too_large", "the limit is 1024"),
        (lambda: fetch(f"{https}/no-length", sha, 1024), "too_large", "more than 1024 bytes"),
        (lambda: fetch(f"{https}/missing", sha, 1 << 20), "failed", "HTTP 404"),
        (lambda: fetch(f"{https}/redirect", sha, 1 << 20), "failed", "not https"),
        (lambda: fetch_bundle(f"{https}/b.k2b", sha, 1 << 20, timeout_s=10), "failed", "CERTIFICATE_VERIFY_FAILED"),
        (lambda: fetch("http://127.0.0.1/b.k2b", sha, 1 << 20), "failed", "only https://"),
        (lambda: fetch_bundle(f"{https}/b.k2b", sha, 1 << 20, ca_file=pki / "srv.csr"), "failed", "deploy.ca_file"),
    ]:
        with pytest.raises(FetchError) as err:
            call()
        assert err.value.status == status and fragment in err.value.detail, err.value.detail


def test_the_cli_leaves_a_bundle_over_the_default_device_limit_to_the_devices(tmp_path):
    """A 65 MiB bundle (past the 64 MiB a device takes by default, within what one may be set to take): deploy --url
    reads it, hashes it and goes on to the broker (unreachable here), and bundle inspect shows it; neither refuses
    it as too large for a device whose limit it does not know."""
    import os
    import sys

    from bundles import small_model_dir

    from k2edge.bundle import create_bundle

    root = Path(__file__).resolve().parents[1]
    model = small_model_dir(tmp_path / "big" / "digits")
    import numpy as np

    noise = np.random.default_rng(0).integers(0, 256, (68000, 32, 32), dtype=np.uint8)  # 66 MiB gzip cannot shrink
    np.savez(model / "calib.npz", x=noise, y=np.zeros(len(noise), np.int64))
    bundle = tmp_path / "digits-1.0.0.k2b"
    create_bundle(model, bundle, version="1.0.0", profiles=["cpu-dev"])
    assert bundle.stat().st_size > 64 << 20
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "k2edge", "deploy", str(bundle), "--broker", "127.0.0.1:1", "--device", "d",
                           "--url", "https://h/b.k2b"], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert proc.returncode == 1 and "cannot reach the broker" in proc.stderr and "too_large" not in proc.stderr, proc.stderr
    shown = subprocess.run([sys.executable, "-m", "k2edge", "bundle", "inspect", str(bundle)], capture_output=True,
                           text=True, env=env, cwd=root, timeout=120)
    assert shown.returncode == 0 and "digits" in shown.stdout and "too_large" not in shown.stdout, shown.stdout + shown.stderr
