#!/usr/bin/env bash
# Installs everything (venv, the project, the system tools some tests drive for real)
# and runs the whole test suite. Used by the README and by .ci/run.
#
# In CI (CI=true, or as root) every tool below is installed or the run fails, and
# ITO_REQUIRE_<TOOL>=1 turns the tests' "tool missing" skip into a failure
# (tests/helpers/tools.py). Elsewhere a missing tool is a warning and a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh

in_ci() { [ "${CI:-}" = true ] || [ "$(id -u)" = 0 ]; }

# Debian's postgresql keeps initdb/pg_ctl under /usr/lib/postgresql/<major>/bin.
have() {
  local b
  for b in "$@"; do
    command -v "$b" >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/$b" >/dev/null \
      || return 1
  done
}

# require TOOL "binaries" "apt packages (alternatives separated by |)" "what needs it"
require() {
  local tool=$1 bins=$2 pkgs=$3 why=$4 log="/tmp/ito-install-$1.log" alt
  if ! have $bins && in_ci; then
    : >"$log"
    apt-get update -qq >>"$log" 2>&1 || true
    IFS='|' read -ra alts <<<"$pkgs"
    for alt in "${alts[@]}"; do
      # shellcheck disable=SC2086 # word-split the package list on purpose
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $alt \
        >>"$log" 2>&1 && break
    done
  fi
  if have $bins; then
    if in_ci; then export "ITO_REQUIRE_$tool=1"; fi
  elif in_ci; then
    cat "$log" >&2 2>/dev/null || true
    echo "error: could not install $pkgs (provides $bins, needed by $why)" >&2
    exit 1
  else
    echo "warning: $bins not installed and this is not CI: $why will be skipped" >&2
  fi
}

require PROMETHEUS "prometheus" "prometheus" "the real-Prometheus scrape test"
require SLURM "slurmctld slurmd munged sbatch" "slurm-wlm munge" "the single-node Slurm test"
require KUBECTL "kubectl" "kubectl|kubernetes-client" "the deploy/k8s render tests"
require SS "ss" "iproute2" "the Ray head listener test"
require POSTGRES "initdb pg_ctl" "postgresql" "the PostgreSQL store tests"
# The outsider test builds a network namespace and a veth pair: root only.
if [ "$(id -u)" = 0 ]; then
  require NETNS "ip" "iproute2" "the outsider network test (tests/runtime/test_outsider.py)"
fi
# Some tests need root (a file chowned to another uid, Slurm's daemons): CI runs them,
# so a CI runner that is not root fails them instead of skipping them.
if in_ci; then export ITO_REQUIRE_ROOT=1; fi

# Lint, format and types are part of the suite: a change that breaks one fails CI
# (mypy's config holds every package to --strict's flags).
# mypy's cache lives outside the clone, one per clone path (CI clones afresh): a cold
# check is ~70 s of CPU, one from the last run's cache ~4 s. mypy compares the hash of
# every file whose mtime changed, so a fresh clone's unchanged files reuse their
# entries and what changed is checked again. ITO_MYPY_CACHE_DIR sets the folder.
repo_key=$(pwd -P | sha256sum | cut -c1-12)
export MYPY_CACHE_DIR="${ITO_MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ito-train/mypy-$repo_key}"
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
.venv/bin/python -m mypy

# One process by default: on the 2-core testbed the suite is bound by its CPU work, and
# 3 pytest-xdist workers took as long (42.8 min) with load failures (docs/testing.md).
# ITO_TEST_WORKERS=N runs it on N workers (`-n N --dist loadgroup`); the tests that must
# share a worker carry an xdist group (tests/helpers/xdist_groups.py).
pytest_args=()
if [ "${ITO_TEST_WORKERS:-0}" != 0 ]; then
  pytest_args+=(-n "$ITO_TEST_WORKERS" --dist loadgroup)
fi
# CI logs name the slowest tests, so a slow one is seen when it lands.
if in_ci; then pytest_args+=(--durations=25); fi

set +e
.venv/bin/python -m pytest "${pytest_args[@]}" "$@"
rc=$?
set -e
# pytest exits 5 when it collected no tests: that is not a failure of the install.
if [ "$rc" = 5 ]; then echo "no tests collected"; exit 0; fi
exit "$rc"
