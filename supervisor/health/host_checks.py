"""The machine before a run: disk for checkpoints and logs, the dataset cache, the
master port, the open-file limit, the torch / CUDA / NCCL builds.

FAIL (exit 2, nothing is spawned): less free disk than one checkpoint (or 100 MiB for
logs); a model CPU workers cannot hold in this host's RAM; a dataset cache directory that cannot be read or created; node 0's master
port busy or not an address of this machine, another node's master address that
does not resolve; no torch, or a CPU-only torch where GPUs are planned.
WARN: room for fewer checkpoints than `training.keep_last` + 1, or under 1 GiB for
logs; a cache directory this user cannot write (an unbuilt cache cannot be built);
an open-file limit under 1024. torch is never imported (that alone takes seconds):
versions come from the installed packages' metadata.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import resource
import shutil
import socket
from pathlib import Path

from gpuherd.config import Config
from gpuherd.model_checks import check_fits, host_memory_bytes
from gpuherd.model_size import GPT2_PADDED_VOCAB, checkpoint_bytes, count_params
from gpuherd.storage import format_bytes
from supervisor.health.items import FAIL, NA, PASS, WARN, CheckItem
from supervisor.rendezvous import NodeLinkError, bind_master

GIB = 1024**3
LOGS_FAIL, LOGS_WARN = 100 * 1024**2, GIB
MIN_OPEN_FILES = 1024


def host_items(cfg: Config, gpus_planned: int, master: tuple[str, int] | None, node_rank: int,
               script: bool = False, cpu_workers: int = 0, master_bound: bool = False) -> list[CheckItem]:
    """`script`: a user's script runs, not the built-in trainer: the config's model, checkpoint
    directory and dataset cache are not its own, so nothing is judged by them. `cpu_workers`:
    the CPU workers the run would start (0 on GPUs), each holding the whole model in this
    host's RAM. `master_bound`: this run already holds node 0's port (probing it would find
    our own socket)."""
    if script:
        own = [("checkpoint disk", NA, "a script saves its own checkpoints, of a size gpuherd cannot know"),
               ("dataset cache", NA, "a script reads its own data"),
               ("model memory", NA, "a script's model is its own")]
    else:
        own = [_checkpoint_disk(cfg), _dataset_cache(cfg), _model_memory(cfg, cpu_workers)]
    master_item = ("master port", PASS, f"{master[0]}:{master[1]} bound by this run") if master and master_bound \
        else _master(master, node_rank)
    items = [*own, _logs_disk(cfg), master_item, _open_files(), _software(gpus_planned)]
    return [CheckItem("host", name, status, detail) for name, status, detail in items]


def judged(cfg: Config, gpus_planned: int, cpu_workers: int, script: bool = False) -> str:
    """What a check judged, in words: the model of the preset (and overrides) on these workers."""
    workers = f"{gpus_planned} GPU worker(s)" if gpus_planned else f"{cpu_workers} CPU worker(s)"
    if script:
        return f"a user's script on {workers}"
    m = cfg.model
    params = count_params(m, model_vocab(cfg))
    scale, unit = next((scale, unit) for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                       if params >= scale or unit == "")
    return (f"preset {cfg.preset}: {params / scale:.3g}{unit} parameters ({m.n_layers} layers, dim {m.dim}), "
            f"{cfg.training.max_steps} steps, on {workers}")


def one_checkpoint_bytes(cfg: Config) -> int:
    """About what one checkpoint of this model takes (weights + optimizer state)."""
    return checkpoint_bytes(count_params(cfg.model, model_vocab(cfg)))


def model_vocab(cfg: Config) -> int:
    """The embedding rows the worker will build: `model.vocab_size`, else the tokenizer's
    vocabulary padded as the worker pads it (the byte tokenizer's 256 rows, not GPT-2's 50304:
    a model's size, and its checkpoint's, can differ by far more than that alone)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.tokenizer == "gpt2":  # known without loading its BPE files
        return GPT2_PADDED_VOCAB
    from dataset_cache import DatasetError, load_tokenizer, padded_vocab_size  # numpy: only when needed

    try:
        return padded_vocab_size(load_tokenizer(cfg.data.tokenizer).vocab_size)
    except DatasetError:  # an unusable tokenizer is refused in one line by the run itself
        return GPT2_PADDED_VOCAB


def _free(path: Path) -> tuple[Path, int]:
    """Free bytes where `path` is, or will be (its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path, shutil.disk_usage(path).free


def _checkpoint_disk(cfg: Config) -> tuple[str, str, str]:
    where, free = _free(Path(cfg.system.checkpoint_dir))
    one, keep = one_checkpoint_bytes(cfg), cfg.training.keep_last + 1
    detail = f"{free / GIB:.1f} GiB free at {where}; one checkpoint is about {one / GIB:.2f} GiB"
    if free < one:
        return "checkpoint disk", FAIL, detail + ": not even one fits (system.checkpoint_dir elsewhere?)"
    if free < keep * one:
        return "checkpoint disk", WARN, detail + f": fewer than the {keep} kept while saving (training.keep_last + 1)"
    return "checkpoint disk", PASS, detail


def _model_memory(cfg: Config, cpu_workers: int) -> tuple[str, str, str]:
    """What the run refuses before its spawn (CPU workers, the host's RAM); on GPUs each worker's
    layout planner picks a sharding that fits its GPU, or refuses in one line itself."""
    if not cpu_workers:
        return "model memory", NA, "each GPU worker fits the model to its GPU (training.strategy)"
    where = f"this host (available RAM / {cpu_workers} workers)"
    problem = check_fits(cfg, host_memory_bytes(cpu_workers), world_size=cpu_workers, tokenizer_vocab=model_vocab(cfg),
                         where=where)
    if problem is not None:
        return "model memory", FAIL, problem + "; --debug or --preset gpt2-small train a smaller one"
    return "model memory", PASS, f"fits in {where}: {format_bytes(host_memory_bytes(cpu_workers))} each"


def _logs_disk(cfg: Config) -> tuple[str, str, str]:
    where, free = _free(Path(cfg.system.run_root))
    detail = f"{free / GIB:.1f} GiB free at {where}"
    if free < LOGS_FAIL:
        return "log disk", FAIL, detail + ": logs and metrics need at least 100 MiB"
    if free < LOGS_WARN:
        return "log disk", WARN, detail + ": a long run's logs may fill it"
    return "log disk", PASS, detail


def _dataset_cache(cfg: Config) -> tuple[str, str, str]:
    cache = Path(cfg.data.cache_dir)
    if cache.exists():
        if not cache.is_dir() or not os.access(cache, os.R_OK | os.X_OK):
            return "dataset cache", FAIL, f"{cache} is not a readable directory"
        if not os.access(cache, os.W_OK):
            return "dataset cache", WARN, f"{cache} is read-only for this user: only caches built already can be used"
        return "dataset cache", PASS, f"{cache} readable and writable"
    parent, _free_bytes = _free(cache)
    if not os.access(parent, os.W_OK | os.X_OK):
        return "dataset cache", FAIL, f"{cache} does not exist and {parent} is not writable: it cannot be built"
    return "dataset cache", PASS, f"{cache} will be created"


def _master(master: tuple[str, int] | None, node_rank: int) -> tuple[str, str, str]:
    if master is None:
        return "master port", NA, "single node: the supervisor binds a free port itself"
    addr, port = master
    if node_rank == 0:
        try:
            sock, ip = bind_master(addr, port)
        except NodeLinkError as exc:
            return "master port", FAIL, str(exc)
        sock.close()
        return "master port", PASS, f"{addr}:{port} ({ip}) free on this node"
    try:
        ip = socket.getaddrinfo(addr, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        return "master port", FAIL, f"--master-addr {addr}: cannot resolve it ({exc.strerror})"
    try:
        socket.create_connection((ip, port), timeout=1.0).close()
        return "master port", PASS, f"{addr}:{port} ({ip}) reachable"
    except OSError:
        return "master port", PASS, f"{addr} resolves to {ip}; nothing listens on {port} yet (node 0 may start later)"


def _open_files() -> tuple[str, str, str]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        return "open files", WARN, (f"limit {shown} (hard {hard}): workers, pipes and NCCL sockets may run out; "
                                    f"ulimit -n {hard}")
    return "open files", PASS, f"limit {shown}"


def _software(gpus_planned: int) -> tuple[str, str, str]:
    torch = _version("torch")
    if torch is None:
        return "torch", FAIL, "torch is not installed (bash install.sh)"
    cuda = _torch_cuda()
    nccl = next((v for v in map(_version, ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")) if v), None)
    detail = f"torch {torch}, CUDA {cuda or 'none (CPU build)'}, NCCL {nccl or 'n/a'}"
    if gpus_planned and not cuda:
        return "torch", FAIL, detail + ": a CPU-only torch cannot use the planned GPUs (bash install.sh)"
    return "torch", PASS, detail


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_cuda() -> str | None:
    """`torch.version.cuda` read from torch/version.py's literals: importing it would load torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.AnnAssign):
            target = node.target
        elif isinstance(node, ast.Assign):
            target = node.targets[0]
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(node.value, ast.Constant):
            return node.value.value
    return None
