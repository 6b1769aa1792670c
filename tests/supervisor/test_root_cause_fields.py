"""A root cause carries its facts as fields: `kind` is a CauseKind, a stop names its `signal`,
a SLURM stop says so (`slurm_stop`, `preempted`), `node` and `rank` say where. The message is
for people: no decision reads a fact back out of its words."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from supervisor.rendezvous import slurm_env
from supervisor.rendezvous.multi import MultiNode
from supervisor.summary import CauseKind, RootCause

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
