#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs the project with its test extras.
# Sourced by demo.sh and test.sh, so both README commands install the same way.
set -euo pipefail
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q -U pip
.venv/bin/pip install -q -e '.[test]'
