"""`python -m supervisor.commands.spare RUN [--device D]`: a warm spare for a shrunk run (`gpuherd spare`).

RUN is a run directory or a run id under --logs. The run's supervisor starts one warm spare
(on the device the lost rank left, or the lost rank's device named with --device when several
were lost) and the shrunk group grows back to it once it is warm, at a step boundary; the
command returns as soon as the spare is started (`gpuherd top` shows the regrow).
Exit codes: 0 the spare started; 2 RUN names no run, or --device names no device the run
lost (a training rank's, or none of the run's; shrunk or not) (one line on stderr); 10 refused: the run is not running, not shrunk, stopping, or a
spare already starts for it; 1 no answer from the supervisor within --timeout.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from gpuherd.cli import OneLineParser, die
from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from gpuherd.files import try_flock
from supervisor.processes import device_name, read_answer, request_path, write_request
from supervisor.views import resolve_run

PROG = "gpuherd spare"
POLL_S = 0.1


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", metavar="RUN", help="run directory or run id")
    parser.add_argument("--logs", default="logs", metavar="DIR", help="where runs are (system.run_root; default logs)")
    parser.add_argument("--device", default=None, metavar="D",
                        help="the lost rank's device the spare runs on (GPU3, 3, cuda:3, CPU1 or a GPU UUID; "
                             "default: the device of the lowest lost rank without a spare)")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="S",
                        help="seconds to wait for the supervisor's answer (default 30)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.timeout <= 0:
        die(f"--timeout {args.timeout:g}: must be > 0 seconds", prog=PROG)
    try:
        device = None if args.device is None else device_name(args.device)
        run_dir = resolve_run(args.run, Path(args.logs))
    except ValueError as exc:
        die(str(exc), prog=PROG)
    except GpuherdError as exc:
        die(exc.message, exc.exit_code, PROG)
    why = not_running(run_dir)
    if why is not None:
        die(f"run {run_dir.name} is not running ({why}): no spare started", ExitCode.REFUSED, PROG)
    try:
        request = write_request(run_dir, device)
    except OSError as exc:
        die(f"cannot write the request into {run_dir}: {exc.strerror or exc}", ExitCode.FAILURE, PROG)
    deadline = time.monotonic() + args.timeout
    while (answer := read_answer(run_dir, request.id)) is None:
        if time.monotonic() >= deadline:
            request_path(run_dir, request.id).unlink(missing_ok=True)  # withdrawn: a later start never acts on it
            die(f"no answer from the supervisor of run {run_dir.name} within {args.timeout:g} s (stopped, or "
                "between two attempts?): request withdrawn", ExitCode.FAILURE, PROG)
        time.sleep(POLL_S)
    if not answer.granted:
        die(answer.message, answer.code, PROG)
    print(f"{PROG}: {answer.message}", flush=True)
    return 0


def not_running(run_dir: Path) -> str | None:
    """Why no supervisor runs `run_dir` (None: one holds its run.lock). The probe's shared lock is
    dropped at once; a start of the run racing it for that instant is refused, as two starts are."""
    try:
        fd = os.open(run_dir / "run.lock", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "no run.lock: no supervisor ever held it"
    except OSError as exc:
        return f"run.lock cannot be opened: {exc.strerror or exc}"
    try:
        return None if not try_flock(fd, shared=True) else "its supervisor has ended"
    except OSError:  # a filesystem without locks: the supervisor's answer (or its silence) tells
        return None
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
