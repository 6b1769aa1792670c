"""What a run trains on, in words: the mixture build summary and the worker's
start-up line (tokens per source, effective share, epochs the run will make)."""

from __future__ import annotations

from dataset_cache.cache import TokenCache
from dataset_cache.mixture import Mixture, MixtureSource


def mixture_lines(mixture: Mixture, built: list[bool] | None = None) -> list[str]:
    """One line per source, then how validation reads the mixture."""
    lines = []
    for index, source in enumerate(mixture.sources):
        state = "" if built is None else (", built" if built[index] else ", reused")
        lines.append(f"{source.spec} (cache {source.cache.key}{state}): {_share_text(source)}")
    return [*lines, _validation_text(mixture)]


def describe_data(data: TokenCache | Mixture, planned_tokens: int) -> str:
    """The start-up line; `planned_tokens`: windows x context the whole run will draw."""
    if isinstance(data, TokenCache):
        train = int(data.tokens("train").size)
        return (
            f"data: {data.meta['dataset']['name']} (cache {data.key}, {data.tokenizer}) | {train:,} train / "
            f"{int(data.tokens('val').size):,} val tokens | {_epochs(planned_tokens, train)} epochs in this run"
        )
    parts = [f"data: mixture {data.key} of {len(data.sources)} sources ({data.tokenizer})"]
    for source in data.sources:
        text = f"{source.spec}: {_share_text(source)}"
        if source.train_share > 0:
            text += f", {_epochs(planned_tokens * source.train_share, source.tokens('train'))} epochs in this run"
        parts.append(text)
    return " | ".join([*parts, _validation_text(data)])


def _share_text(source: MixtureSource) -> str:
    if source.role == "held_out":
        return f"held out, {source.tokens('val'):,} tokens, {source.val_share:.1%} of validation samples"
    return (f"{source.tokens('train'):,} train tokens, {source.train_share:.1%} of training samples "
            f"({source.role} {source.amount:g})")


def _validation_text(mixture: Mixture) -> str:
    if mixture.meta.get("held_out"):
        return "validation: the held_out sources only (training sources are read whole)"
    return "validation: each source's val split, at the training shares"


def _epochs(tokens: float, available: int) -> str:
    return f"{tokens / available:.2f}" if available else "?"
