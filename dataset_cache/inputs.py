"""data.dataset (or a data.mix source) -> the files to read, in reading order.

A file, a directory (searched recursively, hidden entries skipped, files of
unknown formats ignored), a glob (`shards/*.parquet`, `**` recursive), or a
HuggingFace `save_to_disk` directory (its Arrow shards, in the order its
state.json lists them).

Each file carries the name it has in the cache key: its path relative to the
input's root (the directory, or the part of a glob before the first wildcard),
and "" for a single file. So renaming or moving the corpus keeps its cache,
while renaming a file inside it (which can reorder the documents) does not.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import orjson

from dataset_cache.readers import KNOWN_SUFFIXES, format_of
from gpuherd.config import is_glob
from gpuherd.errors import DatasetError

HF_STATE = "state.json"  # written by datasets' save_to_disk next to dataset_info.json
HF_DICT = "dataset_dict.json"


@dataclass(frozen=True)
class InputFile:
    path: Path
    name: str  # in the cache key
    fmt: str  # a readers.READER_VERSIONS key


def resolve_inputs(spec: str) -> list[InputFile]:
    if is_glob(spec):
        return _glob_inputs(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DatasetError(
            f"data.dataset path not found: {path} (use a file, directory or glob of {KNOWN_SUFFIXES} files, "
            "a HuggingFace save_to_disk directory, shakespeare or dummy)"
        )
    path = path.resolve()
    if path.is_file():
        fmt = format_of(path)
        if fmt is None:
            raise DatasetError(f"data.dataset {path} is not a supported file (use {KNOWN_SUFFIXES})")
        return [InputFile(path, "", fmt)]
    if not path.is_dir():
        raise DatasetError(f"data.dataset {path} is neither a regular file nor a directory")
    if (path / HF_STATE).is_file():
        return _hf_inputs(path)
    if (path / HF_DICT).is_file():
        raise DatasetError(
            f"data.dataset {path} is a HuggingFace DatasetDict: point it at one split's directory (e.g. {path / 'train'})"
        )
    inputs = _known(
        (p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)), path
    )
    if not inputs:
        raise DatasetError(f"data.dataset directory {path} holds no {KNOWN_SUFFIXES} files")
    return inputs


def _glob_inputs(pattern: str) -> list[InputFile]:
    pattern = os.path.abspath(Path(pattern).expanduser())  # lexical: matches stay under the root it names
    parts = Path(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if is_glob(part))
    root = Path(*parts[:fixed])
    inputs = _known((Path(p) for p in glob.glob(pattern, recursive=True)), root)
    if not inputs:
        raise DatasetError(f"data.dataset glob {pattern} matches no {KNOWN_SUFFIXES} file")
    return inputs


def _known(paths, root: Path) -> list[InputFile]:  # noqa: ANN001 (an iterable of Paths)
    found = []
    for path in paths:
        fmt = format_of(path)
        if fmt is not None and path.is_file():
            found.append(InputFile(path, path.relative_to(root).as_posix(), fmt))
    return sorted(found, key=lambda f: f.name)


def _hf_inputs(path: Path) -> list[InputFile]:
    state_file = path / HF_STATE
    try:
        state = orjson.loads(state_file.read_bytes())
        names = [str(entry["filename"]) for entry in state["_data_files"]]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise DatasetError(f"{state_file} is not a HuggingFace save_to_disk state file ({type(exc).__name__}: {exc})") from None
    if state.get("_indices_data_files"):  # datasets < 2.0 saved a select()/shuffle() as data + an indices file
        raise DatasetError(f"{path} holds an indices mapping; save it again with dataset.flatten_indices().save_to_disk()")
    inputs = []
    for name in names:
        shard = path / name
        if not shard.is_file():
            raise DatasetError(f"{state_file} lists {name}, which is missing from {path}")
        inputs.append(InputFile(shard, name, "hf-arrow"))
    if not inputs:
        raise DatasetError(f"{state_file} lists no data files")
    return inputs
