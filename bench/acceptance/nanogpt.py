"""A training script gpuherd was not written for: karpathy/nanoGPT's train.py, unchanged, under
`gpuherd run` on one GPU with `--max-restarts 1`. Its rank is SIGKILLed once it has written a
checkpoint and trained on past it; gpuherd restarts it, from the restart standby that imported
torch while the first attempt trained, and nanoGPT resumes by its own means: its config file
(nanoGPT's configurator runs it as Python) says `init_from = 'resume'` once `out/ckpt.pt` exists.

    python -m bench.acceptance.nanogpt --device cuda --result FILE

The data: random GPT-2 token ids in nanoGPT's own format (data/<dataset>/train.bin, val.bin of
uint16), so nothing is fetched; the model: 6 layers, 384 wide, block 256, no compile.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import psutil

from bench.acceptance.nanogpt_files import FILES, missing_files, nanogpt_dir
from bench.acceptance.outcome import Outcome, part_main
from bench.launchers import kill_tree, worker_env

ITERS, CKPT_EVERY, KILL_AT = 300, 100, 130
CONFIG = f"""# bench/acceptance/nanogpt.py: a small GPT on random tokens, a checkpoint every {CKPT_EVERY} iterations,
# and nanoGPT's own resume wherever a checkpoint exists (what a restart after a SIGKILL finds)
out_dir = 'out'
dataset = 'acceptance'
eval_interval = {CKPT_EVERY}
eval_iters = 5
log_interval = 1
always_save_checkpoint = True
batch_size = 16
block_size = 256
gradient_accumulation_steps = 1
n_layer = 6
n_head = 6
n_embd = 384
max_iters = {ITERS}
lr_decay_iters = {ITERS}
warmup_iters = 10
compile = False
init_from = 'resume' if os.path.exists(os.path.join(out_dir, 'ckpt.pt')) else 'scratch'
"""
ITER_LINE = re.compile(r"\biter (\d+): loss")


def prepare(work: Path) -> None:
    for name in FILES:
        shutil.copy2(nanogpt_dir() / name, work / name)
    data = work / "data" / "acceptance"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 4_000_000), ("val", 200_000)):
        rng.integers(0, 50257, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    (work / "acceptance_config.py").write_text(CONFIG)


def _rank0(supervisor: int) -> psutil.Process | None:
    """The training rank (a restart standby has no RANK yet)."""
    for child in psutil.Process(supervisor).children(recursive=True):
        try:
            if child.environ().get("RANK") == "0" and "train.py" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def _iters(log: Path) -> list[int]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [int(m.group(1)) for line in lines if (m := ITER_LINE.search(line))]


def run(work: Path, out: Outcome) -> None:
    cmd = [sys.executable, "-m", "supervisor", "--no-report", "--skip-checks", "--force", "--gpus", "0",
           "--max-restarts", "1", "--run-id", "nanogpt", "--script", "train.py", "acceptance_config.py"]
    print(f"acceptance: {' '.join(cmd)} (in {work})", flush=True)
    run_dir = work / "logs" / "nanogpt"
    proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), start_new_session=True)
    killed = None
    try:
        deadline = time.monotonic() + 600
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            logs = sorted(run_dir.rglob("worker-rank0-*.log"))
            victim = _rank0(proc.pid)
            if logs and victim is not None and (work / "out" / "ckpt.pt").exists() and max(_iters(logs[0]),
                                                                                         default=0) >= KILL_AT:
                victim.send_signal(signal.SIGKILL)
                killed = (time.time(), victim.pid)
            time.sleep(0.01)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    _checked(run_dir, code, killed, out)


def _checked(run_dir: Path, code: int, killed: tuple[float, int] | None, out: Outcome) -> None:
    out.check(killed is not None, f"rank 0 never reached iteration {KILL_AT} after a checkpoint to be killed")
    out.check(code == 0, f"gpuherd ended with exit {code}")
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    out.check(summary["restarts"] == 1, f"{summary['restarts']} restart(s), not 1")
    logs = sorted(run_dir.rglob("worker-rank0-*.log"))
    resumed = any("Resuming training from out" in p.read_text(errors="replace") for p in logs)
    out.check(resumed, "the restarted train.py did not resume from its checkpoint (no 'Resuming training from out')")
    iters = [i for p in logs for i in _iters(p)]
    out.check(max(iters, default=0) == ITERS, f"the last iteration logged is {max(iters, default=0)}, not {ITERS}")
    standbys = re.findall(r"restart standbys \[([\d, ]+)\]", (run_dir / "supervisor.log").read_text(errors="replace"))
    standby_pids = {int(p) for found in standbys for p in found.split(",")}
    pid_after = next((w["pid"] for w in summary["attempts"][-1]["workers"] if w["rank"] == 0), None)
    out.figure("nanoGPT train.py, SIGKILLed at iteration >= "
               f"{KILL_AT} (checkpoint every {CKPT_EVERY}): gpuherd's exit, restarts", f"{code}, {summary['restarts']}")
    out.figure("the restarted rank: a restart standby (imported torch while attempt 0 trained)",
               "yes" if pid_after in standby_pids else f"no (pid {pid_after}; standbys {sorted(standby_pids)})")
    out.figure("train.py's own resume (init_from='resume', iterations to the end)",
               f"{'resumed' if resumed else 'not resumed'}; last iteration {max(iters, default=0)}")
    if killed is not None and summary["attempts"][-1].get("started_at"):
        out.note(f"attempt 1 started {summary['attempts'][-1]['started_at']}; rank 0 (pid {killed[1]}) killed at "
                 f"{killed[0]:.3f}")


def _run(args: argparse.Namespace, out: Outcome) -> None:
    if args.device != "cuda":
        raise RuntimeError("nanoGPT's train.py needs CUDA under a launcher: --device cuda")
    absent = missing_files()
    if absent:
        raise RuntimeError(f"{', '.join(absent)} not in {nanogpt_dir()}: `bash bench/gpu_acceptance.sh --prepare SRC`")
    work = Path(tempfile.mkdtemp(prefix="acceptance-nanogpt-"))
    try:
        prepare(work)
        run(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(part_main(_run, __doc__.splitlines()[0]))
