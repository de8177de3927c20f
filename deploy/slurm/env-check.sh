#!/bin/bash
# Sourced by every script here. Each variable a job takes from its environment is
# checked against a strict pattern before any use, so none reaches bash arithmetic
# ($((...)) runs the command in a value like 'a[$(cmd)]'), a JSON literal (the
# booking's Ray resource) or a command line unchecked. A bad value stops the job
# with exit 64 and is not echoed. Empty counts as unset; required variables are
# checked by the scripts themselves (${X:?}).

ITO_ENV_INVALID=64

# ito_valid NAME ERE: NAME, when set and not empty, must match ERE (anchored).
ito_valid() {
  local value="${!1:-}"
  [ -n "$value" ] || return 0
  if ! [[ $value =~ $2 ]]; then
    echo "ito: $1 is malformed; refusing to start" >&2
    exit "$ITO_ENV_INVALID"
  fi
}

ito_check_env() {
  local path='^/[A-Za-z0-9_./+-]{0,4095}$' bin='^[A-Za-z0-9_./+-]{1,4096}$' v
  # The booking id as the backend's registry spells it (BookingFile.booking_id).
  ito_valid ITO_BOOKING '^[A-Za-z0-9_.:-]{1,128}$'
  # This node's name as the booking lists it (a booking file's nodes), and Slurm's.
  ito_valid ITO_NODE_NAME '^[A-Za-z0-9_.:-]{1,128}$'
  ito_valid SLURMD_NODENAME '^[A-Za-z0-9_.:-]{1,128}$'
  # A port block of 100 must fit below 65536 and above the privileged ports.
  ito_valid ITO_PORT_BASE '^[1-9][0-9]{3,4}$'
  if [ -n "${ITO_PORT_BASE:-}" ] && { [ "$ITO_PORT_BASE" -lt 1024 ] ||
                                       [ "$ITO_PORT_BASE" -gt 65435 ]; }; then
    echo "ito: ITO_PORT_BASE is outside 1024..65435; refusing to start" >&2
    exit "$ITO_ENV_INVALID"
  fi
  ito_valid SLURM_JOB_ID '^[0-9]{1,10}$'
  ito_valid SLURM_JOB_NUM_NODES '^[1-9][0-9]{0,5}$'
  ito_valid SLURM_CPUS_ON_NODE '^[0-9]{1,5}$'
  ito_valid SLURM_GPUS_ON_NODE '^[0-9]{1,4}$'
  ito_valid ITO_JOIN_TIMEOUT_S '^[1-9][0-9]{0,5}$'
  ito_valid ITO_MARK_AMOUNT '^[0-9]{1,6}(\.[0-9]{1,6})?$'
  ito_valid ITO_OBJECT_STORE_BYTES '^[1-9][0-9]{0,15}$'
  ito_valid ITO_RAY_ADDRESS '^([A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:]{2,39}\]):[0-9]{1,5}$'
  ito_valid ITO_NODE_IP '^([0-9.]{7,15}|[0-9A-Fa-f:]{2,39})$'
  ito_valid ITO_API_HOST '^[A-Za-z0-9.:-]{1,253}$'
  for v in ITO_DB ITO_VAR_DIR ITO_LAUNCH_KEY_FILE ITO_RAY_TEMP_DIR ITO_SLURM_DIR; do
    ito_valid "$v" "$path"
  done
  for v in ITO_RAY_BIN ITO_PYTHON ITO_BACKEND_BIN; do
    ito_valid "$v" "$bin"
  done
}
