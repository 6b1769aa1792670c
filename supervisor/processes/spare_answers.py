"""`gpuherd spare` answered by a running supervision loop (supervision.py): each request the
run's SpareDesk took is judged (spare_requests.judge) on what this node sees now, and answered;
a granted one starts a spare through live recovery, which takes its carried rank back once warm.
"""

from __future__ import annotations

from loguru import logger

from gpuherd.exit_codes import ExitCode
from supervisor.processes.live_recovery import LiveRecovery
from supervisor.processes.spare_requests import Answer, Facts, SpareDesk, judge
from supervisor.processes.spawn import WorkerProcess


def answer_requests(requests: SpareDesk, live: LiveRecovery | None, workers: dict[int, WorkerProcess],
                    running: str | None) -> None:
    """`running`: None while the attempt runs with no cause, else the loop's phase (a refusal)."""
    for request in requests.take():
        verdict = judge(request, facts(live, workers, running))
        answer = verdict if isinstance(verdict, Answer) else _start_asked_spare(live, workers, verdict)
        logger.log("INFO" if answer.granted else "WARNING", f"gpuherd spare: {answer.message}")
        requests.answer(request.id, answer)


def _start_asked_spare(live: LiveRecovery, workers: dict[int, WorkerProcess], rank: int) -> Answer:
    tag = workers[rank].slot.tag
    try:
        spare = live.ask_spare(rank)
    except OSError as exc:
        return Answer(ExitCode.FAILURE, f"the spare for rank {rank} could not be started: {exc}")
    return Answer(ExitCode.OK, f"warm spare pid {spare.pid} started for rank {rank} on {tag}: the group grows "
                               "back to it at a step boundary once it is warm",
                  rank=rank, device=tag, pid=spare.pid)


def facts(live: LiveRecovery | None, workers: dict[int, WorkerProcess], running: str | None) -> Facts:
    """What a spare request is judged by: the phase, the carried ranks, the spares already there."""
    devices = {rank: (w.slot.tag, w.slot.uuid) for rank, w in workers.items()}
    if live is None:
        return Facts(running, "live recovery is off (--max-restarts with --min-replicas lets a group shrink, "
                              "then grow back)", {}, devices, {})
    pids = [s.pid for s in live.pool.spares if s.poll() is None]
    carried = {rank: devices[rank][0] for rank in live.carried()}  # this node's: its spares take them back
    asked = {live.asked[pid]: pid for pid in pids if live.asked.get(pid) in carried}
    return Facts(running, live.off, carried, devices, asked, tuple(p for p in pids if p not in live.asked),
                 finished=live.finished, elsewhere=live.carried_elsewhere(), dead_nodes=live.dead_nodes())
