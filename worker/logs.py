"""Loguru setup for one worker: the log-line contract of docs/reference/log-lines.md."""

from __future__ import annotations

import sys

from loguru import logger

from gpuherd.contract import WorkerIdentity


def setup_logging(identity: WorkerIdentity, level: str) -> None:
    """Supervised: `LEVEL | message` (the supervisor adds `GPU0:`). Standalone: the
    worker adds its own `GPU0:` / `CPU0:` prefix so the console looks the same."""
    logger.remove()
    prefix = "" if identity.supervised else f"{identity.tag}:"
    logger.add(sys.stderr, format=prefix + "{level} | {message}", level=level.upper(),
               colorize=False, backtrace=False, diagnose=False)
