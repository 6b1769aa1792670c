"""The SLURM tier's gate (tests/slurm/conftest.py): skipped when not asked for, a failure when
asked for and unable to run. Decided without starting any cluster or installing anything."""

from __future__ import annotations

import pytest

from tests.slurm.conftest import tier_verdict


def _never_install(packages: list[str]) -> None:
    raise AssertionError(f"nothing may be installed here, asked for {packages}")


def _verdict(opted_in=True, platform="linux", euid=0, missing=(), has_apt_get=True, install=_never_install):
    return tier_verdict(opted_in, platform, euid, list(missing), has_apt_get, install)


def test_not_asked_for_is_a_skip_whatever_the_machine():
    for verdict in (_verdict(opted_in=False), _verdict(opted_in=False, euid=1000, platform="darwin")):
        assert not verdict.run and not verdict.fail
        assert "opt-in" in verdict.reason


@pytest.mark.parametrize(("machine", "named"), [
    ({"platform": "darwin"}, "needs Linux"),
    ({"euid": 1000}, "needs root"),
    ({"missing": ["slurmd", "munge"], "has_apt_get": False}, "needs the packages slurmd munge"),
])
def test_asked_for_and_unable_to_run_is_a_failure_naming_why(machine, named):
    verdict = _verdict(**machine)
    assert not verdict.run and verdict.fail
    assert "GPUHERD_SLURM_TESTS=1" in verdict.reason and named in verdict.reason


def test_a_failed_package_install_is_a_failure_not_a_skip():
    def broken_apt(packages):
        raise OSError("E: Unable to locate package slurmd")

    verdict = _verdict(missing=["slurmd"], install=broken_apt)
    assert verdict.fail and not verdict.run
    assert "could not install slurmd: E: Unable to locate package slurmd" in verdict.reason


def test_missing_packages_are_installed_then_the_tier_runs():
    installed = []
    verdict = _verdict(missing=["slurmctld", "slurmd"], install=installed.extend)
    assert verdict.run and not verdict.fail
    assert installed == ["slurmctld", "slurmd"]


def test_a_ready_machine_runs_the_tier_without_installing():
    verdict = _verdict()
    assert verdict.run and not verdict.fail and verdict.reason == ""
