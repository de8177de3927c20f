#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs the project with its test extras.
# Sourced by demo.sh and test.sh, so both README commands install the same way.
set -euo pipefail
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q -U pip
# --no-compile: bytecode is written on first import, for the modules that run, instead
# of for every installed module up front (44 s of the install on 2 cores). That needs
# Python allowed to write it, whatever the host's environment says.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/pip install -q --no-compile -e '.[test]'
