#!/usr/bin/env bash
# k2edge quickstart: set up a virtual environment and run the demo or the whole test suite.
#
#   ./quickstart.sh demo          the whole path on the demo model: broker, daemon, requests, answers
#   ./quickstart.sh test [ARGS]   run the whole test suite (ARGS go to pytest, e.g. -m "not slow"), in one pytest-xdist
#                                 worker per core up to 4 (K2EDGE_TEST_WORKERS=N sets it; 0: in this process)
#
# Works on a fresh Debian/Ubuntu machine with Python 3.10+. The environment lives in .venv
# (override with K2EDGE_VENV); a second run reuses it.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${K2EDGE_VENV:-.venv}
PY=${PYTHON:-python3}

die() { echo "quickstart: $*" >&2; exit 1; }

can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }

apt_updated=
apt_install() {  # quietly; the package lists are refreshed once a run
    [ -n "$apt_updated" ] || { apt-get update -qq || true; apt_updated=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

need_python() {
    command -v "$PY" >/dev/null || die "$PY not found; install Python 3.10+ (apt-get install python3)"
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "Python 3.10+ needed, found $("$PY" -V 2>&1)"
}

setup() {
    need_python
    if [ ! -x "$VENV/bin/python" ]; then
        if ! "$PY" -m venv "$VENV" 2>/dev/null; then
            rm -rf "$VENV"
            if can_apt; then
                apt_install python3-venv
                "$PY" -m venv "$VENV"
            else
                die "python3 -m venv failed; install the venv module: sudo apt-get install python3-venv"
            fi
        fi
    fi
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q -e ".[dev]" > "$VENV/pip-install.log" 2>&1 \
        || { tail -n 30 "$VENV/pip-install.log" >&2; die "pip install failed (full log: $VENV/pip-install.log)"; }
}

need_mosquitto() {
    command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] && return 0
    if can_apt; then
        echo "quickstart: installing mosquitto (the MQTT broker the demo and the tests use)"
        apt_install mosquitto
        # the tests and the demo start their own broker; Debian's starts one on 1883 that we do not need
        return 0
    fi
    die "mosquitto not found; install it: sudo apt-get install mosquitto"
}

# the RTSP stream tests' camera is GStreamer's RTSP server, reached from Debian's python3-gi (a venv
# cannot see it); without it those tests skip
need_rtsp_server() {
    local sys_py=/usr/bin/python3 pkgs="python3-gi gir1.2-gst-rtsp-server-1.0"
    "$sys_py" -c 'import gi; gi.require_version("GstRtspServer", "1.0"); from gi.repository import GstRtspServer' \
        >/dev/null 2>&1 && return 0
    if can_apt; then
        echo "quickstart: installing $pkgs (GStreamer's RTSP server: the camera of the stream tests)"
        apt_install --no-install-recommends $pkgs && return 0
    fi
    echo "quickstart: warning: no GStreamer RTSP server for $sys_py, the RTSP stream tests will be skipped" \
         "(sudo apt-get install $pkgs)" >&2
}

# the live view's browser test drives Debian's chromium with Playwright (browsers cannot be downloaded here,
# so no `playwright install`); without chromium that test skips, saying so
need_chromium() {
    command -v chromium >/dev/null && return 0
    if can_apt; then
        echo "quickstart: installing chromium (the browser of the live view's test)"
        apt_install --no-install-recommends chromium && return 0
    fi
    echo "quickstart: warning: no chromium, the live view's browser test will be skipped (sudo apt-get install chromium)" >&2
}

free_port() { "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

demo() {
    need_mosquitto
    local k2="$VENV/bin/k2edge" model=models/digits/model.onnx port
    tmp=$(mktemp -d)
    port=$(free_port)
    # TCP_NODELAY on the broker: without it every MQTT round trip waits ~40 ms for Nagle's algorithm
    printf 'listener %s 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\nmax_queued_messages 100000\nuser %s\n' "$port" "$(id -un)" > "$tmp/mosquitto.conf"
    echo "== plan: where each layer of the demo model runs under profile c2 (block-wise, INT8) on an AGX Orin"
    "$k2" plan "$model" --profile c2
    echo
    echo "== broker: mosquitto on 127.0.0.1:$port"
    "$(command -v mosquitto || echo /usr/sbin/mosquitto)" -c "$tmp/mosquitto.conf" > "$tmp/mosquitto.log" 2>&1 &
    broker=$!
    echo "== daemon: k2edge serve --config config/k2edge.toml --broker 127.0.0.1:$port (log: $tmp/daemon.log)"
    "$k2" serve --config config/k2edge.toml --broker "127.0.0.1:$port" > "$tmp/daemon.log" 2>&1 &
    daemon=$!
    trap 'kill $daemon $broker 2>/dev/null; rm -rf "$tmp"' EXIT
    for _ in $(seq 240); do grep -q "serving digits" "$tmp/daemon.log" && break; kill -0 $daemon 2>/dev/null || break; sleep 0.5; done
    grep -q "serving digits" "$tmp/daemon.log" || { cat "$tmp/daemon.log"; die "the daemon did not come up"; }
    echo
    echo "== requests over MQTT 5 (request/response with correlation data)"
    for f in models/digits/samples/digit-3-21.jpg models/digits/samples/digit-7-10.jpg; do
        "$k2" request --broker "127.0.0.1:$port" --device demo --model digits "$f"
    done
    "$k2" request --broker "127.0.0.1:$port" --device demo --model digits --raw models/digits/samples/digit-5-2.jpg
    echo "-- the full JSON answer of one request:"
    "$k2" request --broker "127.0.0.1:$port" --device demo --model digits --json models/digits/samples/digit-9-4.jpg
    echo "-- and a request for a model the daemon does not serve:"
    "$k2" request --broker "127.0.0.1:$port" --device demo --model cats models/digits/samples/digit-9-4.jpg || true
    echo
    echo "== SIGTERM: the daemon drains and goes offline"
    kill -TERM $daemon
    wait $daemon && echo "daemon exited 0"
    tail -n 3 "$tmp/daemon.log"
}

test_workers() {  # a worker per core, at most 4: the daemon tests each start processes of their own
    local n; n=$(nproc 2>/dev/null || echo 1)
    echo "${K2EDGE_TEST_WORKERS:-$(( n < 4 ? n : 4 ))}"
}

case "${1:-}" in
    demo) setup; demo ;;
    test) shift; need_mosquitto; need_rtsp_server; need_chromium; setup
          exec "$VENV/bin/python" -m pytest -n "$(test_workers)" "$@" ;;
    *) echo "usage: $0 demo | test [pytest args]" >&2; exit 2 ;;
esac
