#!/bin/bash
# One Ray node of a booking, run by srun on each allocated node: `ray start --block`
# with the booking's mark, the node's CPUs and GPUs from Slurm's environment, and
# explicit ports from ITO_PORT_BASE:
#   +0 node manager  +1 object manager  +2 metrics export  +3 dashboard agent (http)
#   +4 dashboard agent (grpc)  +5 runtime-env agent  +6 ray client (head only)
#   +7 GCS (head only)  +8 dashboard (head only)  +9 the API server (self-contained)
# Worker processes bind ports ITO_PORT_BASE+10 .. +99.
# Usage: ray-node.sh worker|head
set -euo pipefail
role="${1:-worker}"
ray="${ITO_RAY_BIN:-ray}"
base="${ITO_PORT_BASE:?}"
cpus="${SLURM_CPUS_ON_NODE:-$(nproc)}"
gpus="${SLURM_GPUS_ON_NODE:-0}"
# The mark's amount is the node's GPUs; a CPU testbed counts its ranks instead.
mark="${ITO_MARK_AMOUNT:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 1)}"
ip="${ITO_NODE_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
ip="${ip:-127.0.0.1}"
args=(start --block --disable-usage-stats "--node-ip-address=$ip"
      "--num-cpus=$cpus" "--num-gpus=$gpus"
      "--node-manager-port=$((base + 0))" "--object-manager-port=$((base + 1))"
      "--metrics-export-port=$((base + 2))" "--dashboard-agent-listen-port=$((base + 3))"
      "--dashboard-agent-grpc-port=$((base + 4))" "--runtime-env-agent-port=$((base + 5))"
      "--min-worker-port=$((base + 10))" "--max-worker-port=$((base + 99))")
if [ -n "${ITO_OBJECT_STORE_BYTES:-}" ]; then
  args+=("--object-store-memory=${ITO_OBJECT_STORE_BYTES}")
fi
if [ "$role" = head ]; then
  # The head runs no work: runs go only to booked nodes.
  args+=(--head "--port=$((base + 7))" "--ray-client-server-port=$((base + 6))" --num-cpus=0
         --include-dashboard=true "--dashboard-port=$((base + 8))" --dashboard-host=127.0.0.1)
else
  args+=("--address=${ITO_RAY_ADDRESS:?}" "--resources={\"booking:${ITO_BOOKING:?}\": ${mark}}")
fi
if [ -n "${ITO_RAY_TEMP_DIR:-}" ]; then
  args+=("--temp-dir=${ITO_RAY_TEMP_DIR}")
fi
export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
exec "$ray" "${args[@]}"
