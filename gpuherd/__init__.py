"""Shared, typed pieces of gpuherd that every part reads: config, CLI, contracts.

`supervisor/`, `worker/` and `dataset_cache/` may import from here; nothing here
imports from them, so the contracts cannot grow a dependency cycle.
"""

__version__ = "0.1.0"
