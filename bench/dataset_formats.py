"""Build speed per input format against the raw tokenizer, and peak memory of a
build over a parquet set larger than any process should hold (used by
bench_dataset_cache.py).

Speed: the same documents as .txt files, one .jsonl.zst and one .parquet. In
each round every format's build (`prepare_cache` with N processes, from a fresh
cache directory: hashing, decompression, parquet decoding, fsync and the
verifying first open included) runs right after tiktoken's own
`encode_ordinary_batch` with N threads on the documents already in memory.
Reported: best against best, and the ratio within each pair.

Memory: a parquet set of the given size is built in a child process, which
reports its own peak RSS and the largest of its tokenizer processes.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

from bench.machine import ROOT

POOL_DOCUMENTS = 20_000  # distinct dummy documents (~10 MB); larger corpora cycle through them
TXT_DOCS_PER_FILE = 200
RSS_ROW_GROUP_ROWS = 10_000  # ~5 MB of text per row group, as a sane writer makes them
RSS_FILE_MB = 128


def corpus_documents(megabytes: float) -> list[str]:
    """English-like documents (the `dummy` generator), numbered so none repeats."""
    from dataset_cache.dummy import dummy_document

    pool = [dummy_document(i) for i in range(POOL_DOCUMENTS)]
    docs, size, i = [], 0, 0
    while size < megabytes * 1e6:
        doc = f"{i}. {pool[i % len(pool)]}"
        docs.append(doc)
        size += len(doc)
        i += 1
    return docs


def write_formats(docs: list[str], root: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    txt = root / "txt"
    txt.mkdir(parents=True)
    for n, start in enumerate(range(0, len(docs), TXT_DOCS_PER_FILE)):
        (txt / f"{n:06d}.txt").write_text("\n\n".join(docs[start:start + TXT_DOCS_PER_FILE]))
    zst = root / "corpus.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor(level=3).compress(b"".join(orjson.dumps({"text": d}) + b"\n" for d in docs)))
    parquet = root / "corpus.parquet"
    pq.write_table(pa.table({"text": docs}), parquet, row_group_size=RSS_ROW_GROUP_ROWS)
    return {"txt": txt, "jsonl.zst": zst, "parquet": parquet}


def format_rounds(docs: list[str], work: Path, rounds: int, workers: int) -> dict:
    """Seconds per round of each format's build, each right after a raw tokenizer run
    (paired: on a shared machine the load changes between rounds, rarely within a pair)."""
    from dataset_cache import load_tokenizer, prepare_cache
    from gpuherd.config import DataConfig

    inputs = write_formats(docs, work / "inputs")
    enc = load_tokenizer("gpt2")._encoding
    times: dict[str, list[float]] = {"raw": [], **{fmt: [] for fmt in inputs}}
    text_mb: dict[str, float] = {"raw": sum(len(d.encode()) for d in docs) / 1e6}
    paired: dict[str, list[float]] = {fmt: [] for fmt in inputs}
    for _ in range(rounds):
        for fmt, path in inputs.items():
            started = time.perf_counter()
            raw_tokens = sum(len(ids) + 1 for ids in enc.encode_ordinary_batch(docs, num_threads=workers))
            times["raw"].append(time.perf_counter() - started)
            cache_dir = work / "cache"
            shutil.rmtree(cache_dir, ignore_errors=True)  # cold: the raw-file hash memo goes too
            cfg = DataConfig(dataset=str(path), tokenizer="gpt2", context_length=1024, cache_dir=str(cache_dir))
            started = time.perf_counter()
            info = prepare_cache(cfg, workers=workers)
            times[fmt].append(time.perf_counter() - started)
            text_mb[fmt] = orjson.loads((info.path / "metadata.json").read_bytes())["dataset"]["text_bytes"] / 1e6
            paired[fmt].append((text_mb[fmt] / times[fmt][-1]) / (text_mb["raw"] / times["raw"][-1]))
    on_disk = {fmt: sum(f.stat().st_size for f in ([p] if p.is_file() else p.iterdir())) / 1e6 for fmt, p in inputs.items()}
    return {"times": times, "text_mb": text_mb, "disk_mb": on_disk, "raw_tokens": raw_tokens, "documents": len(docs),
            "paired_ratios": paired}


def write_parquet_set(root: Path, megabytes: float) -> tuple[int, float]:
    """`megabytes` of text as parquet files of RSS_FILE_MB, written row group by row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dataset_cache.dummy import dummy_document

    pool = [dummy_document(i) for i in range(RSS_ROW_GROUP_ROWS)]
    root.mkdir(parents=True)
    written, files, file_mb, writer, group = 0.0, 0, RSS_FILE_MB, None, 0
    while written < megabytes:
        if writer is None or file_mb >= RSS_FILE_MB:
            if writer is not None:
                writer.close()
            writer, file_mb = pq.ParquetWriter(root / f"part-{files:04d}.parquet", pa.schema([("text", pa.string())])), 0.0
            files += 1
        rows = [f"{group}.{i} {doc}" for i, doc in enumerate(pool)]
        writer.write_table(pa.table({"text": rows}), row_group_size=RSS_ROW_GROUP_ROWS)
        mb = sum(len(r) for r in rows) / 1e6
        written, file_mb, group = written + mb, file_mb + mb, group + 1
    writer.close()
    return files, written


# The builder's peak is VmHWM of its own address space: ru_maxrss would also carry
# the bench process's peak, which Linux hands on through the (v)fork + exec.
# Its tokenizer processes are plain forks, so RUSAGE_CHILDREN is theirs.
BUILDER = r"""
import json, re, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from dataset_cache import prepare_cache
from gpuherd.config import DataConfig
started = time.perf_counter()
info = prepare_cache(DataConfig(dataset=sys.argv[2], tokenizer="gpt2", context_length=1024, cache_dir=sys.argv[3]),
                     workers=int(sys.argv[4]))
hwm = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
print(json.dumps({"seconds": time.perf_counter() - started, "tokens": info.train_tokens + info.val_tokens,
                  "builder_kb": int(hwm.group(1)), "tokenizer_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def peak_rss(work: Path, megabytes: float, workers: int) -> dict:
    files, text_mb = write_parquet_set(work / "big", megabytes)
    disk_mb = sum(p.stat().st_size for p in (work / "big").iterdir()) / 1e6
    done = subprocess.run([sys.executable, "-c", BUILDER, str(ROOT), str(work / "big"), str(work / "big-cache"), str(workers)],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"peak-RSS build failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(work / "big", ignore_errors=True)
    shutil.rmtree(work / "big-cache", ignore_errors=True)
    return {"files": files, "text_mb": round(text_mb, 1), "disk_mb": round(disk_mb, 1), "workers": workers,
            "row_group_rows": RSS_ROW_GROUP_ROWS, "seconds": round(result["seconds"], 2), "tokens": result["tokens"],
            "builder_mb": round(result["builder_kb"] / 1024, 1), "tokenizer_mb": round(result["tokenizer_kb"] / 1024, 1)}


def render(formats: dict, rss: dict, workers: int) -> list[str]:
    best = {name: min(values) for name, values in formats["times"].items()}
    raw_mbps = formats["text_mb"]["raw"] / best["raw"]
    lines = [
        "## Input formats vs the raw tokenizer (best of the interleaved rounds)",
        "",
        f"{formats['documents']:,} English-like documents, {formats['text_mb']['raw']:.1f} MB of text, "
        f"{formats['raw_tokens']:,} GPT-2 tokens; {workers} threads for tiktoken, {workers} processes for gpuherd.",
        "",
        "| input | on disk | MB of text / s (best) | best vs best raw | paired ratios (median) | rounds (s) |",
        "|---|---:|---:|---:|---|---|",
        f"| tiktoken `encode_ordinary_batch`, text already in memory | - | {raw_mbps:.2f} | 1.00x | - | "
        f"{', '.join(f'{v:.2f}' for v in formats['times']['raw'])} |",
    ]
    for fmt in ("txt", "jsonl.zst", "parquet"):
        mbps = formats["text_mb"][fmt] / best[fmt]
        pairs = formats["paired_ratios"][fmt]
        lines.append(f"| gpuherd prepare_cache, .{fmt} | {formats['disk_mb'][fmt]:.1f} MB | {mbps:.2f} | "
                     f"{mbps / raw_mbps:.2f}x | {', '.join(f'{v:.2f}' for v in pairs)} ({statistics.median(pairs):.2f}x) | "
                     f"{', '.join(f'{v:.2f}' for v in formats['times'][fmt])} |")
    lines += [
        "",
        "Each build ran right after a raw tokenizer run; a paired ratio compares the two (throughput of the build / "
        "throughput of the raw run). gpuherd's side reads the files (zstd decompression, parquet decoding, JSON "
        "parsing) and hashes them for the key, writes and fsyncs the cache, and checksums it on the first open; "
        "the .txt files hold 200 documents each.",
        "",
        "## Peak memory of a build",
        "",
        f"{rss['text_mb']:,.0f} MB of text in {rss['files']} parquet files ({rss['disk_mb']:,.0f} MB on disk, row groups "
        f"of {rss['row_group_rows']:,} documents), GPT-2, {rss['workers']} processes: built in {rss['seconds']:.1f} s "
        f"({rss['text_mb'] / rss['seconds']:.1f} MB/s, {rss['tokens']:,} tokens). Peak RSS: builder "
        f"{rss['builder_mb']:.0f} MB, largest tokenizer process {rss['tokenizer_mb']:.0f} MB.",
        "",
    ]
    return lines
