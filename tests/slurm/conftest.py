"""The `slurm` tier: gpuherd under real SLURM daemons (tests/slurm/cluster.py).

Opt-in, because it is minutes, not seconds: `GPUHERD_SLURM_TESTS=1 pytest -m slurm -n 0`
(`GPUHERD_SLURM_PROCTRACK=pgid` for a cluster whose job signals reach each task's process group only).
It needs root (network namespaces, daemons) on Linux. Missing Debian packages (slurmctld
slurmd slurm-client munge) are installed with apt-get when it is there (CI runs as root on
Debian). Not asked for, every test here is skipped with the reason; asked for
(`GPUHERD_SLURM_TESTS=1`, as CI does) and unable to run (no Linux, no root, the packages
missing or failing to install), every test here FAILS with the reason: a tier CI asked for
never passes by skipping. The cluster (2 nodes) is started once for the module and always
taken down at its end, failures included (a module may ask for more nodes: CLUSTER_NODES).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.slurm.cluster import Cluster, ClusterError, install_packages, missing_packages

OPT_IN = "GPUHERD_SLURM_TESTS"
PROCTRACK = "GPUHERD_SLURM_PROCTRACK"  # linuxproc (default: signals every process of a step, like cgroup) or pgid


@dataclass(frozen=True)
class TierVerdict:
    """Whether the tier runs; when it does not, `fail` says whether that is a failure (asked for)."""

    run: bool
    fail: bool = False
    reason: str = ""


def tier_verdict(opted_in: bool, platform: str, euid: int, missing: list[str], has_apt_get: bool,
                 install: Callable[[list[str]], None]) -> TierVerdict:
    """Pure but for `install`: what to do with the tier on this machine."""
    if not opted_in:
        return TierVerdict(False, reason=f"the SLURM cluster tier is opt-in: {OPT_IN}=1 (minutes; root on Linux)")

    def cannot(why: str) -> TierVerdict:
        return TierVerdict(False, fail=True, reason=f"{OPT_IN}=1 asked for the SLURM tier, but it cannot run: {why}")

    if not platform.startswith("linux"):
        return cannot("needs Linux (network namespaces)")
    if euid != 0:
        return cannot("needs root (network namespaces, SLURM daemons)")
    if missing and not has_apt_get:
        return cannot(f"needs the packages {' '.join(missing)} and there is no apt-get to install them")
    if missing:
        try:
            install(missing)
        except Exception as exc:  # noqa: BLE001 - any failure to install is the reason, said once
            return cannot(f"could not install {' '.join(missing)}: {exc}")
    return TierVerdict(True)


_VERDICT = pytest.StashKey[TierVerdict]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the marker, not the keyword: every test under tests/slurm has "slurm" among its keywords
    ours = [item for item in items if item.get_closest_marker("slurm") is not None]
    if not ours:
        return
    verdict = tier_verdict(os.environ.get(OPT_IN) == "1", sys.platform,
                           os.geteuid() if hasattr(os, "geteuid") else -1,
                           missing_packages(), shutil.which("apt-get") is not None, install_packages)
    for item in ours:
        if verdict.fail:
            item.stash[_VERDICT] = verdict  # failed in setup by _tier_can_run, reason and all
        elif not verdict.run:
            item.add_marker(pytest.mark.skip(reason=verdict.reason))


@pytest.fixture(autouse=True)
def _tier_can_run(request: pytest.FixtureRequest) -> None:
    verdict = request.node.stash.get(_VERDICT, None)
    if verdict is not None:
        pytest.fail(verdict.reason, pytrace=False)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory) -> Cluster:
    """A module's cluster: 2 nodes, or its CLUSTER_NODES (a job with a spare node needs 3)."""
    root = tmp_path_factory.mktemp("slurm-cluster")
    c = Cluster(root, nodes=getattr(request.module, "CLUSTER_NODES", 2), proctrack=os.environ.get(PROCTRACK, "linuxproc"))
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
