#!/usr/bin/env bash
# K ranks on this machine (Gloo on CPU, NCCL on GPUs), same config as a one-process run.
#   launch/torchrun_local.sh CONFIG.yaml [K] [extra gossip-pfl run args...]
set -euo pipefail
config=${1:?usage: $0 CONFIG.yaml [NPROC] [--set key=value ...]}
shift
nproc=2
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then  # K is optional: "CONFIG --set k=v" keeps 2 ranks
  nproc=$1
  shift
fi
exec torchrun --standalone --nproc_per_node="$nproc" -m gossip_pfl run "$config" "$@"
