#!/usr/bin/env bash
# Usage: ./train_auto_gpu.sh [args]
# Picks the least-used GPU (utilization averaged over GPUHERD_SELECT_WINDOW
# seconds, default 1; free memory; no other processes; not throttling), claims
# it so a second auto job started at the same moment picks another one, prints
# `Using GPU N (lowest utilization)` and then runs exactly like
# `./train_gpu.sh N [args]`, holding the claim until the run ends.
# Exit 2: no GPU at all, or every GPU busy or claimed (--force shares one); 4: every GPU lost.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/python.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,8s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
  exit 0
fi
exec "$GPUHERD_PY" -m supervisor.commands.select_gpu --run -- "$@"
