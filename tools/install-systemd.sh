#!/usr/bin/env bash
# Install k2edge as a systemd service on this machine (a Jetson, or any Debian/Ubuntu host).
#
#   sudo tools/install-systemd.sh [--prefix /opt/k2edge] [--trust KEY.pub ...] [--user k2edge] [--no-start] [--dry-run]
#   sudo tools/install-systemd.sh --dirs-only [--root DIR] [--trust KEY.pub ...] [--user k2edge]
#
# Creates the k2edge system user, a virtual environment under PREFIX (with the system site
# packages, so JetPack's TensorRT is visible), /etc/k2edge with the example config, the profiles,
# an empty credentials directory and the trust directory (each --trust key installed in it),
# the state directory for deployed model versions, PREFIX/bundles for the bundles the config names,
# installs systemd/k2edge.service and enables it. Re-running it upgrades the package, keeps an
# existing /etc/k2edge/k2edge.toml and resets the directories' owners and modes.
#
# Owners and modes (GROUP is the service user's group):
#   /etc/k2edge, /etc/k2edge/profiles    root:GROUP 0750   the daemon reads its config, never writes it
#   /etc/k2edge/trust                    root:GROUP 0750   trusted public keys, each root:GROUP 0640
#   /etc/k2edge/credentials              root:root  0700   systemd hands secrets over with LoadCredential
#   PREFIX/bundles                       root:GROUP 0750   first-version bundles named by the config
#   /var/lib/k2edge, /var/lib/k2edge/models  USER:GROUP 0750   outbox, audit.log, deployed versions
#   /var/cache/k2edge                    USER:GROUP 0750   the engine cache
# --dirs-only creates just these (under --root DIR when given: an image being built, or a test).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PREFIX=/opt/k2edge
START=1
DRY=0
DIRS_ONLY=0
ROOT=""
SVC_USER=k2edge
TRUST=()
usage() { echo "usage: $0 [--prefix DIR] [--trust KEY.pub]... [--user NAME] [--no-start] [--dry-run] | --dirs-only [--root DIR] [--trust KEY.pub]... [--user NAME]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX=$2; shift 2 ;;
        --no-start) START=0; shift ;;
        --dry-run) DRY=1; shift ;;
        --dirs-only) DIRS_ONLY=1; shift ;;
        --root) ROOT=${2%/}; shift 2 ;;
        --user) SVC_USER=$2; shift 2 ;;
        --trust) TRUST+=("$2"); shift 2 ;;
        *) usage ;;
    esac
done
run() { if [ "$DRY" = 1 ]; then echo "+ $*"; else "$@"; fi; }
[ -n "$ROOT" ] && [ "$DIRS_ONLY" = 0 ] && { echo "install-systemd: --root goes with --dirs-only" >&2; exit 2; }
for key in ${TRUST[@]+"${TRUST[@]}"}; do
    grep -q -- "-----BEGIN PUBLIC KEY-----" "$key" 2>/dev/null || { echo "install-systemd: $key is not a PEM public key (k2edge keys generate writes one)" >&2; exit 1; }
done

if [ "$DRY" = 0 ] && [ "$(id -u)" != 0 ]; then
    echo "install-systemd: run as root (sudo $0)" >&2
    exit 1
fi

if [ "$DIRS_ONLY" = 1 ]; then
    id "$SVC_USER" >/dev/null 2>&1 || { echo "install-systemd: --dirs-only needs the user $SVC_USER to exist (the full install creates it)" >&2; exit 1; }
else
    # the service user must be able to run the interpreter: prefer the system one over a per-user build
    PY=${PYTHON:-$(command -v /usr/bin/python3 || command -v python3)}
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "install-systemd: Python 3.10+ needed ($PY)" >&2; exit 1; }
    # streams: PyAV and scipy (the tracker), for [[streams]]; on a Jetson also pycuda and jetson-stats
    extras="[streams]"
    [ -e /etc/nv_tegra_release ] && extras="[jetson,streams]"
    id "$SVC_USER" >/dev/null 2>&1 || run useradd --system --home-dir /var/lib/k2edge --shell /usr/sbin/nologin "$SVC_USER"
fi
if id "$SVC_USER" >/dev/null 2>&1; then GROUP=$(id -gn "$SVC_USER"); else GROUP=$SVC_USER; fi

# the directory layout (see the header); install -d also resets owner and mode of existing folders
make_dirs() {
    run install -d -m 0750 -o root -g "$GROUP" "$ROOT/etc/k2edge" "$ROOT/etc/k2edge/profiles" "$ROOT/etc/k2edge/trust"
    run install -d -m 0700 -o root -g root "$ROOT/etc/k2edge/credentials"
    run install -d -m 0755 "$ROOT$PREFIX"
    run install -d -m 0750 -o root -g "$GROUP" "$ROOT$PREFIX/bundles"
    run install -d -m 0750 -o "$SVC_USER" -g "$GROUP" "$ROOT/var/lib/k2edge" "$ROOT/var/lib/k2edge/models" "$ROOT/var/cache/k2edge"
    for key in ${TRUST[@]+"${TRUST[@]}"}; do
        run install -m 0640 -o root -g "$GROUP" "$key" "$ROOT/etc/k2edge/trust/$(basename "$key")"
    done
}
make_dirs
if [ "$DIRS_ONLY" = 1 ]; then
    echo "directories laid out under ${ROOT:-/}"
    exit 0
fi
for g in video render; do getent group "$g" >/dev/null && run usermod -aG "$g" "$SVC_USER"; done

[ -x "$PREFIX/venv/bin/python" ] || run "$PY" -m venv --system-site-packages "$PREFIX/venv"
run "$PREFIX/venv/bin/python" -m pip install -q --upgrade pip
run "$PREFIX/venv/bin/python" -m pip install -q "$REPO$extras"
run install -d -m 0755 "$PREFIX/models"
run cp -r "$REPO/models/digits" "$PREFIX/models/"
run install -m 0644 "$REPO/README.md" "$PREFIX/README.md"
run install -d -m 0755 "$PREFIX/docs"
run install -m 0644 "$REPO"/docs/*.md "$PREFIX/docs/"  # the README links here

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
        chgrp "$GROUP" /etc/k2edge/k2edge.toml
        chmod 0640 /etc/k2edge/k2edge.toml
    fi
fi

if [ "$DRY" = 1 ]; then
    echo "+ install systemd/k2edge.service as /etc/systemd/system/k2edge.service (ExecStart under $PREFIX/venv)"
else
    sed "s|/opt/k2edge/venv|$PREFIX/venv|g; s|/opt/k2edge/README.md|$PREFIX/README.md|; s|/opt/k2edge/bundles|$PREFIX/bundles|; s|^User=k2edge|User=$SVC_USER|; s|^Group=k2edge|Group=$GROUP|" \
        "$REPO/systemd/k2edge.service" > /etc/systemd/system/k2edge.service
fi
if [ "$DRY" = 1 ]; then
    echo "dry run: nothing was installed (the lines above are what would be done)"
elif [ -d /run/systemd/system ]; then
    run systemctl daemon-reload
    if [ "$START" = 1 ]; then run systemctl enable --now k2edge.service; else run systemctl enable k2edge.service; fi
    echo "installed; follow it with: journalctl -u k2edge -f"
else
    echo "systemd is not running here: the unit is installed; enable it on the device with systemctl enable --now k2edge"
fi
