"""The fleet lifecycle's config tables ([trust], [deploy], [metrics]) and the installed directory layout."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from k2edge.bundle import Limits, generate_keys
from k2edge.config import load_config
from k2edge.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MODEL = '[[models]]\nname = "a"\nonnx = "m.onnx"\n'


def _load(tmp_path, text):
    p = tmp_path / "k.toml"
    p.write_text(MODEL + text)
    return load_config(p)


def test_tables_default_and_resolve_paths(tmp_path):
    cfg = _load(tmp_path, "")
    assert cfg.trust is None and cfg.metrics is None
    assert cfg.deploy.max_bundle_bytes == 64 << 20 and Limits.from_settings(cfg.deploy) == Limits()
    cfg = _load(tmp_path, '[trust]\nkeys = ["trust/ops.pub", "/etc/k2edge/trust/old.pub"]\n'
                          '[deploy]\nmax_bundle_bytes = 1048576\nca_file = "ca.pem"\n[metrics]\n')
    assert cfg.trust.keys == (tmp_path / "trust" / "ops.pub", Path("/etc/k2edge/trust/old.pub"))
    assert cfg.trust.allow_unsigned is False
    assert cfg.deploy.ca_file == tmp_path / "ca.pem" and Limits.from_settings(cfg.deploy).max_bundle_bytes == 1 << 20
    assert (cfg.metrics.host, cfg.metrics.port) == ("127.0.0.1", 9108)
    assert _load(tmp_path, "[trust]\nallow_unsigned = true\n").trust.keys == ()


@pytest.mark.parametrize("text, fragment", [
    ("[trust]\n", "trust.keys: list at least one public key file"),
    ('[trust]\nkeys = ["a.pub", "a.pub"]\n', "trust.keys: lists"),
    ('[trust]\nkeys = ["a.pub"]\nallow_unsigend = true\n', "trust.allow_unsigend: unknown key"),
    ("[deploy]\nmax_bundle_bytes = 10\n", "deploy.max_bundle_bytes: must be >= 1024, got 10"),
    ("[deploy]\nmax_files = 0\n", "deploy.max_files: must be >= 4"),
    ("[deploy]\nurl = 'x'\n", "deploy.url: unknown key (known keys: max_bundle_bytes"),
    ("[metrics]\nport = 70000\n", "metrics.port: must be <= 65535, got 70000"),
    ("[metrics]\nhost = ''\n", "metrics.host"),
])
def test_table_errors_name_the_key(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    assert fragment in str(err.value)


def test_verify_cli_takes_trust_and_limits_from_the_config(tmp_path):
    from k2edge.bundle import create_bundle

    private, public, _ = generate_keys(tmp_path / "keys")
    create_bundle(ROOT / "models" / "digits", tmp_path / "d.k2b", version="1.0.0", key=private)
    served = MODEL.replace('"a"', '"digits"')
    (tmp_path / "k.toml").write_text(served + f'[trust]\nkeys = ["{public}"]\n')
    (tmp_path / "small.toml").write_text(served + f'[trust]\nkeys = ["{public}"]\n[deploy]\nmax_bundle_bytes = 4096\n')
    (tmp_path / "other.toml").write_text(MODEL + f'[trust]\nkeys = ["{public}"]\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def verify(config):
        return subprocess.run([sys.executable, "-m", "k2edge", "bundle", "verify", str(tmp_path / "d.k2b"), "--config",
                               str(config)], capture_output=True, text=True, env=env, cwd=ROOT)

    assert verify(tmp_path / "k.toml").stdout == "verified digits 1.0.0\n"
    small = verify(tmp_path / "small.toml")
    assert small.returncode == 1 and small.stdout.startswith("too_large: ")
    other = verify(tmp_path / "other.toml")  # the device with this config would refuse it: so does verify
    assert other.returncode == 1 and other.stdout == ("bad_manifest: the bundle is for model 'digits', which is not "
                                                      "served here (served: a)\n"), other.stdout


def test_unit_keeps_state_private_and_still_verifies(tmp_path):
    unit = (ROOT / "systemd" / "k2edge.service").read_text()
    assert "StateDirectoryMode=0750" in unit and "ProtectSystem=strict" in unit
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    local = tmp_path / "k2edge.service"
    local.write_text(unit.replace("/opt/k2edge/venv/bin/k2edge", shutil.which("true")))
    proc = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_installer_dry_run_lists_the_trust_and_state_directories(tmp_path):
    key = generate_keys(tmp_path / "k")[1]
    proc = subprocess.run(["bash", str(ROOT / "tools" / "install-systemd.sh"), "--dry-run", "--prefix", str(tmp_path / "opt"),
                           "--trust", str(key)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "install -d -m 0750 -o root -g k2edge /etc/k2edge /etc/k2edge/profiles /etc/k2edge/trust" in out
    assert f"install -m 0640 -o root -g k2edge {key} /etc/k2edge/trust/k2edge.pub" in out
    assert "install -d -m 0750 -o k2edge -g k2edge /var/lib/k2edge /var/lib/k2edge/models" in out
    assert f"install -d -m 0750 -o root -g k2edge {tmp_path / 'opt'}/bundles" in out
    assert f"-m pip install -q {ROOT}[streams]" in out or f"-m pip install -q {ROOT}[jetson,streams]" in out, out
    assert out.rstrip().endswith("dry run: nothing was installed (the lines above are what would be done)")
    assert "the unit is installed" not in out and "installed;" not in out
    bad = subprocess.run(["bash", str(ROOT / "tools" / "install-systemd.sh"), "--dry-run", "--trust", str(ROOT / "README.md")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "not a PEM public key" in bad.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv (util-linux)")
def test_installer_lays_out_directories_the_service_user_can_read_but_not_change():
    """Run for real under a scratch root, with 'nobody' as the service user, and check as that user."""
    scratch = Path(tempfile.mkdtemp(prefix="k2edge-root-", dir="/tmp"))
    try:
        os.chmod(scratch, 0o755)  # the service user must be able to walk in, as it can walk into /
        key = generate_keys(scratch / "keys")[1]
        root = scratch / "root"
        proc = subprocess.run(["bash", str(ROOT / "tools" / "install-systemd.sh"), "--dirs-only", "--root", str(root),
                               "--user", "nobody", "--trust", str(key)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        os.chmod(root, 0o755)
        nobody = subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True).stdout.strip()
        group = subprocess.run(["id", "-g", "nobody"], capture_output=True, text=True).stdout.strip()

        def owner_mode(rel):
            st = (root / rel).stat()
            return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)

        assert owner_mode("etc/k2edge/trust") == (0, int(group), 0o750)
        assert owner_mode("etc/k2edge/trust/k2edge.pub") == (0, int(group), 0o640)
        assert owner_mode("etc/k2edge/credentials") == (0, 0, 0o700)
        assert owner_mode("opt/k2edge/bundles") == (0, int(group), 0o750)
        assert owner_mode("var/lib/k2edge/models") == (int(nobody), int(group), 0o750)

        def as_nobody(script: str) -> int:
            return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sh", "-c", script],
                                  cwd=root, capture_output=True).returncode

        assert as_nobody("cat etc/k2edge/trust/k2edge.pub >/dev/null") == 0
        assert as_nobody("touch etc/k2edge/trust/rogue.pub") != 0
        assert as_nobody("rm -f etc/k2edge/trust/k2edge.pub") != 0 and (root / "etc/k2edge/trust/k2edge.pub").exists()
        assert as_nobody("touch opt/k2edge/bundles/x.k2b") != 0
        assert as_nobody("ls etc/k2edge/credentials") != 0
        assert as_nobody("mkdir var/lib/k2edge/models/digits && touch var/lib/k2edge/audit.log") == 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
