"""The parts of the GPU acceptance, in the order they run, with their time limits.

The order is what a short lease should measure first: the figures never measured on a GPU (the
124M shape with the preset's own choices, the recovery cases on a real CUDA device, a real
script's kill and resume) before the ones an earlier lease measured once (the 1B shape's MFU,
`pytest -m gpu`). A part runs in a process of its own (`python -m bench.acceptance.<module>
ARGS --device D --result FILE`) under its limit; once the run's budget is spent, the parts left
are not started and the record says so.

Without a GPU the run is a rehearsal: a part that can run on CPU workers (the recovery cases:
the same driver and checks, CPU ranks over gloo) runs there under its rehearsal limit, with
fewer steps; a GPU-only part is skipped with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

BUDGET_S = 480.0  # the parts together: 8 minutes, so a lent H100's start-up (1-2 min) fits 10
REHEARSAL_BUDGET_S = 600.0  # a rehearsal's CPU ranks on a small, shared machine are slower than a GPU's
LAST_START_S = 20.0  # a part is not started with less of the budget left than this
GPU_ONLY_MFU = "MFU needs a CUDA GPU: a CPU has no peak-FLOPs entry"


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    limit_s: float  # on a GPU
    module: str  # bench.acceptance.<module>
    args: tuple[str, ...] = ()
    gpu_only: str | None = None  # why it cannot rehearse on a CPU; None: it can
    rehearsal_s: float | None = None  # its limit in a rehearsal (None: limit_s)

    def command(self, python: str, device: str, result: str) -> list[str]:
        return [python, "-m", f"bench.acceptance.{self.module}", *self.args, "--device", device, "--result", result]

    def limit(self, gpu: bool) -> float:
        return self.limit_s if gpu or self.rehearsal_s is None else self.rehearsal_s


PARTS: tuple[Part, ...] = (
    Part("environment", "torch, CUDA, the device, the carried packages, `gpuherd check`", 40, "environment"),
    Part("mfu-124M", "124M shape with the gpt2-small preset's own batch, sequence, compile and optimizer: MFU",
         150, "throughput", ("mfu-124M",), gpu_only=GPU_ONLY_MFU),
    Part("live", "2 ranks on one GPU, rank 1 SIGKILLed: a warm spare takes it; its first step against the median",
         90, "cases", ("live",), rehearsal_s=180),
    Part("fsdp", "FSDP, 2 ranks on one GPU, rank 1 SIGKILLed: its shard from the neighbour's copy", 75, "cases",
         ("fsdp",), rehearsal_s=150),
    Part("sdc", "a bit flipped in rank 1's parameters: caught at its step, rank named, healed in place", 60, "cases",
         ("sdc",), rehearsal_s=120),
    Part("shrink", "rank 1 SIGKILLed with no spare (--min-replicas 1): the group shrinks to 1", 75, "cases",
         ("shrink",), rehearsal_s=150),
    Part("async-save", "2 ranks on one GPU, async periodic saves: the loop blocked per save", 60, "cases",
         ("async-save",), rehearsal_s=120),
    Part("nanogpt", "karpathy/nanoGPT's train.py under `gpuherd run`, SIGKILLed, restarted, resumed by itself",
         120, "nanogpt", gpu_only="nanoGPT's train.py puts a torchrun rank on cuda:LOCAL_RANK"),
    Part("save-1B", "the 1B shape: the loop blocked by an async save against a blocking one", 150, "throughput",
         ("save-1B",), gpu_only="the 1B model's state (~16 GB) is a GPU figure"),
    Part("mfu-1B", "1B shape (sequence 2048, bf16, per-block compile): MFU", 150, "throughput", ("mfu-1B",),
         gpu_only=GPU_ONLY_MFU),
    Part("pytest-gpu", "`pytest -m gpu`", 180, "pytest_gpu", rehearsal_s=180),
)


def chosen(only: list[str] | None) -> list[Part]:
    """The parts to run, in plan order; `only` names some (an unknown name is a ValueError)."""
    if not only:
        return list(PARTS)
    names = {p.name for p in PARTS}
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"unknown part {unknown[0]!r}; parts: {', '.join(p.name for p in PARTS)}")
    return [p for p in PARTS if p.name in only]
