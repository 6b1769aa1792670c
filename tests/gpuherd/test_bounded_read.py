"""read_bounded: what it refuses without blocking or reading forever, and what it reads."""

from __future__ import annotations

import os

import pytest

from gpuherd.bounded_read import NotAFile, TooLarge, read_bounded


def test_a_regular_file_is_read_up_to_the_limit_and_refused_past_it(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert read_bounded(path, 10) == b"x" * 10
    with pytest.raises(TooLarge):
        read_bounded(path, 9)


def test_a_named_pipe_nobody_writes_is_refused_at_once_unless_pipes_are_asked_for(tmp_path):
    fifo = tmp_path / "summary.json"
    os.mkfifo(fifo)
    with pytest.raises(NotAFile, match="^a named pipe$"):
        read_bounded(fifo, 100)  # O_NONBLOCK: no wait for a writer that never comes


def test_a_pipe_is_read_to_its_end_when_asked_for():
    read_end, write_end = os.pipe()
    os.write(write_end, b'{"a": 1}')
    os.close(write_end)
    try:
        assert read_bounded(f"/proc/self/fd/{read_end}", 100, pipes=True) == b'{"a": 1}'
    finally:
        os.close(read_end)


@pytest.mark.parametrize("path, words", [("/dev/zero", "a character device"), ("/", "a directory")])
def test_a_device_or_a_directory_is_refused_before_it_is_read(path, words):
    with pytest.raises(NotAFile, match=f"^{words}$"):
        read_bounded(path, 100, pipes=True)
