"""Remembered sha256 of big raw-text files, so a cache hit on a 50 GB corpus does
not re-read 50 GB on every start.

A remembered digest is trusted only while the file's inode, size, mtime and
ctime are all unchanged. ctime cannot be set from user space and moves on every
write, so even a tool that restores mtime (rsync, cp -p, touch -d) invalidates
it. `--verify-cache` ignores the memo and re-reads everything.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from dataset_cache.hashing import sha256_bytes, sha256_file
from gpuherd.files import write_bytes_atomic

MEMO_MIN_BYTES = 16 << 20  # smaller files hash in milliseconds; not worth a memo file


class HashMemo:
    def __init__(self, directory: Path | None, trust: bool = True) -> None:
        self.directory = directory
        self.trust = trust

    def sha256(self, path: Path) -> str:
        stat = path.stat()
        if self.directory is None or stat.st_size < MEMO_MIN_BYTES:
            return sha256_file(path)
        identity = {
            "path": str(path), "inode": stat.st_ino, "device": stat.st_dev, "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns,
        }
        memo_file = self.directory / f"{sha256_bytes(str(path).encode())[:24]}.json"
        if self.trust:
            try:
                remembered = orjson.loads(memo_file.read_bytes())
                if remembered.get("identity") == identity:
                    return str(remembered["sha256"])
            except (OSError, orjson.JSONDecodeError, KeyError, AttributeError):
                pass
        digest = sha256_file(path)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(memo_file, orjson.dumps({"identity": identity, "sha256": digest}))
        except OSError:  # a read-only cache dir only costs the re-hash next time
            pass
        return digest


NO_MEMO = HashMemo(None)


def memo_dir(cache_dir: Path) -> Path:
    return cache_dir / ".hashes"
