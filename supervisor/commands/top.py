"""`python -m supervisor.commands.top [RUN]`: watch a run live (`gpuherd top`).

RUN is a run directory or a run id under --logs (default: the newest run there).
Exit codes: 0 shown; 2 RUN names no run (one line on stderr).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from gpuherd.cli import OneLineParser, die
from gpuherd.errors import GpuherdError
from supervisor.views import RunFiles, RunState, resolve_run, watch

PROG = "gpuherd top"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", metavar="RUN", help="run directory or run id (default: the newest run)")
    parser.add_argument("--logs", default="logs", metavar="DIR", help="where runs are (system.run_root; default logs)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit (for scripts and tests)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between redraws (default 1)")
    parser.add_argument("--width", type=int, default=None, metavar="COLS",
                        help="render this wide (default: the terminal's width; 200 when not a terminal)")
    parser.add_argument("--all-ranks", action="store_true",
                        help="one row per rank however many there are (default: over 32 ranks, one row per "
                             "status and the worst ranks)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.interval <= 0:
        die(f"--interval {args.interval:g}: must be > 0 seconds", prog=PROG)
    try:
        run_dir = resolve_run(args.run, Path(args.logs))
    except GpuherdError as exc:
        die(exc.message, exc.exit_code, PROG)
    try:
        # piped or redirected (a file, `less`, a script): rich would assume 80 columns and cut every cell
        width = args.width or (None if sys.stdout.isatty() else 200)
        # the state keeps what each rank shows, not every record: memory stays flat however long the run
        watch(RunState(RunFiles(run_dir, keep_records=False)), Console(width=width), once=args.once,
              interval=args.interval, all_ranks=args.all_ranks)
    except KeyboardInterrupt:  # Ctrl-C is how one leaves a live view: not an error
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
