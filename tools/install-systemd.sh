#!/usr/bin/env bash
# Install k2edge as a systemd service on this machine (a Jetson, or any Debian/Ubuntu host).
#
#   sudo tools/install-systemd.sh [--prefix /opt/k2edge] [--no-start] [--dry-run]
#
# Creates the k2edge system user, a virtual environment under PREFIX (with the system site
# packages, so JetPack's TensorRT is visible), /etc/k2edge with the example config, the profiles
# and an empty credentials directory, installs systemd/k2edge.service and enables it.
# Re-running it upgrades the package and keeps an existing /etc/k2edge/k2edge.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PREFIX=/opt/k2edge
START=1
DRY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX=$2; shift 2 ;;
        --no-start) START=0; shift ;;
        --dry-run) DRY=1; shift ;;
        *) echo "usage: $0 [--prefix DIR] [--no-start] [--dry-run]" >&2; exit 2 ;;
    esac
done
run() { if [ "$DRY" = 1 ]; then echo "+ $*"; else "$@"; fi; }

if [ "$DRY" = 0 ] && [ "$(id -u)" != 0 ]; then
    echo "install-systemd: run as root (sudo $0)" >&2
    exit 1
fi

# the service user must be able to run the interpreter: prefer the system one over a per-user build
PY=${PYTHON:-$(command -v /usr/bin/python3 || command -v python3)}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "install-systemd: Python 3.10+ needed ($PY)" >&2; exit 1; }
extras=""
[ -e /etc/nv_tegra_release ] && extras="[jetson]"

id k2edge >/dev/null 2>&1 || run useradd --system --home-dir /var/lib/k2edge --shell /usr/sbin/nologin k2edge
for g in video render; do getent group "$g" >/dev/null && run usermod -aG "$g" k2edge; done

run install -d -m 0755 "$PREFIX"
[ -x "$PREFIX/venv/bin/python" ] || run "$PY" -m venv --system-site-packages "$PREFIX/venv"
run "$PREFIX/venv/bin/python" -m pip install -q --upgrade pip
run "$PREFIX/venv/bin/python" -m pip install -q "$REPO$extras"
run install -d -m 0755 "$PREFIX/models"
run cp -r "$REPO/models/digits" "$PREFIX/models/"
run install -m 0644 "$REPO/README.md" "$PREFIX/README.md"

run install -d -m 0750 -o root -g k2edge /etc/k2edge /etc/k2edge/profiles
run install -d -m 0700 -o root -g root /etc/k2edge/credentials
for cred in mqtt-password k2-api-key; do
    [ -e "/etc/k2edge/credentials/$cred" ] || run install -m 0600 -o root -g root /dev/null "/etc/k2edge/credentials/$cred"
done
run cp "$REPO"/profiles/*.json /etc/k2edge/profiles/
if [ ! -e /etc/k2edge/k2edge.toml ]; then
    if [ "$DRY" = 1 ]; then
        echo "+ write /etc/k2edge/k2edge.toml from config/k2edge.toml (model paths under $PREFIX/models)"
    else
        sed -e "s|\.\./models/|$PREFIX/models/|g" -e "s|^device_id = .*|device_id = \"$(hostname -s)\"|" \
            "$REPO/config/k2edge.toml" > /etc/k2edge/k2edge.toml
        chgrp k2edge /etc/k2edge/k2edge.toml
        chmod 0640 /etc/k2edge/k2edge.toml
    fi
fi

if [ "$DRY" = 1 ]; then
    echo "+ install systemd/k2edge.service as /etc/systemd/system/k2edge.service (ExecStart under $PREFIX/venv)"
else
    sed "s|/opt/k2edge/venv|$PREFIX/venv|g; s|/opt/k2edge/README.md|$PREFIX/README.md|" \
        "$REPO/systemd/k2edge.service" > /etc/systemd/system/k2edge.service
fi
if [ -d /run/systemd/system ]; then
    run systemctl daemon-reload
    if [ "$START" = 1 ]; then run systemctl enable --now k2edge.service; else run systemctl enable k2edge.service; fi
    echo "installed; follow it with: journalctl -u k2edge -f"
else
    echo "systemd is not running here: the unit is installed; enable it on the device with systemctl enable --now k2edge"
fi
