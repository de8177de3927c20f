#!/usr/bin/env bash
# Installs everything and runs the main job: the end-to-end demo on the embedded
# default (SQLite + a local Ray head), through the canonical API and the ito CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m orchestrator.demo "$@"
