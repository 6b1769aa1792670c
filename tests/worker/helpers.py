"""Shared fixtures for the worker tests, and a small training driver run as a script.

As a script (one process per rank, torchrun-style environment):

    python tests/worker/helpers.py train SPEC.json

SPEC: {"overrides": [...], "runs": [{"name", "overrides", "port"}], "status_dir", "signals": bool}
Every run trains the tiny model on in-memory tokens through `worker.train.run`
and writes its status records (one per step, with the loss) to
`<status_dir>/<name>-rank<r>.jsonl`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
VOCAB = 288  # >= the byte tokenizer (257), so generate.py can decode these checkpoints
CONTEXT = 16

TINY = [
    "model.n_layers=2", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16",
    f"data.context_length={CONTEXT}", "training.batch_size=2", "training.grad_accum_nums=2",
    "training.max_steps=6", "training.warmup_steps=2", "training.log_every=1", "training.eval_every=0",
    "training.learning_rate=3e-3", "debug.nan_detection=false", "debug.log_level=INFO",
]


def tiny_config(tmp: Path, *extra: str):
    from gpuherd.config import resolve

    return resolve("debug", overrides=[*TINY, f"system.checkpoint_dir={tmp / 'ckpt'}",
                                       f"system.run_root={tmp / 'logs'}", *extra], cwd=tmp)


def tokens(n: int, seed: int) -> np.ndarray:
    """A learnable stream: a repeating pattern with noise, so losses fall quickly."""
    rs = np.random.default_rng(seed)
    base = np.tile(np.arange(VOCAB), n // VOCAB + 1)[:n]
    noise = rs.integers(0, VOCAB, n)
    return np.where(rs.random(n) < 0.2, noise, base).astype(np.int64)


def bundle(cfg, rank: int = 0, world_size: int = 1, tokenizer: str = "in-memory"):
    from worker.data import in_memory_bundle

    data = in_memory_bundle(tokens(20_000, 1), tokens(4_000, 2), VOCAB, cfg.training.batch_size,
                            cfg.data.context_length, rank, world_size, cfg.system.seed)
    data.tokenizer = tokenizer
    return data


def read_status(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def step_losses(path: Path) -> list[float]:
    return [r["loss"] for r in read_status(path) if r["type"] == "step" and "loss" in r]


def status_writer(path: Path, rank: int):
    from gpuherd.status_channel import StatusWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    return StatusWriter(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), rank)


def worker_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUHERD_", "TORCHELASTIC_"))}
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "GPUHERD_DEVICE_KIND": "cpu", "GPUHERD_DEVICE_ID": str(rank), "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


def spawn(args: list[str], envs: list[dict[str, str]], timeout: float, cwd: Path | None = None
          ) -> list[subprocess.CompletedProcess]:
    """Start one process per env, wait for all; kill every one of them on timeout."""
    procs = [subprocess.Popen([PYTHON, *args], env=env, cwd=cwd or REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for env in envs]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


class Watched:
    """A child process whose stderr lines are collected as they come (to signal it mid-run)."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path | None = None, **popen) -> None:
        import threading

        self.proc = subprocess.Popen([PYTHON, *args], env=env, cwd=cwd or REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True, **popen)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, needle: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line with {needle!r}; got:\n" + "\n".join(self.lines[-30:]))

    def finish(self, timeout: float = 60) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        self._reader.join(timeout=5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)


def run_pair(tmp_path: Path, script_text: str, env: dict[str, str]) -> list[Path]:
    """`script_text` run as two ranks (argv: rank, a FileStore path, an output file), both to exit 0;
    the two output files, by rank."""
    script = tmp_path / "pair.py"
    script.write_text(script_text)
    outs = [tmp_path / f"{r}.pt" for r in (0, 1)]
    procs = [subprocess.Popen([PYTHON, str(script), str(r), str(tmp_path / "store"), str(outs[r])], env=env,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
    return outs


def free_port() -> int:
    from worker.distributed import free_port as _free_port

    return _free_port()


# --------------------------------------------------------------------------- script mode


def _train(spec_path: str) -> int:
    sys.path.insert(0, str(REPO))
    from gpuherd.contract import WorkerIdentity
    from worker.logs import setup_logging
    from worker.main import guarded
    from worker.train import run

    spec = json.loads(Path(spec_path).read_text())
    identity = WorkerIdentity.from_env()
    setup_logging(identity, "INFO")
    tmp = Path(spec["tmp"])
    code = 0
    for item in spec["runs"]:
        os.environ["MASTER_PORT"] = str(item["port"])  # a fresh rendezvous per run
        cfg = tiny_config(tmp, *spec.get("overrides", []), *item.get("overrides", []))
        status = status_writer(Path(spec["status_dir"]) / f"{item['name']}-rank{identity.rank}.jsonl", identity.rank)
        run_dir = Path(item["run_dir"]) if item.get("run_dir") else None

        def body(cfg=cfg, status=status, run_dir=run_dir) -> int:
            data = bundle(cfg, identity.rank, identity.world_size, "byte")
            return run(cfg, identity, data=data, status=status, run_dir=run_dir,
                       install_signals=spec.get("signals", False))

        code = guarded(body, status)
        if code:
            return code
    return code


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "train":
        sys.exit(_train(sys.argv[2]))
    sys.exit(f"usage: {sys.argv[0]} train SPEC.json")
