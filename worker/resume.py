"""Which checkpoint a run resumes from, and whether it is whole
(docs/design/checkpoints.md).

- `training.resume=PATH`: that checkpoint, verified; any problem is one line, exit 2.
- `training.resume=auto`: the newest checkpoint in `system.checkpoint_dir` that
  verifies; each newer one that does not is skipped with one WARNING naming it and why.
- a restarted attempt (`GPUHERD_RESUME`, the supervisor's pick): the checkpoint must
  record this run's id. Another run's is refused (two runs share the directory, and
  continuing its weights would be silently wrong); a corrupt one falls back to the
  newest valid checkpoint of this run.

Verifying is a collective: every rank checks the sizes, the ranks split the digests
work, and every rank reaches the same verdict from the gathered results.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from gpuherd.checkpoint_layout import list_checkpoints
from gpuherd.checkpoint_manifest import Manifest, checksum_problem, read_manifest, size_problem, written_by
from gpuherd.exit_codes import ExitCode
from worker import distributed as wdist
from worker.checkpoint_io import read_meta
from worker.distributed import WorkerError


@dataclass(frozen=True)
class CheckedCheckpoint:
    path: Path
    problem: str | None  # None: whole, and its meta is readable
    run_id: str | None  # the run that wrote it; None when it does not say
    meta: dict[str, Any] | None


@dataclass(frozen=True)
class Picker:
    directory: Path
    run_id: str  # "" outside a named run: no run-id rule then
    rank: int
    world_size: int

    def pick(self, want: str | None, handed: str | None) -> CheckedCheckpoint | None:
        """The checkpoint to resume (see the module doc), or None to start at step 0."""
        if handed:
            return self._restart_point(Path(handed))
        if want is None:
            return None
        if want != "auto":
            verdict = self.check(Path(want))
            if verdict.problem:
                raise WorkerError(verdict.problem, ExitCode.USAGE)
            return verdict
        newest = [path for _, path in reversed(list_checkpoints(self.directory))]
        if not newest:
            return None
        found, first_problem = self._first_valid(newest)
        if found is None:
            raise WorkerError(f"none of the {len(newest)} checkpoint(s) in {self.directory} can be resumed; "
                              f"the newest: {first_problem}", ExitCode.USAGE)
        return found

    def check(self, path: Path) -> CheckedCheckpoint:
        """Verify `path` against its manifest and read its meta (a collective)."""
        problem, manifest, meta = self._local_check(path)
        problems = [p for p in wdist.gather_objects(problem) if p]
        run_id = manifest.run_id if manifest is not None else (meta or {}).get("run_id")
        if problems:
            return CheckedCheckpoint(path, problems[0], run_id, None)
        return CheckedCheckpoint(path, None, run_id, meta)

    def _local_check(self, path: Path) -> tuple[str | None, Manifest | None, dict[str, Any] | None]:
        if not path.exists():
            return f"checkpoint not found: {path}", None, None
        try:
            manifest = read_manifest(path)
        except ValueError as exc:
            return str(exc), None, None
        if manifest is not None:
            mine = sorted(manifest.files)[self.rank::self.world_size]
            problem = size_problem(path, manifest) or checksum_problem(path, manifest, mine)
            if problem:
                return problem, manifest, None
        try:
            meta = read_meta(path)
        except WorkerError as exc:
            return str(exc), manifest, None
        if manifest is None:
            self._warn(f"checkpoint {path} has no manifest (saved by an older gpuherd, or interrupted just "
                       "before its manifest): it cannot be verified")
        return None, manifest, meta

    def _first_valid(self, candidates: list[Path]) -> tuple[CheckedCheckpoint | None, str | None]:
        first_problem = None
        for path in candidates:
            verdict = self.check(path)
            if verdict.problem is None:
                return verdict, first_problem
            first_problem = first_problem or verdict.problem
            self._warn(f"{verdict.problem}: skipped")
        return None, first_problem

    def _restart_point(self, handed: Path) -> CheckedCheckpoint:
        verdict = self.check(handed)
        if not self.run_id:
            if verdict.problem:
                raise WorkerError(verdict.problem, ExitCode.USAGE)
            return verdict
        if verdict.run_id != self.run_id and (verdict.problem is None or verdict.run_id is not None):
            whose = f"run {verdict.run_id}" if verdict.run_id else "a run that recorded no run id"
            raise WorkerError(
                f"checkpoint {handed} was written by {whose}, not by this run ({self.run_id}): another run shares "
                f"system.checkpoint_dir {self.directory}; refusing to resume its weights (give each run its own "
                "checkpoint_dir)", ExitCode.USAGE)
        if verdict.problem is None:
            return verdict
        self._warn(f"{verdict.problem}: skipped, looking for an older checkpoint of this run")
        older = [path for _, path in reversed(list_checkpoints(self.directory))
                 if path != handed and written_by(path, self.run_id)]
        found, _ = self._first_valid(older)
        if found is None:
            raise WorkerError(f"cannot resume run {self.run_id}: {verdict.problem}, and {self.directory} holds no "
                              "older valid checkpoint of this run", ExitCode.USAGE)
        return found

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            logger.warning(message)
