"""gpuherd's own markers (gpuherd/contract.py's INTERNAL_VARS) found in the supervisor's environment.

They are set by gpuherd for the processes it starts; one exported in the user's shell (copied from
a worker's environment, a debugger, a job template) is no setting: with `GPUHERD_STANDBY=1` every
rank waited for a rank nobody sent and the run ended 0 with the script never run; with
`GPUHERD_SPARE=1` the built-in trainer's workers waited as spares and trained nothing. So they are
taken out of the supervisor's environment first thing (no helper, worker, spare or standby started
from it sees them; worker_env drops them from any base it is given too) and named in one line once
the run directory is open (a refused launch still prints one line only).
"""

from __future__ import annotations

import os

from gpuherd import contract


def take_inherited_markers() -> dict[str, str]:
    """The markers in this process's environment (name: value, by name), removed from it."""
    found = {name: os.environ[name] for name in sorted(contract.INTERNAL_VARS) if name in os.environ}
    for name in found:
        del os.environ[name]
    return found


def markers_notice(found: dict[str, str]) -> str | None:
    """One line naming them, or None."""
    if not found:
        return None
    one = len(found) == 1
    names = ", ".join(f"{name}={value}" for name, value in found.items())
    return (f"ignored {names} from gpuherd's own environment: {'a marker' if one else 'markers'} gpuherd sets "
            f"only for the processes it starts, never a setting; no process of this run inherits "
            f"{'that value' if one else 'those values'}")
