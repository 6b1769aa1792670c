"""The async writer's way to the disk (worker/direct_sink.py): the same bytes and digest as an
ordinary write whatever the alignment of what it is given, the large aligned records sent
straight from their memory, and the file still the torch.save checkpoint that resume reads."""

from __future__ import annotations

import errno
import mmap
import os
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash

from gpuherd.checkpoint_manifest import file_digest, read_manifest
from worker import direct_sink
from worker.checkpoint_io import directly_to_disk, load_file, save_checkpoint_file
from worker.direct_sink import ALIGN, DirectSink
from worker.save_snapshot import SnapshotTaker, rebuild


def _pieces() -> list[memoryview]:
    """Writes as torch.save makes them: headers of odd sizes padded up to an aligned file offset,
    then a record's data, aligned in memory (with a tail) or not, one larger than the bounce
    buffer, some small; and records that follow without padding."""
    region, head = mmap.mmap(-1, 24 << 20), 20 << 20  # headers and padding come from `head` on
    region[:] = os.urandom(len(region))
    view = memoryview(region)
    records = [view[ALIGN * 4:ALIGN * 4 + direct_sink.BOUNCE + 3 * ALIGN + 17], view[7:7 + 2 * ALIGN + 1],
               view[ALIGN * 2500:ALIGN * 2501], view[5:6], view[ALIGN * 10:ALIGN * 10 + 5 * ALIGN],
               view[ALIGN * 3000:ALIGN * 3000 + 3 * ALIGN + 1]]
    pieces, offset = [], 0
    for i, record in enumerate(records):
        header = view[head:head + 30 + i]
        pad = (-(offset + len(header))) % ALIGN if i % 3 != 2 else 0  # every third record follows unpadded
        for piece in (header, view[head + 100:head + 100 + pad], record):
            if len(piece):
                pieces.append(piece)
                offset += len(piece)
    return pieces  # they hold the region


def _write(path: Path, pieces: list[memoryview]) -> DirectSink:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        sink = DirectSink(fd)
        for piece in pieces:
            # the file offset where a piece lands is aligned only now and then: pad to it sometimes
            assert sink.write(piece) == len(piece)
        sink.flush()
        sink.close()
    finally:
        os.close(fd)
    return sink


def _direct_allowed(where: Path) -> bool:
    fd = os.open(where / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        return direct_sink._set_direct(fd, True)
    finally:
        os.close(fd)


def test_the_file_holds_every_byte_once_and_the_digest_is_its_xxh3(tmp_path: Path):
    pieces = _pieces()
    sink = _write(tmp_path / "f", pieces)
    expected = b"".join(bytes(p) for p in pieces)
    assert (tmp_path / "f").read_bytes() == expected  # no padding left behind: the last block was cut back
    assert sink.digest().size == len(expected)
    assert sink.digest().hexdigest == xxhash.xxh3_128(expected).hexdigest() == file_digest(tmp_path / "f").hexdigest
    # the aligned records' whole blocks went straight from memory (where the filesystem allows)
    aligned = direct_sink.BOUNCE + 3 * ALIGN + 5 * ALIGN
    assert sink.direct_bytes == (aligned if _direct_allowed(tmp_path) else 0)


def test_a_filesystem_that_refuses_direct_writes_gets_the_same_bytes(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(direct_sink, "_set_direct", lambda fd, on: False)
    pieces = _pieces()
    sink = _write(tmp_path / "f", pieces)
    assert sink.direct_bytes == 0
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(p) for p in pieces)


def test_a_direct_write_refused_midway_goes_on_the_ordinary_way(tmp_path: Path, monkeypatch):
    """EINVAL from a direct write (an alignment this device does not take): the sink drops
    O_DIRECT and writes the rest, nothing lost or doubled."""
    monkeypatch.setattr(direct_sink, "_set_direct", lambda fd, on: on)  # pretend it was taken
    refused, real_write = [], os.write

    def write(fd: int, data) -> int:
        if not refused and len(data) >= 2 * ALIGN:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_sink.os, "write", write)
    pieces = _pieces()
    sink = _write(tmp_path / "f", pieces)
    monkeypatch.undo()
    assert refused and not sink.direct
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(p) for p in pieces)


def test_other_write_errors_are_raised(tmp_path: Path, monkeypatch):
    def full(fd: int, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_sink.os, "write", full)
    pieces = _pieces()
    with pytest.raises(OSError) as raised:
        _write(tmp_path / "f", pieces)
    assert raised.value.errno == errno.ENOSPC


def test_a_checkpoint_written_from_the_shared_buffer_is_the_one_resume_reads(tmp_path: Path):
    """The writer's whole path: the state copied into the buffer, rebuilt there, saved directly:
    torch.load (weights_only, mmap) reads the same tensors, the manifest vouches for the bytes,
    and the large tensors went to the disk straight from the buffer where the filesystem allows."""
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 7))
    moments = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
               for i, p in enumerate(model.parameters())}  # AdamW's, without importing what an optimizer does
    optimizer = {"state": moments, "param_groups": [{"lr": 0.1, "params": list(moments)}]}
    state = {"model": model.state_dict(), "optimizer": optimizer, "optimizer_format": "plain"}
    taker = SnapshotTaker(torch.device("cpu"), 16 << 20, 1 << 20)
    try:
        snapshot = taker.take({"meta": {"step": 3, "run_id": "r"}, "states": state})
        assert all(s.offset % ALIGN == 0 for s in snapshot.slots if s.nbytes >= ALIGN)
        built = rebuild(snapshot, taker.region.map)
        with directly_to_disk():
            save_checkpoint_file({"format": "gpuherd/full-v1", **built["states"], "meta": built["meta"]},
                                 tmp_path / "step_0000003.pt")
        del built
    finally:
        taker.close()
    path = tmp_path / "step_0000003.pt"
    back = load_file(path)
    for name, tensor in state["model"].items():
        assert torch.equal(back["model"][name], tensor), name
    for key, moments in state["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(back["optimizer"]["state"][key][name], value), (key, name)
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"] and back["meta"]["step"] == 3
    assert read_manifest(path).files[path.name] == file_digest(path)
    with zipfile.ZipFile(path) as archive:
        alignment = next(i for i in archive.infolist() if i.filename.endswith("/.storage_alignment"))
        big = next(i for i in archive.infolist() if i.file_size >= 200 * 300 * 4)
    assert _record(path, alignment)[1] == str(ALIGN).encode()
    assert _record(path, big)[0] % ALIGN == 0  # its data starts block-aligned in the file


def _record(path: Path, info: zipfile.ZipInfo) -> tuple[int, bytes]:
    """Where a stored record's data starts, and its bytes (zipfile's own read would check the
    CRC32s that torch.save was told to leave out)."""
    with open(path, "rb") as handle:
        handle.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(handle.read(2), "little"), int.from_bytes(handle.read(2), "little")
        start = info.header_offset + 30 + name_len + extra_len
        handle.seek(start)
        return start, handle.read(info.file_size)
