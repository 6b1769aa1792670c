"""The `slurm` tier: gpuherd under real SLURM daemons (tests/slurm/cluster.py).

Opt-in, because it is minutes, not seconds: `GPUHERD_SLURM_TESTS=1 pytest -m slurm -n 0`
(`GPUHERD_SLURM_PROCTRACK=pgid` for a cluster whose job signals reach each task's process group only).
It needs root (network namespaces, daemons) on Linux. Missing Debian packages (slurmctld
slurmd slurm-client munge) are installed with apt-get when it is there (CI runs as root on
Debian); elsewhere, or without root, every test here is skipped with the reason. The cluster
(2 nodes) is started once for the module and always taken down at its end, failures included.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.slurm.cluster import Cluster, ClusterError, install_packages, missing_packages

OPT_IN = "GPUHERD_SLURM_TESTS"
PROCTRACK = "GPUHERD_SLURM_PROCTRACK"  # linuxproc (default: signals every process of a step, like cgroup) or pgid


def _why_not() -> str | None:
    if os.environ.get(OPT_IN) != "1":
        return f"the SLURM cluster tier is opt-in: {OPT_IN}=1 (minutes; root on Linux)"
    if not sys.platform.startswith("linux"):
        return "needs Linux (network namespaces)"
    if os.geteuid() != 0:
        return "needs root (network namespaces, SLURM daemons)"
    missing = missing_packages()
    if missing and shutil.which("apt-get") is None:
        return f"needs the packages {' '.join(missing)} and there is no apt-get to install them"
    if missing:
        try:
            install_packages(missing)
        except Exception as exc:  # noqa: BLE001 - any failure to install is a reason to skip, said once
            return f"could not install {' '.join(missing)}: {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if "slurm" in item.keywords]
    if not ours:
        return
    why = _why_not()
    if why:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    root = tmp_path_factory.mktemp("slurm-cluster")
    c = Cluster(root, nodes=2, proctrack=os.environ.get(PROCTRACK, "linuxproc"))
    try:
        c.up()
    except ClusterError as exc:
        pytest.fail(f"the test cluster did not come up: {exc}")
    try:
        yield c
    finally:
        notes = c.down()
        for note in notes:
            print(f"cluster teardown: {note}", file=sys.stderr)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """Where a job's logs, checkpoints and dataset cache go (the shared filesystem)."""
    return tmp_path
