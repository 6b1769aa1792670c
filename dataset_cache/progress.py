"""Build progress for long tokenizations: MB, tokens, tokens/s and ETA via loguru."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loguru import logger

from gpuherd.text import format_duration


@dataclass
class BuildProgress:
    label: str
    total_bytes: int  # raw text size: the ETA's denominator
    doc_limit: int = 0  # data.num_samples: the build stops early at this many documents
    every_seconds: float = 2.0
    text_bytes: int = 0
    tokens: int = 0
    documents: int = 0
    started: float = field(default_factory=time.perf_counter)
    _last_report: float = field(default_factory=time.perf_counter)

    def update(self, text_bytes: int, tokens: int, documents: int) -> None:
        self.text_bytes += text_bytes
        self.tokens += tokens
        self.documents += documents
        now = time.perf_counter()
        if now - self._last_report >= self.every_seconds:
            self._last_report = now
            logger.info(self.line())

    @property
    def fraction(self) -> float:
        by_bytes = self.text_bytes / self.total_bytes if self.total_bytes else 0.0
        by_docs = self.documents / self.doc_limit if self.doc_limit else 0.0
        return min(1.0, max(by_bytes, by_docs))

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def line(self) -> str:
        elapsed = max(self.elapsed, 1e-9)
        fraction = self.fraction
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("nan")
        eta_text = format_duration(eta) if eta == eta else "?"
        return (
            f"tokenizing {self.label}: {fraction:4.0%} | {self.text_bytes / 1e6:,.1f}/{self.total_bytes / 1e6:,.1f} MB"
            f" | {self.tokens:,} tokens | {self.tokens / elapsed:,.0f} tok/s | {self.text_bytes / 1e6 / elapsed:.1f} MB/s"
            f" | ETA {eta_text}"
        )
