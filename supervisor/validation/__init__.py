"""A launch's inputs, checked before anything is written or spawned: what would otherwise
fail late, as a traceback after the run folder exists or at the first save.

  validate_launch(cfg, plan, train) (launch.py): the worker count and the open-file
    limit (limits.py), the backend against the devices, and every directory the run
    writes (paths.py): no file in the way, no over-long component, writable (a probe file)
  LaunchError (gpuherd/errors.py, with every failure's class): one line, exit 2

The machine's health (free disk for checkpoints, GPUs, the master port) is judged by
the pre-flight checks in supervisor/health/, after these.
"""

from gpuherd.errors import LaunchError
from supervisor.validation.launch import validate_launch

__all__ = ["LaunchError", "validate_launch"]
