"""A real multi-node SLURM cluster on one Linux host, for the `slurm` tests (root needed).

One `slurmctld` and N `slurmd`s (Debian's Slurm packages), each compute node in its own
network namespace on a private bridge (10.201.0.0/24, nothing routed anywhere), one
`munged`, and the host's filesystem shared by every node, as a cluster's shared
filesystem is. Everything this starts is written down (`Cluster.pids`) and stopped by
`down()`, by pid, together with whatever is left inside its namespaces: the daemons, the
jobs' processes, the namespaces themselves, the bridge.

- Daemons run under `nsenter --net` plus a private mount and UTS namespace (their own
  hostname and /etc/hosts), not `ip netns exec`: the latter remounts /sys, which hides
  /sys/fs/cgroup, and slurmd then refuses to start.
- `proctrack/linuxproc` (the default here): like `proctrack/cgroup`, a job signal
  (scancel, the time limit, --signal) reaches every process of a step. `pgid` signals
  only each task's process group.
- Every file (slurm.conf, state, spool, logs, pid files) lives in the cluster's own
  directory; clients find the config through SLURM_CONF, so the host's /etc/slurm is
  never touched. The job id counter starts at 1 with every cluster.
- The nodes reach nothing but each other and the controller, like air-gapped compute
  nodes: everything a job needs is on the shared filesystem already.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge",
            "ip": "iproute2", "nsenter": "util-linux"}
NET = "10.201.0"
CTL = "ghctl"  # the controller's namespace ("login node"): the bridge lives here
BRIDGE = "ghbr0"
NODE_PREFIX = "ghnode"
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
RECORD = Path("/run/gpuherd-test-cluster.json")  # what is up now, for a later session to take down

SLURM_CONF = """\
# A throwaway cluster on one host, written by tests/slurm/cluster.py
ClusterName=gpuherd-test
SlurmctldHost={ctl}({net}.254)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
# a requeued job may start again this long after its requeue (SLURM's default: 120 s)
AuthInfo=cred_expire=20
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/{proctrack}
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
KillWait={kill_wait}
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=3600
SlurmdParameters=config_overrides
# preemption as clusters run it: a job in `urgent` preempts the jobs in `debug`, which get
# SIGTERM, GraceTime to stop, and are requeued (cancelled when not requeueable)
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


class ClusterError(RuntimeError):
    pass


def missing_packages() -> list[str]:
    return sorted({pkg for cmd, pkg in PACKAGES.items() if shutil.which(cmd) is None
                   and not Path(f"/usr/sbin/{cmd}").exists()})


def install_packages(packages: list[str]) -> None:
    """Debian's packages; policy-rc.d (if present) keeps their own services from starting."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True, env=env, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], check=True,
                   capture_output=True, env=env, timeout=900)


def _run(*cmd: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    return done


@dataclass
class Cluster:
    root: Path  # every file of the cluster
    nodes: int = 2
    proctrack: str = "linuxproc"
    kill_wait: int = 30
    pids: dict[str, int] = field(default_factory=dict)  # daemon -> pid, all started by us
    namespaces: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [f"{NODE_PREFIX}{i}" for i in range(1, self.nodes + 1)]

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self) -> dict[str, str]:
        """A client's environment (sbatch exports it into the job, SLURM_CONF included)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    # ------------------------------------------------------------------ up
    def up(self) -> Cluster:
        if CTL in _run("ip", "netns", "list").stdout.split():
            left_behind()
        if CTL in _run("ip", "netns", "list").stdout.split():
            raise ClusterError(f"namespace {CTL} exists and is not ours: another test cluster is up")
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        try:
            self._munge()
            self._network()
            self._write_conf()
            self._daemons()
            RECORD.write_text(json.dumps({"root": str(self.root), "nodes": self.nodes, "pids": self.pids,
                                          "namespaces": self.namespaces}))
            self.wait_idle()
        except BaseException:
            self.down()
            raise
        return self

    def _munge(self) -> None:
        if MUNGE_SOCKET.exists() and _run("sh", "-c", "munge -n | unmunge", check=False).returncode == 0:
            return  # a munged is serving already (not ours: left alone)
        key = Path("/etc/munge/munge.key")
        if not key.exists() or key.stat().st_size == 0:
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(os.urandom(1024))
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
        for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        pidfile = Path("/run/munge/munged.pid")  # munged runs as munge: its own directory
        pidfile.unlink(missing_ok=True)
        _run("runuser", "-u", "munge", "--", "/usr/sbin/munged", "--force")
        self.pids["munged"] = self._pid_from(pidfile)
        _run("sh", "-c", "munge -n | unmunge")

    def _network(self) -> None:
        _run("ip", "netns", "add", CTL)
        self.namespaces.append(CTL)
        _run("ip", "-n", CTL, "link", "set", "lo", "up")
        _run("ip", "-n", CTL, "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "-n", CTL, "addr", "add", f"{NET}.254/24", "dev", BRIDGE)
        _run("ip", "-n", CTL, "link", "set", BRIDGE, "up")
        hosts = ["127.0.0.1 localhost", f"{NET}.254 {CTL}"]
        for i, name in enumerate(self.names, 1):
            _run("ip", "netns", "add", name)
            self.namespaces.append(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", CTL, "link", "add", f"v-{name}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _run("ip", "-n", CTL, "link", "set", f"v-{name}", "master", BRIDGE, "up")
            _run("ip", "-n", name, "addr", "add", f"{NET}.{i}/24", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            hosts.append(f"{NET}.{i} {name}")
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")

    def _write_conf(self) -> None:
        lines = "\n".join(f"NodeName={n} NodeAddr={NET}.{i} NodeHostname={n} CPUs=2 RealMemory=4000 State=UNKNOWN"
                          for i, n in enumerate(self.names, 1))
        self.conf.write_text(SLURM_CONF.format(ctl=CTL, net=NET, root=self.root, proctrack=self.proctrack,
                                               kill_wait=self.kill_wait, node_lines=lines, ctld_port=6917,
                                               slurmd_port=6918))

    def _in_ns(self, ns: str, *cmd: str) -> list[str]:
        """COMMAND as host `ns`: its network, its hostname, the cluster's /etc/hosts."""
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"', ns,
                str(self.root / "hosts"), *cmd]

    def _daemons(self) -> None:
        env = self.env()
        _run(*self._in_ns(CTL, "/usr/sbin/slurmctld", "-f", str(self.conf)), env=env)
        self.pids["slurmctld"] = self._pid_from(self.root / "slurmctld.pid")
        for name in self.names:
            (self.root / "spool" / name).mkdir(parents=True, exist_ok=True)
            _run(*self._in_ns(name, "/usr/sbin/slurmd", "-f", str(self.conf), "-N", name), env=env)
            self.pids[f"slurmd-{name}"] = self._pid_from(self.root / f"slurmd-{name}.pid")

    @staticmethod
    def _pid_from(path: Path, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return int(path.read_text())
            except (OSError, ValueError):
                time.sleep(0.1)
        raise ClusterError(f"no pid file {path} after {timeout:g} s (see {path.parent}/log)")

    def wait_idle(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        states: list[str] = []
        while time.monotonic() < deadline:
            states = self.sx("sinfo", "-h", "-N", "-p", "debug", "-o", "%t", check=False).stdout.split()  # each node once
            if states.count("idle") == self.nodes:
                return
            time.sleep(0.5)
        raise ClusterError(f"nodes not idle after {timeout:g} s: {states} (see {self.root}/log)")

    # ------------------------------------------------------------------ use
    def sx(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM client on the login node (the controller's namespaces)."""
        return _run("nsenter", "-t", str(self.pids["slurmctld"]), "--net", "--uts", "--mount", *cmd,
                    check=check, timeout=timeout, env=self.env())

    def on(self, node: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """A command on compute node `node` (inside its slurmd's namespaces)."""
        return _run("nsenter", "-t", str(self.pids[f"slurmd-{node}"]), "--net", "--uts", "--mount", *cmd,
                    check=check, env=self.env())

    def sbatch(self, script: Path, *options: str) -> str:
        out = self.sx("sbatch", "--parsable", *options, str(script)).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, NodeList, ExitCode, ...)."""
        text = self.sx("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise ClusterError(f"job {job_id} not in {states} after {timeout:g} s: {info.get('JobState')}")

    def processes(self, node: str) -> list[int]:
        """Every process in node `node`'s network namespace except its slurmd: a job's leftovers."""
        pids = _run("ip", "netns", "pids", node, check=False).stdout.split()
        return [int(p) for p in pids if int(p) != self.pids.get(f"slurmd-{node}")]

    def partition(self, node: str) -> None:
        self.on(node, "ip", "link", "set", "eth0", "down")

    def heal(self, node: str) -> None:
        self.on(node, "ip", "link", "set", "eth0", "up")

    def cancel_all(self) -> None:
        jobs = self.sx("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.sx("scancel", *jobs, check=False)

    # ------------------------------------------------------------------ down
    def down(self) -> list[str]:
        """Stop everything `up` started, whatever state it is in; says what had to be killed hard.
        Jobs first (their processes may not outlive the cluster), then the node daemons, the
        controller, anything still inside a namespace, the namespaces, and our munged last."""
        notes = []
        if "slurmctld" in self.pids:
            try:
                self.cancel_all()
            except (ClusterError, subprocess.TimeoutExpired):
                pass
        daemons = set(self.pids.values())
        for ns in [n for n in self.namespaces if n != CTL]:
            for pid in self._pids_in(ns):
                if pid not in daemons:
                    _kill(pid, signal.SIGKILL)
                    notes.append(f"killed {pid} left in {ns}")
        for name in [n for n in self.pids if n.startswith("slurmd")] + [n for n in ("slurmctld",) if n in self.pids]:
            pid = self.pids.pop(name)
            if not _stop(pid):
                notes.append(f"{name} ({pid}) needed SIGKILL")
        for ns in self.namespaces:
            for pid in self._pids_in(ns):
                _kill(pid, signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
        if "munged" in self.pids:
            _stop(self.pids.pop("munged"))
        RECORD.unlink(missing_ok=True)
        return notes

    @staticmethod
    def _pids_in(ns: str) -> list[int]:
        return [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]


def left_behind() -> list[str]:
    """Take down a cluster an earlier session left up (its pytest was killed before its teardown)."""
    try:
        record = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return []
    def ours(pid: int) -> bool:  # a pid the kernel reused since is someone else's
        try:
            return any(name in Path(f"/proc/{pid}/cmdline").read_bytes() for name in (b"slurm", b"munge"))
        except OSError:
            return False
    pids = {name: pid for name, pid in record["pids"].items() if ours(pid)}
    cluster = Cluster(Path(record["root"]), nodes=record["nodes"], pids=pids, namespaces=record["namespaces"])
    return cluster.down()


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # our daemons are not our children: a zombie here is reaped by init soon
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _stop(pid: int, timeout: float = 10) -> bool:
    """SIGTERM, then SIGKILL after `timeout`; True when SIGTERM was enough."""
    _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    _kill(pid, signal.SIGKILL)
    return False
