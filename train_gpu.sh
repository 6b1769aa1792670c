#!/usr/bin/env bash
# Usage: ./train_gpu.sh <gpu_id> [args]     (gpu_id defaults to 0)
# Runs one worker on that GPU through the supervisor, so logs, monitoring, NaN
# debugging and teardown are the same as a multi-GPU run. <gpu_id> is the id
# nvidia-smi shows. Exit 2: bad id, no such GPU, no GPU, or the GPU is busy
# (--force shares a busy GPU); 4: the GPU is lost. Everything after the id goes to the supervisor
# (--debug, --preset, --config FILE.json, --max-steps N, --set k=v, --force).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/python.sh"

GPU_ID=0
if [[ $# -gt 0 && "$1" != -* ]]; then
  if [[ ! "$1" =~ ^[0-9]+$ ]]; then
    echo "train_gpu.sh: error: GPU id must be a non-negative integer as nvidia-smi shows it, got '$1' (usage: ./train_gpu.sh <gpu_id> [args])" >&2
    exit 2
  fi
  GPU_ID=$1
  shift
elif [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,7s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
  exit 0
fi
exec "$GPUHERD_PY" -m supervisor --gpus "$GPU_ID" "$@"
