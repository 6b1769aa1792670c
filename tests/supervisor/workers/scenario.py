"""A torchrun-style worker whose behaviour each test picks per rank, for real-process tests.

    python scenario.py BEHAVIOUR_RANK0 BEHAVIOUR_RANK1 ...   (missing ranks: "train")

Behaviours: train[:steps] | forever | raise | exit0 | silent-exit0 | sigkill | stop |
stall | silent-stall | ignore-term | ignore-int | flood[:lines] | midline | grandchild | escapee | graceful | env |
fail-until:K (raise on attempts < K, i.e. TORCHELASTIC_RESTART_COUNT < K, then train) | exit:N |
slow-save:S (train, then S seconds in phase checkpoint, exit 0 without 'done') |
scancel (SIGTERM to the supervisor and exit 143 at once, as a batch system's cancel does) |
save-on:SIG:S (train until SIG (INT or TERM), then report phase checkpoint, take S seconds to
"save", report the checkpoint, exit 128+SIG) | usr2-log (train; log each SIGUSR2) |
save:S (write .checkpoints/step_S.pt, report it, finish) | save-then-fail:S (attempt 0: save
step S, then raise once a file `go` exists; later attempts: log GPUHERD_RESUME, finish) |
flood-raise:N (N lines on stderr, then raise) | raise-after:R[,R...][:TEXT] (train, wait until each
rank R's worker log holds TEXT, default its last step line, then raise: an order of events that no
scheduler can swap) |
suspect:N[:K] (on attempts < K, default all: train, then N transient faults on this rank's device,
each with its `suspect` record as the built-in worker sends them under debug.nan_policy=rerun,
limit N-1, and exit 8; later attempts train and finish) |
leave (train, note its pid in `left<RANK>`, exit 0 without 'done') | peer-gone:R (train, wait until rank
R left and is reaped, then fail as gloo does: "Connection closed by peer") |
slow-steps:S (liveness records; steps of S seconds computing; Ctrl-C: finish the step, save, exit 130) |
slow-first-step:S (liveness records; the first step computes S seconds, then 3 quick steps, done) |
slow-alive:S (liveness records; S seconds of each slow-but-alive stretch in turn, `SLOW_ALIVE`, the
other ranks waiting for it in a "collective" meanwhile; then done).
Every rank registers faulthandler on SIGUSR1 (as gpuherd's own worker does) unless
the behaviour ends in "+nofh".
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time

from gpuherd.status_channel import StatusWriter

RANK = int(os.environ["RANK"])
SPEC = sys.argv[1 + RANK] if len(sys.argv) > 1 + RANK else "train"
NAME, _, ARG = SPEC.removesuffix("+nofh").partition(":")
TAG = f"[{'CPU' if os.environ.get('GPUHERD_DEVICE_KIND') == 'cpu' else 'GPU'} {os.environ.get('GPU_RANK')}]"
status = StatusWriter.from_env(RANK)
if not SPEC.endswith("+nofh"):
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def log(message: str, level: str = "INFO") -> None:
    print(f"{level} | {TAG} {message}", file=sys.stderr, flush=True)


def step(i: int, total: int) -> None:
    log(f"Step [{i}/{total}] | Loss: {10 - i * 0.01:.4f}")
    status.send("step", step=i, max_steps=total, loss=10 - i * 0.01)
    time.sleep(0.02)


def train(total: int) -> None:
    status.send("phase", name="train")
    for i in range(total):
        step(i, total)


def save_checkpoint(step_no: int) -> str:
    """A checkpoint in gpuherd's layout, written atomically, reported like the built-in worker does."""
    from pathlib import Path

    from gpuherd.files import write_bytes_atomic

    path = Path(".checkpoints") / f"step_{step_no:07d}.pt"
    path.parent.mkdir(exist_ok=True)
    write_bytes_atomic(path, f"run {os.environ['TORCHELASTIC_RUN_ID']} step {step_no}".encode())
    status.send("checkpoint", step=step_no, path=str(path.absolute()))
    log(f"saved {path.absolute()}")
    return str(path)


def save_on(signame: str, seconds: float) -> None:
    signum = getattr(signal, f"SIG{signame}")

    def save(_signum, _frame):
        log(f"SIG{signame}: saving a checkpoint ({seconds:g} s)", "WARNING")
        status.send("phase", name="checkpoint")
        time.sleep(seconds)
        status.send("checkpoint", step=0, path="ckpt")
        log("checkpoint saved", "WARNING")
        status.send("phase", name="shutdown")
        raise SystemExit(128 + signum)
    signal.signal(signum, save)


def save_then_fail(step_no: int) -> int:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt > 0:
        log(f"attempt {attempt}, resume={os.environ.get('GPUHERD_RESUME', '')!r}")
        status.send("done", step=step_no)
        return 0
    train(2)
    save_checkpoint(step_no)
    while not os.path.exists("go"):
        step(step_no, 10**6)
    raise RuntimeError(f"boom after saving step {step_no}")


def more_behaviours() -> int:
    if NAME == "save":
        save_checkpoint(int(ARG))
        status.send("done", step=int(ARG))
        return 0
    if NAME == "save-then-fail":
        return save_then_fail(int(ARG))
    if NAME == "flood-raise":
        for i in range(int(ARG)):
            sys.stderr.write(f"INFO | {TAG} flood line {i:06d} " + "x" * 60 + "\n")
        sys.stderr.flush()
        raise RuntimeError(f"boom after {ARG} lines")
    if NAME == "raise-after":
        train(3)
        ranks, _, text = ARG.partition(":")
        for rank in ranks.split(","):
            wait_for_rank_log(int(rank), text or "Step [2/3]")
        raise RuntimeError(f"boom from rank {RANK}")
    if NAME in ("leave", "peer-gone"):
        return leave_or_peer_gone()
    if NAME in ("slow-steps", "slow-first-step"):
        return slow_steps(float(ARG))
    if NAME == "slow-alive":
        return slow_alive(float(ARG))
    if NAME == "suspect":
        faults, _, until = ARG.partition(":")
        if until and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) >= int(until):
            train(3)
            status.send("done", step=3)
            return 0
        return suspect(int(faults))
    raise SystemExit(f"unknown behaviour {SPEC!r}")


def leave_or_peer_gone() -> int:
    """Issue 24's early exit: one rank leaves with exit 0, the other then fails on its absence."""
    train(3)
    if NAME == "leave":
        with open(f"left{RANK}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"left{RANK}.tmp", f"left{RANK}")
        return 0
    while not os.path.exists(f"left{ARG}"):
        time.sleep(0.02)
    pid = int(open(f"left{ARG}").read())
    while os.path.exists(f"/proc/{pid}"):  # exited and reaped: the supervisor has seen it leave
        time.sleep(0.02)
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")


def slow_steps(seconds: float) -> int:
    """Steps that compute for `seconds` (a big model's step), with the liveness thread gpuherd's
    worker runs: a Ctrl-C is honoured at the end of the step in flight, then a save."""
    from gpuherd.liveness import Liveness

    live = Liveness(status).start()
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    status.send("phase", name="train")
    for i in range(10**6):
        live.step(i)
        live.doing("forward/backward")
        end = time.monotonic() + (seconds if NAME == "slow-steps" or i == 0 else 0.05)
        while time.monotonic() < end:  # busy: state R, CPU busy, as a real forward/backward
            sum(range(2000))
        log(f"Step [{i}/1000] | Loss: {10 - i * 0.01:.4f}")
        status.send("step", step=i, max_steps=1000, loss=10 - i * 0.01)
        if stop:
            with live.phase("checkpoint"):
                status.send("phase", name="checkpoint")
                time.sleep(0.3)
                status.send("checkpoint", step=i, path="ckpt")
            status.send("phase", name="shutdown")
            live.stop()
            return 130
        if NAME == "slow-first-step" and i == 3:
            live.stop()
            status.send("done", step=i)
            return 0
    return 0


# What a rank of a real job does for seconds without a step, alive: (phase, activity, how). `busy`:
# Python holds the GIL computing (a garbage collection, a first step's kernel selection): the
# liveness thread cannot run, the CPU is busy. `gil-idle`: a C call holding the GIL waits (a
# compile waiting on its workers, a write to a slow filesystem): the thread cannot run and the
# CPU is idle. `sleep`: the main thread waits with the GIL released (an eval waiting on its
# device): the thread reports, the CPU is idle.
SLOW_ALIVE = (("train", "forward/backward", "busy", "a slow first step"),
              ("train", "forward/backward", "busy", "a GC pause"),
              ("compile", "compile", "gil-idle", "a compile"),
              ("checkpoint", "torch.save", "gil-idle", "a slow save"),
              ("eval", "eval", "sleep", "a long eval"))


def slow_alive(seconds: float) -> int:
    """Rank 1 goes through each stretch of SLOW_ALIVE at step 0 (the first) or after a quick step;
    every other rank waits for it in a "collective" (state S, CPU idle, its liveness thread
    reporting `collective`): the evidence a wedged rank would give, but for the stretch itself."""
    import ctypes

    from gpuherd.liveness import Liveness

    live = Liveness(status).start()
    status.send("phase", name="train")
    for i, (phase, activity, how, what) in enumerate(SLOW_ALIVE):
        live.step(i)
        if RANK != 1:
            with live.collective("all_reduce (gradients)"):
                while not os.path.exists(f"stretch{i}"):
                    time.sleep(0.05)
        else:
            if phase != "train":
                live.at(phase, activity)
                status.send("phase", name=phase)
            live.doing(activity)
            log(f"{what}: {seconds:g} s ({how})")
            if how == "busy":
                switch = sys.getswitchinterval()
                sys.setswitchinterval(seconds + 5)  # no other thread runs until this loop is done
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    sum(range(2000))
                sys.setswitchinterval(switch)
            elif how == "gil-idle":
                ctypes.PyDLL(None).usleep(int(seconds * 1e6))  # PyDLL: the GIL stays held through the call
            else:
                time.sleep(seconds)
            if phase != "train":
                status.send("phase", name="train")
            open(f"stretch{i}", "w").close()
        log(f"Step [{i}/{len(SLOW_ALIVE)}] | Loss: {10 - i * 0.01:.4f}")
        status.send("step", step=i, max_steps=len(SLOW_ALIVE), loss=10 - i * 0.01)
    live.stop()
    status.send("done", step=len(SLOW_ALIVE))
    return 0


def suspect(faults: int) -> int:
    import socket

    from gpuherd.exit_codes import ExitCode

    train(2)
    device = "cpu" if os.environ.get("GPUHERD_DEVICE_KIND") == "cpu" else f"cuda:0 ({TAG.strip('[]')})"
    for n in range(1, faults + 1):
        log(f"Transient fault at step {n}; suspect device: {device}", "WARNING")
        status.send("suspect", step=n, device=device, host=socket.gethostname(), transient_faults=n,
                    limit=faults - 1, stopping=n == faults)
    log(f"Stopping: rank {RANK} had more than {faults - 1} transient faults", "ERROR")
    return int(ExitCode.DEVICE_SUSPECT)


def wait_for_rank_log(rank: int, text: str, timeout: float = 30.0) -> None:
    from pathlib import Path

    run_dir = Path(os.environ["GPUHERD_RUN_DIR"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in p.read_text() for p in run_dir.glob(f"worker-rank{rank}-*.log")):
            return
        time.sleep(0.02)


def main() -> int:
    if NAME == "env":
        print("ENV " + json.dumps(dict(os.environ)), flush=True)
        status.send("done", step=0)
        return 0
    if NAME == "train":
        train(int(ARG or 20))
        status.send("done", step=int(ARG or 20))
        return 0
    if NAME in ("forever", "ignore-term", "ignore-int", "graceful", "grandchild", "escapee", "save-on", "usr2-log"):
        if NAME == "save-on":
            signame, _, seconds = ARG.partition(":")
            save_on(signame, float(seconds))
        if NAME == "usr2-log":
            signal.signal(signal.SIGUSR2, lambda *_: log("got SIGUSR2", "WARNING"))
        if NAME == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if NAME == "ignore-int":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if NAME == "graceful":
            def stop(signum, frame):
                log("SIGINT: saving checkpoint and stopping", "WARNING")
                status.send("checkpoint", step=0, path="ckpt")
                raise SystemExit(130)
            signal.signal(signal.SIGINT, stop)
        if NAME == "grandchild":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            log(f"grandchild pid {child.pid}")
        if NAME == "escapee":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
            log(f"escapee pid {child.pid}")
        i = 0
        while True:
            step(i, 10**6)
            i += 1
    if NAME == "fail-until":
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        log(f"attempt {attempt}, resume={os.environ.get('GPUHERD_RESUME', '')!r}")
        if attempt < int(ARG):
            train(2)
            raise RuntimeError(f"boom on attempt {attempt} from rank {RANK}")
        train(5)
        status.send("done", step=5)
        return 0
    if NAME == "exit":
        train(2)
        return int(ARG)
    if NAME == "scancel":
        train(2)
        os.kill(os.getppid(), signal.SIGTERM)
        os._exit(143)
    if NAME == "raise":
        train(3)
        raise RuntimeError(f"boom from rank {RANK}")
    if NAME == "exit0":
        train(3)
        return 0
    if NAME == "silent-exit0":
        log("finished early without a word on the status channel")
        return 0
    if NAME == "sigkill":
        train(3)
        os.kill(os.getpid(), signal.SIGKILL)
    if NAME == "stop":
        train(3)
        os.kill(os.getpid(), signal.SIGSTOP)
        return 0
    if NAME == "stall":
        train(3)
        log("waiting in a collective that never completes")
        time.sleep(600)
        return 0
    if NAME == "silent-stall":
        log("waiting forever without a word on the status channel")
        time.sleep(600)
        return 0
    if NAME == "slow-save":
        train(3)
        status.send("phase", name="checkpoint")
        log("saving the final checkpoint")
        time.sleep(float(ARG))
        status.send("checkpoint", step=3, path="ckpt")
        return 0
    if NAME == "flood":
        n = int(ARG or 100_000)
        out = sys.stdout
        for i in range(n):
            out.write(f"flood line {i:06d} from rank {RANK} " + "x" * 40 + "\n")
        out.flush()
        status.send("done", step=0)
        return 0
    if NAME == "midline":
        train(2)
        sys.stderr.write("fatal: half a line without newli")
        sys.stderr.flush()
        os._exit(3)
    return more_behaviours()


if __name__ == "__main__":
    raise SystemExit(main())
