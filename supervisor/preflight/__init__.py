"""Before anything is written or spawned: the checks that would otherwise fail late.

  preflight(cfg, plan, train) (checks.py): worker count and open-file limit (limits.py),
    the backend against the devices, and every directory the run writes (paths.py): no
    file in the way, no over-long component, writable (a probe file), room for two
    checkpoints of the planned model (gpuherd/model_size.py)
  PreflightError (errors.py): one line, exit 2
"""

from supervisor.preflight.checks import planned_vocab, preflight
from supervisor.preflight.errors import PreflightError

__all__ = ["PreflightError", "planned_vocab", "preflight"]
