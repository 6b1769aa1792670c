"""The supervisor: owns processes, devices, logs, health and rendezvous of one run.

Rooms (one concern each; docs/design/architecture.md has the map):
  processes/   the supervision event loop, spawning, worker environment, orphan cleanup
  output/      worker output -> prefixed lines on the console and in per-worker files
  health/      heartbeats, run watchers (the GPU watch), metrics.jsonl
  gpus/        NVML and the device plan
  rendezvous/  the per-attempt store, single- and multi-node backends, SLURM
  commands/    `python -m` programs for users (select_gpu, topology, sbatch)
"""

from pathlib import Path

# The checkout gpuherd runs from: workers (`python -m worker`) and helper processes are
# started with it on PYTHONPATH, and generated scripts `cd` into it.
REPO_ROOT = Path(__file__).resolve().parents[1]
