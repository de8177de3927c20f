#!/bin/bash
# Wait (bounded: ITO_JOIN_TIMEOUT_S, default 300) until N live nodes carry the Ray
# resource MARK in the cluster at ADDRESS. Usage: wait-joined.sh ADDRESS MARK N
set -euo pipefail
address="$1" mark="$2" want="$3"
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
