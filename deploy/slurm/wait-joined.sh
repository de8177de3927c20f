#!/bin/bash
# Wait (bounded: ITO_JOIN_TIMEOUT_S, default 300) until N live nodes carry the Ray
# resource MARK in the cluster at ADDRESS. Usage: wait-joined.sh ADDRESS MARK N
set -euo pipefail
# shellcheck source=env-check.sh
. "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/env-check.sh"
ito_check_env
address="${1:?usage: wait-joined.sh ADDRESS MARK N}" mark="${2:?}" want="${3:?}"
# The arguments are checked like the environment: they reach Python and arithmetic.
ITO_ARG_ADDRESS="$address" ITO_ARG_MARK="$mark" ITO_ARG_WANT="$want"
ito_valid ITO_ARG_ADDRESS '^([A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:]{2,39}\]):[0-9]{1,5}$'
ito_valid ITO_ARG_MARK '^[A-Za-z0-9_.:-]{1,136}$'
ito_valid ITO_ARG_WANT '^[1-9][0-9]{0,5}$'
python="${ITO_PYTHON:-python3}"
deadline=$(( $(date +%s) + ${ITO_JOIN_TIMEOUT_S:-300} ))
while :; do
  have=$(RAY_AUTH_MODE=token "$python" - "$address" "$mark" <<'PY' 2>/dev/null || echo 0
import sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(sum(1 for n in ray.nodes() if n["Alive"] and sys.argv[2] in n["Resources"]))
PY
)
  have="${have##*$'\n'}"
  if [ "${have:-0}" -ge "$want" ]; then
    echo "ito: ${have} of ${want} nodes marked ${mark} joined"
    exit 0
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "ito: only ${have:-0} of ${want} nodes marked ${mark} joined in time" >&2
    exit 1
  fi
  sleep 2
done
