"""Read this node's place in a SLURM allocation from the environment (`--slurm`).

The generated sbatch script (`python -m supervisor.commands.sbatch`) runs one supervisor per node
through `srun --ntasks-per-node=1`; each one calls `read_slurm(os.environ)` to learn
how many nodes there are, which one it is, and where node 0 (the master) lives.

Inside an `srun` step SLURM_NODEID is relative to the *step's* nodes, so the node count
and node list are read from the step's variables first (SLURM_STEP_NUM_NODES,
SLURM_STEP_NODELIST) and from the job's only when there is no step; all three then
describe the same set of nodes even for a step that uses part of the allocation.
Variable meanings: the OUTPUT ENVIRONMENT VARIABLES sections of sbatch(1) and srun(1).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode

# First name that is set wins (step before job: see the module docstring).
NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")

# Without MASTER_PORT every node derives the same port from the job id, with no
# communication needed. 20000-29999 lies above the privileged ports and below Linux's
# default ephemeral range (32768-60999, net.ipv4.ip_local_port_range), so the kernel
# does not hand it out as the source port of some outgoing connection; two jobs whose
# master is the same node collide only if their ids are equal modulo 10000.
DERIVED_PORT_BASE = 20000
DERIVED_PORT_SPAN = 10000

SCONTROL_TIMEOUT_S = 10.0
STATE_TIMEOUT_S = 5.0  # the job's state at a stop


class SlurmError(GpuherdError):
    """The allocation cannot be read; the message is one line naming the variable at fault."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class SlurmNode:
    job_id: str
    nnodes: int
    node_rank: int  # SLURM_NODEID: 0 .. nnodes-1, 0 is the master
    master_addr: str  # first host of the node list
    master_port: int
    hosts: tuple[str, ...]  # every node in SLURM's order (node rank = index); () with an explicit master_addr
    gpus_on_node: int | None  # GPUs SLURM gave this node; None when SLURM does not say
    cuda_visible_devices: str | None  # as SLURM set it (the allocated GPUs), None if unset
    restart_count: int = 0  # SLURM_RESTART_COUNT: how often this job was requeued (same job id)


def hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist expression (`node[01-03],gpu7`) with `scontrol show hostnames`.

    scontrol is the only complete implementation of the hostlist syntax (ranges, padding,
    several bracket groups), so it is asked rather than re-implemented.
    """
    hint = "pass --master-addr HOST explicitly"
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise SlurmError(f"scontrol is not on PATH; {hint}") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"scontrol show hostnames did not answer within {SCONTROL_TIMEOUT_S:g} s; {hint}") from None
    except OSError as exc:
        raise SlurmError(f"cannot run scontrol ({exc.strerror}); {hint}") from None
    if done.returncode != 0:
        detail = _first_line(done.stderr) or f"exit code {done.returncode}"
        raise SlurmError(f"scontrol show hostnames failed: {detail}; {hint}")
    hosts = done.stdout.split()
    if not hosts:
        raise SlurmError(f"scontrol show hostnames printed no host; {hint}")
    return hosts


def kill_wait() -> float | None:
    """SLURM's KillWait, the seconds between a job's SIGTERM and its SIGKILL (`scontrol show
    config`), or None when it cannot be read (no scontrol, a container, an old SLURM)."""
    done = _scontrol("show", "config", timeout=SCONTROL_TIMEOUT_S)
    if isinstance(done, str) or done.returncode != 0:
        return None
    return parse_kill_wait(done.stdout)


SLURM_STOP = "stopped by SLURM"  # a job-wide stop: the same words on every node, no node named
PREEMPTION_EVENT = "preemption"
WARNING_EVENT = "the time limit is near"  # SIGUSR1/2: the job's --signal warning


@dataclass(frozen=True)
class SlurmStop:
    """Why SLURM stopped the job: `event` (the time limit, preemption, a node failure, requeue,
    scancel) and the signal that came."""

    event: str
    signame: str

    @property
    def preempted(self) -> bool:
        return self.event == PREEMPTION_EVENT

    @property
    def message(self) -> str:
        """The outcome every node reports the same way: "stopped by SLURM: scancel (SIGTERM)"."""
        if self.event == WARNING_EVENT:
            return f"{SLURM_STOP}: the time limit is near ({self.signame}, the job's --signal warning)"
        return f"{SLURM_STOP}: {self.event} ({self.signame})"


def slurm_stop(signame: str, job: dict[str, str], restart_count: int = 0) -> SlurmStop | None:
    """Why SLURM stopped the job; None when SLURM does not say (a SIGTERM while the job still
    runs: someone's `kill`). `job`: `job_info(job id)`. While the job's processes are being
    signalled its state reads COMPLETING; the cause is in its other fields (a requeue has
    already counted itself in Restarts, past this start's `restart_count`)."""
    if signame in ("SIGUSR1", "SIGUSR2"):
        return SlurmStop(WARNING_EVENT, signame)
    state, reason = job.get("JobState", ""), job.get("Reason", "")
    if state == "TIMEOUT" or reason == "TimeLimit":
        event = "the time limit"
    elif preempted(job):
        event = PREEMPTION_EVENT
    elif state == "NODE_FAIL" or reason.startswith("Node"):
        event = "a node failure"
    elif state.startswith("REQUEUE") or state == "PENDING" or _restarts(job) > restart_count:
        event = "requeue"
    elif state in ("CANCELLED", "COMPLETING"):
        event = "scancel"
    else:
        return None
    return SlurmStop(event, signame)


def stop_reason(signame: str, job: dict[str, str], restart_count: int = 0) -> str | None:
    """`slurm_stop`'s words, or None."""
    stop = slurm_stop(signame, job, restart_count)
    return stop.message if stop is not None else None


def _restarts(job: dict[str, str]) -> int:
    value = job.get("Restarts", "")
    return int(value) if value.isdigit() else 0


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields (JobState, Reason, PreemptTime, Restarts, ...); {} when
    SLURM cannot be asked."""
    return _scontrol_fields("show", "job", "-o", job_id)


def preempted(job: dict[str, str]) -> bool:
    return job.get("JobState") == "PREEMPTED" or job.get("PreemptTime", "None") not in ("None", "Unknown", "")


def requeue_after_preemption(job_id: str, job: dict[str, str]) -> str | None:
    """A requeueable job (`--requeue`: Requeue=1) preempted with PreemptMode=REQUEUE is requeued
    by SLURM only if it is still running when its GraceTime ends: one that saved and exited in
    time ends FAILED and never runs again. So node 0 asks for the requeue itself as the job
    exits (what Lightning's SLURM auto-requeue does). Returns what was done, in words, or None
    when the job is not to be requeued (not preempted, not requeueable, or its partition's
    PreemptMode says CANCEL: the cluster's policy is kept)."""
    if not preempted(job) or job.get("Requeue") != "1":
        return None
    partition = job.get("Partition", "")
    mode = _scontrol_fields("show", "partition", "-o", partition).get("PreemptMode", "") if partition else ""
    if mode.upper().startswith("CANCEL"):
        return None
    done = _scontrol("requeue", job_id)
    if isinstance(done, str) or done.returncode != 0:
        why = done if isinstance(done, str) else (
            " ".join((done.stderr or done.stdout).split())[:200] or f"exit {done.returncode}")
        return f"SLURM preempted job {job_id}; asking it to requeue the job failed (scontrol requeue: {why})"
    return f"SLURM preempted job {job_id}: requeued it (scontrol requeue); its next start continues this run"


def _scontrol(*args: str, timeout: float = STATE_TIMEOUT_S) -> subprocess.CompletedProcess | str:
    """scontrol's answer, or why it could not be asked (not on PATH, no answer within `timeout`)."""
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)


def _scontrol_fields(*args: str) -> dict[str, str]:
    done = _scontrol(*args)
    if isinstance(done, str) or done.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", done.stdout))


def parse_kill_wait(config_text: str) -> float | None:
    """`KillWait                = 30 sec` in `scontrol show config` -> 30.0."""
    match = re.search(r"^\s*KillWait\s*=\s*([0-9]+)\s*(sec)?\s*$", config_text, re.MULTILINE | re.IGNORECASE)
    return float(match.group(1)) if match else None


def read_slurm(environ: Mapping[str, str], hostnames: Callable[[str], list[str]] = hostnames, *,
               master_addr: str | None = None) -> SlurmNode:
    """This node's SlurmNode; SlurmError (one line, naming the variable) on anything missing or wrong.

    `master_addr` is an explicit --master-addr: the node list is then not expanded, so no
    scontrol is needed (containers often lack it), and `hosts` is empty. MASTER_ADDR from
    the environment is deliberately not read: sbatch exports the submitting shell's
    environment, and a MASTER_ADDR=localhost left over from single-node runs would send
    every node to itself; a stale MASTER_PORT still names one port all nodes agree on.
    """
    job_id = _get(environ, "SLURM_JOB_ID")
    if job_id is None:
        raise SlurmError("not inside a SLURM allocation: SLURM_JOB_ID is not set "
                         "(submit with sbatch, or run inside salloc/srun)")
    nnodes_var, nnodes = _first_int(environ, NNODES_VARS, minimum=1)
    node_rank = _int(environ, "SLURM_NODEID", minimum=0)
    if node_rank >= nnodes:
        raise SlurmError(f"SLURM_NODEID={node_rank} but {nnodes_var}={nnodes}: node ids run from 0 to {nnodes - 1}")
    _check_one_task_per_node(environ)
    hosts = [] if master_addr else _hosts(environ, nnodes_var, nnodes, hostnames)
    return SlurmNode(job_id=job_id, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr or hosts[0],
                     master_port=_master_port(environ, job_id), hosts=tuple(hosts),
                     gpus_on_node=_gpus_on_node(environ), cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
                     restart_count=_int(environ, "SLURM_RESTART_COUNT", minimum=0)
                     if _get(environ, "SLURM_RESTART_COUNT") is not None else 0)


def derived_port(job_id: str) -> int:
    """The port every node of job `job_id` agrees on without talking to the others."""
    if not _is_count(job_id):
        raise SlurmError(f"SLURM_JOB_ID={job_id!r} is not an integer, so no port can be derived from it; "
                         "set MASTER_PORT")
    return DERIVED_PORT_BASE + int(job_id) % DERIVED_PORT_SPAN


def parse_gpu_count(name: str, value: str) -> int:
    """A GPU count as SLURM writes one: `4`, or `[type:]N` items such as `a100:4` or `volta:3,kepler:1` (summed).

    SLURM_GPUS_ON_NODE is a plain count; the typed form is what --gpus-per-node=[type:]N puts
    in SLURM_GPUS_PER_NODE (sbatch(1)), read here when SLURM_GPUS_ON_NODE is absent.
    """
    total = 0
    for item in value.split(","):
        count = item.strip().rsplit(":", 1)[-1]
        if not _is_count(count):
            raise SlurmError(f"{name}={value!r} is not a GPU count (expected e.g. 4 or a100:4)")
        total += int(count)
    return total


def _hosts(environ: Mapping[str, str], nnodes_var: str, nnodes: int,
           expand: Callable[[str], list[str]]) -> list[str]:
    name, nodelist = _first_set(environ, NODELIST_VARS)
    if "[" in nodelist:
        try:
            hosts = list(expand(nodelist))
        except SlurmError as exc:
            raise SlurmError(f"cannot expand {name}={nodelist!r}: {exc}") from None
    else:  # without brackets a hostlist is plain comma-separated names: no scontrol needed
        hosts = [host.strip() for host in nodelist.split(",") if host.strip()]
    if len(hosts) != nnodes:
        raise SlurmError(f"{name}={nodelist!r} names {len(hosts)} host(s) but {nnodes_var}={nnodes}")
    return hosts


def _check_one_task_per_node(environ: Mapping[str, str]) -> None:
    """One supervisor per node: several would each start a worker on every GPU of the node.

    srun writes the step's layout as counts with repeats, e.g. `1(x4)` or `2,1` (srun(1)).
    """
    name = "SLURM_STEP_TASKS_PER_NODE"
    value = _get(environ, name)
    if value is None:
        return
    counts = [re.fullmatch(r"([0-9]+)(?:\(x[0-9]+\))?", item.strip()) for item in value.split(",")]
    if not all(counts):
        raise SlurmError(f"{name}={value!r} is not a task layout (expected e.g. 1(x4))")
    if any(int(match.group(1)) != 1 for match in counts):
        raise SlurmError(f"{name}={value!r}: gpuherd runs one supervisor per node, which starts the "
                         "per-GPU workers itself; launch it with srun --ntasks-per-node=1")


def _master_port(environ: Mapping[str, str], job_id: str) -> int:
    if _get(environ, "MASTER_PORT") is None:
        return derived_port(job_id)
    return _int(environ, "MASTER_PORT", minimum=1, maximum=65535)


def _gpus_on_node(environ: Mapping[str, str]) -> int | None:
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = _get(environ, name)
        if value is not None:
            return parse_gpu_count(name, value)
    return None


def _get(environ: Mapping[str, str], name: str) -> str | None:
    """The stripped value, or None when unset or empty (an empty SLURM variable carries nothing)."""
    value = environ.get(name, "").strip()
    return value or None


def _first_set(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str]:
    for name in names:
        value = _get(environ, name)
        if value is not None:
            return name, value
    raise SlurmError(f"none of {', '.join(names)} is set: is this running inside the SLURM job?")


def _first_int(environ: Mapping[str, str], names: tuple[str, ...], minimum: int) -> tuple[str, int]:
    name, _ = _first_set(environ, names)
    return name, _int(environ, name, minimum=minimum)


def _int(environ: Mapping[str, str], name: str, minimum: int, maximum: int | None = None) -> int:
    value = _get(environ, name)
    if value is None:
        raise SlurmError(f"{name} is not set: is this running inside the SLURM job?")
    if not _is_count(value):
        raise SlurmError(f"{name}={value!r} is not an integer")
    number = int(value)
    if number < minimum or (maximum is not None and number > maximum):
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise SlurmError(f"{name}={number} is out of range: it must be {bounds}")
    return number


def _is_count(text: str) -> bool:
    """ASCII digits only: str.isdigit() would also accept '²' and int() would accept '+4' or '1_000'."""
    return re.fullmatch(r"[0-9]+", text) is not None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
