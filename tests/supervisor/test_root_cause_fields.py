"""A root cause carries its facts as fields: `kind` is a CauseKind, a stop names its `signal`,
a SLURM stop says so (`slurm_stop`, `preempted`), `node` and `rank` say where. The message is
for people: no decision reads a fact back out of its words."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import orjson
import pytest

from supervisor.rendezvous import slurm_env
from supervisor.rendezvous.multi import MultiNode
from supervisor.summary import CauseKind, RootCause
from tests.supervisor import helpers as sh

PREEMPTED_JOB = {"JobState": "COMPLETING", "PreemptTime": "2026-11-25T16:00:00"}


def test_the_kind_is_an_enum_checked_when_the_cause_is_built():
    cause = RootCause("terminated", 143, "the supervisor received SIGTERM", signal="SIGTERM")
    assert cause.kind is CauseKind.TERMINATED and cause.kind == "terminated"  # summary.json keeps the word
    assert dataclasses.replace(cause, kind="hang").kind is CauseKind.HANG
    with pytest.raises(ValueError):
        RootCause("hnag", 124, "a typo is no kind")


def test_the_fields_cross_nodes_and_files_unchanged():
    cause = RootCause("terminated", 143, "stopped by SLURM: preemption (SIGTERM)", node=1, rank=3, signal="SIGTERM",
                      slurm_stop=True, preempted=True)
    decoded = orjson.loads(orjson.dumps(dataclasses.asdict(cause)))
    assert decoded["kind"] == "terminated"
    assert RootCause.from_dict(decoded) == cause


def test_slurm_says_why_it_stopped_the_job_as_fields():
    stop = slurm_env.slurm_stop("SIGTERM", PREEMPTED_JOB)
    assert stop is not None and stop.preempted and stop.event == "preemption"
    assert stop.message == slurm_env.stop_reason("SIGTERM", PREEMPTED_JOB) == "stopped by SLURM: preemption (SIGTERM)"
    scancel = slurm_env.slurm_stop("SIGTERM", {"JobState": "CANCELLED"})
    assert scancel is not None and not scancel.preempted
    assert slurm_env.slurm_stop("SIGTERM", {"JobState": "RUNNING"}) is None


def test_a_job_wide_slurm_stop_names_no_node_by_its_field_not_its_words():
    node = MultiNode.__new__(MultiNode)  # only what _as_job_cause reads
    node.node_rank, node.host = 2, "h2"
    job_wide = RootCause("terminated", 143, "words that say nothing of SLURM", signal="SIGTERM", slurm_stop=True)
    assert node._as_job_cause(job_wide)["message"] == "words that say nothing of SLURM"
    own = RootCause("terminated", 143, "stopped by SLURM: but only in words", signal="SIGTERM")
    assert node._as_job_cause(own)["message"] == "node 2 (h2): stopped by SLURM: but only in words"


def test_a_preempted_slurm_job_is_named_and_requeued_from_the_causes_fields(tmp_path):
    """The whole path in one run: the supervisor's SIGTERM is a cause whose `signal` field makes
    it ask SLURM why (here: a preemption), the published cause says so in words and fields, and
    its `preempted` field (never its message) makes node 0 ask for the requeue."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        'case "$1 $2" in\n'
        '  "show job") echo "JobId=4242 JobState=COMPLETING Reason=None PreemptTime=2026-11-25T16:00:00 Restarts=0 '
        'Requeue=1 Partition=debug";;\n'
        '  "show partition") echo "PartitionName=debug PreemptMode=REQUEUE";;\n'
        'esac\nexit 0\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {**sh.env(), "PATH": f"{bin_dir}{os.pathsep}{sh.env()['PATH']}", "SLURM_JOB_ID": "4242"}
    cmd = [sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report", "--nproc", "1",
           "--script", str(sh.SCENARIO), "forever"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not sh.wait_for(lambda: sh.workers_started(proc, 1, tmp_path)):
        proc.kill()
        raise AssertionError(f"the worker never started: {proc.communicate()[1][-3000:]}")
    proc.send_signal(signal.SIGTERM)
    code, _, err = sh.finish(proc, timeout=60)
    assert code == 143, err[-3000:]
    cause = orjson.loads((sh.run_dir_of(tmp_path) / "summary.json").read_bytes())["root_cause"]
    assert cause["message"].startswith("stopped by SLURM: preemption (SIGTERM)"), cause["message"]
    assert (cause["kind"], cause["signal"], cause["slurm_stop"], cause["preempted"]) == \
        ("terminated", "SIGTERM", True, True)
    assert "requeue 4242" in calls.read_text().splitlines()
