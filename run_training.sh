#!/usr/bin/env bash
# Train on every GPU (or 2 CPU workers without one) under the gpuherd supervisor (= `gpuherd run`).
#   bash run_training.sh --debug                       the debug preset end to end
#   bash run_training.sh --gpus 0,2 --config my.json   chosen GPUs, a partial config
#   bash run_training.sh --nproc-per-node 2 train.py --lr 1e-3   any torchrun-style script, torchrun's flags
# Works from any directory; paths you type are relative to where you are.
# Exit codes: see docs/reference/exit-codes.md. Help: bash run_training.sh --help
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/python.sh"
exec "$GPUHERD_PY" -m supervisor "$@"
