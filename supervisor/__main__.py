"""`python -m supervisor` (what run_training.sh execs)."""

from supervisor.main import cli

cli()
