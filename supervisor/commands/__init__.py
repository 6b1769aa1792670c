"""Thin `python -m supervisor.commands.<name>` entry points: parse, call, map errors to exit codes."""
