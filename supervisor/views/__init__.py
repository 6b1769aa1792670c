"""Viewers of a run's files: `gpuherd top` (live table) and `gpuherd report` (HTML + PNG).

They read `logs/<run-id>/` only (metrics.jsonl, summary.json, config.json,
supervisor.log, the worker log names) and never contact the supervisor or the
workers, so they work on a live run, a finished one, or a copy of its directory.
"""
