#!/bin/bash
# The host firewall rule for one Slurm job's run listeners: the ports B+70 .. B+99 of
# the job's block (ITO_LISTEN_PORTS, see ray-node.sh) answer the job's own nodes and
# this host only. Every other host of the cluster network (other tenants' jobs, login
# sessions) is dropped before it reaches a run's lighthouse, ManagerServer, store or
# weight sync. Prints an nftables ruleset; the caller applies it (as root).
#
# From the site's Slurm prolog and epilog (root, on every node of the job):
#   prolog:  addrs=$(scontrol show hostnames "$SLURM_JOB_NODELIST" \
#                    | xargs -n1 getent ahostsv4 | awk '{print $1}' | sort -u)
#            deploy/slurm/run-ports-firewall.sh add $addrs | nft -f -
#   epilog:  deploy/slurm/run-ports-firewall.sh del | nft -f -
# The block is the job's default (20000 + 100 * (job id % 400)), or ITO_PORT_BASE when
# the prolog's environment sets it; a job submitted with its own ITO_PORT_BASE needs the
# same value here. The equivalent iptables rules, per node address A of the job:
#   iptables -A INPUT -p tcp --dport B+70:B+99 -s A -j ACCEPT   (and -i lo -j ACCEPT)
#   iptables -A INPUT -p tcp --dport B+70:B+99 -j DROP
# Usage: run-ports-firewall.sh add NODE_ADDRESS... | run-ports-firewall.sh del
set -euo pipefail
# shellcheck source=env-check.sh
. "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/env-check.sh"
ito_check_env  # before any use: every variable below has passed its pattern
: "${SLURM_JOB_ID:?run from a Slurm prolog or epilog (SLURM_JOB_ID)}"
base="${ITO_PORT_BASE:-$((20000 + 100 * (SLURM_JOB_ID % 400)))}"
low=$((base + 70)) high=$((base + 99))
table="ito_job_${SLURM_JOB_ID}"
mode="${1:-}"
case "$mode" in
  del)
    echo "delete table inet ${table}"
    exit 0
    ;;
  add) shift ;;
  *) echo "usage: run-ports-firewall.sh add NODE_ADDRESS... | del" >&2; exit 64 ;;
esac
v4=() v6=()
for addr in "$@"; do
  if [[ $addr =~ ^([0-9]{1,3}\.){3}[0-9]{1,3}$ ]]; then
    v4+=("$addr")
  elif [[ $addr =~ ^[0-9A-Fa-f:]{2,39}$ ]]; then
    v6+=("$addr")
  else
    echo "ito: a node address is malformed; refusing" >&2
    exit 64
  fi
done
[ "${#v4[@]}" -gt 0 ] || [ "${#v6[@]}" -gt 0 ] || {
  echo "ito: no node address of the job given" >&2
  exit 64
}
join() { local IFS=,; echo "$*"; }
echo "table inet ${table} {"
echo "  chain input {"
echo "    type filter hook input priority filter - 1; policy accept;"
echo "    iifname \"lo\" tcp dport ${low}-${high} accept"
if [ "${#v4[@]}" -gt 0 ]; then
  echo "    ip saddr { $(join "${v4[@]}") } tcp dport ${low}-${high} accept"
fi
if [ "${#v6[@]}" -gt 0 ]; then
  echo "    ip6 saddr { $(join "${v6[@]}") } tcp dport ${low}-${high} accept"
fi
echo "    tcp dport ${low}-${high} drop"
echo "  }"
echo "}"
