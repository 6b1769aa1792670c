"""gpuherd's GPU acceptance: one command on a lent one-GPU machine (`bash bench/gpu_acceptance.sh`).

What it runs, in order, each part in a process of its own under a time limit of its own, the
whole within a budget (10 minutes on one H100 with the machine's start-up), carrying on past a
part that fails and saying which did (plan.py lists the parts and their limits):

- the environment: torch, CUDA, the device, the packages carried as wheels;
- the 124M shape's MFU with the `gpt2-small` preset's own choices, and the 1B shape's;
- the recovery cases on one shared GPU (`system.shared_gpu_for_tests`, gloo): a warm spare's
  live recovery and its first step against the median step, a shrink, FSDP recovery from the
  neighbour's copy, the SDC check and heal, async saves;
- karpathy/nanoGPT's train.py under `gpuherd run`, SIGKILLed after its first checkpoint, restarted
  from a restart standby and resumed by its own `init_from='resume'`;
- the 1B model's async save against a blocking one;
- `pytest -m gpu`.

Without a GPU the same command is the rehearsal: the recovery cases run on CPU workers (the same
driver, the same checks), and each GPU-only part is skipped with its reason. Every figure is
written with its device: `bench/RESULTS.md` (a GPU run) or `bench/results/gpu_acceptance.md` (a
rehearsal), and under `$OUT` when that is set (a lent machine's files come back from there).
"""
