"""A launch's bad paths and impossible values (supervisor/validation/) are refused before
anything is written or spawned: exit 2, one line naming the culprit, the working
directory untouched."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.validation import LaunchError
from supervisor.validation.limits import check_backend, check_worker_count, open_files_needed
from supervisor.validation.paths import check_directory, probe_writable
from tests.supervisor import helpers as sh

TINY_TRAIN = ("--debug", "--set", "data.dataset=dummy", "--set", "data.tokenizer=byte")


def _supervisor(cwd: Path, *args: str, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", "--set", "system.device=cpu", *args], cwd=cwd,
                          env=sh.env(), capture_output=True, text=True, timeout=120, preexec_fn=preexec)


def _refused(done: subprocess.CompletedProcess, fragment: str) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, fragment", [
    (("--set", "system.checkpoint_dir=a_file"), "system.checkpoint_dir {cwd}/a_file is a file, not a directory"),
    (("--set", "system.checkpoint_dir=a_file/ckpt"), "system.checkpoint_dir {cwd}/a_file/ckpt: {cwd}/a_file is a file"),
    (("--set", "system.run_root=a_file"), "system.run_root {cwd}/a_file is a file, not a directory"),
    (("--set", "data.cache_dir=a_file/cache"), "data.cache_dir {cwd}/a_file/cache: {cwd}/a_file is a file"),
    (("--set", f"system.run_root=runs/{'r' * 300}"), "system.run_root: the path component 'rrrrrrrrrrrrrrrrrr"),
    (("--set", f"system.checkpoint_dir={'c' * 300}/x"), "(300 bytes) is longer than the filesystem allows"),
    (("--set", "system.checkpoint_dir=/proc/gpuherd-checkpoints"), "cannot create files there"),
    (("--config", "a_dir"), "config file {cwd}/a_dir is a directory; --config takes a JSON file"),
    (("--nproc", "100000"), "--nproc 100000 (system.nproc): one supervisor runs at most 1024 workers"),
    (("--set", "system.backend=nccl"), "system.backend=nccl needs CUDA GPUs, but this run's workers are on CPU"),
    (("--gpus", "0,1"), "system.gpus 0,1 (--gpus) names GPUs, but system.device=cpu runs CPU workers"),
    (("--run-id", "a", "--rdzv-id", "b"), "--run-id a and --rdzv-id b name the run twice, differently; give one"),
    # the value quoted as typed would be two lines: its newline is shown, not printed
    (("--run-id", "a\nb"), "--run-id 'a\\nb' must be 1-128 characters of letters, digits"),
    # each spare imports torch: far more than any host holds, refused before the first one starts
    (("--max-restarts", "1", "--spares", "100000"), "2 worker(s) and 100000 warm spare(s) (--spares) need about"),
    # the value as typed: before, after a float round trip in the --set parse, 99999999999999991611392
    (("--spare-nodes", "99999999999999999999999"), "system.spare_nodes must fit in a signed 64-bit integer "
                                                   "(at most 9223372036854775807), got 99999999999999999999999"),
])
def test_bad_paths_and_values_exit_2_before_anything_is_written(tmp_path, args, fragment):
    (tmp_path / "a_file").write_text("in the way\n")
    (tmp_path / "a_dir").mkdir()
    done = _supervisor(tmp_path, *TINY_TRAIN, *args)
    _refused(done, fragment.format(cwd=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file"]
    assert not list((tmp_path / "a_dir").iterdir())


def test_a_script_that_is_a_directory_is_refused(tmp_path):
    (tmp_path / "train").mkdir()
    _refused(_supervisor(tmp_path, "--script", "train"), "train is a directory, not a script")
    assert [p.name for p in tmp_path.iterdir()] == ["train"]


def _open_files(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def test_too_many_workers_for_the_open_file_limit(tmp_path):
    done = _supervisor(tmp_path, *TINY_TRAIN, "--nproc", "50", preexec=_open_files(200))
    _refused(done, "50 workers need about 464 open files, but this process may open only 200 (ulimit -Hn)")
    assert list(tmp_path.iterdir()) == []


def test_a_low_soft_open_file_limit_is_raised_to_what_the_workers_need(tmp_path):
    """Soft limit below the need, hard limit above it: raised, as `ulimit -n` would."""
    assert _soft_limit_after(tmp_path, "ensure_open_files(40)", soft=100, hard_at_least=1000) == 384  # 64 + 8 a worker


def _soft_limit_after(cwd: Path, call: str, soft: int, hard_at_least: int) -> int:
    """The soft open-file limit a fresh process has after `call`, started with `soft` and this
    machine's hard limit (skipped where that is below `hard_at_least`)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < hard_at_least:
        pytest.skip(f"the hard open-file limit here is {hard}")
    code = (f"import resource; from supervisor.validation.limits import ensure_open_files; {call}; "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=sh.env(), capture_output=True, text=True,
                          timeout=60, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_node_0_of_1024_nodes_under_a_low_hard_file_limit_is_refused_before_the_join(tmp_path):
    """A cluster's usual limit (1,024) on node 0 of a 1,024-node job: refused in one line naming
    the limit and how to raise it, before anything binds, joins or is written; not a node 0 that
    drops nodes with "Too many open files" hundreds of nodes into the join."""
    done = _supervisor(tmp_path, *TINY_TRAIN, "--nnodes", "1024", "--node-rank", "0", "--master-addr", "127.0.0.1",
                       "--master-port", "1", "--nproc", "1", preexec=_open_files(1024))
    _refused(done, "node 0 of 1024 nodes (1 workers each) needs about 5192 open files for the job's connections, "
                   "but this process may open only 1024 (ulimit -Hn); raise the hard limit on node 0")
    assert list(tmp_path.iterdir()) == []


def test_node_0_raises_its_soft_file_limit_to_what_the_nodes_it_serves_need(tmp_path):
    """Soft 1,024 (the usual default), hard above the need: node 0 raises it for itself and the
    stores it starts (they inherit it); a node other than 0 serves no node and needs no more."""
    raised = _soft_limit_after(tmp_path, "ensure_open_files(8, hosted_nodes=1024)", soft=1024, hard_at_least=20000)
    assert raised == 64 + 8 * 8 + 3 * 1024 + 2 * 8 * 1024


def test_open_files_needed_counts_every_node_and_worker_node_0_serves():
    assert open_files_needed(4) == 64 + 32
    assert open_files_needed(4, hosted_nodes=2) == 64 + 32 + 6 + 16
    assert open_files_needed(1, hosted_nodes=16384) > 16384 * 4  # 16K nodes: beyond any default limit


def test_check_directory_finds_what_mkdir_would_start_from(tmp_path):
    assert check_directory("k", tmp_path / "new" / "deeper") == tmp_path
    (tmp_path / "f").write_text("x")
    with pytest.raises(LaunchError, match=f"^k {tmp_path}/f/sub: {tmp_path}/f is a file, not a directory$"):
        check_directory("k", tmp_path / "f" / "sub")


def test_probe_leaves_nothing_behind(tmp_path):
    probe_writable("k", tmp_path / "ckpt", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_directory_is_named(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere; /proc covers this case in the supervisor test")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(LaunchError, match="cannot create files there"):
        probe_writable("system.checkpoint_dir", locked / "ckpt", locked)


def test_worker_count_and_backend_limits():
    check_worker_count(1024)
    with pytest.raises(LaunchError, match="at most 1024 workers"):
        check_worker_count(1025)
    check_backend("nccl", "cuda")
    check_backend("gloo", "cpu")
    with pytest.raises(LaunchError, match="system.backend=nccl needs CUDA GPUs"):
        check_backend("nccl", "cpu")


@pytest.mark.parametrize("args, fragment", [
    (("--set", "model.vocab_size=10"), "model.vocab_size=10 is smaller than the vocabulary of tokenizer gpt2"),
    (("--set", "model.dim=8192", "--set", "model.n_layers=200"), "the model does not fit: training it needs"),
])
def test_a_model_that_cannot_train_is_refused_before_any_worker_starts(tmp_path, args, fragment):
    """The supervisor, not every worker after the spawn: one line, exit 2, nothing written."""
    done = _supervisor(tmp_path, "--debug", "--set", "data.dataset=dummy", "--skip-checks", *args)
    _refused(done, fragment)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("section, key", [("system", "run_root"), ("system", "checkpoint_dir"), ("data", "cache_dir")])
def test_a_nul_byte_in_a_path_is_refused(tmp_path, section, key):
    """A NUL cannot come through argv, but a JSON config's `\\u0000` carries one."""
    (tmp_path / "nul.json").write_text(f'{{"{section}": {{"{key}": "x\\u0000y"}}}}')
    done = _supervisor(tmp_path, *TINY_TRAIN, "--config", "nul.json")
    _refused(done, f"{section}.{key} '{tmp_path}/x\\x00y' holds a NUL byte")
    assert [p.name for p in tmp_path.iterdir()] == ["nul.json"]


def test_a_nul_byte_in_a_config_key_is_shown_not_printed(tmp_path):
    (tmp_path / "nul.json").write_text('{"training": {"lear\\u0000ning_rate": 1}}')
    done = _supervisor(tmp_path, *TINY_TRAIN, "--config", "nul.json")
    _refused(done, "unknown key 'training.lear\\x00ning_rate'")
    assert "\x00" not in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["nul.json"]


@pytest.mark.parametrize("setting", ["training.learning_rate=1e300", "system.rendezvous_timeout=1e300",
                                     "system.stop_timeout=1e300", "model.rope_theta=1e300"])
def test_absurd_magnitudes_are_refused(tmp_path, setting):
    done = _supervisor(tmp_path, *TINY_TRAIN, "--set", setting)
    _refused(done, f"{setting.partition('=')[0]} must be within")
    assert list(tmp_path.iterdir()) == []


def test_a_config_from_process_substitution_is_read(tmp_path):
    """`--config <(...)` hands a pipe (/dev/fd/N), not a regular file: it is read like one
    (the bad value inside it is what gets named, not a missing file)."""
    line = f"exec {sys.executable} -m supervisor --set system.device=cpu {' '.join(TINY_TRAIN)} " \
           """--config <(echo '{"training": {"learning_rate": -1}}')"""
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=120)
    _refused(done, "training.learning_rate must be within (0, ")
    assert list(tmp_path.iterdir()) == []


def _address_space(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@pytest.mark.parametrize("config, fragment", [
    # before: read forever, the memory growing (under this test's 4 GiB address space: a MemoryError traceback)
    ("/dev/zero", "config file /dev/zero is a character device; --config takes a JSON file (or a pipe: <(...))"),
    ("/dev/null", "config file /dev/null is a character device; --config takes a JSON file"),
    # a pipe is read, to a bound: one that never ends is refused once it passed it
    ("<(yes)", "is larger than 16 MiB, the limit for a config file"),
    ("big.json", "big.json is larger than 16 MiB, the limit for a config file"),
])
def test_a_config_that_is_a_device_or_never_ends_is_refused_in_one_line(tmp_path, config, fragment):
    """`--config` reads at most MAX_CONFIG_BYTES, from a file or a pipe, never a device."""
    with (tmp_path / "big.json").open("wb") as f:  # sparse: 17 MiB of zero bytes that take no disk
        f.truncate(17 << 20)
    line = f"exec {sys.executable} -m supervisor --set system.device=cpu {' '.join(TINY_TRAIN)} --config {config}"
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=sh.env(), capture_output=True, text=True,
                          timeout=120, preexec_fn=_address_space(4 << 30))
    _refused(done, fragment)
    assert [p.name for p in tmp_path.iterdir()] == ["big.json"]
