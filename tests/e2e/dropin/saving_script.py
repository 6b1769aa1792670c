"""A torchrun-style script that saves itself with torch.save every --every steps and resumes
from its own file; nothing of gpuherd in it. Prints `step N loss X`.

--kill-at N: the first attempt SIGKILLs itself right after step N (a test's fault).
--save-on-interrupt: Ctrl-C (KeyboardInterrupt) saves once more before it exits.
"""

import argparse
import os
import signal
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--save-on-interrupt", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt)
        model.load_state_dict(state["model"])
        step = state["step"]
        print(f"resumed from step {step}", flush=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    try:
        while step < args.steps:
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            step += 1
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            if step % args.every == 0:
                torch.save({"model": model.state_dict(), "step": step}, args.ckpt)
            if first_attempt and step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(args.sleep)
    except KeyboardInterrupt:
        if args.save_on_interrupt:
            torch.save({"model": model.state_dict(), "step": step}, args.ckpt)
        raise


if __name__ == "__main__":
    main()
