"""Asking a running supervisor for a warm spare (`gpuherd spare RUN`): the request, its answer,
and the judgment, both sides of the channel.

The channel is the run directory, which the supervisor already owns and every command already
finds: `gpuherd spare` writes `requests/spare-<id>.json` atomically (`{"format": 1, "id",
"device", "time"}`) while the run's supervisor holds `run.lock`; the supervision loop lists
`requests/` at its 0.25 s checks, takes each request (removes it), judges it (`judge`: a pure
function of the request and what the loop knows) and writes `requests/spare-<id>.answer.json`
atomically (`{"format": 1, "id", "code", "message", "rank", "device", "pid"}`), which the
command prints and exits with. No signal is spent (SIGUSR1/2 already ask for a save), and a
request needs no process of its own on the supervisor's side.

What a granted request does is the pool's (spares.py: one spare more than --spares K) and live
recovery's (live_recovery.py: that spare, once warm, takes back the carried rank it was asked
for, through the policy's `SpareReady` -> `Regrow`, as a refilled pool's spare would).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson
from loguru import logger

from gpuherd.exit_codes import ExitCode
from gpuherd.files import write_bytes_atomic

FORMAT = 1
REQUESTS = "requests"  # under the run directory
_REQUEST = re.compile(r"^spare-([0-9a-f]{8,32})\.json$")
_TAG = re.compile(r"^(gpu|cuda|cpu)?:?(\d+)$")
_UUID = re.compile(r"^GPU-[0-9a-fA-F-]{8,}$")


def device_name(text: str) -> str:
    """The device as the run's console names it: `3`, `GPU3`, `gpu 3`, `cuda:3` -> `GPU3`;
    `CPU1`, `cpu:1` -> `CPU1`; a GPU UUID (`GPU-...`) as it is. ValueError: none of these."""
    s = text.strip().replace(" ", "")
    if _UUID.match(s):
        return s
    m = _TAG.match(s.lower())
    if m is None:
        raise ValueError(f"--device {text!r}: expected a device like GPU3, 3, cuda:3, CPU1 or a GPU UUID")
    return f"{'CPU' if m.group(1) == 'cpu' else 'GPU'}{int(m.group(2))}"


@dataclass(frozen=True)
class SpareRequest:
    id: str
    device: str | None = None  # device_name()'s form; None: the device the lost rank left
    time: float = 0.0


@dataclass(frozen=True)
class Answer:
    code: int  # the command's exit code (gpuherd/exit_codes.py): 0 granted
    message: str  # one line for the operator
    rank: int | None = None  # granted: the carried rank the spare takes back
    device: str | None = None
    pid: int | None = None  # granted: the spare's pid

    @property
    def granted(self) -> bool:
        return self.code == ExitCode.OK


@dataclass(frozen=True)
class Facts:
    """What the supervision loop knows when it judges a request."""

    running: str | None  # None: the attempt trains undisturbed; else what it does instead, in words
    off: str | None  # why no rank of this attempt can be shrunk or grown back (None: it can)
    carried: Mapping[int, str]  # rank -> its device: the ranks lost and carried by a shrunk group
    devices: Mapping[int, tuple[str, str]]  # every rank of the attempt -> (its device, its GPU UUID or "")
    asked: Mapping[int, int]  # carried rank -> pid of a spare asked for it, still waiting to take it
    standing: tuple[int, ...] = ()  # pids of the pool's own spares (--spares K): each takes the lowest carried rank
    finished: bool = False  # a rank said `done`: training is over
    # multi-node: another node's carried rank -> that node (that node's spares take it back)
    elsewhere: Mapping[int, int] = field(default_factory=dict)
    dead_nodes: tuple[int, ...] = ()  # multi-node: nodes that died whole, their ranks carried to the end


def judge(request: SpareRequest, facts: Facts) -> Answer | int:
    """The carried rank a new spare is to take back, or the answer that refuses the request: a
    state of the run that takes no spare (REFUSED, 10), or a wrong request (USAGE, 2) whatever
    the group's state: a --device that is no device of the run, or a training rank's."""
    refused = ExitCode.REFUSED
    if facts.off is not None:
        return Answer(refused, f"this run's group cannot shrink or grow back: {facts.off}")
    if facts.running is not None:
        return Answer(refused, f"the run is {facts.running}: no spare started")
    if facts.finished:
        return Answer(refused, "training has finished: no spare started")
    named = None if request.device is None else _named_rank(request.device, facts)
    if isinstance(named, Answer):
        return named
    if not facts.carried and facts.elsewhere:
        lost = ", ".join(f"node {node}'s rank {rank}" for rank, node in sorted(facts.elsewhere.items()))
        return Answer(refused, f"the ranks lost are another node's ({lost}): ask that node's supervisor "
                               "(`gpuherd spare` with its run directory); a spare runs on the node whose device the "
                               "rank left")
    if not facts.carried and facts.dead_nodes:
        nodes = ", ".join(f"node {node}" for node in facts.dead_nodes)
        return Answer(refused, f"the ranks lost are {nodes}'s, which died whole: they come back with the job's next "
                               "restart (its join waits for every node), not with a spare")
    if not facts.carried:
        return Answer(refused, f"the group is not shrunk: all {len(facts.devices)} ranks train, nothing to grow back")
    # the pool's own spares take the lowest carried ranks nobody asked a spare for
    waiting = sorted(r for r in facts.carried if r not in facts.asked)[len(facts.standing):]
    if named is None:
        if not waiting:
            return Answer(refused, f"a spare is already starting for every carried rank ({_spares(facts)}): the "
                                   "group grows back once it is warm")
        return waiting[0]
    if named not in waiting:
        return Answer(refused, f"a spare is already starting for rank {named} on {facts.carried[named]} "
                               f"({_spares(facts)}): the group grows back once it is warm")
    return named


def _named_rank(device: str, facts: Facts) -> int | Answer:
    """The lost rank whose device --device names, or the answer (USAGE) for a device that is no
    device of the run here, or a training rank's."""
    rank = next((r for r, (tag, uuid) in facts.devices.items() if device in (tag, uuid)), None)
    left = ", ".join(f"{facts.carried[r]} (rank {r})" for r in sorted(facts.carried)) or "no rank is lost here"
    if rank is None:
        ours = ", ".join(tag for tag, _uuid in sorted(facts.devices.values()))
        return Answer(ExitCode.USAGE, f"--device {device} is not one of this run's devices here ({ours}): "
                                      f"a spare takes back a lost rank on the device it left: {left}")
    if rank not in facts.carried:
        return Answer(ExitCode.USAGE, f"--device {device} is rank {rank}'s, which is training: name a device "
                                      f"a lost rank left: {left}")
    return rank


def _spares(facts: Facts) -> str:
    asked = [f"pid {pid} for rank {r}" for r, pid in sorted(facts.asked.items())]
    return ", ".join(asked + [f"the pool's pid {pid}" for pid in facts.standing])


class SpareDesk:
    """The supervisor's side of `requests/`: one per run (every attempt reads the same desk)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / REQUESTS
        for stale in self._listed():  # a request left from an earlier start (its command gave up)
            stale.unlink(missing_ok=True)
            logger.debug(f"removed a request from before this start of the run: {stale.name}")

    def _listed(self) -> list[Path]:
        try:
            return sorted(p for p in self.dir.iterdir() if _REQUEST.match(p.name))
        except OSError:  # no request was ever made: the directory does not exist
            return []

    def take(self) -> list[SpareRequest]:
        """The requests written since the last call, each removed as it is read; one that cannot
        be read is answered at once."""
        taken: list[SpareRequest] = []
        for path in self._listed():
            request_id = _REQUEST.match(path.name).group(1)
            try:
                body = orjson.loads(path.read_bytes())
                path.unlink(missing_ok=True)
                taken.append(decode_request(body, request_id))
            except (OSError, orjson.JSONDecodeError, ValueError) as exc:
                path.unlink(missing_ok=True)
                self.answer(request_id, Answer(ExitCode.USAGE, f"unreadable request {path.name}: {exc}"))
        return taken

    def answer(self, request_id: str, answer: Answer) -> None:
        try:
            write_bytes_atomic(answer_path(self.dir.parent, request_id),
                               orjson.dumps({"format": FORMAT, "id": request_id, **asdict(answer)}))
        except OSError as exc:  # the command waits out its timeout and says so
            logger.warning(f"gpuherd spare: the answer to request {request_id} could not be written: {exc}")


def decode_request(body: object, request_id: str) -> SpareRequest:
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("id") != request_id:
        raise ValueError(f"not a format-{FORMAT} spare request with id {request_id}")
    device = body.get("device")
    if device is not None and not isinstance(device, str):
        raise ValueError("device is not a string")
    return SpareRequest(request_id, None if device is None else device_name(device), float(body.get("time") or 0))


def request_path(run_dir: Path, request_id: str) -> Path:
    return run_dir / REQUESTS / f"spare-{request_id}.json"


def answer_path(run_dir: Path, request_id: str) -> Path:
    return run_dir / REQUESTS / f"spare-{request_id}.answer.json"


def write_request(run_dir: Path, device: str | None) -> SpareRequest:
    """The command's side: a new request, in place atomically (the supervisor never reads half of one)."""
    request = SpareRequest(secrets.token_hex(8), device, time.time())
    (run_dir / REQUESTS).mkdir(exist_ok=True)
    write_bytes_atomic(request_path(run_dir, request.id), orjson.dumps({"format": FORMAT, **asdict(request)}))
    return request


def read_answer(run_dir: Path, request_id: str) -> Answer | None:
    """The supervisor's answer, once written (then removed: it was read), else None."""
    path = answer_path(run_dir, request_id)
    try:
        body = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError) as exc:
        return Answer(ExitCode.FAILURE, f"the supervisor's answer {path} cannot be read: {exc}")
    path.unlink(missing_ok=True)
    fields = {k: body.get(k) for k in ("rank", "device", "pid")}
    return Answer(int(body.get("code", ExitCode.FAILURE)), str(body.get("message", "")), **fields)
