#!/usr/bin/env python3
"""Silent-data-corruption check: what it costs per optimizer step, side by side.

Two DDP ranks (gloo, CPU, one thread each) train the same model with the production pieces
(worker.model.Transformer, DDP, AdamW over gpuherd's groups) and, after each optimizer step,
run the check exactly as the trainer's healthy path does (worker/sdc: the parameter
fingerprint, the optimizer-state one at its default interval of 10, one all_gather, one host
sync, the verdict) at interval 1, at interval 10, or not at all. The three settings take
turns in rounds inside the same two processes, so load from elsewhere hits all alike; each
setting's step time is the median over its steps, and the check's own time is measured too
(its share of the unchecked step is the cost at interval 1, free of step-to-step noise).

Models: the debug preset's (system.device=cpu) and a ~75M one (8 layers, dim 768, vocab
12288, context 128, batch 2: 256 tokens per rank and step, a small step, so the check's share
is at its largest).

    PYTHONPATH=. python bench/bench_sdc.py [--quick]
Writes bench/results/sdc.md and bench/results/sdc.json.
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from gpuherd.config import resolve  # noqa: E402
from worker.engines import adamw_kwargs, optimizer_groups  # noqa: E402
from worker.model import ModelArgs, Transformer  # noqa: E402
from worker.sdc.blame import judge  # noqa: E402
from worker.sdc.check import gather_rows  # noqa: E402
from worker.sdc.fingerprint import Fingerprint, optimizer_state, parameters  # noqa: E402

WORLD = 2
OPTIM_EVERY = 10  # training.sdc_optim_check_every's default
MODELS = {
    "debug": [],
    "75M": ["model.n_layers=8", "model.dim=768", "model.n_heads=12", "model.n_kv_heads=4", "model.multiple_of=256",
            "data.context_length=128", "training.batch_size=2"],
}
VOCAB = {"debug": 512, "75M": 12288}
SETTINGS = {"off": 0, "every 1": 1, "every 10": 10}


def _check(model: torch.nn.Module, optimizer: torch.optim.Optimizer, done: int, every: int) -> float:
    """The trainer's healthy path (worker/sdc/check.py); its seconds, 0 when not due."""
    if not every or done % every:
        return 0.0
    start = time.perf_counter()
    named = parameters(model) + (optimizer_state(model, optimizer) if done % OPTIM_EVERY == 0 else [])
    assert judge(gather_rows(Fingerprint.of(named, torch.device("cpu")).sums, WORLD)).agree
    return time.perf_counter() - start


def _rank(rank: int, name: str, rounds: int, steps: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    cfg = resolve("debug", overrides=["system.device=cpu", *MODELS[name]])
    args = ModelArgs.from_config(cfg.model, VOCAB[name], cfg.data.context_length)
    inner = Transformer(args)
    inner.init_weights(cfg.system.seed, torch.device("cpu"))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    optimizer = torch.optim.AdamW(optimizer_groups(inner, cfg.training.weight_decay),
                                  **adamw_kwargs(cfg, torch.device("cpu")))
    gen = torch.Generator().manual_seed(rank)
    batch, ctx = cfg.training.batch_size, cfg.data.context_length
    times: dict[str, list[float]] = {k: [] for k in SETTINGS}
    check_s: list[float] = []
    done = 0
    for r in range(rounds + 1):  # round 0 warms allocator and caches, untimed
        for setting, every in SETTINGS.items():
            for _ in range(steps):
                x = torch.randint(0, VOCAB[name], (batch, ctx), generator=gen)
                dist.barrier()  # both ranks start the step together: the time is the step's, not a wait
                start = time.perf_counter()
                model(x, x).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done += 1
                dist.barrier()  # in every setting: the check's time excludes waiting for the slower rank's step
                spent = _check(inner, optimizer, done, every)
                if r:
                    times[setting].append(time.perf_counter() - start)
                    if every == 1:
                        check_s.append(spent)
    if rank == 0:
        Path(out).write_bytes(orjson.dumps({"times": times, "check_s": check_s,
                                            "params": sum(p.numel() for p in inner.parameters())}))
    dist.destroy_process_group()


def measure(name: str, rounds: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(name, rounds, steps, os.path.join(tmp, "store"), out), nprocs=WORLD)
        raw = orjson.loads(Path(out).read_bytes())
    step = {k: statistics.median(v) for k, v in raw["times"].items()}
    return {"model": name, "params": raw["params"], "steps_per_setting": len(raw["times"]["off"]),
            "median_step_s": step, "check_s_median": statistics.median(raw["check_s"]),
            "overhead_every_1": step["every 1"] / step["off"] - 1,
            "overhead_every_10": step["every 10"] / step["off"] - 1,
            "check_share_of_step": statistics.median(raw["check_s"]) / step["off"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    plan = {"debug": (2, 10), "75M": (2, 3)} if args.quick else {"debug": (5, 20), "75M": (3, 6)}
    rows = [measure(name, *plan[name]) for name in MODELS]
    lines = ["| model | params | step, check off | step, every 1 | step, every 10 | overhead every 1 | "
             "overhead every 10 | the check itself (share of an unchecked step) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["median_step_s"]
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {s['off'] * 1e3:.1f} ms | "
                     f"{s['every 1'] * 1e3:.1f} ms | "
                     f"{s['every 10'] * 1e3:.1f} ms | {r['overhead_every_1'] * 100:+.1f}% | "
                     f"{r['overhead_every_10'] * 100:+.1f}% | {r['check_s_median'] * 1e3:.2f} ms "
                     f"({r['check_share_of_step'] * 100:.2f}%) |")
    load = os.getloadavg()[0]
    lines.append(f"\n{WORLD} DDP ranks (gloo, CPU, 1 thread each); medians over {rows[0]['steps_per_setting']} "
                 f"(debug) and {rows[1]['steps_per_setting']} (75M) steps per setting, settings interleaved in "
                 "rounds; the optimizer state is fingerprinted every 10th step in both checked settings. "
                 f"Load average at the end: {load:.1f} on {os.cpu_count()} cores (other work shares the machine: "
                 "step-time ratios carry its noise, the check's own time and share do much less).")
    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "sdc.md").write_text("\n".join(lines) + "\n")
    (results / "sdc.json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
