"""Signed model bundles: every refusal, through the API, the model store and the CLI; nothing extracted."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bundles import (DEMO, DIGITS_CARD, ROOT, file_member, flip_byte, read_members, rebuild, replace_data,
                     small_model_dir, special_member, write_members)
from k2edge.bundle import CHECK_ORDER, Limits, ModelStore, create_bundle, generate_keys, load_trust, verify_bundle


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    base = tmp_path_factory.mktemp("keys")
    ops = generate_keys(base / "ops")
    rogue = generate_keys(base / "rogue")
    return {"ops_key": ops[0], "ops_pub": ops[1], "rogue_key": rogue[0], "rogue_pub": rogue[1]}


@pytest.fixture(scope="module")
def signed(keys, tmp_path_factory) -> Path:
    """The demo model (ONNX, labels, the 200-image calib/ folder) with profile c2, signed by ops."""
    out = tmp_path_factory.mktemp("signed") / "digits-1.0.0.k2b"
    create_bundle(DEMO, out, version="1.0.0", profiles=["c2"], key=keys["ops_key"])
    return out


@pytest.fixture(scope="module")
def trust(keys):
    return load_trust([keys["ops_pub"]])


def _k2edge(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "k2edge", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)


def _tampered_sig(members):
    def corrupt(data):
        body = json.loads(data)
        sig = bytearray(base64.b64decode(body["signature"]))
        sig[10] ^= 0x40
        body["signature"] = base64.b64encode(bytes(sig)).decode()
        return json.dumps(body).encode()

    return replace_data(members, "manifest.sig", corrupt)


def _card_bundle(tmp: Path, keys, h: int = 32, w: int = 32, **kw) -> Path:
    folder = small_model_dir(tmp / "model", card=DIGITS_CARD.format(h=h, w=w), **kw)
    create_bundle(folder, tmp / "card.k2b", version="1.0.0", profiles=["c2"], key=keys["ops_key"], check=False)
    return tmp / "card.k2b"


# the refusals the issue names, each: (how to make it, status, a fragment of the detail)
REFUSALS = {
    "flipped byte in the ONNX": (lambda s, t, k: rebuild(s, t / "b.k2b", lambda m: replace_data(m, "model.onnx", flip_byte)),
                                 "hash_mismatch", "model.onnx"),
    "a ../ member": (lambda s, t, k: rebuild(s, t / "b.k2b", lambda m: m + [file_member("../evil.txt", b"owned")]),
                     "unsafe_path", "'..'"),
    "a duplicate member name": (lambda s, t, k: rebuild(s, t / "b.k2b", lambda m: m + [file_member("labels.txt", b"a\nb\n")]),
                                "unsafe_path", "appears twice"),
    "a member not in the manifest": (lambda s, t, k: rebuild(s, t / "b.k2b", lambda m: m + [file_member("extra.py", b"x")]),
                                     "unexpected_file", "extra.py"),
    "a key not trusted": (lambda s, t, k: create_bundle(DEMO, t / "b.k2b", version="1.0.0", key=k["rogue_key"]) and t / "b.k2b",
                          "untrusted_key", "not among the 1 trusted"),
    "a corrupted signature": (lambda s, t, k: rebuild(s, t / "b.k2b", _tampered_sig), "bad_signature", "does not match"),
    "a missing file": (lambda s, t, k: rebuild(s, t / "b.k2b", lambda m: [x for x in m if x[0].name != "labels.txt"]),
                       "missing_file", "labels.txt"),
    "an input shape that contradicts the card": (lambda s, t, k: _card_bundle(t, k, h=28, w=28),
                                                 "structure_mismatch", "input.size: [28, 28]"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_through_api_store_and_cli_with_nothing_extracted(case, signed, keys, trust, tmp_path):
    """Each tampering the issue lists is refused with its status and one line, by the API, the store and the CLI."""
    make, status, fragment = REFUSALS[case]
    bundle = make(signed, tmp_path, keys)
    result = verify_bundle(bundle, trust)
    assert (result.status, result.ok) == (status, False), result.line
    assert fragment in result.detail and "\n" not in result.line
    assert result.line.startswith(f"{status}: ")
    # the store: the same refusal from the bytes (an MQTT payload), and nothing written
    state = tmp_path / "state"
    installed = ModelStore(state, trust).install(bundle.read_bytes())
    assert installed.status == status and installed.paths == {}
    assert not state.exists() or not any(state.rglob("*"))
    # the CLI: one line on stdout, exit 1, no traceback
    proc = _k2edge("bundle", "verify", str(bundle), "--trust", str(keys["ops_pub"]))
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == result.line


def test_signed_bundle_verifies_plain_or_gzip(signed, keys, trust, tmp_path):
    result = verify_bundle(signed, trust)
    assert result.line == "verified digits 1.0.0" and result.key_id is not None
    plain = write_members(tmp_path / "plain.k2b", read_members(signed), compress=False)
    assert verify_bundle(plain, trust).line == "verified digits 1.0.0"
    assert verify_bundle(signed.read_bytes(), trust).ok
    proc = _k2edge("bundle", "verify", str(signed), "--trust", str(keys["rogue_pub"]), "--trust", str(keys["ops_pub"]))
    assert (proc.returncode, proc.stdout) == (0, "verified digits 1.0.0\n")


def test_manifest_and_signature_come_first_and_name_every_file(signed):
    members = read_members(signed)
    assert [m[0].name for m in members[:2]] == ["manifest.json", "manifest.sig"]
    manifest = json.loads(members[0][1])
    assert manifest["name"] == "digits" and manifest["version"] == "1.0.0" and manifest["model"] == "model.onnx"
    assert manifest["labels"] == "labels.txt" and manifest["calib"] == "calib" and manifest["profiles"] == ["profiles/c2.json"]
    assert {f["path"] for f in manifest["files"]} == {m[0].name for m in members[2:]}
    assert sum(1 for f in manifest["files"] if f["path"].startswith("calib/")) == 200
    sig = json.loads(members[1][1])
    assert set(sig) == {"key_id", "signature"} and len(base64.b64decode(sig["signature"])) == 64


@pytest.mark.parametrize("case, edit, status, fragment", [
    ("symlink", lambda m: m + [special_member("calib/link.png", tarfile.SYMTYPE, "/etc/shadow")], "unsafe_path", "symbolic link"),
    ("hard link", lambda m: m + [special_member("hard", tarfile.LNKTYPE, "model.onnx")], "unsafe_path", "hard link"),
    ("absolute", lambda m: m + [file_member("/etc/cron.d/evil", b"x")], "unsafe_path", "absolute"),
    ("device", lambda m: m + [special_member("null", tarfile.CHRTYPE)], "unsafe_path", "device"),
    ("fifo", lambda m: m + [special_member("pipe", tarfile.FIFOTYPE)], "unsafe_path", "fifo"),
    ("stray folder", lambda m: m + [special_member("empty", tarfile.DIRTYPE)], "unexpected_file", "empty"),
    ("manifest edited", lambda m: replace_data(m, "manifest.json", lambda d: d.replace(b'"1.0.0"', b'"9.0.0"')),
     "bad_signature", "does not match"),
    ("no signature", lambda m: [x for x in m if x[0].name != "manifest.sig"], "unsigned", "not signed"),
    ("no manifest", lambda m: [x for x in m if x[0].name != "manifest.json"], "unsigned", "no manifest.json"),
    ("resized ONNX", lambda m: replace_data(m, "model.onnx", lambda d: d + b"\0"), "hash_mismatch", "model.onnx"),
    # order: the first failing check wins, whatever else is wrong
    ("unexpected before hash", lambda m: replace_data(m, "model.onnx", flip_byte) + [file_member("x", b"")],
     "unexpected_file", "'x'"),
    ("unsafe before unexpected", lambda m: m + [file_member("x", b""), file_member("a/../b", b"")], "unsafe_path", "'..'"),
])
def test_more_refusals_and_their_order(case, edit, status, fragment, signed, trust, tmp_path):
    result = verify_bundle(rebuild(signed, tmp_path / "b.k2b", edit), trust)
    assert result.status == status and fragment in result.detail, (case, result.line)


def test_trust_is_checked_before_anything_inside(keys, trust, tmp_path):
    """A bundle signed by an unknown key is refused as such even when it also carries a ../ member."""
    create_bundle(DEMO, tmp_path / "rogue.k2b", version="1.0.0", key=keys["rogue_key"])
    bad = rebuild(tmp_path / "rogue.k2b", tmp_path / "b.k2b", lambda m: m + [file_member("../x", b"")])
    assert verify_bundle(bad, trust).status == "untrusted_key"
    assert CHECK_ORDER.index("untrusted_key") < CHECK_ORDER.index("unsafe_path")


def test_limits_and_non_bundles(signed, trust, tmp_path):
    assert verify_bundle(signed, trust, Limits(max_unpacked_bytes=100_000)).status == "too_large"
    assert verify_bundle(signed, trust, Limits(max_files=50)).status == "too_large"
    small = Limits(max_bundle_bytes=signed.stat().st_size - 1)
    assert "deploy.max_bundle_bytes" in verify_bundle(signed, trust, small).detail
    junk = tmp_path / "junk.k2b"
    junk.write_bytes(os.urandom(4096))
    assert verify_bundle(junk, trust).status == "not_a_bundle"
    truncated = tmp_path / "cut.k2b"
    truncated.write_bytes(signed.read_bytes()[: signed.stat().st_size // 2])
    assert verify_bundle(truncated, trust).status == "not_a_bundle"
    assert verify_bundle(tmp_path / "absent.k2b", trust).line.startswith("not_a_bundle: ")
    assert verify_bundle(tmp_path, trust).status == "not_a_bundle"


def test_gzip_bomb_is_stopped_at_the_limit(signed, trust, tmp_path):
    """A small gzip that unpacks to far more than the limit costs no more than the limit to read."""
    zeros = file_member("calib/zeros.bin", b"\0" * (64 << 20))
    bomb = rebuild(signed, tmp_path / "bomb.k2b", lambda m: m + [zeros])
    assert bomb.stat().st_size < 2 << 20
    result = verify_bundle(bomb, trust, Limits(max_unpacked_bytes=8 << 20))
    assert result.status == "too_large" and "max_unpacked_bytes" in result.detail


def test_structure_checks_card_labels_and_accepts_a_matching_card(keys, trust, tmp_path):
    assert verify_bundle(_card_bundle(tmp_path / "ok", keys), trust).line == "verified model 1.0.0"
    rgb = small_model_dir(tmp_path / "rgb" / "model", card=DIGITS_CARD.format(h=32, w=32).replace('"L"', '"RGB"'))
    create_bundle(rgb, tmp_path / "rgb.k2b", key=keys["ops_key"], check=False)
    assert "3 channel(s)" in verify_bundle(tmp_path / "rgb.k2b", trust).detail
    nine = small_model_dir(tmp_path / "nine" / "digits", labels="".join(f"{i}\n" for i in range(9)))
    create_bundle(nine, tmp_path / "nine.k2b", key=keys["ops_key"], check=False)
    result = verify_bundle(tmp_path / "nine.k2b", trust)
    assert result.status == "structure_mismatch" and "10 classes, but the labels list 9" in result.detail
    detector = small_model_dir(tmp_path / "det" / "m", card='task = "detection"\n[input]\nsize = [32, 32]\n')
    create_bundle(detector, tmp_path / "det.k2b", key=keys["ops_key"], check=False)
    assert "rank 3" in verify_bundle(tmp_path / "det.k2b", trust).detail


def test_profile_batch_contradicting_a_fixed_batch(keys, trust, tmp_path):
    import onnx

    folder = small_model_dir(tmp_path / "fixed")
    model = onnx.load(str(folder / "model.onnx"))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    onnx.save(model, str(folder / "model.onnx"))
    profile = tmp_path / "b4.json"
    profile.write_text(json.dumps({"edge_runtime": {"offload_ratio": 1.0, "batch_size": 4}}))
    create_bundle(folder, tmp_path / "b.k2b", profiles=[str(profile)], key=keys["ops_key"], check=False)
    result = verify_bundle(tmp_path / "b.k2b", trust)
    assert result.status == "structure_mismatch" and "batch_size 4" in result.detail and "fixed batch of 1" in result.detail


def test_create_refuses_what_every_device_would_refuse(keys, tmp_path):
    """A card that contradicts its model is refused by `bundle create` in one line, before anything is written or
    signed (it used to sign a bundle every device then refused as structure_mismatch)."""
    folder = small_model_dir(tmp_path / "m" / "digits", card=DIGITS_CARD.format(h=28, w=28))
    out = tmp_path / "d.k2b"
    proc = _k2edge("bundle", "create", str(folder), "--out", str(out), "--key", str(keys["ops_key"]))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "devices would refuse this bundle (structure_mismatch): card.toml: input.size: [28, 28]" \
        in lines[0], proc.stderr
    assert not out.exists()


def test_cli_create_sign_verify_inspect(keys, tmp_path):
    out = tmp_path / "d.k2b"
    proc = _k2edge("bundle", "create", str(DEMO), "--out", str(out), "--version", "2.1.0", "-p", "c2", "-p", "c3")
    assert proc.returncode == 0 and "unsigned" in proc.stdout, proc.stderr
    proc = _k2edge("bundle", "verify", str(out), "--trust", str(keys["ops_pub"]))
    assert (proc.returncode, proc.stdout.split(":")[0]) == (1, "unsigned")
    assert _k2edge("bundle", "sign", str(out), "--key", str(keys["ops_key"])).returncode == 0
    proc = _k2edge("bundle", "verify", str(out), "--trust", str(keys["ops_pub"]), "--json")
    data = json.loads(proc.stdout)
    assert proc.returncode == 0 and data["status"] == "verified" and data["version"] == "2.1.0"
    info = json.loads(_k2edge("bundle", "inspect", str(out), "--json").stdout)
    assert info["manifest"]["profiles"] == ["profiles/c2.json", "profiles/c3.json"]
    assert info["integrity"]["status"] == "verified" and info["key_id"] == data["key_id"]
    text = _k2edge("bundle", "inspect", str(out)).stdout
    assert "digits 2.1.0" in text and "match the manifest" in text
    # re-signing with another key replaces the signature; the content is unchanged
    assert _k2edge("bundle", "sign", str(out), "--key", str(keys["rogue_key"])).returncode == 0
    assert _k2edge("bundle", "verify", str(out), "--trust", str(keys["ops_pub"])).stdout.startswith("untrusted_key: ")
    assert _k2edge("bundle", "verify", str(out), "--trust", str(keys["rogue_pub"])).stdout == "verified digits 2.1.0\n"


def test_a_tampered_bundle_is_never_signed(signed, keys, tmp_path):
    bad = rebuild(signed, tmp_path / "b.k2b", lambda m: replace_data(m, "model.onnx", flip_byte))
    proc = _k2edge("bundle", "sign", str(bad), "--key", str(keys["ops_key"]))
    assert proc.returncode == 1 and "hash_mismatch" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, fragment", [
    (["bundle", "verify", "X", "--trust", "/nonexistent.pub"], "does not exist"),
    (["bundle", "verify", "X"], "--trust"),
    (["bundle", "create", "/nonexistent", "--out", "x.k2b"], "does not exist"),
    (["bundle", "create", str(DEMO), "--out", "x.k2b", "--version", "1.0"], "semantic version"),
    (["bundle", "create", str(DEMO), "--out", "x.k2b", "-p", "nope"], "not found"),
    (["bundle", "create", str(DEMO), "--out", "x.k2b", "--name", "a b/c"], "name: must be letters, digits"),
    (["bundle", "create", str(DEMO), "--out", "x.k2b", "--name", "x" * 129], "name: must be at most 128 characters"),
    (["bundle", "sign", "X", "--key", str(DEMO / "labels.txt")], "not a PEM private key"),
    (["bundle", "inspect", "/nonexistent.k2b"], "does not exist"),
    (["keys", "show", str(DEMO / "model.onnx")], "not a PEM"),
])
def test_cli_user_errors_are_one_line(args, fragment, tmp_path):
    proc = _k2edge(*[str(tmp_path / "x.k2b") if a == "X" else a for a in args])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and fragment in proc.stderr, proc.stderr


def test_create_refuses_a_folder_with_several_models(tmp_path):
    folder = small_model_dir(tmp_path / "two")
    (folder / "other.onnx").write_bytes((folder / "model.onnx").read_bytes())
    proc = _k2edge("bundle", "create", str(folder), "--out", str(tmp_path / "x.k2b"))
    assert proc.returncode == 1 and "exactly one .onnx" in proc.stderr
    proc = _k2edge("bundle", "create", str(folder / "other.onnx"), "--out", str(tmp_path / "x.k2b"), "--name", "other")
    assert proc.returncode == 0, proc.stderr


def test_same_inputs_make_the_same_bundle_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    a = create_bundle(DEMO, tmp_path / "a.k2b", profiles=["c2"])
    create_bundle(DEMO, tmp_path / "b.k2b", profiles=["c2"])
    assert a.created == "2023-11-14T22:13:20Z"
    assert (tmp_path / "a.k2b").read_bytes() == (tmp_path / "b.k2b").read_bytes()


@pytest.mark.parametrize("edit, fragment", [
    (lambda m: {**m, "version": "1.0"}, "version: must be a semantic version"),
    (lambda m: {**m, "model": "nope.onnx"}, "model 'nope.onnx' is not among files"),
    (lambda m: {**m, "name": "../x"}, "name: must be letters"),
    (lambda m: {**m, "name": "digits\n"}, "name: must be letters"),  # '$' matched before a trailing newline
    (lambda m: {**m, "version": "1.3.0\n"}, "version: must be a semantic version"),
    (lambda m: {**m, "created": "yesterday"}, "created: must be an ISO 8601 time"),
    (lambda m: {**m, "files": m["files"] + m["files"][:1]}, "more than once"),
    (lambda m: {**m, "shiny": True}, "shiny: unknown key"),
])
def test_a_signed_but_invalid_manifest_is_bad_manifest(edit, fragment, signed, keys, trust, tmp_path):
    """Only signed bytes are parsed; a validly signed manifest that is not a manifest is refused as such."""
    from k2edge.bundle.keys import load_private_key, sign_manifest

    members = read_members(signed)
    manifest = json.dumps(edit(json.loads(members[0][1]))).encode()
    sig = sign_manifest(manifest, load_private_key(keys["ops_key"])).to_bytes()
    members = replace_data(replace_data(members, "manifest.json", lambda _: manifest), "manifest.sig", lambda _: sig)
    result = verify_bundle(write_members(tmp_path / "b.k2b", members), trust)
    assert result.status == "bad_manifest" and fragment in result.detail, result.line


def test_structure_follows_the_card_layout_and_output_name(keys, trust, tmp_path):
    nhwc = DIGITS_CARD.format(h=32, w=32).replace('color = "L"', 'color = "L"\nlayout = "NHWC"')
    create_bundle(small_model_dir(tmp_path / "a" / "m", card=nhwc), tmp_path / "a.k2b", key=keys["ops_key"], check=False)
    assert "height is 1, not 32" in verify_bundle(tmp_path / "a.k2b", trust).detail  # [N, 1, 32, 32] read as NHWC
    named = DIGITS_CARD.format(h=32, w=32).replace('output = "logits"', 'output = "logits"\noutput_name = "probs"')
    create_bundle(small_model_dir(tmp_path / "b" / "m", card=named), tmp_path / "b.k2b", key=keys["ops_key"], check=False)
    assert "output_name 'probs' is not an output" in verify_bundle(tmp_path / "b.k2b", trust).detail


def _resigned_with_card(src: Path, dst: Path, card: bytes, key: Path) -> Path:
    """``src`` with its card replaced and the manifest updated and signed again (a signed, intact bundle)."""
    import hashlib

    from k2edge.bundle.keys import load_private_key, sign_manifest

    members = replace_data(read_members(src), "card.toml", lambda _: card)
    body = json.loads(members[0][1])
    for entry in body["files"]:
        if entry["path"] == "card.toml":
            entry.update(size=len(card), sha256=hashlib.sha256(card).hexdigest())
    manifest = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
    sig = sign_manifest(manifest, load_private_key(key)).to_bytes()
    members = replace_data(replace_data(members, "manifest.json", lambda _: manifest), "manifest.sig", lambda _: sig)
    return write_members(dst, members)


@pytest.mark.parametrize("card, fragment", [
    (DIGITS_CARD.format(h=32, w=32).replace('resize = "stretch"', 'resize = "squash"'),
     "card.toml: input.resize: must be one of"),
    ("colour = 1\n" + DIGITS_CARD.format(h=32, w=32), "card.toml: colour: unknown key"),
    (DIGITS_CARD.format(h=32, w=32).replace('name = "input"', 'name = "pixels"'), "input.name 'pixels' is not an input"),
])
def test_a_signed_card_is_checked_by_the_card_schema(card, fragment, keys, trust, tmp_path):
    """The card inside a bundle gets the card's full validation (not a partial reading): refused as structure_mismatch."""
    good = _card_bundle(tmp_path, keys)
    bad = _resigned_with_card(good, tmp_path / "bad.k2b", card.encode(), keys["ops_key"])
    result = verify_bundle(bad, trust)
    assert result.status == "structure_mismatch" and fragment in result.detail, result.line


def test_the_card_is_layered_over_the_model_metadata_as_at_load(keys, trust, tmp_path):
    """A card without a size over a model whose own metadata contradicts its input: refused as the engine would."""
    import onnx

    folder = small_model_dir(tmp_path / "meta" / "m", card='task = "classification"\n[input]\ncolor = "L"\n')
    model = onnx.load(str(folder / "model.onnx"))
    onnx.helper.set_model_props(model, {"k2edge.preprocess": json.dumps({"size": [28, 28]})})
    onnx.save(model, str(folder / "model.onnx"))
    create_bundle(folder, tmp_path / "meta.k2b", key=keys["ops_key"], check=False)
    result = verify_bundle(tmp_path / "meta.k2b", trust)
    assert result.status == "structure_mismatch" and "input.size: [28, 28]" in result.detail, result.line
