"""The config's shape: one dataclass per section, each field with its default and limits.

Sections: `system`, `model`, `training`, `data`, `debug`. A limit is declared on
its field (`limited(default, gt=0)`, see limits.py), so `validate()` follows a
rename; the few rules that relate two fields live in validate.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gpuherd.config.limits import limited
from gpuherd.config.merge import merge, section_names
from gpuherd.errors import ConfigError

# Names the data section understands without a path on disk.
BUILTIN_DATASETS = ("shakespeare", "dummy")
BUILTIN_TOKENIZERS = ("gpt2", "byte")
# Upper bounds on magnitudes, so a typo (1e300) is refused here instead of failing later
# with a traceback: a wait in seconds overflows timedelta and thread waits far below 1e300
# (30 days is longer than any wait a run means), and a number the model or optimizer puts
# into a float32 tensor must fit one (a huge but finite one still reaches the NaN guard).
LONGEST_WAIT_S = 30 * 24 * 3600.0
FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class SystemConfig:
    device: str = limited("auto", choices=("auto", "cuda", "cpu"))
    device_id: int | None = limited(None, ge=0)  # one physical GPU id (train_gpu.sh sets it)
    gpus: list[int] | None = limited(None, ids=True)  # physical GPU ids to use; None = all allowed
    nproc: int = limited(2, gt=0)  # CPU workers on a machine with no GPU
    backend: str = limited("auto", choices=("auto", "nccl", "gloo"))  # auto = nccl on GPU, gloo on CPU
    seed: int = limited(1337, ge=0)
    run_root: str = "logs"  # run directories go to <run_root>/<run-id>/
    checkpoint_dir: str = ".checkpoints"
    isolate: bool = True  # each worker sees only its own GPU
    # tests only: every rank (--nproc N) and warm spare on one GPU, collectives over gloo (NCCL refuses one
    # GPU twice); for gpuherd's own GPU tests on a one-GPU machine, never for training (docs/guide/gpus.md)
    shared_gpu_for_tests: bool = False
    hang_timeout: float = limited(0.0, ge=0, le=LONGEST_WAIT_S)  # fixed step allowance in seconds; 0 = learned per phase (hang_factor, hang_floor)
    startup_timeout: float = limited(0.0, ge=0, le=LONGEST_WAIT_S)  # allowance for init + first step; 0 = default
    grace_period: float = limited(5.0, gt=0, le=LONGEST_WAIT_S)  # SIGTERM -> SIGKILL wait during teardown
    rendezvous_timeout: float = limited(120.0, gt=0, le=LONGEST_WAIT_S)  # process-group init
    # --nnodes MIN:MAX: once MIN nodes joined, how long node 0 waits for more (torchrun's last_call_timeout)
    rendezvous_last_call: float = limited(30.0, ge=0, le=LONGEST_WAIT_S)
    # multi-node: seconds of silence before a node is given up: node 0 names a node whose heartbeat stood still
    # this long, and the other nodes give node 0 up when its job store answers nothing this long (a stall of
    # node 0, a frozen VM or machine, shorter than this is ridden out)
    node_silence_timeout: float = limited(10.0, ge=3, le=3600)
    log_ranks: list[int] | None = limited(None, ids=True)  # console shows these ranks (+ all warnings)
    collapse_logs: bool = False  # fold every rank's step line too (other alike lines always fold)
    monitor_interval: float = limited(5.0, gt=0, le=LONGEST_WAIT_S)  # seconds between GPU samples
    max_restarts: int = limited(0, ge=0)  # restart every worker after a failure, resuming from the newest checkpoint
    restart_backoff: float = limited(0.2, ge=0, le=LONGEST_WAIT_S)  # seconds before the first restart; doubles for each further quick failure
    spares: int = limited(-1, ge=-1)  # warm spare workers per node for live recovery; -1 = 1 when max_restarts > 0, settled when the config is built
    # a lost rank with no spare left: the survivors go on with its data slot (same global batch) while at
    # least this many remain; 0 = never shrink (restart instead)
    min_replicas: int = limited(0, ge=0)
    # nodes beyond --nnodes that stand by without a rank: one takes the ranks of a node that dies whole
    spare_nodes: int = limited(0, ge=0)
    # live recovery of training.strategy=fsdp: after every step each rank's shard (weights and optimizer
    # state) is copied into its neighbour's host memory; costs 4 shard copies of host RAM per rank (two
    # own snapshots, two of the neighbour's); false = a lost fsdp rank restarts every worker instead
    shard_copies: bool = True
    # a --script run with restarts left: from its first step, one interpreter per rank imports torch
    # for the next attempt (at the lowest CPU priority; ~0.3 GB of host memory each)
    standbys: bool = True
    restart_on_nan: bool = False  # a NaN stop (exit 6) is restarted too, not only crashes and hangs
    exclude_suspect_gpus: bool = False  # after an exit 8, the restart runs without the suspect GPUs
    allow_suspect_gpus: bool = False  # start on GPUs this host's suspect list names (left out by default)
    stop_timeout: float = limited(120.0, gt=0, le=LONGEST_WAIT_S)  # a graceful stop (SIGTERM, Ctrl-C) with its final save, at most
    preflight: bool = True  # GPU and host checks (`gpuherd check`) before anything starts
    # report.html + PNG figures rendered at the end, before the exit (matplotlib: about a second);
    # off, the summary names `gpuherd report RUN`, which renders the same page from the run's files
    report: bool = False
    # hang verdicts and stragglers (supervisor/health/): learned timeouts and slow-rank warnings
    hang_factor: float = limited(5.0, ge=1, le=1000)  # learned allowance of a phase = max(hang_floor, hang_factor x its p99)
    hang_floor: float = limited(10.0, gt=0, le=LONGEST_WAIT_S)  # seconds: a learned allowance is never shorter
    straggler_factor: float = limited(1.3, ge=0, le=1000)  # compute per step this much above the others' median; 0 = off
    straggler_windows: int = limited(3, gt=0)  # ... in this many 5 s windows in a row before the warning
    # a straggler moved out live (a warm spare takes its rank, or --min-replicas goes on without it; a
    # whole node: a spare node takes its place): compute per step this much above the others' median
    # in every window for straggler_move_after_s
    straggler_move_factor: float = limited(2.0, gt=1, le=1000)
    straggler_move_after_s: float = limited(30.0, ge=0, le=LONGEST_WAIT_S)  # seconds; 0 = never moved, named only


@dataclass
class ModelConfig:
    # Upper bounds sit far above any trained model (GPT-3: 96 layers, dim 12288; Llama 3 405B:
    # 126, 16384): a value past them is a typo, refused before workers try to build it.
    n_layers: int = limited(32, gt=0, le=1024)
    dim: int = limited(4096, gt=0, le=65536)
    n_heads: int = limited(32, gt=0, le=1024)
    n_kv_heads: int | None = 8  # grouped-query attention; None = n_heads (checked against n_heads)
    vocab_size: int = limited(0, ge=0, le=2**22)  # 0 = the tokenizer's, padded to a multiple of 64
    multiple_of: int = limited(256, gt=0, le=65536)  # SwiGLU hidden size is rounded up to this
    ffn_dim_multiplier: float | None = limited(None, gt=0, le=64)
    norm_eps: float = limited(1e-5, gt=0, le=FLOAT32_MAX)
    rope_theta: float = limited(10000.0, gt=0, le=FLOAT32_MAX)
    init_std: float = limited(0.02, gt=0, le=FLOAT32_MAX)
    tie_embeddings: bool = False
    attention: str = limited("auto", choices=("auto", "flash_attn", "sdpa", "eager"))


@dataclass
class TrainingConfig:
    batch_size: int = limited(4, gt=0)  # micro-batch per worker
    grad_accum_nums: int = limited(8, gt=0)
    learning_rate: float = limited(3e-4, gt=0, le=FLOAT32_MAX)
    min_lr_ratio: float = limited(0.1, ge=0, le=1)  # cosine decays to learning_rate * this
    weight_decay: float = limited(0.1, ge=0, le=FLOAT32_MAX)
    beta1: float = limited(0.9, ge=0, lt=1)
    beta2: float = limited(0.95, ge=0, lt=1)
    eps: float = limited(1e-8, ge=0, le=FLOAT32_MAX)
    max_steps: int = limited(10000, gt=0)
    warmup_steps: int = limited(2000, ge=0)  # at most max_steps
    max_grad_norm: float = limited(1.0, ge=0, le=FLOAT32_MAX)  # 0 disables clipping
    use_amp: bool = True  # bf16 autocast on GPU (fp16 + scaler where no bf16)
    amp_dtype: str = limited("bf16", choices=("bf16", "fp16"))
    num_workers: int = limited(2, ge=0)  # batches a background thread prepares ahead; 0 = in the loop
    log_every: int = limited(10, gt=0)
    eval_every: int = limited(500, ge=0)  # 0 disables evaluation
    eval_steps: int = limited(20, gt=0)
    save_every: int = limited(1000, ge=0)  # 0 = only at the end
    keep_last: int = limited(3, gt=0)
    # Periodic saves copy the state to host memory and write it in a background thread
    # while training goes on (worker/saver.py); off = the loop waits for every write.
    async_save: bool = True
    strategy: str = limited("auto", choices=("auto", "single", "ddp", "fsdp", "zero1", "deepspeed"))
    deepspeed_config: str | None = None  # a DeepSpeed JSON file; required by strategy=deepspeed
    fsdp_reshard_after_forward: bool = True  # True ~ ZeRO-3, False ~ ZeRO-2
    gradient_checkpointing: bool = False
    compile: bool | None = None  # torch.compile per block; None = on for CUDA, off on CPU
    resume: str | None = None  # None | "auto" | path to a checkpoint
    # Silent data corruption (worker/sdc/): data-parallel replicas compare fingerprints of their state
    sdc_check_every: int = limited(1, ge=0)  # parameters, every N optimizer steps and before each save; 0 = off
    sdc_optim_check_every: int = limited(10, ge=0)  # optimizer state too (FSDP: a recompute of the step); 0 = never


@dataclass
class DataConfig:
    dataset: str = "shakespeare"  # shakespeare | dummy | a file, directory or glob (formats: docs/guide/data.md)
    tokenizer: str = "gpt2"  # gpt2 | byte | path to a tokenizer.json
    context_length: int = limited(2048, gt=0, le=2**21)
    num_samples: int = limited(0, ge=0)  # documents to use (per source in a mixture); 0 = all
    val_fraction: float = limited(0.05, gt=0, lt=1)
    cache_dir: str = "cache/datasets"
    verify_cache: bool = False  # full checksum on every open
    text_field: str = "text"  # the key / column holding the text in JSONL, parquet and HF datasets
    # error: exit 3 naming file and line/row | skip: counted in the build summary
    on_bad_record: str = limited("error", choices=("error", "skip"))
    mix: list[dict[str, Any]] | None = None  # [{source, weight | epochs | held_out, text_field?}]; replaces dataset


@dataclass
class DebugConfig:
    enabled: bool = False
    log_level: str = limited("INFO", choices=("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR"))
    nan_detection: bool = True  # cheap finite checks every step
    nan_hooks: bool = False  # forward hooks naming the first bad module
    nan_policy: str = limited("stop", choices=("stop", "skip", "rerun"))
    max_nan_skips: int = limited(3, gt=0)
    max_dump_mb: int = limited(1024, gt=0)
    # Suspicious steps beyond NaN/Inf (worker/nan/spikes.py, worker/nan/rerun_policy.py). A loss (and
    # gradient-norm) spike is a value above median + spike_k x MAD of the last spike_window
    # applied steps, judged once spike_warmup steps were seen. `rerun` replays the step to
    # tell a transient (device) fault from a reproducible (data/model) one.
    spike_policy: str = limited("off", choices=("off", "stop", "skip", "rerun"))
    spike_window: int = limited(100, ge=3)  # a median and a MAD of fewer values say nothing about spread
    spike_warmup: int = limited(20, ge=0)
    spike_k: float = limited(10.0, gt=0)
    spike_grad_norm: bool = True  # judge the gradient norm too, not only the loss
    max_transient_faults: int = limited(2, ge=0)  # per device; one more stops the run with exit 8
    rerun_deterministic: bool = True  # deterministic kernels while a rerun policy is on
    # Each logged step record names every micro-batch drawn in it (`samples`: data slot, epoch,
    # windows consumed): a test or an audit can check that no sample was skipped or repeated
    record_samples: bool = False


@dataclass
class LoggingConfig:
    # "offline": rank 0 also writes a Weights & Biases run into the run directory for a
    # later `wandb sync`; nothing ever contacts a server from a training run.
    wandb: str = limited("off", choices=("off", "offline"))


@dataclass
class Config:
    preset: str = "production"
    system: SystemConfig = field(default_factory=SystemConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Config:
        """Exact inverse of `to_dict` (a saved, resolved config)."""
        cfg = cls(preset=str(raw.get("preset", "custom")))
        merge(cfg, {k: v for k, v in raw.items() if k != "preset"}, source="saved config")
        return cfg

    @classmethod
    def load(cls, path: Path) -> Config:
        try:
            raw = orjson.loads(Path(path).read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read resolved config {path}: {exc}") from None
        return cls.from_dict(raw)


SECTIONS = section_names(Config())
