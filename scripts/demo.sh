#!/usr/bin/env bash
# Installs everything and runs the main job: the end-to-end demo on the embedded
# default (SQLite + a local Ray head), through the canonical API and the ito CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q -U pip
.venv/bin/pip install -q -e '.[test]'
export OMP_NUM_THREADS=1
exec .venv/bin/python -m orchestrator.demo "$@"
