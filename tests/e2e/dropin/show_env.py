"""Prints what a rank sees from its launcher (one `ENV {...}` line per rank), then, when told,
fails on one rank: with torch's @record (FAIL_WITH=record), or a plain exit code (FAIL_WITH=3)."""

import json
import os
import sys

SEEN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "OMP_NUM_THREADS", "TORCHELASTIC_TIMER_FILE", "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_ERROR_FILE")


def main() -> None:
    # one write per line: torchrun's ranks share its stdout, and print's two writes interleave
    sys.stdout.write("ENV " + json.dumps({"argv": sys.argv[1:], **{k: os.environ.get(k) for k in SEEN}}) + "\n")
    sys.stdout.flush()
    if os.environ.get("FAIL_RANK") != os.environ["RANK"]:
        return
    how = os.environ.get("FAIL_WITH", "record")
    if how != "record":
        raise SystemExit(int(how))
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def train() -> None:
        raise RuntimeError(f"boom on rank {os.environ['RANK']}")

    train()


if __name__ == "__main__":
    main()
