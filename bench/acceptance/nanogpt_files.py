"""Where karpathy/nanoGPT's files are: never part of this repository (MIT-licensed, and the point
is a training script gpuherd was not written for), so they travel with the checkout in an
ignored folder, `.nanogpt/` (or GPUHERD_NANOGPT_DIR), which `bash bench/gpu_acceptance.sh
--prepare SRC` fills from a nanoGPT checkout or git directory."""

from __future__ import annotations

import os
from pathlib import Path

from bench.launchers import ROOT

FILES = ("train.py", "model.py", "configurator.py")
DIR_VAR = "GPUHERD_NANOGPT_DIR"


def nanogpt_dir() -> Path:
    return Path(os.environ.get(DIR_VAR) or ROOT / ".nanogpt")


def missing_files() -> list[str]:
    return [name for name in FILES if not (nanogpt_dir() / name).is_file()]
