#!/usr/bin/env bash
# k2edge quickstart: set up a virtual environment and run the demo or the whole test suite.
#
#   ./quickstart.sh demo          build, run and evaluate the bundled demo model
#   ./quickstart.sh test [ARGS]   run the whole test suite (ARGS go to pytest, e.g. -m "not slow")
#
# Works on a fresh Debian/Ubuntu machine with Python 3.10+. The environment lives in .venv
# (override with K2EDGE_VENV); a second run reuses it.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${K2EDGE_VENV:-.venv}
PY=${PYTHON:-python3}

die() { echo "quickstart: $*" >&2; exit 1; }

need_python() {
    command -v "$PY" >/dev/null || die "$PY not found; install Python 3.10+ (apt-get install python3)"
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "Python 3.10+ needed, found $("$PY" -V 2>&1)"
}

setup() {
    need_python
    if [ ! -x "$VENV/bin/python" ]; then
        if ! "$PY" -m venv "$VENV" 2>/dev/null; then
            rm -rf "$VENV"
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
                apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
                "$PY" -m venv "$VENV"
            else
                die "python3 -m venv failed; install the venv module: sudo apt-get install python3-venv"
            fi
        fi
    fi
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    "$VENV/bin/python" -m pip install -q -e ".[dev]"
}

demo() {
    local k2="$VENV/bin/k2edge" model=models/digits/model.onnx
    echo "== plan: where each layer of the demo model runs under profile c1 (AGX Orin)"
    "$k2" plan "$model" --profile c1
    echo
    echo "== build: normalise, calibrate INT8, extract segments (cached under ~/.cache/k2edge)"
    "$k2" build "$model" --profile c2
    echo
    echo "== infer: the sample JPEGs through the c2 pipeline"
    "$k2" infer "$model" --profile c2 --top-k 2 models/digits/samples/*.jpg
    echo
    echo "== eval: top-1 on the held-out set, FP32 reference vs FP16 vs INT8"
    for p in cpu-dev c5 c2; do "$k2" eval "$model" --profile "$p" --dataset models/digits/eval.npz; done
}

case "${1:-}" in
    demo) setup; demo ;;
    test) shift; setup; exec "$VENV/bin/python" -m pytest "$@" ;;
    *) echo "usage: $0 demo | test [pytest args]" >&2; exit 2 ;;
esac
