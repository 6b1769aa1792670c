"""The supervisor<->worker contracts in gpuherd/: names, tags, the status codec, exit codes."""

from __future__ import annotations

import os
import signal

import orjson
import pytest

from gpuherd import contract
from gpuherd.exit_codes import ExitCode, describe, from_signal
from gpuherd.status_channel import PIPE_BUF, StatusWriter
from gpuherd.status_records import Nan, Refusal, Refused, Step, decode


def test_torchrun_variables_are_all_present():
    # What torch.distributed.elastic's LocalElasticAgent sets for each worker.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        assert name in contract.TORCHRUN_VARS
    assert contract.GPU_RANK == "GPU_RANK"  # seed 003's name


@pytest.mark.parametrize(
    "env, tag, bracket",
    [
        ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "GPUHERD_DEVICE_KIND": "cuda", "GPUHERD_DEVICE_ID": "6"}, "GPU6", "[GPU 6]"),
        ({"RANK": "0", "WORLD_SIZE": "2", "GPUHERD_DEVICE_KIND": "cpu", "GPUHERD_DEVICE_ID": "0"}, "CPU0", "[CPU 0]"),
        ({"GPU_RANK": "3"}, "GPU3", "[GPU 3]"),  # seed 003's standalone `GPU_RANK=3 python3 pretrain_main.py`
        ({}, "GPU0", "[GPU 0]"),
    ],
)
def test_identity_tags(env, tag, bracket):
    ident = contract.WorkerIdentity.from_env(env)
    assert ident.tag == tag and ident.bracket == bracket


def test_identity_defaults_to_rank_zero_of_one():
    ident = contract.WorkerIdentity.from_env({})
    assert (ident.rank, ident.world_size, ident.supervised) == (0, 1, False)


def test_status_records_cross_a_real_pipe():
    read_fd, write_fd = os.pipe()
    try:
        writer = StatusWriter(write_fd, rank=3)
        writer.send("step", step=5, loss=2.5)
        writer.send("nan", step=6, note="x" * (PIPE_BUF * 2))  # too big: sent as a truncated marker
        os.close(write_fd)
        lines = os.read(read_fd, 1 << 16).splitlines()
    finally:
        os.close(read_fd)
    first, second = (decode(line) for line in lines)
    assert isinstance(first, Step) and first.rank == 3 and first.step == 5 and first.loss == 2.5
    assert second == Nan(rank=3, time=second.time, truncated=True)


def test_status_writer_without_supervisor_is_silent():
    writer = StatusWriter(None, rank=0)
    assert not writer.connected
    writer.send("step", step=1)


def test_status_writer_survives_a_dead_reader():
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    old = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        writer = StatusWriter(write_fd, rank=0)
        writer.send("step", step=1)
        assert not writer.connected
    finally:
        signal.signal(signal.SIGPIPE, old)
        os.close(write_fd)


def test_unknown_record_type_is_a_programming_error():
    with pytest.raises(ValueError):
        StatusWriter(1, rank=0).send("stpe")


def test_decode_rejects_garbage():
    assert decode(b"not json") == Refusal(Refused.UNREADABLE)
    assert decode(orjson.dumps([1])) == Refusal(Refused.NOT_AN_OBJECT)
    assert decode(orjson.dumps({"type": "bogus"})) == Refusal(Refused.UNKNOWN_TYPE, "bogus")
    # the supervisor's own records are no worker's to send: refused on a worker's pipe
    assert decode(orjson.dumps({"type": "restart", "attempt": 2})) == Refusal(Refused.UNKNOWN_TYPE, "restart")


def test_exit_codes_are_documented_and_distinct():
    values = [int(code) for code in ExitCode]
    assert len(values) == len(set(values))
    assert (ExitCode.USAGE, ExitCode.HANG, ExitCode.SIGINT, ExitCode.SIGTERM) == (2, 124, 130, 143)
    assert from_signal(signal.SIGKILL) == 137
    assert describe(137) == "killed by SIGKILL"
    assert describe(-9) == "killed by SIGKILL"
    assert describe(6) == "non-finite loss or gradient, or a loss spike"
    assert describe(17) == "exit code 17"


def test_reference_pages_list_every_contract_name_and_exit_code(repo_root):
    doc = (repo_root / "docs" / "reference" / "environment.md").read_text()
    for name in contract.TORCHRUN_VARS + contract.GPUHERD_VARS:
        assert f"`{name}`" in doc, f"{name} is not documented in docs/reference/environment.md"
    codes = (repo_root / "docs" / "reference" / "exit-codes.md").read_text()
    for code in ExitCode:
        assert f"| {int(code)} |" in codes, f"exit code {int(code)} is not documented"


def test_cuda_defaults_yield_to_what_the_user_set():
    assert contract.cuda_defaults({}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                          "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert contract.cuda_defaults({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert contract.cuda_defaults({"PYTORCH_ALLOC_CONF": "expandable_segments:False",  # torch's newer name
                                   "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}) == {}


def test_environment_page_documents_the_cuda_and_network_environment(repo_root):
    doc = (repo_root / "docs" / "reference" / "environment.md").read_text()
    for name in (*contract.CUDA_DEFAULTS, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert f"| `{name}` |" in doc, f"{name} is not in docs/reference/environment.md's environment table"
    assert "`TORCH_NCCL_ASYNC_ERROR_HANDLING` | never" in doc
