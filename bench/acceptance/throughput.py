"""What one GPU trains: MFU of the 124M and 1B shapes, and the 1B model's async save.

    python -m bench.acceptance.throughput mfu-124M|mfu-1B|save-1B --device cuda --result FILE

- mfu-124M: `gpuherd --preset gpt2-small` as a user starts it, its batch, sequence, gradient
  accumulation, compile and optimizer as the preset and the defaults choose them; only the data
  differ (the dummy set, GPT-2's padded vocabulary, so no tokenizer or corpus is needed). The MFU
  of the last logged step (trainer's own figure: 6N + 12LHQT over the GPU's peak). Goal >= 40%.
- mfu-1B: the 1B shape of bench/bench_worker.py (16 layers, dim 2048, GQA 32/8, sequence 2048,
  micro-batch 8, no accumulation) with the defaults' bf16 and per-block compile. Goal >= 45%.
- save-1B: one loop of the 1B shape (eager, bf16 autocast) in this process, an async save after
  step SAVE_AT and the final save after the last step: what the async save blocked the loop
  (the copy to pinned host memory) against the blocking final write of the same state.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.acceptance.outcome import Outcome, part_main
from bench.launchers import run_records, worker_env

VOCAB = 50304  # GPT-2's, padded to a multiple of 64
DUMMY_DATA = ["data.dataset=dummy", "data.tokenizer=byte", f"model.vocab_size={VOCAB}"]
SHAPE_1B = ["model.n_layers=16", "model.dim=2048", "model.n_heads=32", "model.n_kv_heads=8", "model.multiple_of=256",
            "data.context_length=2048", "training.batch_size=8", "training.grad_accum_nums=1"]
ROWS = {  # name: (preset, overrides beyond the data and the schedule, goal)
    "mfu-124M": ("gpt2-small", [], 0.40),
    "mfu-1B": ("production", SHAPE_1B, 0.45),
}
STEPS, LOG_EVERY = 40, 10
SAVE_AT = 10


def mfu_command(row: str, work: Path) -> list[str]:
    preset, shape, _ = ROWS[row]
    cmd = [sys.executable, "-m", "supervisor", "--preset", preset, "--gpus", "0", "--force", "--no-report",
           "--skip-checks", "--run-id", row]
    for item in [*DUMMY_DATA, *shape, f"training.max_steps={STEPS}", "training.warmup_steps=5",
                 f"training.log_every={LOG_EVERY}", "training.eval_every=0", "training.save_every=0",
                 f"system.checkpoint_dir={work / 'ckpt'}"]:
        cmd += ["--set", item]
    return cmd


def last_logged(records: list[dict]) -> dict | None:
    """The last step record that carries the logged figures (tokens/s, MFU)."""
    logged = [r for r in records if r.get("type") == "step" and "tokens_per_s" in r]
    return max(logged, key=lambda r: r["step"]) if logged else None


def mfu(row: str, out: Outcome) -> None:
    import subprocess

    _, _, goal = ROWS[row]
    with tempfile.TemporaryDirectory(prefix=f"acceptance-{row}-") as tmp:
        work = Path(tmp)
        cmd = mfu_command(row, work)
        print(f"acceptance: {' '.join(cmd)}", flush=True)
        code = subprocess.run(cmd, cwd=work, env=worker_env(), timeout=900).returncode
        out.check(code == 0, f"the run ended with exit {code}")
        run_dir = work / "logs" / row
        last = last_logged(run_records(run_dir / "metrics.jsonl"))
        if not out.check(last is not None and last.get("mfu") is not None, "no step record with an MFU"):
            return
        config = (run_dir / "config.json").read_text() if (run_dir / "config.json").exists() else "{}"
        out.note(f"{row}: the run's resolved config: {_choices(config)}")
        out.figure(f"{row}: tokens/s (step {last['step']}, the last logged)", f"{last['tokens_per_s']:,.0f}")
        out.figure(f"{row}: MFU", f"{100 * last['mfu']:.1f}%", f">= {100 * goal:.0f}%", last["mfu"] >= goal)


def _choices(config_json: str) -> str:
    """What the preset and the defaults chose, from the run's resolved config."""
    import orjson

    cfg = orjson.loads(config_json)
    t, m, d = cfg.get("training", {}), cfg.get("model", {}), cfg.get("data", {})
    keys = [("batch_size", t), ("grad_accum_nums", t), ("context_length", d), ("compile", t), ("use_amp", t),
            ("amp_dtype", t), ("strategy", t), ("attention", m), ("n_layers", m), ("dim", m)]
    return ", ".join(f"{k}={where.get(k)}" for k, where in keys)


def save_1b(out: Outcome) -> None:
    from bench.bench_checkpoint import loop_seconds

    model = [*SHAPE_1B, "training.use_amp=true", "training.compile=false"]
    with tempfile.TemporaryDirectory(prefix="acceptance-save-1B-") as tmp:
        _, saves = loop_seconds(Path(tmp), "cuda", model, VOCAB, SAVE_AT + 4, "async", SAVE_AT, final=True)
    periodic = [r for r in saves if r["step"] == SAVE_AT and r.get("mode") == "async"]
    final = [r for r in saves if r["step"] > SAVE_AT]
    if not out.check(bool(periodic) and bool(final), f"saves recorded: {[(r['step'], r.get('mode')) for r in saves]}"):
        return
    a, b = periodic[0], final[0]
    out.figure("1B: the loop blocked by an async save (copy to pinned host memory)", f"{a['stall_s']:.2f} s")
    out.figure("1B: the async save's background write", f"{a['write_s']:.2f} s")
    out.figure("1B: the loop blocked by the blocking final save's write (its wait for the async write apart)",
               f"{b['stall_s'] - b.get('wait_s', 0.0):.2f} s (waited {b.get('wait_s', 0.0):.2f} s first)")
    out.figure("1B: async blocked / blocking write", f"{a['stall_s'] / max(b['stall_s'] - b.get('wait_s', 0.0), 1e-9):.3f}x",
               "<= 0.2x", a["stall_s"] <= 0.2 * (b["stall_s"] - b.get("wait_s", 0.0)))


def _run(args: argparse.Namespace, out: Outcome) -> None:
    if args.device != "cuda":
        raise RuntimeError(f"{args.row} is a GPU figure: --device cuda")
    if args.row == "save-1B":
        save_1b(out)
    else:
        mfu(args.row, out)


if __name__ == "__main__":
    raise SystemExit(part_main(_run, __doc__.splitlines()[0],
                               lambda p: p.add_argument("row", choices=[*ROWS, "save-1B"])))
