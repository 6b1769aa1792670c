"""Where the validation split starts: the last `val_fraction` of the tokens,
moved to the nearest document boundary when one is close, so held-out
documents are held out whole."""

from __future__ import annotations

import numpy as np

from gpuherd.errors import DatasetError


def split_index(doc_offsets: np.ndarray, total: int, val_fraction: float, context_length: int, dataset: str) -> int:
    """Number of training tokens; tokens [split, total) are the validation split."""
    need = context_length + 1  # one full window of inputs plus the shifted target
    target_val = int(round(total * val_fraction))
    if total - target_val < need or target_val < need:
        raise DatasetError(
            f"dataset {dataset} gives {total:,} tokens: too few for a train and a val split "
            f"(val_fraction {val_fraction}) of at least context_length+1 = {need:,} tokens each; "
            "use more text, a smaller data.context_length or another data.val_fraction"
        )
    target = total - target_val
    j = int(np.searchsorted(doc_offsets, target))
    candidates = [int(doc_offsets[i]) for i in (j - 1, j) if 0 <= i < len(doc_offsets)]
    best = min(candidates, key=lambda b: abs(b - target), default=target)
    close = abs(best - target) <= target_val // 2
    if close and best >= need and total - best >= need:
        return best
    return target
