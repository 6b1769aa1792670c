#!/usr/bin/env python3
"""Sample text from a training checkpoint (seed 001's inference script).

    python3 generate.py --checkpoint .checkpoints/step_0000100.pt --prompt "Once upon a time"
    python3 generate.py --checkpoint .checkpoints --prompt "ROMEO:" --max-new-tokens 200 --top-k 50

--checkpoint takes any gpuherd checkpoint: a single file (single / DDP / ZeRO-1),
an FSDP directory (torch.distributed.checkpoint shards, read without a process
group), a DeepSpeed directory, or a checkpoint directory (its latest checkpoint).
The model shape and tokenizer come from the checkpoint itself; decoding uses a KV cache.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the repo's packages, from any cwd

from gpuherd.cli import OneLineParser, die  # noqa: E402
from gpuherd.exit_codes import ExitCode  # noqa: E402

PROG = "generate.py"


def parse_args(argv: list[str] | None):
    p = OneLineParser(prog=PROG, description="Sample from a gpuherd checkpoint with a KV cache.")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="checkpoint file or directory")
    p.add_argument("--prompt", default="", help="text to continue (default: start from the end-of-text token)")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200, metavar="K", help="sample among the K likeliest tokens; 0 = all")
    p.add_argument("--num-samples", type=int, default=1, metavar="N")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        die(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}", prog=PROG)
    if args.temperature < 0:
        die(f"--temperature must be >= 0, got {args.temperature}", prog=PROG)
    if args.top_k < 0 or args.num_samples < 1:
        die("--top-k must be >= 0 and --num-samples >= 1", prog=PROG)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from worker.distributed import WorkerError
    from worker.inference import generate, load_for_inference

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        die("--device cuda but torch sees no CUDA device", code=ExitCode.DEVICE, prog=PROG)
    try:
        loaded = load_for_inference(Path(args.checkpoint).expanduser(), device)
    except WorkerError as exc:
        die(str(exc), code=exc.exit_code, prog=PROG)
    tokenizer = loaded.tokenizer
    prompt_ids = tokenizer.encode(args.prompt) if args.prompt else [loaded.eot_id]
    print(f"{PROG}: {loaded.path} (step {loaded.step}, {loaded.n_params / 1e6:.1f}M parameters, "
          f"tokenizer {loaded.tokenizer_spec}) on {device}", file=sys.stderr)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for i in range(args.num_samples):
        start = time.perf_counter()
        ids = generate(loaded.model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, gen,
                       stop_id=loaded.eot_id)
        took = time.perf_counter() - start
        if i:
            print("-" * 40)
        print((args.prompt or "") + tokenizer.decode(ids[len(prompt_ids):]), flush=True)
        print(f"{PROG}: {len(ids) - len(prompt_ids)} tokens in {took:.2f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
