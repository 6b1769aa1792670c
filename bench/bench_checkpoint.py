#!/usr/bin/env python3
"""Checkpoint benchmark: what periodic saves cost the training loop, blocking vs async.

The same model, data and machine, in one process, interleaved (A B A B): the training
loop of `worker.train.run` (strategy single) with a checkpoint every SAVE_EVERY steps,
`training.async_save=false` (every save blocks the loop for the whole write) against
`true` (the loop copies the state to host memory and a writer thread writes it), and the
same loop without periodic saves. The measure is the loop's total extra time for the
saves: its wall time from the first to the last step, minus that of the loop without
saves (and, measured inside the loop, the time it was blocked by them). Goal: async <= 0.1x
blocking (CPU, a 75M-parameter model saved every 3 steps).

GPU (only with CUDA; skipped and said so otherwise): the same row for a 1B model
(bench_worker's 1B shape, bf16), `python -m bench --gpu`.

The DDP rows (bench/save_loss.py): a 2-rank run of the built-in trainer under `gpuherd` on the
CPU (the debug preset, and with `--ddp-75m` the 75M model above), a save every 6 steps,
async against blocking, interleaved; each save's loss read from rank 0's step records, and
the trainer's own account of it (its `accounted` records) beside it. Goal: async <= 0.2x
blocking, the account within 10% of the records.

    PYTHONPATH=. python bench/bench_checkpoint.py [--quick] [--gpu-only] [--save-every N] [--gpu-model 124M|1B] [--ddp-only] [--ddp-75m]
Writes bench/results/checkpoint.md and bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.bench_worker import GPU_MODELS, GPU_VOCAB  # noqa: E402
from bench.compare import Comparison, Side, write_results  # noqa: E402
from bench.save_loss import SAVE_EVERY as DDP_SAVE_EVERY  # noqa: E402
from bench.save_loss import run_ddp, save_losses  # noqa: E402
from gpuherd.config import resolve  # noqa: E402
from gpuherd.contract import WorkerIdentity  # noqa: E402
from gpuherd.model_size import count_params  # noqa: E402
from gpuherd.status_channel import StatusWriter  # noqa: E402
from worker.data import in_memory_bundle  # noqa: E402
from worker.train import run  # noqa: E402

CPU_MODEL = ["model.n_layers=10", "model.dim=768", "model.n_heads=12", "model.n_kv_heads=4", "model.multiple_of=64",
             "data.context_length=128", "training.batch_size=1", "training.use_amp=false"]
CPU_VOCAB = 8192
CPU_MODEL_DDP = [*CPU_MODEL, "data.tokenizer=byte", f"model.vocab_size={CPU_VOCAB}"]  # under gpuherd: the dummy set
SAVE_EVERY = 3
MODES = ("none", "blocking", "async")


def mode_overrides(mode: str, save_every: int) -> list[str]:
    return {"none": ["training.save_every=0"],
            "blocking": [f"training.save_every={save_every}", "training.async_save=false"],
            "async": [f"training.save_every={save_every}", "training.async_save=true"]}[mode]


def loop_seconds(tmp: Path, device: str, model: list[str], vocab: int, steps: int, mode: str,
                 save_every: int, final: bool = False) -> tuple[float, list]:
    """Wall time of the loop from its first step record to its last (saves in between), and its
    checkpoint records (`final`: the final save's after the last step too, blocking in every mode)."""
    ckpt = tmp / f"ckpt-{mode}-{time.monotonic_ns()}"
    cfg = resolve("debug", overrides=[*model, *mode_overrides(mode, save_every), f"training.max_steps={steps}", "training.log_every=1",
                                      "training.warmup_steps=2", "training.eval_every=0", "training.keep_last=2",
                                      "debug.nan_detection=false", "debug.nan_hooks=false", "debug.log_level=WARNING",
                                      "training.grad_accum_nums=1", f"system.checkpoint_dir={ckpt}"], cwd=tmp)
    status_path = tmp / f"status-{time.monotonic_ns()}.jsonl"
    fd = os.open(status_path, os.O_WRONLY | os.O_CREAT)
    data = in_memory_bundle(np.random.default_rng(0).integers(0, vocab, 2_000_000), None, vocab,
                            cfg.training.batch_size, cfg.data.context_length, 0, 1, 1)
    identity = WorkerIdentity(0, 0, 1, 1, device, 0, False)
    assert run(cfg, identity, data=data, status=StatusWriter(fd, 0), install_signals=False) == 0
    os.close(fd)
    records = [orjson.loads(line) for line in status_path.read_bytes().splitlines()]
    times = [r["time"] for r in records if r["type"] == "step" and "loss" in r]
    saves = [r for r in records if r["type"] == "checkpoint" and (final or r["step"] < steps)]
    for path in ckpt.glob("*"):  # keep the disk as free for the next run as for the first
        path.unlink()
    return times[-1] - times[0], saves


def compare(device: str, model: list[str], vocab: int, steps: int, repeats: int,
            what: str, save_every: int) -> tuple[list[Comparison], dict]:
    """Interleaved repeats of the three loops. Two measures of what the saves cost the loop: the
    time it was blocked by them (their `stall_s`, timed inside the loop: captures, copies, writes
    and waits), and its wall time minus the loop's without saves (what the writer's competition
    for the CPU adds too, but also every other disturbance of a shared machine)."""
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    saves: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for i in range(repeats):
            order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
            for mode in order:
                seconds, records = loop_seconds(tmp, device, model, vocab, steps, mode, save_every)
                samples[mode].append(seconds)
                saves[mode].append(records)
    blocked = {m: [sum(r["stall_s"] for r in run) for run in saves[m]] for m in ("blocking", "async")}
    extra = {m: [max(s - n, 0.0) for s, n in zip(samples[m], samples["none"], strict=True)]
             for m in ("blocking", "async")}
    comparisons = [Comparison(f"{what}: the loop blocked by them", "s", Side("async", blocked["async"]),
                              Side("blocking", blocked["blocking"])),
                   Comparison(f"{what}: the loop's wall time minus the loop's without saves", "s",
                              Side("async", extra["async"]), Side("blocking", extra["blocking"]))]
    flat = {m: [r for run in saves[m] for r in run] for m in ("blocking", "async")}
    detail = {"loop_s": samples, "blocked_s": blocked, "extra_s": extra,
              "stall_s": {m: [r["stall_s"] for r in flat[m]] for m in flat},
              "write_s": {m: [r["write_s"] for r in flat[m]] for m in flat},
              "waits": sum(1 for r in flat["async"] if r["wait_s"] > 0)}
    return comparisons, detail


DDP_STEPS = 4 * DDP_SAVE_EVERY + 1  # 4 periodic saves, the final one (blocking in both) after the last step


def compare_ddp(model: list[str], what: str, repeats: int) -> tuple[list[Comparison], str, dict]:
    """Interleaved 2-rank runs, async and blocking: each save's loss from the step records, and
    the trainer's account of the async ones against them."""
    losses: dict[str, list[float]] = {"async": [], "blocking": []}
    account: dict[str, list[tuple[float, float]]] = {"async": [], "blocking": []}
    cpu: dict[str, list[list[float]]] = {"async": [], "blocking": []}  # per run, the writes' CPU seconds in order
    typical: list[float] = []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-ddp-") as tmp:
        for i in range(repeats):
            for mode in (("async", "blocking") if i % 2 == 0 else ("blocking", "async")):
                records = run_ddp(Path(tempfile.mkdtemp(dir=tmp)), model, DDP_STEPS, mode)
                if not records:
                    failed += 1
                    continue
                got = save_losses(records)
                typical.append(got["typical_step_s"])
                losses[mode] += [row["records_s"] for row in got["saves"]]
                account[mode] += [(row["records_s"], row["trainer_s"]) for row in got["saves"]
                                  if row["trainer_s"] is not None]
                cpu[mode].append([row["write_cpu_s"] for row in got["saves"] if row["write_cpu_s"] is not None])
    rows = [Comparison(f"2-rank DDP on the CPU, {what}: the loop's loss per save, from its step records", "s",
                       Side("async", losses["async"] or [float("nan")]),
                       Side("blocking", losses["blocking"] or [float("nan")]))]
    mean = {m: statistics.fmean(v) if v else float("nan") for m, v in losses.items()}
    sums = {m: (sum(r for r, _ in v), sum(t for _, t in v)) for m, v in account.items()}
    note = (f"2-rank DDP, {what}: {repeats} interleaved runs per mode ({failed} failed), saves every "
            f"{DDP_SAVE_EVERY} steps, typical step {statistics.median(typical) if typical else float('nan'):.2f} s; "
            f"mean loss per save async {mean['async']:.3f} s vs blocking {mean['blocking']:.3f} s "
            f"(ratio {mean['async'] / mean['blocking']:.2f}); the trainer's own account over all saves: async "
            f"{sums['async'][1]:.2f} s against {sums['async'][0]:.2f} s from the records, blocking "
            f"{sums['blocking'][1]:.2f} s against {sums['blocking'][0]:.2f} s; the write's CPU seconds per save "
            f"(median; per run in order): " + "; ".join(
                f"{m} {statistics.median(sum(v, [])) if sum(v, []) else float('nan'):.3f} s ("
                + " / ".join(", ".join(f"{c:.3f}" for c in run) for run in v) + ")" for m, v in cpu.items()))
    return rows, note, {"losses": losses, "account": account, "typical_step_s": typical, "write_cpu_s": cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat instead of 3")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU row")
    parser.add_argument("--ddp-only", action="store_true", help="only the 2-rank DDP rows")
    parser.add_argument("--ddp-75m", action="store_true", help="a 2-rank DDP row for the 75M model too")
    parser.add_argument("--save-every", type=int, default=SAVE_EVERY,
                        help="steps between the single-process rows' saves (a GPU's short steps: more, so that "
                             "a write can end before the next save)")
    parser.add_argument("--gpu-model", choices=sorted(GPU_MODELS), default="1B",
                        help="the GPU row's shape (the 1B model's saves, ~16 GB each, take minutes)")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    comparisons, notes, details = [], [], {}
    if not args.gpu_only:
        ddp_rows = [([], "debug preset")] + ([(CPU_MODEL_DDP, "75M model")] if args.ddp_75m else [])
        for model, what in ddp_rows:
            rows, note, details[f"ddp {what}"] = compare_ddp(model, what, 2 if args.quick else 4)
            comparisons += rows
            notes.append(note)
    if args.ddp_only:
        write_results("checkpoint", "Checkpoints: blocking vs async save (training.async_save)", comparisons, notes)
        return 0
    every = args.save_every
    steps = 2 * every + 1  # two periodic saves, both inside the timed loop; the final one
    # (after the last step, blocking in every loop) is outside it
    rows = [] if args.gpu_only else [("cpu", "CPU", CPU_MODEL, CPU_VOCAB)]
    if torch.cuda.is_available():
        rows.append(("cuda", torch.cuda.get_device_name(0),
                     [*GPU_MODELS[args.gpu_model], "training.use_amp=true", "training.compile=false"], GPU_VOCAB))
    else:
        notes.append("GPU row skipped: no CUDA device on this machine (`python -m bench --gpu` on one fills it).")
    for device, name, model, vocab in rows:
        n = count_params(resolve("debug", overrides=model).model, vocab)
        rows_of_device, details[device] = compare(device, model, vocab, steps, repeats,
                                                  f"{name}, {n / 1e6:,.0f}M parameters, {steps // every} saves "
                                                  f"{every} steps apart", every)
        comparisons += rows_of_device
        notes.append(_detail_note(name, details[device]))
    notes.append("blocked = the sum of the saves' stall_s (the loop waiting on them: capture, copy to host memory, "
                 "the write when blocking, any wait for the previous write); wall time = the loop from its first to "
                 "its last step, minus the same loop without periodic saves, per interleaved repeat (it also counts "
                 "the background writer's use of the CPU, and every disturbance of a shared machine); the "
                 "advantage column is blocking / async.")
    write_results("checkpoint", "Checkpoints: blocking vs async save (training.async_save)", comparisons, notes)
    out = Path(__file__).resolve().parent / "results" / "checkpoint.json"
    out.write_bytes(orjson.dumps({**orjson.loads(out.read_bytes()), "details": details}, option=orjson.OPT_INDENT_2))
    return 0


def _detail_note(where: str, d: dict) -> str:
    med = {k: {m: statistics.median(v) if v else 0.0 for m, v in d[k].items()} for k in ("stall_s", "write_s")}
    return (f"{where}: per save, the loop blocked {med['stall_s']['blocking']:.2f} s (blocking) vs "
            f"{med['stall_s']['async']:.3f} s (async: capture + copy to host memory); the background write took "
            f"{med['write_s']['async']:.2f} s (blocking write {med['write_s']['blocking']:.2f} s); "
            f"{d['waits']} async save(s) had to wait for the previous write (medians)")


if __name__ == "__main__":
    sys.exit(main())
