"""`python -m worker.nan.replay PICKLE_OR_CHECKPOINT [--device cpu]`: run a recorded
suspicious step again, on any device (CPU included), and say whether it reproduces.

The step restarts from its checkpoint's weights (saved before the optimizer step)
and runs every recorded rank's micro-batches forward and backward as the engine
does (each loss / number of micro-batches), in the recorded precision, with the
debug probes attached; then each sample alone, forward and backward, to point at
the rows that do it ('!'). A replay that is non-finite again prints the NaN banner.

Exit 0: it reproduces (non-finite again; for a spike: above the recorded
threshold) -> the batch or the model. Exit 7: it does not -> the device it was
recorded on is suspect. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuherd.config import ConfigError
from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from worker.attention import resolve_backend
from worker.nan.banner import NanReport, render
from worker.nan.inspect_model import inspect_model
from worker.nan.probes import ForwardProbe, GradProbe, MicroBatchCounter
from worker.nan.recorded import Recorded, ReplayError, load_model, locate
from worker.nan.samples import SampleName

ROWS_SHOWN = 3  # healthy rows listed per rank besides the ones that reproduce the fault


@dataclass
class RankReplay:
    path: Path
    data: dict[str, Any]  # the rank's debug pickle
    loss: float
    grad_norm: float  # this rank's own gradients (the recorded norm was reduced over all ranks)
    report: NanReport
    rows: list[list[tuple[float, bool]]]  # per micro-batch, per row: (its own loss, its gradients finite)

    @property
    def kind(self) -> str:
        return str(self.data.get("kind", "nonfinite"))

    def threshold(self) -> float | None:
        spike = self.data.get("spike") or {}
        state = (spike.get("thresholds") or {}).get(spike.get("metric", "loss"))
        return None if not state else float(state["threshold"])

    @property
    def value(self) -> float:
        spike = self.data.get("spike") or {}
        return self.grad_norm if spike.get("metric") == "grad_norm" else self.loss

    @property
    def reproduces(self) -> bool:
        if self.kind == "nonfinite":
            return (not math.isfinite(self.loss) or not math.isfinite(self.grad_norm)
                    or bool(self.report.gradients) or bool(self.report.parameters))
        threshold = self.threshold()
        return threshold is not None and self.value > threshold


class Replayer:
    """One model, the debug probes on it, and the recorded precision."""

    def __init__(self, model: torch.nn.Module, meta: dict[str, Any], device: torch.device, recorded_on: str) -> None:
        self.model, self.device = model, device
        training = meta["config"]["training"]
        amp = training["use_amp"] and recorded_on.startswith("cuda")  # CPU runs train in fp32
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[training["amp_dtype"]] if amp else None
        try:
            backend, _ = resolve_backend(meta["config"]["model"]["attention"], device, self.dtype)
        except ConfigError:  # flash-attn recorded on a GPU, replayed where it does not exist
            backend = "sdpa"
        model.set_attention_backend(backend)
        model.train()
        self.counter = MicroBatchCounter()
        self.forward, self.grads = ForwardProbe(model, self.counter), GradProbe(model, self.counter)
        self.forward.attach()
        self.grads.attach()

    @property
    def precision(self) -> str:
        return "fp32" if self.dtype is None else f"{self.dtype} autocast, as recorded"

    def _autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.dtype is None else torch.autocast(self.device.type, dtype=self.dtype)

    def rank(self, path: Path, data: dict[str, Any], step: int) -> RankReplay:
        inputs, targets = data.get("batch_token_ids"), data.get("batch_target_ids")
        if not inputs or targets is None:
            raise ReplayError(f"{path} holds no target ids (written by an older gpuherd, or not by the worker's"
                              " loop): nothing to replay")
        self.model.zero_grad(set_to_none=True)
        self.counter.reset()
        self.forward.reset()
        self.grads.reset()
        pairs = [(torch.as_tensor(x, device=self.device), torch.as_tensor(y, device=self.device))
                 for x, y in zip(inputs, targets, strict=True)]
        losses = []
        for x, y in pairs:
            with self._autocast():
                loss = self.model(x, y)
            (loss / len(pairs)).backward()  # as Engine.micro_step: the step's gradient is the mean
            losses.append(loss.detach().float())
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        loss, norm = float(torch.stack(losses).mean()), float(torch.nn.utils.get_total_norm(grads))
        inspection = inspect_model(self.model)
        report = NanReport(
            bracket=_bracket(data.get("tag")), step=step, loss=loss, grad_norm=norm, lr=data.get("lr"),
            gradients=inspection.bad_gradients, parameters=inspection.bad_parameters,
            affected_layers=inspection.affected_layers, first_bad_module=self.forward.first_bad(),
            first_bad_gradient=self.grads.first_bad(), hooks=True)
        return RankReplay(path, data, loss, norm, report, [[self._row(x[i:i + 1], y[i:i + 1]) for i in range(len(x))]
                                                           for x, y in pairs])

    def _row(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, bool]:
        """One sample on its own, forward and backward: does it produce the fault by itself?"""
        self.model.zero_grad(set_to_none=True)
        with self._autocast():
            loss = self.model(x, y)
        loss.backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(loss.detach()), bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def _bracket(tag: Any) -> str:
    return f"[{tag[:3]} {tag[3:]}]" if isinstance(tag, str) and len(tag) > 3 else "[?]"


def describe(recorded: Recorded, replays: list[RankReplay], device: torch.device, precision: str) -> list[str]:
    lines = [f"Replay of step {recorded.step} on {device} ({precision}) from {recorded.checkpoint}:"
             f" {len(replays)} rank pickle(s)"]
    for rep in replays:
        if rep.kind == "nonfinite" and rep.reproduces:
            lines += render(rep.report)
        data = rep.data
        lines.append(f"Rank {data.get('rank', '?')}: recorded on {data.get('device', '?')} ({data.get('host', '?')}):"
                     f" loss {data.get('loss', math.nan):.4f}, grad norm {data.get('grad_norm', math.nan):.4f} |"
                     f" replayed: loss {rep.loss:.4f}, grad norm of its own gradients {rep.grad_norm:.4f}"
                     f" -> {'reproduces' if rep.reproduces else 'does not reproduce'}")
        if rep.threshold() is not None:
            lines.append(f"  recorded {rep.kind.replace('_', ' ')} threshold: {rep.threshold():.4f}")
        lines += _rows(rep)
    return lines


def _rows(rep: RankReplay) -> list[str]:
    """The samples that produce the fault on their own ('!'), then the highest-loss others."""
    names = {(n["micro_batch"], n["row"]): SampleName(**n) for n in rep.data.get("batch") or []}
    threshold = rep.threshold()

    def bad(loss: float, grads_finite: bool) -> bool:
        if rep.kind != "nonfinite":
            return threshold is not None and loss > threshold
        return not (math.isfinite(loss) and grads_finite)

    rows = [(m, r, loss, ok) for m, micro in enumerate(rep.rows) for r, (loss, ok) in enumerate(micro)]
    marked = [row for row in rows if bad(row[2], row[3])]
    rest = sorted((row for row in rows if row not in marked), key=lambda row: -row[2])[:ROWS_SHOWN]
    lines = []
    for m, r, loss, ok in marked + rest:
        name = names.get((m, r))
        where = name.describe() if name else f"micro-batch {m} row {r}"
        grads = "" if ok else ", non-finite gradients"
        lines.append(f"  {'!' if (m, r, loss, ok) in marked else ' '} sample loss {loss:.4f}{grads}: {where}")
    return lines


def verdict(replays: list[RankReplay], device: torch.device) -> tuple[bool, str]:
    hit = [rep for rep in replays if rep.reproduces]
    if hit:
        ranks = [rep.data.get("rank") for rep in hit]
        return True, (f"REPRODUCES on {device} (rank(s) {ranks}): the batch or the model is at fault,"
                      " not the device it was recorded on")
    where = sorted({str(rep.data.get("device")) + " on " + str(rep.data.get("host")) for rep in replays})
    return False, (f"Does NOT reproduce on {device}: suspect the device it was recorded on ({', '.join(where)}):"
                   " a transient fault. Replay on the same kind of device to rule out a difference between devices")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker.nan.replay", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a nan_debug_step_N*.pkl dump or its nan_grad_step_N.pt checkpoint")
    parser.add_argument("--device", default="cpu", help="where to replay: cpu (default), cuda, cuda:1, ...")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    try:
        device = _device(args.device)
        recorded = locate(args.path)
        model, meta = load_model(recorded.checkpoint, device)  # refused checkpoint: no pickle was read
        dumps = recorded.dumps()
        replayer = Replayer(model, meta, device, str(dumps[0][1].get("device", "cpu")))
        replays = [replayer.rank(path, data, recorded.step) for path, data in dumps]
    except GpuherdError as exc:
        print(f"worker.nan.replay: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    reproduces, last = verdict(replays, device)
    print("\n".join(describe(recorded, replays, device, replayer.precision) + [last]))
    return 0 if reproduces else int(ExitCode.DEVICE_SUSPECT)


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ReplayError(f"--device {name!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ReplayError(f"--device {name}: no CUDA device here; replay on cpu")
    return device


if __name__ == "__main__":
    sys.exit(main())
