"""Goodput in TensorBoard: the whole run's ratio, productive and badput seconds by cause,
at the end of each attempt and of each start, to `<run_dir>/tensorboard/goodput/` (its own
run beside the workers' scalars, on the same step axis: the last step the workers completed).

Written when the `tensorboard` package is installed (as the workers' scalars are), with its
event-file writer alone: the supervisor never imports torch. That import still costs a few
hundred milliseconds, so `GoodputScalars` starts it in a background thread when the run starts
and a failing run's exit does not wait for it.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import time
from pathlib import Path
from typing import Any

from loguru import logger

from gpuherd.log_writes import quiet_writer_thread_disk_errors
from supervisor.goodput.account import Goodput
from supervisor.goodput.timeline import Event

MODULES = ("tensorboard.compat.proto.event_pb2", "tensorboard.compat.proto.summary_pb2",
           "tensorboard.summary.writer.event_file_writer")
SUBDIR = Path("tensorboard") / "goodput"


def scalars(g: Goodput) -> dict[str, float]:
    """The tags and values one point of the run's goodput is written as."""
    return {"goodput/ratio": g.ratio, "goodput/wall_s": g.wall_s, "goodput/productive_s": g.productive_s,
            **{f"goodput/badput_s/{cause}": seconds for cause, seconds in g.badput_s.items()}}


def last_step(events: list[Event]) -> int:
    """The step axis the workers' scalars use: the newest completed step (0 before any)."""
    return max((e.step for e in events if e.kind == "step" and e.step is not None), default=0)


class GoodputScalars:
    def __init__(self, run_dir: Path) -> None:
        self.where = run_dir / SUBDIR
        self.modules: dict[str, Any] = {}
        self.writer: Any = None
        self.failed = False
        self.loading: threading.Thread | None = None
        if importlib.util.find_spec("tensorboard") is None:
            logger.debug("tensorboard not installed: no goodput event files")
            return
        self.loading = threading.Thread(target=self._load, name="goodput-tensorboard-import", daemon=True)
        self.loading.start()

    def _load(self) -> None:
        try:
            self.modules = {name: importlib.import_module(name) for name in MODULES}
        except Exception as exc:  # noqa: BLE001 - a broken tensorboard install costs the event files, not the run
            logger.debug(f"tensorboard unusable ({type(exc).__name__}: {exc}): no goodput event files")

    def write(self, g: Goodput, step: int, wall_time: float | None = None) -> bool:
        """One point; False (and nothing written) when tensorboard is missing, still importing, or
        the disk refuses it (said once: the run's outcome never depends on its charts)."""
        if self.loading is None or self.loading.is_alive() or len(self.modules) < len(MODULES) or self.failed:
            return False
        event_pb2, summary_pb2, event_file_writer = (self.modules[name] for name in MODULES)
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)
                                             for tag, value in scalars(g).items()])
        try:
            if self.writer is None:
                # the writer's own thread meets a full disk first: said once below, not as its traceback
                quiet_writer_thread_disk_errors()
                self.where.mkdir(parents=True, exist_ok=True)
                self.writer = event_file_writer.EventFileWriter(str(self.where))
            self.writer.add_event(event_pb2.Event(wall_time=wall_time or time.time(), step=step, summary=summary))
            self.writer.flush()
        except OSError as exc:
            self.failed = True
            logger.warning(f"goodput: TensorBoard cannot write to {self.where}: {exc.strerror or exc}; no more goodput "
                           "event files, the run goes on")
            return False
        return True

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError:
                pass
            self.writer = None
