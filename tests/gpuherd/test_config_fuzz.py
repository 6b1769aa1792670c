"""Malformed input through the real entry points: every case exits 2 with one line that
names the culprit, no traceback, and nothing written (the working directory's listing
is compared before and after). Most cases run in-process through the entry points'
own parsing (`supervisor.cli.parse`, `pretrain_main.main`); a handful run as real
subprocesses (`python -m supervisor`, `pretrain_main.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEBUG_CPU = ["--debug", "--set", "system.device=cpu"]

# (a --set item, a fragment of the one line it must produce)
BAD_SETS = [
    ("model.dim=10000000000000000000000000", "model.dim must fit in a signed 64-bit integer"),
    ("system.seed=100000000000000000000", "system.seed must fit in a signed 64-bit integer"),
    ("training.max_steps=1e30", "training.max_steps must fit in a signed 64-bit integer"),
    ("debug.max_dump_mb=100000000000000000000", "debug.max_dump_mb must fit"),
    ("model.dim=1099511627776", "model.dim must be within (0, 65536]"),
    ("model.n_layers=100000000", "model.n_layers must be within (0, 1024]"),
    ("model.n_heads=0", "model.n_heads"),
    ("model.dim=-4", "model.dim"),
    ("model.vocab_size=-1", "model.vocab_size"),
    ("model.vocab_size=99999999999", "model.vocab_size"),
    ("data.context_length=0", "data.context_length"),
    ("data.context_length=100000000", "data.context_length"),
    ("training.batch_size=0", "training.batch_size"),
    ("training.batch_size=abc", "training.batch_size must be an integer"),
    ("training.learning_rate=-1", "training.learning_rate"),
    ("training.learning_rate=fast", "training.learning_rate must be a number"),
    ("training.learning_rate=true", "training.learning_rate must be a number"),
    ("training.beta1=1.0", "training.beta1"),
    ("training.min_lr_ratio=2", "training.min_lr_ratio"),
    ("training.warmup_steps=20", "training.warmup_steps (20) must not exceed training.max_steps"),
    ("training.strategy=ddpp", "did you mean 'ddp'"),
    ("training.amp_dtype=fp8", "training.amp_dtype"),
    ("training.keep_last=0", "training.keep_last"),
    ("training.eval_steps=0", "training.eval_steps"),
    ("training.max_grad_norm=-1", "training.max_grad_norm"),
    ("training.use_amp=maybe", "training.use_amp must be true or false"),
    ("training.use_amp=1", "training.use_amp must be true or false"),
    ("training.resume=/nonexistent/step_0000001.pt", "training.resume checkpoint not found"),
    ("training.strategy=deepspeed", "needs training.deepspeed_config"),
    ("system.device=tpu", "system.device"),
    ("system.backend=mpi", "system.backend"),
    ("system.gpus=[-1]", "system.gpus must hold non-negative ids"),
    ("system.gpus=[0,0]", "system.gpus lists an id twice"),
    ("system.gpus=a,b", "system.gpus must be a comma-separated list"),
    ("system.log_ranks=[1,1]", "system.log_ranks lists an id twice"),
    ("system.grace_period=0", "system.grace_period"),
    ("system.hang_timeout=-5", "system.hang_timeout"),
    ("system.nproc=0", "system.nproc"),
    ("system.max_restarts=-1", "system.max_restarts"),
    ("system.seed=-1", "system.seed"),
    ("system.monitor_interval=0", "system.monitor_interval"),
    ("system.device_id=-2", "system.device_id"),
    ("debug.log_level=LOUD", "debug.log_level"),
    ("debug.nan_policy=ignore", "debug.nan_policy"),
    ("debug.max_nan_skips=0", "debug.max_nan_skips"),
    ("data.val_fraction=1.5", "data.val_fraction"),
    ("data.num_samples=-3", "data.num_samples"),
    ("data.dataset=/no/such/corpus.txt", "data.dataset '/no/such/corpus.txt'"),
    ("data.tokenizer=/no/such/tokenizer.json", "data.tokenizer '/no/such/tokenizer.json'"),
    ("model.n_kv_heads=3", "must be a multiple of model.n_kv_heads (3)"),
    ("model.dim=130", "model.dim (130) must be divisible by model.n_heads"),
    ("model.dim=132", "must be even for rotary embeddings"),
    ("model.attention=flash", "did you mean 'flash_attn'"),
    ("model.norm_eps=0", "model.norm_eps"),
    ("model.ffn_dim_multiplier=1000", "model.ffn_dim_multiplier"),
    ("model.multiple_of=0", "model.multiple_of"),
    ("model.dim=[1,2]", "model.dim must be an integer, got list"),
    ("model.dim=null", "model.dim must be an integer, got null"),
    ("modell.dim=4", "unknown section 'modell'"),
    ("model.dimm=4", "did you mean 'model.dim'"),
    ("system.grad_accum_nums=2", "did you mean 'training.grad_accum_nums'"),
    ("dim=4", "'dim' must be section.key (did you mean 'model.dim'?)"),
    ("model.dim", "--set expects section.key=value"),
    ("=3", "--set expects section.key=value"),
]

# (flags, fragment), given to both entry points
BAD_FLAGS = [
    (["--max-steps", "100000000000000000000000"], "training.max_steps must fit in a signed 64-bit integer"),
    (["--max-steps", "0"], "training.max_steps"),
    (["--max-steps", "abc"], "--max-steps: invalid int value"),
    (["--max-steps", "1e5"], "--max-steps: invalid int value"),
    (["--preset", "nope"], "--preset: invalid choice"),
    (["--preset", "production"], "--debug and --preset production contradict each other"),
    (["--resume", "/nope/step_0000001.pt"], "training.resume checkpoint not found"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]

# (file name, contents, fragment) for --config
BAD_FILES = [
    ("missing.json", None, "config file not found"),
    ("a_directory", "DIR", "is a directory; --config takes a JSON file"),
    ("invalid.json", '{"model": {"dim": 64,}}', "invalid JSON at line 1"),
    ("list.json", "[1, 2]", "top level must be an object of sections"),
    ("section.json", '{"modle": {"dim": 64}}', "unknown section 'modle'"),
    ("type.json", '{"model": {"dim": "big"}}', "model.dim must be an integer, got str"),
    ("notobject.json", '{"model": 3}', "section 'model' must be an object"),
    ("huge.json", '{"system": {"seed": 1e20}}', "system.seed must fit in a signed 64-bit integer"),
    ("binary.json", b"\xff\xfe\x00garbage", "cannot read config file"),
    ("trailing.json", '{"model": {}} extra', "invalid JSON"),
]

# flags only the supervisor has
BAD_SUPERVISOR_FLAGS = [
    (["--nproc", "0"], "system.nproc"),
    (["--nproc", "-3"], "system.nproc"),
    (["--gpus", "a"], "--gpus: expected comma-separated integers"),
    (["--hang-timeout", "x"], "--hang-timeout: expected seconds"),
    (["--grace-period", "0"], "system.grace_period"),
    (["--nnodes", "0"], "--nnodes must be >= 1"),
    (["--nnodes", "2", "--node-rank", "3"], "--node-rank 3 is outside 0..1"),
    (["--master-port", "70000"], "--master-port 70000 is not a TCP port"),
    (["--nnodes", "2"], "--nnodes 2 needs --master-addr"),
    (["--max-restarts", "-1"], "system.max_restarts"),
    (["--log-ranks", "0,0"], "system.log_ranks lists an id twice"),
    (["--script"], "--script needs a path"),
    (["--script", "/nope/train.py"], "script not found: /nope/train.py"),
]

# bad for the one-process trainer, before any file: the tokenizer knows more tokens
BAD_PRETRAIN = [
    (["--set", "data.tokenizer=byte", "--set", "model.vocab_size=10"],
     "model.vocab_size=10 is smaller than the vocabulary of tokenizer byte (256 tokens)"),
    (["--set", "model.vocab_size=64"], "model.vocab_size=64 is smaller than the vocabulary of tokenizer gpt2 (50257"),
]


def _config_file(inputs: Path, name: str, contents: str | bytes | None) -> str:
    path = inputs / name
    if contents == "DIR":
        path.mkdir()
    elif isinstance(contents, bytes):
        path.write_bytes(contents)
    elif contents is not None:
        path.write_text(contents)
    return str(path)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _one_line_exit_2(call, argv: list[str], fragment: str, capsys, cwd: Path) -> None:
    before = _listing(cwd)
    with pytest.raises(SystemExit) as info:
        call(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert info.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("gpuherd: error: "), err
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err
    assert _listing(cwd) == before  # nothing written


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch) -> Path:
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def _supervisor(argv: list[str]) -> None:
    from supervisor.cli import parse

    parse(argv)


def _pretrain(argv: list[str]) -> None:
    import pretrain_main

    pretrain_main.main(argv)


@pytest.mark.parametrize("entry", [_supervisor, _pretrain], ids=["supervisor", "pretrain_main"])
@pytest.mark.parametrize("item, fragment", BAD_SETS, ids=[item for item, _ in BAD_SETS])
def test_bad_set_values(entry, item, fragment, capsys, cwd):
    _one_line_exit_2(entry, [*DEBUG_CPU, "--set", item], fragment, capsys, cwd)


@pytest.mark.parametrize("entry", [_supervisor, _pretrain], ids=["supervisor", "pretrain_main"])
@pytest.mark.parametrize("flags, fragment", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags(entry, flags, fragment, capsys, cwd):
    _one_line_exit_2(entry, [*DEBUG_CPU, *flags], fragment, capsys, cwd)


@pytest.mark.parametrize("name, contents, fragment", BAD_FILES, ids=[name for name, _, _ in BAD_FILES])
def test_bad_config_files(name, contents, fragment, capsys, cwd, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    path = _config_file(inputs, name, contents)
    for entry in (_supervisor, _pretrain):
        _one_line_exit_2(entry, [*DEBUG_CPU, "--config", path], fragment, capsys, cwd)


@pytest.mark.parametrize("flags, fragment", BAD_SUPERVISOR_FLAGS, ids=[" ".join(f) for f, _ in BAD_SUPERVISOR_FLAGS])
def test_bad_supervisor_flags(flags, fragment, capsys, cwd):
    _one_line_exit_2(_supervisor, [*DEBUG_CPU, *flags], fragment, capsys, cwd)


@pytest.mark.parametrize("flags, fragment", BAD_PRETRAIN, ids=["byte", "gpt2"])
def test_vocab_below_the_tokenizer_is_refused_before_anything_is_written(flags, fragment, capsys, cwd):
    _one_line_exit_2(_pretrain, [*DEBUG_CPU, *flags], fragment, capsys, cwd)


# A few through real processes: the exit code and the one line as a shell sees them.
PROCESS_CASES = [
    ("-m supervisor", ["--set", "model.dim=10000000000000000000000000"], "model.dim must fit in a signed 64-bit"),
    ("-m supervisor", ["--max-steps", "100000000000000000000000"], "training.max_steps must fit"),
    ("-m supervisor", ["--set", "model.n_layers=100000000"], "model.n_layers must be within (0, 1024]"),
    ("pretrain_main.py", ["--set", "system.seed=100000000000000000000"], "system.seed must fit"),
    ("pretrain_main.py", ["--set", "data.tokenizer=byte", "--set", "model.vocab_size=10"], "model.vocab_size=10"),
]


@pytest.mark.parametrize("program, flags, fragment", PROCESS_CASES, ids=[f"{p} {f[-1]}" for p, f, _ in PROCESS_CASES])
def test_bad_input_through_a_real_process(program, flags, fragment, tmp_path):
    command = [sys.executable, *program.split()] if program.startswith("-m") else [sys.executable, str(REPO / program)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([*command, *DEBUG_CPU, *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_model_too_big_for_this_host_is_refused_before_anything_is_written(tmp_path):
    """pretrain_main.py on CPU: the estimate (weights, gradients, AdamW, activations)
    against the host's available RAM; no dataset cache, run folder or checkpoint."""
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    flags = ["--set", "model.dim=65536", "--set", "model.n_heads=512", "--set", "model.n_kv_heads=512",
             "--set", "model.n_layers=1024", "--set", "data.dataset=dummy"]
    res = subprocess.run([sys.executable, str(REPO / "pretrain_main.py"), *DEBUG_CPU, *flags], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "the model does not fit: training it needs at least ~" in lines[0]
    assert "but this host (available RAM) has" in lines[0]
    assert list(tmp_path.iterdir()) == []
