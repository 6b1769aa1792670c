"""What one part found: its figures (each with the device it was measured on), its notes and its
failed checks, written as JSON to the file the runner named (`--result`)."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson


@dataclass
class Outcome:
    device: str  # what the figures were measured on: "NVIDIA H100 80GB HBM3", "cpu (rehearsal)"
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def figure(self, measure: str, value: str, goal: str = "", met: bool | None = None) -> None:
        self.rows.append({"measure": measure, "value": value, "goal": goal, "met": met})

    def check(self, ok: bool, failure: str) -> bool:
        """A check of the part: a failure is named in the record (the part then failed)."""
        if not ok:
            self.failures.append(failure)
        return ok

    def note(self, line: str) -> None:
        self.notes.append(line)

    def save(self, path: Path) -> None:
        path.write_bytes(orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2))


def device_name(device: str) -> str:
    """The device a part's figures come from, named as the record shows it."""
    if device != "cuda":
        return "cpu (rehearsal)"
    import torch

    return torch.cuda.get_device_name(0)


def part_main(run: Callable[[argparse.Namespace, Outcome], None], describe: str,
              add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """A part's command line: `[ARGS] --device cuda|cpu --result FILE`; `run` fills the outcome.
    Exit 0 when every check held, 1 otherwise (an exception is a failure with its last line)."""
    parser = argparse.ArgumentParser(description=describe)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    outcome = Outcome(device_name(args.device))
    try:
        run(args, outcome)
    except Exception as exc:  # noqa: BLE001 - the part failed; the runner goes on with the next one
        traceback.print_exc()
        outcome.failures.append(f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
    outcome.save(args.result)
    for failure in outcome.failures:
        print(f"acceptance: check failed: {failure}", file=sys.stderr)
    return 1 if outcome.failures else 0
