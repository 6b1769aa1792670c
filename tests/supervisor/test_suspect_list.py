"""The suspect list that outlives a run (supervisor/health/suspect_list.py), what a start does
with it, `gpuherd check --clear-suspect`, and a second strike of silent data corruption: the
rank's GPU is never handed to a spare in place, and a restart leaves it out. In milliseconds;
the real processes: tests/e2e/test_sdc_run.py."""

from __future__ import annotations

import orjson
import pytest

from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import from_object as record
from supervisor.commands import check
from gpuherd.config import SystemConfig
from supervisor.gpus import DeviceError, DevicePlan, DeviceSlot, plan_devices, release_claims
from supervisor.health.suspect_list import (StartExclusion, SuspectList, at_start, avoid_listed, list_path,
                                           remember)
from supervisor.health.suspects import SuspectWatch, mark_moved
from supervisor.restarts import exclude_suspects
from supervisor.summary import SDC_CAUSE, RootCause, SuspectDevice
# fixtures shared with the tests they come from: `warnings` (WARNING lines), `four_gpus` (the fake NVML)
from tests.supervisor.test_live_recovery import _live, _shrinking, warnings  # noqa: F401
from tests.supervisor.test_units import four_gpus  # noqa: F401

GPU4 = DevicePlan(slots=tuple(DeviceSlot(r, "cuda", r, uuid=f"GPU-{r}aaa") for r in range(4)), isolate=True)
CPU2 = DevicePlan(slots=(DeviceSlot(0, "cpu", 0), DeviceSlot(1, "cpu", 1)), isolate=False)
EXIT_8 = RootCause("worker-exit", ExitCode.DEVICE_SUSPECT, "GPU2 (rank 2) exit code 8", rank=2, device="GPU2")


def sdc(gpu: int | None, strikes: int = 2, slot: int | None = None, uuid: str = "") -> SuspectDevice:
    return SuspectDevice(attempt=0, rank=gpu if gpu is not None else slot, device="cuda:0", gpu=gpu, host="h1",
                         transient_faults=strikes, limit=1, step=7, cause=SDC_CAUSE, slot=slot if gpu is None else gpu,
                         uuid=uuid, evidence=["layers.1.w: one bit flipped (bit 22)"], steps=[3, 7][-strikes:])


def test_strikes_survive_a_round_trip_keyed_by_uuid_even_when_the_index_moves(tmp_path):
    path = list_path(tmp_path, "node7")
    remember(tmp_path, "run-a", [sdc(2, uuid="GPU-2aaa")], host="node7")
    remember(tmp_path, "run-b", [sdc(3, strikes=1, uuid="GPU-2aaa")], host="node7")  # the same board, renumbered
    listed = SuspectList.load(path)
    (entry,) = listed.devices
    assert (entry.label, entry.uuid, [s.run_id for s in entry.strikes]) == ("GPU3", "GPU-2aaa", ["run-a", "run-b"])
    assert entry.strikes[0].evidence == ("layers.1.w: one bit flipped (bit 22)",) and entry.strikes[0].count == 2
    assert "GPU3 (GPU-2aaa): 2 strike(s); last: silent data corruption x1, run run-b attempt 0, rank 3" in entry.line()


def test_only_sdc_and_transient_faults_over_the_limit_go_on_the_list(tmp_path):
    within = SuspectDevice(attempt=0, rank=0, device="cuda:0", gpu=0, host="h", transient_faults=1, limit=2, step=4)
    over = SuspectDevice(attempt=0, rank=1, device="cuda:0", gpu=1, host="h", transient_faults=3, limit=2, step=9)
    remember(tmp_path, "r", [within, over, sdc(None, strikes=1, slot=1)], host="h")
    assert [d.label for d in SuspectList.load(list_path(tmp_path, "h")).devices] == ["GPU1", "CPU1"]


@pytest.mark.parametrize("body", [b"{not json", b'{"format": 99, "devices": []}', b'{"format": 1, "devices": [{}]}',
                                  b'{"format": 1, "devices": [{"kind": "tpu", "index": 0}]}'])
def test_a_damaged_list_is_one_warning_and_empty_and_the_next_write_replaces_it(tmp_path, warnings, body):
    path = list_path(tmp_path, "h")
    path.parent.mkdir(parents=True)
    path.write_bytes(body)
    listed = SuspectList.load(path)
    assert listed.devices == [] and len(warnings) == 1 and str(path) in warnings[0] and "damaged" in warnings[0]
    remember(tmp_path, "r", [sdc(0)], host="h")
    assert orjson.loads(path.read_bytes())["devices"][0]["label"] == "GPU0"


@pytest.mark.parametrize(("selector", "left"), [("GPU3", ["CPU1"]), ("gpu 3", ["CPU1"]), ("3", ["CPU1"]),
                                                 ("GPU-3aaa", ["CPU1"]), ("CPU1", ["GPU3"]), ("all", []),
                                                 ("GPU1", ["GPU3", "CPU1"])])
def test_clear_selectors(tmp_path, selector, left):
    remember(tmp_path, "r", [sdc(3, uuid="GPU-3aaa"), sdc(None, slot=1)], host="h")
    listed = SuspectList.load(list_path(tmp_path, "h"))
    listed.remove(selector)
    assert [d.label for d in listed.devices] == left


def _listed(tmp_path, *suspects: SuspectDevice) -> SuspectList:
    remember(tmp_path, "r1", list(suspects), host="h")
    return SuspectList.load(list_path(tmp_path, "h"))


def _start(listed: SuspectList, allow: bool = False, **system) -> tuple[DevicePlan, StartExclusion]:
    """What main.py does: plan around the list (unless allowed or explicit), then judge the plan."""
    explicit = "gpus" in system
    avoid = None if allow or explicit else avoid_listed(listed)
    plan = plan_devices(SystemConfig(**system), None, nproc_explicit="nproc" in system, avoid=avoid)
    return plan, at_start(plan, listed, allow=allow, explicit=explicit)


def test_a_start_leaves_a_listed_gpu_out_nproc_still_gets_its_workers_and_says_how_to_put_it_back(tmp_path,
                                                                                                  four_gpus):
    listed = _listed(tmp_path, sdc(2, uuid=four_gpus.gpus[2].uuid))
    plan, found = _start(listed)
    assert [s.device_id for s in plan.slots] == [0, 1, 3] and [s.rank for s in plan.slots] == [0, 1, 2]
    (line,) = found.said
    assert line.startswith("GPU 2 left out: on this host's suspect list (GPU2 (") and found.gpus == (2,)
    assert "this run: 3 worker(s) on GPU 0, GPU 1, GPU 3; `gpuherd check --clear-suspect GPU2` to put it back" in line
    assert line.endswith("--allow-suspect-gpus for one run")
    release_claims()
    plan, _ = _start(listed, nproc=3)
    assert [s.device_id for s in plan.slots] == [0, 1, 3]  # --nproc 3: three healthy GPUs, not two


def test_allow_uses_it_with_one_line_and_an_explicit_gpus_naming_it_is_refused(tmp_path, four_gpus):
    listed = _listed(tmp_path, sdc(1))  # no UUID known: matched by index
    plan, allowed = _start(listed, allow=True)
    assert plan.world_size == 4 and allowed.said[0].endswith("used anyway (--allow-suspect-gpus)")
    release_claims()
    with pytest.raises(DeviceError) as refused:
        _start(listed, gpus=[0, 1])
    assert refused.value.exit_code == ExitCode.USAGE
    assert str(refused.value).startswith("--gpus names GPU 1, which is on this host's suspect list (GPU1: 1 strike")
    assert str(refused.value).endswith("`gpuherd check --clear-suspect GPU1` to take it off")
    release_claims()
    plan, fine = _start(listed, gpus=[2, 3])  # naming healthy ones: nothing to say
    assert [s.device_id for s in plan.slots] == [2, 3] and fine.said == ()


def test_every_gpu_listed_is_exit_8_and_cpu_workers_are_named_not_excluded(tmp_path, four_gpus):
    listed = _listed(tmp_path, *(sdc(g) for g in range(4)))
    with pytest.raises(DeviceError) as none_left:
        _start(listed)
    assert none_left.value.exit_code == ExitCode.DEVICE_SUSPECT
    assert str(none_left.value).startswith("no GPU left to choose from 0,1,2,3: GPU 0 is on this host's suspect list")
    assert str(none_left.value).endswith("`gpuherd check --clear-suspect GPU0` (and 3 more)")
    listed = _listed(tmp_path / "cpu", sdc(None, slot=1))
    cpu = at_start(CPU2, listed, allow=False, explicit=False)
    assert cpu.gpus == () and len(cpu.said) == 1
    assert "CPU1: 1 strike(s)" in cpu.said[0] and cpu.said[0].endswith("no device to leave out: starting as asked")


def test_the_watch_keeps_the_evidence_in_either_order_and_a_moved_rank_starts_a_new_entry():
    watch = SuspectWatch(CPU2, attempt=0)
    evidence = {"type": "sdc", "rank": 0, "step": 1, "culprits": [1], "evidence": ["w: one bit flipped (bit 22)"]}
    watch.observe(record(evidence))  # the healthy rank's record first
    for n, step in ((1, 1), (2, 3)):
        watch.observe(record({"type": "suspect", "rank": 1, "step": step, "device": "cpu", "host": "h",
                              "transient_faults": n, "limit": 1, "cause": SDC_CAUSE}))
    watch.observe(record({**evidence, "step": 3, "evidence": ["v: several values differ"]}))  # after the suspect
    watch.observe(record({"type": "suspect", "rank": 1, "step": 6, "device": "cpu", "host": "h",
                          "transient_faults": 1, "limit": 1, "cause": SDC_CAUSE}))  # the spare, struck once
    first, moved = watch.devices(exclusion_on=False)
    assert (first.steps, first.evidence, first.slot) == ([1, 3], ["v: several values differ"], 1) and first.over_limit
    assert (moved.steps, moved.transient_faults) == ([6], 1)
    mark_moved([first, moved], [{"rank": 1, "attempt": 0, "outcome": "recovered", "number": 1, "action": "replaced"}])
    assert first.then == "its rank moved to a warm spare (live recovery 1)" and moved.then == ""


def test_a_struck_out_gpu_is_never_replaced_in_place_it_shrinks_or_the_attempt_restarts():
    live, _ = _live()
    assert live.why_not(1, [0]) is None  # any other loss: a spare takes the rank
    assert "rank 1's GPU is a suspect device and a warm spare takes a rank on the rank's own GPU" in \
        live.why_not(1, [0], suspect_gpu=True)
    shrinking, _metrics, _told = _shrinking(floor=2, spares=1)
    assert not shrinking.shrinks() and shrinking.shrinks(suspect_gpu=True)
    assert shrinking.why_not(2, [0, 1, 3], suspect_gpu=True) is None  # the survivors go on without it


def test_a_restart_leaves_a_struck_out_gpu_out_without_the_flag_but_not_a_transient_one():
    out = exclude_suspects(GPU4, EXIT_8, [sdc(2)], 1, enabled=False)
    assert out.gpus == (2,) and out.said == (
        "a second silent data corruption: attempt 1 runs without GPU 2 (2 silent data corruptions, limit 1): "
        "world size 4 -> 3 (GPU 0, GPU 1, GPU 3)",)
    transient = SuspectDevice(attempt=0, rank=2, device="cuda:0", gpu=2, host="h", transient_faults=3, limit=2, step=4)
    assert exclude_suspects(GPU4, EXIT_8, [transient], 1, enabled=False).gpus == ()


def test_check_shows_the_list_and_clears_an_entry_or_refuses_bad_input_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    host = list_path(tmp_path).stem
    remember(tmp_path / "logs", "r1", [sdc(None, slot=1)], host=host)
    args = ["--debug", "--set", "data.dataset=dummy", "--set", "system.device=cpu"]
    assert check.main(args) == 0
    out = capsys.readouterr().out
    assert "suspect list (" in out and "CPU1: 1 strike(s)" in out and "[--clear-suspect CPU1]" in out
    with pytest.raises(SystemExit) as bad:
        check.main([*args, "--clear-suspect", "GPU9"])
    err = capsys.readouterr().err
    assert bad.value.code == 2 and err.splitlines() == [
        f"gpuherd check: error: --clear-suspect GPU9: not on this host's suspect list "
        f"{tmp_path / 'logs' / '.suspect-devices' / f'{host}.json'} (CPU1)"]
    assert check.main([*args, "--clear-suspect", "cpu1"]) == 0
    assert "CPU1 taken off the suspect list" in capsys.readouterr().err
    assert SuspectList.load(list_path(tmp_path / "logs", host)).devices == []


def test_a_run_root_that_is_a_file_has_no_list_and_nothing_is_said(tmp_path, capfd):
    """Validation refuses such a run root in one line; the list must not add a warning first."""
    from loguru import logger

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    sink = logger.add(lambda m: print(m, end=""), level="WARNING")
    try:
        found = SuspectList.load(list_path(a_file))
    finally:
        logger.remove(sink)
    assert found.devices == [] and found.damaged is None
    assert "suspect list" not in capfd.readouterr().out
