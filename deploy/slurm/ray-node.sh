#!/bin/bash
# One Ray node of a booking, run by srun on each allocated node: `ray start --block`
# with the booking's mark, the node's CPUs and GPUs from Slurm's environment, and
# explicit ports from ITO_PORT_BASE (B), a block of 100 per Slurm job:
#   head:   B+0 node manager  B+1 object manager  B+2 metrics  B+3 dashboard agent (http)
#           B+4 dashboard agent (grpc)  B+5 runtime-env agent  B+6 ray client  B+7 GCS
#           B+8 dashboard  B+9 the API server (self-contained variant)
#   worker: B+10 .. B+15 the same node ports as the head's B+0 .. B+5
#           B+20 .. B+69 worker processes (actors)
#           B+70 .. B+99 the runs' own listeners (ITO_LISTEN_PORTS: the torchft
#                        lighthouse's front, the groups' ManagerServers and stores, heal
#                        transfers, the weight sync), which the site firewall opens to
#                        the job's own nodes only (run-ports-firewall.sh)
# so a head and a worker on one host (the batch host) do not collide either.
# Usage: ray-node.sh worker|head
set -euo pipefail
# shellcheck source=env-check.sh
. "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/env-check.sh"
ito_check_env  # before any use: every variable below has passed its pattern
# Ray's workers inherit this: run scratch and checkpoints are the backend user's alone.
umask 077
role="${1:-worker}"
case "$role" in head | worker) ;; *) echo "usage: ray-node.sh worker|head" >&2; exit 64 ;; esac
ray="${ITO_RAY_BIN:-ray}"
base="${ITO_PORT_BASE:?}"
workers="--min-worker-port=$((base + 20)) --max-worker-port=$((base + 69))"
# Ray's workers inherit it from `ray start`: where a run's listeners take their ports.
export ITO_LISTEN_PORTS="$((base + 70))-$((base + 99))"
if [ "$role" = head ]; then
  workers="--min-worker-port=0 --max-worker-port=0"  # the head runs no actors
else
  base=$((base + 10))
fi
cpus="${SLURM_CPUS_ON_NODE:-$(nproc)}"
gpus="${SLURM_GPUS_ON_NODE:-0}"
if [ "$role" = head ]; then cpus=0 gpus=0; fi  # the head runs no work
# The mark's amount is the node's GPUs; a CPU testbed counts its ranks instead.
mark="${ITO_MARK_AMOUNT:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 1)}"
# The booking's name for this node (its booking file's `nodes`): a resource of its own,
# so the backend knows which Ray node is which booking node (a node taken back from the
# booking drains the run's groups on it). Slurm's node name unless set.
ITO_NODE_NAME="${ITO_NODE_NAME:-${SLURMD_NODENAME:-$(hostname -s)}}"
ito_valid ITO_NODE_NAME '^[A-Za-z0-9_.:-]{1,128}$'
ip="${ITO_NODE_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
ip="${ip:-127.0.0.1}"
args=(start --block --disable-usage-stats "--node-ip-address=$ip"
      "--num-cpus=$cpus" "--num-gpus=$gpus"
      "--node-manager-port=$((base + 0))" "--object-manager-port=$((base + 1))"
      "--metrics-export-port=$((base + 2))" "--dashboard-agent-listen-port=$((base + 3))"
      "--dashboard-agent-grpc-port=$((base + 4))" "--runtime-env-agent-port=$((base + 5))"
      $workers)
if [ -n "${ITO_OBJECT_STORE_BYTES:-}" ]; then
  args+=("--object-store-memory=${ITO_OBJECT_STORE_BYTES}")
fi
if [ "$role" = head ]; then
  # The head runs no work: runs go only to booked nodes.
  args+=(--head "--port=$((base + 7))" "--ray-client-server-port=$((base + 6))"
         --include-dashboard=true "--dashboard-port=$((base + 8))" --dashboard-host=127.0.0.1)
else
  args+=("--address=${ITO_RAY_ADDRESS:?}"
         "--resources={\"booking:${ITO_BOOKING:?}\": ${mark}, \"booking-node:${ITO_NODE_NAME}\": 1}")
fi
if [ -n "${ITO_RAY_TEMP_DIR:-}" ]; then
  args+=("--temp-dir=${ITO_RAY_TEMP_DIR}")
fi
export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
if [ "$role" = head ]; then
  # Token auth stays on; the token (~/.ray/auth_token, shared file system) is made once.
  "$ray" get-auth-token --generate >/dev/null
fi
# Secrets stay with the server: this job's environment may be the API server's (the
# self-contained variant), with the store's URL and password in it. `ray start`, and
# so every Ray process on this node, gets only these names of it: the allowlist of
# orchestrator/runtime/ray_cluster.py (RAY_ENV_NAMES, RAY_ENV_PREFIXES), which
# tests/deploy/test_slurm_env.py keeps equal to this one.
ray_env_names=(PATH HOME USER LOGNAME SHELL LANG LANGUAGE TZ TMPDIR LD_LIBRARY_PATH
  VIRTUAL_ENV PYTHONPATH PYTHONUNBUFFERED OMP_NUM_THREADS MKL_NUM_THREADS
  OPENBLAS_NUM_THREADS TOKENIZERS_PARALLELISM NVIDIA_VISIBLE_DEVICES
  NVIDIA_DRIVER_CAPABILITIES CUBLAS_WORKSPACE_CONFIG PYTORCH_CUDA_ALLOC_CONF HF_HOME
  HF_HUB_CACHE HF_DATASETS_CACHE HF_HUB_OFFLINE HF_DATASETS_OFFLINE TRANSFORMERS_OFFLINE
  XDG_CACHE_HOME ITO_LAUNCH_KEY_FILE ITO_CONFIGS_DIR ITO_DATA_CACHE ITO_NODE_IP
  ITO_LISTEN_PORTS)
ray_env_prefixes=(RAY_ LC_ CUDA_ NCCL_ GLOO_ TORCH_)
keep=()
while read -r name; do
  for allowed in "${ray_env_names[@]}"; do
    if [ "$name" = "$allowed" ]; then keep+=("$name=${!name}"); continue 2; fi
  done
  for prefix in "${ray_env_prefixes[@]}"; do
    if [[ $name == "$prefix"* ]]; then keep+=("$name=${!name}"); continue 2; fi
  done
done < <(compgen -e)
exec env -i "${keep[@]}" "$ray" "${args[@]}"
