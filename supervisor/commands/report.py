"""`python -m supervisor.commands.report RUN [RUN ...]`: HTML + PNG report of runs (`gpuherd report`).

Each RUN is a run directory or a run id under --logs. One RUN: written to
<RUN>/report/; several: compared, written to <first RUN>/report-vs-<other ids>/
(or --out DIR). Prints the path of report.html.
Exit codes: 0 written; 2 a RUN names no run, or the output cannot be written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpuherd.cli import OneLineParser, die
from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from supervisor.views import resolve_run

PROG = "gpuherd report"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directory or run id; several are compared")
    parser.add_argument("--logs", default="logs", metavar="DIR", help="where runs are (system.run_root; default logs)")
    parser.add_argument("--out", default=None, metavar="DIR", help="write here instead of into the first run")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run_dirs = [resolve_run(run, Path(args.logs)) for run in args.runs]
    except GpuherdError as exc:
        die(exc.message, exc.exit_code, PROG)
    if len(set(run_dirs)) != len(run_dirs):
        die("the same run is named twice", prog=PROG)
    from supervisor.views import write_report  # matplotlib loads only once the input is good

    try:
        written = write_report(run_dirs, Path(args.out) if args.out else None)
    except GpuherdError as exc:
        die(exc.message, exc.exit_code, PROG)
    except OSError as exc:
        die(f"cannot write the report: {exc}", ExitCode.USAGE, PROG)
    print(written.html)
    return 0


if __name__ == "__main__":
    sys.exit(main())
