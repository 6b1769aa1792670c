"""Storage failures are found wherever a writer buried them, and said in one line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpuherd.exit_codes import ExitCode, describe
from gpuherd.storage import format_bytes, probe_errno, storage_errno, storage_message


class CheckpointException(Exception):  # torch.distributed.checkpoint's shape: {rank: (exception, traceback)}
    def __init__(self, failures: dict) -> None:
        super().__init__("CheckpointException ranks:" + ",".join(map(str, failures)))
        self.failures = failures


def _torch_style() -> RuntimeError:
    """What torch.save raises on a full disk: its own error, the OSError only as context."""
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 78766080 vs 78765968")  # noqa: B904
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize("exc, code", [
    (OSError(errno.EROFS, "Read-only file system"), errno.EROFS),
    (_torch_style(), errno.ENOSPC),
    (CheckpointException({1: (OSError(errno.EDQUOT, "Disk quota exceeded"), "tb")}), errno.EDQUOT),
    (RuntimeError("PytorchStreamWriter failed writing file data/3: [Errno 27] File too large"), errno.EFBIG),
    (OSError(errno.EACCES, "Permission denied"), None),
    (ValueError("a bug"), None),
])
def test_the_storage_errno_is_found_through_causes_contexts_and_rank_failures(exc, code):
    assert storage_errno(exc) == code


def test_a_probe_says_nothing_about_a_healthy_directory_and_leaves_nothing(tmp_path: Path):
    assert probe_errno(tmp_path) is None and list(tmp_path.iterdir()) == []


def test_the_message_names_the_directory_the_cause_and_the_numbers(tmp_path: Path):
    message = storage_message("checkpoint", tmp_path, errno.ENOSPC, 2_500_000_000)
    assert message.startswith(f"cannot save checkpoint to {tmp_path}: no space left on device (needs ~2.5 GB, ")
    assert message.endswith(" free)")
    assert format_bytes(897_000_000) == "897.0 MB" and format_bytes(512) == "512 bytes"


def test_storage_has_its_own_exit_code():
    assert int(ExitCode.STORAGE) == 7 and "disk full" in describe(7)
