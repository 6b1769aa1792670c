"""What a result was measured on: date, commit, CPU, GPU, driver, torch."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _gpus() -> tuple[str, str]:
    """(GPU names, driver) through the GPU adapter, or ("none", "n/a") without NVML."""
    from supervisor.gpus import NvmlUnavailable, nvml

    try:
        with nvml.session() as pynvml:
            names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                     for i in range(pynvml.nvmlDeviceGetCount())]
            return (", ".join(names) or "none"), pynvml.nvmlSystemGetDriverVersion()
    except NvmlUnavailable:
        return "none", "n/a"


def describe() -> dict[str, str]:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    gpus, driver = _gpus()
    dirty = " (uncommitted changes)" if _git("status", "--porcelain") else ""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": (_git("rev-parse", "--short", "HEAD") or "unknown") + dirty,
        "cpu": f"{_cpu_model()} ({os.cpu_count()} cores)",
        "gpu": gpus,
        "driver": driver,
        "python": platform.python_version(),
        "torch": torch_version,
    }
