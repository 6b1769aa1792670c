"""mkdocs hook (mkdocs.yml `hooks:`): the build fails when a generated reference table no longer
matches the code (scripts/reference_pages.py), so the site never shows a stale one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError

_GENERATOR = Path(__file__).with_name("reference_pages.py")


def on_pre_build(config, **kwargs) -> None:
    spec = importlib.util.spec_from_file_location("reference_pages", _GENERATOR)
    pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pages)
    behind = pages.stale()
    if behind:
        raise PluginError(f"stale generated reference: {', '.join(behind)}; run python {_GENERATOR.relative_to(pages.ROOT)}")
