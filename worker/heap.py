"""The interpreter's heap, kept cheap to collect: everything alive once the imports are done
(torch's and the trainer's modules, hundreds of thousands of objects) moves to the collector's
permanent generation, so a full collection walks only what training made since. A live
recovery collects the broken group's cycles while the survivors wait to rebuild it, and that
collection (and every automatic full one during training) walked the whole import graph:
1.2 s of a 2-core machine under load, a third of it after the freeze."""

from __future__ import annotations

import gc


def freeze_imports() -> None:
    """Collect the imports' garbage, then freeze what is left (once per process: a warm spare
    freezes after its warm-up, off a recovery's path, and its trainer start does not again)."""
    if gc.get_freeze_count():
        return
    gc.collect()
    gc.freeze()
