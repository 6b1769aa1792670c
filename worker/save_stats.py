"""What checkpoints cost the loop, counted per save (worker/saver.py): the stall (the loop
blocked: capture, copy to host memory, and any wait for the previous write), the wait
alone, the write itself (in the background, or the blocking save's whole time), and what
each save cost the loop in all, measured on its step times (worker/save_cost.py). Shown on
the next step line (`| Ckpt: ...`) and in one line at the end of the run."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SaveStats:
    saves: int = 0  # saves the loop went through (written here or by rank 0)
    stall_s: float = 0.0
    stall_max_s: float = 0.0
    waits: int = 0  # saves that had to wait for the previous write
    wait_s: float = 0.0
    written: int = 0  # writes this rank published
    background: int = 0  # of them, written in the background
    write_s: float = 0.0
    write_cpu_s: float = 0.0  # the writes' CPU seconds, wherever they ran
    accounted: int = 0  # saves whose cost to the loop was measured
    cost_s: float = 0.0
    _note_stall: list[float] = field(default_factory=list)  # since the last step line
    _note_write: list[float] = field(default_factory=list)
    _note_wait: float = 0.0

    def staged(self, stall_s: float, wait_s: float) -> None:
        """A save the loop handed to the background (or to rank 0's) after `stall_s`."""
        self.saves += 1
        self.stall_s += stall_s
        self.stall_max_s = max(self.stall_max_s, stall_s)
        self._note_stall.append(stall_s)
        self._waited(wait_s)

    def published(self, stall_s: float, wait_s: float, write_s: float, background: bool,
                  cpu_s: float = 0.0) -> None:
        """A write of this rank's ended and published its checkpoint, in `cpu_s` CPU seconds."""
        if not background:  # a blocking save is also the loop's stall; a background one was counted staged
            self.saves += 1
            self.stall_s += stall_s
            self.stall_max_s = max(self.stall_max_s, stall_s)
            self._note_stall.append(stall_s)
            self._waited(wait_s)
        self.written += 1
        self.background += background
        self.write_s += write_s
        self.write_cpu_s += cpu_s
        self._note_write.append(write_s)

    def account(self, cost_s: float) -> None:
        """A save's whole cost to the loop, measured once its write ended."""
        self.accounted += 1
        self.cost_s += cost_s

    def _waited(self, wait_s: float) -> None:
        if wait_s > 0:
            self.waits += 1
            self.wait_s += wait_s
            self._note_wait += wait_s

    def step_note(self) -> str | None:
        """`Ckpt: stall 0.05s, write 2.31s` for the saves since the previous call (None: none)."""
        parts = []
        if self._note_stall:
            parts.append(f"stall {sum(self._note_stall):.2f}s")
        if self._note_wait:
            parts.append(f"waited {self._note_wait:.2f}s")
        if self._note_write:
            parts.append(f"write {sum(self._note_write):.2f}s")
        self._note_stall, self._note_write, self._note_wait = [], [], 0.0
        return f"Ckpt: {', '.join(parts)}" if parts else None

    def summary(self) -> str | None:
        """One line for the end of the run (None when nothing was saved)."""
        if not self.saves:
            return None
        line = (f"checkpoints: {self.saves} saved, the loop blocked {self.stall_s:.2f} s in all "
                f"({self.stall_s / self.saves:.3f} s per save, at most {self.stall_max_s:.3f} s)")
        if self.written:
            line += (f"; {self.written} written by this rank ({self.background} in the background), "
                     f"{self.write_s / self.written:.2f} s per write")
            if self.write_cpu_s:
                line += f" ({self.write_cpu_s / self.written:.2f} s of CPU)"
        if self.waits:
            line += f"; {self.waits} waited {self.wait_s:.2f} s in all for the previous write"
        if self.accounted:
            line += (f"; measured on the step times, {self.accounted} cost the loop {self.cost_s:.2f} s in all "
                     f"({self.cost_s / self.accounted:.3f} s per save)")
        return line
