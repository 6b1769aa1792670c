"""The end of a run, once its last attempt is over: summary.json, every node's outcome on
node 0, the root-cause block on the console, the report, and the requeue of a preempted
SLURM job.

The requeue's `scontrol` calls come last, after everything the run writes, each bounded by
slurm_env's timeout: nothing waits on SLURM while a worker runs, and a SLURM that does not
answer delays the exit by at most those timeouts.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from loguru import logger

from supervisor.attempt_policy import requeue_wanted
from supervisor.output import STDERR, Console
from supervisor.rendezvous import Rendezvous, job_info, requeue_after_preemption
from supervisor.summary import RootCause, Summary
from supervisor.torchrun import write_launcher_error_file


class RunEnd:
    """Says how the run ended, everywhere it must be said."""

    def __init__(self, rendezvous: Rendezvous, console: Console, run_dir: Path, report: bool) -> None:
        """`report`: system.report, the HTML report built at the end (else its command is named)."""
        self.rendezvous, self.console, self.run_dir, self.report = rendezvous, console, run_dir, report

    def close(self, summary: Summary, cause: RootCause | None) -> None:
        node_rank = self.rendezvous.node_rank
        if node_rank != 0:  # on disk before node 0 hears of this node's end (and may requeue the job)
            self.write_summary(summary)
        nodes = self._gather_outcomes(summary)
        summary.node_outcomes = nodes or []
        block = summary.block()
        if node_rank == 0:
            self.write_summary(summary)
        write_launcher_error_file(dict(os.environ), cause, summary.workers)
        logger.bind(file_only=True).info(block)  # the console gets it below, unprefixed
        if nodes is None:  # node 0 prints the job's one summary, this node's outcome in it
            block = (f"gpuherd: node {summary.node_rank} ended with exit {summary.exit_code}; the job's summary is "
                     f"printed by node 0; this node's: {self.run_dir}/summary.json")
        self.console.write(STDERR, block.encode() + b"\n")
        if self.report:
            from supervisor.views import report_after_run  # matplotlib: only when a report is wanted

            html = report_after_run(self.run_dir)
            if html is not None:
                logger.info(f"report: {html} (figures beside it; `gpuherd report RUN RUN` compares runs)")
        else:  # not on the exit path: a scheduler, a restart or a Ctrl-C never waits for matplotlib
            logger.info(f"report: gpuherd report {self.run_dir} (HTML + figures from the run's files, "
                        "whenever you want them)")
        self._requeue_if_preempted(cause, summary)  # last: SLURM signals the job's processes then

    def write_summary(self, summary: Summary) -> None:
        try:
            summary.write(self.run_dir / "summary.json")
        except OSError as exc:  # the log disk failed: the summary goes to the console instead, whole
            logger.warning(f"summary.json could not be written to {self.run_dir} ({exc.strerror}): here it is")
            self.console.write(STDERR, summary.to_json() + b"\n")

    def _requeue_if_preempted(self, cause: RootCause | None, summary: Summary) -> None:
        """Node 0 of a preempted requeueable job, once every node has ended and written its
        summary: the requeue SLURM does not do for a job that stopped within its GraceTime."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if not requeue_wanted(cause, node_rank=self.rendezvous.node_rank, slurm_job_id=job_id):
            return
        requeued = requeue_after_preemption(job_id, job_info(job_id))
        if requeued is not None:
            logger.warning(requeued)
            summary.notes.append(requeued)
            self.write_summary(summary)

    def _gather_outcomes(self, summary: Summary) -> list[dict] | None:
        """Multi-node: every node's outcome on node 0, None on the others; [] on one node."""
        if self.rendezvous.nnodes < 2:
            return []
        mine = {"node": summary.node_rank, "host": socket.gethostname(), "exit_code": summary.exit_code,
                "outcome": summary.outcome, "final_save": summary.final_save, "run_dir": summary.run_dir}
        return self.rendezvous.gather_outcomes(mine)
