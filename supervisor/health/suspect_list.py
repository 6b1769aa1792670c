"""The suspect list that outlives a run: devices blamed for silent data corruption or transient
faults, with their evidence, one JSON file per host under the run root.

Where: `<system.run_root>/.suspect-devices/<host>.json`. Beside the runs, not in a per-user
state directory, because the runs are the evidence (each strike names its run id, whose
summary.json and logs sit next to the list), every gpuherd command already takes the run root
from the same configuration (`gpuherd check` reads what `gpuherd run` wrote with the same
options), a team sharing a run root shares what it learned about its machines, and a test
with its own run root never touches a user's list. One file per host: hosts sharing the run
root over a network filesystem each write only their own (GPU numbers mean nothing across
hosts), so no two writers ever race on one file across machines. A dot folder: a run id must
start with a letter or digit, so no run can ever own that name, and tools that take the newest
entry of the run root still find a run.

Written atomically (gpuherd/files.py); a device gains one strike per attempt it was blamed in.
Read tolerantly: a missing file is an empty list; a damaged or foreign one (hand-edited, cut
by a full disk outside gpuherd, another version's) is one warning and an empty list, never a
crash, and it is replaced at the next write.

A device is keyed by its GPU UUID where known (an index can name another board after a swap),
else by its label (`GPU3`, `CPU1`: CPU workers have no device to exclude, but listing them
makes the path testable without a GPU and says which slot of a run went wrong).

A start (supervisor/main.py) plans its GPUs around the listed ones (`avoid_listed`), refuses an
explicit --gpus naming one, and says what it did (`at_start`); `gpuherd check` shows the list
and `--clear-suspect` edits it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from loguru import logger

from gpuherd.exit_codes import ExitCode
from gpuherd.files import write_bytes_atomic
from supervisor.gpus import DeviceError, DevicePlan, GpuInfo
from supervisor.summary import SDC_CAUSE, SuspectDevice, now_iso

FORMAT = 1
FOLDER = ".suspect-devices"
CLEAR_HINT = "`gpuherd check --clear-suspect {label}` to put it back for good, or --allow-suspect-gpus for one run"


def list_path(run_root: str | Path, host: str | None = None) -> Path:
    return Path(run_root) / FOLDER / f"{host or socket.gethostname()}.json"


@dataclass(frozen=True)
class Strike:
    """One attempt in which the device was blamed."""

    run_id: str
    attempt: int
    rank: int
    step: int | None
    cause: str  # silent data corruption | transient fault
    count: int  # strikes (or transient faults) in that attempt
    evidence: tuple[str, ...] = ()  # bucket, value and bit; or the recompute's finding
    time: str = ""

    def line(self) -> str:
        proof = f": {'; '.join(self.evidence[:2])}" if self.evidence else ""
        return (f"{self.cause} x{self.count}, run {self.run_id} attempt {self.attempt}, rank {self.rank}, step "
                f"{self.step}, {self.time}{proof}")


@dataclass(frozen=True)
class Listed:
    """A device on the list."""

    kind: str  # cuda | cpu
    index: int  # nvidia-smi's GPU index, or the CPU worker slot
    uuid: str = ""
    strikes: tuple[Strike, ...] = ()

    @property
    def label(self) -> str:
        return f"{'GPU' if self.kind == 'cuda' else 'CPU'}{self.index}"

    @property
    def key(self) -> str:
        return self.uuid or self.label

    def line(self) -> str:
        uuid = f" ({self.uuid})" if self.uuid else ""
        last = self.strikes[-1].line() if self.strikes else "no evidence kept"
        return f"{self.label}{uuid}: {len(self.strikes)} strike(s); last: {last}"

    def matches(self, selector: str) -> bool:
        """`GPU3`, `GPU 3`, `3` (a GPU), a UUID, `CPU1`."""
        s = selector.strip().replace(" ", "")
        if self.uuid and s == self.uuid:
            return True
        if s.isdigit():
            return self.kind == "cuda" and int(s) == self.index
        return s.upper() == self.label


@dataclass
class SuspectList:
    path: Path
    host: str
    devices: list[Listed] = field(default_factory=list)
    damaged: str | None = None  # why the file on disk could not be read (it is replaced at the next write)

    @classmethod
    def load(cls, path: Path, host: str | None = None) -> SuspectList:
        """Never raises: a missing file is empty; a damaged one is said once (WARNING) and empty."""
        found = cls(path, host or path.stem)
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            # no list; a run root that is not a directory is refused by validation in one line
            return found
        except OSError as exc:
            found.damaged = f"cannot be read ({exc.strerror or exc})"
        else:
            try:
                found.devices = _decode(orjson.loads(raw))
            except (orjson.JSONDecodeError, ValueError, TypeError, KeyError) as exc:
                found.damaged = f"is damaged ({exc}); it is ignored and replaced at the next write"
        if found.damaged:
            logger.warning(f"suspect list {path} {found.damaged}")
        return found

    def gpus(self) -> list[Listed]:
        return [d for d in self.devices if d.kind == "cuda"]

    def entry_for(self, index: int, uuid: str) -> Listed | None:
        """The listed GPU that is this one: by UUID where both know it (an index can name another
        board after a swap), else by index."""
        for entry in self.gpus():
            if (entry.uuid == uuid) if (entry.uuid and uuid) else (entry.index == index):
                return entry
        return None

    def add(self, suspect: SuspectDevice, run_id: str, uuid: str = "") -> Listed:
        """One strike for the device `suspect` names (an entry created if new)."""
        kind, index = ("cuda", suspect.gpu) if suspect.gpu is not None else ("cpu", suspect.slot)
        strike = Strike(run_id=run_id, attempt=suspect.attempt, rank=suspect.rank, step=suspect.step,
                        cause=suspect.cause, count=suspect.transient_faults, evidence=tuple(suspect.evidence),
                        time=now_iso())
        for i, d in enumerate(self.devices):
            if (d.uuid and d.uuid == uuid) or (not (d.uuid and uuid) and d.kind == kind and d.index == index):
                self.devices[i] = replace(d, index=index, uuid=uuid or d.uuid, strikes=d.strikes + (strike,))
                return self.devices[i]
        self.devices.append(Listed(kind, index, uuid, (strike,)))
        return self.devices[-1]

    def remove(self, selector: str) -> list[Listed]:
        """The entries `selector` names (`all`: every one), taken off the list."""
        gone = list(self.devices) if selector.strip().lower() == "all" else \
            [d for d in self.devices if d.matches(selector)]
        self.devices = [d for d in self.devices if d not in gone]
        return gone

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"format": FORMAT, "host": self.host, "devices": [_encode(d) for d in self.devices]}
        write_bytes_atomic(self.path, orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")
        self.damaged = None


def _encode(d: Listed) -> dict[str, Any]:
    return {"kind": d.kind, "index": d.index, "uuid": d.uuid, "label": d.label,
            "strikes": [{**asdict(s), "evidence": list(s.evidence)} for s in d.strikes]}


def _decode(body: Any) -> list[Listed]:
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("devices"), list):
        raise ValueError(f"not a format-{FORMAT} suspect list")
    out = []
    for d in body["devices"]:
        if d["kind"] not in ("cuda", "cpu") or not isinstance(d["index"], int):
            raise ValueError(f"a device entry with kind {d['kind']!r} and index {d['index']!r}")
        strikes = tuple(Strike(run_id=str(s["run_id"]), attempt=int(s["attempt"]), rank=int(s["rank"]),
                               step=s.get("step"), cause=str(s["cause"]), count=int(s["count"]),
                               evidence=tuple(str(e) for e in s.get("evidence") or ()), time=str(s.get("time", "")))
                        for s in d.get("strikes") or ())
        out.append(Listed(d["kind"], d["index"], str(d.get("uuid") or ""), strikes))
    return out


def listable(d: SuspectDevice) -> bool:
    """What goes on the list (and so is left out of the next start): any device named by silent
    data corruption (one wrong number without a sign is one too many), and a device over its limit
    of transient faults (it stopped an attempt with exit 8). A transient fault within the limit
    stays in its run's summary only: a replayed step that came out clean is tolerated by design."""
    return d.cause == SDC_CAUSE or d.over_limit


def remember(run_root: str | Path, run_id: str, suspects: list[SuspectDevice], host: str | None = None) -> None:
    """An attempt's suspects onto this host's list, one strike each, said in one line each. A list
    that cannot be written is one warning: the run's own summary still holds the evidence."""
    found = [d for d in suspects if listable(d)]
    if not found:
        return
    path = list_path(run_root, host)
    listed = SuspectList.load(path, host or socket.gethostname())
    entries = [listed.add(d, run_id, d.uuid) for d in found]
    try:
        listed.save()
    except OSError as exc:
        logger.warning(f"suspect list {path} not written ({exc.strerror or exc}): the devices stay in this run's "
                       "summary.json only")
        return
    for entry in entries:
        then = ("CPU workers: nothing to exclude, the next start names it" if entry.kind == "cpu" else
                "the next start leaves it out; " + CLEAR_HINT.format(label=entry.label))
        logger.warning(f"suspect list: {entry.label} ({len(entry.strikes)} strike(s)) recorded in {path}: {then}")


@dataclass(frozen=True)
class StartExclusion:
    """What a start does with this host's list (`at_start`)."""

    gpus: tuple[int, ...] = ()  # listed GPUs the plan runs without
    said: tuple[str, ...] = ()  # one line each, for the console and supervisor.log


def avoid_listed(listed: SuspectList) -> Callable[[GpuInfo], str | None]:
    """For the planner's automatic choice (supervisor/gpus/plan.py): why a GPU is not to be
    chosen, else None. Only narrowing the choice, `--nproc N` still gets N healthy GPUs."""
    def why(gpu: GpuInfo) -> str | None:
        entry = listed.entry_for(gpu.index, gpu.uuid)
        if entry is None:
            return None
        return (f"GPU {gpu.index} is on this host's suspect list ({entry.line()}; the list: {listed.path}): check "
                f"it (`gpuherd check`, nvidia-smi), then --allow-suspect-gpus or `gpuherd check --clear-suspect "
                f"{entry.label}`")
    return why


def at_start(plan: DevicePlan, listed: SuspectList, *, allow: bool, explicit: bool) -> StartExclusion:
    """What the start says about this host's list, the plan made (with `avoid_listed` unless
    `allow` or `explicit`). CPU workers have nothing to leave out: a listed CPU slot is named and
    the run starts as asked. `allow` (--allow-suspect-gpus): listed GPUs are used, said once each.
    `explicit` (--gpus / system.gpus / system.device_id named the GPUs): a listed one is refused
    (DeviceError, exit 2), never quietly dropped: whoever names GPUs expects exactly those, and a
    silent change of the world size would surprise them more than one line now. Else each listed
    GPU the plan runs without is said, with how to put it back."""
    if plan.kind != "cuda":
        return StartExclusion(said=tuple(
            f"suspect list {listed.path}: {d.line()}; CPU workers have no device to leave out: starting as asked"
            for d in listed.devices if d.kind == "cpu"))
    used = [(s.device_id, e) for s in plan.slots if (e := listed.entry_for(s.device_id, s.uuid)) is not None]
    if allow:
        return StartExclusion(said=tuple(f"GPU {gpu} is on this host's suspect list ({e.line()}): used anyway "
                                         "(--allow-suspect-gpus)" for gpu, e in used))
    if used:
        gpu, entry = used[0]
        what = "--gpus names" if explicit else "the plan holds"
        raise DeviceError(f"{what} GPU {gpu}, which is on this host's suspect list ({entry.line()}): "
                          f"--allow-suspect-gpus to use it anyway, or `gpuherd check --clear-suspect {entry.label}` to "
                          "take it off", ExitCode.USAGE)
    if explicit:  # the GPUs named are used; the listed ones were not asked for
        return StartExclusion()
    planned = {s.uuid for s in plan.slots if s.uuid} | {str(s.device_id) for s in plan.slots}
    out = [e for e in listed.gpus() if not (e.uuid in planned or (not e.uuid and str(e.index) in planned))]
    return StartExclusion(gpus=tuple(sorted(e.index for e in out)), said=tuple(
        f"GPU {e.index} left out: on this host's suspect list ({e.line()}); this run: {plan.world_size} worker(s) on "
        f"{', '.join(f'GPU {s.device_id}' for s in plan.slots)}; " + CLEAR_HINT.format(label=e.label) for e in out))
