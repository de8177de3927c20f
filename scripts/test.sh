#!/usr/bin/env bash
# Installs everything (venv, the project, Debian's prometheus for the scrape test)
# and runs the whole test suite. Used by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
if [ "$(id -u)" = 0 ]; then
  # CI runs as root: the real-Prometheus scrape test must run there, never be skipped.
  if ! command -v prometheus >/dev/null 2>&1; then
    if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
          --no-install-recommends prometheus) >/tmp/ito-prometheus-install.log 2>&1; then
      cat /tmp/ito-prometheus-install.log >&2
      echo "error: could not install Debian's prometheus (needed by the scrape test)" >&2
      exit 1
    fi
  fi
  export ITO_REQUIRE_PROMETHEUS=1
else
  command -v prometheus >/dev/null 2>&1 \
    || echo "warning: prometheus is not installed and this is not root: the scrape test will be skipped" >&2
fi
if ! { command -v slurmctld && command -v munged; } >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # The Slurm deploy test starts a real single-node Slurm (tests/deploy/test_slurm.py).
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge) >/dev/null 2>&1 \
    || echo "warning: could not install slurm-wlm and munge; the Slurm test will be skipped" >&2
fi
if [ "$(id -u)" = 0 ]; then
  # The store's contract and replica tests run against a real PostgreSQL: in CI they
  # must run, never be skipped (tests/helpers/postgres.py starts it in a temp folder).
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
          --no-install-recommends postgresql) >/tmp/ito-postgres-install.log 2>&1; then
      cat /tmp/ito-postgres-install.log >&2
      echo "error: could not install Debian's postgresql (needed by the store tests)" >&2
      exit 1
    fi
  fi
  export ITO_REQUIRE_POSTGRES=1
fi
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected no tests: that is not a failure of the install.
if [ "$rc" = 5 ]; then echo "no tests collected"; exit 0; fi
exit "$rc"
